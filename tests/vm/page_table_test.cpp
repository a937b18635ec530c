// The unified-memory policy layer (logical page table + coherence) against a fake backend that
// keeps one value per physical copy and checks every hook call: copies only from existing copies,
// mappings only to existing copies, never more pages on a device than its capacity.
#include <ferry/vm/page_table.hpp>
#include <ferry/settings.hpp>

#include "support/errors.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <bit>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <thread>

using ferry::deadline;
using ferry::deadline_after;
namespace test = ferry::test;
using namespace ferry::vm;
using ::testing::HasSubstr;

namespace {

struct fake_mover final : page_mover {
  fake_mover(std::uint64_t pages, std::vector<std::uint64_t> capacity)
      : n(pages), cap(std::move(capacity)), present(cap.size() * n), val(cap.size() * n, 0), mapped(n), writable(n), occ(cap.size()) {
    for (auto& m : mapped) m = -1;
  }
  std::size_t at(location l, std::uint64_t p) const { return static_cast<std::size_t>(l) * n + p; }
  void violation(const std::string& why) {
    std::lock_guard l(mu);
    if (first.empty()) first = why;
  }
  void grow(location l) {
    auto o = ++occ[l];
    if (l != host && static_cast<std::uint64_t>(o) > cap[l]) violation("device " + std::to_string(l) + " over capacity");
  }
  void copy(std::uint64_t p, location from, location to) override {
    if (!present[at(from, p)]) violation("copy of page " + std::to_string(p) + " from a location without it");
    if (!present[at(to, p)]) {
      present[at(to, p)] = true;
      grow(to);
    }
    val[at(to, p)] = val[at(from, p)];
    copies++;
  }
  void populate(std::uint64_t p, location l) override {
    if (present[at(l, p)]) violation("populate of a present copy");
    present[at(l, p)] = true;
    val[at(l, p)] = 0;
    grow(l);
  }
  void unmap(std::uint64_t p) override { mapped[p] = -1; }
  void drop(std::uint64_t p, location l) noexcept override {
    if (!present[at(l, p)]) violation("drop of a missing copy");
    if (mapped[p] == l) violation("drop of the mapped copy of page " + std::to_string(p));
    present[at(l, p)] = false;
    --occ[l];
  }
  void map(std::uint64_t p, location l, bool w) override {
    if (!present[at(l, p)]) violation("mapping page " + std::to_string(p) + " to a location without it");
    mapped[p] = l;
    writable[p] = w;
  }
  // Batches as a real backend runs them: copies at start, mappings at finish, and the page table
  // may start another batch in between. Every `inject`-th start fails (nothing done).
  std::uint64_t start(const std::vector<step>& s) override {
    if (inject && ++starts % inject == 0) throw ferry::error(ferry::errc::out_of_memory, "fake.start", "batch", "injected failure");
    for (auto& x : s) {
      if (x.map && mapped[x.page] != x.was_at) violation("a batch step with the wrong old mapping for page " + std::to_string(x.page));
      if (x.copy) copy(x.page, x.from, x.to);
    }
    std::lock_guard l(mu);
    flights[++ticket] = s;
    in_flight = std::max<std::uint64_t>(in_flight, flights.size());
    return ticket;
  }
  void finish(std::uint64_t t) override {
    std::vector<step> s;
    {
      std::lock_guard l(mu);
      s = std::move(flights.at(t));
      flights.erase(t);
    }
    for (auto& x : s)
      if (x.map) map(x.page, x.to, x.writable);
    batches++;
  }
  std::uint64_t present_mask(std::uint64_t p) const {
    std::uint64_t m = 0;
    for (location l = 0; l < static_cast<location>(cap.size()); ++l)
      if (present[at(l, p)]) m |= 1ull << l;
    return m;
  }

