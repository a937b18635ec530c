// Writes are atomic per file: a new version beside the target, put in place by one rename at the
// commit. A writer that dies leaves the target untouched, an overwrite leaves no stale tail, two
// writers never interleave, and the client reports success only once the server committed.
#include <ferry/core/checksum.hpp>
#include <ferry/store/client.hpp>
#include <ferry/store/server.hpp>

#include "net/ucx.hpp"
#include "support/errors.hpp"
#include "support/server_io.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <thread>

using namespace ferry;
using ::testing::HasSubstr;
using clk = std::chrono::steady_clock;

namespace {

std::string random_text(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(rng());
  return s;
}

std::string slurp(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

struct writable {
  std::filesystem::path root;
  std::unique_ptr<store::server> srv;
  const std::string secret = "atomic-writes-secret-0123456789";
  writable() {
    root = std::filesystem::path(::testing::TempDir()) / ("ferry-atomic-" + std::to_string(::getpid()));
    std::filesystem::remove_all(root);
    std::filesystem::create_directories(root / "out");
    store::server_options o;
    o.root = root.string();
    o.secret = secret;
    o.writable = true;
    srv = std::make_unique<store::server>(test::server_io(), o);
  }
  ~writable() {
    srv.reset();
    std::filesystem::remove_all(root);
  }
  std::unique_ptr<store::client> client(std::uint64_t piece = 1 << 20) {
    store::client_options co;
    co.secret = secret;
    co.piece = piece;
    co.timeout = std::chrono::seconds(10);
    return std::make_unique<store::client>("127.0.0.1", srv->port(), co);
  }
  void put_local(const std::string& name, const std::string& bytes) {
    std::ofstream(root / name, std::ios::binary | std::ios::trunc) << bytes;
  }
  // Names in out/ (hidden ones too: a new version must never be left behind under a name).
  std::set<std::string> names() {
    std::set<std::string> n;
    for (auto& e : std::filesystem::directory_iterator(root / "out")) n.insert(e.path().filename().string());
    return n;
  }
};

TEST(StoreAtomicWrite, OverwritingReplacesTheWholeFileNoStaleTail) {
  writable w;
  w.put_local("out/f.bin", random_text(16 << 20, 1));
  ::chmod((w.root / "out/f.bin").c_str(), 0640);
  auto c = w.client();
  auto small = random_text((1 << 20) + 3, 2);
  c->put("out/f.bin", small.data(), small.size());
  EXPECT_EQ(std::filesystem::file_size(w.root / "out/f.bin"), small.size()) << "the old 16 MiB file's tail was kept";
  EXPECT_EQ(slurp(w.root / "out/f.bin"), small);
  struct ::stat st{};
  ::stat((w.root / "out/f.bin").c_str(), &st);
  EXPECT_EQ(st.st_mode & 0777, 0640u) << "the replaced file keeps its permissions";
  EXPECT_EQ(w.names(), std::set<std::string>{"f.bin"});
}

TEST(StoreAtomicWrite, AWriterThatGoesAwayLeavesTheTargetUntouched) {
  writable w;
  auto old = random_text(3 << 20, 3);
  w.put_local("out/f.bin", old);
  {
    auto c = w.client();
    auto h = c->open_write("out/f.bin");
    auto data = random_text(8 << 20, 4);
    c->write(h, 0, data.data(), 4 << 20);  // half of it, then the client is gone
    EXPECT_EQ(w.srv->stats().open_writes, 1u);
    EXPECT_EQ(slurp(w.root / "out/f.bin"), old) << "visible before the commit";
  }
  // Its connections close; the server drops the new version with them.
  for (int i = 0; i < 100 && w.srv->stats().open_writes; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(w.srv->stats().open_writes, 0u);
  EXPECT_EQ(slurp(w.root / "out/f.bin"), old);
  EXPECT_EQ(w.names(), std::set<std::string>{"f.bin"}) << "nothing left behind";
  // An aborted write, likewise.
  auto c = w.client();
  auto h = c->open_write("out/g.bin");
  c->write(h, 0, old.data(), 100);
  c->abort(h);
  EXPECT_EQ(w.srv->stats().open_writes, 0u);
  EXPECT_EQ(w.names(), std::set<std::string>{"f.bin"});
  EXPECT_THAT(test::error_text([&] { c->commit(h); }), HasSubstr("no open write with this handle"));
}

TEST(StoreAtomicWrite, ACommitOfBytesThatNeverArrivedIsRefusedAndReplacesNothing) {
  writable w;
  auto old = random_text(1 << 20, 5);
  w.put_local("out/f.bin", old);
  auto c = w.client();
  auto h = c->open_write("out/f.bin");
  c->write(h, 0, old.data(), 1000);
  EXPECT_THAT(test::error_text([&] { c->commit(h, 5000); }),
              HasSubstr("a commit of 5000 bytes, but the writes cover [0, 1000); nothing was replaced"));
  EXPECT_EQ(slurp(w.root / "out/f.bin"), old);
  EXPECT_EQ(w.names(), std::set<std::string>{"f.bin"});
}

// What is committed is what arrived: one piece sent four times is not four pieces; a size declared up
// front is not data; a gap is refused. Each refusal leaves the target as it was.
TEST(StoreAtomicWrite, ACommitIsRefusedUnlessTheWritesCoverTheFileWithoutAGap) {
  writable w;
  auto old = random_text(1 << 20, 8);
  w.put_local("out/f.bin", old);
  auto c = w.client();
  auto piece = random_text(64 << 10, 9);
  auto h = c->open_write("out/f.bin");
  for (int i = 0; i < 4; ++i) c->write(h, 0, piece.data(), piece.size());
  EXPECT_THAT(test::error_text([&] { c->commit(h, 4 * piece.size()); }),
              HasSubstr("a commit of 262144 bytes, but the writes cover [0, 65536)"));
  EXPECT_EQ(slurp(w.root / "out/f.bin"), old);
  h = c->open_write("out/f.bin", net::write_mode::replace, std::chrono::seconds(30), 8 << 20);  // 8 MiB declared, 64 KiB sent
  c->write(h, 0, piece.data(), piece.size());
  EXPECT_EQ(c->commit(h), piece.size()) << "the file ends where the data ends, not at the declared size";
  EXPECT_EQ(slurp(w.root / "out/f.bin"), piece);
  h = c->open_write("out/f.bin");
  c->write(h, 0, piece.data(), 1000);
  c->write(h, 5000, piece.data(), 1000);
  EXPECT_THAT(test::error_text([&] { c->commit(h); }), HasSubstr("the writes leave a gap at [1000, 5000)"));
  EXPECT_EQ(slurp(w.root / "out/f.bin"), piece);
  EXPECT_EQ(w.names(), std::set<std::string>{"f.bin"}) << "no new version left behind";
}

TEST(StoreAtomicWrite, TwoWritersOfOnePathNeverInterleave) {
  writable w;
  auto a = w.client(64 << 10), b = w.client(64 << 10);
  auto da = random_text(4 << 20, 6), db = random_text(4 << 20, 7);
  auto ha = a->open_write("out/f.bin"), hb = b->open_write("out/f.bin");
  // Their pieces alternate on the server.
  for (std::uint64_t off = 0; off < da.size(); off += 256 << 10) {
    a->write(ha, off, da.data() + off, 256 << 10);
    b->write(hb, off, db.data() + off, 256 << 10);
  }
  EXPECT_EQ(a->commit(ha, da.size()), da.size());
  EXPECT_EQ(slurp(w.root / "out/f.bin"), da);
  EXPECT_EQ(b->commit(hb, db.size()), db.size());
  EXPECT_EQ(slurp(w.root / "out/f.bin"), db) << "the last commit wins whole";
  // Concurrently, many times: the file is always one writer's content, whole.
  std::atomic<int> torn{0};
  std::thread reader([&] {
    for (int i = 0; i < 200; ++i) {
      auto now = slurp(w.root / "out/f.bin");
      if (now != da && now != db) torn++;
    }
  });
  std::thread ta([&] {
    for (int i = 0; i < 5; ++i) a->put("out/f.bin", da.data(), da.size());
  });
  for (int i = 0; i < 5; ++i) b->put("out/f.bin", db.data(), db.size());
  ta.join();
  reader.join();
  EXPECT_EQ(torn.load(), 0);
  EXPECT_EQ(w.names(), std::set<std::string>{"f.bin"});
}

TEST(StoreAtomicWrite, UpdatesKeepTheRestOfTheFile) {
  writable w;
  auto old = random_text(3 << 20, 8);
  w.put_local("out/f.bin", old);
  auto c = w.client();
  auto h = c->open_write("out/f.bin", net::write_mode::keep);
  auto patch = random_text(5000, 9);
  c->write(h, 12345, patch.data(), patch.size());
  EXPECT_EQ(slurp(w.root / "out/f.bin"), old);
  EXPECT_EQ(c->commit(h), old.size());
  old.replace(12345, patch.size(), patch);
  EXPECT_EQ(slurp(w.root / "out/f.bin"), old);
}

TEST(StoreAtomicWrite, OnlyRegularFilesAreWrittenAndWritesNeedAnOpenWrite) {
  writable w;
  ASSERT_EQ(::mkfifo((w.root / "out/fifo").c_str(), 0644), 0);
  std::filesystem::create_directories(w.root / "out/dir");
  std::filesystem::create_symlink("fifo", w.root / "out/link");
  auto c = w.client();
  char b[16] = {};
  EXPECT_THAT(test::error_text([&] { c->put("out/fifo", b, sizeof b); }), HasSubstr("is a FIFO; only regular files are written"));
  EXPECT_THAT(test::error_text([&] { c->put("out/dir", b, sizeof b); }), HasSubstr("is a directory"));
  EXPECT_THAT(test::error_text([&] { c->put("out/link", b, sizeof b); }), HasSubstr("is a symbolic link"));
  EXPECT_THAT(test::error_text([&] { c->put("out/", b, sizeof b); }), HasSubstr("names no file"));
  EXPECT_THAT(test::error_text([&] { c->put("out/missing-dir/x", b, sizeof b); }), HasSubstr("No such file"));
  // A handle is bound to its path; a made-up one is refused.
  auto h = c->open_write("out/a.bin");
  store::client::write_handle other{h.id, "out/b.bin"};
  EXPECT_THAT(test::error_text([&] { c->write(other, 0, b, sizeof b); }), HasSubstr("the handle belongs to 'out/a.bin'"));
  store::client::write_handle made_up{h.id ^ 1, "out/a.bin"};
  EXPECT_THAT(test::error_text([&] { c->write(made_up, 0, b, sizeof b); }), HasSubstr("no open write with this handle"));
  c->abort(h);
  EXPECT_EQ(w.names(), (std::set<std::string>{"dir", "fifo", "link"}));
}

TEST(StoreAtomicWrite, OpenWritesPerConnectionAreBounded) {
  writable w;
  auto c = w.client();
  std::vector<store::client::write_handle> hs;
  std::string err;
  for (int i = 0; i < 1100 && err.empty(); ++i) {
    err = test::error_text([&] { hs.push_back(c->open_write("out/n" + std::to_string(i))); });
    if (err == "(no error)") err.clear();
  }
  EXPECT_THAT(err, HasSubstr("too many open writes"));
  EXPECT_LE(hs.size(), 256u * 4);  // per connection; the client's lanes are connections of their own
  for (auto& h : hs) c->abort(h);
  EXPECT_EQ(w.srv->stats().open_writes, 0u);
}

}  // namespace
