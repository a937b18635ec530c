#pragma once
// ferry's one error model: every failing call throws ferry::error.
//
// An error carries what a user needs to act on it without a debugger:
//   - code:     a small portable category (errc) to branch on;
//   - op:       the operation that failed ("device.map", "settings.parse", "cuda.load");
//   - resource: what it failed on (a path, "sim:0", "va=0x7f..+2097152", a peer);
//   - detail:   what was wrong, in words;
//   - cause:    the underlying system/CUDA/UCX message with its original code, kept verbatim.
// what() reads: "<op> <resource>: <detail>: <cause> [<code>]".
// Asynchronous work (streams, transfer requests) reports the same type as a value
// (std::optional<error>) instead of throwing, so one failed request does not hide the others.
// See docs/design/errors.md for the rationale.
#include <ferry/core/export.hpp>

#include <cstddef>
#include <cstdint>
#include <source_location>
#include <stdexcept>
#include <string>
#include <string_view>

namespace ferry {

enum class errc {
  invalid_argument,   // the caller passed something malformed (bad size, bad setting value)
  out_of_range,       // an index/offset/length outside what exists
  not_found,          // a named thing does not exist (file, device, setting)
  permission_denied,  // EACCES/EPERM and friends
  out_of_memory,      // host or device memory exhausted, capacity limit reached
  no_space,           // a file system is full or over quota (ENOSPC, EDQUOT)
  bad_address,        // pointer/VA not mapped, not accessible, not owned
  busy,               // resource in use (mapped range, pending work)
  unavailable,        // a feature/backend/driver is absent on this machine
  not_supported,      // present but cannot do this operation
  timeout,            // a deadline expired
  cancelled,          // cancelled by the user
  io_error,           // file system / disk error
  device_error,       // accelerator reported a failure (CUDA error)
  network_error,      // transport/peer failure (UCX)
  protocol_error,     // malformed or unexpected message
  internal,           // a ferry bug: an invariant did not hold
};

// Stable lower-case name of a code, e.g. "out_of_memory".
FERRY_API std::string_view to_string(errc c) noexcept;

struct error_info {
  errc code = errc::internal;
  std::string op;
  std::string resource;
  std::string detail;
  std::string cause;
  int sys_errno = 0;       // errno when the cause is a system call, else 0
  long backend_code = 0;   // CUresult / ucs_status_t / cuFile code when the cause is a backend, else 0
  std::source_location where = std::source_location::current();
};

class FERRY_API error : public std::runtime_error {
 public:
  explicit error(error_info info);
  error(errc code, std::string op, std::string resource, std::string detail, std::string cause = {},
        std::source_location where = std::source_location::current());

  errc code() const noexcept { return info_.code; }
  const std::string& op() const noexcept { return info_.op; }
  const std::string& resource() const noexcept { return info_.resource; }
  const std::string& detail() const noexcept { return info_.detail; }
  const std::string& cause() const noexcept { return info_.cause; }
  int sys_errno() const noexcept { return info_.sys_errno; }
  long backend_code() const noexcept { return info_.backend_code; }
  const std::source_location& where() const noexcept { return info_.where; }
  const error_info& info() const noexcept { return info_; }

  // Same error, with context prepended to the detail ("while loading shard 3: ...").
  error with_context(std::string_view context) const;

 private:
  error_info info_;
};

// Formats an error_info the way error::what() does; without `with_code`, leaving out the trailing
// " [<code>]" (for a message whose code travels beside it).
FERRY_API std::string format_error(const error_info& info, bool with_code = true);

// Throws ferry::error. Callers pass the operation and resource; the source location is captured.
[[noreturn]] FERRY_API void fail(errc code, std::string op, std::string resource, std::string detail,
                                 std::source_location where = std::source_location::current());

// Throws ferry::error for a failed system call: the code is derived from err (ENOENT -> not_found,
// EACCES -> permission_denied, ...) and the cause reads "<strerror> (errno <n> <NAME>)".
[[noreturn]] FERRY_API void fail_errno(int err, std::string op, std::string resource, std::string detail = {},
                                       std::source_location where = std::source_location::current());

// Throws invalid_argument unless cond holds. For cheap checks of caller input.
inline void expects(bool cond, std::string_view op, std::string_view resource, std::string_view detail,
                    std::source_location where = std::source_location::current()) {
  if (!cond) [[unlikely]]
    fail(errc::invalid_argument, std::string(op), std::string(resource), std::string(detail), where);
}

// The errno that best stands for a code (to carry a ferry error across the wire): EACCES for
// permission_denied, ENOENT for not_found, ...
FERRY_API int errno_from_errc(errc c) noexcept;
// Maps an errno value to the portable code.
FERRY_API errc errc_from_errno(int err) noexcept;
// "ENOENT" for 2, or "E?" when unknown.
FERRY_API std::string_view errno_name(int err) noexcept;
// "<strerror> (errno <n> <NAME>)".
FERRY_API std::string describe_errno(int err);

// A peer- or user-supplied string made safe for an error message: control bytes and bytes >= 0x7f
// become \xNN (a NUL would otherwise cut what() short), and it is cut at `limit` characters.
FERRY_API std::string printable(std::string_view s, std::size_t limit = 200);

// Formats a pointer/range the same way everywhere: "0x7f00001000+4096".
FERRY_API std::string describe_range(const void* p, std::size_t bytes);
FERRY_API std::string describe_range(std::uintptr_t p, std::size_t bytes);

}  // namespace ferry
