#include "net/ucx.hpp"

#include "core/logging.hpp"

#include <ucs/config/global_opts.h>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <pthread.h>
#include <sys/prctl.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <set>
#include <sstream>

namespace ferry::net {


namespace {

std::string status_text(ucs_status_t s) { return fmt::format("{} (ucs_status {})", ucs_status_string(s), static_cast<int>(s)); }

void check(ucs_status_t s, std::string_view op, std::string_view res) {
  if (s == UCS_OK) return;
  error_info i{errc::network_error, std::string(op), std::string(res), "UCX call failed", status_text(s), 0, static_cast<long>(s)};
  throw error(std::move(i));
}

std::string addr_text(const sockaddr_storage& ss) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET) {
    auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    ::inet_ntop(AF_INET, &a->sin_addr, buf, sizeof buf);
    return fmt::format("{}:{}", buf, ntohs(a->sin_port));
  }
  auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
  ::inet_ntop(AF_INET6, &a->sin6_addr, buf, sizeof buf);
  return fmt::format("[{}]:{}", buf, ntohs(a->sin6_port));
}

std::uint16_t port_of(const sockaddr_storage& ss) {
  return ss.ss_family == AF_INET ? ntohs(reinterpret_cast<const sockaddr_in*>(&ss)->sin_port)
                                 : ntohs(reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_port);
}

sockaddr_storage make_addr(const std::string& host, std::uint16_t port) {
  sockaddr_storage ss{};
  auto* a4 = reinterpret_cast<sockaddr_in*>(&ss);
  auto* a6 = reinterpret_cast<sockaddr_in6*>(&ss);
  if (::inet_pton(AF_INET, host.c_str(), &a4->sin_addr) == 1) {
    a4->sin_family = AF_INET;
    a4->sin_port = htons(port);
  } else if (::inet_pton(AF_INET6, host.c_str(), &a6->sin6_addr) == 1) {
    a6->sin6_family = AF_INET6;
    a6->sin6_port = htons(port);
  } else {
    fail(errc::invalid_argument, "net.address", host, "not an IPv4 or IPv6 address");
  }
  return ss;
}

// UCX 1.13 keeps an event it could not hand to a busy worker by its descriptor's number, and aborts
// the process (async.c:643, openucx/ucx#9942, fixed in 1.17) when that worker, looking at it later,
// finds the number taken meanwhile by an endpoint or listener of another worker -- as when a server
// dies and one lane closes its connection while another makes its listener again. A worker holds
// such an event only between closing a descriptor and its next look at what UCX kept, and UCX looks
// at the end of every progress call. So descriptors are made and closed by one thread at a time
// (`making`, recursive: its own progress under it may close more), only while no other worker is
// inside a progress call (where UCX closes a failed connection's descriptors by itself), and a
// worker that closed some looks before letting go (forget_closed). Progress calls take no lock of
// the process: each worker says it is inside one on a cache line of its own, and waits at the door
// while descriptors are being made.
namespace {
struct descriptor_gate {
  std::recursive_mutex mu;
  std::atomic<bool> making{false};
  struct worker_flag {
    const std::atomic<bool>* inside;  // the worker's "inside a progress call"
    const std::string* name;
  };
  std::vector<worker_flag> workers;  // (under mu)
};
descriptor_gate& gate() {
  static descriptor_gate g;
  return g;
}
thread_local int making_depth = 0;                            // this thread holds the gate (nested)
thread_local const std::atomic<bool>* progressing = nullptr;  // the worker whose progress this thread is inside

// Held while descriptors are made or closed.
class making_descriptors {
 public:
  making_descriptors() {
    auto& g = gate();
    g.mu.lock();
    if (making_depth++ > 0) return;
    g.making.store(true, std::memory_order_seq_cst);
    // A progress call ends within microseconds; one that does not (a callback that blocks) is
    // waited for a bounded while, then this goes on, said in the log, rather than hang.
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    for (const auto& w : g.workers) {
      if (w.inside == progressing) continue;  // this thread's own worker: its events are its own
      ferry::detail::backoff b({std::chrono::microseconds(20), std::chrono::milliseconds(1), std::chrono::microseconds(50),
                                std::chrono::milliseconds(1)});
      while (w.inside->load(std::memory_order_seq_cst)) {
        const auto now = std::chrono::steady_clock::now();
        if (now >= until) {
          log::warn("net", "{} stayed inside one progress call for 10 s; making descriptors beside it", *w.name);
          break;
        }
        b.pause();
      }
    }
  }
  ~making_descriptors() {
    auto& g = gate();
    if (--making_depth == 0) g.making.store(false, std::memory_order_release);
    g.mu.unlock();
  }
  making_descriptors(const making_descriptors&) = delete;
  making_descriptors& operator=(const making_descriptors&) = delete;
};
}  // namespace

// Closes an endpoint without waiting for the peer (its requests are cancelled).
void close_ep(ucp_ep_h ep) {
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
  if (r && !UCS_PTR_IS_ERR(r)) ucp_request_free(r);
}

struct send_ctx {
  std::vector<std::byte> buf;  // frame bytes or the data header
  std::function<void(ucs_status_t)> done;
  ucx_worker* w = nullptr;  // set while UCX holds the send (pending_op)
};

void send_cb(void* request, ucs_status_t status, void* user) {
  auto* c = static_cast<send_ctx*>(user);
  if (c->w) c->w->pending_op(-1);
  if (c->done) c->done(status);
  delete c;
  ucp_request_free(request);
}

struct recv_ctx {
  ucx_worker* w;
  std::shared_ptr<connection> conn;
  std::uint64_t rid, off;
  std::size_t len;
  ucx_worker::data_done* done;
};

}  // namespace

// ---- connection --------------------------------------------------------------------------------

void connection::mark_failed(const std::string& why) {
  std::function<void(const std::string&)> told;
  {
    std::lock_guard l(mu_);
    if (!alive_) return;
    failure_ = why;
    told = on_failure_;
  }
  alive_ = false;
  if (told) told(why);
}

void connection::on_failure(std::function<void(const std::string&)> f) {
  std::lock_guard l(mu_);
  on_failure_ = std::move(f);
}

namespace {
// Sends one active message on the progress thread; `c` (buffer, completion) is freed when UCX is
// done with it, immediately or from send_cb. A dead connection completes with CONNECTION_RESET.
void am_send(connection& conn, unsigned id, send_ctx* c, const void* header, std::size_t header_len, const void* data,
             std::size_t n, std::uint32_t flags) {
  if (!conn.alive() || !conn.ep) {
    if (c->done) c->done(UCS_ERR_CONNECTION_RESET);
    delete c;
    return;
  }
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.cb.send = send_cb;
  p.user_data = c;
  p.flags = UCP_AM_SEND_FLAG_REPLY | flags;
  ucs_status_ptr_t r = ucp_am_send_nbx(conn.ep, id, header, header_len, data, n, &p);
  if (r != nullptr && !UCS_PTR_IS_ERR(r)) {
    c->w = &conn.worker();
    c->w->pending_op(+1);
  } else if (r == nullptr) {
    if (c->done) c->done(UCS_OK);
    delete c;
  } else if (UCS_PTR_IS_ERR(r)) {
    if (c->done) c->done(UCS_PTR_STATUS(r));
    conn.mark_failed("send failed: " + status_text(UCS_PTR_STATUS(r)));
    delete c;
  }
}
}  // namespace

