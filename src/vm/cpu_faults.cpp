// The CPU's faults on unified memory: the process's SIGSEGV handler and each space's service
// thread. See cpu_faults.hpp.
#include "vm/cpu_faults.hpp"

#include <ferry/core/error.hpp>

#include "core/fault_note.hpp"
#include "core/logging.hpp"

#include <fmt/format.h>
#include <execinfo.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#include <climits>
#include <cstring>
#include <mutex>

namespace ferry::vm {

namespace {

// A fault handed from the signal handler to the service thread; lives on the faulting thread's stack.
struct fault_record {
  std::uintptr_t addr;
  bool write;
  std::atomic<int> state;  // 0 waiting, 1 resolved, -1 failed
};

// What goes down the pipe, by value: the service thread checks who sent it and where before it
// touches the record (a process forked from the owner inherits the pipe).
struct fault_message {
  std::uint64_t magic;
  long pid;
  std::uintptr_t addr;
  fault_record* record;
};
constexpr std::uint64_t fault_magic = 0x66657272792d7666ull;  // "ferry-vf"
static_assert(sizeof(fault_message) <= PIPE_BUF, "one atomic write");

// Live spaces, for the handler: fixed slots, no allocation, no locks.
constexpr int max_spaces = 32;
struct space_slot {
  std::atomic<std::uintptr_t> base{0}, size{0};
  std::atomic<int> fd{-1};  // the space's fault pipe (write end)
  std::atomic<long> service_tid{0};
  std::atomic<long> pid{0};             // the process that made the space (its service thread's)
  std::atomic<long long> wait_ns{0};    // how long a fault may wait for its service thread
};
space_slot g_spaces[max_spaces];
struct sigaction g_old_segv{};
std::once_flag g_handler_once;

long futex(std::atomic<int>* a, int op, int val, const timespec* ts) {
  return ::syscall(SYS_futex, reinterpret_cast<int*>(a), op, val, ts, nullptr, 0);
}

void write_str(const char* s) {
  [[maybe_unused]] auto r = ::write(2, s, std::strlen(s));
}

// "0x" and the hex digits of v into buf (async-signal-safe).
const char* hex(std::uintptr_t v, char (&buf)[20]) {
  char* p = buf + sizeof buf - 1;
  *p = 0;
  do *--p = "0123456789abcdef"[v & 15];
  while (v >>= 4);
  *--p = 'x';
  *--p = '0';
  return p;
}

// Where the faulting access came from, on the way to abort(): which code touched a page it could
// not get (the process's, a library's, or ferry's own). Not async-signal-safe, unlike the rest of
// the handler: backtrace() is primed in install_handler so that here it loads nothing, but
// backtrace_symbols_fd() takes the dynamic loader's lock, which another thread may hold (a dlopen);
// the alarm ends the process then, as the abort would have.
void print_faulting_stack() {
  ::alarm(5);
  void* frames[48];
  int n = ::backtrace(frames, 48);
  char name[17] = {0};
  ::prctl(PR_GET_NAME, name);
  write_str("ferry: the faulting thread (");
  write_str(name);
  write_str(")'s stack:\n");
  ::backtrace_symbols_fd(frames, n, 2);
  if (const auto& c = fault_note::current; c.what) {  // the library call it was in, as ferry made it
    char h[20];
    write_str("ferry: the faulting thread was in ");
    write_str(c.what);
    write_str(": dst ");
    write_str(hex(c.dst, h));
    write_str(", src ");
    write_str(hex(c.src, h));
    write_str(", bytes ");
    write_str(hex(c.bytes, h));
    write_str("\n");
  }
}

// Async-signal-safe: table lookup, write(2) to a pipe, futex wait (and, on the way to abort(), the
// stack print above).
void on_segv(int sig, siginfo_t* si, void* uc) {
  auto a = reinterpret_cast<std::uintptr_t>(si->si_addr);
  for (auto& s : g_spaces) {
    std::uintptr_t b = s.base.load(std::memory_order_acquire), n = s.size.load(std::memory_order_acquire);
    int fd = s.fd.load(std::memory_order_acquire);
    if (fd < 0 || a < b || a - b >= n) continue;
    char h[20];
    long me = ::syscall(SYS_getpid);
    if (me != s.pid.load()) {
      // A process forked from the space's owner: the pages and their service thread stay with the
      // parent. The access ends here, the way a stray access does (SIGSEGV), and says why.
      write_str("ferry: unified memory at ");
      write_str(hex(a, h));
      write_str(" belongs to the process that made it, not to this one forked from it; SIGSEGV\n");
      ::signal(SIGSEGV, SIG_DFL);
      return;  // re-faults with the default action
    }
    if (::syscall(SYS_gettid) == s.service_tid.load()) {  // it would wait for itself
      write_str("ferry: the unified-memory service thread touched a non-resident page (a bug); aborting\n");
      ::abort();
    }
    bool write = true;
#if defined(__x86_64__)
    write = (static_cast<ucontext_t*>(uc)->uc_mcontext.gregs[REG_ERR] & 2) != 0;
#endif
    fault_record r{a, write, {0}};
    fault_message m{fault_magic, me, a, &r};
    if (::write(fd, &m, sizeof m) != static_cast<ssize_t>(sizeof m)) {
      write_str("ferry: unified-memory fault could not reach its service thread\n");
      ::abort();
    }
    // Waits in slices up to the space's deadline: a service thread that cannot serve the fault
    // ends the process with a message instead of leaving this thread waiting forever.
    long long left = s.wait_ns.load();
    while (r.state.load(std::memory_order_acquire) == 0) {
      if (left <= 0) {
        write_str("ferry: a unified-memory fault at ");
        write_str(hex(a, h));
        write_str(" was not served within the space's deadline (its service thread is stuck); aborting\n");
        print_faulting_stack();
        ::abort();
      }
      timespec ts{0, 100'000'000};
      futex(&r.state, FUTEX_WAIT_PRIVATE, 0, &ts);
      left -= 100'000'000;
    }
    if (r.state.load() < 0) {
      write_str("ferry: unified-memory fault could not be resolved (see the log); aborting\n");
      print_faulting_stack();
      ::abort();
    }
    return;  // the access is retried
  }
  // Not ours: whoever was there before.
  if (g_old_segv.sa_flags & SA_SIGINFO) {
    if (g_old_segv.sa_sigaction) return g_old_segv.sa_sigaction(sig, si, uc);
  } else if (g_old_segv.sa_handler != SIG_DFL && g_old_segv.sa_handler != SIG_IGN) {
    return g_old_segv.sa_handler(sig);
  }
  ::signal(SIGSEGV, SIG_DFL);  // re-faults and dumps as usual
}

// In a child of fork(): every live space's pages become inaccessible, so that the child's first
// access faults (and ends, see on_segv) instead of reading or writing the parent's shared pages.
void after_fork_in_child() {
  for (auto& s : g_spaces) {
    std::uintptr_t b = s.base.load(), n = s.size.load();
    if (n && s.fd.load() >= 0) ::mprotect(reinterpret_cast<void*>(b), n, PROT_NONE);
  }
}

void install_handler() {
  std::call_once(g_handler_once, [] {
    void* prime[1];
    ::backtrace(prime, 1);  // loads the unwinder now, not inside the signal handler
    ::pthread_atfork(nullptr, nullptr, after_fork_in_child);
    struct sigaction sa{};
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    if (::sigaction(SIGSEGV, &sa, &g_old_segv) != 0) fail_errno(errno, "vm.init", "SIGSEGV", "cannot install the fault handler");
  });
}

}  // namespace

cpu_fault_service::cpu_fault_service(std::uintptr_t base, std::uint64_t size, std::chrono::nanoseconds wait, fault_target& target,
                                     std::string name)
    : base_(base), size_(size), target_(target), name_(std::move(name)) {
  install_handler();
  for (int i = 0; i < max_spaces && slot_ < 0; ++i) {
    int none = -1;
    if (g_spaces[i].fd.load() == -1 && g_spaces[i].fd.compare_exchange_strong(none, -2)) slot_ = i;
  }
  if (slot_ < 0) fail(errc::busy, "vm.space", name_, fmt::format("more than {} address spaces at once", max_spaces));
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    const int err = errno;
    g_spaces[slot_].fd.store(-1);
    fail_errno(err, "vm.space", "fault pipe");
  }
  pipe_rd_ = fds[0];
  pipe_wr_ = fds[1];
  // Dedicated, not the executor's: it must run while any other thread, an executor worker too, is stopped at a fault.
  thread_ = std::thread([this] { serve(); });
  g_spaces[slot_].pid.store(::getpid());
  g_spaces[slot_].wait_ns.store(wait.count());
  g_spaces[slot_].base.store(base_, std::memory_order_release);
  g_spaces[slot_].size.store(size_, std::memory_order_release);
  g_spaces[slot_].fd.store(pipe_wr_, std::memory_order_release);
}

