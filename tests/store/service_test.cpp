// The storage service over UCX on loopback: reads with checksums, stat, list, refusals, many clients.
#include <ferry/core/checksum.hpp>
#include <ferry/store/client.hpp>
#include <ferry/store/secret.hpp>
#include <ferry/store/server.hpp>

#include "support/errors.hpp"
#include "support/server_io.hpp"
#include "support/tally.hpp"
#include "support/phased_clients.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <atomic>
#include <deque>
#include <mutex>
#include <numeric>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <optional>
#include <random>
#include <set>
#include <thread>
#include <tuple>

using namespace ferry;
using ::testing::AllOf;
using ::testing::HasSubstr;

namespace {

struct served {
  std::filesystem::path base, root;
  std::vector<unsigned char> data;
  std::unique_ptr<store::server> srv;
  served() {
    base = std::filesystem::path(::testing::TempDir()) / ("ferry-serve-" + std::to_string(::getpid()));
    std::filesystem::remove_all(base);  // left by an earlier process of the same id that did not end cleanly
    root = base / "export";
    std::filesystem::create_directories(root / "data");
    data.resize((9 << 20) + 12345);
    std::mt19937_64 rng(1);
    for (auto& c : data) c = static_cast<unsigned char>(rng());
    std::ofstream(root / "data" / "shard.bin", std::ios::binary).write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
    std::ofstream(base / "secret.txt") << "outside";
    std::filesystem::create_symlink("../secret.txt", root / "escape");
    store::server_options o;
    o.root = root.string();
    o.chunk = 1 << 20;
    o.workers = 4;  // the lane-spreading tests need several
    srv = std::make_unique<store::server>(test::server_io(), o);
  }
  ~served() {
    srv.reset();
    std::filesystem::remove_all(base);
  }
};

TEST(StoreService, ReadStatListOverLoopbackWithChecksums) {
  served s;
  store::client c("127.0.0.1", s.srv->port());
  std::vector<unsigned char> buf(s.data.size());
  EXPECT_EQ(c.read("data/shard.bin", 0, buf.data(), buf.size()), buf.size());
  EXPECT_EQ(checksum64(buf.data(), buf.size()), checksum64(s.data.data(), s.data.size()));
  // A range in the middle, and a read past EOF returns the short count.
  std::vector<unsigned char> part(1000);
  EXPECT_EQ(c.read("data/shard.bin", 4097, part.data(), part.size()), 1000u);
  EXPECT_EQ(std::memcmp(part.data(), s.data.data() + 4097, 1000), 0);
  EXPECT_EQ(c.read("data/shard.bin", s.data.size() - 10, part.data(), part.size()), 10u);
  auto st = c.stat("data/shard.bin");
  EXPECT_EQ(st.size, s.data.size());
  auto entries = c.list("data");
  ASSERT_EQ(entries.size(), 1u);
  EXPECT_EQ(entries[0].name, "shard.bin");
  EXPECT_EQ(entries[0].size, s.data.size());
  EXPECT_GE(s.srv->stats().requests, 5u);
}

// Reads above the inline size are requests of the file engine the server was given (the io layer:
// its io_uring, its checks), by messages and into lent memory alike: its count of bytes read grows
// by what was served.
TEST(StoreService, LargeReadsAreRequestsOfTheFileEngine) {
  served s;
  auto bytes_read = [] { return test::server_io().counters().get("bytes_read").value(); };
  std::uint64_t before = bytes_read();
  std::vector<unsigned char> buf(s.data.size());
  for (bool map : {false, true}) {
    store::client_options co;
    co.map = map;
    store::client c("127.0.0.1", s.srv->port(), co);
    std::memset(buf.data(), 0, buf.size());
    EXPECT_EQ(c.read("data/shard.bin", 0, buf.data(), buf.size()), buf.size());
    EXPECT_EQ(checksum64(buf.data(), buf.size()), checksum64(s.data.data(), s.data.size())) << "map " << map;
    if (map) {
      EXPECT_GT(s.srv->stats().direct_reads, 0u) << "the lent-memory path was not taken";
    }
  }
  EXPECT_GE(bytes_read() - before, 2 * s.data.size());
}

namespace {
// Small reads of one file submitted together, as the ferry:// adapter submits a batch's: they go as
// one read_many request (up to 64 of them). `reads`: (offset, length) each, into `mem`'s buffer of
// the same index; each told to `t`.
void submit_together(store::client& c, const std::string& path, const std::vector<std::pair<std::uint64_t, std::uint64_t>>& reads,
                     const std::vector<unsigned char*>& mem, test::tally& t, std::uint64_t version = 0,
                     std::chrono::steady_clock::time_point until = std::chrono::steady_clock::now() + std::chrono::seconds(10)) {
  std::vector<store::client::request> rs;
  for (std::size_t i = 0; i < reads.size(); ++i) {
    store::client::request r;
    r.path = path;
    r.offset = reads[i].first;
    r.length = reads[i].second;
    r.mem = mem[i];
    r.version = version;
    r.until = until;
    r.done = t.done(i);
    rs.push_back(std::move(r));
  }
  c.submit(rs);
}
std::vector<unsigned char*> pointers(std::vector<std::vector<unsigned char>>& bufs, std::size_t skip = 0) {
  std::vector<unsigned char*> p;
  for (auto& b : bufs) p.push_back(b.data() + skip);
  return p;
}
}  // namespace

// Small reads of one file submitted together (a GPU cache's misses) go as one request: each read gets
// exactly its bytes, short at the end of the file and none past it, told once; a missing file, a file
// replaced since the version asked for, and a path outside the root fail every read, naming it.
TEST(StoreService, SmallReadsOfOneFileGoAsOneRequest) {
  served s;
  const std::uint64_t size = s.data.size();
  const std::vector<std::pair<std::uint64_t, std::uint64_t>> want = {
      {0, 4096}, {4097, 1}, {123457, 5000}, {size - 100, 4096}, {size + 5, 10}, {8 << 20, 65536}, {77, 3}};
  // The answer written into the client's landing region (same host), and sent as a message.
  std::optional<store::client> held;
  for (bool map : {false, true}) {
    SCOPED_TRACE(map ? "into the landing region" : "by messages");
    store::client_options co;
    co.map = map;
    held.emplace("127.0.0.1", s.srv->port(), co);
    auto& c = *held;
    std::vector<std::vector<unsigned char>> bufs;
    for (auto [off, len] : want) bufs.emplace_back(len + 2, 0xee);
    const std::uint64_t version = c.stat("data/shard.bin").version;
    const auto requests = s.srv->stats().requests;
    test::tally t(want.size());
    submit_together(c, "data/shard.bin", want, pointers(bufs, 1), t, version);
    ASSERT_TRUE(t.wait(std::chrono::seconds(30)));
    EXPECT_EQ(s.srv->stats().requests - requests, 1u) << "one request for all the reads";
    EXPECT_EQ(c.stats().direct_pieces, map ? 1u : 0u);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // a second completion would come meanwhile
    auto l = t.lock();
    for (std::size_t i = 0; i < want.size(); ++i) {
      auto [off, len] = want[i];
      std::uint64_t n = off >= size ? 0 : std::min(len, size - off);
      EXPECT_EQ(t.told[i], 1) << "read " << i;
      EXPECT_EQ(t.errors[i], "") << "read " << i;
      EXPECT_EQ(t.bytes[i], n) << "read " << i;
      EXPECT_EQ(std::memcmp(bufs[i].data() + 1, s.data.data() + std::min(off, size), n), 0) << "read " << i;
      EXPECT_EQ(bufs[i][0], 0xee) << "read " << i;
      EXPECT_EQ(bufs[i][n + 1], 0xee) << "nothing past the bytes read, read " << i;
    }
  }
  auto& c = *held;
  // A missing file, a version the file no longer has, a path outside the root: every read fails,
  // naming the path; nothing of the file is handed over.
  const std::vector<std::pair<std::uint64_t, std::uint64_t>> two = {{0, 16}, {100, 1}};
  for (auto [path, version, says] : {std::tuple<const char*, std::uint64_t, const char*>{"data/none.bin", 0, "none.bin"},
                                     {"data/shard.bin", 12345, "shard.bin"},
                                     {"escape", 0, "leads outside the root"}}) {
    SCOPED_TRACE(path);
    std::vector<std::vector<unsigned char>> bufs(2, std::vector<unsigned char>(16, 0xee));
    test::tally t(two.size());
    submit_together(c, path, two, pointers(bufs), t, version);
    ASSERT_TRUE(t.wait(std::chrono::seconds(30)));
    for (auto& e : t.errors) EXPECT_THAT(e, HasSubstr(says));
    for (auto& b : bufs) EXPECT_EQ(b, std::vector<unsigned char>(16, 0xee));
  }
}

// On one host, answers of reads in one request go into the landing region: a request waits for a
// free slot (every answer gives one back as soon as its reads have taken it), so many requests and a
// read between them share a few slots, and they are all free again once the reads are told. A
// request whose answer is larger than a slot is split into requests that each fit one. Every read
// exact.
TEST(StoreService, SmallReadsInOneRequestLandInSlotsWaitingForOneOrSplitToFitOne) {
  served s;
  store::client_options co;
  co.map = true;              // (a same-host server maps the landing region)
  co.piece = 64 << 10;        // no small slots: a slot holds 64 KiB
  co.landing = 4 * co.piece;  // four of them
  store::client c("127.0.0.1", s.srv->port(), co);
  // Each submission reads a file of its own (links to one file): reads of one file queued together
  // may join one request, and a submission must stay a request of its own here.
  for (int g = 0; g < 10; ++g) std::filesystem::create_hard_link(s.root / "data" / "shard.bin", s.root / "data" / ("g" + std::to_string(g) + ".bin"));
  // `groups` submissions of `per` reads each, all under way at once.
  auto read_all = [&](std::size_t groups, std::size_t per, std::uint64_t len, bool read_between) {
    std::vector<std::vector<unsigned char>> mem(groups * per, std::vector<unsigned char>(len));
    std::deque<test::tally> ts;
    for (std::size_t g = 0; g < groups; ++g) {
      std::vector<std::pair<std::uint64_t, std::uint64_t>> reads;
      std::vector<unsigned char*> into;
      for (std::size_t i = 0; i < per; ++i) {
        reads.push_back({(g * per + i) * 10007, len});
        into.push_back(mem[g * per + i].data());
      }
      submit_together(c, "data/g" + std::to_string(g) + ".bin", reads, into, ts.emplace_back(per));
    }
    if (read_between) {  // a read of its own takes a slot (waiting for one if need be)
      std::vector<unsigned char> one(60000);
      EXPECT_EQ(c.read("data/shard.bin", 777, one.data(), one.size(), std::chrono::seconds(5)), one.size());
      EXPECT_EQ(std::memcmp(one.data(), s.data.data() + 777, one.size()), 0);
    }
    for (auto& t : ts) {
      ASSERT_TRUE(t.wait(std::chrono::seconds(30)));
      for (std::size_t i = 0; i < per; ++i) {
        EXPECT_EQ(t.errors[i], "");
        EXPECT_EQ(t.bytes[i], len);
      }
    }
    for (std::size_t k = 0; k < mem.size(); ++k) EXPECT_EQ(std::memcmp(mem[k].data(), s.data.data() + k * 10007, len), 0) << "read " << k;
  };
  const auto started = std::chrono::steady_clock::now();
  const auto direct = [&] { return c.stats().direct_pieces; };
  const auto before = direct();
  // Answers of 8 x 4 KiB + counts fit a slot; ten requests and a read of its own share four slots:
  // each waits for a slot given back by an answer (none comes by messages).
  read_all(10, 8, 4096, true);
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(10)) << "a request or the read waited past the answers";
  const auto after_ten = direct();
  EXPECT_EQ(after_ten - before, 11u) << "an answer came by messages on the same host";
  // 16 x 4 KiB and the counts: more than a slot holds. The first 15 go as one request, the last as
  // one of its own, each into a slot.
  read_all(1, 16, 4096, false);
  EXPECT_EQ(direct() - after_ten, 2u) << "an answer larger than a slot was not split to fit slots";
  const auto after_split = direct();
  read_all(4, 8, 4096, false);  // every slot free again: each of four requests takes one
  EXPECT_EQ(direct() - after_split, 4u) << "slots were not given back as their answers were taken";
  // Requests that end without an answer -- refused by the server -- give their slots back too.
  for (const char* path : {"escape", "data/none.bin"}) {
    std::vector<std::vector<unsigned char>> bufs(2, std::vector<unsigned char>(4096));
    test::tally t(2);
    submit_together(c, path, {{0, 4096}, {8192, 4096}}, pointers(bufs), t);
    ASSERT_TRUE(t.wait(std::chrono::seconds(30)));
    for (auto& e : t.errors) EXPECT_NE(e, "") << path;
  }
  const auto after_errors = direct();
  read_all(4, 8, 4096, false);
  EXPECT_EQ(direct() - after_errors, 4u) << "a request that ended without an answer kept its slot";
  EXPECT_EQ(c.stats().quarantined, 0u);
}

