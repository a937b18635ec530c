// The GPU page cache on the sim backend, with host threads standing in for warps (the same state
// machine kernels run, page_cache.hpp / array.hpp): concurrent misses on one page, random reads of
// every element size over a dataset larger than the cache, dirty pages written back on eviction
// and by flush, sources that fail, a full ring, requests that go unanswered.
#include <ferry/gpu/cache.hpp>
#include <ferry/vm/address_space.hpp>
#include <ferry/runtime.hpp>

#include "support/data.hpp"
#include "support/errors.hpp"
#include "support/sim.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <barrier>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

using namespace ferry;
using ::testing::HasSubstr;

namespace {

settings sim_cfg() { return test::sim_settings(256ull << 20); }

struct data_file : test::random_file {
  data_file(const char* name, std::size_t n, std::uint64_t seed) : random_file(::testing::TempDir(), name, n, seed) {}
};

gpu::cache_options host_cache(std::uint64_t bytes, std::uint32_t page, std::uint32_t slots = 64) {
  gpu::cache_options o;
  o.bytes = bytes;
  o.page_bytes = page;
  o.requests.by = gpu::requesters::host;
  o.requests.slots = slots;
  return o;
}

template <std::size_t N>
struct bytes_of {
  unsigned char b[N];
};

// 8 threads, each `per` random elements of a T-array that starts at an odd offset of the file.
template <typename T>
void random_reads(gpu::cache& c, const data_file& d, std::uint64_t base, int per) {
  auto a = gpu::array<T>(c.view(), c.map_bytes(file::open(d.path.string(), open_mode::read), base, d.bytes.size() - base));
  std::atomic<int> not_ok{0}, wrong{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < 8; ++t)
    ts.emplace_back([&, t] {
      std::mt19937_64 rng(static_cast<std::uint64_t>(t) * 31 + sizeof(T));
      for (int k = 0; k < per; ++k) {
        const std::uint64_t i = rng() % a.size();
        T v{};
        if (a.get(i, v) != gpu::status::ok) {
          not_ok++;
          continue;
        }
        if (std::memcmp(&v, d.bytes.data() + base + i * sizeof(T), sizeof(T)) != 0) wrong++;
      }
    });
  for (auto& x : ts) x.join();
  EXPECT_EQ(not_ok.load(), 0) << sizeof(T) << "-byte elements";
  EXPECT_EQ(wrong.load(), 0) << sizeof(T) << "-byte elements";
}

}  // namespace

// 8 threads that read the same element at once: one fills the page, the others wait for it and
// then hit; every value is the file's.
TEST(GpuCache, RequestersThatMissOnOnePageTogetherFillItOnce) {
  runtime rt(sim_cfg());
  data_file d("gpu-cache-one", 1 << 20, 1);
  gpu::cache c(rt.files(), rt.devices().get("sim:0"), host_cache(256 << 10, 64 << 10));
  auto a = c.map<std::uint64_t>(file::open(d.path.string(), open_mode::read), 0, d.bytes.size() / 8);
  std::uint64_t want;
  std::memcpy(&want, d.bytes.data() + 8 * 1000, 8);
  std::barrier go(8);
  std::atomic<int> wrong{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < 8; ++t)
    ts.emplace_back([&] {
      go.arrive_and_wait();
      for (int k = 0; k < 100; ++k) {
        std::uint64_t v = a[1000];
        if (v != want) wrong++;
      }
    });
  for (auto& x : ts) x.join();
  EXPECT_EQ(wrong.load(), 0);
  auto s = c.stats();
  EXPECT_EQ(s.counted.misses, 1u);
  EXPECT_EQ(s.counted.hits, 799u);
  EXPECT_EQ(s.requests.requests, 1u);
  EXPECT_NO_THROW(c.check());
}

