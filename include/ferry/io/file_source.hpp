#pragma once
// Files that live elsewhere, named by a URI ("ferry://host:port/path"). The io layer knows them only
// through this interface: the layer that implements a scheme (store, for ferry://) registers an
// opener, and from then on file::open, file_engine batches and the synchronous helpers treat such
// a file like a local one -- same requests, same per-request results, deadlines and errors.
#include <ferry/core/error.hpp>
#include <ferry/core/export.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>

namespace ferry {

enum class open_mode;

class FERRY_API file_source {
 public:
  virtual ~file_source();
  virtual std::uint64_t size() = 0;
  virtual void sync() {}
  // How its data has been moving, for a person to read (a summary line): the transport and the route.
  virtual std::string describe() { return {}; }
  // Starts moving [offset, offset+bytes) from the file into `mem` (or from `mem` into the file when
  // `write`); `mem` may be any memory ferry knows. `done(bytes, err)` runs exactly once, on any
  // thread, with the bytes moved (short at end of file) or the error; it runs no later than shortly
  // after `until` (the source's own deadline handling), so a batch can always be waited for.
  using completion = std::function<void(std::uint64_t bytes, const error* err)>;
  virtual void start(bool write, std::uint64_t offset, void* mem, std::uint64_t bytes,
                     std::chrono::steady_clock::time_point until, completion done) = 0;
};

using file_opener = std::function<std::shared_ptr<file_source>(const std::string& uri, open_mode mode)>;

// Keeps an opener registered; unregisters it when destroyed.
class FERRY_API scheme_registration {
 public:
  scheme_registration() = default;
  scheme_registration(scheme_registration&& o) noexcept : id_(std::exchange(o.id_, 0)) {}
  scheme_registration& operator=(scheme_registration&& o) noexcept;
  ~scheme_registration();

 private:
  friend FERRY_API scheme_registration register_file_scheme(const std::string&, file_opener);
  std::uint64_t id_ = 0;
};

// Opens "scheme://..." paths with `open` while the handle lives. When a scheme is registered twice
// (two runtimes), the newest live registration serves it.
FERRY_API scheme_registration register_file_scheme(const std::string& scheme, file_opener open);

// A URI as messages show it: without user:password@ and with its query cut ("?..."), since either
// may carry a secret (a password, a signature).
FERRY_API std::string uri_for_messages(const std::string& uri);

// The opener for `path` ("scheme://..."), or null when the path has no scheme; throws not_supported
// naming the path when the scheme is not registered.
FERRY_API file_opener find_file_scheme(const std::string& path);

}  // namespace ferry