// A file that shrank after the server mapped it: small reads in one request count only the bytes the
// file still has (those served from the mapping too, whose pages past the new end read as zeros), and
// nothing of the old content past the end arrives.
TEST(StoreService, SmallReadsOfAShrunkenFileCountOnlyWhatItStillHas) {
  served s;
  store::client c("127.0.0.1", s.srv->port());
  std::vector<unsigned char> first(4096);
  ASSERT_EQ(c.read("data/shard.bin", 0, first.data(), first.size(), std::chrono::seconds(10)), 4096u);  // the server has the file open and mapped
  const std::uint64_t now_size = (1 << 20) + 1000;
  std::filesystem::resize_file(s.root / "data" / "shard.bin", now_size);
  const std::vector<std::pair<std::uint64_t, std::uint64_t>> want = {
      {8192, 4096}, {now_size - 3000, 4096}, {now_size - 1, 2}, {now_size + 10, 100}, {2 << 20, 4096}, {4096, 100}};
  std::vector<std::vector<unsigned char>> bufs;
  for (auto [off, len] : want) bufs.emplace_back(len, 0xee);
  const auto requests = s.srv->stats().requests;
  test::tally t(want.size());
  submit_together(c, "data/shard.bin", want, pointers(bufs), t);
  ASSERT_TRUE(t.wait(std::chrono::seconds(30)));
  EXPECT_EQ(s.srv->stats().requests - requests, 1u) << "one request for all the reads";
  for (std::size_t i = 0; i < want.size(); ++i) {
    auto [off, len] = want[i];
    std::uint64_t n = off >= now_size ? 0 : std::min(len, now_size - off);
    EXPECT_EQ(t.errors[i], "") << "read " << i;
    EXPECT_EQ(t.bytes[i], n) << "read " << i;
    EXPECT_EQ(std::memcmp(bufs[i].data(), s.data.data() + std::min(off, now_size), n), 0) << "read " << i;
  }
}

