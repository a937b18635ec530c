#include <ferry/core/error.hpp>
#include <ferry/mem/pinned_pool.hpp>
#include <ferry/mem/registration.hpp>
#include <ferry/runtime.hpp>

#include "support/errors.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <malloc.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <thread>

using namespace ferry;
using ::testing::HasSubstr;

namespace {

// A client over a fake "allocation table": the test allocates and frees regions (changing their
// buffer id) and the client counts pins per page, so double registration is detected.
class fake_client final : public peer_memory_client {
 public:
  explicit fake_client(std::uintptr_t base, std::uint64_t size) : base_(base), size_(size) {}
  std::string_view name() const noexcept override { return "fake"; }
  std::optional<memory_region> acquire(const void* p, std::uint64_t n) override {
    auto a = reinterpret_cast<std::uintptr_t>(p);
    if (a < base_ || a + n > base_ + size_) return std::nullopt;
    std::lock_guard l(mu_);
    return memory_region{memory_type::host_pageable, device_kind::none, -1, a, n, generation_, this};
  }
  std::uint64_t pin(const memory_region&, std::uintptr_t b, std::uint64_t n) override {
    std::lock_guard l(mu_);
    for (std::uintptr_t p = b; p < b + n; p += 4096)
      if (++pages_[p] > 1) double_pins_++;
    pins_++;
    return 7;
  }
  void unpin(std::uint64_t cookie, std::uintptr_t b, std::uint64_t n) noexcept override {
    std::lock_guard l(mu_);
    EXPECT_EQ(cookie, 7u);
    for (std::uintptr_t p = b; p < b + n; p += 4096) pages_[p]--;
    unpins_++;
  }
  bool still_valid(const memory_region& r) override {
    std::lock_guard l(mu_);
    return r.buffer_id == generation_;
  }
  void free_and_reallocate() {
    std::lock_guard l(mu_);
    generation_++;
  }
  int pins() { std::lock_guard l(mu_); return pins_; }
  int unpins() { std::lock_guard l(mu_); return unpins_; }
  int double_pins() { std::lock_guard l(mu_); return double_pins_; }

