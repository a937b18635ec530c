// Stream-ordered transfers on sim devices: a user's stream (a view of a stream the test made, as a
// user's cudaStream_t would be) with work before and after a batch, value waits, deadlines and
// failures that release the stream. A host word the test holds at 0 plays a user's long kernel.
#include <ferry/core/checksum.hpp>
#include <ferry/runtime.hpp>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

using namespace ferry;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

namespace {

settings sim_settings() {
  settings s;
  s.backend = backend_choice::sim;
  s.sim_devices = 1;
  s.sim_capacity = 64ull << 20;
  s.sim_granularity = 1ull << 20;
  s.staging_bytes = 1ull << 20;
  s.staging_buffers = 4;
  s.xfer_threads = 2;
  s.deadline = std::chrono::seconds(20);
  return s;
}

struct region {
  va_range va;
  std::vector<physical_chunk> chunks;
  region(device& d, std::uint64_t bytes) {
    std::uint64_t g = d.granularity();
    va = d.reserve(bytes);
    for (std::uint64_t off = 0; off < bytes; off += g) {
      chunks.push_back(d.allocate(g));
      d.map(va.at(off), chunks.back());
    }
    access_desc grants[] = {{location::on_device(0), access::read_write}};
    d.set_access(va.base(), bytes, grants);
  }
  std::byte* p(std::uint64_t off = 0) const { return va.at(off); }
};

void set_word(std::uint32_t& w, std::uint32_t v) { std::atomic_ref<std::uint32_t>(w).store(v, std::memory_order_release); }
std::uint32_t word(std::uint32_t& w) { return std::atomic_ref<std::uint32_t>(w).load(std::memory_order_acquire); }

TEST(StreamOrder, AViewIsTheSameStreamAndHasItsHandle) {
  runtime rt(sim_settings());
  device& d = rt.devices().get("sim:0");
  auto mine = d.create_stream();
  EXPECT_FALSE(mine->is_view());
  auto view = d.wrap_stream(mine->native_handle());
  EXPECT_TRUE(view->is_view());
  EXPECT_EQ(view->native_handle(), mine->native_handle());
  // Work through the view queues behind work on the stream itself.
  alignas(4) std::uint32_t hold = 0, flag = 0;
  mine->wait_value(&hold, 1);
  view->write_value(&flag, 5);
  std::this_thread::sleep_for(30ms);
  EXPECT_EQ(word(flag), 0u) << "the view's write ran before the stream's wait";
  set_word(hold, 1);
  view->synchronize();
  EXPECT_EQ(word(flag), 5u);
  view.reset();  // a view goes; the stream stays usable
  mine->write_value(&flag, 6);
  mine->synchronize();
  EXPECT_EQ(word(flag), 6u);
  // The default streams wrap; a handle that is no stream of the device is refused by name.
  auto legacy = d.wrap_stream(native_stream::legacy());
  legacy->write_value(&flag, 7);
  legacy->synchronize();
  EXPECT_EQ(word(flag), 7u);
  try {
    d.wrap_stream(native_stream{0x1234});
    FAIL() << "a bogus handle was wrapped";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::invalid_argument);
    EXPECT_THAT(e.what(), HasSubstr("0x1234"));
  }
}

TEST(StreamOrder, WaitValueComparesSequenceNumbersAcrossWrapAround) {
  runtime rt(sim_settings());
  device& d = rt.devices().get("sim:0");
  auto s = d.create_stream();
  alignas(4) std::uint32_t seq = 0xFFFFFFF0u, flag = 0;
  s->wait_value(&seq, 0x10);  // 0x10 comes after 0xFFFFFFF0 once the number wraps
  s->write_value(&flag, 1);
  set_word(seq, 0xFFFFFFFFu);
  std::this_thread::sleep_for(30ms);
  EXPECT_EQ(word(flag), 0u) << "0xFFFFFFFF is before 0x10 in sequence order";
  set_word(seq, 0x10);
  s->synchronize();
  EXPECT_EQ(word(flag), 1u);
  EXPECT_THROW(s->write_value(reinterpret_cast<std::uint32_t*>(reinterpret_cast<std::uintptr_t>(&flag) + 1), 1), error)
      << "a misaligned word is refused";
}