// Small reads keep the file open between requests (the server's file cache, and each session's
// last file); a file replaced under the same name is read anew once the cache's time to live is over.
TEST(StoreService, AReplacedFileIsSeenAfterTheFileCacheTimeToLive) {
  auto base = std::filesystem::path(::testing::TempDir()) / ("ferry-ttl-" + std::to_string(::getpid()));
  std::filesystem::create_directories(base);
  auto put = [&](char fill) {
    std::string content(8192, fill);
    std::ofstream(base / "next", std::ios::binary).write(content.data(), static_cast<std::streamsize>(content.size()));
    std::filesystem::rename(base / "next", base / "f");  // a new file under the old name
  };
  put('a');
  store::server_options o;
  o.root = base.string();
  o.fd_cache_ttl = std::chrono::milliseconds(200);
  {
    store::server srv(test::server_io(), o);
    store::client c("127.0.0.1", srv.port());
    char buf[4096];
    for (int i = 0; i < 3; ++i) {  // the same file, several small reads: served from the open file
      ASSERT_EQ(c.read("f", 4096 * (i % 2), buf, sizeof buf), sizeof buf);
      EXPECT_EQ(buf[0], 'a');
    }
    put('b');
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    ASSERT_EQ(c.read("f", 0, buf, sizeof buf), sizeof buf);
    EXPECT_EQ(buf[0], 'b') << "still reading the replaced file after the time to live";
    EXPECT_EQ(buf[4095], 'b');
  }
  std::filesystem::remove_all(base);
}

