// Writes, asynchronous requests and staged (sim device) memory through the storage service.
#include <ferry/core/checksum.hpp>
#include <ferry/device/mapped_memory.hpp>
#include <ferry/runtime.hpp>
#include <ferry/store/client.hpp>
#include <ferry/store/server.hpp>

#include "support/data.hpp"
#include "support/server_io.hpp"
#include "support/tally.hpp"
#include "support/errors.hpp"
#include "support/phased_clients.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

using namespace ferry;
using ::testing::HasSubstr;
using ferry::test::random_bytes;
using ferry::test::slurp;

namespace {

// An update in place, atomic like every write: the file's current content with [off, off + n)
// replaced, committed.
void update(store::client& c, const std::string& path, std::uint64_t off, const void* src, std::uint64_t n) {
  auto h = c.open_write(path, net::write_mode::keep);
  c.write(h, off, src, n);
  c.commit(h);
}

settings sim_settings() {
  settings cfg = settings::defaults();
  cfg.backend = backend_choice::sim;
  cfg.sim_capacity = 64ull << 20;
  cfg.sim_granularity = 1ull << 20;
  return cfg;
}

struct writable_server {
  std::filesystem::path root;
  std::unique_ptr<store::server> srv;
  const std::string secret = "s3cret for writes";
  explicit writable_server(std::uint64_t chunk = 1 << 20) {
    root = std::filesystem::path(::testing::TempDir()) / ("ferry-write-" + std::to_string(::getpid()));
    std::filesystem::create_directories(root / "out");
    store::server_options o;
    o.root = root.string();
    o.chunk = chunk;
    o.secret = secret;
    o.writable = true;
    srv = std::make_unique<store::server>(test::server_io(), o);
  }
  ~writable_server() {
    srv.reset();
    std::filesystem::remove_all(root);
  }
  // Options for GPU-like (sim) memory: the runtime's cache and engine, 4 MiB of staging / landing.
  store::client_options opts_with(runtime& rt) const {
    auto o = opts();
    o.cache = &rt.registrations();
    o.engine = &rt.engine();
    o.landing = 4 << 20;
    return o;
  }
  store::client_options opts(std::uint64_t piece = 1 << 20) const {
    store::client_options c;
    c.secret = secret;
    c.piece = piece;
    c.timeout = std::chrono::seconds(10);
    return c;
  }
};

TEST(StoreWrite, WriteThenReadRoundTripsRandomData) {
  writable_server s;
  store::client c("127.0.0.1", s.srv->port(), s.opts());
  EXPECT_TRUE(c.writable());
  auto data = random_bytes((5 << 20) + 777, 7);  // several pieces and a ragged tail
  c.put("out/new.bin", data.data(), data.size());
  EXPECT_EQ(slurp(s.root / "out" / "new.bin"), data) << "the file on the server holds exactly what was written";
  // Overwrite an unaligned range in the middle, then read the whole file back through the service.
  auto patch = random_bytes(300001, 8);
  update(c, "out/new.bin", 4097, patch.data(), patch.size());
  std::memcpy(data.data() + 4097, patch.data(), patch.size());
  std::vector<unsigned char> back(data.size());
  EXPECT_EQ(c.read("out/new.bin", 0, back.data(), back.size()), back.size());
  EXPECT_EQ(checksum64(back.data(), back.size()), checksum64(data.data(), data.size()));
  EXPECT_EQ(c.stat("out/new.bin").size, data.size());
  auto st = s.srv->stats();
  EXPECT_EQ(st.bytes_received, data.size() + patch.size()) << "first write + patch";
  EXPECT_EQ(st.write_buffered, 0u) << "every write buffer was released";
  // Small writes (one eager data message).
  unsigned char small[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  c.put("out/small.bin", small, sizeof small);
  EXPECT_EQ(slurp(s.root / "out" / "small.bin"), std::vector<unsigned char>(small, small + 10));
}

TEST(StoreWrite, RefusedOnReadOnlyServersAndOutsideTheRoot) {
  writable_server s;
  store::client c("127.0.0.1", s.srv->port(), s.opts());
  unsigned char b[16] = {};
  EXPECT_THAT(test::error_text([&] { c.put("../escape.bin", b, sizeof b); }), HasSubstr("'..' is not allowed"));
  EXPECT_THAT(test::error_text([&] { c.put("/tmp/abs.bin", b, sizeof b); }), HasSubstr("absolute paths are not allowed"));
  EXPECT_FALSE(std::filesystem::exists(s.root.parent_path() / "escape.bin"));
  // A read-only server: the client knows from the handshake and says so, naming the path.
  store::server_options ro;
  ro.root = s.root.string();
  store::server rs(test::server_io(), ro);
  store::client r("127.0.0.1", rs.port());
  EXPECT_FALSE(r.writable());
  std::string t = test::error_text([&] { r.put("out/x.bin", b, sizeof b); });
  EXPECT_THAT(t, HasSubstr("the server is read-only"));
  EXPECT_THAT(t, HasSubstr("out/x.bin"));
  EXPECT_THAT(t, HasSubstr("[permission_denied]"));
  // Writable without a secret is refused unless insecure is asked for explicitly.
  store::server_options w;
  w.root = s.root.string();
  w.writable = true;
  EXPECT_THAT(test::error_text([&] { store::server x(test::server_io(), w); }), HasSubstr("refusing to serve writable without a shared secret"));
  w.insecure = true;
  store::server x(test::server_io(), w);
  store::client xc("127.0.0.1", x.port());
  xc.put("out/insecure.bin", b, sizeof b);
  EXPECT_EQ(std::filesystem::file_size(s.root / "out" / "insecure.bin"), sizeof b);
}

TEST(StoreWrite, ManyOutstandingRequestsOnOneConnection) {
  writable_server s;
  auto data = random_bytes(16 << 20, 9);
  {
    // The reads' memory and ends outlive the client, whose requests write them.
    std::vector<std::vector<unsigned char>> bufs(200);
    std::vector<std::uint64_t> offs(bufs.size());
    test::tally tr(bufs.size());
    store::client c("127.0.0.1", s.srv->port(), s.opts(256 << 10));
    // 64 writes in flight at once (more pieces than credits: the client queues them, never fails).
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    auto h = c.open_write("out/many.bin");
    test::tally tw(64);
    for (std::uint64_t i = 0; i < 64; ++i) {
      store::client::request r;
      r.path = h.path;
      r.offset = i * (256 << 10);
      r.mem = data.data() + i * (256 << 10);
      r.length = 256 << 10;
      r.write = h.id;
      r.until = until;
      r.done = tw.done(i);
      c.submit(std::move(r));
    }
    ASSERT_TRUE(tw.wait(std::chrono::seconds(60)));
    for (std::size_t i = 0; i < 64; ++i) EXPECT_EQ(tw.bytes[i], 256u << 10) << tw.errors[i];
    EXPECT_FALSE(std::filesystem::exists(s.root / "out" / "many.bin")) << "visible before its commit";
    EXPECT_EQ(c.commit(h, data.size()), data.size());
    EXPECT_EQ(slurp(s.root / "out" / "many.bin"), data);
    // 200 reads of random sizes and offsets, up to 64 outstanding.
    std::mt19937_64 rng(3);
    auto check = [&](std::size_t k) {
      auto l = tr.lock();
      EXPECT_EQ(tr.bytes[k], bufs[k].size()) << tr.errors[k];
      EXPECT_EQ(std::memcmp(bufs[k].data(), data.data() + offs[k], bufs[k].size()), 0) << "read " << k;
    };
    for (std::size_t k = 0; k < bufs.size(); ++k) {
      std::uint64_t len = 1 + rng() % (3 << 20), off = rng() % (data.size() - len);
      bufs[k].resize(len);
      offs[k] = off;
      store::client::request r;
      r.path = "out/many.bin";
      r.offset = off;
      r.mem = bufs[k].data();
      r.length = len;
      r.until = until;
      r.done = tr.done(k);
      c.submit(std::move(r));
      if (k >= 63) {
        ASSERT_TRUE(tr.wait_one(k - 63, std::chrono::seconds(60))) << "read " << k - 63;
        check(k - 63);
      }
    }
    for (std::size_t k = bufs.size() - 63; k < bufs.size(); ++k) {
      ASSERT_TRUE(tr.wait_one(k, std::chrono::seconds(60))) << "read " << k;
      check(k);
    }
    if (c.stats().data_path.find("mapped") != std::string::npos)
      EXPECT_GT(s.srv->stats().direct_reads, 0u) << "reads went into the mapped landing region";
    else
      EXPECT_GT(s.srv->stats().inline_replies, 0u) << "small reads were answered inline";
    EXPECT_GT(s.srv->stats().mapped_reads, 0u) << "small reads of a file that did not change came from its mapping";
  }
}

TEST(StoreWrite, ThirtyTwoClientsWriteAndReadBackConcurrently) {
  writable_server s;
  std::atomic<int> good{0};
  test::phased_clients(
      32, [&](int) { return std::make_unique<store::client>("127.0.0.1", s.srv->port(), s.opts()); },
      [&](store::client& c, int i) {
        auto d = random_bytes((1 << 20) + static_cast<std::size_t>(i) * 1000, 100 + static_cast<std::uint64_t>(i));
        std::string p = "out/client" + std::to_string(i) + ".bin";
        c.put(p, d.data(), d.size());
        std::vector<unsigned char> back(d.size());
        if (c.read(p, 0, back.data(), back.size()) == d.size() && back == d) good++;
      });
  EXPECT_EQ(good.load(), 32);
  EXPECT_EQ(s.srv->stats().write_buffered, 0u);
}

TEST(StoreWrite, SimDeviceMemoryIsStagedBothWays) {
  writable_server s;
  runtime rt(sim_settings());
  store::client c("127.0.0.1", s.srv->port(), s.opts_with(rt));  // fewer staging buffers than pieces: recycled
  auto data = random_bytes((9 << 20) + 5, 11);
  {
    std::ofstream f(s.root / "out" / "src.bin", std::ios::binary);
    f.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  }
  device& dev = rt.devices().get("sim:0");
  mapped_memory m = allocate_mapped(dev, 10 << 20);
  EXPECT_EQ(c.read("out/src.bin", 0, m.data(), data.size()), data.size());
  auto st = dev.create_stream();
  std::uint64_t sum = 0;
  st->checksum(m.data(), data.size(), &sum);
  st->synchronize();
  EXPECT_EQ(sum, checksum64(data.data(), data.size())) << "sim memory holds the file";
  auto cs = c.stats();
  EXPECT_GE(cs.staged_bytes, data.size());
  // Every piece of the read was copied on by the transfer engine, and that took time (where GPU reads' time goes).
  const auto piece = s.opts_with(rt).piece;
  EXPECT_GE(cs.staged_pieces, (data.size() + piece - 1) / piece);
  EXPECT_GT(cs.copy_out_ns, 0u);
  EXPECT_GE(rt.engine().counters().get("requests").value(), cs.staged_pieces) << "copies on go through the engine";
  c.put("out/back.bin", m.data(), data.size());  // sim -> staging -> server
  EXPECT_EQ(slurp(s.root / "out" / "back.bin"), data);
  // Memory nobody knows is refused up front, naming the pointer.
  EXPECT_THAT(test::error_text([&] { c.read("out/src.bin", 0, reinterpret_cast<void*>(0x10), 100); }),
              HasSubstr("not memory ferry knows"));
}

// A client given the transfer engine but no registration cache never classified the caller's memory:
// reads into sim (GPU-like) memory, small ones too, are copied on by the engine, which classifies it
// -- never by a memcpy into device memory.
TEST(StoreWrite, ReadsIntoDeviceMemoryWithoutACacheAreCopiedOnByTheEngine) {
  writable_server s;
  runtime rt(sim_settings());
  auto o = s.opts();
  o.engine = &rt.engine();
  store::client c("127.0.0.1", s.srv->port(), o);
  auto data = random_bytes(256 << 10, 17);
  {
    std::ofstream f(s.root / "out" / "few.bin", std::ios::binary);
    f.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  }
  device& dev = rt.devices().get("sim:0");
  mapped_memory m = allocate_mapped(dev, 1 << 20);
  auto st = dev.create_stream();
  for (int i = 0; i < 24; ++i) {
    const std::uint64_t off = (static_cast<std::uint64_t>(i) * 9973) % (data.size() - 70000), n = i % 3 ? 100 + i * 191 : 70000;
    ASSERT_EQ(c.read("out/few.bin", off, m.data(), n), n) << i;
    std::uint64_t sum = 0;
    st->checksum(m.data(), n, &sum);
    st->synchronize();
    ASSERT_EQ(sum, checksum64(data.data() + off, n)) << i << ": " << off << "+" << n;
  }
}

// With no settings a same-host client's data goes through the landing region the server maps, and
// a staged request classifies the caller's memory once: the engine's copies on (one per piece) tell the
// transfer engine what both sides are instead of having them classified again.
TEST(StoreWrite, SameHostIsMappedByDefaultAndTheCallersMemoryIsClassifiedOnce) {
  writable_server s;
  runtime rt(sim_settings());
  store::client c("127.0.0.1", s.srv->port(), s.opts_with(rt));
  EXPECT_THAT(c.stats().data_path, HasSubstr("mapped"));
  auto data = random_bytes((6 << 20) + 5, 23);
  {
    std::ofstream f(s.root / "out" / "src.bin", std::ios::binary);
    f.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  }
  device& dev = rt.devices().get("sim:0");
  mapped_memory m = allocate_mapped(dev, 8 << 20);
  ASSERT_EQ(c.read("out/src.bin", 0, m.data(), 4096), 4096u);  // the landing region is pinned on first use
  auto before = rt.registrations().stats().classifications;
  auto staged = c.stats().staged_pieces;
  ASSERT_EQ(c.read("out/src.bin", 0, m.data(), data.size()), data.size());
  EXPECT_GE(c.stats().staged_pieces - staged, 7u) << "several pieces, each copied on by the engine";
  EXPECT_EQ(rt.registrations().stats().classifications - before, 1u) << "the destination was classified per piece";
  EXPECT_GE(c.stats().direct_pieces, 7u);
  before = rt.registrations().stats().classifications;
  c.put("out/back.bin", m.data(), data.size());
  EXPECT_EQ(rt.registrations().stats().classifications - before, 1u) << "the source was classified per piece";
  EXPECT_EQ(slurp(s.root / "out" / "back.bin"), data);
}

// Same host over shared memory: the client lends a landing region, the server maps it and reads
// and writes files in place (no data message). Host and sim memory, random data, unaligned offsets,
// fewer landing slots than pieces (recycled).
TEST(StoreWrite, MappedLandingRegionOverSharedMemory) {
  // UCX puts shared-memory lanes on client/server endpoints only with this (UCX 1.13).
  ::setenv("UCX_MM_ERROR_HANDLING", "y", 1);
  writable_server s;
  runtime rt(sim_settings());
  store::client c("127.0.0.1", s.srv->port(), s.opts_with(rt));  // 4 landing slots of 1 MiB
  auto st0 = c.stats();
  ::unsetenv("UCX_MM_ERROR_HANDLING");
  if (st0.data_path.find("mapped") == std::string::npos)
    GTEST_SKIP() << "no shared-memory transport between client and server here (lanes " << st0.transports << ")";
  std::error_code ec;
  if (std::filesystem::directory_iterator("/sys/class/infiniband", ec) == std::filesystem::directory_iterator()) {
    EXPECT_EQ(st0.transports.find("tcp"), std::string::npos)
        << "a shared-memory connection without an RDMA device has no tcp (rendezvous) lane: " << st0.transports;
  }
  auto data = random_bytes((9 << 20) + 77, 21);
  {
    std::ofstream f(s.root / "out" / "src.bin", std::ios::binary);
    f.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  }
  // Host memory, unaligned offset.
  std::vector<unsigned char> host(data.size());
  EXPECT_EQ(c.read("out/src.bin", 4097, host.data(), data.size() - 4097), data.size() - 4097);
  EXPECT_EQ(std::memcmp(host.data(), data.data() + 4097, data.size() - 4097), 0);
  // Sim device memory both ways.
  device& dev = rt.devices().get("sim:0");
  mapped_memory m = allocate_mapped(dev, 10 << 20);
  EXPECT_EQ(c.read("out/src.bin", 0, m.data(), data.size()), data.size());
  auto stream = dev.create_stream();
  std::uint64_t sum = 0;
  stream->checksum(m.data(), data.size(), &sum);
  stream->synchronize();
  EXPECT_EQ(sum, checksum64(data.data(), data.size())) << "sim memory holds the file";
  c.put("out/back.bin", m.data(), data.size());
  EXPECT_EQ(slurp(s.root / "out" / "back.bin"), data);
  // Host write at an unaligned offset into an existing file.
  auto patch = random_bytes(3 << 20, 22);
  update(c, "out/back.bin", 12345, patch.data(), patch.size());
  auto back = slurp(s.root / "out" / "back.bin");
  EXPECT_EQ(std::memcmp(back.data() + 12345, patch.data(), patch.size()), 0);
  EXPECT_EQ(std::memcmp(back.data(), data.data(), 12345), 0);
  auto cs = c.stats();
  auto ss = s.srv->stats();
  EXPECT_GE(cs.direct_pieces, 25u) << "every piece above the inline size went through the region";
  EXPECT_GT(ss.direct_reads, 0u);
  EXPECT_GT(ss.direct_writes, 0u);
  EXPECT_EQ(ss.mapped_sessions, static_cast<std::uint64_t>(cs.lanes));
  EXPECT_EQ(cs.quarantined, 0u);
}

// Buffers allocated from the client: over shared memory every lane's server maps them and serves
// reads and writes in place, at any size (a small read sends only its completion). Random data,
// unaligned offsets and lengths, multi-piece requests; a freed buffer's address reused by the next
// allocation is not confused with it; over tcp the same calls work with ordinary memory.
// A small read's answer is seen by the thread waiting for it (driving its lane, or polling the
// slot's notify record) or by the lane's progress thread; with a spin of a nanosecond the waiter
// soon sleeps and both happen. Every read must land whole either way, in allocated and in host memory.
TEST(StoreWrite, SmallReadsLandWhicheverThreadSeesTheAnswer) {
  ::setenv("UCX_MM_ERROR_HANDLING", "y", 1);
  writable_server s;
  auto o = s.opts();
  o.spin = std::chrono::nanoseconds(1);
  store::client c("127.0.0.1", s.srv->port(), o);
  ::unsetenv("UCX_MM_ERROR_HANDLING");
  auto data = random_bytes(1 << 20, 43);
  {
    std::ofstream f(s.root / "out" / "small.bin", std::ios::binary);
    f.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  }
  auto* lent = static_cast<unsigned char*>(c.allocate(16 << 10));
  std::vector<unsigned char> host(16 << 10);
  for (int i = 0; i < 400; ++i) {
    unsigned char* b = i % 2 ? lent : host.data();
    std::uint64_t off = (static_cast<std::uint64_t>(i) * 7919) % (data.size() - 9000), n = 1 + (i * 131) % 9000;
    std::memset(b, 0xEE, n);
    ASSERT_EQ(c.read("out/small.bin", off, b, n), n) << i;
    ASSERT_EQ(std::memcmp(b, data.data() + off, n), 0) << i << ": " << off << "+" << n;
  }
  auto st = c.stats();
  if (st.data_path.find("mapped") != std::string::npos) {
    EXPECT_GE(st.staged_pieces, 200u) << "every host read landed in a slot and was copied on";
    EXPECT_GT(st.staged_pieces - st.copied_by_waiter, 0u) << "a spin of 1 ns leaves some to the progress thread and the engine";
  }
  // Past the end: short, either way.
  EXPECT_EQ(c.read("out/small.bin", data.size() - 10, lent, 100), 10u);
  EXPECT_EQ(c.read("out/small.bin", data.size() - 10, host.data(), 100), 10u);
  c.deallocate(lent);
}

// Small reads into the caller's own memory go through a landing slot the server writes (and the
// slot's notify record), then one copy on: every read takes a slot and gives it back, whether the
// waiting thread copied it on or an engine worker did.
TEST(StoreWrite, SmallHostReadsBorrowALandingSlotAndGiveItBack) {
  ::setenv("UCX_MM_ERROR_HANDLING", "y", 1);
  writable_server s;
  auto data = random_bytes(1 << 20, 44);
  {
    std::ofstream f(s.root / "out" / "slot.bin", std::ios::binary);
    f.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  }
  for (auto spin : {std::chrono::nanoseconds(1), std::chrono::nanoseconds(50'000'000)}) {
    auto o = s.opts();
    o.spin = spin;
    store::client c("127.0.0.1", s.srv->port(), o);
    auto st0 = c.stats();
    if (st0.data_path.find("mapped") == std::string::npos) {
      ::unsetenv("UCX_MM_ERROR_HANDLING");
      GTEST_SKIP() << "no shared-memory transport between client and server here (lanes " << st0.transports << ")";
    }
    std::vector<unsigned char> host(16 << 10);
    // Many more reads than the landing region has slots: a slot not given back would show.
    for (int i = 0; i < 300; ++i) {
      std::uint64_t off = (static_cast<std::uint64_t>(i) * 4099) % (data.size() - (16 << 10)), n = 1 + (i * 977) % (16 << 10);
      std::memset(host.data(), 0xEE, n);
      ASSERT_EQ(c.read("out/slot.bin", off, host.data(), n), n) << i;
      ASSERT_EQ(std::memcmp(host.data(), data.data() + off, n), 0) << i << ": " << off << "+" << n;
    }
    auto st = c.stats();
    EXPECT_EQ(st.direct_pieces - st0.direct_pieces, 300u) << "spin " << spin.count() << " ns: every read through a slot";
    EXPECT_GE(s.srv->stats().notify_records, 300u * (spin.count() == 1 ? 1 : 2)) << "each with a notify record";
    EXPECT_EQ(st.staged_pieces - st0.staged_pieces, 300u) << "and copied on from it";
    EXPECT_EQ(st.quarantined, 0u);
    if (spin.count() == 1) {
      EXPECT_GT(st.staged_pieces - st.copied_by_waiter, 0u) << "a spin of 1 ns leaves some to the engine's workers";
    }
    // Past the end: short, through the slot too.
    EXPECT_EQ(c.read("out/slot.bin", data.size() - 10, host.data(), 100), 10u);
    EXPECT_EQ(std::memcmp(host.data(), data.data() + data.size() - 10, 10), 0);
  }
  ::unsetenv("UCX_MM_ERROR_HANDLING");
}

TEST(StoreWrite, AllocatedBuffersAreServedInPlaceOverSharedMemory) {
  ::setenv("UCX_MM_ERROR_HANDLING", "y", 1);
  writable_server s;
  store::client c("127.0.0.1", s.srv->port(), s.opts());
  auto st0 = c.stats();
  ::unsetenv("UCX_MM_ERROR_HANDLING");
  if (st0.data_path.find("mapped") == std::string::npos)
    GTEST_SKIP() << "no shared-memory transport between client and server here (lanes " << st0.transports << ")";
  auto data = random_bytes((6 << 20) + 4321, 41);
  {
    std::ofstream f(s.root / "out" / "src.bin", std::ios::binary);
    f.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  }
  const std::uint64_t size = 8 << 20;
  auto* b = static_cast<unsigned char*>(c.allocate(size));
  auto inline0 = s.srv->stats().inline_replies;
  // Small (answered on the server's progress thread), medium, and several pieces of 1 MiB.
  for (auto [off, at, n] : {std::tuple<std::uint64_t, std::uint64_t, std::uint64_t>{4097, 0, 4096}, {12345, 777, 100000},
                            {3, 4096 + 5, (5 << 20) + 11}, {data.size() - 1000, size - 4096, 4096}}) {
    std::memset(b + at, 0xEE, n);
    std::uint64_t want = std::min<std::uint64_t>(n, data.size() - off);
    ASSERT_EQ(c.read("out/src.bin", off, b + at, n), want) << off << "+" << n;
    EXPECT_EQ(std::memcmp(b + at, data.data() + off, want), 0) << off << "+" << n;
  }
  auto cs = c.stats();
  EXPECT_GE(cs.lent_pieces, 1u + 1 + 6 + 1) << "every piece went straight into the buffer";
  auto records0 = s.srv->stats().notify_records;
  for (int i = 0; i < 20; ++i) ASSERT_EQ(c.read("out/src.bin", 4096 * i, b, 4096), 4096u);
  // Each carried a notify record, written by the server (whether the waiter saw it before the
  // completion message depends on scheduling).
  EXPECT_EQ(s.srv->stats().notify_records - records0, 20u) << "small reads into the buffer carry a notify record";
  cs = c.stats();
  EXPECT_EQ(s.srv->stats().inline_replies, inline0) << "no data message for a small read into an allocated buffer";
  EXPECT_GE(s.srv->stats().direct_reads, 9u);
  // Writes from the buffer, at an unaligned offset of both.
  auto patch = random_bytes((3 << 20) + 5, 42);
  std::memcpy(b + 99, patch.data(), patch.size());
  std::ofstream(s.root / "out" / "dst.bin") << "seven b";  // kept: the write at 7 leaves no gap
  update(c, "out/dst.bin", 7, b + 99, patch.size());
  auto back = slurp(s.root / "out" / "dst.bin");
  ASSERT_EQ(back.size(), patch.size() + 7);
  EXPECT_EQ(std::memcmp(back.data(), "seven b", 7), 0);
  EXPECT_EQ(std::memcmp(back.data() + 7, patch.data(), patch.size()), 0);
  EXPECT_GT(c.stats().lent_pieces, cs.lent_pieces);
  // Freed: the servers forget it; a new buffer (often at the same address) is served, not the old one.
  c.deallocate(b);
  EXPECT_THAT(test::error_text([&] { c.deallocate(b); }), HasSubstr("not a buffer this client allocated"));
  for (int i = 0; i < 3; ++i) {
    auto* b2 = static_cast<unsigned char*>(c.allocate(size));
    std::memset(b2, 0, 4096);
    ASSERT_EQ(c.read("out/src.bin", 4096 * (i + 1), b2, 4096), 4096u);
    EXPECT_EQ(std::memcmp(b2, data.data() + 4096 * (i + 1), 4096), 0) << "round " << i << (b2 == b ? " (same address)" : "");
    c.deallocate(b2);
  }
  EXPECT_THAT(test::error_text([&] { c.allocate(0); }), HasSubstr("must be between 1 and 1 TiB"));
}

// The mappings of the client's lent shared memory in this process (client and server share it
// here): start address and resident bytes, from /proc/self/smaps.
std::vector<std::pair<std::uintptr_t, std::uint64_t>> lent_mappings_of_size(std::uint64_t bytes) {
  std::vector<std::pair<std::uintptr_t, std::uint64_t>> found;
  std::ifstream in("/proc/self/smaps");
  bool ours = false;
  std::uintptr_t start = 0;
  for (std::string line; std::getline(in, line);) {
    std::uintptr_t a = 0, b = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &a, &b) == 2) {  // a mapping's first line; its fields follow
      ours = line.find("memfd:ferry-lent") != std::string::npos && b - a == bytes;
      start = a;
    } else if (ours && line.rfind("Rss:", 0) == 0) {
      found.push_back({start, std::stoull(line.substr(4)) * 1024});
    }
  }
  return found;
}

