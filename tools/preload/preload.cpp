// libferry_preload.so: loaded into an unmodified program (LD_PRELOAD, as `ferry run` sets it), it
// routes read, pread, write and pwrite whose buffer is GPU memory (cudaMalloc'd, sim) or ferry's
// unified memory to ferry's file engine (docs/design/unified-memory.md, "Unmodified programs").
//
// Each call goes to the C library first, untouched: host buffers, pipes, sockets and every error
// the kernel gives stay exactly as they were. Only a call the kernel refused with EFAULT (memory the
// CPU cannot reach) on a regular file is looked at again: when ferry's registration cache knows the
// buffer as device or unified memory, the file engine moves the bytes, with the syscall's results
// (the count, short at the end of the file; errno on failure; read and write move the descriptor's
// offset, write honours O_APPEND) on the caller's own descriptor. Anything else keeps the kernel's
// EFAULT. A program that never passes such memory never starts ferry's runtime.
//
// The managed memory of such a program is ferry's too (managed.cpp, driver_hook.cpp).
#include "preload.hpp"

#include <ferry/core/error.hpp>
#include <ferry/core/log.hpp>
#include <ferry/io/file.hpp>
#include <ferry/runtime.hpp>

#include <dlfcn.h>
#include <pthread.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
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

// The process's runtime, made on the first call that needs it. It ends at exit, from an atexit
// handler registered once it is made (so before the statics it made are destroyed), unless a call
// is still under way on another thread or the program has managed memory on it (then it is left to
// the process's end). A child forked after it was made has none of its threads: there calls keep
// the kernel's EFAULT (as a forked child of a UVM program cannot use the parent's managed memory
// either).
std::once_flag made;
std::atomic<ferry::runtime*> rt{nullptr};
std::atomic<bool> ending{false}, forked{false}, making{false};
std::atomic<int> in_flight{0};

void teardown() {
  ending = true;
#if FERRY_PRELOAD_MANAGED
  if (ferry::preload::managed_at_exit()) return;
#endif
  if (in_flight.load() == 0 && !forked.load()) delete rt.exchange(nullptr);
}

}  // namespace

ferry::runtime* ferry::preload::get_runtime() {
  if (ending.load() || forked.load()) return nullptr;
  std::call_once(made, [] {
    making = true;
    try {
      rt = new ferry::runtime();
      std::atexit(teardown);
    } catch (const std::exception& e) {
      ferry::log_message(ferry::log_level::error, "preload",
                         std::string("ferry's runtime did not start; reads and writes of GPU memory keep failing with EFAULT: ") + e.what());
    }
    making = false;
  });
  return rt.load();
}