TEST(StoreService, RefusalsNameThePeerAndPath) {
  served s;
  store::client c("127.0.0.1", s.srv->port());
  std::vector<unsigned char> buf(100);
  EXPECT_THAT(test::error_text([&] { c.read("../secret.txt", 0, buf.data(), 100); }), HasSubstr("'..' is not allowed"));
  try {
    c.read("escape", 0, buf.data(), 100);
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::permission_denied) << "the category survives the wire";
  }
  EXPECT_THAT(test::error_text([&] { c.read("/etc/passwd", 0, buf.data(), 100); }), HasSubstr("absolute paths are not allowed"));
  EXPECT_THAT(test::error_text([&] { c.read("escape", 0, buf.data(), 100); }), HasSubstr("leads outside the root"));
  std::string nul("data/shard.bin\0x", 16);
  EXPECT_THAT(test::error_text([&] { c.stat(nul); }), HasSubstr("NUL byte"));
  std::string missing = test::error_text([&] { c.stat("nope.bin"); });
  EXPECT_THAT(missing, HasSubstr("No such file or directory"));
  EXPECT_THAT(missing, HasSubstr("127.0.0.1:" + std::to_string(s.srv->port())));
  EXPECT_THAT(missing, HasSubstr("[not_found]"));
  // The server is still fine.
  EXPECT_EQ(c.read("data/shard.bin", 0, buf.data(), 100), 100u);
}

