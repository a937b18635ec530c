// The transfer engine on sim devices: every path, batches, deadlines, cancellation, per-request errors.
#include <ferry/core/checksum.hpp>
#include <ferry/runtime.hpp>
#include <ferry/xfer/staged_copies.hpp>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <cstring>
#include <random>

#include <sys/mman.h>

using namespace ferry;
using ::testing::HasSubstr;

namespace {

settings sim_settings() {
  settings s;
  s.backend = backend_choice::sim;
  s.sim_devices = 2;
  s.sim_capacity = 256ull << 20;
  s.sim_granularity = 1ull << 20;
  s.staging_bytes = 1ull << 20;
  s.staging_buffers = 4;
  s.xfer_threads = 4;
  s.xfer_chunk = 4ull << 20;
  s.deadline = std::chrono::seconds(20);
  return s;
}

// Device memory on a sim device, granted to every sim device.
struct region {
  va_range va;
  std::vector<physical_chunk> chunks;
  region(device& d, std::uint64_t bytes, int devices = 2) {
    std::uint64_t g = d.granularity();
    bytes = (bytes + g - 1) / g * g;
    va = d.reserve(bytes);
    for (std::uint64_t off = 0; off < bytes; off += g) {
      chunks.push_back(d.allocate(g));
      d.map(va.at(off), chunks.back());
    }
    std::vector<access_desc> grants;
    for (int i = 0; i < devices; ++i) grants.push_back({location::on_device(i), access::read_write});
    d.set_access(va.base(), bytes, grants);
  }
  std::byte* p(std::uint64_t off = 0) const { return va.at(off); }
};

std::vector<unsigned char> random_bytes(std::size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  std::mt19937_64 rng(seed);
  for (std::size_t i = 0; i < n; i += 8) {
    auto w = rng();
    std::memcpy(v.data() + i, &w, std::min<std::size_t>(8, n - i));
  }
  return v;
}

std::uint64_t device_checksum(device& d, const void* p, std::uint64_t n) {
  auto s = d.create_stream();
  std::uint64_t sum = 0;
  s->checksum(p, n, &sum);
  s->synchronize();
  return sum;
}

TEST(Engine, MixedBatchOverEveryPathWithRandomData) {
  runtime rt(sim_settings());
  device& d0 = rt.devices().get("sim:0");
  device& d1 = rt.devices().get("sim:1");
  region a(d0, 16 << 20), b(d0, 16 << 20), c(d1, 16 << 20);
  std::vector<std::size_t> sizes = {1, 7, 4096, 65536 + 3, 1 << 20, (9 << 20) + 5};
  std::vector<std::vector<unsigned char>> src, back;
  std::vector<transfer_request> reqs;
  std::uint64_t off = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    src.push_back(random_bytes(sizes[i], static_cast<unsigned>(i)));
    back.emplace_back(sizes[i], 0);
    reqs.push_back({a.p(off), src[i].data(), sizes[i]});  // host -> sim:0
    off += (sizes[i] + 8191) / 8192 * 8192;
  }
  transfer_batch up = rt.engine().submit(reqs);
  ASSERT_TRUE(up.wait());
  EXPECT_EQ(up.bytes_done(), up.bytes_total());
  // sim:0 -> sim:0 (direct), sim:0 -> sim:1 (peer), sim:1 -> host (direct)
  std::vector<transfer_request> hops = {{b.p(), a.p(), off}, {c.p(), b.p(), off}};
  transfer_batch hop1 = rt.engine().submit({&hops[0], 1});
  ASSERT_TRUE(hop1.wait());
  transfer_batch hop2 = rt.engine().submit({&hops[1], 1});
  ASSERT_TRUE(hop2.wait());
  EXPECT_EQ(hop1.results()[0].path, transfer_path::direct);
  EXPECT_EQ(hop2.results()[0].path, transfer_path::peer);
  std::vector<transfer_request> down;
  off = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    down.push_back({back[i].data(), c.p(off), sizes[i]});
    off += (sizes[i] + 8191) / 8192 * 8192;
  }
  transfer_batch dn = rt.engine().submit(down);
  ASSERT_TRUE(dn.wait());
  for (std::size_t i = 0; i < sizes.size(); ++i) EXPECT_EQ(back[i], src[i]) << "request " << i;
  // host -> host
  std::vector<unsigned char> h2(sizes.back());
  auto on_caller = rt.engine().counters().get("copies_on_caller").value();
  rt.engine().copy(h2.data(), src.back().data(), h2.size());
  EXPECT_EQ(h2, src.back());
  EXPECT_GE(rt.engine().counters().get("path.host").value(), 1u);
  // copy() of one unit of work (one chunk, one device copy) runs on the calling thread: no worker
  // hand-off. (The 9 MiB host copy above is several chunks, for the workers.)
  EXPECT_EQ(rt.engine().counters().get("copies_on_caller").value(), on_caller);
  std::vector<unsigned char> small(4096);
  rt.engine().copy(small.data(), src[2].data(), small.size());
  EXPECT_EQ(small, src[2]);
  EXPECT_EQ(rt.engine().counters().get("copies_on_caller").value(), on_caller + 1);
  std::vector<unsigned char> h3(sizes.back());
  rt.engine().copy(c.p(0), src.back().data(), h3.size());
  rt.engine().copy(h3.data(), c.p(0), h3.size());
  EXPECT_EQ(h3, src.back()) << "host -> sim -> host by copy()";
  EXPECT_EQ(rt.engine().counters().get("copies_on_caller").value(), on_caller + 3);
  // submit() leaves its work to the workers (the waiter may still help).
  std::vector<unsigned char> h4(sizes.back());
  transfer_request one{h4.data(), src.back().data(), h4.size()};
  ASSERT_TRUE(rt.engine().submit({&one, 1}).wait());
  EXPECT_EQ(h4, src.back());
  EXPECT_EQ(rt.engine().counters().get("copies_on_caller").value(), on_caller + 3);
}