  std::uint64_t n;
  std::vector<std::uint64_t> cap;
  std::vector<std::atomic<bool>> present;
  std::vector<std::uint64_t> val;  // changed under the page's lock only
  std::vector<std::atomic<int>> mapped;
  std::vector<std::atomic<bool>> writable;  // how the page is mapped: a write needs no fault
  std::vector<std::atomic<std::int64_t>> occ;
  std::atomic<std::uint64_t> copies{0}, batches{0};
  int inject = 0;
  std::atomic<int> starts{0};
  std::map<std::uint64_t, std::vector<step>> flights;  // mu
  std::uint64_t ticket = 0, in_flight = 0;              // mu
  std::mutex mu;
  std::string first;  // first violation
};

deadline soon() { return deadline_after(std::chrono::seconds(10)); }

}  // namespace

// Random concurrent faults, prefetches, DONTNEED, READ_MOSTLY changes, pins and evictions from 8
// threads against a reference model (the last value written to each page): every read sees the last
// write, every physical copy holds it, the backend is only asked for legal things, capacities hold.
TEST(VmPageTable, RandomConcurrentOperationsKeepCoherenceAndCapacity) {
  constexpr std::uint64_t pages = 32;
  for (replacement pol : {replacement::lru, replacement::fifo}) {
    fake_mover mv(pages, {0, 6, 4});
    mv.inject = 41;  // some batches fail: the table must be as before them
    // LRU runs with thrashing mitigation too: held pages take the "leave it" path at random moments.
    thrash_policy thrash;
    if (pol == replacement::lru) thrash = {std::chrono::milliseconds(1), std::chrono::microseconds(200)};
    page_table t(pages, 2 << 20, {0, 6, 4}, pol, mv, thrash);
    std::vector<std::uint64_t> model(pages, 0);  // under the page's lock
    std::atomic<std::uint64_t> next{1}, reads{0}, writes{0}, bad_reads{0}, incoherent{0}, moved_while_pinned{0};
    std::atomic<int> errors{0}, injected{0};
    std::vector<std::thread> th;
    for (int k = 0; k < 8; ++k)
      th.emplace_back([&, k] {
        std::mt19937_64 rng(1000 + k);
        for (int i = 0; i < 2500; ++i) {
          std::uint64_t p = rng() % pages;
          location l = static_cast<location>(rng() % 3);
          try {
            switch (rng() % 12) {
              case 0: case 1: case 2: case 3: case 4: {  // an access: read or write through `l`
                bool w = rng() % 3 == 0;
                t.access(p, l, w, soon(), [&] {
                  if (mv.mapped[p] != l) incoherent++;
                  // A writable mapping while other copies exist: a write would not invalidate them.
                  if (mv.writable[p] && std::popcount(mv.present_mask(p)) > 1) incoherent++;
                  if (w) {
                    std::uint64_t v = next++;
                    mv.val[mv.at(l, p)] = v;
                    model[p] = v;
                    writes++;
                  } else {
                    if (mv.val[mv.at(l, p)] != model[p]) bad_reads++;
                    reads++;
                  }
                  for (location x = 0; x < 3; ++x)
                    if (mv.present[mv.at(x, p)] && mv.val[mv.at(x, p)] != model[p]) incoherent++;
                });
                break;
              }
              case 5: t.prefetch(p, l, soon()); break;
              case 6: t.dontneed(p, 1 + static_cast<location>(rng() % 2), soon()); break;
              case 7: t.set_read_mostly(p, rng() % 2); break;
              case 8: {
                t.pin(p);
                auto a = t.snapshot(p).valid;
                std::this_thread::sleep_for(std::chrono::microseconds(rng() % 50));
                auto b = t.snapshot(p).valid;
                if (a & ~b) moved_while_pinned++;
                t.unpin(p);
                break;
              }
              case 9: t.evict_one(1 + static_cast<location>(rng() % 2)); break;
              case 10:  // batched prefetch of a few pages (batches of 1..3; two in flight)
                t.prefetch_range(p, std::min(pages, p + 1 + rng() % 6), l, 1 + rng() % 3, std::chrono::seconds(10));
                break;
              case 11:  // a fault with fault-ahead
                t.fault_range(p, p + 1 + rng() % 5, l, rng() % 3 == 0, 1 + rng() % 3, std::chrono::seconds(10));
                break;
            }
          } catch (const ferry::error& e) {
            if (std::string(e.what()).find("injected failure") != std::string::npos) injected++;
            else if (errors++ == 0) ADD_FAILURE() << e.what();
          } catch (const std::exception& e) {
            if (errors++ == 0) ADD_FAILURE() << e.what();
          }
        }
      });
    for (auto& x : th) x.join();
    EXPECT_EQ(mv.first, "") << "the backend was asked for something illegal";
    EXPECT_EQ(errors, 0);
    EXPECT_EQ(bad_reads, 0u) << "a read did not see the last write";
    EXPECT_EQ(incoherent, 0u);
    EXPECT_EQ(moved_while_pinned, 0u);
    for (std::uint64_t p = 0; p < pages; ++p) {
      auto s = t.snapshot(p);
      EXPECT_EQ(s.valid, mv.present_mask(p)) << "page " << p;
      EXPECT_EQ(s.pins, 0u);
      EXPECT_FALSE(mv.writable[p] && std::popcount(s.valid) > 1) << "page " << p << " mapped writable with other copies";
      for (location x = 0; x < 3; ++x)
        if (s.valid & (1ull << x)) {
          EXPECT_EQ(mv.val[mv.at(x, p)], model[p]) << "page " << p << " location " << x;
        }
    }
    for (location d : {1, 2}) {
      EXPECT_EQ(static_cast<std::int64_t>(t.resident(d)), mv.occ[d].load());
      EXPECT_LE(t.resident(d), d == 1 ? 6u : 4u);
    }
    auto st = t.stats();
    EXPECT_GT(reads, 1000u);
    EXPECT_GT(writes, 500u);
    EXPECT_GT(st.evictions, 50u);
    EXPECT_GT(st.writebacks, 0u);
    EXPECT_GT(st.clean_drops, 0u);
    EXPECT_GT(st.duplicates, 0u);
    EXPECT_GT(st.invalidations, 0u);
    EXPECT_GT(st.migrations_d2d, 0u);
    EXPECT_GT(st.batches, 100u);
    EXPECT_GT(st.fault_ahead, 0u);
    if (pol == replacement::lru) {
      EXPECT_GT(st.thrash_holds, 0u);
    }
    EXPECT_GT(injected, 0);
    EXPECT_GE(mv.in_flight, 2u) << "never two batches in flight: the pipelining is untested";
    EXPECT_TRUE(mv.flights.empty()) << "a started batch was never finished";
  }
}

