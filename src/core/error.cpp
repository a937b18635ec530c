#include <ferry/core/error.hpp>

#include <fmt/format.h>

#include <cerrno>
#include <cstring>

namespace ferry {

std::string_view to_string(errc c) noexcept {
  switch (c) {
    case errc::invalid_argument: return "invalid_argument";
    case errc::out_of_range: return "out_of_range";
    case errc::not_found: return "not_found";
    case errc::permission_denied: return "permission_denied";
    case errc::out_of_memory: return "out_of_memory";
    case errc::no_space: return "no_space";
    case errc::bad_address: return "bad_address";
    case errc::busy: return "busy";
    case errc::unavailable: return "unavailable";
    case errc::not_supported: return "not_supported";
    case errc::timeout: return "timeout";
    case errc::cancelled: return "cancelled";
    case errc::io_error: return "io_error";
    case errc::device_error: return "device_error";
    case errc::network_error: return "network_error";
    case errc::protocol_error: return "protocol_error";
    case errc::internal: return "internal";
  }
  return "unknown";
}

std::string format_error(const error_info& i, bool with_code) {
  std::string s = i.op.empty() ? std::string("ferry") : i.op;
  if (!i.resource.empty()) s += " " + i.resource;
  s += ": ";
  s += i.detail.empty() ? std::string(to_string(i.code)) : i.detail;
  if (!i.cause.empty()) s += ": " + i.cause;
  if (!with_code) return s;
  s += " [";
  s += to_string(i.code);
  s += "]";
  return s;
}

error::error(error_info info) : std::runtime_error(format_error(info)), info_(std::move(info)) {}

error::error(errc code, std::string op, std::string resource, std::string detail, std::string cause,
             std::source_location where)
    : error(error_info{code, std::move(op), std::move(resource), std::move(detail), std::move(cause), 0, 0, where}) {}

error error::with_context(std::string_view context) const {
  error_info i = info_;
  i.detail = fmt::format("{}: {}", context, i.detail);
  return error(std::move(i));
}

void fail(errc code, std::string op, std::string resource, std::string detail, std::source_location where) {
  throw error(error_info{code, std::move(op), std::move(resource), std::move(detail), {}, 0, 0, where});
}

errc errc_from_errno(int err) noexcept {
  switch (err) {
    case ENOENT: case ENODEV: case ENXIO: return errc::not_found;
    case EACCES: case EPERM: case EROFS: return errc::permission_denied;
    case ENOMEM: return errc::out_of_memory;
    case ENOSPC: case EDQUOT: return errc::no_space;
    case EFAULT: return errc::bad_address;
    case EBUSY: case EEXIST: case ETXTBSY: return errc::busy;
    case ENOSYS: case EOPNOTSUPP: case ENOTTY: return errc::not_supported;
    case ETIMEDOUT: case ETIME: return errc::timeout;
    case ECANCELED: case EINTR: return errc::cancelled;
    case EINVAL: case ENAMETOOLONG: case ELOOP: case ENOTDIR: case EISDIR: return errc::invalid_argument;
    case EFBIG: case EOVERFLOW: case ERANGE: return errc::out_of_range;
    case ECONNREFUSED: case ECONNRESET: case EHOSTUNREACH: case ENETUNREACH: case EPIPE: return errc::network_error;
    default: return errc::io_error;
  }
}

int errno_from_errc(errc c) noexcept {
  switch (c) {
    case errc::invalid_argument: return EINVAL;
    case errc::out_of_range: return ERANGE;
    case errc::not_found: return ENOENT;
    case errc::permission_denied: return EACCES;
    case errc::out_of_memory: return ENOMEM;
    case errc::no_space: return ENOSPC;
    case errc::bad_address: return EFAULT;
    case errc::busy: return EBUSY;
    case errc::unavailable: return ENODEV;
    case errc::not_supported: return EOPNOTSUPP;
    case errc::timeout: return ETIMEDOUT;
    case errc::cancelled: return ECANCELED;
    case errc::network_error: return ECONNRESET;
    case errc::protocol_error: return EPROTO;
    case errc::io_error: case errc::device_error: case errc::internal: return EIO;
  }
  return EIO;
}

std::string_view errno_name(int err) noexcept {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 32))
  if (const char* n = strerrorname_np(err)) return n;
#endif
  return "E?";
}

std::string describe_errno(int err) {
  return fmt::format("{} (errno {} {})", std::strerror(err), err, errno_name(err));
}

void fail_errno(int err, std::string op, std::string resource, std::string detail, std::source_location where) {
  error_info i{errc_from_errno(err), std::move(op), std::move(resource), std::move(detail), describe_errno(err), err, 0,
               where};
  if (i.detail.empty()) i.detail = std::string(to_string(i.code));
  throw error(std::move(i));
}

std::string printable(std::string_view s, std::size_t limit) {
  std::string out;
  for (unsigned char c : s) {
    if (out.size() >= limit) {
      out += "...";
      break;
    }
    if (c < 0x20 || c >= 0x7f) out += fmt::format("\\x{:02x}", c);
    else out += static_cast<char>(c);
  }
  return out;
}

std::string describe_range(std::uintptr_t p, std::size_t bytes) { return fmt::format("{:#x}+{}", p, bytes); }
std::string describe_range(const void* p, std::size_t bytes) {
  return describe_range(reinterpret_cast<std::uintptr_t>(p), bytes);
}

}  // namespace ferry