// Whether this kernel makes page-table entries ahead on request (MADV_POPULATE_WRITE, Linux 5.14);
// without it the server's pages fault in as they are used.
bool kernel_populates() {
#ifdef MADV_POPULATE_WRITE
  void* p = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return false;
  bool ok = ::madvise(p, 4096, MADV_POPULATE_WRITE) == 0;
  ::munmap(p, 4096);
  return ok;
#else
  return false;
#endif
}

// A buffer the client allocates is lent on every lane; the server maps it once for all of them, and
// makes its page-table entries ahead of use (else every page faults inside the copies, once per
// lane).
TEST(StoreWrite, AnAllocatedBufferIsMappedOnceForAllLanesWithItsPagesMadeAhead) {
  ::setenv("UCX_MM_ERROR_HANDLING", "y", 1);
  writable_server s;
  auto o = s.opts();
  o.lanes = 4;
  store::client c("127.0.0.1", s.srv->port(), o);
  auto st0 = c.stats();
  ::unsetenv("UCX_MM_ERROR_HANDLING");
  if (st0.data_path.find("mapped") == std::string::npos)
    GTEST_SKIP() << "no shared-memory transport between client and server here (lanes " << st0.transports << ")";
  const std::uint64_t size = 9 << 20;  // no other lent region here has this size
  auto* b = static_cast<unsigned char*>(c.allocate(size));
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  const bool populates = kernel_populates();
  std::vector<std::pair<std::uintptr_t, std::uint64_t>> maps;
  for (;;) {
    maps = lent_mappings_of_size(size);
    bool server_full = !populates;
    for (auto& [at, rss] : maps) server_full = server_full || (at != reinterpret_cast<std::uintptr_t>(b) && rss == size);
    if ((maps.size() == 2 && server_full) || std::chrono::steady_clock::now() > until) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(maps.size(), 2u) << "the client's own mapping and one of the server's, for " << o.lanes << " lanes";
  for (auto& [at, rss] : maps) {
    const bool client = at == reinterpret_cast<std::uintptr_t>(b);
    if (populates || client) {
      EXPECT_EQ(rss, size) << (client ? "client" : "server") << " mapping";
    }
  }
  // And it is the one reads land in.
  auto data = random_bytes(1 << 20, 43);
  {
    std::ofstream f(s.root / "out" / "once.bin", std::ios::binary);
    f.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  }
  for (int i = 0; i < 8; ++i) {
    ASSERT_EQ(c.read("out/once.bin", 0, b + i * (1 << 20), 1 << 20), 1u << 20);
    EXPECT_EQ(std::memcmp(b + i * (1 << 20), data.data(), 1 << 20), 0) << i;
  }
  EXPECT_GE(c.stats().lent_pieces, 8u);
  c.deallocate(b);
}

TEST(StoreWrite, AllocatedBuffersAreOrdinaryMemoryWhereTheServerCannotMapThem) {
  writable_server s;
  auto o = s.opts();
  o.map = false;
  store::client c("127.0.0.1", s.srv->port(), o);
  auto data = random_bytes((2 << 20) + 9, 43);
  {
    std::ofstream f(s.root / "out" / "src.bin", std::ios::binary);
    f.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  }
  auto* b = static_cast<unsigned char*>(c.allocate(data.size()));
  ASSERT_EQ(c.read("out/src.bin", 0, b, data.size()), data.size());
  EXPECT_EQ(std::memcmp(b, data.data(), data.size()), 0);
  ASSERT_EQ(c.read("out/src.bin", 100, b, 4096), 4096u);
  EXPECT_EQ(std::memcmp(b, data.data() + 100, 4096), 0);
  EXPECT_EQ(c.stats().lent_pieces, 0u);
  c.deallocate(b);
}

}  // namespace

