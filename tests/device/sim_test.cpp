// Behaviour specific to the sim backend: the parts of a real device it models for the layers above
// (capacity, CPU faults on device memory, bad host pointers, slow engines and deadlines).
#include <ferry/core/checksum.hpp>
#include <ferry/device/registry.hpp>
#include <ferry/settings.hpp>

#include "support/errors.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/mman.h>

#include <csignal>

#include <thread>

using namespace ferry;
using ::testing::HasSubstr;

namespace {

settings small_sim(std::uint64_t capacity = 8ull << 20, std::uint64_t gran = 1ull << 20) {
  settings s;
  s.sim_capacity = capacity;
  s.sim_granularity = gran;
  s.sim_devices = 2;
  s.deadline = std::chrono::seconds(10);
  return s;
}

TEST(Sim, CapacityExhaustionIsOutOfMemoryAndRecovers) {
  device_registry reg(small_sim());
  device& d = reg.get("sim:0");
  std::vector<physical_chunk> cs;
  for (int i = 0; i < 8; ++i) cs.push_back(d.allocate(1 << 20));
  EXPECT_EQ(d.memory().free, 0u);
  try {
    d.allocate(1 << 20);
    FAIL() << "allocation past capacity succeeded";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::out_of_memory);
    EXPECT_THAT(e.what(), HasSubstr("sim:0 bytes=1048576"));
    EXPECT_THAT(e.what(), HasSubstr("8388608 of 8388608 in use"));
  }
  cs.pop_back();
  EXPECT_NO_THROW(cs.push_back(d.allocate(1 << 20)));
  cs.clear();
  EXPECT_EQ(d.memory().free, 8u << 20);
  EXPECT_NO_THROW(d.allocate(8 << 20));  // freed blocks coalesce
}

TEST(Sim, HostChunksDoNotCountAgainstDeviceCapacity) {
  device_registry reg(small_sim(2 << 20));
  device& d = reg.get("sim:0");
  auto h1 = d.allocate(4 << 20, location::on_host());
  auto h2 = d.allocate(4 << 20, location::on_host());
  EXPECT_EQ(d.memory().free, 2u << 20);
}

void touch_device_memory_from_cpu() {
  device_registry reg(small_sim());
  device& d = reg.get("sim:0");
  va_range va = d.reserve(1 << 20);
  physical_chunk c = d.allocate(1 << 20);
  d.map(va.base(), c);
  access_desc rw[] = {{location::on_device(), access::read_write}};
  d.set_access(va.base(), 1 << 20, rw);
  *va.at<volatile int>(0) = 1;  // device memory: no CPU access
}

TEST(SimDeathTest, CpuTouchingDeviceMemoryFaultsLikeCuda) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
#if defined(__SANITIZE_ADDRESS__)
  EXPECT_DEATH(touch_device_memory_from_cpu(), "SEGV");  // ASan reports the fault and exits
#else
  EXPECT_EXIT(touch_device_memory_from_cpu(), ::testing::KilledBySignal(SIGSEGV), "");
#endif
}

TEST(Sim, BadHostPointerIsAnErrorNotACrash) {
  device_registry reg(small_sim());
  device& d = reg.get("sim:0");
  va_range va = d.reserve(1 << 20);
  physical_chunk c = d.allocate(1 << 20);
  d.map(va.base(), c);
  access_desc rw[] = {{location::on_device(), access::read_write}};
  d.set_access(va.base(), 1 << 20, rw);
  // A host page with no access at all.
  void* bad = ::mmap(nullptr, 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(bad, MAP_FAILED);
  auto s = d.create_stream();
  s->copy(va.base(), bad, 4096);
  try {
    s->synchronize();
    FAIL() << "copy from an unreadable host page succeeded";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::bad_address);
    EXPECT_THAT(e.what(), HasSubstr("source host memory is not readable"));
    EXPECT_THAT(e.what(), HasSubstr("EFAULT"));
  }
  std::vector<char> ok(4096, 'x');
  s->copy(bad, ok.data(), 4096);
  try {
    s->synchronize();
    FAIL();
  } catch (const error& e) {
    EXPECT_THAT(e.what(), HasSubstr("destination host memory is not writable"));
  }
  // The error was reported once; the stream is usable again.
  s->copy(va.base(), ok.data(), 4096);
  EXPECT_NO_THROW(s->synchronize());
  ::munmap(bad, 4096);
}