// Tasks run queued items on the executor as the queue asks for them: none for copies the caller
// runs itself, never more at once than FERRY_XFER_THREADS.
TEST(Engine, TasksStartAsTheQueueAsksForThem) {
  settings s = sim_settings();
  s.xfer_threads = 3;
  runtime rt(s);
  auto made = [&] { return rt.engine().counters().get("tasks.most").value(); };
  device& d0 = rt.devices().get("sim:0");
  region a(d0, 16 << 20);
  auto src = random_bytes(16 << 20, 5);
  rt.engine().copy(a.p(), src.data(), 4096);
  EXPECT_EQ(made(), 0u) << "a copy the caller runs starts no task";
  std::vector<transfer_request> reqs;
  for (int i = 0; i < 16; ++i) reqs.push_back({a.p(std::uint64_t(i) << 20), src.data() + (i << 20), 1 << 20});
  for (int round = 0; round < 8; ++round) {
    std::vector<transfer_batch> bs;
    for (int k = 0; k < 4; ++k) bs.push_back(rt.engine().submit(reqs));
    for (auto& b : bs) ASSERT_TRUE(b.wait());
  }
  EXPECT_GE(made(), 1u);
  EXPECT_LE(made(), 3u) << "never more than FERRY_XFER_THREADS";
  std::vector<unsigned char> back(16 << 20);
  rt.engine().copy(back.data(), a.p(), back.size());
  EXPECT_EQ(back, src);
}

// copy() from many threads: each runs its copy on a stream of its own until the engine holds 64
// such streams; the copies of further threads go to the workers (a stream per thread ever seen would
// pile up). The threads stay alive until all have copied, so that no thread id is reused.
TEST(Engine, CopiesFromManyThreadsKeepHelperStreamsBounded) {
  runtime rt(sim_settings());
  device& d0 = rt.devices().get("sim:0");
  region a(d0, 1 << 20);
  auto src = random_bytes(4096, 5);
  auto before = rt.engine().counters().get("copies_on_caller").value();
  std::atomic<int> copied{0};
  std::vector<std::thread> ts;
  for (int i = 0; i < 80; ++i)
    ts.emplace_back([&, i] {
      rt.engine().copy(a.p(4096 * static_cast<std::uint64_t>(i)), src.data(), src.size());
      copied++;
      while (copied.load() < 80) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    });
  for (auto& t : ts) t.join();
  auto ran_here = rt.engine().counters().get("copies_on_caller").value() - before;
  EXPECT_GE(ran_here, 60u);
  EXPECT_LE(ran_here, 64u) << "threads past the bound hand their copies to the workers";
  std::vector<unsigned char> back(4096);
  rt.engine().copy(back.data(), a.p(4096 * 79), back.size());
  EXPECT_EQ(back, src);
}