// RMA data path (FERRY_NET_RMA=on): the client registers its memory for the network and the server
// puts reads into it / gets writes out of it. Over tcp UCX emulates RMA in software (slow, but the
// same protocol as on verbs), which is what lets this run here. Random data, unaligned offsets,
// pieces cut at the piece size; sim memory keeps the staged path.
// Shared memory without the landing region: data moves by messages, multi-MiB pieces by UCX's
// rendezvous, which runs as its AM pipeline here (no rendezvous lane on shared-memory connections).
TEST(StoreWrite, SharedMemoryWithoutTheLandingRegionMovesDataByMessages) {
  ::setenv("UCX_MM_ERROR_HANDLING", "y", 1);
  writable_server s(4 << 20);
  auto o = s.opts(4 << 20);
  o.map = false;
  store::client c("127.0.0.1", s.srv->port(), o);
  auto st0 = c.stats();
  ::unsetenv("UCX_MM_ERROR_HANDLING");
  if (st0.transports.find("memory") == std::string::npos)
    GTEST_SKIP() << "no shared-memory transport between client and server here (lanes " << st0.transports << ")";
  EXPECT_EQ(st0.data_path.find("mapped"), std::string::npos) << st0.data_path;
  auto data = random_bytes((13 << 20) + 333, 23);
  c.put("out/msg.bin", data.data(), data.size());
  EXPECT_EQ(slurp(s.root / "out" / "msg.bin"), data);
  std::vector<unsigned char> back(data.size());
  EXPECT_EQ(c.read("out/msg.bin", 0, back.data(), back.size()), back.size());
  EXPECT_EQ(back, data);
}