// A direct read's pieces (their data goes through shared memory, not on the lane) follow the
// request's first piece onto its lane, so one server worker takes them all; pieces whose data
// travels on the lanes (no shared memory) spread over the lanes, and so over the workers.
TEST(StoreService, ADirectReadsPiecesFollowItsFirstLaneOthersSpread) {
  served s;
  for (bool map : {true, false}) {
    SCOPED_TRACE(map ? "through the landing region" : "by messages");
    store::client_options co;
    co.lanes = 4;
    co.piece = 1 << 20;
    co.map = map;
    std::vector<unsigned char> buf(8 << 20);  // (outlives the client, whose requests write it)
    store::client c("127.0.0.1", s.srv->port(), co);
    ASSERT_EQ(c.read("data/shard.bin", 0, buf.data(), 1), 1u);  // connected (and the landing region lent)
    if (map && c.stats().data_path.find("mapped") == std::string::npos)
      GTEST_SKIP() << "no landing region shared with the server here (" << c.stats().data_path << ")";
    const auto before = s.srv->stats().worker_requests;
    const auto direct_before = c.stats().direct_pieces;
    ASSERT_EQ(c.read("data/shard.bin", 0, buf.data(), buf.size(), std::chrono::seconds(30)), buf.size());
    EXPECT_EQ(std::memcmp(buf.data(), s.data.data(), buf.size()), 0);
    const auto after = s.srv->stats().worker_requests;
    ASSERT_EQ(after.size(), 4u);
    std::vector<std::uint64_t> took;
    for (std::size_t k = 0; k < after.size(); ++k) took.push_back(after[k] - before[k]);
    // (The read asks for the file's version first: one more request, on any worker.)
    const auto most = *std::max_element(took.begin(), took.end());
    const auto all = std::accumulate(took.begin(), took.end(), std::uint64_t{0});
    const auto workers = std::count_if(took.begin(), took.end(), [](std::uint64_t n) { return n > 0; });
    ASSERT_EQ(all, 9u) << "a stat and 8 pieces; requests each worker took: " << ::testing::PrintToString(took);
    if (map) {
      ASSERT_EQ(c.stats().direct_pieces - direct_before, 8u) << "the pieces went through the landing region";
      EXPECT_GE(most, 8u) << "the 8 pieces on one worker; requests each worker took: " << ::testing::PrintToString(took);
    } else {
      EXPECT_GE(workers, 3) << "requests each worker took: " << ::testing::PrintToString(took);
      EXPECT_LT(most, 8u);
    }
  }
}