cpu_fault_service::~cpu_fault_service() {
  g_spaces[slot_].fd.store(-2);
  g_spaces[slot_].base.store(0);
  g_spaces[slot_].size.store(0);
  g_spaces[slot_].service_tid.store(0);
  g_spaces[slot_].fd.store(-1);
  stop_ = true;
  // Wakes the thread out of its poll now rather than at its next timeout (a process's exit waits for it).
  const fault_message wake{};
  [[maybe_unused]] const auto w = ::write(pipe_wr_, &wake, sizeof wake);
  thread_.join();
  ::close(pipe_rd_);
  ::close(pipe_wr_);
}

void cpu_fault_service::serve() {
  g_spaces[slot_].service_tid.store(::syscall(SYS_gettid));
  while (!stop_) {
    pollfd pf{pipe_rd_, POLLIN, 0};
    if (::poll(&pf, 1, target_.work_waiting() ? 0 : 50) <= 0) {
      target_.between_faults();
      continue;
    }
    fault_message m{};
    if (::read(pipe_rd_, &m, sizeof m) != static_cast<ssize_t>(sizeof m)) continue;
    if (m.magic == 0 && stop_) break;  // the destructor's wake
    // Only a fault of this process, in this range, is served: anything else is not touched.
    if (m.magic != fault_magic || m.pid != ::getpid() || !m.record || m.addr < base_ || m.addr - base_ >= size_) {
      log::error("vm", "{}: ignoring a malformed fault message (pid {}, address {:#x})", name_, m.pid, m.addr);
      continue;
    }
    fault_record* r = m.record;
    const int result = target_.serve_fault(r->addr, r->write) ? 1 : -1;
    r->state.store(result, std::memory_order_release);
    futex(&r->state, FUTEX_WAKE_PRIVATE, 1, nullptr);
  }
}

}  // namespace ferry::vm
