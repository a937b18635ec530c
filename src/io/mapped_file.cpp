#include <ferry/io/mapped_file.hpp>

#include <atomic>
#include <csetjmp>
#include <csignal>
#include <cstring>
#include <mutex>
#include <utility>

#include <sys/mman.h>
#include <sys/stat.h>

namespace ferry {

namespace {
// The guarded copy of this thread, if one is running: where to jump and which bytes it reads and writes.
// (Touched by the thread before it copies, so the handler never makes the TLS block allocate.)
// Volatile, with signal fences around the copy: to the compiler these are stores nobody reads
// (the copy cannot see them), and it would drop them.
thread_local sigjmp_buf* volatile t_jump = nullptr;
thread_local const std::byte* volatile t_lo = nullptr;
thread_local const std::byte* volatile t_hi = nullptr;
thread_local const std::byte* volatile t_dlo = nullptr;
thread_local const std::byte* volatile t_dhi = nullptr;
struct sigaction g_previous {};

void on_sigbus(int sig, siginfo_t* si, void* ctx) {
  auto* at = static_cast<const std::byte*>(si->si_addr);
  if (t_jump && ((at >= t_lo && at < t_hi) || (at >= t_dlo && at < t_dhi))) siglongjmp(*t_jump, 1);
  // Not a guarded read: whatever handled SIGBUS before us does.
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction) return g_previous.sa_sigaction(sig, si, ctx);
  } else if (g_previous.sa_handler == SIG_IGN) {
    return;
  } else if (g_previous.sa_handler != SIG_DFL) {
    return g_previous.sa_handler(sig);
  }
  // The default action: restore it; the faulting access repeats and ends the process as usual.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(SIGBUS, &dfl, nullptr);
}

void install_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    sa.sa_sigaction = on_sigbus;
    sigemptyset(&sa.sa_mask);
    // SA_NODEFER: the handler leaves by siglongjmp without restoring the signal mask (sigsetjmp
    // with savemask 0, which costs no system call), so SIGBUS must not be blocked while it runs.
    sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigaction(SIGBUS, &sa, &g_previous);
  });
}

// Runs f() with SIGBUS on [src, src+n) or [dst, dst+dn) turned into `false`. Inlined into its
// callers: the frame that called sigsetjmp has to stay alive while f runs.
template <typename F>
inline bool guarded(const void* src, std::size_t n, const void* dst, std::size_t dn, F f) {
  install_handler();
  sigjmp_buf jump;
  t_lo = static_cast<const std::byte*>(src);
  t_hi = t_lo + n;
  t_dlo = static_cast<const std::byte*>(dst);
  t_dhi = t_dlo + dn;
  if (sigsetjmp(jump, 0) != 0) {
    t_jump = nullptr;
    return false;
  }
  t_jump = &jump;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  f();
  std::atomic_signal_fence(std::memory_order_seq_cst);
  t_jump = nullptr;
  return true;
}
}  // namespace

bool guarded_copy(void* dst, const void* src, std::size_t n) {
  return guarded(src, n, dst, n, [&] { std::memcpy(dst, src, n); });
}

bool guarded_publish(std::uint64_t* at, std::uint64_t first, std::uint64_t second) {
  return guarded(nullptr, 0, at, 2 * sizeof(std::uint64_t), [&] {
    std::atomic_ref<std::uint64_t>(at[1]).store(second, std::memory_order_relaxed);
    std::atomic_ref<std::uint64_t>(at[0]).store(first, std::memory_order_release);
  });
}

mapped_file::mapped_file(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size <= 0) return;
  void* p = ::mmap(nullptr, static_cast<std::size_t>(st.st_size), PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return;
  base_ = static_cast<const std::byte*>(p);
  size_ = static_cast<std::uint64_t>(st.st_size);
}

mapped_file::~mapped_file() {
  if (base_) ::munmap(const_cast<std::byte*>(base_), static_cast<std::size_t>(size_));
}

mapped_file::mapped_file(mapped_file&& o) noexcept
    : base_(std::exchange(o.base_, nullptr)), size_(std::exchange(o.size_, 0)) {}

mapped_file& mapped_file::operator=(mapped_file&& o) noexcept {
  if (this != &o) {
    if (base_) ::munmap(const_cast<std::byte*>(base_), static_cast<std::size_t>(size_));
    base_ = std::exchange(o.base_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

bool mapped_file::read(void* dst, std::uint64_t n, std::uint64_t offset) const {
  if (!base_ || offset > size_ || n > size_ - offset) return false;
  return guarded_copy(dst, base_ + offset, static_cast<std::size_t>(n));
}

}  // namespace ferry
