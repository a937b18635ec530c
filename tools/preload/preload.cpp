// libferry_preload.so: loaded into an unmodified program (LD_PRELOAD, as `ferry run` sets it), it
// routes read, pread, write and pwrite whose buffer is GPU memory (cudaMalloc'd, sim) or ferry's
// unified memory to ferry's file engine (docs/design/unified-memory.md, "Unmodified programs").
//
// Each call goes to the C library first, untouched: host buffers, pipes, sockets and every error
// the kernel gives stay exactly as they were. Only a call the kernel refused with EFAULT (memory the
// CPU cannot reach) on a regular file is looked at again: when ferry's registration cache knows the
// buffer as device or unified memory, the file engine moves the bytes, with the syscall's results
// (the count, short at the end of the file; errno on failure; read and write move the descriptor's
// offset, write honours O_APPEND). Anything else keeps the kernel's EFAULT. A program that never
// passes such memory never starts ferry's runtime.
#include <ferry/core/error.hpp>
#include <ferry/core/log.hpp>
#include <ferry/io/file.hpp>
#include <ferry/runtime.hpp>

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <mutex>
#include <string>

namespace {

using read_fn = ssize_t (*)(int, void*, size_t);
using pread_fn = ssize_t (*)(int, void*, size_t, off_t);
using write_fn = ssize_t (*)(int, const void*, size_t);
using pwrite_fn = ssize_t (*)(int, const void*, size_t, off_t);

struct next_calls {
  read_fn read = nullptr;
  pread_fn pread = nullptr;
  write_fn write = nullptr;
  pwrite_fn pwrite = nullptr;
};

// The C library's own functions, found once (before main, and again if a call comes first).
const next_calls& next() {
  static const next_calls n = [] {
    next_calls c;
    c.read = reinterpret_cast<read_fn>(::dlsym(RTLD_NEXT, "read"));
    c.pread = reinterpret_cast<pread_fn>(::dlsym(RTLD_NEXT, "pread64"));
    c.write = reinterpret_cast<write_fn>(::dlsym(RTLD_NEXT, "write"));
    c.pwrite = reinterpret_cast<pwrite_fn>(::dlsym(RTLD_NEXT, "pwrite64"));
    return c;
  }();
  return n;
}

// The process's runtime, made on the first call that needs it and ended before the library goes
// (the runtime's threads must stop before libferry's own globals do).
std::once_flag made;
std::atomic<ferry::runtime*> rt{nullptr};
std::atomic<bool> ending{false};

ferry::runtime* runtime() {
  if (ending.load()) return nullptr;
  std::call_once(made, [] {
    try {
      rt = new ferry::runtime();
    } catch (const std::exception& e) {
      ferry::log_message(ferry::log_level::error, "preload",
                         std::string("ferry's runtime did not start; reads and writes of GPU memory keep failing with EFAULT: ") + e.what());
    }
  });
  return rt.load();
}

[[gnu::constructor]] void on_load() { (void)next(); }
[[gnu::destructor]] void on_unload() {
  ending = true;
  delete rt.exchange(nullptr);
}

// Whether `fd` is a regular file and the buffer memory ferry moves (device or unified, one
// allocation): the cases that are routed. Everything else keeps the kernel's answer. A read at
// `read_at` needs only the bytes the file still holds there, as the kernel writes no more: `n` is cut
// to those (0 at the end of the file).
ferry::runtime* routable(int fd, const void* buf, size_t& n, off_t read_at = -1) {
  struct stat st {};
  if (n == 0 || ::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return nullptr;
  if (read_at >= 0) n = read_at < st.st_size ? std::min<size_t>(n, static_cast<size_t>(st.st_size - read_at)) : 0;
  ferry::runtime* r = runtime();
  if (n == 0) return r;
  if (!r) return nullptr;
  try {
    const auto m = r->registrations().classify(buf, n);
    const bool ours = m.type == ferry::memory_type::device || m.type == ferry::memory_type::unified;
    return ours && m.contains(reinterpret_cast<std::uintptr_t>(buf), n) ? r : nullptr;
  } catch (const std::exception&) {
    return nullptr;
  }
}

// The descriptor's file as a ferry file: opened again through /proc (the same file, also when it
// was unlinked or renamed since) with the descriptor's access but without O_APPEND, whose writes
// would all go to the end; the offsets are positional and the caller's own.
std::shared_ptr<ferry::file> adopt(int fd, bool writable) {
  char link[64], path[4096];
  std::snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  const ssize_t k = ::readlink(link, path, sizeof path - 1);
  std::string name = k > 0 ? std::string(path, static_cast<std::size_t>(k)) : std::string(link);
  const int fl = ::fcntl(fd, F_GETFL);
  if (fl < 0) ferry::fail_errno(errno, "preload.adopt", name, "fcntl");
  const int again = ::open(link, (writable ? (fl & O_ACCMODE) : O_RDONLY) | O_CLOEXEC);
  if (again < 0) ferry::fail_errno(errno, "preload.adopt", name, "opening it again");
  return ferry::file::adopt(again, name, writable);
}

// A routed call's failure as the syscall's: -1, errno from ferry's error, the message in the log
// (errno alone does not say which file or why).
ssize_t failed(const std::exception& e) {
  int err = EIO;
  if (const auto* fe = dynamic_cast<const ferry::error*>(&e)) err = fe->sys_errno() ? fe->sys_errno() : ferry::errno_from_errc(fe->code());
  ferry::log_message(ferry::log_level::warn, "preload", e.what());
  errno = err;
  return -1;
}

ssize_t routed_read(ferry::runtime& r, int fd, void* buf, size_t n, off_t offset) {
  try {
    auto f = adopt(fd, false);
    return static_cast<ssize_t>(r.files().read(*f, static_cast<std::uint64_t>(offset), buf, n));
  } catch (const std::exception& e) {
    return failed(e);
  }
}

ssize_t routed_write(ferry::runtime& r, int fd, const void* buf, size_t n, off_t offset) {
  try {
    auto f = adopt(fd, true);
    r.files().write(*f, static_cast<std::uint64_t>(offset), buf, n);
    return static_cast<ssize_t>(n);
  } catch (const std::exception& e) {
    return failed(e);
  }
}

}  // namespace

extern "C" {

// For programs that use ferry themselves under the preload library: the runtime it routes through
// (made now if it was not yet), so that both share one. Null when it could not start.
[[gnu::visibility("default")]] ferry::runtime* ferry_preload_runtime() { return runtime(); }

[[gnu::visibility("default")]] ssize_t pread64(int fd, void* buf, size_t n, off_t offset) {
  const ssize_t got = next().pread(fd, buf, n, offset);
  if (got >= 0 || errno != EFAULT) return got;
  ferry::runtime* r = routable(fd, buf, n, offset);
  if (!r) {
    errno = EFAULT;
    return -1;
  }
  return n ? routed_read(*r, fd, buf, n, offset) : 0;
}
[[gnu::visibility("default")]] ssize_t pread(int fd, void* buf, size_t n, off_t offset) { return pread64(fd, buf, n, offset); }

[[gnu::visibility("default")]] ssize_t pwrite64(int fd, const void* buf, size_t n, off_t offset) {
  const ssize_t put = next().pwrite(fd, buf, n, offset);
  if (put >= 0 || errno != EFAULT) return put;
  ferry::runtime* r = routable(fd, buf, n);
  if (!r) {
    errno = EFAULT;
    return -1;
  }
  // pwrite on an O_APPEND descriptor appends on Linux, whatever the offset.
  const int fl = ::fcntl(fd, F_GETFL);
  struct stat st {};
  if (fl >= 0 && (fl & O_APPEND) && ::fstat(fd, &st) == 0) offset = st.st_size;
  return routed_write(*r, fd, buf, n, offset);
}
[[gnu::visibility("default")]] ssize_t pwrite(int fd, const void* buf, size_t n, off_t offset) { return pwrite64(fd, buf, n, offset); }

// read and write at the descriptor's offset, which moves by what was moved (as the kernel moves it;
// not atomic against another thread using the same descriptor at the same time).
[[gnu::visibility("default")]] ssize_t read(int fd, void* buf, size_t n) {
  const ssize_t got = next().read(fd, buf, n);
  if (got >= 0 || errno != EFAULT) return got;
  const off_t at = ::lseek(fd, 0, SEEK_CUR);
  ferry::runtime* r = at >= 0 ? routable(fd, buf, n, at) : nullptr;
  if (!r) {
    errno = EFAULT;
    return -1;
  }
  const ssize_t moved = n ? routed_read(*r, fd, buf, n, at) : 0;
  if (moved > 0) ::lseek(fd, at + moved, SEEK_SET);
  return moved;
}

[[gnu::visibility("default")]] ssize_t write(int fd, const void* buf, size_t n) {
  const ssize_t put = next().write(fd, buf, n);
  if (put >= 0 || errno != EFAULT) return put;
  ferry::runtime* r = routable(fd, buf, n);
  const int fl = r ? ::fcntl(fd, F_GETFL) : -1;
  struct stat st {};
  const off_t at = !r || fl < 0 ? -1 : (fl & O_APPEND) ? (::fstat(fd, &st) == 0 ? st.st_size : -1) : ::lseek(fd, 0, SEEK_CUR);
  if (at < 0) {
    errno = EFAULT;
    return -1;
  }
  const ssize_t moved = routed_write(*r, fd, buf, n, at);
  if (moved > 0) ::lseek(fd, at + moved, SEEK_SET);
  return moved;
}

}  // extern "C"
