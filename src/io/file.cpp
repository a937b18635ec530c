#include <ferry/core/error.hpp>
#include <ferry/io/file.hpp>

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <mutex>
#include <vector>

namespace ferry {

namespace {
// The O_DIRECT descriptor and its alignment, for a file open as `fd` (through `how`: a path, or
// the descriptor's /proc link). File systems that refuse O_DIRECT (tmpfs, some overlays) say EINVAL.
void open_direct(const std::string& how, int flags, int fd, int& dfd, std::uint32_t& align) {
  dfd = ::open(how.c_str(), flags | O_DIRECT | O_CLOEXEC);
  struct statx sx{};
  if (dfd >= 0 && ::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN) &&
      sx.stx_dio_offset_align) {
    // Use the stricter of the offset and memory alignment, at least 512.
    align = std::max<std::uint32_t>({sx.stx_dio_offset_align, sx.stx_dio_mem_align, 512u});
  }
}
}  // namespace

file::file() {
  static std::atomic<std::uint64_t> next{1};
  id_ = next.fetch_add(1, std::memory_order_relaxed);
}

std::shared_ptr<file> file::over(std::shared_ptr<file_source> source, std::string name, bool writable) {
  if (!source) fail(errc::invalid_argument, "file.over", name, "no source");
  auto f = std::shared_ptr<file>(new file());
  f->path_ = std::move(name);
  f->writable_ = writable;
  f->source_ = std::move(source);
  return f;
}

std::shared_ptr<file> file::open(const std::string& path, open_mode mode) {
  if (auto opener = find_file_scheme(path)) {
    auto source = opener(path, mode);
    if (!source) fail(errc::internal, "file.open", path, "the scheme's opener returned nothing");
    if (mode == open_mode::read)
      if (int fd = source->take_descriptor(); fd >= 0) {
        auto f = adopt(fd, path, false, true);
        f->lent_ = true;
        return f;
      }
    return over(std::move(source), path, mode != open_mode::read);
  }
  int flags = mode == open_mode::read ? O_RDONLY : O_RDWR;
  if (mode == open_mode::create) flags |= O_CREAT | O_TRUNC;
  auto f = std::shared_ptr<file>(new file());
  f->path_ = path;
  f->writable_ = mode != open_mode::read;
  // O_NONBLOCK: opening a FIFO or a device must not wait for a peer; only regular files are kept,
  // and those then do blocking I/O as usual.
  f->fd_ = ::open(path.c_str(), flags | O_CLOEXEC | O_NONBLOCK, 0644);
  if (f->fd_ < 0)
    fail_errno(errno, "file.open", path,
               mode == open_mode::read ? "cannot open for reading" : mode == open_mode::create ? "cannot create" : "cannot open for writing");
  struct stat st{};
  if (::fstat(f->fd_, &st) != 0) fail_errno(errno, "file.open", path, "fstat failed");
  if (S_ISDIR(st.st_mode)) fail(errc::invalid_argument, "file.open", path, "is a directory");
  if (!S_ISREG(st.st_mode))
    fail(errc::invalid_argument, "file.open", path, "not a regular file (a FIFO, socket or device): ferry reads and writes regular files only");
  if (::fcntl(f->fd_, F_SETFL, ::fcntl(f->fd_, F_GETFL) & ~O_NONBLOCK) != 0) fail_errno(errno, "file.open", path, "fcntl(F_SETFL) failed");
  // A second descriptor for O_DIRECT.
  open_direct(path, flags & ~(O_CREAT | O_TRUNC), f->fd_, f->dfd_, f->align_);
  return f;
}


std::shared_ptr<file> file::adopt(int fd, std::string path, bool writable, bool direct) {
  auto f = std::shared_ptr<file>(new file());
  f->fd_ = fd;
  f->path_ = std::move(path);
  f->writable_ = writable;
  struct stat st{};
  if (::fstat(fd, &st) != 0) fail_errno(errno, "file.adopt", f->path_, "fstat failed");
  if (!S_ISREG(st.st_mode)) fail(errc::invalid_argument, "file.adopt", f->path_, "not a regular file");
  if (direct) open_direct(fmt::format("/proc/self/fd/{}", fd), writable ? O_RDWR : O_RDONLY, fd, f->dfd_, f->align_);
  return f;
}

std::string file::describe() const {
  if (source_) return source_->describe();
  return lent_ ? "the file itself, its descriptor lent by the server on this host (read as a local file)" : "a local file";
}

std::shared_ptr<file> file::borrow(int fd, std::string path, bool writable) {
  struct stat st{};
  if (::fstat(fd, &st) != 0) fail_errno(errno, "file.borrow", path, "fstat failed");
  if (!S_ISREG(st.st_mode)) fail(errc::invalid_argument, "file.borrow", path, "not a regular file");
  auto f = std::shared_ptr<file>(new file());
  f->fd_ = fd;
  f->owned_ = false;
  f->path_ = std::move(path);
  f->writable_ = writable;
  return f;
}

std::uint64_t file::read_here(void* dst, std::uint64_t bytes, std::uint64_t offset) const {
  if (source_) fail(errc::not_supported, "file.read", path_, "a remote file is read through the file engine");
  auto* p = static_cast<std::byte*>(dst);
  std::uint64_t got = 0;
  while (got < bytes) {
    ssize_t r = ::pread(fd_, p + got, bytes - got, static_cast<off_t>(offset + got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) fail_errno(errno, "file.read", fmt::format("{} offset {}", path_, offset + got));
    if (r == 0) break;  // end of file
    got += static_cast<std::uint64_t>(r);
  }
  return got;
}

void file::write_here(const void* src, std::uint64_t bytes, std::uint64_t offset) const {
  if (source_) fail(errc::not_supported, "file.write", path_, "a remote file is written through the file engine");
  if (!writable_) fail(errc::permission_denied, "file.write", path_, "opened read-only");
  auto* p = static_cast<const std::byte*>(src);
  std::uint64_t put = 0;
  while (put < bytes) {
    ssize_t r = ::pwrite(fd_, p + put, bytes - put, static_cast<off_t>(offset + put));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) fail_errno(errno, "file.write", fmt::format("{} offset {}", path_, offset + put));
    if (r == 0) fail(errc::io_error, "file.write", fmt::format("{} offset {}", path_, offset + put), "pwrite wrote nothing");
    put += static_cast<std::uint64_t>(r);
  }
}