TEST(VmPageTable, LruEvictsTheLeastRecentlyUsedFifoTheFirstArrived) {
  for (replacement pol : {replacement::lru, replacement::fifo}) {
    fake_mover mv(4, {0, 2});
    page_table t(4, 4096, {0, 2}, pol, mv);
    t.access(0, 1, true, soon());
    t.access(1, 1, true, soon());
    t.access(0, 1, false, soon());  // page 0 used again
    t.access(2, 1, true, soon());   // full: one goes
    bool p0 = t.snapshot(0).valid & 2, p1 = t.snapshot(1).valid & 2;
    if (pol == replacement::lru) {
      EXPECT_TRUE(p0);
      EXPECT_FALSE(p1);
    } else {
      EXPECT_FALSE(p0);
      EXPECT_TRUE(p1);
    }
    EXPECT_EQ(t.stats().writebacks, 1u) << "the evicted page was dirty: copied to host, not lost";
    EXPECT_EQ(t.resident(1), 2u);
  }
}

TEST(VmPageTable, PagesPreferringADeviceAreEvictedLast) {
  fake_mover mv(4, {0, 2});
  page_table t(4, 4096, {0, 2}, replacement::lru, mv);
  t.set_preferred(0, 1);
  t.access(0, 1, true, soon());  // coldest, but prefers the device
  t.access(1, 1, true, soon());
  t.access(2, 1, true, soon());  // full: page 1 goes, not page 0
  EXPECT_TRUE(t.snapshot(0).valid & 2);
  EXPECT_FALSE(t.snapshot(1).valid & 2);
  t.set_preferred(2, 1);
  t.access(3, 1, true, soon());  // both residents prefer the device: the coldest of them goes
  EXPECT_FALSE(t.snapshot(0).valid & 2);
  EXPECT_TRUE(t.snapshot(2).valid & 2);
  EXPECT_EQ(mv.first, "");
}