// The scenario of the streams issue: producer work, a ferry batch, consumer work, all on one user
// stream with no CPU synchronization between them.
TEST(StreamOrder, ABatchRunsAfterTheStreamsEarlierWorkAndLaterWorkSeesIt) {
  runtime rt(sim_settings());
  device& d = rt.devices().get("sim:0");
  const std::uint64_t n = 4ull << 20;
  region a(d, n), b(d, n);
  std::vector<std::byte> host_src(n), host_dst(n);
  fill_pattern(host_src.data(), n, 11);
  auto users = d.create_stream();  // the user's stream; ferry sees it through a view
  auto on = d.wrap_stream(users->native_handle());
  alignas(4) std::uint32_t hold = 0;
  users->wait_value(&hold, 1);        // a long kernel of the user's
  users->fill_pattern(a.p(), n, 3);   // the producer
  std::vector<transfer_request> reqs = {{b.p(), a.p(), n},                          // device -> device
                                        {host_dst.data(), host_src.data(), n}};    // host -> host, on a CPU
  transfer_options o;
  o.on = on.get();
  transfer_batch batch = rt.engine().submit(reqs, o);
  std::uint64_t sum_b = 0, sum_host = 0;
  users->checksum(b.p(), n, &sum_b);  // consumers: they must see the batch's data
  users->copy(a.p(), host_dst.data(), n);
  users->checksum(a.p(), n, &sum_host);
  std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(batch.poll()) << "the batch ran before the stream's earlier work";
  EXPECT_EQ(batch.bytes_done(), 0u);
  set_word(hold, 1);
  users->synchronize();  // the test's check only; nothing between the stream's steps waited on a CPU
  EXPECT_EQ(sum_b, pattern_checksum(n, 3)) << "the consumer saw the producer's data copied by the batch";
  EXPECT_EQ(sum_host, pattern_checksum(n, 11)) << "the consumer saw the host copy made on a CPU";
  ASSERT_TRUE(batch.wait());
  EXPECT_EQ(batch.bytes_done(), 2 * n);
}

TEST(StreamOrder, BatchesOnOneStreamRunInTheStreamsOrder) {
  runtime rt(sim_settings());
  device& d = rt.devices().get("sim:0");
  const std::uint64_t n = 1ull << 20;
  region r(d, 5 * n);
  auto users = d.create_stream();
  alignas(4) std::uint32_t hold = 0;
  users->wait_value(&hold, 1);
  users->fill_pattern(r.p(0), n, 21);
  transfer_options o;
  o.on = users.get();
  std::vector<transfer_batch> chain;
  for (int i = 0; i < 4; ++i) {  // each copies what the one before it wrote
    transfer_request q{r.p((i + 1) * n), r.p(i * n), n};
    chain.push_back(rt.engine().submit({&q, 1}, o));
  }
  std::uint64_t sum = 0;
  users->checksum(r.p(4 * n), n, &sum);
  std::this_thread::sleep_for(30ms);  // time enough for a batch that did not wait to run, wrongly
  for (auto& c : chain) EXPECT_FALSE(c.poll());
  set_word(hold, 1);
  users->synchronize();
  EXPECT_EQ(sum, pattern_checksum(n, 21));
  for (auto& c : chain) EXPECT_TRUE(c.wait());
}

TEST(StreamOrder, ADeadlineOrCancelReleasesTheStreamAndTheResultSaysSo) {
  runtime rt(sim_settings());
  device& d = rt.devices().get("sim:0");
  const std::uint64_t n = 1ull << 20;
  region a(d, n), b(d, n);
  auto users = d.create_stream();
  alignas(4) std::uint32_t hold = 0, after = 0;
  users->wait_value(&hold, 1);  // the user's kernel that does not finish in time
  transfer_request q{b.p(), a.p(), n};
  transfer_options o;
  o.on = users.get();
  o.until = deadline_after(200ms);
  transfer_batch late = rt.engine().submit({&q, 1}, o);
  {
    transfer_options c;
    c.on = users.get();
    transfer_batch dropped = rt.engine().submit({&q, 1}, c);
  }  // its handle goes before the stream reaches it: cancelled
  users->write_value(&after, 1);
  EXPECT_FALSE(late.wait());
  auto r = late.results()[0];
  EXPECT_EQ(r.state, request_state::timed_out);
  ASSERT_TRUE(r.err);
  EXPECT_THAT(r.err->what(), HasSubstr("stream"));
  EXPECT_EQ(r.bytes_done, 0u);
  set_word(hold, 1);  // the user's kernel ends: the stream passes both released batches
  users->synchronize(deadline_after(5s));
  EXPECT_EQ(word(after), 1u) << "work after the dropped batches ran";
}

TEST(StreamOrder, AFailedRequestIsReportedAndLaterStreamWorkProceeds) {
  runtime rt(sim_settings());
  device& d = rt.devices().get("sim:0");
  const std::uint64_t n = 1ull << 20;
  region a(d, n);
  va_range unmapped = d.reserve(n);  // reserved, nothing mapped: the copy fails when it runs
  auto users = d.create_stream();
  alignas(4) std::uint32_t after = 0;
  transfer_request q{unmapped.at(0), a.p(), n};
  transfer_options o;
  o.on = users.get();
  transfer_batch bad = rt.engine().submit({&q, 1}, o);
  users->write_value(&after, 1);
  EXPECT_FALSE(bad.wait());
  EXPECT_EQ(bad.results()[0].state, request_state::failed);
  users->synchronize(deadline_after(5s));
  EXPECT_EQ(word(after), 1u);
}

TEST(StreamOrder, MoreStreamsThanGatesReuseIdleOnes) {
  runtime rt(sim_settings());
  device& d = rt.devices().get("sim:0");
  const std::uint64_t n = 64 << 10;
  region a(d, 1ull << 20), b(d, 1ull << 20);
  for (int i = 0; i < 300; ++i) {
    auto s = d.create_stream();
    transfer_request q{b.p(), a.p(), n};
    transfer_options o;
    o.on = s.get();
    transfer_batch t = rt.engine().submit({&q, 1}, o);
    ASSERT_TRUE(t.wait()) << "stream " << i;
    s->synchronize();
  }
}

}  // namespace