// Lanes by default follow the machine (one per four cores, 1..4: each lane's thread polls after
// activity, and more lanes than that take turns with the caller and the server on a small machine);
// a count out of range is refused with the count named.
TEST(StoreService, DefaultLanesFollowTheCoresAndABadCountIsRefused) {
  served s;
  store::server_options o;
  o.root = s.root.string();
  store::server srv(test::server_io(), o);
  const unsigned cores = std::thread::hardware_concurrency();
  const int want = static_cast<int>(std::clamp(cores / 4, 1u, 4u));
  EXPECT_EQ(default_net_lanes(), want);
  EXPECT_EQ(store_settings{}.net_lanes, 0);
  store::client_options co;  // lanes 0: the default
  store::client c("127.0.0.1", srv.port(), co);
  std::vector<unsigned char> buf(4096);
  EXPECT_EQ(c.read("data/shard.bin", 0, buf.data(), buf.size(), std::chrono::steady_clock::now() + std::chrono::seconds(30)), 4096u);
  EXPECT_EQ(c.stats().lanes, want);
  co.lanes = 65;
  try {
    store::client bad("127.0.0.1", srv.port(), co);
    FAIL() << "65 lanes were taken";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("lanes 65"), std::string::npos) << e.what();
  }
}

// A client that keeps every credit in use sends its next request the moment an answer arrives:
// the server must have given that request's credit back before answering, or the next one is
// refused as one too many. Reads answered by I/O threads (above the inline size), one lane, two
// credits, four requests submitted at a time -- the two waiting for credit are sent by the lane's
// thread as it takes an answer -- for 5000 requests.
TEST(StoreService, ACreditIsFreeWhenItsAnswerArrives) {
  served s;
  store::server_options o;
  o.root = s.root.string();
  o.max_outstanding = 2;
  o.workers = 1;
  store::server srv(test::server_io(), o);
  std::vector<unsigned char> buf(4 * (32 << 10));  // (outlives the client, whose requests write it)
  store::client_options co;
  co.lanes = 1;
  store::client c("127.0.0.1", srv.port(), co);
  const int n = 5000;
  test::tally t(n);
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (int i = 0; i < n; ++i) {
    if (i >= 4) {  // four submitted: the oldest ends before the next goes
      ASSERT_TRUE(t.wait_one(i - 4, std::chrono::seconds(60))) << "request " << i - 4;
      auto l = t.lock();
      ASSERT_EQ(t.bytes[i - 4], 32u << 10) << "request " << i - 4 << ": " << t.errors[i - 4];
    }
    store::client::request r;
    r.path = "data/shard.bin";
    r.offset = static_cast<std::uint64_t>(i % 64) * 4096;
    r.mem = buf.data() + (i % 4) * (32 << 10);
    r.length = 32 << 10;
    r.until = until;
    r.done = t.done(i);
    c.submit(std::move(r));
  }
  ASSERT_TRUE(t.wait(std::chrono::seconds(60)));
  for (int i = n - 4; i < n; ++i) EXPECT_EQ(t.bytes[i], 32u << 10) << t.errors[i];
  EXPECT_EQ(srv.stats().errors, 0u);
}

