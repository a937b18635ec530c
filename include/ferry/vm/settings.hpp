#pragma once
// vm's tunables: a unified address space's capacity, pages, migrations and returns, and its block
// pool (rows in src/vm/settings.cpp; ferry/settings.hpp gathers every layer's).
#include <ferry/core/export.hpp>
#include <ferry/core/settings.hpp>

#include <chrono>
#include <cstdint>
#include <span>
#include <string_view>

namespace ferry {

// Which device page a unified address space evicts first.
enum class page_replacement { lru, fifo };
FERRY_API std::string_view to_string(page_replacement v) noexcept;

// With core's (FERRY_DEADLINE: a space's waits).
struct FERRY_API vm_settings : virtual core_settings {
  std::uint64_t vm_capacity = 0;              // device bytes a unified address space may use (0: free minus reserve)
  std::uint64_t vm_reserve = 1ull << 30;      // left free on the device when vm_capacity is 0
  std::uint64_t vm_keep = 0;                 // a block pool's kept whole-page blocks, at most (0: a quarter of the device capacity)
  std::uint64_t vm_page = 32ull << 20;        // unified-memory page (0: the device granularity)
  page_replacement vm_policy = page_replacement::lru;
  int vm_batch = 16;                          // pages per batched migration
  int vm_fault_ahead = 8;                     // pages a CPU fault moves to host (the faulting one and the next)
  std::chrono::nanoseconds vm_thrash_lapse = std::chrono::seconds(1);  // evicted, prefetched back within: thrashing (0: off)
  std::chrono::nanoseconds vm_thrash_hold = std::chrono::seconds(1);   // a thrashing page stays on the host this long
  // Pages the CPU took from a device go back: before kernel launches, and after this quiet time (0: only at launches).
  bool vm_return_at_launch = true;
  std::chrono::nanoseconds vm_return_quiet = std::chrono::milliseconds(200);
  std::chrono::nanoseconds vm_prefetch_wait = std::chrono::milliseconds(200);
  std::chrono::nanoseconds vm_return_hold = std::chrono::seconds(1);  // a page the CPU takes back this soon stays (doubling)
  bool vm_report = false;                     // each unified address space prints where its time went when it ends

  static std::span<const setting_row<vm_settings>> table();
};

}  // namespace ferry
