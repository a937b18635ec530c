// The logical page table and its coherence protocol (see include/ferry/vm/page_table.hpp).
#include <ferry/core/error.hpp>
#include <ferry/vm/page_table.hpp>

#include "core/logging.hpp"

#include <fmt/format.h>

#include <bit>
#include <chrono>
#include <list>
#include <mutex>
#include <thread>

namespace ferry::vm {

page_mover::~page_mover() = default;

replacement parse_replacement(const std::string& s) {
  if (s == "lru") return replacement::lru;
  if (s == "fifo") return replacement::fifo;
  fail(errc::invalid_argument, "vm.policy", s, "expected lru or fifo");
}

namespace {
constexpr std::uint64_t bit(location l) { return 1ull << l; }
}  // namespace

struct page_table::impl {
  struct page {
    std::mutex mu;
    std::uint64_t valid = 0;  // mu
    location mapped = -1;     // mu
    bool writable = false;    // mu: how it is mapped
    bool read_mostly = false; // mu
    location preferred = -1;  // mu
    std::atomic<std::uint32_t> pins{0};  // changed under mu (pin) or without it (unpin)
  };
  // Replacement order of one device's resident pages: front = keep, back = evict first.
  struct order {
    std::mutex mu;
    std::list<std::uint64_t> l;
    std::vector<std::list<std::uint64_t>::iterator> where;
    std::vector<bool> in;
  };

  std::uint64_t n, bytes;
  std::vector<std::uint64_t> cap;
  replacement pol;
  page_mover& mv;
  std::unique_ptr<page[]> pg;
  std::vector<std::unique_ptr<order>> ord;          // per location (host's unused)
  std::unique_ptr<std::atomic<std::uint64_t>[]> used;  // pages holding a valid copy, per location
  struct counters {
    std::atomic<std::uint64_t> faults{0}, populated{0}, h2d{0}, d2h{0}, d2d{0}, duplicates{0}, invalidations{0}, evictions{0},
        writebacks{0}, clean_drops{0}, prefetches{0}, dontneeds{0};
  } st;

  impl(std::uint64_t pages, std::uint64_t page_bytes, std::vector<std::uint64_t> capacity, replacement p, page_mover& m)
      : n(pages), bytes(page_bytes), cap(std::move(capacity)), pol(p), mv(m), pg(new page[pages]) {
    expects(!cap.empty() && cap.size() <= static_cast<std::size_t>(max_locations), "vm.page_table", "locations",
            fmt::format("{} locations (host + devices) must be between 1 and {}", cap.size(), max_locations));
    used.reset(new std::atomic<std::uint64_t>[cap.size()]);
    for (std::size_t d = 0; d < cap.size(); ++d) {
      used[d] = 0;
      auto o = std::make_unique<order>();
      if (d != 0) {
        o->where.resize(n);
        o->in.assign(n, false);
      }
      ord.push_back(std::move(o));
    }
  }

  void check(std::uint64_t p, location at, const char* op) const {
    if (p >= n) fail(errc::out_of_range, op, fmt::format("page {}", p), fmt::format("the table has {} pages", n));
    if (at < 0 || static_cast<std::size_t>(at) >= cap.size())
      fail(errc::invalid_argument, op, fmt::format("location {}", at), fmt::format("locations are 0 (host) .. {}", cap.size() - 1));
  }

  // ---- replacement order (device locations) ----
  void order_insert(location d, std::uint64_t p) {
    auto& o = *ord[d];
    std::lock_guard l(o.mu);
    if (o.in[p]) return;
    o.l.push_front(p);
    o.where[p] = o.l.begin();
    o.in[p] = true;
  }
  void order_touch(location d, std::uint64_t p) {
    if (pol == replacement::fifo) return;  // FIFO: arrival order only
    auto& o = *ord[d];
    std::lock_guard l(o.mu);
    if (!o.in[p]) return;
    o.l.splice(o.l.begin(), o.l, o.where[p]);
  }
  void order_remove(location d, std::uint64_t p) {
    auto& o = *ord[d];
    std::lock_guard l(o.mu);
    if (!o.in[p]) return;
    o.l.erase(o.where[p]);
    o.in[p] = false;
  }

