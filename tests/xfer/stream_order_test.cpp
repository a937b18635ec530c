// Stream-ordered transfers on sim devices: a user's stream (a view of a stream the test made, as a
// user's cudaStream_t would be) with work before and after a batch, value waits, deadlines and
// failures that release the stream. A host word the test holds at 0 plays a user's long kernel.
#include <ferry/core/checksum.hpp>
#include <ferry/runtime.hpp>

#include "support/data.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <filesystem>
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
  s.staging_buffers = 16;  // the file tests run two stream-ordered requests of 4 buffers each at once
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

// ---- stream-ordered file I/O (file_engine::submit with transfer_options::on) ----------------------

namespace {

struct temp_file {
  std::filesystem::path p;
  explicit temp_file(std::uint64_t bytes, std::uint64_t seed) {
    p = std::filesystem::path(::testing::TempDir()) / ("ferry-stream-" + std::to_string(::getpid()) + "-" + std::to_string(seed));
    std::vector<std::byte> d(bytes);
    fill_pattern(d.data(), bytes, seed);
    ferry::test::write_file(p, d.data(), bytes);
  }
  ~temp_file() { std::filesystem::remove(p); }
};

// Reads a file of pattern `seed` into sim memory and host memory in the stream's order: the stream
// is held (a user's long kernel) while the read is submitted, and the checks that follow on the
// stream must see the file's bytes. Many chunks (1 MiB staging buffers, 4 slots): a pipeline.
void file_read_lands_in_stream_order(int slots) {
  settings cfg = sim_settings();
  cfg.stream_slots = slots;
  runtime rt(cfg);
  device& d = rt.devices().get("sim:0");
  const std::uint64_t n = (9ull << 20) + 4096;
  temp_file tf(n, 31);
  auto f = file::open(tf.p.string(), open_mode::read);
  region dst(d, 16ull << 20);
  std::vector<std::byte> host(n);
  auto users = d.create_stream();
  alignas(4) std::uint32_t hold = 0;
  users->wait_value(&hold, 1);
  users->fill_pattern(dst.p(), n, 99);  // the user's kernel writes the buffer the read then fills
  transfer_options o;
  o.on = users.get();
  std::vector<file_request> reqs = {{f, 0, dst.p(), n, false}, {f, 0, host.data(), n, false}};
  transfer_batch t = rt.files().submit(reqs, o);
  std::uint64_t sum = 0;
  users->checksum(dst.p(), n, &sum);
  std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(t.poll()) << "the read was in the destination before the stream got there";
  set_word(hold, 1);
  users->synchronize();
  EXPECT_EQ(sum, pattern_checksum(n, 31)) << "the stream's next op saw the file's bytes";
  ASSERT_TRUE(t.wait()) << (t.results()[0].err ? t.results()[0].err->what() : "");
  EXPECT_EQ(checksum64(host.data(), n), pattern_checksum(n, 31));
  EXPECT_EQ(t.bytes_done(), 2 * n);
}

TEST(StreamOrder, AFileReadLandsInStreamOrder) { file_read_lands_in_stream_order(4); }
// One buffer: each chunk is read only after the stream copied the one before out of it, so a
// stream that did not wait for each chunk would copy the previous chunk's bytes again.
TEST(StreamOrder, AFileReadThroughOneBufferWaitsForEveryChunk) { file_read_lands_in_stream_order(1); }

// A stream-ordered read whose handle goes away before the stream gets there is cancelled at once
// (not waited out to its deadline), says so, and the stream still goes on.
TEST(StreamOrder, DestroyingAReadsHandleBeforeTheStreamGetsThereCancelsIt) {
  runtime rt(sim_settings());
  device& d = rt.devices().get("sim:0");
  temp_file tf(4ull << 20, 12);
  auto f = file::open(tf.p.string(), open_mode::read);
  std::vector<std::byte> host(4ull << 20);
  auto users = d.create_stream();
  alignas(4) std::uint32_t hold = 0, after = 0;
  users->wait_value(&hold, 1);  // the user's long kernel
  auto start = std::chrono::steady_clock::now();
  {
    transfer_batch t = rt.files().read_async(f, 0, host.data(), host.size(), *users);
    t.cancel();
    EXPECT_FALSE(t.wait());
    ASSERT_TRUE(t.results()[0].err);
    EXPECT_EQ(t.results()[0].err->code(), errc::cancelled) << t.results()[0].err->what();
    transfer_batch u = rt.files().read_async(f, 0, host.data(), host.size(), *users);
  }  // u's handle ends here, the stream still held
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s) << "a cancelled read waited for its deadline";
  users->write_value(&after, 1);
  set_word(hold, 1);
  users->synchronize(deadline_after(5s));
  EXPECT_EQ(word(after), 1u) << "the stream went on past the cancelled reads";
}