void connection::send_frame(const message& m) {
  if (!alive_) fail(errc::network_error, "net.send", peer_, "connection lost: " + failure());
  // Frames are always eager: the receiver handles them whole, never by rendezvous. The frame is
  // the message's data (id am_frame), not its header.
  if (int how = w_.enter()) {
    w_.encode_scratch(how, m);
    w_.send_held(*this, am_frame, w_.frame_scratch_, 0, nullptr, 0);
    w_.leave(how, true);
    return;
  }
  auto buf = encode(m);
  auto self = shared_from_this();
  w_.post([self, b = std::move(buf)]() mutable { self->worker().send_owned(*self, am_frame, std::move(b), 0); });
}

void connection::send_data(std::uint64_t rid, std::uint64_t off, const void* data, std::size_t n,
                           std::function<void(ucs_status_t)> done) {
  auto* c = new send_ctx{std::vector<std::byte>(sizeof(data_header)), std::move(done)};
  data_header h{rid, off};
  std::memcpy(c->buf.data(), &h, sizeof h);
  auto self = shared_from_this();
  w_.run_or_post([self, c, data, n] { am_send(*self, am_data, c, c->buf.data(), c->buf.size(), data, n, 0); }, true);
}

void connection::send_reply(const message& m, const void* data, std::size_t n) {
  auto buf = encode(m, n);
  std::size_t hl = buf.size();
  if (n) buf.insert(buf.end(), static_cast<const std::byte*>(data), static_cast<const std::byte*>(data) + n);
  send_reply(std::move(buf), hl);
}

void connection::send_reply(std::vector<std::byte> buf, std::size_t hl) {
  if (!alive_) fail(errc::network_error, "net.send", peer_, "connection lost: " + failure());
  if (hl > buf.size()) fail(errc::invalid_argument, "net.send", peer_, "reply frame longer than its buffer");
  if (int how = w_.enter()) {
    w_.send_owned(*this, am_reply, std::move(buf), hl);
    w_.leave(how, true);
    return;
  }
  auto self = shared_from_this();
  w_.post([self, b = std::move(buf), hl]() mutable { self->worker().send_owned(*self, am_reply, std::move(b), hl); });
}

std::byte* connection::reply_space(std::size_t n) {
  if (w_.owner_.load(std::memory_order_relaxed) != std::this_thread::get_id())
    fail(errc::internal, "net.send", peer_, "reply_space outside the worker's handlers");
  auto& d = w_.reply_scratch_;
  if (d.size() < n) d.resize(n);
  return d.data();
}

void connection::send_reply_space(const message& m, std::size_t n) {
  if (!alive_) fail(errc::network_error, "net.send", peer_, "connection lost: " + failure());
  auto& d = w_.reply_scratch_;
  if (n > d.size() || w_.owner_.load(std::memory_order_relaxed) != std::this_thread::get_id())
    fail(errc::internal, "net.send", peer_, "send_reply_space without reply_space on the worker's thread");
  if (int how = w_.enter()) {
    w_.encode_scratch(how, m);
    w_.send_held(*this, am_reply, w_.frame_scratch_, w_.frame_scratch_.size(), &d, n);
    w_.leave(how, true);
    return;
  }
  // Work posted earlier goes first: this reply waits behind it, with its own copy of the data.
  send_reply(m, d.data(), n);
}

std::string connection::transports() {
  auto self = shared_from_this();
  auto text_of = [self]() -> std::string {
        if (!self->ep) return "closed";
        // UCX reports lanes only as text: "lane[0]:  3:tcp/lo.0 md[1] ... am am_bw#0" -- keep the tl/dev names.
        char* text = nullptr;
        std::size_t len = 0;
        FILE* f = ::open_memstream(&text, &len);
        if (!f) return "?";
        ucp_ep_print_info(self->ep, f);
        std::fclose(f);
        std::set<std::string> tls;
        std::istringstream in(std::string(text, len));
        std::free(text);
        for (std::string line; std::getline(in, line);) {
          auto l = line.find("lane[");
          if (l == std::string::npos) continue;
          auto colon = line.find(':', l);
          if (colon == std::string::npos) continue;
          auto start = line.find(':', colon + 1);  // "3:tcp/lo.0" -> after the resource index
          if (start == std::string::npos) continue;
          auto end = line.find_first_of(" \t", start);
          std::string tl = line.substr(start + 1, end == std::string::npos ? std::string::npos : end - start - 1);
          if (auto dot = tl.rfind('.'); dot != std::string::npos && tl.find('/') != std::string::npos && dot > tl.find('/'))
            tl.resize(dot);
          // Mark the lane that carries active messages (ferry's control and data messages).
          std::istringstream words(line.substr(end == std::string::npos ? line.size() : end));
          for (std::string w; words >> w;)
            if (w == "am") tl += "(am)";
          if (!tl.empty()) tls.insert(tl);
        }
        std::string out;
        for (auto& t : tls) out += (out.empty() ? "" : ",") + t;
        return out.empty() ? "?" : out;
  };
  // A frame handler (the worker's holder) asks on its own thread; others hand it to the worker.
  if (w_.owner_.load(std::memory_order_relaxed) == std::this_thread::get_id()) return text_of();
  return w_.call(text_of, std::chrono::steady_clock::now() + std::chrono::seconds(10));
}

void connection::close() {
  auto self = shared_from_this();
  w_.post([self] {
    if (!self->ep) return;
    self->w_.drop(*self);
    self->mark_failed("closed");
  });
}

// ---- context, regions -------------------------------------------------------------------------