// Thrashing: a page evicted and prefetched back within the lapse stays where it is (host, read in
// place by the device) for the hold, without evicting anyone; PREFERRED_LOCATION overrides; the hold
// ends; lapse 0 turns it off.
TEST(VmPageTable, ThrashingPagesStayOnTheHostForTheHold) {
  const auto hour = std::chrono::hours(1);
  for (auto hold : {std::chrono::nanoseconds(hour), std::chrono::nanoseconds(0)}) {
    fake_mover mv(6, {0, 2});
    page_table t(6, 4096, {0, 2}, replacement::lru, mv, thrash_policy{hour, hold});
    for (std::uint64_t p = 0; p < 6; ++p) t.access(p, host, true, soon());
    t.prefetch_range(0, 2, 1, 2, std::chrono::seconds(10));
    t.prefetch_range(2, 4, 1, 2, std::chrono::seconds(10));  // evicts 0 and 1
    EXPECT_EQ(t.stats().evictions, 2u);
    EXPECT_EQ(t.stats().thrash_holds, 0u) << "first evictions are not thrashing yet";
    t.prefetch_range(0, 2, 1, 2, std::chrono::seconds(10));  // back within the lapse: held
    auto st = t.stats();
    EXPECT_EQ(st.thrash_holds, 2u);
    EXPECT_EQ(st.held_prefetches, 2u);
    EXPECT_EQ(st.evictions, 2u) << "a held page must not make room";
    for (std::uint64_t p : {0, 1}) {
      EXPECT_EQ(t.snapshot(p).valid, 1u) << "page " << p;
      EXPECT_EQ(t.snapshot(p).mapped, host) << "page " << p << ": the device reads it in place";
    }
    EXPECT_EQ(t.resident(1), 2u);
    if (hold == std::chrono::nanoseconds(0)) {
      // The hold is over at once: the next PREFETCH migrates (and evicts).
      t.prefetch(0, 1, soon());
      EXPECT_EQ(t.snapshot(0).valid & 2, 2u);
      EXPECT_EQ(t.stats().evictions, 3u);
    } else {
      t.prefetch(1, 1, soon());  // the single-page path: still held
      EXPECT_EQ(t.stats().held_prefetches, 3u);
      EXPECT_EQ(t.snapshot(1).valid, 1u);
      t.set_preferred(0, 1);  // the caller says it belongs on the device: moved despite the hold
      t.prefetch(0, 1, soon());
      EXPECT_EQ(t.snapshot(0).valid & 2, 2u);
      t.prefetch(1, 1, soon());
      EXPECT_EQ(t.snapshot(1).valid, 1u) << "page 1 is still held";
    }
    t.access(4, 1, false, soon());  // an access (not a hint) always moves
    EXPECT_EQ(t.snapshot(4).valid & 2, 2u);
    EXPECT_EQ(mv.first, "");
  }
  // Lapse 0: no thrashing mitigation, every PREFETCH migrates.
  fake_mover mv(4, {0, 2});
  page_table t(4, 4096, {0, 2}, replacement::lru, mv);
  for (std::uint64_t p = 0; p < 4; ++p) t.access(p, host, true, soon());
  for (int round = 0; round < 2; ++round) t.prefetch_range(0, 4, 1, 2, std::chrono::seconds(10));
  EXPECT_EQ(t.stats().thrash_holds, 0u);
  EXPECT_EQ(t.stats().evictions, 6u);
  EXPECT_EQ(mv.first, "");
}

