// Blocks of a unified address space, kept per stream for reuse (include/ferry/vm/block_pool.hpp).
#include <ferry/core/error.hpp>
#include <ferry/vm/block_pool.hpp>

#include "core/logging.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <bit>

namespace ferry::vm {

namespace {
constexpr std::uint64_t least_class = 512;
}

block_pool::~block_pool() {
  std::lock_guard l(mu_);
  std::vector<std::uintptr_t> pages;
  for (auto& [p, b] : live_)
    if (!b.slab) pages.push_back(p);
  for (auto& [k, v] : kept_)
    if (k.second > small_max())
      for (void* p : v) pages.push_back(reinterpret_cast<std::uintptr_t>(p));
  for (auto& [p, s] : slabs_) pages.push_back(p);
  for (std::uintptr_t p : pages) {
    try {
      space_.free(reinterpret_cast<void*>(p));
    } catch (const std::exception& e) {
      log::warn("vm", "block pool: a page did not go back to its space: {}", e.what());
    }
  }
}

void* block_pool::space_alloc(std::uint64_t bytes) {
  try {
    return space_.alloc(bytes);
  } catch (const error& e) {
    if (e.code() != errc::out_of_memory || release_locked() == 0) throw;
  }
  return space_.alloc(bytes);
}

void* block_pool::alloc(std::uint64_t bytes, std::uintptr_t stream) {
  if (bytes == 0) fail(errc::invalid_argument, "vm.block_alloc", "0 bytes", "an allocation takes at least one byte");
  const std::uint64_t page = space_.page_bytes();
  const bool small = bytes <= small_max();
  const std::uint64_t size = small ? std::max(least_class, std::bit_ceil(bytes)) : (bytes + page - 1) / page * page;
  std::lock_guard l(mu_);
  auto found = kept_.find({stream, size});
  if (found == kept_.end() || found->second.empty()) {
    void* fresh = space_alloc(small ? page : size);  // may release kept blocks (and erase their lists)
    ++st_.from_space;
    st_.pages += (small ? page : size) / page;
    if (!small) {
      live_[reinterpret_cast<std::uintptr_t>(fresh)] = {stream, size, 0};
      st_.in_use += size;
      return fresh;
    }
    // A page of this class for this stream: its blocks are kept, the first handed out below.
    auto base = reinterpret_cast<std::uintptr_t>(fresh);
    slabs_[base] = {size, stream, 0};
    found = kept_.try_emplace({stream, size}).first;
    for (std::uint64_t off = page; off >= size; off -= size) found->second.push_back(reinterpret_cast<void*>(base + off - size));
    st_.kept += page;
  } else {
    ++st_.reused;
  }
  auto& kept = found->second;
  void* p = kept.back();
  kept.pop_back();
  st_.kept -= size;
  st_.in_use += size;
  auto a = reinterpret_cast<std::uintptr_t>(p);
  std::uintptr_t page_of = 0;
  if (small) {
    auto it = std::prev(slabs_.upper_bound(a));
    it->second.used++;
    page_of = it->first;
  }
  live_[a] = {stream, size, page_of};
  return p;
}

void block_pool::free(void* p) {
  std::lock_guard l(mu_);
  auto it = live_.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == live_.end()) fail(errc::invalid_argument, "vm.block_free", fmt::format("{}", p), "not a block of this pool in use");
  const live_block b = it->second;
  live_.erase(it);
  if (b.slab) slabs_[b.slab].used--;
  kept_[{b.stream, b.size}].push_back(p);
  st_.in_use -= b.size;
  st_.kept += b.size;
}

std::uint64_t block_pool::release() {
  std::lock_guard l(mu_);
  return release_locked();
}

std::uint64_t block_pool::release_locked() {
  const std::uint64_t page = space_.page_bytes();
  std::uint64_t given = 0;
  auto give = [&](std::uintptr_t p, std::uint64_t n) {
    space_.free(reinterpret_cast<void*>(p));
    given += n;
    st_.pages -= n / page;
  };
  for (auto k = kept_.begin(); k != kept_.end();) {
    auto& [stream, size] = k->first;
    auto& v = k->second;
    if (size > small_max()) {
      for (void* p : v) give(reinterpret_cast<std::uintptr_t>(p), size);
      st_.kept -= size * v.size();
      v.clear();
    } else {
      // Pages of this class whose every block is kept: their blocks leave the list, the page the pool.
      std::erase_if(v, [&](void* p) {
        auto s = std::prev(slabs_.upper_bound(reinterpret_cast<std::uintptr_t>(p)));
        if (s->second.used) return false;
        st_.kept -= size;
        return true;
      });
      (void)stream;
    }
    k = v.empty() ? kept_.erase(k) : std::next(k);
  }
  for (auto s = slabs_.begin(); s != slabs_.end();) {
    if (s->second.used) {
      ++s;
      continue;
    }
    give(s->first, page);
    s = slabs_.erase(s);
  }
  return given;
}

block_pool_stats block_pool::stats() const {
  std::lock_guard l(mu_);
  return st_;
}

}  // namespace ferry::vm