TEST(Sim, DeadlineExpiresOnASlowEngine) {
  settings s = small_sim(64 << 20);
  s.sim_copy_gbps = 0.01;  // 10 MB/s
  device_registry reg(s);
  device& d = reg.get("sim:0");
  std::vector<char> a(8 << 20), b(8 << 20);
  auto st = d.create_stream();
  st->copy(b.data(), a.data(), a.size());  // ~0.8 s
  auto t0 = std::chrono::steady_clock::now();
  try {
    st->synchronize(deadline_after(std::chrono::milliseconds(50)));
    FAIL() << "synchronize returned before the copy could finish";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::timeout);
    EXPECT_THAT(e.what(), HasSubstr("sim:0 stream#"));
    EXPECT_THAT(e.what(), HasSubstr("1 of 1 operations unfinished"));
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
  EXPECT_NO_THROW(st->synchronize(deadline_after(std::chrono::seconds(10))));
}

TEST(Sim, PeerAccessNeedsAGrant) {
  device_registry reg(small_sim());
  device& d0 = reg.get("sim:0");
  device& d1 = reg.get("sim:1");
  va_range va = d1.reserve(1 << 20);
  physical_chunk c = d1.allocate(1 << 20);
  d1.map(va.base(), c);
  access_desc own[] = {{location::on_device(), access::read_write}};
  d1.set_access(va.base(), 1 << 20, own);
  std::vector<char> h(4096, 'p');
  auto s = d0.create_stream();
  try {
    s->copy(va.base(), h.data(), h.size());
    FAIL() << "sim:0 wrote sim:1 memory without a grant";
  } catch (const error& e) {
    EXPECT_THAT(e.what(), HasSubstr("without write access for sim:0"));
  }
  access_desc peer[] = {{location::on_device(0), access::read}};
  d1.set_access(va.base(), 1 << 20, peer);
  EXPECT_THROW(s->copy(va.base(), h.data(), h.size()), error);  // read only
  std::vector<char> back(4096);
  EXPECT_NO_THROW(s->copy(back.data(), va.base(), back.size()));
  s->synchronize();
}

TEST(Sim, PeerMemoryIsRefusedClearly) {
  settings c = small_sim();
  {
    device_registry reg(c);
    device& d0 = reg.get("sim:0");
    std::uint64_t g = d0.granularity();
    EXPECT_THAT(test::error_text([&] { (void)d0.allocate(g, location::on_device(1)); }), HasSubstr("no sim device 1 is open"));
    (void)reg.get("sim:1");
    std::vector<physical_chunk> all;
    EXPECT_THAT(test::error_text([&] {
                  for (;;) all.push_back(d0.allocate(g, location::on_device(1)));
                }),
                HasSubstr("device memory of sim:1 exhausted"));
    EXPECT_EQ(reg.get("sim:1").memory().free, 0u);
    EXPECT_EQ(d0.memory().free, d0.memory().total) << "sim:0's own memory is untouched";
    all.clear();
    EXPECT_EQ(reg.get("sim:1").memory().free, reg.get("sim:1").memory().total);
  }
  c.sim_peer = false;
  device_registry reg(c);
  EXPECT_THAT(test::error_text([&] { (void)reg.get("sim:0").allocate(reg.get("sim:0").granularity(), location::on_device(1)); }),
              HasSubstr("FERRY_SIM_PEER=0"));
}

TEST(Sim, ManyStreamsFromManyThreads) {
  device_registry reg(small_sim(64 << 20));
  device& d = reg.get("sim:0");
  std::vector<std::thread> ts;
  std::atomic<int> good{0};
  for (int t = 0; t < 8; ++t)
    ts.emplace_back([&, t] {
      va_range va = d.reserve(1 << 20);
      physical_chunk c = d.allocate(1 << 20);
      d.map(va.base(), c);
      access_desc rw[] = {{location::on_device(), access::read_write}};
      d.set_access(va.base(), 1 << 20, rw);
      auto s = d.create_stream();
      for (int i = 0; i < 20; ++i) {
        std::uint64_t sum = 0;
        s->fill_pattern(va.base(), 1 << 20, static_cast<std::uint64_t>(t * 100 + i));
        s->checksum(va.base(), 1 << 20, &sum);
        s->synchronize();
        if (sum == pattern_checksum(1 << 20, static_cast<std::uint64_t>(t * 100 + i))) good++;
      }
      d.unmap(va.base(), 1 << 20);
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(good.load(), 160);
}

TEST(Sim, LookupErrors) {
  device_registry reg(small_sim());
  auto text = [&](std::string_view n) { return test::error_text([&] { reg.get(n); }); };
  EXPECT_THAT(text("sim:2"), HasSubstr("there are 2 sim devices"));
  EXPECT_THAT(text("tpu:0"), HasSubstr("expected a device name like gpu:0"));
  EXPECT_THAT(text("sim:"), HasSubstr("expected a device name"));
  EXPECT_THAT(text("sim:-1"), HasSubstr("expected a device name"));
}

}  // namespace