TEST(StoreService, ThirtyTwoConcurrentClients) {
  served s;
  std::atomic<int> good{0};
  test::phased_clients(
      32,
      [&](int) {
        store::client_options co;
        co.lanes = 4;  // as many as the server's workers: one on each
        return std::make_unique<store::client>("127.0.0.1", s.srv->port(), co);
      },
      [&](store::client& c, int i) {
        std::vector<unsigned char> buf(1 << 20);
        std::uint64_t off = static_cast<std::uint64_t>(i) * 200000;
        if (c.read("data/shard.bin", off, buf.data(), buf.size()) == buf.size() &&
            std::memcmp(buf.data(), s.data.data() + off, buf.size()) == 0)
          good++;
      });
  EXPECT_EQ(good.load(), 32);
  // Each client opened its lanes (one connection each): lane 0 on the first worker, one further lane
  // on each other worker.
  EXPECT_EQ(s.srv->stats().connections, 32u * 4u);
  EXPECT_THAT(s.srv->stats().worker_connections, ::testing::Each(32u));
  // Every client has gone: the server let go of their sessions.
  for (int i = 0; i < 50 && s.srv->stats().live_sessions > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(s.srv->stats().live_sessions, 0u);
}

TEST(StoreService, LanesSpreadOverTheWorkersInTheOrderTheDoorNamesThem) {
  served s;
  store::client_options o;
  o.lanes = 4;
  store::client a("127.0.0.1", s.srv->port(), o);
  EXPECT_THAT(s.srv->stats().worker_connections, ::testing::ElementsAre(1u, 1u, 1u, 1u));
  o.lanes = 3;  // every client's start in the rotation follows the last one's lanes
  store::client b("127.0.0.1", s.srv->port(), o);
  store::client c("127.0.0.1", s.srv->port(), o);
  EXPECT_THAT(s.srv->stats().worker_connections, ::testing::ElementsAre(3u, 3u, 2u, 2u));
  std::vector<unsigned char> buf(3 << 20);
  EXPECT_EQ(c.read("data/shard.bin", 0, buf.data(), buf.size()), buf.size());
  EXPECT_EQ(std::memcmp(buf.data(), s.data.data(), buf.size()), 0);
}

// A loopback port nobody listens on (bound, then let go), with `free_after` more free after it.
std::uint16_t free_ports(int free_after) {
  for (int attempt = 0; attempt < 50; ++attempt) {
    std::vector<int> held;
    auto bind_port = [&](std::uint16_t p) {
      int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      a.sin_port = htons(p);
      socklen_t len = sizeof a;
      if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
        ::close(fd);
        return 0;
      }
      held.push_back(fd);
      return static_cast<int>(ntohs(a.sin_port));
    };
    int first = bind_port(0);
    bool ok = first > 0 && first + free_after <= 65535;
    for (int k = 1; ok && k <= free_after; ++k) ok = bind_port(static_cast<std::uint16_t>(first + k)) > 0;
    for (int fd : held) ::close(fd);
    if (ok) return static_cast<std::uint16_t>(first);
  }
  ADD_FAILURE() << "no run of free loopback ports";
  return 0;
}