  // Drops location d's copy, pointing the mapping at another valid copy first if it was d's.
  void drop_copy_remapped(std::uint64_t p, page& g, location d) {
    if (g.mapped == d) {
      location other = std::countr_zero(g.valid & ~bit(d));
      mv.map(p, other, (g.valid & ~bit(d)) == bit(other));
      g.mapped = other;
      g.writable = (g.valid & ~bit(d)) == bit(other);
    }
    drop_copy(p, g, d);
    if (g.mapped >= 0 && !g.writable && g.valid == bit(g.mapped)) point_at(p, g, g.mapped);
  }
  // Drops location d's copy of a locked page.
  void drop_copy(std::uint64_t p, page& g, location d) {
    mv.drop(p, d);
    g.valid &= ~bit(d);
    if (d != host) {
      order_remove(d, p);
      used[d]--;
    }
  }
  void count_move(location from, location to) {
    if (from == host) st.h2d++;
    else if (to == host) st.d2h++;
    else st.d2d++;
  }

  // Evicts one page of device d other than `except`: the coldest one that is neither pinned nor
  // locked by someone else (try_lock only: a fault never waits for another page's lock).
  bool evict_one(location d, std::uint64_t except) {
    std::uint64_t victim = n;
    {
      auto& o = *ord[d];
      std::lock_guard l(o.mu);
      // First pass: pages that do not prefer this device (PREFERRED_LOCATION); then any.
      for (int pass = 0; pass < 2 && victim == n; ++pass)
        for (auto it = o.l.rbegin(); it != o.l.rend(); ++it) {
          if (*it == except) continue;
          if (!pg[*it].mu.try_lock()) continue;
          if (pg[*it].pins.load() != 0 || (pass == 0 && pg[*it].preferred == d)) {
            pg[*it].mu.unlock();
            continue;
          }
          victim = *it;
          break;
        }
    }
    if (victim == n) return false;
    page& g = pg[victim];
    std::lock_guard l(g.mu, std::adopt_lock);
    if (!(g.valid & bit(d))) return true;  // went meanwhile: room was made anyway
    if (!(g.valid & bit(host))) {  // dirty: the device holds the only copy
      mv.copy(victim, d, host);
      g.valid |= bit(host);
      st.writebacks++;
      st.d2h++;
    } else {
      st.clean_drops++;
    }
    drop_copy_remapped(victim, g, d);
    st.evictions++;
    return true;
  }

  // Takes room for one page on device d, evicting as needed; false when every resident page is
  // pinned or locked by someone else right now.
  bool try_reserve(location d, std::uint64_t p) {
    if (d == host) return true;
    for (;;) {
      std::uint64_t u = used[d].load();
      if (u < cap[d]) {
        if (used[d].compare_exchange_weak(u, u + 1)) return true;
        continue;
      }
      if (!evict_one(d, p)) return false;
    }
  }
  // No room now: let go of our own page for a moment -- the pages that block us may be locked by
  // faults that wait for room where ours lives -- then the caller starts over.
  void wait_for_room(location d, std::unique_lock<std::mutex>& l, deadline until) {
    thread_local std::chrono::steady_clock::time_point said{};
    if (std::chrono::steady_clock::now() - said > std::chrono::seconds(1)) {
      said = std::chrono::steady_clock::now();
      log::debug("vm", "waiting for room on device slot {} ({} of {} pages used, all pinned or busy)", d, used[d].load(), cap[d]);
    }
    if (std::chrono::steady_clock::now() >= until)
      fail(errc::out_of_memory, "vm.fault", fmt::format("device slot {}", d),
           fmt::format("capacity of {} pages reached and every resident page is pinned or busy", cap[d]));
    l.unlock();
    std::this_thread::sleep_for(std::chrono::microseconds(20));
    l.lock();
  }

  // Waits (page unlocked meanwhile) until nobody pins the page.
  void wait_unpinned(std::uint64_t p, std::unique_lock<std::mutex>& l, deadline until) {
    if (pg[p].pins.load() != 0) log::debug("vm", "page {} is pinned ({}): waiting for the unpin", p, pg[p].pins.load());
    while (pg[p].pins.load() != 0) {
      if (std::chrono::steady_clock::now() >= until)
        fail(errc::timeout, "vm.migrate", fmt::format("page {}", p), "pinned by a transfer past the deadline");
      l.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      l.lock();
    }
  }

