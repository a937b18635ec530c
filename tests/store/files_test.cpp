// ferry:// in the file API: file::open + file_engine batches against a loopback `ferry serve`.
#include <ferry/core/checksum.hpp>
#include <ferry/device/mapped_memory.hpp>
#include <ferry/gpu/cache.hpp>
#include <ferry/io/file_engine.hpp>
#include <ferry/runtime.hpp>
#include <ferry/store/client.hpp>
#include <ferry/store/server.hpp>

#include "support/data.hpp"
#include "support/server_io.hpp"
#include "support/errors.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <thread>
#include <mutex>
#include <condition_variable>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <atomic>
#include <random>

using namespace ferry;
using ::testing::HasSubstr;
using ferry::test::random_bytes;
using ferry::test::slurp;

namespace {


void spill(const std::filesystem::path& p, const std::vector<unsigned char>& d) {
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(d.data()), static_cast<std::streamsize>(d.size()));
}


// A server over a fresh directory, and runtime settings whose clients know its secret.
struct fixture {
  std::filesystem::path root, secret_file;
  std::unique_ptr<store::server> srv;
  // `lend`: the server lends files to the clients that ask (FERRY_SERVE_LEND_FILES).
  explicit fixture(bool writable, bool lend = false) {
    root = std::filesystem::path(::testing::TempDir()) / ("ferry-files-" + std::to_string(::getpid()));
    std::filesystem::create_directories(root / "d");
    secret_file = root.string() + ".secret";
    std::ofstream(secret_file) << "files secret 0123456789\n";
    std::filesystem::permissions(secret_file, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
    store::server_options o;
    o.root = root.string();
    o.secret = "files secret 0123456789";
    o.writable = writable;
    o.files = lend;
    srv = std::make_unique<store::server>(test::server_io(), o);
  }
  ~fixture() {
    srv.reset();
    std::filesystem::remove_all(root);
    std::filesystem::remove(secret_file);
  }
  std::string uri(const std::string& path) const { return "ferry://127.0.0.1:" + std::to_string(srv->port()) + "/" + path; }
  settings cfg() const {
    settings c = settings::defaults();
    c.backend = backend_choice::sim;
    c.sim_capacity = 64ull << 20;
    c.sim_granularity = 1ull << 20;
    c.secret_file = secret_file.string();
    c.net_piece = 1 << 20;
    c.net_landing = 4 << 20;
    c.deadline = std::chrono::seconds(10);
    return c;
  }
};

// nginx from Debian on loopback serving `root` (HTTP/1.1, byte ranges), in a process of its own
// (ended with the object); `port` 0 when nginx is not installed or did not start.
struct nginx_process {
  pid_t pid = -1;
  std::uint16_t port = 0;
  nginx_process(const std::filesystem::path& dir, const std::filesystem::path& root) {
    std::string bin;
    for (const char* b : {"/usr/sbin/nginx", "/usr/bin/nginx"})
      if (::access(b, X_OK) == 0) bin = b;
    if (bin.empty()) return;
    int s = ::socket(AF_INET, SOCK_STREAM, 0);  // a free port: bound, read back, let go
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t n = sizeof a;
    ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a);
    ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &n);
    ::close(s);
    const auto p = ntohs(a.sin_port);
    std::filesystem::create_directories(dir);
    std::ofstream(dir / "nginx.conf") << (::geteuid() == 0 ? "user root;\n" : "") << "daemon off; worker_processes 1; pid " << (dir / "nginx.pid").string()
                                      << "; error_log " << (dir / "error.log").string() << ";\nevents { worker_connections 256; }\nhttp { access_log off; "
                                      << "client_body_temp_path " << (dir / "body").string() << "; server { listen 127.0.0.1:" << p << "; root "
                                      << root.string() << "; } }\n";
    std::vector<std::string> args = {bin, "-c", (dir / "nginx.conf").string(), "-p", dir.string()};
    std::vector<char*> argv;
    for (auto& x : args) argv.push_back(x.data());
    argv.push_back(nullptr);
    if (::posix_spawn(&pid, bin.c_str(), nullptr, nullptr, argv.data(), environ) != 0) {
      pid = -1;
      return;
    }
    for (int i = 0; i < 200 && !port; ++i) {  // listening within 10 s
      int c = ::socket(AF_INET, SOCK_STREAM, 0);
      a.sin_port = htons(p);
      if (::connect(c, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) port = p;
      ::close(c);
      if (!port) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  ~nginx_process() {
    if (pid <= 0) return;
    ::kill(pid, SIGTERM);
    ::waitpid(pid, nullptr, 0);
  }
};

// The GPU page cache (sim, its requesters 8 host threads standing in for warps) over `uri`: random
// elements of a dataset four times the cache, from element 5 on, each equal to `data`'s; no failure.
void cache_reads(runtime& rt, const std::string& uri, const std::vector<unsigned char>& data) {
  gpu::cache_options o;
  o.bytes = 1 << 20;
  o.page_bytes = 4096;
  o.requests.by = gpu::requesters::host;
  o.requests.slots = 64;
  gpu::cache c(rt.files(), rt.devices().get("sim:0"), o);
  auto a = c.map<std::uint64_t>(file::open(uri, open_mode::read), 5, data.size() / 8 - 5);  // from element 5
  std::atomic<int> not_ok{0}, wrong{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < 8; ++t)
    ts.emplace_back([&, t] {
      std::mt19937_64 rng(static_cast<std::uint64_t>(t) * 17 + 1);
      for (int k = 0; k < 1500; ++k) {
        const std::uint64_t i = rng() % a.size();
        std::uint64_t v = 0;
        if (a.get(i, v) != gpu::status::ok) {
          not_ok++;
          continue;
        }
        if (std::memcmp(&v, data.data() + 8 * (5 + i), 8) != 0) wrong++;
      }
    });
  for (auto& x : ts) x.join();
  EXPECT_EQ(not_ok.load(), 0) << uri;
  EXPECT_EQ(wrong.load(), 0) << uri;
  auto st = c.stats();
  EXPECT_GT(st.counted.evictions, 0u);
  EXPECT_EQ(st.counted.failures, 0u);
  EXPECT_NO_THROW(c.check());
}

}  // namespace

// One batch mixing host and sim memory, several offsets and a read past the end of the file.
// One batch of three reads of `f` (holding `data`): unaligned into host memory (several pieces),
// into sim memory (staged) and past the end (short); each exactly its bytes.
void batch_reads_are_exact(runtime& rt, const std::shared_ptr<file>& f, const std::vector<unsigned char>& data) {
  std::vector<unsigned char> host(3 << 20), tail(1 << 20);
  mapped_memory sim = allocate_mapped(rt.devices().get("sim:0"), 4 << 20);
  std::vector<file_request> reqs = {
      {f, 7, host.data(), host.size(), false},                         // unaligned, 3 pieces
      {f, 1 << 20, sim.data(), (2 << 20) + 5, false},                  // staged
      {f, data.size() - 1000, tail.data(), tail.size(), false},        // short: past the end
  };
  auto b = rt.files().submit(reqs);
  ASSERT_TRUE(b.wait());
  auto res = b.results();
  EXPECT_EQ(res[0].bytes_done, host.size());
  EXPECT_EQ(res[1].bytes_done, (2u << 20) + 5);
  EXPECT_EQ(res[2].bytes_done, 1000u);
  EXPECT_EQ(0, std::memcmp(host.data(), data.data() + 7, host.size()));
  EXPECT_EQ(0, std::memcmp(tail.data(), data.data() + data.size() - 1000, 1000));
  auto st = rt.devices().get("sim:0").create_stream();
  std::uint64_t sum = 0;
  st->checksum(sim.data(), (2 << 20) + 5, &sum);
  st->synchronize();
  EXPECT_EQ(sum, checksum64(data.data() + (1 << 20), (2 << 20) + 5)) << "sim memory holds the range";
}

TEST(RemoteFiles, BatchReadsIntoHostAndSimMemory) {
  fixture fx(false);
  auto data = random_bytes((5 << 20) + 333, 41);
  spill(fx.root / "d" / "data.bin", data);
  runtime rt(fx.cfg());
  auto f = file::open(fx.uri("d/data.bin"), open_mode::read);
  EXPECT_EQ(f->size(), data.size());
  EXPECT_EQ(f->fd(), -1);
  ASSERT_TRUE(f->source());

  batch_reads_are_exact(rt, f, data);
  EXPECT_EQ(rt.files().counters().get("requests.remote").value(), 3u);

  // The synchronous helper goes the same way.
  std::vector<unsigned char> small(4096);
  EXPECT_EQ(rt.files().read(*f, 12345, small.data(), small.size()), small.size());
  EXPECT_EQ(0, std::memcmp(small.data(), data.data() + 12345, small.size()));
}

// On the same host a file opened for reading is lent by the server (a read-only descriptor) and read
// as a local file: every read exact, none through the server; written files still go through it.
TEST(RemoteFiles, ASameHostServerLendsAFileOpenedForReading) {
  fixture fx(true, true);
  auto data = random_bytes((5 << 20) + 333, 43);
  spill(fx.root / "d" / "data.bin", data);
  runtime rt(fx.cfg());
  auto f = file::open(fx.uri("d/data.bin"), open_mode::read);
  EXPECT_GE(f->fd(), 0) << "the same-host server lent the file";
  EXPECT_FALSE(f->source());
  EXPECT_EQ(f->path(), fx.uri("d/data.bin")) << "errors name the URI";
  EXPECT_EQ(f->size(), data.size());
  EXPECT_EQ(fx.srv->stats().files_lent, 1u);

  batch_reads_are_exact(rt, f, data);
  EXPECT_EQ(rt.files().counters().get("requests.remote").value(), 0u) << "no read went to the server";
  EXPECT_EQ(fx.srv->stats().reads, 0u);

  // Replaced on the server: the open file keeps reading the version it opened, as a local file does;
  // a file opened again reads the new one.
  auto fresh = random_bytes(4096, 44);
  spill(fx.root / "d" / "new.bin", fresh);
  std::filesystem::rename(fx.root / "d" / "new.bin", fx.root / "d" / "data.bin");
  std::vector<unsigned char> small(4096);
  EXPECT_EQ(rt.files().read(*f, 0, small.data(), small.size()), small.size());
  EXPECT_EQ(0, std::memcmp(small.data(), data.data(), small.size()));
  auto again = file::open(fx.uri("d/data.bin"), open_mode::read);
  EXPECT_EQ(rt.files().read(*again, 0, small.data(), small.size()), small.size());
  EXPECT_EQ(0, std::memcmp(small.data(), fresh.data(), small.size()));

  // Opened for writing: through the server, never lent.
  auto w = file::open(fx.uri("d/out.bin"), open_mode::create);
  EXPECT_EQ(w->fd(), -1);
  EXPECT_TRUE(w->source());
  EXPECT_EQ(fx.srv->stats().files_lent, 2u);
}

// Many small reads of one ferry:// file in one batch (as a GPU cache's misses come) go as a few requests,
// each answered in one message; each read gets exactly its bytes (short at the end of the file). Small
// reads into sim memory in the same batch go one by one (the answer is copied by the CPU), and are
// right too.
TEST(RemoteFiles, SmallReadsOfABatchGoTogether) {
  fixture fx(false);
  auto data = random_bytes((2 << 20) + 777, 43);
  spill(fx.root / "d" / "pages.bin", data);
  runtime rt(fx.cfg());
  auto f = file::open(fx.uri("d/pages.bin"), open_mode::read);
  mapped_memory sim = allocate_mapped(rt.devices().get("sim:0"), 1 << 20);
  std::vector<std::vector<unsigned char>> host;
  std::vector<file_request> reqs;
  std::mt19937_64 rng(5);
  for (int i = 0; i < 600; ++i) {
    const std::uint64_t len = 1 + rng() % 9000, off = rng() % data.size();
    host.emplace_back(len);
    reqs.push_back({f, off, host.back().data(), len, false});
  }
  host.emplace_back(100);
  reqs.push_back({f, data.size() - 10, host.back().data(), 100, false});  // short (the buffer is long enough)
  for (int i = 0; i < 8; ++i) reqs.push_back({f, static_cast<std::uint64_t>(i) * 5000, sim.data() + i * 8192, 4096, false});
  const auto served = fx.srv->stats();
  auto b = rt.files().submit(reqs);
  ASSERT_TRUE(b.wait());
  b.check();
  auto res = b.results();
  for (int i = 0; i < 600; ++i) {
    const auto& r = reqs[i];
    const std::uint64_t n = std::min<std::uint64_t>(r.bytes, data.size() - r.offset);
    ASSERT_EQ(res[i].bytes_done, n) << "read " << i;
    ASSERT_EQ(0, std::memcmp(r.mem, data.data() + r.offset, n)) << "read " << i;
  }
  EXPECT_EQ(res[600].bytes_done, 10u);
  EXPECT_EQ(0, std::memcmp(host[600].data(), data.data() + data.size() - 10, 10));
  auto st = rt.devices().get("sim:0").create_stream();
  for (int i = 0; i < 8; ++i) {
    std::uint64_t sum = 0;
    st->checksum(sim.data() + i * 8192, 4096, &sum);
    st->synchronize();
    EXPECT_EQ(sum, checksum64(data.data() + i * 5000, 4096)) << "sim read " << i;
  }
  const auto now = fx.srv->stats();
  EXPECT_EQ(now.reads - served.reads, reqs.size()) << "every read served";
  EXPECT_LT(now.requests - served.requests, 40u) << "the 601 small host reads went as a few requests";
}

// A GPU cache's misses come a few per batch, many batches at once: small reads queued together go as
// few requests even across batches, and a batch cancelled meanwhile ends without its memory being
// written later (each cancelled batch's memory is refilled with a marker once its wait returns).
TEST(RemoteFiles, SmallReadsOfManyBatchesGoTogether) {
  fixture fx(false);
  auto data = random_bytes((2 << 20) + 333, 47);
  spill(fx.root / "d" / "pages.bin", data);
  runtime rt(fx.cfg());
  auto f = file::open(fx.uri("d/pages.bin"), open_mode::read);
  constexpr int n = 300;
  std::vector<std::vector<unsigned char>> host(n);
  std::vector<file_request> reqs;
  std::mt19937_64 rng(9);
  for (int i = 0; i < n; ++i) {
    const std::uint64_t len = 1 + rng() % 9000, off = rng() % (data.size() - len);
    host[i].resize(len);
    reqs.push_back({f, off, host[i].data(), len, false});
  }
  const auto served = fx.srv->stats();
  std::vector<transfer_batch> bs;
  for (int i = 0; i < n; ++i) {
    bs.push_back(rt.files().submit({&reqs[i], 1}));
    if (i % 3 == 1) bs.back().cancel();
  }
  for (int i = 0; i < n; ++i) {
    const bool ok = bs[i].wait();
    const auto r = bs[i].results()[0];
    if (i % 3 == 1) {
      ASSERT_TRUE(ok || r.state == request_state::cancelled) << "read " << i << ": " << (r.err ? r.err->what() : "");
      if (!ok) std::memset(host[i].data(), 0xa5, host[i].size());  // ended: its memory is the caller's again
      continue;
    }
    ASSERT_TRUE(ok) << "read " << i << ": " << (r.err ? r.err->what() : "");
    ASSERT_EQ(r.bytes_done, reqs[i].bytes) << "read " << i;
    ASSERT_EQ(0, std::memcmp(host[i].data(), data.data() + reqs[i].offset, reqs[i].bytes)) << "read " << i;
  }
  // Every batch over (a live member's group was copied out before it ended; a group of cancelled
  // members only was given up): a late copy into a cancelled read's memory would show now.
  bs.clear();
  for (int i = 1; i < n; i += 3) {
    if (host[i][0] != 0xa5) continue;
    ASSERT_EQ(std::count(host[i].begin(), host[i].end(), 0xa5), static_cast<std::ptrdiff_t>(host[i].size())) << "cancelled read " << i << " written after it ended";
  }
  const auto now = fx.srv->stats();
  const std::uint64_t reads = now.reads - served.reads, requests = now.requests - served.requests;
  EXPECT_GE(reads, static_cast<std::uint64_t>(n - n / 3)) << "every read not cancelled was served";
  EXPECT_LT(requests, reads) << "reads of different batches went together";
}

// A ferry:// file read in a stream's order: the stream is held while the read is submitted, and its
// next op (a checksum of the destination) sees the server's bytes. Then the server goes away under a
// second stream-ordered read: the read fails and the stream is released.
TEST(RemoteFiles, StreamOrderedReadsOfAFerryFile) {
  auto fx = std::make_unique<fixture>(false);
  auto data = random_bytes((3 << 20) + 4100, 43);
  spill(fx->root / "d" / "data.bin", data);
  runtime rt(fx->cfg());
  device& d = rt.devices().get("sim:0");
  auto f = file::open(fx->uri("d/data.bin"), open_mode::read);
  mapped_memory sim = allocate_mapped(d, 4 << 20);
  auto users = d.create_stream();
  alignas(4) std::uint32_t hold = 0, after = 0;
  users->wait_value(&hold, 1);
  users->fill_pattern(sim.data(), 4 << 20, 3);  // the user's kernel writes the buffer first
  transfer_options o;
  o.on = users.get();
  file_request q{f, 0, sim.data(), data.size(), false};
  transfer_batch t = rt.files().submit({&q, 1}, o);
  std::uint64_t sum = 0;
  users->checksum(sim.data(), data.size(), &sum);
  std::atomic_ref<std::uint32_t>(hold).store(1);
  users->synchronize();
  ASSERT_TRUE(t.wait()) << (t.results()[0].err ? t.results()[0].err->what() : "");
  EXPECT_EQ(sum, checksum64(data.data(), data.size())) << "the stream's next op saw the server's bytes";

  fx.reset();  // the server is gone
  file_request again{f, 0, sim.data(), data.size(), false};
  transfer_batch gone = rt.files().submit({&again, 1}, o);
  users->write_value(&after, 1);
  EXPECT_FALSE(gone.wait());
  EXPECT_NE(gone.results()[0].state, request_state::done);
  users->synchronize(deadline_after(std::chrono::seconds(15)));
  EXPECT_EQ(std::atomic_ref<std::uint32_t>(after).load(), 1u) << "the stream went on past the failed read";
}

// The caller lets go of the file as soon as it has submitted writes to it (a batch without a
// handle): the writes hold the file until they are done, and the file commits them when it goes --
// with the batch's completion as the last holder, on the endpoint's own thread.
TEST(RemoteFiles, WritesOfAFileTheCallerDroppedStillLandAndCommit) {
  fixture fx(true);
  runtime rt(fx.cfg());
  auto data = random_bytes((2 << 20) + 5, 43);
  for (int round = 0; round < 3; ++round) {
    std::mutex m;
    std::condition_variable cv;
    bool finished = false;
    std::vector<request_state> states;
    {
      auto f = file::open(fx.uri("d/dropped.bin"), open_mode::create);
      std::vector<file_request> rs;
      for (std::uint64_t at = 0; at < data.size(); at += 1 << 20)
        rs.push_back({f, at, data.data() + at, std::min<std::uint64_t>(1 << 20, data.size() - at), true});
      rt.files().submit(rs, {}, [&](std::span<const request_result> res) {
        std::lock_guard l(m);
        for (auto& x : res) states.push_back(x.state);
        finished = true;
        cv.notify_all();
      });
    }  // the caller's last reference to the file goes here, the writes may still be under way
    std::unique_lock l(m);
    ASSERT_TRUE(cv.wait_for(l, std::chrono::seconds(30), [&] { return finished; }));
    for (auto st : states) EXPECT_EQ(st, request_state::done);
    l.unlock();
    // Committed when the file went (after its last write): poll, the commit is the file's last act.
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    std::vector<unsigned char> back;
    while (std::chrono::steady_clock::now() < until) {
      back = std::filesystem::exists(fx.root / "d" / "dropped.bin") ? slurp(fx.root / "d" / "dropped.bin") : std::vector<unsigned char>{};
      if (back.size() == data.size()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ASSERT_EQ(back.size(), data.size()) << "round " << round;
    EXPECT_EQ(0, std::memcmp(back.data(), data.data(), data.size())) << "round " << round;
    std::filesystem::remove(fx.root / "d" / "dropped.bin");
  }
}

TEST(RemoteFiles, WritesThroughTheFileEngineLandOnTheServer) {
  fixture fx(true);
  runtime rt(fx.cfg());
  auto data = random_bytes((3 << 20) + 17, 42);
  {
    auto f = file::open(fx.uri("d/new.bin"), open_mode::read_write);  // missing: created by the write
    rt.files().write(*f, 0, data.data(), data.size(), true);
    mapped_memory sim = allocate_mapped(rt.devices().get("sim:0"), 2 << 20);
    auto st = rt.devices().get("sim:0").create_stream();
    std::vector<unsigned char> ones(1 << 20, 0x5a);
    st->copy(sim.data(), ones.data(), ones.size());
    st->synchronize();
    rt.files().write(*f, data.size(), sim.data(), 1 << 20);  // sim memory -> staging -> server
    // Writes are atomic per file: not in place before sync() (or closing the file) commits them.
    EXPECT_EQ(f->size(), data.size());
    EXPECT_EQ(std::filesystem::file_size(fx.root / "d" / "new.bin"), data.size());
    f->sync();
    EXPECT_EQ(f->size(), data.size() + (1 << 20));
  }
  auto back = slurp(fx.root / "d" / "new.bin");
  ASSERT_EQ(back.size(), data.size() + (1 << 20));
  EXPECT_EQ(0, std::memcmp(back.data(), data.data(), data.size()));
  EXPECT_EQ(std::count(back.begin() + static_cast<std::ptrdiff_t>(data.size()), back.end(), 0x5a), 1 << 20);
  // create: a new, empty version; closing the file commits what was written -- an existing file
  // is replaced whole (no stale tail).
  {
    auto f = file::open(fx.uri("d/new.bin"), open_mode::create);
    rt.files().write(*f, 0, data.data(), 1000);
  }
  EXPECT_EQ(slurp(fx.root / "d" / "new.bin"), std::vector<unsigned char>(data.begin(), data.begin() + 1000));
  { auto f = file::open(fx.uri("d/empty.bin"), open_mode::create); }
  EXPECT_EQ(std::filesystem::file_size(fx.root / "d" / "empty.bin"), 0u);
}

TEST(RemoteFiles, BadOpensAreRefusedNamingWhatWasWrong) {
  fixture fx(false);
  spill(fx.root / "d" / "x.bin", random_bytes(10, 1));
  {
    runtime rt(fx.cfg());
    EXPECT_THAT(test::error_text([&] { file::open(fx.uri("d/missing.bin"), open_mode::read); }), HasSubstr("d/missing.bin"));
    EXPECT_THAT(test::error_text([&] { file::open(fx.uri("d/x.bin"), open_mode::create); }), HasSubstr("read-only"));
    EXPECT_THAT(test::error_text([&] { file::open(fx.uri("d/x.bin"), open_mode::read_write); }), HasSubstr("read-only"));
    EXPECT_THAT(test::error_text([&] { file::open(fx.uri("d"), open_mode::read); }), HasSubstr("is a directory"));
    EXPECT_THAT(test::error_text([&] { file::open("ferry://127.0.0.1/x", open_mode::read); }), HasSubstr("no port"));
    EXPECT_THAT(test::error_text([&] { file::open("nosuch://h:1/x", open_mode::read); }), HasSubstr("no handler for nosuch://"));
    // A local path that merely contains "://" is a local path.
    EXPECT_THAT(test::error_text([&] { file::open((fx.root / "a://b").string(), open_mode::read); }), HasSubstr("No such file"));
    auto f = file::open(fx.uri("d/x.bin"), open_mode::read);
    std::vector<unsigned char> buf(10);
    file_request w{f, 0, buf.data(), 10, true};
    auto b = rt.files().submit({&w, 1});
    EXPECT_FALSE(b.wait());
    EXPECT_THAT(test::error_text([&] { b.check(); }), HasSubstr("read-only"));
    EXPECT_THAT(test::error_text([&] { f->resize(0); }), HasSubstr("cannot be resized"));
  }
  // No runtime, no ferry://.
  EXPECT_THAT(test::error_text([&] { file::open(fx.uri("d/x.bin"), open_mode::read); }), HasSubstr("no handler for ferry://"));
}

// The server goes away with requests in a batch: each fails within the deadline, naming the peer.
TEST(RemoteFiles, ServerGoneFailsTheBatchWithinItsDeadline) {
  auto fx = std::make_unique<fixture>(false);
  spill(fx->root / "d" / "data.bin", random_bytes(1 << 20, 3));
  settings cfg = fx->cfg();
  cfg.deadline = std::chrono::seconds(3);
  runtime rt(cfg);
  auto f = file::open(fx->uri("d/data.bin"), open_mode::read);
  std::string peer = "127.0.0.1:" + std::to_string(fx->srv->port());
  fx->srv.reset();
  std::vector<unsigned char> buf(1 << 20);
  auto t0 = std::chrono::steady_clock::now();
  file_request r{f, 0, buf.data(), buf.size(), false};
  auto b = rt.files().submit({&r, 1});
  EXPECT_FALSE(b.wait());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_THAT(test::error_text([&] { b.check(); }), HasSubstr(peer));
}

// A server stopped under a batch and started again on its port: the batch's reads under way, small
// ones sent together and a large one, find their connection lost and are sent again (once each).
// That batch reads what the file holds, or -- its reads sent again before the new server listens --
// fails naming the server; nothing crashes (the stopping server's sessions went under its frame
// handlers once), and the next batch reads what the file holds.
TEST(RemoteFiles, AServerStoppedUnderABatchIsReadAgainOrNamed) {
  fixture fx(false);
  auto data = random_bytes(4 << 20, 47);
  spill(fx.root / "d" / "pages.bin", data);
  settings cfg = fx.cfg();
  cfg.net_retry_after = std::chrono::nanoseconds::zero();  // a refused connect is tried again at the next request
  runtime rt(cfg);
  const std::string uri = fx.uri("d/pages.bin");
  const std::uint16_t port = fx.srv->port();
  auto f = file::open(uri, open_mode::read);
  std::vector<std::vector<unsigned char>> bufs;
  std::vector<file_request> reqs;
  transfer_batch b;
  // New buffers for a batch; the one before is gone first (a batch whose wait() returned false at its
  // deadline may still have a piece under way into the buffers it was given).
  auto make = [&] {
    b = transfer_batch{};
    bufs.clear();
    reqs.clear();
    for (int i = 0; i < 100; ++i) {
      bufs.emplace_back(4096, 0);
      reqs.push_back({f, static_cast<std::uint64_t>(i) * 40000 + 11, bufs.back().data(), 4096, false});
    }
    bufs.emplace_back(2 << 20, 0);
    reqs.push_back({f, 12345, bufs.back().data(), 2 << 20, false});
  };
  auto check = [&](const char* when) {
    for (std::size_t i = 0; i < reqs.size(); ++i)
      ASSERT_EQ(0, std::memcmp(reqs[i].mem, data.data() + reqs[i].offset, reqs[i].bytes)) << when << ", read " << i;
  };
  make();
  b = rt.files().submit(reqs);
  ASSERT_TRUE(b.wait());
  check("before the restart");
  // The next batch goes out, and the server goes under it.
  make();
  b = rt.files().submit(reqs);
  fx.srv.reset();
  store::server_options o;
  o.root = fx.root.string();
  o.secret = "files secret 0123456789";
  o.port = port;
  o.workers = 1;  // (see StoreService.ServerRestartedTheNextReadSucceeds)
  fx.srv = test::restart_server(o);
  ASSERT_TRUE(fx.srv) << "could not listen on port " << port << " again";
  if (b.wait()) check("across the restart");
  else EXPECT_THAT(test::error_text([&] { b.check(); }), HasSubstr("127.0.0.1:" + std::to_string(port)));
  make();
  b = rt.files().submit(reqs);
  ASSERT_TRUE(b.wait()) << test::error_text([&] { b.check(); });
  check("after the restart");
}

// The GPU page cache over a ferry:// source: the misses are the server's to serve (many at once:
// the proxy hands them over in batches).
TEST(RemoteFiles, TheGpuCacheReadsThroughAFerrySource) {
  fixture fx(false);
  auto data = random_bytes((4 << 20) + 77, 43);
  spill(fx.root / "d" / "data.bin", data);
  runtime rt(fx.cfg());
  cache_reads(rt, fx.uri("d/data.bin"), data);
  EXPECT_GT(fx.srv->stats().requests, 100u) << "the misses were the server's to serve";
}

// The same with the file lent (the default on one host): the misses are read from it here.
TEST(RemoteFiles, TheGpuCacheReadsALentFerryFile) {
  fixture fx(false, true);
  auto data = random_bytes((4 << 20) + 77, 45);
  spill(fx.root / "d" / "data.bin", data);
  runtime rt(fx.cfg());
  cache_reads(rt, fx.uri("d/data.bin"), data);
  EXPECT_EQ(fx.srv->stats().files_lent, 1u);
  EXPECT_EQ(fx.srv->stats().reads, 0u) << "no miss went to the server";
}

// The same over http:// from nginx: range requests land in the cache.
TEST(RemoteFiles, TheGpuCacheReadsThroughAWebServer) {
  const auto dir = std::filesystem::path(::testing::TempDir()) / ("ferry-cache-http-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir / "root");
  auto data = random_bytes((4 << 20) + 77, 44);
  spill(dir / "root" / "data.bin", data);
  {
    nginx_process web(dir / "nginx", dir / "root");
    if (!web.port) {
      std::filesystem::remove_all(dir);
      GTEST_SKIP() << "nginx is not installed or did not start (scripts/install-deps installs it)";
    }
    settings cfg = settings::defaults();
    cfg.backend = backend_choice::sim;
    cfg.sim_capacity = 64ull << 20;
    cfg.deadline = std::chrono::seconds(10);
    runtime rt(cfg);
    cache_reads(rt, "http://127.0.0.1:" + std::to_string(web.port) + "/data.bin", data);
  }
  std::filesystem::remove_all(dir);
}