file::~file() {
  if (dfd_ >= 0) ::close(dfd_);
  if (fd_ >= 0 && owned_) ::close(fd_);
}

std::uint64_t file::size() const {
  if (source_) {
    source_->check_process("file.size", uri_for_messages(path_));
    return source_->size();
  }
  struct stat st{};
  if (::fstat(fd_, &st) != 0) fail_errno(errno, "file.size", path_);
  return static_cast<std::uint64_t>(st.st_size);
}

void file::resize(std::uint64_t bytes) {
  if (source_) fail(errc::not_supported, "file.resize", path_, "remote files cannot be resized");
  if (::ftruncate(fd_, static_cast<off_t>(bytes)) != 0)
    fail_errno(errno, "file.resize", path_, fmt::format("cannot set the size to {}", bytes));
}

void file::sync() {
  if (source_) {
    source_->check_process("file.sync", uri_for_messages(path_));
    return source_->sync();
  }
  if (::fsync(fd_) != 0) fail_errno(errno, "file.sync", path_);
}

// ---- schemes ----------------------------------------------------------------------------------

file_source::file_source() : pid_(::getpid()) {}

void file_source::start_many(std::span<request> requests, const source_deadline& until) {
  for (auto& r : requests) {
    try {
      start(r.write, r.offset, r.mem, r.bytes, until, r.done);
    } catch (const error& e) {
      r.done(0, &e);
    } catch (const std::exception& e) {
      error err(errc::internal, "file.submit", "a file source", e.what());
      r.done(0, &err);
    }
  }
}

void file_source::check_process(const char* op, const std::string& resource) const {
  if (pid_ != ::getpid())
    fail(errc::invalid_argument, op, resource,
         fmt::format("opened by process {}, which this one was forked from: its connections stayed there; open the file again here", pid_));
}
file_source::~file_source() = default;

namespace {
struct scheme_entry {
  std::uint64_t id;
  std::string scheme;
  file_opener open;
  long pid;  // the process that registered it
};
// The openers' state (connections, threads) belongs to the process that registered them. In a process
// forked from it they serve nothing, and at its exit they are left as they are: ending them would wait
// for threads that did not come along.
struct scheme_table : std::vector<scheme_entry> {
  ~scheme_table() {
    for (auto& e : *this)
      if (e.pid != ::getpid()) new file_opener(std::move(e.open));
  }
};
std::mutex schemes_mu;
scheme_table schemes;  // newest last
std::uint64_t next_scheme_id = 1;
}  // namespace

scheme_registration register_file_scheme(const std::string& scheme, file_opener open) {
  if (scheme.empty() || scheme.find("://") != std::string::npos || !open)
    fail(errc::invalid_argument, "file.scheme", scheme, "a scheme is a name like \"ferry\" with an opener");
  std::lock_guard l(schemes_mu);
  scheme_registration r;
  r.id_ = next_scheme_id++;
  schemes.push_back({r.id_, scheme, std::move(open), ::getpid()});
  return r;
}

scheme_registration& scheme_registration::operator=(scheme_registration&& o) noexcept {
  if (this != &o) {
    scheme_registration gone(std::move(*this));
    id_ = std::exchange(o.id_, 0);
  }
  return *this;
}

scheme_registration::~scheme_registration() {
  if (!id_) return;
  std::lock_guard l(schemes_mu);
  std::erase_if(schemes, [&](scheme_entry& e) {
    if (e.id != id_) return false;
    if (e.pid != ::getpid()) new file_opener(std::move(e.open));  // the parent's, in a forked child: left alone
    return true;
  });
}

std::string uri_for_messages(const std::string& uri) {
  std::string s = uri;
  if (auto q = s.find('?'); q != std::string::npos) s = s.substr(0, q) + "?...";
  const auto scheme = s.find("://");
  if (scheme == std::string::npos) return s;
  const auto slash = s.find('/', scheme + 3), at = s.find('@', scheme + 3);
  if (at != std::string::npos && (slash == std::string::npos || at < slash)) s.erase(scheme + 3, at - scheme - 2);
  return s;
}

file_opener find_file_scheme(const std::string& path) {
  auto sep = path.find("://");
  if (sep == std::string::npos || sep == 0) return {};
  std::string scheme = path.substr(0, sep);
  // Only letters, digits, '+', '-', '.' (RFC 3986): "dir/a://b" is a local path.
  for (char ch : scheme)
    if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '+' && ch != '-' && ch != '.') return {};
  std::lock_guard l(schemes_mu);
  bool inherited = false;
  for (auto it = schemes.rbegin(); it != schemes.rend(); ++it)
    if (it->scheme == scheme) {
      if (it->pid == ::getpid()) return it->open;
      inherited = true;
    }
  fail(errc::not_supported, "file.open", path,
       fmt::format("no handler for {}:// here ({} is served by a ferry::runtime, which registers it while it lives{})", scheme,
                   scheme == "ferry" ? "ferry://" : "this scheme",
                   inherited ? "; the one registered belongs to the process this one was forked from: make a runtime here" : ""));
}

}  // namespace ferry