  // The core of a fault / prefetch, page locked: `at` ends up with a valid copy and the mapping.
  void make_valid(std::uint64_t p, std::unique_lock<std::mutex>& l, location at, bool write, bool fault, deadline until) {
    while (!try_make_valid(p, l, at, write, fault, until)) {
    }
  }
  // One attempt; false when it had to wait for room (the page was unlocked meanwhile: start over).
  bool try_make_valid(std::uint64_t p, std::unique_lock<std::mutex>& l, location at, bool write, bool fault, deadline until) {
    page& g = pg[p];
    bool here = g.valid & bit(at);
    bool alone = g.valid == bit(at);
    if (here && (!write || alone)) {
      point_at(p, g, at);  // a READ_MOSTLY duplicate: switch the mapping, copy nothing
      if (at != host) order_touch(at, p);
      return true;
    }
    wait_unpinned(p, l, until);
    if ((g.valid & bit(at)) == 0 && !try_reserve(at, p)) {
      wait_for_room(at, l, until);
      return false;
    }
    if (fault) st.faults++;
    if (g.valid == 0) {
      try {
        mv.populate(p, at);
      } catch (...) {
        if (at != host) used[at]--;
        throw;
      }
      g.valid = bit(at);
      if (at != host) order_insert(at, p);
      st.populated++;
    } else if (!(g.valid & bit(at))) {
      location from = (g.valid & bit(host)) ? host : std::countr_zero(g.valid);
      try {
        mv.copy(p, from, at);
      } catch (...) {
        if (at != host) used[at]--;
        throw;
      }
      count_move(from, at);
      g.valid |= bit(at);
      if (at != host) order_insert(at, p);
      point_at(p, g, at);  // map the new copy before any old one goes: no access finds nothing mapped
      if (g.read_mostly && !write) {
        st.duplicates++;
      } else {
        for (location d = 0; d < static_cast<location>(cap.size()); ++d)
          if (d != at && (g.valid & bit(d))) drop_copy(p, g, d);
      }
    }
    point_at(p, g, at);
    if (write && g.valid != bit(at)) {
      for (location d = 0; d < static_cast<location>(cap.size()); ++d)
        if (d != at && (g.valid & bit(d))) {
          drop_copy(p, g, d);
          st.invalidations++;
        }
    }
    point_at(p, g, at);  // writable now if `at` is alone
    if (at != host) order_touch(at, p);
    return true;
  }
  // Maps the page at `at`, writable when `at` holds the only copy.
  void point_at(std::uint64_t p, page& g, location at) {
    bool w = g.valid == bit(at);
    if (g.mapped == at && g.writable == w) return;
    mv.map(p, at, w);
    g.mapped = at;
    g.writable = w;
  }
};

page_table::page_table(std::uint64_t pages, std::uint64_t page_bytes, std::vector<std::uint64_t> capacity, replacement policy,
                       page_mover& mover)
    : impl_(std::make_unique<impl>(pages, page_bytes, std::move(capacity), policy, mover)) {}
page_table::~page_table() = default;
std::uint64_t page_table::pages() const noexcept { return impl_->n; }
std::uint64_t page_table::page_bytes() const noexcept { return impl_->bytes; }

void page_table::lock_page(std::uint64_t page, location at, bool write, deadline until) {
  impl_->check(page, at, "vm.access");
  std::unique_lock l(impl_->pg[page].mu);
  impl_->make_valid(page, l, at, write, true, until);
  l.release();  // unlock_page unlocks
}
void page_table::unlock_page(std::uint64_t page) noexcept { impl_->pg[page].mu.unlock(); }

void page_table::access(std::uint64_t page, location at, bool write, deadline until) {
  access(page, at, write, until, [] {});
}

void page_table::prefetch(std::uint64_t page, location at, deadline until) {
  impl_->check(page, at, "vm.prefetch");
  std::unique_lock l(impl_->pg[page].mu);
  impl_->st.prefetches++;
  impl_->make_valid(page, l, at, false, false, until);
}

void page_table::dontneed(std::uint64_t page, location at, deadline until) {
  impl_->check(page, at, "vm.dontneed");
  if (at == host) fail(errc::invalid_argument, "vm.dontneed", fmt::format("page {}", page), "DONTNEED names a device, not the host");
  auto& g = impl_->pg[page];
  std::unique_lock l(g.mu);
  if (!(g.valid & bit(at))) return;
  impl_->wait_unpinned(page, l, until);
  if (!(g.valid & bit(at))) return;
  impl_->st.dontneeds++;
  if (!(g.valid & bit(host))) {
    impl_->mv.copy(page, at, host);
    g.valid |= bit(host);
    impl_->st.d2h++;
  }
  impl_->drop_copy_remapped(page, g, at);
}

void page_table::set_read_mostly(std::uint64_t page, bool on) {
  impl_->check(page, host, "vm.advise");
  auto& g = impl_->pg[page];
  std::lock_guard l(g.mu);
  g.read_mostly = on;
  // Duplicates end with the hint: keep the mapped copy (or any one). A pinned page keeps them (they
  // are equal copies; the next write invalidates them): pinned memory never goes away under a transfer.
  if (on || std::popcount(g.valid) <= 1 || g.pins.load() != 0) return;
  location keep = g.mapped >= 0 && (g.valid & bit(g.mapped)) ? g.mapped : std::countr_zero(g.valid);
  for (location d = 0; d < static_cast<location>(impl_->cap.size()); ++d)
    if (d != keep && (g.valid & bit(d))) impl_->drop_copy_remapped(page, g, d);
}

void page_table::set_preferred(std::uint64_t page, location at) {
  impl_->check(page, at == -1 ? host : at, "vm.advise");  // -1: no preference
  std::lock_guard l(impl_->pg[page].mu);
  impl_->pg[page].preferred = at;
}

bool page_table::evict_one(location at) {
  impl_->check(0, at, "vm.evict");
  if (at == host) return false;
  return impl_->evict_one(at, impl_->n);
}

void page_table::pin(std::uint64_t page) {
  impl_->check(page, host, "vm.pin");
  std::lock_guard l(impl_->pg[page].mu);  // not while the page is being changed
  impl_->pg[page].pins++;
}
void page_table::pin_in_place(std::uint64_t page, deadline until) {
  impl_->check(page, host, "vm.pin");
  auto& g = impl_->pg[page];
  std::unique_lock l(g.mu);
  location at = g.valid == 0 ? host : (g.mapped >= 0 && (g.valid & bit(g.mapped)) ? g.mapped : std::countr_zero(g.valid));
  impl_->make_valid(page, l, at, true, false, until);
  g.pins++;
}

void page_table::unpin(std::uint64_t page) {
  impl_->check(page, host, "vm.unpin");
  auto& pins = impl_->pg[page].pins;
  std::uint32_t v = pins.load();
  do {
    if (v == 0) fail(errc::invalid_argument, "vm.unpin", fmt::format("page {}", page), "not pinned");
  } while (!pins.compare_exchange_weak(v, v - 1));
}

page_snapshot page_table::snapshot(std::uint64_t page) const {
  impl_->check(page, host, "vm.snapshot");
  auto& g = impl_->pg[page];
  std::lock_guard l(g.mu);
  return {g.valid, g.mapped, g.read_mostly, g.preferred, g.pins.load()};
}

std::uint64_t page_table::resident(location at) const {
  impl_->check(0, at, "vm.resident");
  return impl_->used[at].load();
}

vm_stats page_table::stats() const {
  auto& s = impl_->st;
  std::uint64_t b = impl_->bytes;
  vm_stats v;
  v.faults = s.faults;
  v.populated = s.populated;
  v.migrations_h2d = s.h2d;
  v.migrations_d2h = s.d2h;
  v.migrations_d2d = s.d2d;
  v.bytes_h2d = s.h2d * b;
  v.bytes_d2h = s.d2h * b;
  v.bytes_d2d = s.d2d * b;
  v.duplicates = s.duplicates;
  v.invalidations = s.invalidations;
  v.evictions = s.evictions;
  v.writebacks = s.writebacks;
  v.clean_drops = s.clean_drops;
  v.prefetches = s.prefetches;
  v.dontneeds = s.dontneeds;
  return v;
}

}  // namespace ferry::vm