TEST(StoreService, AGivenPortIsTheDoorsAndATakenOneIsNamed) {
  served s;
  store::server_options o;
  o.root = s.root.string();
  o.workers = 3;
  o.port = free_ports(0);
  {
    store::server srv(test::server_io(), o);
    EXPECT_EQ(srv.port(), o.port);
    store::client c("127.0.0.1", o.port);
    std::vector<unsigned char> buf(100);
    EXPECT_EQ(c.read("data/shard.bin", 0, buf.data(), buf.size()), 100u);
  }
  int taken = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(o.port);
  int one = 1;  // the port's connections to the server above may still be in TIME_WAIT
  ::setsockopt(taken, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  ASSERT_EQ(::bind(taken, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::listen(taken, 1), 0);
  std::string t = test::error_text([&] { store::server srv(test::server_io(), o); });
  ::close(taken);
  EXPECT_THAT(t, HasSubstr("127.0.0.1:" + std::to_string(o.port)));
  EXPECT_THAT(t, HasSubstr("cannot listen"));
}

TEST(StoreService, ServerGoneIsAnErrorWithinTheDeadline) {
  auto s = std::make_unique<served>();
  store::client c("127.0.0.1", s->srv->port());
  std::uint16_t port = s->srv->port();
  s.reset();  // server stops
  std::vector<unsigned char> buf(100);
  auto t0 = std::chrono::steady_clock::now();
  std::string t = test::error_text([&] { c.read("data/shard.bin", 0, buf.data(), 100, std::chrono::seconds(3)); });
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_THAT(t, HasSubstr("127.0.0.1:" + std::to_string(port)));
  EXPECT_THAT(t, ::testing::AnyOf(HasSubstr("[network_error]"), HasSubstr("[timeout]")));
  // The reads after it fail with the same error without trying the dead server again each time
  // (FERRY_NET_RETRY_AFTER, 1 s by default: these come well within it).
  if (t.find("[network_error]") != std::string::npos) {  // the server refused: marked down
    const std::uint64_t tried = c.stats().reconnects;
    for (int i = 0; i < 20; ++i)
      EXPECT_THAT(test::error_text([&] { c.read("data/shard.bin", 0, buf.data(), 100, std::chrono::seconds(3)); }),
                  HasSubstr("127.0.0.1:" + std::to_string(port)));
    EXPECT_EQ(c.stats().reconnects, tried) << "a read tried the dead server again";
  }
  EXPECT_THAT(test::error_text([&] { store::client d("127.0.0.1", port, std::chrono::seconds(3)); }),
              HasSubstr("store.connect 127.0.0.1:" + std::to_string(port) + ": cannot connect to the storage server"));
}

TEST(StoreService, ServerRestartedTheNextReadSucceeds) {
  served s;
  std::uint16_t port = s.srv->port();
  store::client c("127.0.0.1", port);
  std::vector<unsigned char> buf(1 << 20);
  EXPECT_EQ(c.read("data/shard.bin", 0, buf.data(), buf.size()), buf.size());
  s.srv.reset();
  store::server_options o;
  o.root = s.root.string();
  o.port = port;
  // One worker: the first server took free ports for its other workers (any port was asked for),
  // and a restart on a given port wants port + 1, port + 2, ... for them. The kernel hands out odd ports to
  // bind(0) and even ones to connect(), so port + 1 is often the local port of one of this test's
  // own client connections, whose TIME_WAIT (without SO_REUSEADDR) holds it for a minute. A real
  // server restarts on the ports it had; this one shows that the client also copes with a
  // server that now has fewer workers (its lanes all go to the one port named in the welcome).
  o.workers = 1;
  s.srv = test::restart_server(o);
  ASSERT_TRUE(s.srv) << "could not listen on port " << port << " again";
  std::fill(buf.begin(), buf.end(), 0);
  EXPECT_EQ(c.read("data/shard.bin", 4096, buf.data(), buf.size(), std::chrono::seconds(10)), buf.size());
  EXPECT_EQ(std::memcmp(buf.data(), s.data.data() + 4096, buf.size()), 0);
  EXPECT_GE(c.stats().reconnects, 1u);
}

TEST(StoreService, SharedSecretChallengeResponse) {
  served s;
  store::server_options o;
  o.root = s.root.string();
  o.secret = "correct horse battery staple";
  store::server srv(test::server_io(), o);
  std::vector<unsigned char> buf(4096);
  EXPECT_THAT(test::error_text([&] { store::client c("127.0.0.1", srv.port(), std::chrono::seconds(5)); }),
              HasSubstr("the server requires a shared secret"));
  std::string wrong = test::error_text([&] { store::client c("127.0.0.1", srv.port(), std::chrono::seconds(5), "guess"); });
  EXPECT_THAT(wrong, HasSubstr("authentication refused"));
  EXPECT_THAT(wrong, HasSubstr("[permission_denied]"));
  store::client c("127.0.0.1", srv.port(), std::chrono::seconds(5), o.secret);
  EXPECT_EQ(c.read("data/shard.bin", 0, buf.data(), buf.size()), buf.size());
  EXPECT_EQ(std::memcmp(buf.data(), s.data.data(), buf.size()), 0);
  EXPECT_THAT(test::error_text([] { store::read_secret_file("/nonexistent/secret"); }),
              HasSubstr("store.secret /nonexistent/secret: cannot read the secret file"));
}

// Secret files are refused as sshd refuses keys: readable by others, too short to resist guessing, or not a
// regular file; the message says how to fix it.
TEST(StoreService, SecretFilesOthersCanReadOrTooShortAreRefused) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(::testing::TempDir()) / ("ferry-secret-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  auto write = [&](const char* name, const std::string& text, fs::perms p) {
    fs::path f = dir / name;
    std::ofstream(f) << text;
    fs::permissions(f, p);
    return f.string();
  };
  const auto owner = fs::perms::owner_read | fs::perms::owner_write;
  EXPECT_EQ(store::read_secret_file(write("good", "a-long-enough-secret-0123\n", owner)), "a-long-enough-secret-0123");
  const std::string open = write("open", "a-long-enough-secret-0123\n", owner | fs::perms::group_read | fs::perms::others_read);
  EXPECT_THAT(test::error_text([&] { store::read_secret_file(open); }),
              AllOf(HasSubstr("mode 644"), HasSubstr("run: chmod 600 " + open), HasSubstr("[permission_denied]")));
  const std::string shrt = write("short", "guessable\n", owner);
  EXPECT_THAT(test::error_text([&] { store::read_secret_file(shrt); }),
              AllOf(HasSubstr("only 9 bytes"), HasSubstr("head -c 32 /dev/urandom")));
  EXPECT_THAT(test::error_text([&] { store::read_secret_file(dir.string()); }), HasSubstr("not a regular file"));
  fs::remove_all(dir);
}

}  // namespace