// Elements of 1 to 24 bytes, from an array that starts 13 bytes into the file, over a dataset 4x
// the cache: every value is the file's, pages were evicted, no failure.
TEST(GpuCache, RandomReadsOfEveryElementSizeOverADatasetFourTimesTheCache) {
  runtime rt(sim_cfg());
  data_file d("gpu-cache-random", 4 << 20, 2);
  gpu::cache c(rt.files(), rt.devices().get("sim:0"), host_cache(1 << 20, 4096));
  random_reads<std::uint8_t>(c, d, 13, 2000);
  random_reads<std::uint16_t>(c, d, 13, 2000);
  random_reads<std::uint32_t>(c, d, 13, 2000);
  random_reads<std::uint64_t>(c, d, 13, 2000);
  random_reads<bytes_of<12>>(c, d, 13, 2000);  // straddles pages now and then
  random_reads<bytes_of<16>>(c, d, 13, 2000);
  random_reads<bytes_of<24>>(c, d, 13, 2000);
  auto s = c.stats();
  EXPECT_GT(s.counted.evictions, 0u);
  EXPECT_EQ(s.counted.failures, 0u);
  EXPECT_EQ(s.counted.writebacks, 0u) << "nothing was written";
  EXPECT_NO_THROW(c.check());
  std::vector<std::uint32_t> span(5000);
  auto a = c.map<std::uint32_t>(file::open(d.path.string(), open_mode::read), 1, 1'000'000);
  ASSERT_EQ(a.read(12345, span.size(), span.data()), gpu::status::ok) << "a span over several pages";
  EXPECT_EQ(std::memcmp(span.data(), d.bytes.data() + 4 * (1 + 12345), span.size() * 4), 0);
}

// 8 writers of distinct elements (each the elements i % 8 == t) over a file 4x the cache: pages
// are evicted dirty and written back, the rest by flush; the file then holds every written value.
TEST(GpuCache, DirtyPagesAreWrittenBackOnEvictionAndByFlush) {
  runtime rt(sim_cfg());
  data_file d("gpu-cache-write", 1 << 20, 3);
  gpu::cache c(rt.files(), rt.devices().get("sim:0"), host_cache(256 << 10, 4096));
  auto a = c.map<std::uint32_t>(file::open(d.path.string(), open_mode::read_write), 0, d.bytes.size() / 4);
  auto value = [](std::uint64_t i) { return static_cast<std::uint32_t>(i * 2654435761u + 7); };
  std::atomic<int> not_ok{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < 8; ++t)
    ts.emplace_back([&, t] {
      for (std::uint64_t i = static_cast<std::uint64_t>(t); i < a.size(); i += 8)
        if (a.set(i, value(i)) != gpu::status::ok) not_ok++;
    });
  for (auto& x : ts) x.join();
  EXPECT_EQ(not_ok.load(), 0);
  auto s = c.stats();
  EXPECT_GT(s.counted.writebacks, 0u) << "pages were evicted dirty";
  const std::uint64_t flushed = c.flush();
  EXPECT_GT(flushed, 0u);
  EXPECT_LE(flushed, 64u) << "at most the cache's pages are dirty";
  EXPECT_EQ(c.flush(), 0u) << "a second flush finds nothing dirty";
  auto disk = d.on_disk();
  ASSERT_EQ(disk.size(), d.bytes.size());
  std::uint64_t wrong = 0;
  for (std::uint64_t i = 0; i < a.size(); ++i) {
    std::uint32_t v;
    std::memcpy(&v, disk.data() + 4 * i, 4);
    wrong += v != value(i);
  }
  EXPECT_EQ(wrong, 0u);
  a[5] = 42u;  // and a write after the flush reads back from the cache
  EXPECT_EQ(static_cast<std::uint32_t>(a[5]), 42u);
}