namespace {

// A routed call in progress (counted before the runtime is asked for, see teardown).
struct call {
  call() { in_flight.fetch_add(1); }
  ~call() { in_flight.fetch_sub(1); }
  call(const call&) = delete;
  call& operator=(const call&) = delete;
};

[[gnu::constructor]] void on_load() {
  (void)next();
  // FERRY_LOG's level from the start (a runtime sets it when made; the driver's entry points are
  // handed out before).
  try {
    ferry::set_log_level(ferry::settings::from_env().log);
  } catch (const std::exception&) {
  }
  // (Also when the fork came while another thread was making the runtime: the child's call_once
  // would wait for a thread it does not have.)
  ::pthread_atfork(nullptr, nullptr, [] {
    if (rt.load() || making.load()) forked = true;
  });
}

// Whether `fd` is a regular file and the buffer memory ferry moves (device or unified, one
// allocation): the cases that are routed. Everything else keeps the kernel's answer. A read at
// `read_at` needs only the bytes the file still holds there, as the kernel writes no more: `n` is cut
// to those. (At or past the end the kernel answers 0 without touching the buffer, so a read that
// got EFAULT there is of a file whose size says nothing, as /proc's: not routed.)
ferry::runtime* routable(int fd, const void* buf, size_t& n, off_t read_at = -1) {
  struct stat st {};
  if (n == 0 || ::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return nullptr;
  if (read_at >= 0) {
    if (read_at >= st.st_size) return nullptr;
    n = std::min<size_t>(n, static_cast<size_t>(st.st_size - read_at));
  }
  ferry::runtime* r = ferry::preload::get_runtime();
  if (!r) return nullptr;
  try {
    const auto m = r->registrations().classify(buf, n);
    const bool ours = m.type == ferry::memory_type::device || m.type == ferry::memory_type::unified;
    return ours && m.contains(reinterpret_cast<std::uintptr_t>(buf), n) ? r : nullptr;
  } catch (const std::exception&) {
    return nullptr;
  }
}

// The descriptor as a ferry file: the caller's own, borrowed (positional I/O leaves its offset
// alone, and closing nothing keeps the process's record locks on the file). A write to an O_APPEND
// descriptor, whose every write the kernel puts at the end, goes through the file opened again
// through /proc (the same file, also when unlinked or renamed since) without O_APPEND, keeping
// O_SYNC/O_DSYNC; closing that one drops the process's record locks on the file.
std::shared_ptr<ferry::file> as_file(int fd, bool writable) {
  char link[64], path[4096];
  std::snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  const ssize_t k = ::readlink(link, path, sizeof path - 1);
  std::string name = k > 0 ? std::string(path, static_cast<std::size_t>(k)) : std::string(link);
  const int fl = ::fcntl(fd, F_GETFL);
  if (fl < 0) ferry::fail_errno(errno, "preload.file", name, "fcntl");
  if (!writable || !(fl & O_APPEND)) return ferry::file::borrow(fd, name, writable);
  const int again = ::open(link, (fl & (O_ACCMODE | O_SYNC | O_DSYNC)) | O_CLOEXEC);
  if (again < 0) ferry::fail_errno(errno, "preload.file", name, "opening it again without O_APPEND");
  return ferry::file::adopt(again, name, writable, false);
}

// A routed call's failure as the syscall's: -1, errno from ferry's error, the message in the log
// (errno alone does not say which file or why).
ssize_t failed(const std::exception& e) {
  int err = EIO;  // what is not ferry's error (an allocation failed)
  if (const auto* fe = dynamic_cast<const ferry::error*>(&e)) err = fe->sys_errno() ? fe->sys_errno() : ferry::errno_from_errc(fe->code());
  ferry::log_message(ferry::log_level::warn, "preload", e.what());
  errno = err;
  return -1;
}

ssize_t routed_read(ferry::runtime& r, int fd, void* buf, size_t n, off_t offset) {
  try {
    auto f = as_file(fd, false);
    return static_cast<ssize_t>(r.files().read(*f, static_cast<std::uint64_t>(offset), buf, n));
  } catch (const std::exception& e) {
    return failed(e);
  } catch (...) {
    errno = EIO;
    return -1;
  }
}

ssize_t routed_write(ferry::runtime& r, int fd, const void* buf, size_t n, off_t offset) {
  try {
    auto f = as_file(fd, true);
    r.files().write(*f, static_cast<std::uint64_t>(offset), buf, n);
    return static_cast<ssize_t>(n);
  } catch (const std::exception& e) {
    return failed(e);
  } catch (...) {
    errno = EIO;
    return -1;
  }
}

}  // namespace

extern "C" {

// For programs that use ferry themselves under the preload library: the runtime it routes through
// (made now if it was not yet), so that both share one. Null when it could not start.
[[gnu::visibility("default")]] ferry::runtime* ferry_preload_runtime() { return ferry::preload::get_runtime(); }

[[gnu::visibility("default")]] ssize_t pread64(int fd, void* buf, size_t n, off_t offset) {
  const ssize_t got = next().pread(fd, buf, n, offset);
  if (got >= 0 || errno != EFAULT) return got;
  call in;
  ferry::runtime* r = routable(fd, buf, n, offset);
  if (!r) {
    errno = EFAULT;
    return -1;
  }
  return routed_read(*r, fd, buf, n, offset);
}
[[gnu::visibility("default")]] ssize_t pread(int fd, void* buf, size_t n, off_t offset) { return pread64(fd, buf, n, offset); }

[[gnu::visibility("default")]] ssize_t pwrite64(int fd, const void* buf, size_t n, off_t offset) {
  const ssize_t put = next().pwrite(fd, buf, n, offset);
  if (put >= 0 || errno != EFAULT) return put;
  call in;
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
  call in;
  const off_t at = ::lseek(fd, 0, SEEK_CUR);
  ferry::runtime* r = at >= 0 ? routable(fd, buf, n, at) : nullptr;
  if (!r) {
    errno = EFAULT;
    return -1;
  }
  const ssize_t moved = routed_read(*r, fd, buf, n, at);
  if (moved > 0) ::lseek(fd, at + moved, SEEK_SET);
  return moved;
}

[[gnu::visibility("default")]] ssize_t write(int fd, const void* buf, size_t n) {
  const ssize_t put = next().write(fd, buf, n);
  if (put >= 0 || errno != EFAULT) return put;
  call in;
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