namespace {
// Whether the kernel knows an RDMA device (InfiniBand, RoCE, iWARP all appear there).
bool rdma_device_present() {
  std::error_code ec;
  auto it = std::filesystem::directory_iterator("/sys/class/infiniband", ec);
  return !ec && it != std::filesystem::directory_iterator();
}
// Whether UCX may put a connection on shared memory (peer error handling needs UCX_MM_ERROR_HANDLING).
bool shm_connections_enabled() {
  const char* v = std::getenv("UCX_MM_ERROR_HANDLING");
  if (!v) return false;
  std::string s(v);
  for (auto& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return s == "y" || s == "yes" || s == "on" || s == "1";
}
}  // namespace

std::string interface_for(const std::string& host, bool local) {
  sockaddr_storage want = make_addr(host, 9);
  auto same = [](const sockaddr* a, const sockaddr_storage& b) {
    if (!a || a->sa_family != b.ss_family) return false;
    if (a->sa_family == AF_INET)
      return reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr == reinterpret_cast<const sockaddr_in*>(&b)->sin_addr.s_addr;
    return std::memcmp(&reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr, &reinterpret_cast<const sockaddr_in6*>(&b)->sin6_addr,
                       sizeof(in6_addr)) == 0;
  };
  if (want.ss_family == AF_INET) {
    auto a = reinterpret_cast<sockaddr_in*>(&want)->sin_addr.s_addr;
    if (a == htonl(INADDR_ANY)) return {};
    if ((ntohl(a) >> 24) == 127) return "lo";
  } else {
    auto& a = reinterpret_cast<sockaddr_in6*>(&want)->sin6_addr;
    if (IN6_IS_ADDR_UNSPECIFIED(&a)) return {};
    if (IN6_IS_ADDR_LOOPBACK(&a)) return "lo";
  }
  sockaddr_storage mine = want;
  if (!local) {
    // The source address the kernel would use towards `host`.
    int fd = ::socket(want.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return {};
    socklen_t len = sizeof mine;
    bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&want),
                        want.ss_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6)) == 0 &&
              ::getsockname(fd, reinterpret_cast<sockaddr*>(&mine), &len) == 0;
    ::close(fd);
    if (!ok) return {};
  }
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return {};
  std::string name;
  for (ifaddrs* i = list; i; i = i->ifa_next)
    if (same(i->ifa_addr, mine)) {
      name = i->ifa_name;
      break;
    }
  ::freeifaddrs(list);
  return name;
}

namespace {
// UCX's global state -- its async thread, which takes connections -- does not survive fork: a process
// forked from one with live UCX contexts gets connections that never complete. So: the live contexts,
// and the process they belong to.
std::mutex g_ucx_mu;
long g_ucx_process = 0;
int g_ucx_contexts = 0;

// Held while a context is made or ended. ucp_init and ucp_cleanup add and remove libucm handlers
// under libucm's lock held for writing: a child forked meanwhile would inherit it so held (its thread
// not in the child) and every hooked mmap of the child would wait for it forever. So a fork waits for
// a context being made, but at most a second: another library's fork handler that ran before this one
// may hold what ucp_init waits for (the CUDA driver's lock, for UCX's CUDA transports).
std::timed_mutex g_context_making_mu;
thread_local bool t_fork_holds_making = false;
void hold_context_making_across_fork() {
  static const int e = ::pthread_atfork(
      [] { t_fork_holds_making = g_context_making_mu.try_lock_for(std::chrono::seconds(1)); },
      [] {
        if (std::exchange(t_fork_holds_making, false)) g_context_making_mu.unlock();
      },
      [] {
        t_fork_holds_making = false;
        new (&g_context_making_mu) std::timed_mutex;
      });
  if (e != 0)
    log::warn("net", "pthread_atfork: {}; a child forked while a UCX context is made may wait forever in its first mmap",
              std::strerror(e));
}
}  // namespace

ucx_context::ucx_context(const std::string& net_device) {
  {
    std::lock_guard l(g_ucx_mu);
    if (g_ucx_contexts > 0 && g_ucx_process != ::getpid())
      fail(errc::not_supported, "net.init", "UCX",
           fmt::format("this process ({}) was forked from process {} while that one used UCX, which does not survive fork; "
                       "ferry:// and ferry serve work in a process that starts UCX itself (a child started by spawn or "
                       "forkserver, or forked while its parent had no ferry:// connection or server)",
                       ::getpid(), g_ucx_process));
  }
  // Two transport settings UCX reads only from the environment (ucp_config_modify accepts them but
  // the worker rejects them), so they are set there once, before the first UCX context, unless the
  // user set them:
  // - a restarted server must get its well-known port back while the old connections sit in
  //   TIME_WAIT (UCX's default is not to set SO_REUSEADDR);
  // - UCX 1.13's tcp PUT (the rendezvous a large data message takes over tcp) aborts the sending
  //   process on an assertion (tcp_ep.c, PUT_TX_WAITING_ACK) when the receiver closes its endpoint
  //   as a put is acknowledged: a client cancelling its reads took the server down. Without it the
  //   rendezvous data goes as active messages on the same connection, sent without a copy still.
  static std::once_flag once;
  std::call_once(once, [] {
    ::setenv("UCX_TCP_CM_REUSEADDR", "y", 0);
    ::setenv("UCX_TCP_PUT_ENABLE", "n", 0);
  });
  // Shared-memory transports are left out of endpoints that ask for peer error handling (which
  // ferry needs) unless UCX_MM_ERROR_HANDLING=y (UCX 1.13). ferry does not set it: with shm lanes
  // UCX 1.13 does not always report a peer's close to the other side (requests then end only at
  // their deadlines). `ferry-bench remote` sets it for its shm runs; users opt in the same way.
  ucp_config_t* cfg = nullptr;
  check(ucp_config_read(nullptr, nullptr, &cfg), "net.init", "ucp_config_read");
  // Lanes only on the interface of the address the service was asked to use: a server told to
  // listen on loopback must not be reachable on the machine's other addresses through UCX's own
  // tcp listeners, and a client of it must not take lanes over them.
  if (!net_device.empty() && !std::getenv("UCX_NET_DEVICES")) ucp_config_modify(cfg, "NET_DEVICES", net_device.c_str());
  // Shared-memory connections without an RDMA device: UCX gives them a tcp lane for rendezvous
  // (rma_bw; the shared-memory domains cannot register user memory, so only tcp offers it), and
  // then every progress call polls tcp with an epoll_wait system call. Measured (2-core CPU VM):
  // a 16 B / 4 KiB AM round trip over sysv 0.73-0.91 us with that lane, 0.57-0.64 us without; ferry's
  // 4 KiB read 2.5-2.7 us vs 1.8-2.3 us. With no rendezvous rails UCX moves large messages by its AM
  // pipeline on the connection's own lanes (ferry's bulk data on shared memory goes through the
  // mapped landing region anyway). Only when shared memory can carry connections at all
  // (UCX_MM_ERROR_HANDLING=y, see above) -- tcp-only connections keep UCX's default -- and never
  // when the user set UCX_MAX_RNDV_RAILS or an RDMA device exists (its rendezvous is zero-copy).
  if (!std::getenv("UCX_MAX_RNDV_RAILS") && shm_connections_enabled() && !rdma_device_present())
    ucp_config_modify(cfg, "MAX_RNDV_RAILS", "0");
  // UCX 1.13's tcp transport sends large active messages without a copy (zcopy): when the peer
  // closes the connection while such a send is under way (a client cancelling its reads closes its
  // lane), UCX completes the send a second time as it purges the failed endpoint and aborts the
  // sending process on an assertion (uct_iface.h, `comp->count > 0`): a client could take the server
  // down. With zcopy off the data is copied into UCX's buffers as it is sent, and nothing is
  // completed twice. Not with an RDMA device (whose zero-copy sends carry the bulk data), and not
  // when the user set UCX_ZCOPY_THRESH.
  if (!std::getenv("UCX_ZCOPY_THRESH") && !rdma_device_present()) ucp_config_modify(cfg, "ZCOPY_THRESH", "inf");
  // A peer that dies while this side only waits for its replies (a server killed under a read whose
  // requests are all sent) is noticed by UCX's keepalive, every 20 s by default: requests would sit
  // until their deadlines. A probe per endpoint each second costs a few bytes and reports the death
  // in one or two seconds. Unless the user set UCX_KEEPALIVE_INTERVAL.
  if (!std::getenv("UCX_KEEPALIVE_INTERVAL")) ucp_config_modify(cfg, "KEEPALIVE_INTERVAL", "1s");
  // A process forked after this one's memory hooks were installed may hold libucm's event lock
  // forever (mem::memory_hooks_inherited says why): UCX must then add no memory-event handler, or
  // ucp_init waits for that lock. Its handlers belong to registration caches (ucp's own, and the
  // ib, knem and gdr_copy domains') and to the memory-type cache: all off in such a child, where
  // each registration is made when it is used (ferry registers its own buffers once anyway).
  if (memory_hooks_inherited()) {
    if (!std::getenv("UCX_RCACHE_ENABLE")) ucp_config_modify(cfg, "RCACHE_ENABLE", "n");
    // Only for domains the machine has: UCX warns of a setting no domain took.
    if (::access("/dev/knem", F_OK) == 0 || ::access("/dev/gdrdrv", F_OK) == 0) ucp_config_modify(cfg, "RCACHE", "n");
    if (rdma_device_present()) ucp_config_modify(cfg, "REG_METHODS", "odp,direct");
    ucs_global_opts.enable_memtype_cache = UCS_NO;
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP | UCP_FEATURE_RMA;
  params.name = "ferry";
  params.mt_workers_shared = 1;  // several workers (lanes), each on its own thread
  hold_context_making_across_fork();
  ucs_status_t st;
  {
    std::lock_guard making(g_context_making_mu);
    st = ucp_init(&params, cfg, &ctx_);
  }
  ucp_config_release(cfg);
  check(st, "net.init", "ucp_init");
  ucp_context_attr_t ca{};
  ca.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(ctx_, &ca) == UCS_OK) cuda_memory_ = (ca.memory_types & (1ull << UCS_MEMORY_TYPE_CUDA)) != 0;
  std::lock_guard l(g_ucx_mu);
  g_ucx_process = ::getpid();
  ++g_ucx_contexts;
}