// One batch of more stream-ordered reads than the staging pool has buffers: each request goes onto
// the stream before the next waits for buffers, so the later ones get those the stream frees.
TEST(StreamOrder, ABatchOfMoreReadsThanStagingBuffersCompletes) {
  settings cfg = sim_settings();
  cfg.staging_buffers = 4;
  cfg.stream_slots = 2;
  cfg.deadline = std::chrono::seconds(10);
  runtime rt(cfg);
  device& d = rt.devices().get("sim:0");
  const std::uint64_t each = 2ull << 20;
  temp_file tf(12 * each, 41);
  auto f = file::open(tf.p.string(), open_mode::read);
  region dst(d, 12 * each);
  auto users = d.create_stream();
  std::vector<file_request> reqs;
  for (std::uint64_t i = 0; i < 12; ++i) reqs.push_back({f, i * each, static_cast<std::byte*>(dst.p()) + i * each, each, false});
  transfer_options o;
  o.on = users.get();
  auto start = std::chrono::steady_clock::now();
  transfer_batch t = rt.files().submit(reqs, o);
  std::uint64_t sum = 0;
  users->checksum(dst.p(), 12 * each, &sum);
  users->synchronize();
  ASSERT_TRUE(t.wait()) << (t.results()[4].err ? t.results()[4].err->what() : "");
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s) << "a request waited for buffers that only a later one could free";
  EXPECT_EQ(sum, pattern_checksum(12 * each, 41));
}

// A write takes the source as the stream has it at that point: the user's kernel overwrites the
// source right after, on the stream, without waiting on the CPU.
TEST(StreamOrder, AFileWriteTakesTheSourceInStreamOrder) {
  runtime rt(sim_settings());
  device& d = rt.devices().get("sim:0");
  const std::uint64_t n = (5ull << 20) + 8;
  auto path = std::filesystem::path(::testing::TempDir()) / ("ferry-stream-w-" + std::to_string(::getpid()));
  auto f = file::open(path.string(), open_mode::create);
  region src(d, 8ull << 20);
  auto users = d.create_stream();
  alignas(4) std::uint32_t hold = 0;
  users->wait_value(&hold, 1);
  users->fill_pattern(src.p(), n, 5);  // the producer
  transfer_batch t = rt.files().write_async(f, 0, src.p(), n, *users);
  users->fill_pattern(src.p(), n, 6);  // the next step reuses the buffer
  set_word(hold, 1);
  users->synchronize();
  ASSERT_TRUE(t.wait()) << (t.results()[0].err ? t.results()[0].err->what() : "");
  std::vector<std::byte> back(n);
  ASSERT_EQ(rt.files().read(*f, 0, back.data(), n), n);
  EXPECT_EQ(checksum64(back.data(), n), pattern_checksum(n, 5)) << "the file has the source as the stream had it";
  std::filesystem::remove(path);
}

// A read that runs into the end of the file fails, names the file, and releases the stream; the
// destination never receives another file's bytes.
TEST(StreamOrder, AFailedFileReadReleasesTheStreamAndSaysWhy) {
  runtime rt(sim_settings());
  device& d = rt.devices().get("sim:0");
  temp_file tf(3ull << 20, 8);
  auto f = file::open(tf.p.string(), open_mode::read);
  const std::uint64_t n = 6ull << 20;  // three chunks past the end
  std::vector<std::byte> host(n, std::byte{0x5a});
  auto users = d.create_stream();
  alignas(4) std::uint32_t after = 0;
  transfer_batch t = rt.files().read_async(f, 0, host.data(), n, *users);
  users->write_value(&after, 1);
  EXPECT_FALSE(t.wait());
  auto r = t.results()[0];
  EXPECT_EQ(r.state, request_state::failed);
  ASSERT_TRUE(r.err);
  EXPECT_THAT(r.err->what(), HasSubstr(tf.p.string()));
  EXPECT_THAT(r.err->what(), HasSubstr("ends"));
  users->synchronize(deadline_after(5s));
  EXPECT_EQ(word(after), 1u) << "the stream went on past the failed read";
  std::vector<std::byte> want(3ull << 20);
  fill_pattern(want.data(), want.size(), 8);
  std::size_t first_bad = want.size();
  for (std::size_t i = 0; i < want.size(); ++i)
    if (host[i] != want[i]) {
      first_bad = i;
      break;
    }
  EXPECT_EQ(first_bad, want.size()) << "the chunks that exist were delivered; first wrong byte at offset " << first_bad;
  EXPECT_LE(r.bytes_done, want.size()) << "bytes past the end are never counted as read";
}

TEST(StreamOrder, AFileReadWhoseStreamIsHeldTimesOutAndReleasesIt) {
  runtime rt(sim_settings());
  device& d = rt.devices().get("sim:0");
  const std::uint64_t n = 2ull << 20;
  temp_file tf(n, 12);
  auto f = file::open(tf.p.string(), open_mode::read);
  region dst(d, n);
  auto users = d.create_stream();
  alignas(4) std::uint32_t hold = 0, after = 0;
  users->wait_value(&hold, 1);
  transfer_options o;
  o.on = users.get();
  o.until = deadline_after(200ms);
  file_request q{f, 0, dst.p(), n, false};
  transfer_batch t = rt.files().submit({&q, 1}, o);
  users->write_value(&after, 1);
  EXPECT_FALSE(t.wait());
  EXPECT_EQ(t.results()[0].state, request_state::timed_out);
  set_word(hold, 1);
  users->synchronize(deadline_after(5s));
  EXPECT_EQ(word(after), 1u);
}

}  // namespace
