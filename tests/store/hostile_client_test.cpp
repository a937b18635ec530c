// A hostile client against a live storage server: garbage frames, oversize requests, more requests
// than credits. The server refuses each with a clear error or drops that connection — and keeps
// serving everyone else.
#include <ferry/store/client.hpp>
#include <ferry/store/server.hpp>

#include "net/ucx.hpp"
#include "store/door.hpp"
#include "store/lending.hpp"
#include "support/errors.hpp"
#include "support/server_io.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

using namespace ferry;
using namespace ferry::net;
using ::testing::HasSubstr;
using clk = std::chrono::steady_clock;

namespace {

// Collects whatever frames come back on a raw lane: it listens, knocks at the server's door naming
// its port, and takes the server's connection (which says hello with the door's ticket first).
struct raw_client {
  ucx_worker w{"hostile"};
  welcome pass;
  std::shared_ptr<connection> c;
  std::vector<std::uint8_t> offered;  // the ticket the server's connection said hello with
  std::mutex mu;
  std::condition_variable cv;
  std::vector<message> got;
  raw_client(std::uint16_t port) {
    w.on_frame([this](connection& cn, message m) {
      std::lock_guard l(mu);
      if (auto* h = std::get_if<hello>(&m.b); h && !c) {
        c = cn.shared_from_this();
        offered = h->ticket;
      } else {
        got.push_back(std::move(m));
      }
      cv.notify_all();
    });
    const auto lane = w.listen("127.0.0.1", 0, [](std::shared_ptr<connection>) {});
    pass = store::detail::knock("127.0.0.1", port, "", [&] { return std::vector<std::uint16_t>{lane}; }, clk::now() + std::chrono::seconds(5));
    std::unique_lock l(mu);
    if (!cv.wait_for(l, std::chrono::seconds(5), [&] { return c != nullptr; }))
      throw std::runtime_error("the server did not connect to the raw lane");
  }
  message hello_frame(std::uint64_t rid, std::vector<std::uint8_t> ticket = {}) {
    return {rid, 0, hello{1, 1, 64, {}, 1, ticket.empty() ? pass.ticket : ticket, {}}};
  }
  // Sends raw bytes as a frame AM (bypassing the encoder).
  void send_raw(std::vector<std::byte> bytes) {
    auto buf = std::make_shared<std::vector<std::byte>>(std::move(bytes));
    w.post([this, buf] {
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
      ucs_status_ptr_t r = ucp_am_send_nbx(c->ep, am_frame, nullptr, 0, buf->data(), buf->size(), &p);
      if (r && !UCS_PTR_IS_ERR(r)) ucp_request_free(r);
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // keep buf alive while UCX copies it
  }
  bool wait_for(std::size_t n, std::chrono::seconds t = std::chrono::seconds(5)) {
    std::unique_lock l(mu);
    return cv.wait_for(l, t, [&] { return got.size() >= n; });
  }
  // The handshake (no secret): the server's welcome, or an empty one if none came.
  welcome greet() {
    c->send_frame(hello_frame(1));
    if (!wait_for(1)) return {};
    std::lock_guard l(mu);
    auto* wm = std::get_if<welcome>(&got[0].b);
    return wm ? *wm : welcome{};
  }
};

struct exported {
  std::filesystem::path root;
  std::unique_ptr<store::server> srv;
  exported() {
    root = std::filesystem::path(::testing::TempDir()) / ("ferry-hostile-" + std::to_string(::getpid()));
    std::filesystem::create_directories(root);
    std::ofstream(root / "a.bin", std::ios::binary) << std::string(1 << 20, 'x');
    store::server_options o;
    o.root = root.string();
    o.max_request = 64 << 10;
    o.max_outstanding = 2;
    o.files = true;
    srv = std::make_unique<store::server>(test::server_io(), o);
  }
  ~exported() {
    srv.reset();
    std::filesystem::remove_all(root);
  }
};

TEST(StoreHostile, GarbageFramesDropOnlyThatConnection) {
  exported e;
  raw_client bad(e.srv->port());
  bad.send_raw(std::vector<std::byte>(100, std::byte{0x41}));  // not a frame at all
  // The server dropped the hostile connection...
  for (int i = 0; i < 50 && bad.c->alive(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(bad.c->alive()) << "the server kept a connection that sent garbage";
  // ...and still serves others.
  store::client good("127.0.0.1", e.srv->port());
  std::vector<char> buf(100);
  EXPECT_EQ(good.read("a.bin", 0, buf.data(), buf.size()), 100u);
}

TEST(StoreHostile, RequestsBeforeTheHandshakeOversizeAndOverCreditAreRefused) {
  exported e;
  raw_client h(e.srv->port());
  // Before the handshake.
  h.c->send_frame({1, 0, stat_req{"a.bin"}});
  ASSERT_TRUE(h.wait_for(1));
  ASSERT_TRUE(std::holds_alternative<error_reply>(h.got[0].b));
  EXPECT_THAT(std::get<error_reply>(h.got[0].b).message, HasSubstr("request before the handshake"));
  EXPECT_EQ(h.offered, h.pass.ticket) << "the server's connection names the door's ticket first";
  h.c->send_frame(h.hello_frame(2));
  ASSERT_TRUE(h.wait_for(2));
  ASSERT_TRUE(std::holds_alternative<welcome>(h.got[1].b));
  EXPECT_EQ(std::get<welcome>(h.got[1].b).credits, 2u);
  // Oversize.
  h.c->send_frame({3, 0, read_req{"a.bin", 0, 1 << 20}});
  ASSERT_TRUE(h.wait_for(3));
  ASSERT_TRUE(std::holds_alternative<error_reply>(h.got[2].b));
  EXPECT_THAT(std::get<error_reply>(h.got[2].b).message, HasSubstr("exceeds the limit 65536"));
  // Writes to a read-only server.
  h.c->send_frame({4, 0, write_req{"a.bin", 0, 10}});
  ASSERT_TRUE(h.wait_for(4));
  EXPECT_THAT(std::get<error_reply>(h.got[3].b).message, HasSubstr("read-only"));
  // A burst far beyond the credits: every request gets an answer (served or refused as busy).
  for (std::uint64_t id = 10; id < 60; ++id) h.c->send_frame({id, 0, stat_req{"a.bin"}});
  ASSERT_TRUE(h.wait_for(4 + 50, std::chrono::seconds(10)));
  int busy = 0, served = 0;
  for (std::size_t i = 4; i < h.got.size(); ++i) {
    if (auto* er = std::get_if<error_reply>(&h.got[i].b)) busy += er->message.find("credits exhausted") != std::string::npos;
    else served += std::holds_alternative<stat_reply>(h.got[i].b);
  }
  EXPECT_EQ(busy + served, 50);
  EXPECT_GT(served, 0);
  // The server is fine.
  store::client good("127.0.0.1", e.srv->port());
  EXPECT_EQ(good.stat("a.bin").size, 1u << 20);
}

// A read's notify record must lie in a region the client lent; one that does is written
// {request id, bytes} once the data is in place, before the completion is sent.
TEST(StoreHostile, NotifyRecordsStayInsideLentRegions) {
  exported e;
  raw_client h(e.srv->port());
  auto w = h.greet();
  ASSERT_FALSE(w.lending.empty()) << "a same-host server names its lending socket";
  store::detail::shared_region r(1 << 20);
  std::string why;
  ASSERT_TRUE(store::detail::pass_region(w.lending, w.token, r.fd(), r.id(), clk::now() + std::chrono::seconds(5), why)) << why;
  auto base = reinterpret_cast<std::uint64_t>(r.data());
  h.c->send_frame({2, 0, lend{base, r.size(), r.id()}});
  ASSERT_TRUE(h.wait_for(2));
  ASSERT_EQ(std::get<complete>(h.got[1].b).bytes, 1u) << "the server maps a sealed memfd passed with its session's token";
  // Just past the region's end: refused, nothing written.
  h.c->send_frame({3, 0, read_into{"a.bin", 0, 4096, base, base + r.size() - 8}});
  ASSERT_TRUE(h.wait_for(3));
  ASSERT_TRUE(std::holds_alternative<error_reply>(h.got[2].b));
  EXPECT_THAT(std::get<error_reply>(h.got[2].b).message, HasSubstr("notify record"));
  // Inside it: the record says which request and how much, and the data is there.
  auto* rec = reinterpret_cast<std::uint64_t*>(r.data() + r.size() - 64);
  h.c->send_frame({4, 0, read_into{"a.bin", (1 << 20) - 100, 4096, base, base + r.size() - 64}});
  ASSERT_TRUE(h.wait_for(4));
  ASSERT_TRUE(std::holds_alternative<complete>(h.got[3].b));
  EXPECT_EQ(std::get<complete>(h.got[3].b).bytes, 100u);
  EXPECT_EQ(rec[0], 4u);
  EXPECT_EQ(rec[1], 100u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(r.data()), 100), std::string(100, 'x'));
  // Ranges in one request answered into the region: one past its end is refused, nothing written;
  // inside, the counts and the data are there and the completion carries nothing else.
  const std::vector<read_range> two = {{0, 4096}, {(1 << 20) - 10, 4096}};
  const std::uint64_t answer = read_many_answer_bytes(two);
  std::memset(r.data(), 0x11, r.size());
  h.c->send_frame({5, 0, read_many{"a.bin", 0, two, base + r.size() - answer + 1}});
  ASSERT_TRUE(h.wait_for(5));
  ASSERT_TRUE(std::holds_alternative<error_reply>(h.got[4].b));
  EXPECT_THAT(std::get<error_reply>(h.got[4].b).message, HasSubstr("outside every region the client lent"));
  EXPECT_EQ(r.data()[r.size() - 1], std::byte{0x11});
  h.c->send_frame({6, 0, read_many{"a.bin", 0, two, base + 64}});
  ASSERT_TRUE(h.wait_for(6));
  ASSERT_TRUE(std::holds_alternative<complete>(h.got[5].b));
  EXPECT_EQ(std::get<complete>(h.got[5].b).bytes, answer);
  std::uint64_t counts[2];
  std::memcpy(counts, r.data() + 64, sizeof counts);
  EXPECT_EQ(counts[0], 4096u);
  EXPECT_EQ(counts[1], 10u);
  const char* d = reinterpret_cast<const char*>(r.data()) + 64 + 16;
  EXPECT_EQ(std::string(d, 4096), std::string(4096, 'x'));
  EXPECT_EQ(std::string(d + 4096, 10), std::string(10, 'x'));
  EXPECT_EQ(std::string(d + 4096 + 10, 4086), std::string(4086, '\0')) << "zeros past the end of the file";
  EXPECT_EQ(r.data()[64 + answer], std::byte{0x11}) << "nothing past the answer";
}

TEST(StoreHostile, DirectRequestsNeedAMappedRegionAndStayInsideIt) {
  exported e;
  raw_client h(e.srv->port());
  h.greet();
  // A direct read without a lent region: refused, nothing written anywhere.
  h.c->send_frame({2, 0, read_into{"a.bin", 0, 4096, 0x10000}});
  ASSERT_TRUE(h.wait_for(2));
  ASSERT_TRUE(std::holds_alternative<error_reply>(h.got[1].b));
  EXPECT_THAT(std::get<error_reply>(h.got[1].b).message, HasSubstr("without a mapped region"));
  h.c->send_frame({7, 0, read_many{"a.bin", 0, {{0, 4096}}, 0x10000}});
  ASSERT_TRUE(h.wait_for(3));
  {
    std::lock_guard l(h.mu);
    ASSERT_TRUE(std::holds_alternative<error_reply>(h.got.back().b));
    EXPECT_THAT(std::get<error_reply>(h.got.back().b).message, HasSubstr("without a mapped region"));
    h.got.pop_back();  // the answers below are counted from here
  }
  // A region never passed on the lending socket: answered "not mapped" (0).
  h.c->send_frame({3, 0, lend{0x10000, 1 << 20, 12345}});
  ASSERT_TRUE(h.wait_for(3));
  ASSERT_TRUE(std::holds_alternative<complete>(h.got[2].b));
  EXPECT_EQ(std::get<complete>(h.got[2].b).bytes, 0u);
  h.c->send_frame({4, 0, read_into{"a.bin", 0, 4096, 0x10000}});
  ASSERT_TRUE(h.wait_for(4));
  EXPECT_THAT(std::get<error_reply>(h.got[3].b).message, HasSubstr("without a mapped region"));
  // Giving back a region that was never mapped (length 0): answered, nothing else changes.
  h.c->send_frame({6, 0, lend{0x10000, 0, 0}});
  ASSERT_TRUE(h.wait_for(5));
  ASSERT_TRUE(std::holds_alternative<complete>(h.got[4].b));
  EXPECT_EQ(h.got[4].request_id, 6u);
  {
    std::lock_guard l(h.mu);
    h.got.pop_back();  // the RMA check below counts answers from here
  }
  // An RMA request with a key that is no key (bounded copy before UCX unpacks it): the server
  // answers and stays up. Over tcp UCX emulates RMA and does not check keys at the target -- the
  // put lands wherever the requester named in its own process, so the address here is a buffer of
  // ours (a requester can only hurt itself; on verbs the NIC checks the key).
  std::vector<std::byte> mine(4096);
  h.c->send_frame({5, 0, read_rma{"a.bin", 0, 4096, reinterpret_cast<std::uint64_t>(mine.data()), std::vector<std::uint8_t>(64, 0x5a)}});
  ASSERT_TRUE(h.wait_for(5));
  EXPECT_TRUE(std::holds_alternative<error_reply>(h.got[4].b) || std::holds_alternative<complete>(h.got[4].b));
  // The server is fine.
  store::client good("127.0.0.1", e.srv->port());
  EXPECT_EQ(good.stat("a.bin").size, 1u << 20);
}

// The lending socket takes descriptors only with a live session's token, and the server maps only
// sealed shared memory at least as long as claimed; anything else is answered "not mapped".
TEST(StoreHostile, OnlySealedSharedMemoryPassedWithALiveTokenIsMapped) {
  exported e;
  raw_client h(e.srv->port());
  auto w = h.greet();
  ASSERT_FALSE(w.lending.empty());
  auto until = [] { return clk::now() + std::chrono::seconds(5); };
  std::string why;
  store::detail::shared_region good(1 << 20);
  // A token no session holds: refused on the socket.
  EXPECT_FALSE(store::detail::pass_region(w.lending, std::vector<std::uint8_t>(lend_token_size, 0x42), good.fd(), 1, until(), why));
  EXPECT_THAT(why, HasSubstr("refused"));
  // Descriptors that are taken on the socket but must not be mapped.
  int unsealed = ::memfd_create("unsealed", MFD_CLOEXEC);
  ASSERT_EQ(::ftruncate(unsealed, 1 << 20), 0);
  auto file = std::filesystem::path(::testing::TempDir()) / ("ferry-lend-" + std::to_string(::getpid()));
  int plain = ::open(file.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  ASSERT_GE(plain, 0);
  ASSERT_EQ(::ftruncate(plain, 1 << 20), 0);
  int pipefd[2];
  ASSERT_EQ(::pipe2(pipefd, O_CLOEXEC), 0);
  struct bad_case {
    int fd;
    std::uint64_t id, length;
    const char* what;
  };
  std::vector<bad_case> cases{{unsealed, 101, 1 << 20, "an unsealed memfd (the client could shrink it under the server)"},
                              {plain, 102, 1 << 20, "a plain file"},
                              {pipefd[0], 103, 1 << 20, "a pipe"},
                              {good.fd(), 104, 2 << 20, "a region claimed longer than it is"}};
  std::uint64_t rid = 2;
  for (auto& c : cases) {
    ASSERT_TRUE(store::detail::pass_region(w.lending, w.token, c.fd, c.id, until(), why)) << why;
    h.c->send_frame({rid, 0, lend{0x10000000, c.length, c.id}});
    ASSERT_TRUE(h.wait_for(rid));
    ASSERT_TRUE(std::holds_alternative<complete>(h.got[rid - 1].b));
    EXPECT_EQ(std::get<complete>(h.got[rid - 1].b).bytes, 0u) << c.what << " was mapped";
    rid++;
  }
  // The genuine region is, and a direct read lands in it.
  ASSERT_TRUE(store::detail::pass_region(w.lending, w.token, good.fd(), good.id(), until(), why)) << why;
  auto base = reinterpret_cast<std::uint64_t>(good.data());
  h.c->send_frame({rid++, 0, lend{base, good.size(), good.id()}});
  ASSERT_TRUE(h.wait_for(rid - 1));
  EXPECT_EQ(std::get<complete>(h.got[rid - 2].b).bytes, 1u);
  h.c->send_frame({rid++, 0, read_into{"a.bin", 0, 60000, base}});
  ASSERT_TRUE(h.wait_for(rid - 1));
  ASSERT_TRUE(std::holds_alternative<complete>(h.got[rid - 2].b));
  EXPECT_EQ(std::get<complete>(h.got[rid - 2].b).bytes, 60000u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(good.data()), 60000), std::string(60000, 'x'));
  ::close(unsealed);
  ::close(plain);
  ::close(pipefd[0]);
  ::close(pipefd[1]);
  std::filesystem::remove(file);
}

// The server maps a lent file once per client process and shares that mapping between lends, but
// never with a descriptor that could not map the file writable itself: a read-only descriptor of a
// region another session lent, or one whose file was sealed against writing since, is not mapped.
TEST(StoreHostile, ALentMappingIsNeverSharedWithADescriptorThatCouldNotWriteTheFile) {
  exported e;
  raw_client a(e.srv->port()), b(e.srv->port());
  auto wa = a.greet(), wb = b.greet();
  ASSERT_FALSE(wa.lending.empty());
  auto until = [] { return clk::now() + std::chrono::seconds(5); };
  std::string why;
  store::detail::shared_region region(1 << 20);
  auto base = reinterpret_cast<std::uint64_t>(region.data());
  auto lend_on = [&](raw_client& h, const welcome& w, int fd, std::uint64_t id, std::uint64_t rid) {
    EXPECT_TRUE(store::detail::pass_region(w.lending, w.token, fd, id, until(), why)) << why;
    h.c->send_frame({rid, 0, lend{base, region.size(), id}});
    EXPECT_TRUE(h.wait_for(rid));
    EXPECT_TRUE(std::holds_alternative<complete>(h.got[rid - 1].b));
    return std::get<complete>(h.got[rid - 1].b).bytes;
  };
  EXPECT_EQ(lend_on(a, wa, region.fd(), 1, 2), 1u) << "the owner's read-write descriptor is mapped";
  int read_only = ::open(("/proc/self/fd/" + std::to_string(region.fd())).c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(read_only, 0);
  EXPECT_EQ(lend_on(b, wb, read_only, 2, 2), 0u) << "a read-only descriptor got the writable mapping";
  // A direct read through b would have written the file: refused, and the region is untouched.
  std::memset(region.data(), 0x5A, 4096);
  b.c->send_frame({3, 0, read_into{"a.bin", 0, 4096, base}});
  ASSERT_TRUE(b.wait_for(3));
  EXPECT_TRUE(std::holds_alternative<error_reply>(b.got[2].b));
  EXPECT_EQ(std::count(reinterpret_cast<const char*>(region.data()), reinterpret_cast<const char*>(region.data()) + 4096, 'Z'), 4096)
      << "the server wrote into the region through the read-only descriptor's lend";
  ::close(read_only);
#ifdef F_SEAL_FUTURE_WRITE
  // A file sealed against writing after its first lend: a later lend of it is not mapped.
  int sealable = ::memfd_create("sealable", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(sealable, 0);
  ASSERT_EQ(::ftruncate(sealable, 1 << 20), 0);
  ASSERT_EQ(::fcntl(sealable, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  EXPECT_EQ(lend_on(a, wa, sealable, 3, 3), 1u) << "a sealed, writable memfd is mapped";
  ASSERT_EQ(::fcntl(sealable, F_ADD_SEALS, F_SEAL_FUTURE_WRITE), 0);
  EXPECT_EQ(lend_on(a, wa, sealable, 4, 4), 0u) << "a write-sealed file got the writable mapping";
  ::close(sealable);
#endif
}

// A file asked for on the lending socket is lent only for a live session's token, only read-only,
// and only where a read of that path would be served: beneath the root, a regular file. Everything
// else is refused with the reason, and the server goes on serving.
TEST(StoreHostile, FilesAreLentReadOnlyBeneathTheRootForALiveSessionOnly) {
  exported e;
  std::filesystem::create_directories(e.root / "sub");
  auto outside = std::filesystem::path(::testing::TempDir()) / ("ferry-outside-" + std::to_string(::getpid()));
  std::ofstream(outside) << "not for clients";
  std::filesystem::create_symlink(outside, e.root / "escape");
  ASSERT_EQ(::mkfifo((e.root / "fifo").c_str(), 0600), 0);
  // Writable by others: a lent descriptor could be opened again for writing through /proc/self/fd.
  std::ofstream(e.root / "shared.bin") << "anyone may write this";
  ASSERT_EQ(::chmod((e.root / "shared.bin").c_str(), 0666), 0);
  raw_client h(e.srv->port());
  auto w = h.greet();
  ASSERT_FALSE(w.lending.empty());
  auto until = [] { return clk::now() + std::chrono::seconds(5); };
  std::string why;
  EXPECT_EQ(store::detail::ask_file(w.lending, std::vector<std::uint8_t>(lend_token_size, 0x42), "a.bin", until(), why), -1);
  EXPECT_THAT(why, HasSubstr("no live session"));
  struct bad_case {
    std::string path;
    const char* says;
  };
  for (const auto& c : std::vector<bad_case>{{"../a.bin", "'..' is not allowed"},
                                             {"/etc/hostname", "absolute paths"},
                                             {"escape", "outside the root"},
                                             {"sub", "directory"},
                                             {"fifo", "FIFO"},
                                             {"missing.bin", "o such file"},
                                             {std::string("a.bin\0x", 7), "NUL"}}) {
    why.clear();
    EXPECT_EQ(store::detail::ask_file(w.lending, w.token, c.path, until(), why), -1) << c.path << " was lent";
    EXPECT_THAT(why, HasSubstr(c.says)) << c.path;
  }
  EXPECT_EQ(e.srv->stats().files_lent, 0u);
  int fd = store::detail::ask_file(w.lending, w.token, "a.bin", until(), why);
  ASSERT_GE(fd, 0) << why;
  EXPECT_EQ(::fcntl(fd, F_GETFL) & O_ACCMODE, O_RDONLY);
  char b[4] = {};
  EXPECT_EQ(::pread(fd, b, sizeof b, 100), 4);
  EXPECT_EQ(std::string(b, 4), "xxxx");
  EXPECT_EQ(::pwrite(fd, "yy", 2, 0), -1) << "a lent file is written";
  EXPECT_EQ(errno, EBADF);
  ::close(fd);
  EXPECT_EQ(e.srv->stats().files_lent, 1u);
  // A file writable by others is lent to the server's own user, who gains nothing by it; to a process
  // of another user it is not (the descriptor could be opened again for writing through /proc,
  // past directories that user may not search).
  fd = store::detail::ask_file(w.lending, w.token, "shared.bin", until(), why);
  EXPECT_GE(fd, 0) << why;
  if (fd >= 0) ::close(fd);
  if (::geteuid() == 0) {
    int out[2];
    ASSERT_EQ(::pipe(out), 0);
    const pid_t child = ::fork();
    if (child == 0) {
      ::close(out[0]);
      std::string reason;
      int got = -2;
      if (::setgid(65534) == 0 && ::setuid(65534) == 0) got = store::detail::ask_file(w.lending, w.token, "shared.bin", until(), reason);
      const std::string said = std::to_string(got) + " " + reason;
      [[maybe_unused]] auto n = ::write(out[1], said.data(), said.size());
      ::_exit(0);
    }
    ::close(out[1]);
    std::string said;
    char c[256];
    for (ssize_t n; (n = ::read(out[0], c, sizeof c)) > 0;) said.append(c, static_cast<std::size_t>(n));
    ::close(out[0]);
    ::waitpid(child, nullptr, 0);
    EXPECT_THAT(said, ::testing::StartsWith("-1 ")) << "lent to another user";
    EXPECT_THAT(said, HasSubstr("writable by group or others"));
  }
  EXPECT_EQ(e.srv->stats().files_lent, 2u);
  std::filesystem::remove(outside);
  // A server that lends no files says so.
  store::server_options o;
  o.root = e.root.string();
  o.files = false;
  store::server closed(test::server_io(), o);
  raw_client h2(closed.port());
  auto w2 = h2.greet();
  EXPECT_EQ(store::detail::ask_file(w2.lending, w2.token, "a.bin", until(), why), -1);
  EXPECT_THAT(why, HasSubstr("lends no files"));
  // The first server still serves.
  store::client good("127.0.0.1", e.srv->port());
  std::vector<char> buf(100);
  EXPECT_EQ(good.read("a.bin", 0, buf.data(), buf.size()), 100u);
}

// Connections to the lending socket that never send are closed, and a flood of them cannot keep a
// client from lending; descriptors passed but never named by a `lend` go with their session.
TEST(StoreHostile, TheLendingSocketCannotBeWedgedAndLeaksNoDescriptor) {
  auto open_fds = [] {
    std::size_t n = 0;
    for ([[maybe_unused]] auto& x : std::filesystem::directory_iterator("/proc/self/fd")) n++;
    return n;
  };
  exported e;
  std::string name;
  {
    raw_client h(e.srv->port());
    name = h.greet().lending;
  }
  // 200 silent connections, more than the socket keeps waiting.
  std::vector<int> silent;
  for (int i = 0; i < 200; ++i) {
    int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::memcpy(a.sun_path + 1, name.data(), name.size());
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size())) == 0)
      silent.push_back(fd);
    else
      ::close(fd);
  }
  EXPECT_GE(silent.size(), 64u);
  // A real client still lends (its reads go through the mapped region).
  store::client c("127.0.0.1", e.srv->port());
  auto* buf = static_cast<char*>(c.allocate(1 << 20));
  EXPECT_EQ(c.read("a.bin", 0, buf, 60000), 60000u);  // the fixture's request limit is 64 KiB
  EXPECT_THAT(c.stats().data_path, HasSubstr("mapped"));
  c.deallocate(buf);
  // The silent ones are closed by the server within a few seconds (read returns end of file).
  auto until = clk::now() + std::chrono::seconds(10);
  std::size_t closed = 0;
  for (int fd : silent) {
    pollfd p{fd, POLLIN, 0};
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - clk::now()).count();
    char ch;
    if (::poll(&p, 1, static_cast<int>(std::max<long long>(0, left))) == 1 && ::recv(fd, &ch, 1, MSG_DONTWAIT) <= 0) closed++;
    ::close(fd);
  }
  EXPECT_EQ(closed, silent.size());
  // Passed and never named: closed when the session goes (this process shares the server's table).
  auto before = open_fds();
  {
    raw_client h(e.srv->port());
    auto w = h.greet();
    store::detail::shared_region r(4096);
    std::string why;
    for (std::uint64_t id = 1; id <= 10; ++id)
      EXPECT_TRUE(store::detail::pass_region(w.lending, w.token, r.fd(), id, clk::now() + std::chrono::seconds(5), why)) << why;
  }
  bool back = false;
  for (int i = 0; i < 100 && !(back = open_fds() <= before); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_TRUE(back) << open_fds() << " descriptors open, " << before << " before";
}

// A refusal keeps the server's code (as errno on the wire) and names it once.
TEST(StoreHostile, ARefusalNamesItsCodeOnce) {
  exported e;
  store::client c("127.0.0.1", e.srv->port());
  std::vector<char> buf(1 << 20);
  auto t = test::error_text([&] { c.read("a.bin", 0, buf.data(), buf.size()); });  // over the 64 KiB limit
  EXPECT_THAT(t, HasSubstr("exceeds the limit 65536"));
  auto first = t.find("[out_of_range]");
  ASSERT_NE(first, std::string::npos) << t;
  EXPECT_EQ(t.find("[out_of_range]", first + 1), std::string::npos) << t;
}

// A lane's hello with another ticket than the one its connection was made for is refused, and the
// connection closed.
TEST(StoreHostile, ALaneHelloWithAnotherTicketIsRefused) {
  exported e;
  raw_client h(e.srv->port());
  h.c->send_frame(h.hello_frame(1, std::vector<std::uint8_t>(ticket_size, 0x42)));
  ASSERT_TRUE(h.wait_for(1));
  ASSERT_TRUE(std::holds_alternative<error_reply>(h.got[0].b));
  EXPECT_THAT(std::get<error_reply>(h.got[0].b).message, HasSubstr("not the ticket this lane was connected for"));
  for (int i = 0; i < 50 && h.c->alive(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(h.c->alive());
}

}  // namespace

// A client that sends requests but takes none of the answers cannot make the server hold them without
// end: past net::max_held_bytes queued for it, its connection fails on the server (its later requests
// get no answer), while other clients are served throughout.
TEST(StoreHostile, AClientThatTakesNoAnswersIsCutOff) {
  exported e;
  raw_client h(e.srv->port());
  ASSERT_EQ(h.greet().credits, 2u);
  std::atomic<int> answers{0};
  h.w.on_reply([&](connection&, message, const std::byte*, std::size_t) { ++answers; });
  // 1,000 reads of 256 KiB each (four ranges of a.bin), sent from the raw client's own worker, which
  // then takes nothing for a while: 250 MiB of answers, about four times the bound.
  std::vector<std::vector<std::byte>> frames;
  for (std::uint64_t id = 100; id < 1100; ++id)
    frames.push_back(encode({id, 0, read_many{"a.bin", 0, {{0, 65536}, {65536, 65536}, {131072, 65536}, {196608, 65536}}}}));
  std::atomic<bool> sent{false};
  h.w.post([&] {
    for (auto& f : frames) {
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
      ucs_status_ptr_t r = ucp_am_send_nbx(h.c->ep, am_frame, nullptr, 0, f.data(), f.size(), &p);
      if (r && !UCS_PTR_IS_ERR(r)) ucp_request_free(r);  // (the frames outlive the raw client's worker)
    }
    sent = true;
    // Takes nothing until the server has stopped answering (all answered, or none for half a second).
    std::uint64_t last = 0;
    for (int quiet = 0, i = 0; i < 400 && quiet < 5; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      const std::uint64_t now = e.srv->stats().inline_replies;
      quiet = now == last ? quiet + 1 : 0;
      last = now;
      if (now >= 1000) break;
    }
  });
  for (int i = 0; i < 100 && !sent; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_TRUE(sent.load());
  // Another client is served while the server holds answers for the first.
  store::client good("127.0.0.1", e.srv->port());
  EXPECT_EQ(good.stat("a.bin").size, 1u << 20);
  // Once the raw client takes messages again it gets what the server held (and sent), not all 1,000.
  for (int i = 0, quiet = 0, last = -1; i < 400 && quiet < 10; ++i) {  // until none came for a second
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const int now = answers.load();
    quiet = now > 0 && now == last ? quiet + 1 : 0;
    last = now;
  }
  EXPECT_GT(answers.load(), 0);
  EXPECT_LT(answers.load(), 1000) << "the server kept answering a client that took none";
  EXPECT_EQ(good.stat("a.bin").size, 1u << 20);
}