ucx_context::~ucx_context() {
  {
    std::lock_guard making(g_context_making_mu);
    ucp_cleanup(ctx_);
  }
  std::lock_guard l(g_ucx_mu);
  --g_ucx_contexts;
}

remote_key::~remote_key() {
  if (rkey) w->run_or_post([r = rkey] { ucp_rkey_destroy(r); });
}

namespace {
// ucp_ep_rkey_unpack takes no length: it reads what the key's own bits say. A peer's key is copied
// into a zeroed buffer well past the protocol's limit first, so a short or lying key cannot make
// UCX read beyond our memory.
ucs_status_t unpack_bounded(ucp_ep_h ep, std::span<const std::byte> rkey, ucp_rkey_h* out) {
  std::vector<std::byte> padded(max_rkey + 4096);
  std::memcpy(padded.data(), rkey.data(), std::min(rkey.size(), max_rkey));
  return ucp_ep_rkey_unpack(ep, padded.data(), out);
}
}  // namespace

std::shared_ptr<remote_key> connection::unpack_rkey(std::span<const std::byte> rkey) {
  if (!ep || rkey.empty()) return nullptr;
  ucp_rkey_h rk = nullptr;
  if (unpack_bounded(ep, rkey, &rk) != UCS_OK) return nullptr;
  auto m = std::make_shared<remote_key>();
  m->w = &w_;
  m->rkey = rk;
  return m;
}

namespace {
struct rma_ctx {
  std::shared_ptr<connection> conn;
  std::shared_ptr<remote_key> key;  // the rkey lives until the operation completes
  std::function<void(ucs_status_t)> done;
};
void rma_cb(void* request, ucs_status_t status, void* user) {
  auto* c = static_cast<rma_ctx*>(user);
  c->conn->worker().pending_op(-1);
  if (c->done) c->done(status);
  delete c;
  ucp_request_free(request);
}
}  // namespace

void connection::rma(bool get, void* local, std::size_t n, std::uint64_t remote, std::shared_ptr<remote_key> key,
                     std::function<void(ucs_status_t)> done) {
  auto* c = new rma_ctx{shared_from_this(), std::move(key), std::move(done)};
  w_.run_or_post([c, get, local, n, remote] {
    auto& conn = *c->conn;
    if (!conn.ep || !conn.alive()) {
      if (c->done) c->done(UCS_ERR_CONNECTION_RESET);
      delete c;
      return;
    }
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = rma_cb;
    p.user_data = c;
    ucs_status_ptr_t r = get ? ucp_get_nbx(conn.ep, local, n, remote, c->key->rkey, &p)
                             : ucp_put_nbx(conn.ep, local, n, remote, c->key->rkey, &p);
    if (r == nullptr || UCS_PTR_IS_ERR(r)) {
      if (c->done) c->done(r == nullptr ? UCS_OK : UCS_PTR_STATUS(r));
      delete c;
    } else {
      conn.worker().pending_op(+1);
    }
  }, true);
}

void connection::send_frame_fenced(const message& m) {
  if (!alive_) fail(errc::network_error, "net.send", peer_, "connection lost: " + failure());
  auto* c = new send_ctx{encode(m), nullptr};
  auto self = shared_from_this();
  w_.run_or_post([self, c] {
    ucp_worker_fence(self->w_.handle());
    am_send(*self, am_frame, c, nullptr, 0, c->buf.data(), c->buf.size(), UCP_AM_SEND_FLAG_EAGER);
  }, true);
}

// ---- network registrations ---------------------------------------------------------------------

namespace {
struct net_key {
  ucp_mem_h memh = nullptr;
  std::vector<std::byte> rkey;
};
}  // namespace