TEST(StoreWrite, RmaIsUsedOnlyWhereTheLanesHaveRemoteMemoryAccess) {
  writable_server s;
  auto data = random_bytes((9 << 20) + 77, 31);
  {
    std::ofstream f(s.root / "out" / "src.bin", std::ios::binary);
    f.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  }
  {  // auto on tcp: no real RMA here, so messages
    store::client c("127.0.0.1", s.srv->port(), s.opts());
    std::vector<unsigned char> buf(1 << 20);
    EXPECT_EQ(c.read("out/src.bin", 0, buf.data(), buf.size()), buf.size());
    EXPECT_FALSE(c.stats().rma);
    EXPECT_EQ(c.stats().rma_pieces, 0u);
  }
  // Forced on where the lanes have no remote memory access (tcp here): the server refuses, naming why
  // (an RMA request hands UCX the client's packed key to parse; only verbs lanes take them).
  runtime rt(sim_settings());
  auto o = s.opts_with(rt);
  o.rma = rma_use::on;
  o.map = false;  // a same-host server would map our memory instead (the path taken before RMA)
  store::client c("127.0.0.1", s.srv->port(), o);
  std::vector<unsigned char> buf(data.size() + 64);
  auto t = test::error_text([&] { c.read("out/src.bin", 0, buf.data() + 3, data.size()); });
  EXPECT_THAT(t, HasSubstr("RMA needs a lane with remote memory access (verbs)"));
  EXPECT_THAT(t, HasSubstr("[not_supported]"));
}
