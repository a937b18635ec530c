#include <ferry/core/error.hpp>
#include <ferry/store/root.hpp>

#include <fcntl.h>
#include <fmt/format.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <linux/magic.h>
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

namespace {
// File systems whose "regular files" are kernel interfaces, not data: sizes that lie (0 or 4096),
// reads with side effects or that block. Never served.
bool pseudo_fs(long type) {
  switch (static_cast<unsigned long>(type)) {
    case PROC_SUPER_MAGIC: case SYSFS_MAGIC: case DEBUGFS_MAGIC: case TRACEFS_MAGIC: case SECURITYFS_MAGIC:
    case CGROUP_SUPER_MAGIC: case CGROUP2_SUPER_MAGIC: case DEVPTS_SUPER_MAGIC: case BPF_FS_MAGIC: case PSTOREFS_MAGIC:
    case EFIVARFS_MAGIC: case 0x62656570 /* configfs */: case 0x6e736673 /* nsfs */:
      return true;
    default:
      return false;
  }
}
}  // namespace

const char* root_dir::kind_of(const struct ::stat& st) noexcept {
  switch (st.st_mode & S_IFMT) {
    case S_IFREG: return "regular file";
    case S_IFDIR: return "directory";
    case S_IFIFO: return "FIFO";
    case S_IFSOCK: return "socket";
    case S_IFCHR: return "character device";
    case S_IFBLK: return "block device";
    case S_IFLNK: return "symbolic link";
    default: return "special file";
  }
}

int root_dir::open_regular(std::string_view rel, int flags, struct ::stat* out) const {
  int probe = open(rel, O_PATH);
  struct ::stat st{};
  struct ::statfs fs{};
  std::string res = fmt::format("'{}' under {}", printable(rel), path_);
  auto refuse = [&](const std::string& why) {
    ::close(probe);
    fail(errc::invalid_argument, "store.open", res, why);
  };
  if (::fstat(probe, &st) != 0) {
    int e = errno;
    ::close(probe);
    fail_errno(e, "store.open", res);
  }
  if (!S_ISREG(st.st_mode)) refuse(fmt::format("is a {}; only regular files are served", kind_of(st)));
  if (::fstatfs(probe, &fs) == 0 && pseudo_fs(fs.f_type))
    refuse(fmt::format("is on a kernel pseudo file system (type {:#x}); only files on disk file systems are served",
                       static_cast<unsigned long>(fs.f_type)));
  ::close(probe);
  int fd = open(rel, (flags & ~O_CREAT) | O_NONBLOCK | O_NOCTTY);
  struct ::stat st2{};
  if (::fstat(fd, &st2) != 0 || st2.st_dev != st.st_dev || st2.st_ino != st.st_ino || !S_ISREG(st2.st_mode)) {
    ::close(fd);
    fail(errc::busy, "store.open", res, "was replaced while being opened; try again");
  }
  // Regular files ignore O_NONBLOCK for I/O; cleared anyway so that nothing depends on that.
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  if (out) *out = st2;
  return fd;
}

}  // namespace ferry::store