TEST(Engine, StagedThroughHostWithoutPeerAccess) {
  settings s = sim_settings();
  s.sim_peer = false;
  runtime rt(s);
  device& d0 = rt.devices().get("sim:0");
  device& d1 = rt.devices().get("sim:1");
  std::uint64_t n = 5 << 20;
  va_range va0 = d0.reserve(n + (1 << 20)), va1 = d1.reserve(n + (1 << 20));
  std::vector<physical_chunk> cs;
  for (std::uint64_t off = 0; off < va0.size(); off += 1 << 20) {
    cs.push_back(d0.allocate(1 << 20));
    d0.map(va0.at(off), cs.back());
    cs.push_back(d1.allocate(1 << 20));
    d1.map(va1.at(off), cs.back());
  }
  access_desc own[] = {{location::on_device(), access::read_write}};
  d0.set_access(va0.base(), va0.size(), own);
  d1.set_access(va1.base(), va1.size(), own);
  auto st = d0.create_stream();
  st->fill_pattern(va0.base(), n, 5);
  st->synchronize();
  transfer_request r{va1.base(), va0.base(), n};
  transfer_batch b = rt.engine().submit({&r, 1});
  ASSERT_TRUE(b.wait()) << (b.results()[0].err ? b.results()[0].err->what() : "");
  EXPECT_EQ(b.results()[0].path, transfer_path::staged);
  EXPECT_EQ(device_checksum(d1, va1.base(), n), pattern_checksum(n, 5));
}

// A handle assigned over (a finished batch, a running one, an empty one) ends that batch as its
// destructor would, once; the new one is the handle's.
TEST(Engine, AssigningOverABatchHandleEndsTheOldBatchOnce) {
  runtime rt(sim_settings());
  region a(rt.devices().get("sim:0"), 8 << 20);
  auto src = random_bytes(4 << 20, 5);
  std::vector<transfer_request> r1 = {{a.p(), src.data(), src.size()}}, r2 = {{a.p(4 << 20), src.data(), src.size()}};
  transfer_batch b = rt.engine().submit(r1);
  ASSERT_TRUE(b.wait());
  for (int i = 0; i < 20; ++i) {
    b = rt.engine().submit(i % 2 ? r1 : r2);  // over a finished batch, then over a running one
    b = rt.engine().submit(i % 2 ? r2 : r1);
  }
  ASSERT_TRUE(b.wait());
  b = transfer_batch{};
  b = transfer_batch{};
  std::vector<unsigned char> back(src.size());
  rt.engine().copy(back.data(), a.p(4 << 20), back.size());
  EXPECT_EQ(back, src);
}

TEST(Engine, OneBadRequestIsReportedWhileTheOthersComplete) {
  runtime rt(sim_settings());
  device& d0 = rt.devices().get("sim:0");
  region a(d0, 4 << 20);
  va_range unmapped = d0.reserve(1 << 20);
  auto src = random_bytes(1 << 20, 9);
  std::vector<unsigned char> back(1 << 20);
  std::vector<transfer_request> reqs = {
      {a.p(), src.data(), src.size()},                // fine
      {unmapped.base(), src.data(), 4096},            // reserved but not mapped
      {nullptr, src.data(), 10},                      // null
      {a.p(2 << 20), src.data(), 0},                  // zero length
      {a.p(1 << 20), src.data(), src.size()},         // fine
  };
  transfer_batch b = rt.engine().submit(reqs);
  EXPECT_FALSE(b.wait());
  auto res = b.results();
  EXPECT_EQ(res[0].state, request_state::done);
  EXPECT_EQ(res[4].state, request_state::done);
  ASSERT_EQ(res[1].state, request_state::failed);
  EXPECT_EQ(res[1].err->code(), errc::bad_address);
  EXPECT_THAT(res[1].err->what(), HasSubstr("reserved on sim:0 but not mapped"));
  EXPECT_THAT(res[2].err->what(), HasSubstr("null pointer"));
  EXPECT_THAT(res[3].err->what(), HasSubstr("zero length"));
  EXPECT_THROW(b.check(), error);
  rt.engine().copy(back.data(), a.p(1 << 20), back.size());
  EXPECT_EQ(back, src);
}