std::optional<memory_region> ucx_net_client::acquire(const void* p, std::uint64_t n) {
  memory_region r;
  if (classify_) {
    r = classify_->classify(p, n);
    bool host = r.type == memory_type::host_pageable || r.type == memory_type::host_pinned;
    bool cuda = r.type == memory_type::device && ctx_->cuda_memory() && r.device == device_kind::cuda;
    if (!host && !cuda) return std::nullopt;
  } else {
    r.type = memory_type::host_pageable;
    r.device = device_kind::none;
  }
  r.base = reinterpret_cast<std::uintptr_t>(p);
  r.size = n;
  r.client = this;
  return r;
}

std::uint64_t ucx_net_client::pin(const memory_region&, std::uintptr_t base, std::uint64_t size) {
  auto k = std::make_unique<net_key>();
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = reinterpret_cast<void*>(base);
  mp.length = size;
  check(ucp_mem_map(ctx_->handle(), &mp, &k->memh), "net.register", fmt::format("[{:#x}, +{})", base, size));
  void* rk = nullptr;
  std::size_t rkn = 0;
  ucs_status_t st = ucp_rkey_pack(ctx_->handle(), k->memh, &rk, &rkn);
  if (st != UCS_OK) {
    ucp_mem_unmap(ctx_->handle(), k->memh);
    check(st, "net.register", "ucp_rkey_pack");
  }
  k->rkey.assign(static_cast<std::byte*>(rk), static_cast<std::byte*>(rk) + rkn);
  ucp_rkey_buffer_release(rk);
  return reinterpret_cast<std::uint64_t>(k.release());
}

void ucx_net_client::unpin(std::uint64_t cookie, std::uintptr_t, std::uint64_t) noexcept {
  auto* k = reinterpret_cast<net_key*>(cookie);
  if (!k) return;
  ucp_mem_unmap(ctx_->handle(), k->memh);
  delete k;
}

std::span<const std::byte> ucx_net_client::rkey_of(std::uint64_t cookie) {
  auto* k = reinterpret_cast<const net_key*>(cookie);
  return k ? std::span<const std::byte>(k->rkey) : std::span<const std::byte>();
}

// ---- worker ------------------------------------------------------------------------------------

ucx_worker::ucx_worker(std::string name, std::chrono::nanoseconds spin, std::shared_ptr<ucx_context> ctx)
    : name_(std::move(name)), ctx_(ctx ? std::move(ctx) : std::make_shared<ucx_context>()), spin_(spin) {
  ucs_status_t st;
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // the progress thread, or a caller (drive, run_or_post), never both
  {
    making_descriptors d;  // (its interfaces make descriptors too)
    st = ucp_worker_create(ctx_->handle(), &wp, &worker_);
    if (st == UCS_OK) gate().workers.push_back({&inside_.v, &name_});
  }
  check(st, "net.init", "ucp_worker_create");
  for (unsigned id : {am_frame, am_data, am_reply}) {
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                    UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    hp.id = id;
    hp.flags = UCP_AM_FLAG_WHOLE_MSG;
    hp.cb = id == am_frame ? am_frame_cb : id == am_reply ? am_reply_cb : am_data_cb;
    hp.arg = this;
    check(ucp_worker_set_am_recv_handler(worker_, &hp), "net.init", "set_am_recv_handler");
  }
  check(ucp_worker_get_efd(worker_, &efd_), "net.init", "ucp_worker_get_efd");
  wake_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_ = ::epoll_create1(EPOLL_CLOEXEC);
  if (wake_ < 0 || epoll_ < 0) fail_errno(errno, "net.init", name_, "eventfd/epoll");
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = efd_;
  ::epoll_ctl(epoll_, EPOLL_CTL_ADD, efd_, &ev);
  ev.data.fd = wake_;
  ::epoll_ctl(epoll_, EPOLL_CTL_ADD, wake_, &ev);
  // Dedicated, not the executor's: a UCX worker is progressed by one thread, which sleeps in its epoll.
  thread_ = std::thread([this] {
    // Its naps (reacquire) should be as short as asked: the default 50 us timer slack would make a
    // 10 us nap last 60, and a caller that stops driving waits for the nap to end.
    ::prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
    ::pthread_setname_np(::pthread_self(), "ferry-ucx");  // for top, perf and debuggers
    loop();
  });
}

ucx_worker::~ucx_worker() {
  post([this] {
    making_descriptors d;
    std::vector<std::shared_ptr<connection>> closed;  // alive while the progress below may name them
    for (auto& [ep, c] : conns_) {
      close_ep(ep);
      c->ep = nullptr;
      closed.push_back(c);
    }
    conns_.clear();
    close_listener();
    forget_closed();
    stop_ = true;
  });
  thread_.join();
  {
    // Its async context goes with it, and with that what UCX kept for it: the descriptors it closes
    // are free for others only then.
    making_descriptors d;
    std::erase_if(gate().workers, [this](const auto& w) { return w.inside == &inside_.v; });
    ucp_worker_destroy(worker_);
  }
  ::close(wake_);
  ::close(epoll_);
}

void ucx_worker::post(std::function<void()> f) {
  {
    std::lock_guard l(mu_);
    posted_.push_back(std::move(f));
  }
  nposted_.fetch_add(1, std::memory_order_seq_cst);
  // The progress thread polls nposted_ while awake; only a sleeping one needs the eventfd (a
  // syscall per message would cost more than a shared-memory round trip). It sets sleeping_ before
  // its last look at nposted_, this thread bumps nposted_ before looking at sleeping_: one of the
  // two always sees the other.
  if (sleeping_.load(std::memory_order_seq_cst)) {
    std::uint64_t one = 1;
    [[maybe_unused]] auto n = ::write(wake_, &one, sizeof one);
  }
}

void ucx_worker::run_or_post(std::function<void()> f, bool settles) {
  if (int how = enter()) {
    f();
    leave(how, settles);
    return;
  }
  post(std::move(f));
}

int ucx_worker::enter() {
  if (owner_.load(std::memory_order_relaxed) == std::this_thread::get_id()) {
    // Already the holder (a callback, the progress thread): run now unless posted work is waiting
    // (order is kept by posting behind it).
    return nposted_.load(std::memory_order_acquire) != 0 ? 0 : entered_holder;
  }
  // Inside another worker's progress call (a callback sending here): the work waiting on this worker
  // may make or close descriptors, which must not happen inside a progress call
  // (making_descriptors), so this goes behind it instead.
  if (progressing && nposted_.load(std::memory_order_acquire) != 0) return 0;
  // Free (the progress thread naps while callers drive, or sleeps): take it without a word. Each
  // atomic read-modify-write costs 20-30 ns on the GPU machine's VM, and a small request makes
  // dozens; the progress thread takes the worker back only after callers_ and drivers_ stayed zero
  // for a while, and its try_lock simply fails meanwhile.
  int how = entered_quiet;
  if (!ucx_mu_.try_lock()) {
    // Ask the progress thread to let this thread in, and wait for the worker a bounded while (the
    // progress thread looks at callers_ between progress calls; a caller that drives holds it
    // longer): posting instead would hand the send to the other thread.
    callers_.fetch_add(1, std::memory_order_seq_cst);
    int i = 0;
    while (!ucx_mu_.try_lock()) {
      if (++i >= 256) {
        callers_.fetch_sub(1, std::memory_order_seq_cst);
        return 0;
      }
      cpu_relax();
    }
    how = entered_took;
  }
  lock_owner();
  try {
    drain_posted();  // earlier work first
  } catch (...) {
    unlock_owner();
    ucx_mu_.unlock();
    if (how == entered_took) callers_.fetch_sub(1, std::memory_order_seq_cst);
    throw;
  }
  return how;
}