// return_taken asks its caller once there are pages to move -- the space waits there for work the
// devices were seen to launch, on any stream -- and moves nothing when the answer is no.
TEST(VmPageTable, TakenPagesGoBackOnlyWhenTheCallerIsReady) {
  fake_mover mv(4, {0, 4});
  page_table t(4, 4096, {0, 4}, replacement::lru, mv);
  int asked = 0;
  auto answer = [&](bool yes) {
    return std::function<bool()>([&asked, yes] {
      ++asked;
      return yes;
    });
  };
  EXPECT_EQ(t.return_taken({}, 4, 2, answer(true)), 0u);
  EXPECT_EQ(asked, 0) << "nothing taken: not asked";
  for (std::uint64_t p = 0; p < 4; ++p) t.access(p, 1, true, soon());
  for (std::uint64_t p = 0; p < 4; ++p) t.access(p, host, true, soon());  // the CPU takes them
  ASSERT_EQ(t.cpu_taken(), 4u);
  EXPECT_EQ(t.return_taken({}, 4, 2, answer(false)), 0u);
  EXPECT_EQ(asked, 1);
  EXPECT_EQ(t.cpu_taken(), 4u) << "not ready: every page stays";
  EXPECT_EQ(t.resident(1), 0u);
  EXPECT_EQ(t.return_taken({}, 4, 2, answer(true)), 4u);
  EXPECT_EQ(asked, 2);
  EXPECT_EQ(t.cpu_taken(), 0u);
  EXPECT_EQ(t.resident(1), 4u);
  EXPECT_EQ(mv.first, "");
}

TEST(VmPageTable, DontneedKeepsTheDataAndReadMostlyCopiesAreInvalidatedOnWrite) {
  fake_mover mv(2, {0, 4, 4});
  page_table t(2, 4096, {0, 4, 4}, replacement::lru, mv);
  t.access(0, 1, true, soon(), [&] { mv.val[mv.at(1, 0)] = 42; });
  t.dontneed(0, 1, soon());
  EXPECT_EQ(t.snapshot(0).valid, 1u) << "only the host copy is left";
  t.access(0, host, false, soon(), [&] { EXPECT_EQ(mv.val[mv.at(host, 0)], 42u); });
  // READ_MOSTLY: reads on both devices duplicate; a write from the host invalidates them.
  t.set_read_mostly(0, true);
  t.access(0, 1, false, soon());
  t.access(0, 2, false, soon());
  EXPECT_EQ(t.snapshot(0).valid, 0b111u);
  t.access(0, host, true, soon(), [&] { mv.val[mv.at(host, 0)] = 43; });
  EXPECT_EQ(t.snapshot(0).valid, 1u);
  EXPECT_EQ(t.stats().invalidations, 2u);
  t.access(0, 2, false, soon(), [&] { EXPECT_EQ(mv.val[mv.at(2, 0)], 43u); });
  EXPECT_EQ(mv.first, "");
}

TEST(VmPageTable, PinnedPagesStayAndBadInputIsRefused) {
  fake_mover mv(2, {0, 1});
  page_table t(2, 4096, {0, 1}, replacement::lru, mv);
  t.access(0, 1, true, soon());
  t.pin(0);
  // Migrating a pinned page waits for the unpin, until the deadline.
  EXPECT_THAT(test::error_text([&] { t.access(0, host, false, deadline_after(std::chrono::milliseconds(20))); }),
              HasSubstr("pinned"));
  // The only device page is pinned: no room for another.
  EXPECT_THAT(test::error_text([&] { t.access(1, 1, false, deadline_after(std::chrono::milliseconds(20))); }),
              HasSubstr("capacity of 1 pages reached"));
  t.unpin(0);
  t.access(1, 1, false, soon());  // now page 0 can go
  EXPECT_EQ(t.snapshot(0).valid, 1u);
  EXPECT_THAT(test::error_text([&] { t.unpin(0); }), HasSubstr("not pinned"));
  EXPECT_THAT(test::error_text([&] { t.access(2, 1, false, soon()); }), HasSubstr("page 2"));
  EXPECT_THAT(test::error_text([&] { t.access(0, 5, false, soon()); }), HasSubstr("location 5"));
  EXPECT_THAT(test::error_text([&] { t.dontneed(0, host, soon()); }), HasSubstr("names a device"));
  ferry::settings cfg;  // the policy is parsed once, in the settings table
  EXPECT_THAT(test::error_text([&] { cfg.set("FERRY_VM_POLICY", "mru"); }), HasSubstr("expected one of lru|fifo"));
  EXPECT_EQ(mv.first, "");
}