TEST(Engine, FreedHostMemoryIsRefused) {
  runtime rt(sim_settings());
  region a(rt.devices().get("sim:0"), 1 << 20);
  std::size_t n = 1 << 20;
  // The engine's first copy starts its workers, whose stacks and buffers may be mapped into a range
  // freed just before; one copy first keeps the freed range unmapped until the check.
  std::vector<char> warm(4096, 1);
  rt.engine().copy(a.p(), warm.data(), warm.size());
  void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(p, MAP_FAILED);
  ::munmap(p, n);
  try {
    rt.engine().copy(a.p(), p, n);
    FAIL() << "copy from unmapped host memory succeeded";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::bad_address);
    EXPECT_THAT(e.what(), HasSubstr("source is not mapped memory"));
  }
}

TEST(Engine, DeadlineExpiryTimesOutUnfinishedRequests) {
  settings s = sim_settings();
  s.sim_copy_gbps = 0.02;  // 20 MB/s per copy engine
  runtime rt(s);
  region a(rt.devices().get("sim:0"), 32 << 20);
  std::vector<unsigned char> src(32 << 20, 1);
  transfer_request r{a.p(), src.data(), src.size()};
  auto t0 = std::chrono::steady_clock::now();
  transfer_batch b = rt.engine().submit({&r, 1}, {deadline_after(std::chrono::milliseconds(100))});
  EXPECT_FALSE(b.wait());
  auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_LT(waited, std::chrono::milliseconds(1000));
  auto res = b.results();
  EXPECT_EQ(res[0].state, request_state::timed_out);
  EXPECT_EQ(res[0].err->code(), errc::timeout);
  EXPECT_THAT(res[0].err->what(), HasSubstr("deadline"));
  EXPECT_LT(b.bytes_done(), b.bytes_total());
}

// Without a fixed deadline a batch fails only when no byte has moved for its window: one that keeps
// moving outlives the window many times over; one whose next piece takes longer than it fails.
TEST(Engine, ADeadlineWithoutAFixedTimeFollowsProgress) {
  settings s = sim_settings();
  s.sim_copy_gbps = 0.02;   // 20 MB/s: a 1 MiB request takes about 50 ms
  s.sim_copy_engines = 1;
  s.xfer_threads = 1;
  s.xfer_batch_small = 0;   // one work item per request, one after another
  runtime rt(s);
  region a(rt.devices().get("sim:0"), 32 << 20);
  std::vector<unsigned char> src(32 << 20, 3);
  std::vector<transfer_request> reqs;
  for (int i = 0; i < 8; ++i) reqs.push_back({a.p(static_cast<std::uint64_t>(i) << 20), src.data(), 1 << 20});
  auto t0 = std::chrono::steady_clock::now();
  transfer_options moving;
  moving.idle = std::chrono::milliseconds(250);
  transfer_batch b = rt.engine().submit(reqs, moving);
  EXPECT_TRUE(b.wait()) << "every request finished within the window of the one before";
  EXPECT_GT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(250)) << "longer than the window in all";
  b.check();

  transfer_batch fixed = rt.engine().submit(reqs, {deadline_after(std::chrono::milliseconds(250))});
  EXPECT_FALSE(fixed.wait()) << "the same batch against a fixed deadline of the same length";

  transfer_request big{a.p(), src.data(), 16 << 20};  // one piece of 800 ms
  transfer_options stalled;
  stalled.idle = std::chrono::milliseconds(100);
  t0 = std::chrono::steady_clock::now();
  transfer_batch c = rt.engine().submit({&big, 1}, stalled);
  EXPECT_FALSE(c.wait());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(700)) << "failed after the window, not at the end";
  EXPECT_EQ(c.results()[0].state, request_state::timed_out);
}