void ucx_worker::leave(int how, bool settles) {
  if (how != entered_took && how != entered_quiet) return;
  // Push what was started (the progress thread may be asleep), unless it finished at once.
  if (!settles || pending_ > 0)
    while (progress() != 0) {
    }
  unlock_owner();  // released before the lock (and the announcement) go
  ucx_mu_.unlock();
  if (how == entered_took) callers_.fetch_sub(1, std::memory_order_seq_cst);
}

void ucx_worker::owned_send_cb(void* request, ucs_status_t, void* user) {
  auto* w = static_cast<ucx_worker*>(user);
  if (auto it = w->held_.find(request); it != w->held_.end()) {
    if (auto c = it->second.c.lock()) c->held_bytes_ -= it->second.a.size() + it->second.b.size();
    w->held_.erase(it);
  }
  w->pending_op(-1);
  ucp_request_free(request);
}

void ucx_worker::send_owned(connection& c, unsigned id, std::vector<std::byte>&& buf, std::size_t hl) {
  send_held(c, id, buf, hl, nullptr, 0);
}

void ucx_worker::encode_scratch(int how, const message& m) {
  try {
    encode_into(m, frame_scratch_);
  } catch (...) {
    leave(how, true);
    throw;
  }
}

void ucx_worker::send_held(connection& c, unsigned id, std::vector<std::byte>& a, std::size_t hl, std::vector<std::byte>* b,
                           std::size_t n) {
  if (!c.alive() || !c.ep) return;
  const std::byte* data = b ? b->data() : a.data() + hl;
  if (!b) n = a.size() - hl;
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.cb.send = owned_send_cb;
  p.user_data = this;
  p.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
  ucs_status_ptr_t r = ucp_am_send_nbx(c.ep, id, a.data(), hl, data, n, &p);
  if (r == nullptr) return;  // sent (copied out): the buffers may be reused
  if (UCS_PTR_IS_ERR(r)) {
    c.mark_failed("send failed: " + status_text(UCS_PTR_STATUS(r)));
    return;
  }
  // Moving a vector keeps its bytes where UCX points.
  const std::size_t bytes = a.size() + (b ? b->size() : 0);
  held_.emplace(r, held_send{std::move(a), b ? std::move(*b) : std::vector<std::byte>{}, c.weak_from_this()});
  pending_op(+1);
  if ((c.held_bytes_ += bytes) > max_held_bytes)
    c.mark_failed(fmt::format("the peer takes no answers: {} bytes sent to it are still queued", c.held_bytes_));
}

void ucx_worker::progress_once() {
  drain_posted();
  while (progress() != 0) {
  }
}

void ucx_worker::step_aside(std::unique_lock<std::mutex>& l, std::chrono::nanoseconds grace) {
  unlock_owner();
  l.unlock();
  reacquire(l, grace);
}

void ucx_worker::reacquire(std::unique_lock<std::mutex>& l, std::chrono::nanoseconds grace) {
  using clk = std::chrono::steady_clock;
  // Take the worker back once no caller has wanted it for `grace`: a caller that drives requests
  // one after another leaves and comes back within a microsecond, and taking the worker in between
  // would make it wait for this thread's next progress call. While callers keep coming, this
  // thread polls a little between short naps: it has nothing to do while they drive, and spinning
  // would take a core from them (or from the server) where threads outnumber cores. No
  // futex: a caller would pay a wake-up system call on its way out, more than a shared-memory round
  // trip.
  clk::time_point free_since{};
  for (unsigned i = 1;; ++i) {
    if (stop_.load(std::memory_order_relaxed)) {
      l.lock();
      break;
    }
    bool driven = drivers_.load(std::memory_order_acquire) > 0;
    if (driven) {
      free_since = {};
    } else if (callers_.load(std::memory_order_acquire) == 0) {
      auto now = clk::now();
      if (free_since == clk::time_point{}) free_since = now;
      if (now - free_since >= grace && l.try_lock()) {
        if (drivers_.load(std::memory_order_acquire) == 0 && callers_.load(std::memory_order_acquire) == 0) break;
        l.unlock();  // a caller arrived meanwhile: it goes first
      }
    }
    // Naps while a caller drives (it progresses the worker itself), and only naps: polling the
    // worker's counters and lock here would pull their cache lines away from the caller at every
    // look, and the caller writes them a few times per request (a cache-line transfer between
    // cores costs about as much as a small request's whole bookkeeping). A brief caller
    // (run_or_post: a send from an I/O thread) is waited for by polling, so that incoming messages
    // are not left for a nap's length.
    if (driven) std::this_thread::sleep_for(std::chrono::microseconds(20));
    else cpu_relax();
  }
  lock_owner();
}

bool ucx_worker::drain_posted() {
  bool any = false;
  while (nposted_.load(std::memory_order_acquire) != 0) {
    std::function<void()> f;
    {
      std::lock_guard l(mu_);
      if (posted_.empty()) break;
      f = std::move(posted_.front());
      posted_.pop_front();
    }
    nposted_--;
    any = true;
    try {
      f();
    } catch (const std::exception& e) {
      log::error("net", "{}: posted work failed: {}", name_, e.what());
    }
  }
  return any;
}

