// The logical page table and its coherence protocol (see include/ferry/vm/page_table.hpp).
#include <ferry/core/error.hpp>
#include <ferry/vm/page_table.hpp>

#include "core/backoff.hpp"
#include "core/logging.hpp"
#include "vm/replacement_order.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <set>
#include <mutex>
#include <thread>

namespace ferry::vm {

page_mover::~page_mover() = default;

std::uint64_t page_mover::start(const std::vector<step>& steps) {
  std::size_t i = 0;
  std::vector<char> copied(steps.size(), 0), mapped(steps.size(), 0);
  try {
    for (; i < steps.size(); ++i) {
      auto& s = steps[i];
      if (s.copy) {
        copy(s.page, s.from, s.to);
        copied[i] = 1;
      }
      if (s.map) {
        map(s.page, s.to, s.writable);
        mapped[i] = 1;
      }
    }
  } catch (...) {
    // Put back what was done: old mappings first, then the new copies go.
    for (std::size_t j = 0; j < steps.size(); ++j) {
      auto& s = steps[j];
      try {
        if (mapped[j] && s.was_at >= 0) map(s.page, s.was_at, s.was_writable);
      } catch (const std::exception& e) {
        log::error("vm", "page {}: restoring its mapping after a failed migration failed: {}", s.page, e.what());
      }
      if (copied[j]) drop(s.page, s.to);
    }
    throw;
  }
  return 0;
}

void page_mover::finish(std::uint64_t) {}

namespace {
constexpr std::uint64_t bit(location l) { return 1ull << l; }
std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

// A page's state and the table's counters (page_table::impl's, by alias).
namespace page_table_detail {
struct page_state {
  std::mutex mu;
  std::uint64_t valid = 0;  // mu
  location mapped = -1;     // mu
  bool writable = false;    // mu: how it is mapped
  bool read_mostly = false; // mu
  location preferred = -1;  // mu
  std::atomic<std::uint32_t> pins{0};  // changed under mu (pin) or without it (unpin)
  std::int64_t evicted = 0;     // mu: when it was last evicted from a device (steady ns; 0: not since its last hold)
  std::int64_t held_until = 0;  // mu: thrashing -- PREFETCH leaves it where it is until then
  // Return (page_table.hpp): the device a CPU fault took it from (-1: not taken), when; when it
  // last went back; how long the CPU keeps it (held until, and the doubling).
  location came_from = -1;           // mu
  std::int64_t taken_at = 0, returned_at = 0, cpu_hold_until = 0;  // mu
  int hold_shift = 0;                // mu
};
struct table_counters {
  std::atomic<std::uint64_t> faults{0}, populated{0}, h2d{0}, d2h{0}, d2d{0}, duplicates{0}, invalidations{0}, evictions{0},
      writebacks{0}, clean_drops{0}, prefetches{0}, dontneeds{0}, fault_ahead{0}, batches{0}, thrash_holds{0},
      held_prefetches{0}, returns{0}, return_holds{0};
};
}  // namespace page_table_detail

struct page_table::impl {
  using page = page_table_detail::page_state;

  std::uint64_t n, bytes;
  std::vector<std::uint64_t> cap;
  replacement pol;
  page_mover& mv;
  thrash_policy thrash;
  std::chrono::nanoseconds return_hold;
  std::unique_ptr<page[]> pg;
  std::mutex taken_mu;
  std::set<std::uint64_t> taken;  // taken_mu: pages with came_from >= 0
  std::atomic<std::uint64_t> ntaken{0};
  std::vector<std::unique_ptr<replacement_order>> ord;  // per device location (the host's: null)
  std::unique_ptr<std::atomic<std::uint64_t>[]> used;  // pages holding a valid copy, per location
  page_table_detail::table_counters st;

  impl(std::uint64_t pages, std::uint64_t page_bytes, std::vector<std::uint64_t> capacity, replacement p, page_mover& m,
       thrash_policy t, std::chrono::nanoseconds hold)
      : n(pages), bytes(page_bytes), cap(std::move(capacity)), pol(p), mv(m), thrash(t), return_hold(hold), pg(new page[pages]) {
    expects(!cap.empty() && cap.size() <= static_cast<std::size_t>(max_locations), "vm.page_table", "locations",
            fmt::format("{} locations (host + devices) must be between 1 and {}", cap.size(), max_locations));
    used.reset(new std::atomic<std::uint64_t>[cap.size()]);
    for (std::size_t d = 0; d < cap.size(); ++d) {
      used[d] = 0;
      ord.push_back(d == 0 ? nullptr : std::make_unique<replacement_order>(n, pol != replacement::fifo));
    }
  }

