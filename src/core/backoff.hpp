#pragma once
// How a thread that waits by looking gives the CPU back: one shape for the library's poll loops.
// By the time since the wait began (or since reset()): busy looks up to `spin`, then sched_yield up
// to `yield`, then sleeps of `nap` doubling up to `most`; from `long_after` on, sleeps of `long_nap`.
// A sleep overshoots by the timer slack (50 us by default), so a loop that must notice its event
// within microseconds spins or yields first; each loop states its stages, and why, where it makes
// its backoff.
#include <algorithm>
#include <chrono>
#include <thread>

namespace ferry::detail {

// A pause for spin loops (x86 `pause`, arm `yield`): it leaves the core's execution resources to
// the sibling hyper-thread (a copy out of the page cache, say) while this one looks, and costs no
// system call. Every loop that looks without sleeping calls it between looks.
inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

struct backoff_plan {
  std::chrono::nanoseconds spin{0}, yield{0}, nap{0}, most{0};
  std::chrono::nanoseconds long_after = std::chrono::nanoseconds::max(), long_nap{0};
};

class backoff {
 public:
  using clock = std::chrono::steady_clock;
  explicit backoff(backoff_plan p) noexcept : p_(p) { reset(); }
  // Something happened: the next pauses start again from the first stage.
  void reset() noexcept {
    start_ = clock::now();
    nap_ = p_.nap;
  }
  // One pause, by how long the wait has run: nothing, a yield, or a sleep.
  void pause() {
    const auto waited = clock::now() - start_;
    if (waited < p_.spin) return cpu_relax();
    if (waited < p_.yield) return std::this_thread::yield();
    if (waited >= p_.long_after) return std::this_thread::sleep_for(p_.long_nap);
    std::this_thread::sleep_for(nap_);
    nap_ = std::min(nap_ * 2, p_.most);
  }

 private:
  backoff_plan p_;
  clock::time_point start_;
  std::chrono::nanoseconds nap_{0};
};

}  // namespace ferry::detail
