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

block_pool::block_pool(address_space& space, std::uint64_t keep, fence_fn fences)
    : space_(space), page_(space.page_bytes()), keep_(keep ? keep : space.device_capacity() / 4), fences_(std::move(fences)) {}

block_pool::~block_pool() {
  std::vector<std::uintptr_t> pages;
  {
    std::lock_guard l(mu_);
    for (auto& [p, b] : live_)
      if (!b.slab) pages.push_back(p);
    for (auto& [p, k] : kept_order_) pages.push_back(reinterpret_cast<std::uintptr_t>(p));
    for (auto& f : fenced_)
      if (!f.b.slab) pages.push_back(reinterpret_cast<std::uintptr_t>(f.p));
    for (auto& [p, s] : slabs_) pages.push_back(p);
  }
  give_back(pages);  // the space's free waits for its attached streams before the pages go
}

std::uint64_t block_pool::small_max() const noexcept { return std::bit_floor(std::max<std::uint64_t>(page_ / 4, least_class)); }

void block_pool::give_back(const std::vector<std::uintptr_t>& pages) {
  // The pool has forgotten them already: a page the space cannot take back (a transfer still pins it
  // past the deadline) stays the space's problem, never handed out again from here.
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

void* block_pool::alloc(std::uint64_t bytes, std::uintptr_t stream, bool* reused) {
  if (bytes == 0) fail(errc::invalid_argument, "vm.block_alloc", "0 bytes", "an allocation takes at least one byte");
  const bool small = bytes <= small_max();
  if (!small && bytes > ~std::uint64_t{0} - page_)
    fail(errc::out_of_memory, "vm.block_alloc", fmt::format("{} bytes", bytes), "larger than any address space");
  const std::uint64_t size = small ? std::max(least_class, std::bit_ceil(bytes)) : (bytes + page_ - 1) / page_ * page_;
  std::vector<std::uintptr_t> spare;  // kept blocks past the bound, from fenced ones kept now
  void* p = nullptr;
  bool kept = false;
  try {
    p = alloc_locked(size, small, stream, spare, kept);
  } catch (...) {
    give_back(spare);
    throw;
  }
  give_back(spare);
  if (reused) *reused = kept;
  return p;
}

void* block_pool::alloc_locked(std::uint64_t size, bool small, std::uintptr_t stream, std::vector<std::uintptr_t>& spare, bool& reused) {
  std::lock_guard l(mu_);
  reap_locked(spare);
  if (!spare.empty()) {  // before the space is asked: they may be what makes the request fit
    give_back(spare);
    spare.clear();
  }
  auto found = kept_.find({stream, size});
  if (found == kept_.end() || found->second.empty()) {
    void* fresh = space_alloc(small ? page_ : size);  // may release kept blocks (and erase their lists)
    ++st_.from_space;
    st_.pages += (small ? page_ : size) / page_;
    if (!small) {
      live_[reinterpret_cast<std::uintptr_t>(fresh)] = {stream, size, 0};
      st_.in_use += size;
      return fresh;
    }
    // A page of this class for this stream: its blocks are kept, the first handed out below.
    auto base = reinterpret_cast<std::uintptr_t>(fresh);
    slabs_[base] = {size, stream, 0};
    found = kept_.try_emplace({stream, size}).first;
    for (std::uint64_t off = page_ / size * size; off >= size; off -= size) found->second.push_back(reinterpret_cast<void*>(base + off - size));
    st_.kept += page_ / size * size;
  } else {
    ++st_.reused;
    reused = true;
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
  } else {
    kept_large_ -= size;
    // The block reused is its list's last kept, usually the latest freed: looked for from the back.
    auto o = std::find_if(kept_order_.rbegin(), kept_order_.rend(), [&](const auto& x) { return x.first == p; });
    if (o != kept_order_.rend()) kept_order_.erase(std::next(o).base());
  }
  live_[a] = {stream, size, page_of};
  return p;
}

void block_pool::free(void* p) {
  std::vector<std::uintptr_t> pages;
  try {
    std::lock_guard l(mu_);
    auto it = live_.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == live_.end()) fail(errc::invalid_argument, "vm.block_free", fmt::format("{}", p), "not a block of this pool in use");
    const live_block b = it->second;
    std::vector<std::unique_ptr<event>> markers;
    bool fenced = true;
    try {
      if (fences_) markers = fences_(b.stream);
    } catch (const std::exception& e) {
      // Unknown whether other streams still use it: not kept. Whole pages go back to the space,
      // whose free waits for its streams; a small block stays out of use with its page.
      log::warn("vm", "block pool: {} not kept (the other streams could not be fenced: {})", p, e.what());
      fenced = false;
    }
    if (fenced && markers.empty()) {
      keep_locked(p, b.stream, b.size, b.slab, pages);
    } else if (fenced) {
      fenced_.push_back({p, b, std::move(markers)});
      st_.fenced += b.size;
    } else if (!b.slab) {
      st_.pages -= b.size / page_;
      pages.push_back(reinterpret_cast<std::uintptr_t>(p));
    }
    live_.erase(it);  // placed: no longer the caller's
    st_.in_use -= b.size;
    reap_locked(pages);
  } catch (...) {
    give_back(pages);
    throw;
  }
  give_back(pages);
}