void ucx_worker::loop() {
  using clk = std::chrono::steady_clock;
  auto last = clk::now();
  unsigned idle = 0;
  auto looked = last;
  std::unique_lock l(ucx_mu_);
  lock_owner();
  while (!stop_) {
    // (`last` is read after each busy turn and each sleep: no clock reading of its own here.)
    if (has_idle_.load(std::memory_order_acquire) && (kicked_.load(std::memory_order_acquire) || last - looked >= std::chrono::milliseconds(100))) {
      kicked_.store(false, std::memory_order_relaxed);
      unlock_owner();
      l.unlock();
      try {
        idle_();
      } catch (const std::exception& e) {
        log::error("net", "{}: idle work failed: {}", name_, e.what());
      }
      reacquire(l, std::chrono::nanoseconds(0));
      looked = last = clk::now();
      continue;
    }
    if (drivers_.load(std::memory_order_acquire) > 0) {
      // Callers driving is activity too: this thread stays awake (and the worker unarmed) for spin_
      // after they leave. An armed worker would make every peer that sends to it signal it through
      // a socket (UCX's shared-memory transport does sendto when the receiver armed its interface),
      // a system call per message on the peer's side.
      step_aside(l, std::chrono::microseconds(2));
      last = clk::now();
      continue;
    }
    if (callers_.load(std::memory_order_acquire) > 0) {  // a brief caller (a send): let it in, then go on
      step_aside(l, std::chrono::nanoseconds(0));
      last = clk::now();
      continue;
    }
    bool busy = drain_posted();
    while (progress() != 0) busy = true;
    if (busy) {
      last = clk::now();
      continue;
    }
    if (nposted_.load(std::memory_order_acquire) != 0) continue;
    if (stop_) break;
    // Back-off: keep polling for a while after activity (the next request usually follows at once).
    // Callers that want the worker announce themselves and are let in at the top of the loop. The
    // clock every 16th idle turn: reading it costs more than a progress call on some machines
    // (50-70 ns on the GPU machine's VM), and every turn's length is added to a message's wait.
    if (spin_.count() > 0 && ((++idle & 15) != 0 || clk::now() - last < spin_)) {
      cpu_relax();
      continue;
    }
    idle = 0;
    ucs_status_t st = ucp_worker_arm(worker_);
    if (st == UCS_ERR_BUSY) continue;  // events arrived meanwhile
    sleeping_.store(true, std::memory_order_seq_cst);
    if (nposted_.load(std::memory_order_seq_cst) != 0) {
      sleeping_.store(false);
      continue;
    }
    unlock_owner();
    l.unlock();
    epoll_event evs[2];
    int n = ::epoll_wait(epoll_, evs, 2, 100);
    sleeping_.store(false);
    if (n > 0) wakeups_++;
    for (int i = 0; i < n; ++i)
      if (evs[i].data.fd == wake_) {
        std::uint64_t v;
        [[maybe_unused]] auto r = ::read(wake_, &v, sizeof v);
      }
    reacquire(l, std::chrono::nanoseconds(0));  // a caller may be driving the worker
    last = clk::now();
  }
  drain_posted();
}

std::shared_ptr<connection> ucx_worker::adopt(ucp_ep_h ep, std::shared_ptr<connection> c) {
  c->ep = ep;
  conns_[ep] = c;
  return c;
}

void ucx_worker::drop(connection& c) {
  if (!c.ep) return;
  auto keep = c.shared_from_this();  // the map may hold the last reference
  making_descriptors d;
  conns_.erase(c.ep);
  close_ep(c.ep);
  c.ep = nullptr;
  forget_closed();
}

void ucx_worker::forget_closed() {
  // The first call handles the events kept before it began (those of the closed descriptors now
  // find no handler); the second those kept while the first ran.
  progress();
  progress();
}

unsigned ucx_worker::progress() {
  // See making_descriptors: not while another thread makes descriptors (unless this one is it).
  // Inside another worker's progress call (a callback sending on this worker's connection) this
  // thread already counts as inside one: a maker waits for that outer call, so none can be making
  // now, and waiting here would wait for a maker that waits for this thread.
  if (progressing) return ucp_worker_progress(worker_);
  const bool maker = making_depth > 0;
  if (!maker) {
    auto& g = gate();
    for (;;) {
      inside_.v.store(true, std::memory_order_seq_cst);
      if (!g.making.load(std::memory_order_seq_cst)) break;
      inside_.v.store(false, std::memory_order_seq_cst);
      while (g.making.load(std::memory_order_acquire)) std::this_thread::yield();  // (a maker's section is short)
    }
  }
  progressing = &inside_.v;
  const unsigned n = ucp_worker_progress(worker_);
  progressing = nullptr;
  if (!maker) inside_.v.store(false, std::memory_order_release);
  return n;
}

void ucx_worker::ep_error_cb(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* c = static_cast<connection*>(arg);
  auto keep = c->shared_from_this();
  c->mark_failed("peer failure: " + status_text(status));
  // A failed endpoint is its owner's to close: later, not inside UCX's callback.
  c->worker().post([keep] { keep->worker().drop(*keep); });
}

void ucx_worker::conn_cb(ucp_conn_request_h req, void* arg) {
  auto* self = static_cast<ucx_worker*>(arg);
  ucp_conn_request_attr_t a{};
  a.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
  std::string peer = "?";
  if (ucp_conn_request_query(req, &a) == UCS_OK) peer = addr_text(a.client_address);
  // Accepted after this progress call, not inside it: an endpoint is a descriptor made, and no
  // worker may be inside a progress call while one is made (making_descriptors).
  self->conn_requests_.push_back(req);
  self->post([self, req, peer = std::move(peer)]() mutable { self->accept(req, std::move(peer)); });
}

void ucx_worker::accept(ucp_conn_request_h req, std::string peer) {
  // Refused meanwhile (its listener went: close_listener).
  auto it = std::find(conn_requests_.begin(), conn_requests_.end(), req);
  if (it == conn_requests_.end()) return;
  conn_requests_.erase(it);
  if (!accepted_) {  // not listening (stop_listening): refused
    making_descriptors d;
    ucp_listener_reject(listener_, req);
    return;
  }
  auto c = std::make_shared<connection>(*this, peer);
  ucp_ep_params_t p{};
  p.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  p.conn_request = req;
  p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = ep_error_cb;
  p.err_handler.arg = c.get();
  ucp_ep_h ep = nullptr;
  ucs_status_t st = UCS_OK;
  {
    making_descriptors d;
    st = ucp_ep_create(worker_, &p, &ep);
  }
  if (st != UCS_OK) {
    log::warn("net", "{}: cannot accept {}: {}", name_, peer, status_text(st));
    return;
  }
  adopt(ep, c);
  if (accepted_) accepted_(c);
}

bool ucx_worker::close_listener() {
  if (!listener_) return false;
  for (ucp_conn_request_h req : conn_requests_) ucp_listener_reject(listener_, req);  // not accepted yet
  conn_requests_.clear();
  ucp_listener_destroy(listener_);
  listener_ = nullptr;
  return true;
}