TEST(Engine, CancelStopsWhatHasNotStarted) {
  settings s = sim_settings();
  s.sim_copy_gbps = 0.05;
  s.xfer_threads = 1;
  s.xfer_batch_small = 0;  // one work item per request (grouped, 8 of them would start as one item)
  runtime rt(s);
  region a(rt.devices().get("sim:0"), 32 << 20);
  std::vector<unsigned char> src(32 << 20, 2);
  std::vector<transfer_request> reqs;
  for (int i = 0; i < 16; ++i) reqs.push_back({a.p(static_cast<std::uint64_t>(i) << 21), src.data(), 2 << 20});
  transfer_batch b = rt.engine().submit(reqs);
  b.cancel();
  b.wait();
  int cancelled = 0;
  for (auto& r : b.results()) cancelled += r.state == request_state::cancelled;
  EXPECT_GE(cancelled, 14);
  for (auto& r : b.results()) {
    if (r.state == request_state::cancelled) {
      EXPECT_EQ(r.err->code(), errc::cancelled);
    }
  }
}

// Small peer copies of one batch from one GPU to two others, pushed from streams of the source (the
// blocks grouped into work items): every block where it belongs.
TEST(Engine, SmallPeerCopiesToSeveralGpusArriveWhole) {
  settings s = sim_settings();
  s.sim_devices = 3;
  runtime rt(s);
  device& d0 = rt.devices().get("sim:0");
  region a(d0, 4 << 20, 3), b(rt.devices().get("sim:1"), 4 << 20, 3), c(rt.devices().get("sim:2"), 4 << 20, 3);
  const std::size_t block = 16 << 10, n = 128;
  auto data = random_bytes(block * n, 7);
  rt.engine().copy(a.p(), data.data(), data.size());
  std::vector<transfer_request> reqs;
  for (std::size_t i = 0; i < n; ++i)  // block i to sim:1 or sim:2 (alternating), at its own offset there
    reqs.push_back({(i % 2 ? c : b).p(i * block), a.p(i * block), block});
  transfer_batch t = rt.engine().submit(reqs);
  ASSERT_TRUE(t.wait());
  t.check();
  for (auto& r : t.results()) EXPECT_EQ(r.path, transfer_path::peer);
  std::vector<unsigned char> back(block);
  for (std::size_t i = 0; i < n; ++i) {
    rt.engine().copy(back.data(), (i % 2 ? c : b).p(i * block), block);
    ASSERT_EQ(0, std::memcmp(back.data(), data.data() + i * block, block)) << "block " << i;
  }
}

// Blocks grouped into work items end together: those of an item that had not started when the batch
// was cancelled all end cancelled, the others done, none left pending.
TEST(Engine, ACancelledBatchOfGroupedBlocksEndsEveryBlock) {
  settings s = sim_settings();
  s.sim_copy_gbps = 0.05;
  s.xfer_threads = 1;  // two work items of 128 blocks: the worker copies one while the other waits
  runtime rt(s);
  region a(rt.devices().get("sim:0"), 16 << 20);
  std::vector<unsigned char> src(16 << 20, 4);
  std::vector<transfer_request> reqs;
  for (int i = 0; i < 256; ++i) reqs.push_back({a.p(static_cast<std::uint64_t>(i) << 16), src.data() + (i << 16), 64 << 10});
  device& d = rt.devices().get("sim:0");
  const auto batches_before = d.counters().get("copy_batches").value();
  transfer_batch b = rt.engine().submit(reqs);
  // Cancelled once the worker's item is on its stream: that one copies, the other does not start.
  const auto t0 = std::chrono::steady_clock::now();
  while (d.counters().get("copy_batches").value() == batches_before && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10))
    std::this_thread::yield();
  b.cancel();
  b.wait();
  int cancelled = 0, done = 0;
  for (auto& r : b.results()) {
    if (r.state == request_state::cancelled) {
      cancelled++;
      EXPECT_EQ(r.err->code(), errc::cancelled);
    } else if (r.state == request_state::done) {
      done++;
      EXPECT_EQ(r.bytes_done, 64u << 10);
    }
  }
  EXPECT_EQ(cancelled + done, 256) << "every block final";
  EXPECT_EQ(done, 128) << "the item under way when the batch was cancelled";
  EXPECT_EQ(cancelled, 128) << "the item not started";
}