void block_pool::keep_locked(void* p, std::uintptr_t stream, std::uint64_t size, std::uintptr_t in_page, std::vector<std::uintptr_t>& out) {
  // All or nothing: what may throw (allocations) comes before any state changes.
  auto& list = kept_[{stream, size}];
  list.reserve(list.size() + 1);
  if (!in_page) {
    out.reserve(out.size() + kept_order_.size() + 1);
    kept_order_.emplace_back(p, key{stream, size});
  }
  list.push_back(p);
  st_.kept += size;
  if (in_page) {
    slabs_[in_page].used--;
    return;
  }
  kept_large_ += size;
  // Past the bound: the blocks freed longest ago go (this one last).
  while (kept_large_ > keep_ && !kept_order_.empty()) {
    auto [q, k] = kept_order_.front();
    kept_order_.pop_front();
    auto& v = kept_[k];
    std::erase(v, q);
    if (v.empty()) kept_.erase(k);
    kept_large_ -= k.second;
    st_.kept -= k.second;
    st_.pages -= k.second / page_;
    out.push_back(reinterpret_cast<std::uintptr_t>(q));
  }
}

void block_pool::reap_locked(std::vector<std::uintptr_t>& out) {
  // In the order freed: a block whose markers have not all passed stops the look (the later ones
  // were fenced later, their markers are behind).
  auto passed = [](const std::unique_ptr<event>& m) {
    try {
      return m->done();
    } catch (const std::exception&) {
      return true;  // its stream failed: done, successfully or not (as a marker's own query says)
    }
  };
  while (!fenced_.empty()) {
    auto& f = fenced_.front();
    if (!std::all_of(f.markers.begin(), f.markers.end(), passed)) return;
    keep_locked(f.p, f.b.stream, f.b.size, f.b.slab, out);
    st_.fenced -= f.b.size;
    fenced_.pop_front();
  }
}

std::uint64_t block_pool::release() {
  std::vector<std::uintptr_t> spare;
  std::uint64_t given = 0;
  {
    std::lock_guard l(mu_);
    const std::uint64_t before = st_.pages;
    reap_locked(spare);  // blocks whose markers passed since the last call are kept now, so given back too
    release_locked();
    given = (before - st_.pages) * page_;
  }
  give_back(spare);
  return given;
}

std::uint64_t block_pool::release_locked() {
  // The pool forgets what it gives back before the space takes it (see give_back).
  std::vector<std::uintptr_t> pages;
  std::uint64_t given = 0;
  for (auto& [p, k] : kept_order_) {
    pages.push_back(reinterpret_cast<std::uintptr_t>(p));
    given += k.second;
    kept_.erase(k);
  }
  kept_order_.clear();
  st_.kept -= kept_large_;
  kept_large_ = 0;
  for (auto s = slabs_.begin(); s != slabs_.end();) {
    if (s->second.used) {
      ++s;
      continue;
    }
    // Every block of this page is kept: they leave their list, the page the pool.
    const std::uintptr_t base = s->first;
    const std::uint64_t klass = s->second.klass;
    auto k = kept_.find({s->second.stream, klass});
    if (k != kept_.end()) {
      std::erase_if(k->second, [&](void* b) {
        auto a = reinterpret_cast<std::uintptr_t>(b);
        return a >= base && a < base + page_;
      });
      if (k->second.empty()) kept_.erase(k);
    }
    st_.kept -= page_ / klass * klass;
    pages.push_back(base);
    given += page_;
    s = slabs_.erase(s);
  }
  st_.pages -= given / page_;
  give_back(pages);  // under the lock: an allocation that made room waits for it anyway
  return given;
}

block_pool_stats block_pool::stats() const {
  std::lock_guard l(mu_);
  return st_;
}

}  // namespace ferry::vm