  void check(std::uint64_t p, location at, const char* op) const {
    if (p >= n) fail(errc::out_of_range, op, fmt::format("page {}", p), fmt::format("the table has {} pages", n));
    if (at < 0 || static_cast<std::size_t>(at) >= cap.size())
      fail(errc::invalid_argument, op, fmt::format("location {}", at), fmt::format("locations are 0 (host) .. {}", cap.size() - 1));
  }

  // ---- return (page locked) ----
  // A CPU fault moved the page from device `from` to the host; `touched`: the CPU's access was to
  // this page (not one moved ahead with it), the only kind that shows the CPU keeps using it.
  void take(std::uint64_t p, page& g, location from, bool touched) {
    if (from == host) return;
    std::int64_t t = now_ns();
    if (touched && g.returned_at != 0 && t - g.returned_at < return_hold.count()) {
      // Taken back soon after its return: the CPU keeps using it. Held, longer each time.
      g.hold_shift = std::min(g.hold_shift + 1, 7);
      g.cpu_hold_until = t + (return_hold.count() << (g.hold_shift - 1));
      st.return_holds++;
    } else if (touched && g.returned_at != 0) {
      g.hold_shift = 0;
    }
    g.taken_at = t;
    if (g.came_from < 0) {
      std::lock_guard l(taken_mu);
      taken.insert(p);
      ntaken++;
    }
    g.came_from = from;
  }
  // The page is no longer the CPU's (it moved to a device, was freed, or a hint says so).
  void untake(std::uint64_t p, page& g) {
    if (g.came_from < 0) return;
    g.came_from = -1;
    std::lock_guard l(taken_mu);
    taken.erase(p);
    ntaken--;
  }
  // Where a taken page goes back to, or -1 when it stays (not taken, held, too recent, pinned,
  // PREFERRED_LOCATION host).
  location return_target(const page& g, std::int64_t t, std::chrono::nanoseconds quiet) const {
    if (g.came_from < 0 || g.valid != bit(host) || g.pins.load() != 0 || g.preferred == host) return -1;
    if (t < g.cpu_hold_until || t - g.taken_at < quiet.count()) return -1;
    return g.preferred > 0 ? g.preferred : g.came_from;
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
  // Drops location d's copy of a locked page; `release_room` false when its room on d is handed to
  // another page directly (batched eviction).
  void drop_copy(std::uint64_t p, page& g, location d, bool release_room = true) {
    mv.drop(p, d);
    g.valid &= ~bit(d);
    if (d != host) {
      ord[d]->remove(p);
      if (release_room) used[d]--;
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
    ord[d]->coldest([&](auto first, auto last) {
      // First pass: pages that do not prefer this device (PREFERRED_LOCATION); then any.
      for (int pass = 0; pass < 2 && victim == n; ++pass)
        for (auto it = first; it != last; ++it) {
          if (*it == except) continue;
          if (!pg[*it].mu.try_lock()) continue;
          if (pg[*it].pins.load() != 0 || (pass == 0 && pg[*it].preferred == d)) {
            pg[*it].mu.unlock();
            continue;
          }
          victim = *it;
          break;
        }
    });
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
    g.evicted = now_ns();
    st.evictions++;
    return true;
  }

  // Takes room for one page on device d, evicting as needed; false when every resident page is
  // pinned or locked by someone else right now.
  bool try_reserve(location d, std::uint64_t p) {
    if (d == host) return true;
    while (take_room(d, 1) == 0)
      if (!evict_one(d, p)) return false;
    return true;
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
    using namespace std::chrono_literals;
    ferry::detail::backoff wait({.nap = 50us, .most = 50us});  // a transfer's pin lasts a copy: no hurry
    while (pg[p].pins.load() != 0) {
      if (std::chrono::steady_clock::now() >= until)
        fail(errc::timeout, "vm.migrate", fmt::format("page {}", p), "pinned by a transfer past the deadline");
      l.unlock();
      wait.pause();
      l.lock();
    }
  }

  // PREFETCH to device `at` of a locked page: true when the page thrashes and stays where it is.
  // Only a page with a valid copy elsewhere qualifies (a first touch populates), and never one
  // whose PREFERRED_LOCATION is `at` (the caller said it belongs there).
  bool held(page& g, location at) {
    if (thrash.lapse.count() <= 0 || at == host || g.valid == 0 || (g.valid & bit(at)) || g.preferred == at) return false;
    std::int64_t t = now_ns();
    if (t >= g.held_until) {
      if (g.evicted == 0 || t - g.evicted >= thrash.lapse.count()) return false;
      g.held_until = t + thrash.hold.count();
      g.evicted = 0;  // after the hold, only a new eviction makes it thrash again
      st.thrash_holds++;
    }
    st.held_prefetches++;
    return true;
  }
  void prefetch_one(std::uint64_t p, location at, deadline until) {
    std::unique_lock l(pg[p].mu);
    if (held(pg[p], at)) return;
    make_valid(p, l, at, false, false, until);
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
      if (at != host) ord[at]->touch(p);
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
      if (at != host) ord[at]->insert(p);
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
      if (at != host) untake(p, g);
      else if (fault && !g.read_mostly) take(p, g, from, true);
      g.valid |= bit(at);
      if (at != host) ord[at]->insert(p);
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
    if (at != host) ord[at]->touch(p);
    return true;
  }
  // ---- batched migrations ----
  enum class range_mode { prefetch, fault, give_back };
  struct batch {
    std::vector<std::uint64_t> held;       // pages this batch has locked (ascending)
    std::vector<page_mover::step> steps;   // pages moving to `at`
    location at = host;
    std::uint64_t fault_page = ~0ull;       // fault mode: the page the CPU touched
    std::uint64_t ticket = 0;
    bool open = false;                      // started, not finished
  };
  bool holds(const batch* b, std::uint64_t p) const {
    return b && std::find(b->held.begin(), b->held.end(), p) != b->held.end();
  }
  void unlock_all(batch& b) noexcept {
    for (auto p : b.held) pg[p].mu.unlock();
    b.held.clear();
    b.steps.clear();
    b.open = false;
  }
  void give_back_room(batch& b) noexcept {
    if (b.at == host) return;
    used[b.at] -= b.steps.size();
  }

  // Up to k free places on device d (no eviction).
  std::uint64_t take_room(location d, std::uint64_t k) {
    std::uint64_t got = 0;
    while (got < k) {
      std::uint64_t u = used[d].load();
      if (u >= cap[d]) break;
      if (used[d].compare_exchange_weak(u, u + 1)) ++got;
    }
    return got;
  }

  // Evicts up to k pages of device d as one batch; their room passes to the caller (used[d] is not
  // lowered). Victims are taken with try_lock only and never among pages `a` or `b` hold.
  std::uint64_t evict_batch(location d, std::uint64_t k, const batch* a, const batch* b) {
    std::vector<std::uint64_t> victims;
    ord[d]->coldest([&](auto first, auto last) {
      for (int pass = 0; pass < 2 && victims.size() < k; ++pass)
        for (auto it = first; it != last && victims.size() < k; ++it) {
          std::uint64_t v = *it;
          if (holds(a, v) || holds(b, v) || std::find(victims.begin(), victims.end(), v) != victims.end()) continue;
          if (!pg[v].mu.try_lock()) continue;
          if (pg[v].pins.load() != 0 || (pass == 0 && pg[v].preferred == d) || !(pg[v].valid & bit(d))) {
            pg[v].mu.unlock();
            continue;
          }
          victims.push_back(v);
        }
    });
    if (victims.empty()) return 0;
    std::vector<page_mover::step> steps;
    for (auto v : victims) {
      page& g = pg[v];
      std::uint64_t after = (g.valid | bit(host)) & ~bit(d);
      steps.push_back({v, d, host, !(g.valid & bit(host)), g.mapped == d, after == bit(host), g.mapped, g.writable});
    }
    try {
      mv.finish(mv.start(steps));
    } catch (...) {
      for (auto v : victims) pg[v].mu.unlock();
      throw;
    }
    st.batches++;
    for (auto& s : steps) {
      page& g = pg[s.page];
      if (s.copy) {
        st.writebacks++;
        st.d2h++;
      } else {
        st.clean_drops++;
      }
      g.valid |= bit(host);
      if (s.map) {
        g.mapped = host;
        g.writable = s.writable;
      }
      drop_copy(s.page, g, d, false);
      g.evicted = now_ns();
      st.evictions++;
      if (g.mapped >= 0 && !g.writable && g.valid == bit(g.mapped)) point_at(s.page, g, g.mapped);
      g.mu.unlock();
    }
    return victims.size();
  }

  // Locks pages [a, e) into `b` and picks those that move to `at` in this batch; pages needing the
  // single-page path go to `slow` (prefetch mode; in fault mode only the faulting page does). Blocks
  // on a page lock only while holding nothing but this batch's lower pages: `prev` is finished first.
  void prepare(batch& b, std::uint64_t a, std::uint64_t e, location at, range_mode mode, std::uint64_t fault_page,
               std::vector<std::uint64_t>& slow, batch& prev) {
    b.at = at;
    b.fault_page = fault_page;
    for (std::uint64_t p = a; p < e; ++p) {
      page& g = pg[p];
      if (!g.mu.try_lock()) {
        if (prev.open) complete(prev, mode);
        g.mu.lock();
      }
      b.held.push_back(p);
      if (mode == range_mode::give_back) {
        if (return_target(g, now_ns(), std::chrono::nanoseconds::zero()) == at)
          b.steps.push_back({p, host, at, true, true, true, g.mapped, g.writable});
        continue;
      }
      bool odd = mode == range_mode::prefetch || p == fault_page;
      if (g.valid & bit(at)) {
        if ((g.valid == bit(at) || g.read_mostly) && g.mapped == at) {
          if (at != host) ord[at]->touch(p);
        } else if (odd) {
          slow.push_back(p);
        }
        continue;
      }
      if (g.valid == 0 || g.pins.load() != 0) {
        if (odd) slow.push_back(p);
        continue;
      }
      if (mode == range_mode::prefetch && held(g, at)) continue;
      location from = (g.valid & bit(host)) ? host : std::countr_zero(g.valid);
      std::uint64_t after = g.read_mostly ? (g.valid | bit(at)) : bit(at);
      b.steps.push_back({p, from, at, true, true, after == bit(at), g.mapped, g.writable});
      b.steps.back().cpu = mode == range_mode::fault && at == host;  // the CPU faulted: it reads these next
    }
    if (at == host || b.steps.empty()) return;
    std::uint64_t need = b.steps.size();
    std::uint64_t got = take_room(at, need);
    while (got < need && mode != range_mode::give_back) {  // pages go back into free room only
      std::uint64_t freed = evict_batch(at, need - got, &b, prev.open ? &prev : nullptr);
      if (freed == 0) break;
      got += freed;
      got += take_room(at, need - got);
    }
    // No room for the rest now (everything else is pinned or busy): they wait singly, later.
    while (b.steps.size() > got) {
      if (mode == range_mode::prefetch || (mode == range_mode::fault && b.steps.back().page == fault_page))
        slow.push_back(b.steps.back().page);
      b.steps.pop_back();
    }
  }

  void complete(batch& b, range_mode mode) {
    try {
      mv.finish(b.ticket);
    } catch (...) {
      give_back_room(b);
      unlock_all(b);
      throw;
    }
    st.batches++;
    for (auto& s : b.steps) {
      page& g = pg[s.page];
      count_move(s.from, s.to);
      g.valid |= bit(s.to);
      if (s.to != host) ord[s.to]->insert(s.page);
      g.mapped = s.to;
      g.writable = s.writable;
      if (s.to != host) {
        untake(s.page, g);
        if (mode == range_mode::give_back) {
          g.returned_at = now_ns();
          st.returns++;
        }
      } else if (s.cpu && !g.read_mostly) {
        take(s.page, g, s.from, s.page == b.fault_page);
      }
      if (g.read_mostly) {
        st.duplicates++;
      } else {
        for (location d = 0; d < static_cast<location>(cap.size()); ++d)
          if (d != s.to && (g.valid & bit(d))) drop_copy(s.page, g, d);
      }
    }
    unlock_all(b);
  }

  // The batched range walk behind prefetch_range / fault_range. Returns the pages it moved.
  std::uint64_t range(std::uint64_t first, std::uint64_t end, location at, range_mode mode, std::uint64_t fault_page,
                      std::uint64_t per, std::vector<std::uint64_t>& slow) {
    batch prev, cur;
    std::uint64_t moved = 0;
    try {
      for (std::uint64_t a = first; a < end;) {
        // The last batch's remaps have no copies left to hide under: batches halve towards the end
        // (each still hides most of its predecessor's remaps), so that tail shrinks to one page's.
        std::uint64_t e = a + std::min(per, std::max<std::uint64_t>(1, (end - a) / 2));
        prepare(cur, a, e, at, mode, fault_page, slow, prev);
        a = e;
        if (!cur.steps.empty()) {
          try {
            cur.ticket = mv.start(cur.steps);
          } catch (...) {
            give_back_room(cur);
            throw;
          }
          cur.open = true;
          moved += cur.steps.size();
        }
        if (prev.open) complete(prev, mode);
        if (cur.open) {
          std::swap(prev, cur);
        } else {
          unlock_all(cur);
        }
      }
      if (prev.open) complete(prev, mode);
    } catch (...) {
      // A started batch is finished (or rolled back by its failure) before its pages are let go.
      for (batch* b : {&prev, &cur}) {
        if (!b->open) continue;
        try {
          complete(*b, mode);
        } catch (const std::exception& e) {
          log::error("vm", "a batched migration failed while another was being unwound: {}", e.what());
        }
      }
      unlock_all(cur);
      unlock_all(prev);
      throw;
    }
    return moved;
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
                       page_mover& mover, thrash_policy thrash, std::chrono::nanoseconds return_hold)
    : impl_(std::make_unique<impl>(pages, page_bytes, std::move(capacity), policy, mover, thrash, return_hold)) {}
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
  impl_->st.prefetches++;
  impl_->prefetch_one(page, at, until);
}

namespace {
// A range moves in batches of at most `want` pages, and in at least `min_batches` batches when it
// has the pages: the pipeline overlaps one batch's copies with the next one's remaps, so a range of
// a single batch would leave the copy engine idle during all the remaps (and the remaps of host
// chunks cost about as much as the copies: docs/design/unified-memory.md).
constexpr std::uint64_t min_batches = 8;
std::uint64_t batch_pages(std::uint64_t want, const std::vector<std::uint64_t>& cap, location at, std::uint64_t pages) {
  std::uint64_t b = std::max<std::uint64_t>(1, std::min(want, (pages + min_batches - 1) / min_batches));
  // Two batches are in flight and victims are made room for: a quarter of the device at most.
  if (at != host) b = std::min(b, std::max<std::uint64_t>(1, cap[at] / 4));
  return b;
}
}  // namespace

void page_table::prefetch_range(std::uint64_t first, std::uint64_t end, location at, std::uint64_t batch,
                                std::chrono::nanoseconds per_batch) {
  auto& I = *impl_;
  I.check(0, at, "vm.prefetch");
  if (first >= end) return;
  I.check(end - 1, at, "vm.prefetch");
  I.st.prefetches += end - first;
  std::vector<std::uint64_t> slow;
  I.range(first, end, at, impl::range_mode::prefetch, I.n, batch_pages(batch, I.cap, at, end - first), slow);
  for (auto p : slow) I.prefetch_one(p, at, deadline_after(per_batch));
}

void page_table::fault_range(std::uint64_t page, std::uint64_t end, location at, bool write, std::uint64_t batch,
                             std::chrono::nanoseconds per_batch, const std::function<void()>& use) {
  auto& I = *impl_;
  I.check(page, at, "vm.access");
  end = std::min(end, I.n);
  if (end > page) {  // the batched path even for one page: a host target is granted to the CPU in the same call
    std::vector<std::uint64_t> slow;
    bool moved_it = false;
    {
      auto s = snapshot(page);
      moved_it = !(s.valid & bit(at)) && s.valid != 0 && s.pins == 0;
    }
    std::uint64_t moved = I.range(page, end, at, impl::range_mode::fault, page, batch_pages(batch, I.cap, at, end - page), slow);
    if (moved > 0) {
      if (moved_it) I.st.faults++;
      I.st.fault_ahead += moved - (moved_it ? 1 : 0);
    }
  }
  access(page, at, write, deadline_after(per_batch), [&] {  // the faulting page's own semantics (a write: exclusive)
    if (use) use();
  });
}

std::uint64_t page_table::move_ahead(std::uint64_t first, std::uint64_t end, location at, std::uint64_t batch) {
  auto& I = *impl_;
  I.check(0, at, "vm.access");
  end = std::min(end, I.n);
  if (first >= end) return 0;
  std::vector<std::uint64_t> slow;  // stays empty: no page is the faulting one
  std::uint64_t moved = I.range(first, end, at, impl::range_mode::fault, I.n, batch_pages(batch, I.cap, at, end - first), slow);
  I.st.fault_ahead += moved;
  return moved;
}

location page_table::populate_fresh(std::uint64_t page, location prefer, deadline until) {
  auto& I = *impl_;
  I.check(page, prefer, "vm.alloc");
  auto& g = I.pg[page];
  std::unique_lock l(g.mu);
  I.wait_unpinned(page, l, until);
  g.preferred = -1;
  g.read_mostly = false;
  g.evicted = g.held_until = 0;
  I.untake(page, g);
  g.returned_at = g.cpu_hold_until = 0;
  g.hold_shift = 0;
  location at = prefer != host && ((g.valid & bit(prefer)) || I.take_room(prefer, 1) == 1) ? prefer : host;
  bool had = g.valid & bit(at);
  try {
    I.mv.populate(page, at);
  } catch (...) {
    if (at != host && !had) I.used[at]--;
    throw;
  }
  g.valid |= bit(at);
  if (at != host && !had) I.ord[at]->insert(page);
  // The zeroed copy is the only one: the others (an earlier allocation's) go, the mapping moved
  // off them first.
  for (location d = 0; d < static_cast<location>(I.cap.size()); ++d)
    if (d != at && (g.valid & bit(d))) I.drop_copy_remapped(page, g, d);
  I.point_at(page, g, at);
  I.st.populated++;
  return at;
}

void page_table::discard(std::uint64_t page, deadline until) {
  auto& I = *impl_;
  I.check(page, host, "vm.free");
  auto& g = I.pg[page];
  std::unique_lock l(g.mu);
  I.wait_unpinned(page, l, until);
  if (g.mapped >= 0) {
    I.mv.unmap(page);
    g.mapped = -1;
    g.writable = false;
  }
  for (location d = 0; d < static_cast<location>(I.cap.size()); ++d)
    if (g.valid & bit(d)) I.drop_copy(page, g, d);
  g.preferred = -1;
  g.read_mostly = false;
  I.untake(page, g);
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
  if (on) impl_->untake(page, g);  // duplicated by PREFETCHes from now on: placed by the program
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
  if (at == host) impl_->untake(page, impl_->pg[page]);
}

void page_table::locked(std::uint64_t page, const std::function<void()>& f) {
  impl_->check(page, host, "vm.locked");
  std::lock_guard l(impl_->pg[page].mu);
  f();
}

std::uint64_t page_table::cpu_taken() const noexcept { return impl_->ntaken.load(); }

std::uint64_t page_table::return_taken(std::chrono::nanoseconds quiet, std::uint64_t max_pages, std::uint64_t batch,
                                       const std::function<bool()>& ready, std::pair<std::uint64_t, std::uint64_t> keep) {
  auto& I = *impl_;
  if (I.ntaken.load() == 0) return 0;
  bool room = false;
  for (location d = 1; d < static_cast<location>(I.cap.size()); ++d) room = room || I.used[d].load() < I.cap[d];
  if (!room) return 0;
  std::vector<std::uint64_t> cand;
  {
    std::lock_guard l(I.taken_mu);
    cand.assign(I.taken.begin(), I.taken.end());
  }
  // Eligible pages and their devices, then one batched range walk per run of consecutive pages
  // bound for one device (prepare() checks each page again under its lock).
  std::vector<std::pair<std::uint64_t, location>> go;
  std::int64_t t = now_ns();
  for (auto p : cand) {
    if (go.size() >= max_pages) break;
    if (p >= keep.first && p < keep.second) continue;
    auto& g = I.pg[p];
    std::unique_lock l(g.mu, std::try_to_lock);  // a page being changed is not waited for
    if (!l) continue;
    location to = I.return_target(g, t, quiet);
    if (to > 0) go.emplace_back(p, to);
  }
  if (go.empty() || (ready && !ready())) return 0;
  std::uint64_t moved = 0;
  for (std::size_t i = 0; i < go.size();) {
    std::size_t j = i + 1;
    while (j < go.size() && go[j].first == go[j - 1].first + 1 && go[j].second == go[i].second) ++j;
    location to = go[i].second;
    if (I.used[to].load() < I.cap[to]) {
      std::vector<std::uint64_t> slow;
      std::uint64_t first = go[i].first, end = go[j - 1].first + 1;
      moved += I.range(first, end, to, impl::range_mode::give_back, I.n, batch_pages(batch, I.cap, to, end - first), slow);
    }
    i = j;
  }
  return moved;
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
  v.fault_ahead = s.fault_ahead;
  v.batches = s.batches;
  v.thrash_holds = s.thrash_holds;
  v.held_prefetches = s.held_prefetches;
  v.returns = s.returns;
  v.return_holds = s.return_holds;
  return v;
}

}  // namespace ferry::vm