 private:
  std::uintptr_t base_;
  std::uint64_t size_;
  std::mutex mu_;
  std::uint64_t generation_ = 1;
  std::map<std::uintptr_t, int> pages_;
  int pins_ = 0, unpins_ = 0, double_pins_ = 0;
};

constexpr std::uintptr_t kBase = 0x100000000;  // fake addresses: never dereferenced
const void* at(std::uint64_t off) { return reinterpret_cast<const void*>(kBase + off); }

TEST(RegistrationCache, SecondAcquireIsAHit) {
  fake_client c(kBase, 1 << 20);
  registration_cache cache({&c}, 1 << 20);
  { auto r = cache.acquire(at(0), 8192); EXPECT_TRUE(r.valid()); }
  { auto r = cache.acquire(at(100), 4000); EXPECT_TRUE(r.valid()); }  // inside the first
  EXPECT_EQ(c.pins(), 1);
  auto st = cache.stats();
  EXPECT_EQ(st.hits, 1u);
  EXPECT_EQ(st.misses, 1u);
  EXPECT_EQ(st.bytes_pinned, 8192u);
  EXPECT_TRUE(cache.cached(at(0), 8192));
  EXPECT_FALSE(cache.cached(at(0), 8193));
}

TEST(RegistrationCache, OverlappingAndAdjacentRangesAreNeverRegisteredTwice) {
  fake_client c(kBase, 1 << 20);
  registration_cache cache({&c}, 1 << 20);
  auto a = cache.acquire(at(0), 8192);
  auto b = cache.acquire(at(4096), 8192);   // overlaps: only [8K, 12K) is new
  auto d = cache.acquire(at(12288), 4096);  // adjacent
  auto e = cache.acquire(at(0), 16384);     // covered by three entries: a hit
  EXPECT_EQ(c.double_pins(), 0);
  EXPECT_EQ(c.pins(), 3);
  EXPECT_EQ(cache.stats().bytes_pinned, 16384u);
  EXPECT_EQ(cache.stats().hits, 1u);
  EXPECT_EQ(e.region().base, kBase);
  EXPECT_EQ(e.region().size, 16384u);
  // DMA must be issued per pinned piece: [0,8K) [8K,12K) [12K,16K).
  auto pieces = e.pieces();
  ASSERT_EQ(pieces.size(), 3u);
  EXPECT_EQ(pieces[0], std::make_pair(kBase, std::uint64_t{8192}));
  EXPECT_EQ(pieces[1], std::make_pair(kBase + 8192, std::uint64_t{4096}));
  EXPECT_EQ(pieces[2], std::make_pair(kBase + 12288, std::uint64_t{4096}));
  auto inner = cache.acquire(at(100), 9000);  // clipped to the asked range
  auto ip = inner.pieces();
  ASSERT_EQ(ip.size(), 2u);
  EXPECT_EQ(ip[0], std::make_pair(kBase + 100, std::uint64_t{8092}));
  EXPECT_EQ(ip[1], std::make_pair(kBase + 8192, std::uint64_t{908}));
}

TEST(RegistrationCache, UnusedRegistrationsStayPinnedUntilTheLimitThenLruEvicts) {
  fake_client c(kBase, 1 << 20);
  registration_cache cache({&c}, 8192);
  { auto r = cache.acquire(at(0), 4096); }
  { auto r = cache.acquire(at(8192), 4096); }
  EXPECT_EQ(c.unpins(), 0) << "lazy unpinning: released registrations stay pinned under the limit";
  { auto r = cache.acquire(at(0), 4096); }  // touch: now the most recent
  { auto r = cache.acquire(at(16384), 4096); }  // over the limit: LRU (the one at 8192) goes
  EXPECT_EQ(cache.stats().evictions, 1u);
  EXPECT_TRUE(cache.cached(at(0), 4096));
  EXPECT_FALSE(cache.cached(at(8192), 4096));
  EXPECT_LE(cache.stats().bytes_pinned, 8192u);
  // Registrations in use are never evicted, even over the limit.
  auto h1 = cache.acquire(at(32768), 8192);
  auto h2 = cache.acquire(at(65536), 8192);
  EXPECT_TRUE(h1.valid());
  EXPECT_TRUE(h2.valid());
  EXPECT_EQ(cache.stats().bytes_pinned, 16384u);
}

TEST(RegistrationCache, InvalidationDropsEntriesAndTellsHolders) {
  fake_client c(kBase, 1 << 20);
  registration_cache cache({&c}, 1 << 20);
  auto r = cache.acquire(at(0), 8192);
  int calls = 0;
  r.on_invalidate([&] { calls++; });
  cache.invalidate(kBase + 4096, 100);
  EXPECT_EQ(calls, 1);
  EXPECT_FALSE(r.valid());
  EXPECT_FALSE(cache.cached(at(0), 8192));
  EXPECT_EQ(cache.stats().invalidations, 1u);
  EXPECT_EQ(c.unpins(), 1) << "the memory went away: unpinned at once, even while held";
  r = registration{};
  EXPECT_EQ(c.unpins(), 1) << "and not a second time on release";
  auto again = cache.acquire(at(0), 8192);  // a new registration, not the stale one
  EXPECT_EQ(c.pins(), 2);
  EXPECT_TRUE(again.valid());
}

TEST(RegistrationCache, FreedAndReallocatedMemoryIsNeverServedFromAStaleEntry) {
  fake_client c(kBase, 1 << 20);
  registration_cache cache({&c}, 1 << 20);
  auto r = cache.acquire(at(0), 8192);
  bool told = false;
  r.on_invalidate([&] { told = true; });
  c.free_and_reallocate();  // same address, new buffer id
  auto r2 = cache.acquire(at(0), 8192);
  EXPECT_EQ(cache.stats().stale_detected, 1u);
  EXPECT_EQ(cache.stats().hits, 0u);
  EXPECT_EQ(c.pins(), 2);
  EXPECT_TRUE(told);
  EXPECT_FALSE(r.valid());
  EXPECT_TRUE(r2.valid());
}

TEST(RegistrationCache, ConcurrentRegistrationFromManyThreads) {
  fake_client c(kBase, 1 << 20);
  registration_cache cache({&c}, 256 << 10);
  std::vector<std::thread> ts;
  std::atomic<int> invalid{0};
  for (int t = 0; t < 8; ++t)
    ts.emplace_back([&, t] {
      std::mt19937 rng(static_cast<unsigned>(t));
      for (int i = 0; i < 2000; ++i) {
        std::uint64_t off = (rng() % 200) * 4096, len = (1 + rng() % 16) * 4096 - rng() % 100;
        auto r = cache.acquire(at(off), len);
        if (r.region().size != len || r.region().base != kBase + off) invalid++;
        if (i % 500 == 0) cache.invalidate(kBase + off, 4096);
      }
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(invalid.load(), 0);
  EXPECT_EQ(c.double_pins(), 0);
  auto st = cache.stats();
  EXPECT_LE(st.bytes_pinned, 256u << 10);
  cache.trim();
  EXPECT_EQ(cache.stats().bytes_pinned, 0u);
  EXPECT_EQ(c.pins(), c.unpins());
}

TEST(RegistrationCache, BadInputAndUnknownMemory) {
  fake_client c(kBase, 1 << 20);
  registration_cache cache({&c}, 1 << 20);
  auto text = [](auto f) { return test::error_text(f); };
  EXPECT_THAT(text([&] { cache.acquire(nullptr, 10); }), HasSubstr("null pointer"));
  EXPECT_THAT(text([&] { cache.acquire(at(0), 0); }), HasSubstr("zero length"));
  EXPECT_THAT(text([&] { cache.acquire(reinterpret_cast<void*>(~0ull - 10), 100); }), HasSubstr("overflows"));
  EXPECT_THAT(text([&] { cache.acquire(at(2 << 20), 100); }), HasSubstr("not memory that any of ferry's memory clients knows"));
  EXPECT_EQ(cache.classify(at(2 << 20), 100).type, memory_type::unknown);
}

// `n` bytes of fresh anonymous memory registered through `cache`; nothing (the memory unmapped,
// the reason in `why`) where this machine may not pin it (RLIMIT_MEMLOCK).
struct mapped_registration {
  void* p;
  registration r;
};
std::optional<mapped_registration> map_and_register(registration_cache& cache, std::size_t n, std::string& why) {
  void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::runtime_error("mmap failed");
  try {
    return mapped_registration{p, cache.acquire(p, n)};
  } catch (const error& e) {
    ::munmap(p, n);
    if (e.code() != errc::permission_denied && e.code() != errc::out_of_memory) throw;
    why = e.what();
    return std::nullopt;
  }
}

// The real host client: host memory is every page of the range mapped and readable. A page
// mapped PROT_NONE (as a freed cudaMalloc address stays inside CUDA's reservation) or unmapped
// anywhere in a small range makes it unknown; in a large one, an unmapped page does.
TEST(RegistrationCache, HostMemoryIsEveryPageMappedAndReadable) {
  auto host = make_host_client("/nonexistent/libcuda.so.1");
  registration_cache cache({host.get()}, 64 << 20);  // pageable ranges asked are remembered: negatives first
  const std::size_t ps = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)), pages = 256;
  auto* p = static_cast<char*>(::mmap(nullptr, pages * ps, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(p, MAP_FAILED);
  ASSERT_EQ(::mprotect(p + 2 * ps, ps, PROT_NONE), 0);  // a page in the middle of a small range
  ASSERT_EQ(::munmap(p + 200 * ps, ps), 0);              // a hole in a large range
  EXPECT_EQ(cache.classify(p + 10, 4 * ps).type, memory_type::unknown);
  EXPECT_EQ(cache.classify(p + 2 * ps + 5, 8).type, memory_type::unknown);
  EXPECT_EQ(cache.classify(p + 100 * ps, 150 * ps).type, memory_type::unknown);
  EXPECT_EQ(cache.classify(p + 199 * ps + 1, 2 * ps).type, memory_type::unknown);
  EXPECT_EQ(cache.classify(p + 3 * ps, 4 * ps).type, memory_type::host_pageable) << "the pages after it";
  EXPECT_EQ(cache.classify(p + 5 * ps + 100, 190 * ps).type, memory_type::host_pageable) << "a large range";
  ::munmap(p, 200 * ps);
  ::munmap(p + 201 * ps, (pages - 201) * ps);
}

// The real host client and the munmap hook: unmapped memory is never served from the cache.
TEST(RegistrationCache, HostMunmapInvalidatesThroughMemoryHooks) {
  auto host = make_host_client("/nonexistent/libcuda.so.1");  // no CUDA: pins with mlock
  registration_cache cache({host.get()}, 64 << 20);
  const std::size_t n = 1 << 20;
  std::string why;
  auto m = map_and_register(cache, n, why);
  if (!m) GTEST_SKIP() << why;
  void* p = m->p;
  registration r = std::move(m->r);
  EXPECT_EQ(cache.classify(p, n).type, memory_type::host_pageable);
  std::atomic<bool> told{false};  // the cache's own thread may apply the hook's record first
  r.on_invalidate([&] { told = true; });
  ::munmap(p, n);
  // The hook only records the range (it may run inside the allocator, under its lock): the cache's
  // next call applies it before it answers (or its own thread did already); holders are told soon.
  EXPECT_FALSE(cache.cached(p, n));
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!told && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_TRUE(told) << "libucm's VM_UNMAPPED hook did not reach the cache";
  EXPECT_FALSE(r.valid());
  EXPECT_EQ(cache.classify(p, n).type, memory_type::unknown);
  EXPECT_THROW(cache.acquire(p, n), error);
}

// A process forks while another of its threads unmaps memory all the time (a data loader's worker
// forked from a busy trainer): that thread may be inside the memory hook, holding the caches' list,
// at the fork. The child makes a cache of its own and its hooks still work -- it never waits for a
// lock the thread (which is not in the child) held.
TEST(RegistrationCache, ChildrenForkedWhileTheParentUnmapsMakeCachesOfTheirOwn) {
#if defined(__SANITIZE_ADDRESS__)
  // A child's first allocation (its new thread's start) can wait for ever on a lock of ASan's own
  // allocator that the parent's unmapping thread held at the fork: that allocator takes no lock
  // across fork in this compiler's runtime, as glibc's malloc does. The hang is the sanitizer's.
  GTEST_SKIP() << "ASan's allocator is not fork-safe in this runtime: a child can inherit its lock held";
#endif
  auto host = make_host_client("/nonexistent/libcuda.so.1");
  registration_cache parent_cache({host.get()}, 64 << 20);  // the memory hooks are installed
  std::atomic<bool> stop{false};
  std::thread churn([&] {
    while (!stop) {
      void* p = ::mmap(nullptr, 1 << 16, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p != MAP_FAILED) ::munmap(p, 1 << 16);
    }
  });
  int hung = 0, failed = 0;
  for (int i = 0; i < 300; ++i) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      int code = 0;
      try {
        registration_cache c({host.get()}, 64 << 20);
        std::string why;
        auto m = map_and_register(c, 1 << 20, why);
        if (m) {
          ::munmap(m->p, 1 << 20);
          if (c.cached(m->p, 1 << 20)) code = 3;  // the hook did not reach the child's cache
        }
      } catch (...) {
        code = 2;
      }
      ::_exit(code);
    }
    ASSERT_GT(pid, 0);
    int status = 0;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (::waitpid(pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > until) {
        ++hung;
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) != 0) ++failed;
  }
  stop = true;
  churn.join();
  EXPECT_EQ(hung, 0) << "children waited 10 s for a lock a thread of their parent held at the fork";
  EXPECT_EQ(failed, 0);
}

// A registration of heap memory, then free() gives the heap's top back (sbrk, inside the allocator,
// under its lock): the hook only records the range -- unpinning there (the CUDA driver's unregister
// frees memory) would wait on the allocator's lock its own thread holds, for ever -- and the
// cache's next call applies it: the registration is gone before that call answers.
TEST(RegistrationCache, FreeTrimmingTheHeapUnderARegistrationIsAppliedAtTheNextCall) {
  auto host = make_host_client("/nonexistent/libcuda.so.1");
  registration_cache cache({host.get()}, 64 << 20);
  // From the heap (below the mmap threshold), and trimmed as soon as the heap's top is free.
  constexpr std::size_t n = 96 << 10;
  ::mallopt(M_MMAP_THRESHOLD, 1 << 20);
  ::mallopt(M_TRIM_THRESHOLD, 4096);
  ::mallopt(M_TOP_PAD, 0);
  struct restore {
    ~restore() {
      ::mallopt(M_MMAP_THRESHOLD, 128 << 10);
      ::mallopt(M_TRIM_THRESHOLD, 128 << 10);
      ::mallopt(M_TOP_PAD, 128 << 10);
    }
  } r0;
  bool tested = false;
  for (int i = 0; i < 16 && !tested; ++i) {
    auto* p = static_cast<char*>(std::malloc(n));
    ASSERT_NE(p, nullptr);
    registration r;
    try {
      r = cache.acquire(p, n);
    } catch (const error& e) {
      std::free(p);
      if (e.code() == errc::permission_denied || e.code() == errc::out_of_memory) GTEST_SKIP() << e.what();
      throw;
    }
    // Told on this thread while inside free() would be the deadlock; told on the cache's own
    // thread (it applies what hooks record soon after) or at the next call is right.
    std::atomic<bool> told{false}, in_free{false}, told_in_free{false};
    const auto me = std::this_thread::get_id();
    r.on_invalidate([&] {
      told = true;
      if (in_free && std::this_thread::get_id() == me) told_in_free = true;
    });
    volatile std::uintptr_t where = reinterpret_cast<std::uintptr_t>(p);  // only its address is used after the free
    in_free = true;
    std::free(p);  // may trim the heap: sbrk -> libucm's hook -> the cache, inside free()
    in_free = false;
    EXPECT_FALSE(told_in_free) << "the hook invalidated inside free() (round " << i << ")";
    const bool still = cache.cached(reinterpret_cast<const void*>(where), n);  // applies what the hook recorded
    if (told) {
      EXPECT_FALSE(still) << "round " << i;
      tested = true;  // the heap was trimmed over the registration this round
    }
  }
  if (!tested) GTEST_SKIP() << "free() never trimmed the heap over the registration here";
}

// Memory unmapped under a registration is dropped by the cache's own thread soon after, with no
// further call: a registration the driver kept for memory the process gave back would refuse the
// user's next allocation at that address.
TEST(RegistrationCache, MemoryUnmappedUnderARegistrationIsDroppedWithoutAnotherCall) {
  auto host = make_host_client("/nonexistent/libcuda.so.1");
  registration_cache cache({host.get()}, 64 << 20);
  const std::size_t n = 1 << 20;
  std::string why;
  auto m = map_and_register(cache, n, why);
  if (!m) GTEST_SKIP() << why;
  void* p = m->p;
  registration r = std::move(m->r);
  const auto entries = cache.stats().entries;
  ::munmap(p, n);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (r.valid() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_FALSE(r.valid()) << "still registered 5 s after the memory was unmapped";
  EXPECT_LT(cache.stats().entries, entries) << "stats() applies nothing itself: the cache's thread dropped the entry";
}

// Classification of unregistered host memory is remembered (it costs a driver call and syscalls
// per request otherwise) -- but never past the memory's unmapping.
TEST(RegistrationCache, RememberedHostClassificationGoesWithTheMemory) {
  auto host = make_host_client("/nonexistent/libcuda.so.1");
  registration_cache cache({host.get()}, 64 << 20);
  const std::size_t n = 1 << 20;
  void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(p, MAP_FAILED);
  EXPECT_EQ(cache.classify(p, n).type, memory_type::host_pageable);
  auto inner = cache.classify(static_cast<char*>(p) + 4096, 4096);  // inside the remembered range
  EXPECT_EQ(inner.type, memory_type::host_pageable);
  EXPECT_EQ(inner.base, reinterpret_cast<std::uintptr_t>(p) + 4096);
  EXPECT_EQ(inner.size, 4096u);
  EXPECT_EQ(cache.stats().entries, 0u) << "classifying registers nothing";
  ::munmap(p, n);
  EXPECT_EQ(cache.classify(p, n).type, memory_type::unknown) << "a remembered classification outlived the memory";
}

// Pageable ranges classified next to each other (a buffer read into a page at a time) join into one
// remembered range: a range inside it is asked of no client. Invalidating a page of it forgets all of
// it, and the clients are asked again.
TEST(RegistrationCache, AdjacentPageableClassificationsJoin) {
  struct pageable_client final : peer_memory_client {
    int asked = 0;
    std::string_view name() const noexcept override { return "fake-pageable"; }
    std::optional<memory_region> acquire(const void* p, std::uint64_t n) override {
      auto a = reinterpret_cast<std::uintptr_t>(p);
      if (a < kBase || a + n > kBase + (1 << 20)) return std::nullopt;
      asked++;
      return memory_region{memory_type::host_pageable, device_kind::none, -1, a, n, 0, this};
    }
    std::uint64_t pin(const memory_region&, std::uintptr_t, std::uint64_t) override { return 0; }
    void unpin(std::uint64_t, std::uintptr_t, std::uint64_t) noexcept override {}
    bool still_valid(const memory_region&) override { return true; }
  } c;
  registration_cache cache({&c}, 1 << 20);
  for (std::uint64_t page : {3, 1, 2, 0, 5, 4}) EXPECT_EQ(cache.classify(at(page * 4096), 4096).type, memory_type::host_pageable);
  EXPECT_EQ(c.asked, 6);
  auto whole = cache.classify(at(100), 6 * 4096 - 100);
  EXPECT_EQ(c.asked, 6) << "six pages seen one by one were asked about again as one range";
  EXPECT_EQ(whole.base, kBase + 100);
  EXPECT_EQ(whole.size, 6u * 4096 - 100);
  cache.classify(at(6 * 4096), 1);  // past them: asked
  EXPECT_EQ(c.asked, 7);
  cache.invalidate(kBase + 2 * 4096, 4096);
  cache.classify(at(0), 4096);
  EXPECT_EQ(c.asked, 8) << "a page of the joined range was invalidated: the range is asked afresh";
}

// A device allocation's classification is remembered whole (its bounds are the allocation's) and
// checked on every hit: freed and re-allocated at the same address, it is asked afresh.
TEST(RegistrationCache, RememberedDeviceClassificationIsCheckedOnEveryHit) {
  struct device_client final : peer_memory_client {
    std::uint64_t id = 1;
    int asked = 0;
    std::string_view name() const noexcept override { return "fake-device"; }
    std::optional<memory_region> acquire(const void* p, std::uint64_t n) override {
      auto a = reinterpret_cast<std::uintptr_t>(p);
      if (a < kBase || a + n > kBase + (1 << 20)) return std::nullopt;
      asked++;
      return memory_region{memory_type::device, device_kind::sim, 0, kBase, 1 << 20, id, this};
    }
    std::uint64_t pin(const memory_region&, std::uintptr_t, std::uint64_t) override { return 0; }
    void unpin(std::uint64_t, std::uintptr_t, std::uint64_t) noexcept override {}
    bool still_valid(const memory_region& r) override { return r.buffer_id == id; }
  } c;
  registration_cache cache({&c}, 1 << 20);
  EXPECT_EQ(cache.classify(at(4096), 4096).buffer_id, 1u);
  auto again = cache.classify(at(65536), 8192);  // another range of the same allocation
  EXPECT_EQ(c.asked, 1) << "the allocation was asked about twice";
  EXPECT_EQ(again.base, kBase);
  EXPECT_EQ(again.size, 1u << 20);
  c.id = 2;  // freed, and a new allocation at the same address
  EXPECT_EQ(cache.classify(at(4096), 4096).buffer_id, 2u);
  EXPECT_EQ(c.asked, 2);
  EXPECT_EQ(cache.classify(at(1 << 20), 16).type, memory_type::unknown) << "past the allocation";
}

// The staging pool pins what is used: one buffer when made, then segments that double (up to 8
// buffers of 64 KiB here) only while every buffer is out -- for try_get (a caller with buffers out
// that come back) only once the pool has gone round eight times since it last grew -- never past its
// size; then a waiter gets a timeout naming the pool, and a buffer given back is handed out again,
// with the region it was registered in.
TEST(PinnedPool, GrowsBySegmentsOnlyAsBuffersAreTakenAndNeverPastItsSize) {
  settings st;
  st.backend = backend_choice::sim;
  runtime rt(st);  // its cache knows host memory
  pinned_pool pool(rt.registrations(), 64 << 10, 20, -1);
  const auto soon = [] { return std::chrono::steady_clock::now() + std::chrono::seconds(1); };
  EXPECT_EQ(pool.allocated(), 1) << "one buffer when made: a first transfer waits for no more";
  std::vector<pinned_pool::buffer> out;
  out.push_back(pool.try_get());
  EXPECT_TRUE(out.back());
  EXPECT_FALSE(pool.try_get()) << "a caller with a buffer out waits for it rather than grow a fresh pool";
  EXPECT_EQ(pool.allocated(), 1);
  out.push_back(pool.get(soon()));
  EXPECT_EQ(pool.allocated(), 3) << "one with nothing out grows the pool";
  while (static_cast<int>(out.size()) < pool.allocated()) out.push_back(pool.try_get());
  EXPECT_FALSE(pool.try_get()) << "handed out 3 times since it grew to 3: not yet";
  EXPECT_EQ(pool.allocated(), 3);
  // Round and round: buffers given back and taken again until 8 x 3 have been handed out since it grew.
  for (int i = 0; i < 22; ++i) {  // 2 handed out since it grew, and 22 more
    out.front().reset();
    out.front() = pool.try_get();
    ASSERT_TRUE(out.front());
  }
  EXPECT_EQ(pool.allocated(), 3);
  out.push_back(pool.try_get());
  EXPECT_TRUE(out.back()) << "a pool used eight times over grows for try_get too";
  EXPECT_EQ(pool.allocated(), 7);
  for (int want : {15}) {
    while (static_cast<int>(out.size()) < pool.allocated()) out.push_back(pool.try_get());
    out.push_back(pool.get(soon()));
    EXPECT_TRUE(out.back());
    EXPECT_EQ(pool.allocated(), want) << "grown by a segment twice the last when all were out";
  }
  while (out.size() < 20) out.push_back(pool.get(soon()));
  EXPECT_EQ(pool.allocated(), 20) << "the last segment is the rest, not a whole one";
  EXPECT_FALSE(pool.try_get());
  EXPECT_THAT(test::error_text([&] { pool.get(std::chrono::steady_clock::now() + std::chrono::milliseconds(20)); }),
              ::testing::HasSubstr("no staging buffer became free"));
  std::set<std::byte*> distinct;
  for (auto& b : out) {
    ASSERT_TRUE(b);
    EXPECT_EQ(b.size(), 64u << 10);
    EXPECT_TRUE(b.region().contains(reinterpret_cast<std::uintptr_t>(b.data()), b.size())) << "its segment's region holds it";
    distinct.insert(b.data());
  }
  EXPECT_EQ(distinct.size(), 20u);
  std::byte* first = out.front().data();
  out.front().reset();
  auto again = pool.try_get();
  EXPECT_EQ(again.data(), first);
  EXPECT_EQ(pool.allocated(), 20);
}

// A caller that asks once (a stream-ordered read's pipeline depth) grows the pool at once.
TEST(PinnedPool, TryGetNowGrowsWithoutWaitingForRounds) {
  settings st;
  st.backend = backend_choice::sim;
  runtime rt(st);
  pinned_pool pool(rt.registrations(), 64 << 10, 8, -1);
  auto a = pool.try_get();
  EXPECT_FALSE(pool.try_get()) << "when_used: not before the pool went round";
  auto b = pool.try_get(pinned_pool::growth::now);
  EXPECT_TRUE(b);
  EXPECT_EQ(pool.allocated(), 3);
}

}  // namespace