// Ferry unified memory as the source (an address space on the sim device registered with the
// runtime's cache, the CPU's data in it): 8 requesters read random elements through the cache and
// match it; 8 writers then write distinct elements of memory 4x the cache, eviction and flush write
// them back, and the CPU reads every written value in the unified memory. Memory ferry does not know
// is refused at map time.
TEST(GpuCache, UnifiedMemoryIsASourceReadAndWrittenBack) {
  runtime rt(sim_cfg());
  device& dev = rt.devices().get("sim:0");
  const std::uint64_t n = (1 << 20) / 4;
  auto so = vm::space_options::from(rt.config());
  vm::address_space as(dev, 4 << 20, so);
  auto* p = static_cast<std::uint32_t*>(as.alloc(n * 4));
  auto before = [](std::uint64_t i) { return static_cast<std::uint32_t>(i * 0x9E3779B1u + 3); };
  auto after = [](std::uint64_t i) { return static_cast<std::uint32_t>(i * 2654435761u + 7); };
  for (std::uint64_t i = 0; i < n; ++i) p[i] = before(i);
  {
    gpu::cache c(rt.files(), dev, host_cache(256 << 10, 4096));
    auto a = c.map_memory(p, n, true);
    std::atomic<int> not_ok{0}, wrong{0};
    std::vector<std::thread> ts;
    for (int t = 0; t < 8; ++t)
      ts.emplace_back([&, t] {
        std::mt19937_64 rng(static_cast<std::uint64_t>(t) + 77);
        for (int k = 0; k < 2000; ++k) {
          const std::uint64_t i = rng() % n;
          std::uint32_t v = 0;
          if (a.get(i, v) != gpu::status::ok) not_ok++;
          else if (v != before(i)) wrong++;
        }
      });
    for (auto& x : ts) x.join();
    ts.clear();
    EXPECT_EQ(not_ok.load(), 0);
    EXPECT_EQ(wrong.load(), 0);
    for (int t = 0; t < 8; ++t)
      ts.emplace_back([&, t] {
        for (std::uint64_t i = static_cast<std::uint64_t>(t); i < n; i += 8)
          if (a.set(i, after(i)) != gpu::status::ok) not_ok++;
      });
    for (auto& x : ts) x.join();
    EXPECT_EQ(not_ok.load(), 0);
    EXPECT_GT(c.stats().counted.writebacks, 0u) << "pages were evicted dirty";
    EXPECT_GT(c.flush(), 0u);
    EXPECT_NO_THROW(c.check());
  }
  std::uint64_t stale = 0;
  for (std::uint64_t i = 0; i < n; ++i) stale += p[i] != after(i);
  EXPECT_EQ(stale, 0u) << "every written element reached the unified memory";
  gpu::cache c(rt.files(), dev, host_cache(256 << 10, 4096));
  std::vector<std::uint32_t> mine(16);
  EXPECT_NO_THROW(c.map_memory(mine.data(), mine.size())) << "host memory is memory ferry knows";
  EXPECT_THAT(test::error_text([&] { c.map_memory(reinterpret_cast<std::uint32_t*>(4096), 16); }), HasSubstr("not memory ferry knows"));
  as.free(p);
}

// A file cut short under the cache: pages past its new end come back as out_of_range, the host's
// check throws with the proxy's reason, and then pages that exist are read as before.
TEST(GpuCache, ASourceThatFailsIsAStatusInTheRequesterAndAnExceptionOnTheHost) {
  runtime rt(sim_cfg());
  data_file d("gpu-cache-fail", 1 << 20, 4);
  gpu::cache c(rt.files(), rt.devices().get("sim:0"), host_cache(256 << 10, 4096));
  auto f = file::open(d.path.string(), open_mode::read);
  auto a = c.map<std::uint64_t>(f, 0, d.bytes.size() / 8);
  std::filesystem::resize_file(d.path, 256 << 10);
  std::uint64_t v = 0;
  EXPECT_EQ(a.get(100'000, v), gpu::status::out_of_range) << "a page past the new end";
  EXPECT_EQ(a.get(a.size(), v), gpu::status::out_of_range) << "an index past the array";
  try {
    c.check();
    FAIL() << "check did not throw";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::out_of_range);
    EXPECT_THAT(e.what(), HasSubstr("only 0 bytes exist there"));
  }
  EXPECT_NO_THROW(c.check()) << "check clears what it reported";
  ASSERT_EQ(a.get(10, v), gpu::status::ok);
  EXPECT_EQ(std::memcmp(&v, d.bytes.data() + 80, 8), 0);
  EXPECT_EQ(c.stats().counted.failures, 2u);
}

// A ring of 2 slots for 8 requesters: they wait for slots (back-pressure), none fails.
TEST(GpuCache, AFullRingMakesRequestersWaitNotFail) {
  runtime rt(sim_cfg());
  data_file d("gpu-cache-ring", 2 << 20, 5);
  gpu::cache c(rt.files(), rt.devices().get("sim:0"), host_cache(512 << 10, 4096, 2));
  random_reads<std::uint32_t>(c, d, 0, 1000);
  EXPECT_EQ(c.stats().counted.failures, 0u);
}

// Requesters that wait 1 ns for an answer: the page comes back as timed_out, the landing slot the
// proxy may still write is retired, and the host's check says so.
TEST(GpuCache, RequestsThatGoUnansweredEndAtTheRequestersDeadline) {
  runtime rt(sim_cfg());
  data_file d("gpu-cache-deadline", 1 << 20, 6);
  gpu::cache_options o = host_cache(256 << 10, 4096);
  o.wait = std::chrono::nanoseconds(1);
  gpu::cache c(rt.files(), rt.devices().get("sim:0"), o);
  auto a = c.map<std::uint64_t>(file::open(d.path.string(), open_mode::read), 0, d.bytes.size() / 8);
  std::uint64_t v = 0;
  EXPECT_EQ(a.get(0, v), gpu::status::timed_out);
  auto s = c.stats();
  EXPECT_EQ(s.counted.retired, 1u);
  try {
    c.check();
    FAIL() << "check did not throw";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::timeout);
    EXPECT_THAT(e.what(), HasSubstr("timed out"));
  }
}

