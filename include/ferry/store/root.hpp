#pragma once
// The directory a storage server exports. Every client path is resolved beneath it with
// openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS): no "..", no absolute paths, no symlink that
// leads out — enforced by the kernel at every step, not by string checks alone (which race).
#include <ferry/core/export.hpp>

#include <string>
#include <string_view>
#include <sys/types.h>

namespace ferry::store {

class FERRY_API root_dir {
 public:
  // Throws not_found / permission_denied / invalid_argument (not a directory) naming the path.
  explicit root_dir(const std::string& path);
  ~root_dir();
  root_dir(const root_dir&) = delete;
  root_dir& operator=(const root_dir&) = delete;

  const std::string& path() const noexcept { return path_; }
  // Opens `rel` (relative, '/'-separated) beneath the root; returns an fd the caller owns.
  // Throws permission_denied for any attempt to leave the root, invalid_argument for malformed
  // paths (empty, NUL byte, '..' component), and the errno error otherwise — each naming the path.
  int open(std::string_view rel, int flags, mode_t mode = 0644) const;
  // Checks a client path without opening it (same rules as open's string checks).
  static void check(std::string_view rel);

 private:
  std::string path_;
  int fd_ = -1;
};

}  // namespace ferry::store
