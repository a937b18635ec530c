#pragma once
// Where a range of memory changes place (peer_memory_client::one_place): the offsets in [0, n) at
// which one copy must end and the next begin. Empty for memory in one place (every kind but unified
// memory). Asked while the range is pinned, so that the answer holds for the copies.
#include <ferry/mem/memory.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace ferry {

inline void add_place_cuts(const memory_region& m, const void* p, std::uint64_t n, std::vector<std::uint64_t>& cuts) {
  if (m.type != memory_type::unified || !m.client) return;
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  for (std::uint64_t at = 0; at < n;) {
    at += std::max<std::uint64_t>(1, m.client->one_place(a + at, n - at));
    if (at < n) cuts.push_back(at);
  }
}

// The cuts of a copy's two sides, merged in order.
inline std::vector<std::uint64_t> place_cuts(const memory_region& dst, const void* d, const memory_region& src, const void* s,
                                             std::uint64_t n) {
  std::vector<std::uint64_t> cuts;
  add_place_cuts(dst, d, n, cuts);
  const auto mid = cuts.size();
  add_place_cuts(src, s, n, cuts);
  std::inplace_merge(cuts.begin(), cuts.begin() + static_cast<std::ptrdiff_t>(mid), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  return cuts;
}

}  // namespace ferry
