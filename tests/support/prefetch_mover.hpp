#pragma once
// A thread that keeps moving random pages of a unified range between device and host (PREFETCH)
// until stop(): migrations racing whatever the test does with the memory meanwhile.
#include <ferry/vm/address_space.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <random>
#include <thread>

namespace ferry::test {

class prefetch_mover {
 public:
  prefetch_mover(vm::address_space& as, std::byte* p, std::size_t pages, std::size_t page_bytes, std::uint64_t seed)
      : t_([this, &as, p, pages, page_bytes, seed] {
          std::mt19937_64 rng(seed);
          while (!stop_) {
            std::size_t i = rng() % pages;
            try {
              as.advise(p + i * page_bytes, page_bytes, vm::advice::prefetch,
                        rng() % 2 ? memory_kind::device : memory_kind::host);
              moves_++;
            } catch (const std::exception&) {
              errors_++;
            }
          }
        }) {}
  ~prefetch_mover() { stop(); }
  void stop() {
    stop_ = true;
    if (t_.joinable()) t_.join();
  }
  int moves() const { return moves_.load(); }
  int errors() const { return errors_.load(); }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<int> moves_{0}, errors_{0};
  std::thread t_;  // last: starts after the counters exist
};

}  // namespace ferry::test