TEST(Engine, ManySmallRequestsAreGroupedAndProgressIsCounted) {
  runtime rt(sim_settings());
  region a(rt.devices().get("sim:0"), 4 << 20);
  auto src = random_bytes(4 << 20, 3);
  std::vector<transfer_request> reqs;
  for (std::uint64_t off = 0; off < src.size(); off += 4096) reqs.push_back({a.p(off), src.data() + off, 4096});
  transfer_batch b = rt.engine().submit(reqs);
  ASSERT_TRUE(b.wait());
  EXPECT_TRUE(b.poll());
  EXPECT_EQ(b.bytes_done(), src.size());
  EXPECT_EQ(device_checksum(rt.devices().get("sim:0"), a.p(), src.size()), checksum64(src.data(), src.size()));
  // 1024 requests of 4 KiB in work items of at most FERRY_XFER_CHUNK (4 MiB): one copy per request,
  // but far fewer synchronizations than requests.
  EXPECT_EQ(rt.devices().get("sim:0").counters().get("copies").value(), 1024u);
}

// A batch of many small blocks is grouped into two items per worker where half its share per worker
// is more than FERRY_XFER_CHUNK: each item is one enqueue (one more item would be one more
// synchronization).
TEST(Engine, ABatchOfManyBlocksIsTwoEnqueuesPerWorker) {
  settings s = sim_settings();
  s.xfer_threads = 2;
  s.xfer_chunk = 1 << 20;
  runtime rt(s);
  device& dev = rt.devices().get("sim:0");
  region a(dev, 16 << 20);
  auto src = random_bytes(16 << 20, 5);
  std::vector<transfer_request> reqs;
  // 256 blocks of 64 KiB to slots in reverse order: 16 MiB, two workers, so four items of 4 MiB
  // (with items of FERRY_XFER_CHUNK it would be 16).
  for (std::uint64_t i = 0; i < 256; ++i) reqs.push_back({a.p((255 - i) * (64 << 10)), src.data() + i * (64 << 10), 64 << 10});
  transfer_batch b = rt.engine().submit(reqs);
  ASSERT_TRUE(b.wait());
  b.check();
  EXPECT_EQ(dev.counters().get("copy_batches").value(), 4u);
  EXPECT_EQ(dev.counters().get("copies").value(), 256u);
  std::vector<std::byte> back(64 << 10);
  for (std::uint64_t i : {0ull, 1ull, 128ull, 255ull}) {
    rt.engine().copy(back.data(), a.p((255 - i) * (64 << 10)), back.size());
    EXPECT_EQ(checksum64(back.data(), back.size()), checksum64(src.data() + i * (64 << 10), back.size())) << "block " << i;
  }
}

