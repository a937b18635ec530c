// The host proxy of GPU-initiated access on the sim backend, with host threads as requesters: reads
// and writes served from a file into their memory, answers per ticket, sources that fail.
#include <ferry/gpu/proxy.hpp>
#include <ferry/runtime.hpp>

#include "support/data.hpp"
#include "support/sim.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

using namespace ferry;
using ::testing::HasSubstr;

namespace {

constexpr std::uint64_t second = 1'000'000'000;

settings sim_cfg() { return test::sim_settings(64ull << 20); }

struct data_file : test::random_file {
  data_file(const char* name, std::size_t n, std::uint64_t seed) : random_file(::testing::TempDir(), name, n, seed) {}
};

gpu::request read_of(std::uint32_t source, std::uint64_t offset, std::uint64_t bytes, void* dst, std::uint32_t* done) {
  gpu::request r;
  r.source = source;
  r.offset = offset;
  r.bytes = bytes;
  r.addr = reinterpret_cast<std::uint64_t>(dst);
  r.done = reinterpret_cast<std::uint64_t>(done);
  r.kind = gpu::op::read;
  return r;
}

gpu::proxy_options host_requesters(std::uint32_t slots = 64) {
  gpu::proxy_options o;
  o.by = gpu::requesters::host;
  o.slots = slots;
  return o;
}

}  // namespace

// 8 requesters, each 300 random reads (1 byte to 64 KiB, any offset) of a 16 MiB file into its own
// memory through a ring of 16 slots: every read gets its own answer and the file's bytes.
TEST(GpuProxy, EightRequestersReadRandomRangesOfAFile) {
  runtime rt(sim_cfg());
  data_file d("gpu-proxy-read", 16 << 20, 7);
  gpu::proxy px(rt.files(), rt.devices().get("sim:0"), host_requesters(16));
  const std::uint32_t src = px.add(file::open(d.path.string(), open_mode::read));
  auto v = px.view();
  std::span<std::uint32_t> words = px.answer_words(8);
  std::atomic<int> bad{0}, unanswered{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < 8; ++t)
    ts.emplace_back([&, t] {
      std::mt19937_64 rng(static_cast<std::uint64_t>(t));
      std::vector<std::byte> buf(64 << 10);
      for (int i = 0; i < 300; ++i) {
        std::uint64_t n = 1 + rng() % buf.size();
        std::uint64_t off = rng() % (d.bytes.size() - n + 1);
        std::uint32_t* done = &words[static_cast<std::size_t>(t)];
        std::uint64_t ticket = gpu::submit(v, read_of(src, off, n, buf.data(), done), 10 * second);
        if (ticket == gpu::no_ticket || gpu::wait(v, done, ticket, 30 * second) != gpu::status::ok) {
          unanswered++;
          continue;
        }
        if (std::memcmp(buf.data(), d.bytes.data() + off, n) != 0) bad++;
      }
    });
  for (auto& x : ts) x.join();
  EXPECT_EQ(unanswered.load(), 0);
  EXPECT_EQ(bad.load(), 0);
  auto s = px.stats();
  EXPECT_EQ(s.requests, 2400u);
  EXPECT_EQ(s.failed, 0u);
}

// A write request puts the requester's bytes into the file; reads of a range past the end, of a
// source that does not exist and of memory nobody can write come back as error statuses, the
// reasons kept by the proxy; requests after them are served.
TEST(GpuProxy, WritesLandAndFailuresAreStatusesWithTheirReasons) {
  runtime rt(sim_cfg());
  data_file d("gpu-proxy-write", 1 << 20, 9);
  gpu::proxy px(rt.files(), rt.devices().get("sim:0"), host_requesters());
  const std::uint32_t src = px.add(file::open(d.path.string(), open_mode::read_write));
  auto v = px.view();
  std::uint32_t* done = px.answer_words(1).data();
  std::vector<std::byte> mine(4096);
  test::fill_random(mine.data(), mine.size(), 11);
  gpu::request w = read_of(src, 12345, mine.size(), mine.data(), done);
  w.kind = gpu::op::write;
  std::uint64_t t = gpu::submit(v, w, second);
  ASSERT_EQ(gpu::wait(v, done, t, 30 * second), gpu::status::ok);
  {
    std::vector<std::byte> disk(mine.size());
    std::ifstream in(d.path, std::ios::binary);
    in.seekg(12345);
    in.read(reinterpret_cast<char*>(disk.data()), static_cast<std::streamsize>(disk.size()));
    EXPECT_EQ(std::memcmp(disk.data(), mine.data(), mine.size()), 0) << "the file holds the requester's bytes";
  }
  std::vector<std::byte> buf(8192);
  t = gpu::submit(v, read_of(src, (1 << 20) - 100, 4096, buf.data(), done), second);
  EXPECT_EQ(gpu::wait(v, done, t, 30 * second), gpu::status::out_of_range) << "a read past the end";
  t = gpu::submit(v, read_of(7, 0, 16, buf.data(), done), second);
  EXPECT_EQ(gpu::wait(v, done, t, 30 * second), gpu::status::failed) << "no source 7";
  t = gpu::submit(v, read_of(src, 0, 4096, reinterpret_cast<void*>(std::uintptr_t{16}), done), second);
  EXPECT_EQ(gpu::wait(v, done, t, 30 * second), gpu::status::failed) << "memory nobody can write";
  t = gpu::submit(v, read_of(src, 0, 4096, buf.data(), done), second);
  EXPECT_EQ(gpu::wait(v, done, t, 30 * second), gpu::status::ok) << "and the next request is served";
  EXPECT_EQ(std::memcmp(buf.data(), d.bytes.data(), 4096), 0);
  // An answer word the proxy did not hand out (here the requester's own memory): not served, not
  // answered, the requester's wait ends at its deadline.
  std::uint32_t mine_word = 0;
  std::fill(buf.begin(), buf.end(), std::byte{0});
  t = gpu::submit(v, read_of(src, 0, 4096, buf.data(), &mine_word), second);
  EXPECT_EQ(gpu::wait(v, &mine_word, t, 200'000'000), gpu::status::timed_out);
  EXPECT_EQ(mine_word, 0u) << "nothing was stored into a word the proxy does not own";
  EXPECT_TRUE(std::all_of(buf.begin(), buf.begin() + 4096, [](std::byte b) { return b == std::byte{0}; }))
      << "and the request was not served";
  auto e = px.errors();
  ASSERT_EQ(e.size(), 4u);
  EXPECT_THAT(e[0], HasSubstr("only 100 bytes exist there"));
  EXPECT_THAT(e[1], HasSubstr("no source 7"));
  EXPECT_THAT(e[2], HasSubstr("offset 0, 4096 bytes"));
  EXPECT_THAT(e[3], HasSubstr("is not one of the proxy's (answer_words)"));
  EXPECT_EQ(px.stats().failed, 4u);
}

// Bad options are refused, naming what was wrong.
TEST(GpuProxy, ARingSizeThatIsNotAPowerOfTwoIsRefused) {
  runtime rt(sim_cfg());
  try {
    gpu::proxy px(rt.files(), rt.devices().get("sim:0"), host_requesters(100));
    FAIL() << "accepted 100 slots";
  } catch (const error& e) {
    EXPECT_THAT(e.what(), HasSubstr("100 slots"));
  }
}