std::uint16_t ucx_worker::listen(const std::string& host, std::uint16_t port,
                                 std::function<void(std::shared_ptr<connection>)> accepted) {
  sockaddr_storage ss = make_addr(host, port);
  // The work owns what it uses: it may run after call() gave up waiting for it.
  return call(
      [this, ss, host, port, accepted = std::move(accepted)]() mutable -> std::uint16_t {
        making_descriptors d;
        // A listener kept from an earlier call on the same address (any port asked) serves again.
        // Otherwise one listener per worker: a new one replaces it.
        if (listener_) {
          ucp_listener_attr_t la{};
          la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
          if (ucp_listener_query(listener_, &la) == UCS_OK && (port == 0 || port == port_of(la.sockaddr)) &&
              addr_text(la.sockaddr) == addr_text(make_addr(host, port_of(la.sockaddr)))) {
            accepted_ = std::move(accepted);
            return port_of(la.sockaddr);
          }
          if (close_listener()) forget_closed();
        }
        accepted_ = std::move(accepted);
        ucp_listener_params_t lp{};
        lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
        lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&ss);
        lp.sockaddr.addrlen = ss.ss_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
        lp.conn_handler.cb = conn_cb;
        lp.conn_handler.arg = this;
        check(ucp_listener_create(worker_, &lp, &listener_), "net.listen", fmt::format("{}:{}", host, port));
        ucp_listener_attr_t la{};
        la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
        check(ucp_listener_query(listener_, &la), "net.listen", "ucp_listener_query");
        return port_of(la.sockaddr);
      },
      std::chrono::steady_clock::now() + std::chrono::seconds(10));
}

void ucx_worker::stop_listening() {
  // The listener stays until the worker goes, refusing what comes meanwhile: UCX 1.13 runs a
  // connection request on the listener that accepted its connection, so a listener closed while one
  // it accepted has not sent its request yet (a stranger's, a server's late connect) would have UCX
  // run it on freed memory once it comes. The worker's end takes the listener and its accepted
  // connections together.
  call(
      [this] {
        making_descriptors d;
        for (ucp_conn_request_h req : conn_requests_) ucp_listener_reject(listener_, req);
        conn_requests_.clear();
        accepted_ = nullptr;
      },
      std::chrono::steady_clock::now() + std::chrono::seconds(10));
}

std::shared_ptr<connection> ucx_worker::connect(const std::string& host, std::uint16_t port,
                                                std::chrono::steady_clock::time_point until) {
  sockaddr_storage ss = make_addr(host, port);
  auto c = std::make_shared<connection>(*this, fmt::format("{}:{}", host, port));
  // The work owns what it uses: it may run after call() gave up waiting for it (the caller's
  // deadline passed while the progress thread was busy); then it makes no endpoint.
  auto gave_up = std::make_shared<std::atomic<bool>>(false);
  auto make = [this, ss, c, gave_up]() -> std::shared_ptr<connection> {
          if (gave_up->load()) fail(errc::timeout, "net.connect", c->peer(), "the caller stopped waiting");
          ucp_ep_params_t p{};
          p.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                         UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
          p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
          p.sockaddr.addr = reinterpret_cast<const sockaddr*>(&ss);
          p.sockaddr.addrlen = ss.ss_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
          p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
          p.err_handler.cb = ep_error_cb;
          p.err_handler.arg = c.get();
          ucp_ep_h ep = nullptr;
          {
            making_descriptors d;
            check(ucp_ep_create(worker_, &p, &ep), "net.connect", c->peer());
          }
          return adopt(ep, c);
  };
  // Work posted to this worker (the holder) makes it at once; others hand it to the worker.
  if (owner_.load(std::memory_order_relaxed) == std::this_thread::get_id()) return make();
  try {
    return call(make, until);
  } catch (...) {
    // The work may be running now and make an endpoint no one holds: a close posted after it (the
    // progress thread runs posted work in order) ends whatever it made.
    gave_up->store(true);
    c->close();
    throw;
  }
}

ucs_status_t ucx_worker::am_frame_cb(void* arg, const void*, size_t, void* data, size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<ucx_worker*>(arg);
  connection* c = self->find(param->reply_ep);
  if (!c) return UCS_OK;
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {  // frames are sent eager; anything else is hostile
    c->mark_failed("protocol error: a control frame arrived by rendezvous");
    return UCS_OK;
  }
  try {
    message m = decode({static_cast<const std::byte*>(data), length});
    if (self->frame_) self->frame_(*c, std::move(m));
  } catch (const error& e) {
    log::warn("net", "{}: dropping {}: {}", self->name_, c->peer(), e.what());
    c->mark_failed(std::string("protocol error: ") + e.what());
    c->close();
  }
  return UCS_OK;
}

ucs_status_t ucx_worker::am_reply_cb(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                     const ucp_am_recv_param_t* param) {
  auto* self = static_cast<ucx_worker*>(arg);
  connection* c = self->find(param->reply_ep);
  if (!c) return UCS_OK;
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {  // replies are sent eager; anything else is hostile
    c->mark_failed("protocol error: an inline reply arrived by rendezvous");
    return UCS_OK;
  }
  try {
    message m = decode({static_cast<const std::byte*>(header), header_length});
    if (self->reply_) self->reply_(*c, std::move(m), static_cast<const std::byte*>(data), length);
  } catch (const error& e) {
    log::warn("net", "{}: dropping {}: {}", self->name_, c->peer(), e.what());
    c->mark_failed(std::string("protocol error: ") + e.what());
    c->close();
  }
  return UCS_OK;
}

ucs_status_t ucx_worker::am_data_cb(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                    const ucp_am_recv_param_t* param) {
  auto* self = static_cast<ucx_worker*>(arg);
  auto it = self->conns_.find(param->reply_ep);
  std::shared_ptr<connection> c = it == self->conns_.end() ? nullptr : it->second;
  if (!c || header_length != sizeof(data_header) || !self->sink_) return UCS_OK;
  data_header h;
  std::memcpy(&h, header, sizeof h);
  void* dst = self->sink_(*c, h.request_id, h.offset, length);
  if (!dst) return UCS_OK;  // not wanted (unknown request, out of bounds): dropped
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
    std::memcpy(dst, data, length);
    if (self->data_done_) self->data_done_(*c, h.request_id, h.offset, length, UCS_OK);
    return UCS_OK;
  }
  auto* rc = new recv_ctx{self, c, h.request_id, h.offset, length, &self->data_done_};
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.recv_am = [](void* request, ucs_status_t status, size_t, void* user) {
    auto* r = static_cast<recv_ctx*>(user);
    if (*r->done) (*r->done)(*r->conn, r->rid, r->off, r->len, status);
    delete r;
    ucp_request_free(request);
  };
  p.user_data = rc;
  ucs_status_ptr_t r = ucp_am_recv_data_nbx(self->worker_, data, dst, length, &p);
  if (r == nullptr) {
    if (self->data_done_) self->data_done_(*c, h.request_id, h.offset, length, UCS_OK);
    delete rc;
  } else if (UCS_PTR_IS_ERR(r)) {
    if (self->data_done_) self->data_done_(*c, h.request_id, h.offset, length, UCS_PTR_STATUS(r));
    delete rc;
  }
  return UCS_INPROGRESS;
}

}  // namespace ferry::net
