#pragma once
// The directory a storage server exports. Every client path is resolved beneath it with
// openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS): no "..", no absolute paths, no symlink that
// leads out — enforced by the kernel at every step, not by string checks alone (which race).
#include <ferry/core/export.hpp>

#include <string>
#include <string_view>
#include <sys/stat.h>
#include <sys/types.h>

namespace ferry::store {

class FERRY_API root_dir {
 public:
  // Throws not_found / permission_denied / invalid_argument (not a directory) naming the path.
  explicit root_dir(const std::string& path);
  // The same directory through `fd` (a descriptor of it, which this object owns from now on).
  root_dir(int fd, std::string path) : path_(std::move(path)), fd_(fd) {}
  ~root_dir();
  root_dir(const root_dir&) = delete;
  root_dir& operator=(const root_dir&) = delete;

  const std::string& path() const noexcept { return path_; }
  // Opens `rel` (relative, '/'-separated) beneath the root; returns an fd the caller owns.
  // Throws permission_denied for any attempt to leave the root, invalid_argument for malformed
  // paths (empty, NUL byte, '..' component), and the errno error otherwise — each naming the path.
  int open(std::string_view rel, int flags, mode_t mode = 0644) const;
  // Opens an existing regular file beneath the root for reading (O_RDONLY) or writing in place,
  // without ever blocking or touching anything that is not a plain file: the path is first opened
  // O_PATH (which opens nothing) and refused unless it is a regular file on a disk file system (a
  // FIFO, socket, device node, directory or a file of procfs/sysfs and the like is refused with an
  // error naming the path and its type); only then is it opened for I/O, O_NONBLOCK, and checked
  // to be the same inode. `st` (if given) gets its fstat.
  int open_regular(std::string_view rel, int flags, struct ::stat* st = nullptr) const;
  // The type of what `st` describes, for messages ("FIFO", "socket", "directory", ...).
  static const char* kind_of(const struct ::stat& st) noexcept;
  // The root directory's O_PATH descriptor (for *at() calls relative to it).
  int fd() const noexcept { return fd_; }
  // Checks a client path without opening it (same rules as open's string checks).
  static void check(std::string_view rel);

 private:
  std::string path_;
  int fd_ = -1;
};

}  // namespace ferry::store
