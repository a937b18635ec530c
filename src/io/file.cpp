#include <ferry/core/error.hpp>
#include <ferry/io/file.hpp>

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

namespace ferry {

std::shared_ptr<file> file::open(const std::string& path, open_mode mode) {
  int flags = mode == open_mode::read ? O_RDONLY : O_RDWR;
  if (mode == open_mode::create) flags |= O_CREAT | O_TRUNC;
  auto f = std::shared_ptr<file>(new file());
  f->path_ = path;
  f->writable_ = mode != open_mode::read;
  f->fd_ = ::open(path.c_str(), flags | O_CLOEXEC, 0644);
  if (f->fd_ < 0)
    fail_errno(errno, "file.open", path,
               mode == open_mode::read ? "cannot open for reading" : mode == open_mode::create ? "cannot create" : "cannot open for writing");
  struct stat st{};
  if (::fstat(f->fd_, &st) != 0) fail_errno(errno, "file.open", path, "fstat failed");
  if (S_ISDIR(st.st_mode)) fail(errc::invalid_argument, "file.open", path, "is a directory");
  // A second descriptor for O_DIRECT: file systems that refuse it (tmpfs, some overlays) say EINVAL.
  f->dfd_ = ::open(path.c_str(), (flags & ~(O_CREAT | O_TRUNC)) | O_DIRECT | O_CLOEXEC);
  struct statx sx{};
  if (f->dfd_ >= 0 && ::statx(f->fd_, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN) &&
      sx.stx_dio_offset_align) {
    // Use the stricter of the offset and memory alignment, at least 512.
    f->align_ = std::max<std::uint32_t>({sx.stx_dio_offset_align, sx.stx_dio_mem_align, 512u});
  }
  return f;
}

file::~file() {
  if (dfd_ >= 0) ::close(dfd_);
  if (fd_ >= 0) ::close(fd_);
}

std::uint64_t file::size() const {
  struct stat st{};
  if (::fstat(fd_, &st) != 0) fail_errno(errno, "file.size", path_);
  return static_cast<std::uint64_t>(st.st_size);
}

void file::resize(std::uint64_t bytes) {
  if (::ftruncate(fd_, static_cast<off_t>(bytes)) != 0)
    fail_errno(errno, "file.resize", path_, fmt::format("cannot set the size to {}", bytes));
}

void file::sync() {
  if (::fsync(fd_) != 0) fail_errno(errno, "file.sync", path_);
}

}  // namespace ferry