// A batch nobody waits for: its completion is called once, with every result, when the last request
// is final -- done, refused at submit, or past its deadline -- and the data is in place by then.
TEST(Engine, ABatchWithoutAHandleReportsThroughItsCompletionOnce) {
  settings s = sim_settings();
  runtime rt(s);
  region a(rt.devices().get("sim:0"), 8 << 20);
  auto src = random_bytes(6 << 20, 11);
  struct seen {
    std::mutex mu;
    std::condition_variable cv;
    int calls = 0;
    std::vector<request_result> results;
    bool data_in_place = false;
  } got;
  std::vector<transfer_request> reqs = {{a.p(), src.data(), 4 << 20}, {nullptr, src.data(), 10}, {a.p(4 << 20), src.data(), 2 << 20}};
  rt.engine().submit(reqs, {}, [&](std::span<const request_result> r) {
    bool ok = device_checksum(rt.devices().get("sim:0"), a.p(), 4 << 20) == checksum64(src.data(), 4 << 20);
    std::lock_guard l(got.mu);
    got.calls++;
    got.results.assign(r.begin(), r.end());
    got.data_in_place = ok;
    got.cv.notify_all();
  });
  {
    std::unique_lock l(got.mu);
    ASSERT_TRUE(got.cv.wait_for(l, std::chrono::seconds(10), [&] { return got.calls > 0; }));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::lock_guard l(got.mu);
  EXPECT_EQ(got.calls, 1);
  ASSERT_EQ(got.results.size(), 3u);
  EXPECT_EQ(got.results[0].state, request_state::done);
  EXPECT_EQ(got.results[1].state, request_state::failed);
  EXPECT_THAT(got.results[1].err->what(), HasSubstr("null pointer"));
  EXPECT_EQ(got.results[2].state, request_state::done);
  EXPECT_TRUE(got.data_in_place);

  // Every request refused at submit: called before submit returns.
  int refused = 0;
  transfer_request bad{nullptr, src.data(), 10};
  rt.engine().submit({&bad, 1}, {}, [&](std::span<const request_result> r) { refused += r[0].state == request_state::failed; });
  EXPECT_EQ(refused, 1);
}

TEST(Engine, ABatchWithoutAHandleEndsAtItsDeadline) {
  settings s = sim_settings();
  s.sim_copy_gbps = 0.02;
  s.xfer_threads = 1;
  runtime rt(s);
  region a(rt.devices().get("sim:0"), 32 << 20);
  std::vector<unsigned char> src(32 << 20, 1);
  std::vector<transfer_request> reqs;
  for (int i = 0; i < 8; ++i) reqs.push_back({a.p(static_cast<std::uint64_t>(i) << 22), src.data(), 4 << 20});
  std::mutex mu;
  std::condition_variable cv;
  std::optional<std::vector<request_result>> got;
  auto t0 = std::chrono::steady_clock::now();
  rt.engine().submit(reqs, {deadline_after(std::chrono::milliseconds(100))}, [&](std::span<const request_result> r) {
    std::lock_guard l(mu);
    got.emplace(r.begin(), r.end());
    cv.notify_all();
  });
  std::unique_lock l(mu);
  ASSERT_TRUE(cv.wait_for(l, std::chrono::seconds(10), [&] { return got.has_value(); })) << "no completion after the deadline";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  int timed_out = 0;
  for (auto& r : *got) timed_out += r.state == request_state::timed_out;
  EXPECT_GE(timed_out, 7);
}

}  // namespace

// The copy step of staged roads: copies from pinned host memory on to a device, each completion told
// once with its error or none; wait() (and the end of the object) returns only after every one ran.
TEST(StagedCopies, CompletionsAreToldOnceAndWaitedFor) {
  runtime rt(sim_settings());
  device& d = rt.devices().get("sim:0");
  region r(d, 4 << 20);
  auto src = random_bytes(4 << 20, 7);
  registration pin = rt.registrations().acquire(src.data(), src.size());
  std::atomic<int> told{0}, failed{0};
  {
    staged_copies copies(rt.engine());
    for (std::uint64_t off = 0; off < src.size(); off += 1 << 20) {
      transfer_request q{r.p(off), src.data() + off, 1 << 20};
      copies.start(q, std::chrono::steady_clock::now() + std::chrono::seconds(10), [&](const error* e) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));  // a slow completion is still waited for
        (e ? failed : told)++;
      });
    }
    // A copy that cannot be made (a pointer no memory backs) is told its error, not lost.
    transfer_request bad{r.p(0), reinterpret_cast<const void*>(std::uintptr_t{16}), 4096};
    std::string why;
    copies.start(bad, std::chrono::steady_clock::now() + std::chrono::seconds(10), [&](const error* e) {
      if (e) why = e->what();
      (e ? failed : told)++;
    });
  }  // the end waits for them all
  EXPECT_EQ(told.load(), 4);
  EXPECT_EQ(failed.load(), 1);
  EXPECT_EQ(device_checksum(d, r.p(0), src.size()), checksum64(src.data(), src.size()));
}