// Options that cannot work are refused, naming what was wrong.
TEST(GpuCache, BadOptionsAreRefused) {
  runtime rt(sim_cfg());
  auto refused = [&](gpu::cache_options o, const char* what) {
    try {
      gpu::cache c(rt.files(), rt.devices().get("sim:0"), o);
      ADD_FAILURE() << "accepted " << what;
    } catch (const error& e) {
      EXPECT_THAT(e.what(), HasSubstr(what));
    }
  };
  refused(host_cache(1 << 20, 3000), "page_bytes=3000");
  refused(host_cache(1 << 20, 4 << 20), "page_bytes=4194304");
  refused(host_cache(1000, 4096), "bytes=1000");
  gpu::cache c(rt.files(), rt.devices().get("sim:0"), host_cache(1 << 20, 4096));
  data_file d("gpu-cache-bad", 4096, 7);
  try {
    c.map_bytes(file::open(d.path.string(), open_mode::read), 10, 0);
    FAIL() << "mapped an empty range";
  } catch (const error& e) {
    EXPECT_THAT(e.what(), HasSubstr("offset=10 bytes=0"));
  }
}

// Pages written into a cache over a file opened read-only cannot be written back: the requesters
// that meet them while looking for a frame pass them over (the failure kept for the host), so reads
// of other pages go on being served from the clean frames.
TEST(GpuCache, DirtyPagesThatCannotBeWrittenBackDoNotFailOtherReads) {
  runtime rt(sim_cfg());
  data_file d("gpu-cache-readonly", 1 << 20, 8);
  gpu::cache_options o = host_cache(64 << 10, 4096);  // 16 frames
  o.wait = std::chrono::seconds(5);
  gpu::cache c(rt.files(), rt.devices().get("sim:0"), o);
  auto a = c.map<std::uint32_t>(file::open(d.path.string(), open_mode::read), 0, d.bytes.size() / 4);
  for (std::uint64_t p = 0; p < 8; ++p) ASSERT_EQ(a.set(p * 1024, 7u), gpu::status::ok) << "page " << p;
  std::mt19937_64 rng(3);
  int not_ok = 0, wrong = 0;
  for (int k = 0; k < 200; ++k) {
    const std::uint64_t i = 8 * 1024 + rng() % (a.size() - 8 * 1024);
    std::uint32_t v = 0;
    if (a.get(i, v) != gpu::status::ok) not_ok++;
    else wrong += std::memcmp(&v, d.bytes.data() + 4 * i, 4) != 0;
  }
  EXPECT_EQ(not_ok, 0);
  EXPECT_EQ(wrong, 0);
  EXPECT_GT(c.stats().counted.failures, 0u) << "the write-backs were tried and failed";
  try {
    c.check();
    FAIL() << "check did not throw";
  } catch (const error& e) {
    EXPECT_THAT(e.what(), HasSubstr("read-only"));
  }
}
