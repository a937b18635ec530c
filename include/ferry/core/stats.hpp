#pragma once
// Named monotonically increasing counters. Each component owns a `stats` set; counters have stable
// addresses, so hot paths keep a reference and pay one relaxed atomic add.
#include <ferry/core/export.hpp>

#include <atomic>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ferry {

class FERRY_API counter {
 public:
  void add(std::uint64_t n = 1) noexcept { v_.fetch_add(n, std::memory_order_relaxed); }
  std::uint64_t value() const noexcept { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<std::uint64_t> v_{0};
};

// A counter only one thread adds to (a progress thread, say), read by any: a relaxed load and
// store, no locked instruction. An atomic add costs far more, most of all right after stores that
// another core has to see first (a message just written into its queue), and a small request would
// make several.
class FERRY_API owned_counter {
 public:
  void add(std::uint64_t n = 1) noexcept { v_.store(v_.load(std::memory_order_relaxed) + n, std::memory_order_relaxed); }
  std::uint64_t value() const noexcept { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<std::uint64_t> v_{0};
};

class FERRY_API stats {
 public:
  stats() = default;
  stats(const stats&) = delete;
  stats& operator=(const stats&) = delete;

  // The counter of that name, created at zero on first use.
  counter& get(std::string_view name);
  // (name, value) for every counter, in creation order.
  std::vector<std::pair<std::string, std::uint64_t>> snapshot() const;

 private:
  mutable std::mutex mu_;
  std::deque<std::pair<std::string, counter>> counters_;
};

}  // namespace ferry
