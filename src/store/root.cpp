#include <ferry/core/error.hpp>
#include <ferry/store/root.hpp>

#include <fcntl.h>
#include <fmt/format.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>

namespace ferry::store {

root_dir::root_dir(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (fd_ < 0) fail_errno(errno, "store.root", path, "cannot open the root directory");
}

root_dir::~root_dir() {
  if (fd_ >= 0) ::close(fd_);
}

void root_dir::check(std::string_view rel) {
  std::string res = fmt::format("'{}'", printable(rel));
  if (rel.empty()) fail(errc::invalid_argument, "store.path", res, "empty path");
  if (rel.find('\0') != std::string_view::npos) fail(errc::invalid_argument, "store.path", res, "contains a NUL byte");
  if (rel.front() == '/') fail(errc::permission_denied, "store.path", res, "absolute paths are not allowed (paths are relative to the root)");
  std::size_t start = 0;
  while (start <= rel.size()) {
    std::size_t end = rel.find('/', start);
    if (end == std::string_view::npos) end = rel.size();
    if (rel.substr(start, end - start) == "..") fail(errc::permission_denied, "store.path", res, "'..' is not allowed");
    start = end + 1;
  }
}

int root_dir::open(std::string_view rel, int flags, mode_t mode) const {
  check(rel);
  std::string p(rel);
  open_how how{};
  how.flags = static_cast<std::uint64_t>(flags | O_CLOEXEC);
  how.mode = (flags & O_CREAT) ? mode : 0;
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS;
  long fd = ::syscall(SYS_openat2, fd_, p.c_str(), &how, sizeof how);
  if (fd >= 0) return static_cast<int>(fd);
  int e = errno;
  std::string res = fmt::format("'{}' under {}", printable(p), path_);
  if (e == EXDEV) fail(errc::permission_denied, "store.open", res, "the path leads outside the root (a symlink?)");
  if (e == ENOSYS) fail(errc::not_supported, "store.open", res, "openat2 is not available (Linux 5.6+ needed to confine paths)");
  fail_errno(e, "store.open", res);
}

}  // namespace ferry::store
