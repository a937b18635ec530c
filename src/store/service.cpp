#include <ferry/store/root.hpp>
#include <ferry/store/service.hpp>

#include "core/logging.hpp"
#include "net/ucx.hpp"

#include <dirent.h>
#include <openssl/crypto.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <fstream>
#include <map>
#include <random>
#include <thread>

namespace ferry::store {

using namespace ferry::net;
using clk = std::chrono::steady_clock;

namespace {
std::vector<std::uint8_t> random_nonce() {
  std::vector<std::uint8_t> n(nonce_size);
  if (RAND_bytes(n.data(), static_cast<int>(n.size())) != 1)
    fail(errc::internal, "store.nonce", "RAND_bytes", "the OpenSSL random generator failed");
  return n;
}
// HMAC-SHA256(secret, server nonce | client nonce).
std::vector<std::uint8_t> proof(const std::string& secret, const std::vector<std::uint8_t>& server_nonce,
                                const std::vector<std::uint8_t>& client_nonce) {
  std::vector<std::uint8_t> msg(server_nonce);
  msg.insert(msg.end(), client_nonce.begin(), client_nonce.end());
  std::vector<std::uint8_t> mac(EVP_MAX_MD_SIZE);
  unsigned len = 0;
  if (!HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()), msg.data(), msg.size(), mac.data(), &len))
    fail(errc::internal, "store.auth", "HMAC", "HMAC-SHA256 failed");
  mac.resize(len);
  return mac;
}
error_reply to_reply(const error& e) {
  return error_reply{e.sys_errno() ? e.sys_errno() : errno_from_errc(e.code()), printable(e.what(), 1000)};
}
}  // namespace

// ---- server ------------------------------------------------------------------------------------

struct server::impl {
  server_options o;
  root_dir root;
  ucx_worker w;
  std::uint16_t port = 0;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> jobs;
  bool stopping = false;
  std::vector<std::thread> threads;
  std::atomic<std::uint64_t> connections{0}, requests{0}, bytes_sent{0}, errors{0};
  struct session {
    std::atomic<int> outstanding{0};
    bool welcomed = false;
    std::vector<std::uint8_t> client_nonce, server_nonce;  // pending challenge
  };
  std::mutex sess_mu;
  std::map<connection*, std::shared_ptr<session>> sessions;

  explicit impl(server_options opt) : o(std::move(opt)), root(o.root), w("ferry-serve") {
    w.on_frame([this](connection& c, message m) { on_frame(c, std::move(m)); });
    port = w.listen(o.host, o.port, [this](std::shared_ptr<connection> c) {
      connections++;
      {
        std::lock_guard l(sess_mu);
        sessions[c.get()] = std::make_shared<session>();
      }
      // A client that dies or leaves: its session goes; running jobs hold their own reference.
      connection* raw = c.get();
      c->on_failure = [this, raw](const std::string& why) {
        std::lock_guard l(sess_mu);
        sessions.erase(raw);
        log::info("store", "client {} gone: {}", raw->peer(), why);
      };
      log::info("store", "client {} connected", c->peer());
    });
    for (int i = 0; i < o.threads; ++i) threads.emplace_back([this] { work(); });
  }
  ~impl() {
    {
      std::lock_guard l(mu);
      stopping = true;
    }
    cv.notify_all();
    for (auto& t : threads) t.join();
  }
  void work() {
    for (;;) {
      std::function<void()> j;
      {
        std::unique_lock l(mu);
        cv.wait(l, [&] { return stopping || !jobs.empty(); });
        if (stopping) return;
        j = std::move(jobs.front());
        jobs.pop_front();
      }
      j();
    }
  }
  std::shared_ptr<session> session_of(connection& c) {
    std::lock_guard l(sess_mu);
    auto it = sessions.find(&c);
    return it == sessions.end() ? nullptr : it->second;
  }
  void reply_error(connection& c, std::uint64_t rid, const error& e) {
    errors++;
    try {
      c.send_frame({rid, 0, to_reply(e)});
    } catch (...) {
    }
  }
  // Runs on the progress thread: checks, then hands file work to the I/O threads.
  void on_frame(connection& c, message m) {
    auto s = session_of(c);
    if (!s) return;
    auto self = c.shared_from_this();
    std::uint64_t rid = m.request_id;
    if (auto* h = std::get_if<hello>(&m.b)) {
      if (o.secret.empty()) {
        s->welcomed = true;
        c.send_frame({rid, o.max_outstanding, welcome{o.max_outstanding, o.max_request, false}});
      } else {
        s->client_nonce = h->nonce;
        s->server_nonce = random_nonce();
        c.send_frame({rid, 0, challenge{s->server_nonce, true}});
      }
      return;
    }
    if (auto* a = std::get_if<auth>(&m.b)) {
      bool ok = !o.secret.empty() && !s->server_nonce.empty();
      if (ok) {
        auto want = proof(o.secret, s->server_nonce, s->client_nonce);
        ok = want.size() == a->mac.size() && CRYPTO_memcmp(want.data(), a->mac.data(), want.size()) == 0;
      }
      s->server_nonce.clear();  // one answer per challenge
      if (!ok) {
        log::warn("store", "client {} failed to authenticate", c.peer());
        reply_error(c, rid, error(errc::permission_denied, "store.auth", c.peer(), "authentication failed (wrong secret?)"));
        return;
      }
      s->welcomed = true;
      c.send_frame({rid, o.max_outstanding, welcome{o.max_outstanding, o.max_request, false}});
      return;
    }
    if (!s->welcomed) {
      reply_error(c, rid, error(errc::protocol_error, "store.request", c.peer(), "request before the handshake"));
      return;
    }
    if (s->outstanding.load() >= static_cast<int>(o.max_outstanding)) {
      reply_error(c, rid, error(errc::busy, "store.request", c.peer(),
                                fmt::format("more than {} outstanding requests (credits exhausted)", o.max_outstanding)));
      return;
    }
    requests++;
    s->outstanding++;
    auto job = [this, self, s, m = std::move(m)]() mutable {
      try {
        serve(*self, m);
      } catch (const error& e) {
        reply_error(*self, m.request_id, e);
      } catch (const std::exception& e) {
        reply_error(*self, m.request_id, error(errc::internal, "store.request", self->peer(), e.what()));
      }
      s->outstanding--;
    };
    {
      std::lock_guard l(mu);
      jobs.push_back(std::move(job));
    }
    cv.notify_one();
  }
  void serve(connection& c, const message& m) {
    std::uint64_t rid = m.request_id;
    if (auto* r = std::get_if<read_req>(&m.b)) {
      if (r->length > o.max_request)
        fail(errc::out_of_range, "store.read", r->path, fmt::format("request of {} bytes exceeds the limit {}", r->length, o.max_request));
      int fd = root.open(r->path, O_RDONLY);
      struct stat st{};
      ::fstat(fd, &st);
      std::uint64_t size = static_cast<std::uint64_t>(st.st_size);
      std::uint64_t end = std::min<std::uint64_t>(size, r->offset + r->length);
      std::uint64_t total = r->offset < end ? end - r->offset : 0;
      // A few chunks in flight; each buffer is reused once UCX says it was sent.
      const int depth = 4;
      std::vector<std::vector<std::byte>> bufs(depth, std::vector<std::byte>(std::min<std::uint64_t>(o.chunk, std::max<std::uint64_t>(total, 1))));
      std::mutex bm;
      std::condition_variable bcv;
      std::vector<bool> busy(depth, false);
      ucs_status_t send_status = UCS_OK;
      std::uint64_t off = 0;
      int slot = 0;
      auto deadline = clk::now() + std::chrono::minutes(5);
      while (off < total) {
        {
          std::unique_lock l(bm);
          if (!bcv.wait_until(l, deadline, [&] { return !busy[static_cast<std::size_t>(slot)] || !c.alive(); })) break;
          if (!c.alive()) break;
          busy[static_cast<std::size_t>(slot)] = true;
        }
        auto& b = bufs[static_cast<std::size_t>(slot)];
        std::uint64_t n = std::min<std::uint64_t>(b.size(), total - off);
        ssize_t got = ::pread(fd, b.data(), n, static_cast<off_t>(r->offset + off));
        if (got <= 0) {
          int e = got < 0 ? errno : EIO;
          ::close(fd);
          fail_errno(e, "store.read", fmt::format("{} offset {}", r->path, r->offset + off), got == 0 ? "file shrank" : "");
        }
        int my = slot;
        c.send_data(rid, off, b.data(), static_cast<std::size_t>(got), [&, my](ucs_status_t s) {
          std::lock_guard l(bm);
          busy[static_cast<std::size_t>(my)] = false;
          if (s != UCS_OK) send_status = s;
          bcv.notify_all();
        });
        off += static_cast<std::uint64_t>(got);
        bytes_sent += static_cast<std::uint64_t>(got);
        slot = (slot + 1) % depth;
      }
      {
        std::unique_lock l(bm);  // buffers must outlive their sends
        bcv.wait_until(l, deadline, [&] {
          for (bool x : busy)
            if (x) return false;
          return true;
        });
      }
      ::close(fd);
      if (!c.alive()) return;
      c.send_frame({rid, 0, complete{send_status == UCS_OK ? 0 : EIO, off}});
      return;
    }
    if (auto* r = std::get_if<stat_req>(&m.b)) {
      int fd = root.open(r->path, O_RDONLY | O_PATH);
      struct stat st{};
      ::fstat(fd, &st);
      ::close(fd);
      c.send_frame({rid, 0, stat_reply{static_cast<std::uint64_t>(st.st_size), st.st_mode,
                                       static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec}});
      return;
    }
    if (auto* r = std::get_if<list_req>(&m.b)) {
      int fd = root.open(r->path, O_RDONLY | O_DIRECTORY);
      DIR* d = ::fdopendir(fd);
      if (!d) {
        ::close(fd);
        fail_errno(errno, "store.list", r->path);
      }
      list_reply rep;
      std::size_t bytes = 0;
      while (dirent* e = ::readdir(d)) {
        std::string name = e->d_name;
        if (name == "." || name == ".." || name.size() > 255) continue;
        struct stat st{};
        if (::fstatat(::dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
        bytes += 11 + name.size();
        if (bytes > max_message - 64) break;  // one frame's worth
        rep.entries.push_back({name, static_cast<std::uint8_t>(S_ISREG(st.st_mode) ? 0 : S_ISDIR(st.st_mode) ? 1 : 2),
                               static_cast<std::uint64_t>(st.st_size)});
      }
      ::closedir(d);
      c.send_frame({rid, 0, std::move(rep)});
      return;
    }
    if (std::holds_alternative<write_req>(m.b))
      fail(errc::permission_denied, "store.write", c.peer(), "this server is read-only");
    fail(errc::protocol_error, "store.request", c.peer(), "unexpected message type");
  }
};

server::server(server_options o) : impl_(std::make_unique<impl>(std::move(o))) {}
server::~server() = default;
std::uint16_t server::port() const noexcept { return impl_->port; }
server_stats server::stats() const {
  std::lock_guard l(impl_->sess_mu);
  return {impl_->connections.load(), impl_->requests.load(), impl_->bytes_sent.load(), impl_->errors.load(),
          impl_->sessions.size()};
}

// ---- client ------------------------------------------------------------------------------------

struct client::impl {
  ucx_worker w{"ferry-client"};
  std::shared_ptr<connection> c;
  std::string peer;
  std::mutex mu;
  std::condition_variable cv;
  std::uint64_t next_id = 1;
  struct pending {
    std::byte* dst = nullptr;
    std::uint64_t len = 0, received = 0;
    bool completed = false;
    std::uint64_t expect = 0;
    std::optional<message> reply;
    std::optional<error> err;
  };
  std::map<std::uint64_t, std::shared_ptr<pending>> pend;
  welcome hello_reply;
  std::string host;
  std::uint16_t port;
  std::string secret;
  std::atomic<std::uint64_t> reconnects{0};

  impl(const std::string& h, std::uint16_t p, clk::time_point until, std::string sec)
      : peer(fmt::format("{}:{}", h, p)), host(h), port(p), secret(std::move(sec)) {
    w.on_frame([this](connection&, message m) { on_frame(std::move(m)); });
    w.on_data(
        [this](connection&, std::uint64_t rid, std::uint64_t off, std::size_t n) -> void* {
          std::lock_guard l(mu);
          auto it = pend.find(rid);
          if (it == pend.end() || !it->second->dst || off + n > it->second->len) return nullptr;
          return it->second->dst + off;
        },
        [this](connection&, std::uint64_t rid, std::size_t n, ucs_status_t s) {
          std::lock_guard l(mu);
          auto it = pend.find(rid);
          if (it == pend.end()) return;
          if (s != UCS_OK && !it->second->err)
            it->second->err = error(errc::network_error, "store.read", peer, std::string("data receive failed: ") + ucs_status_string(s));
          it->second->received += n;
          cv.notify_all();
        });
    connect(until);
  }
  // (Re)connects and completes the handshake before `until`.
  void connect(clk::time_point until) {
    if (c) c->close();
    c = w.connect(host, port, until);
    c->on_failure = [this](const std::string& why) {
      std::lock_guard l(mu);
      for (auto& [id, p] : pend)
        if (!p->err) p->err = error(errc::network_error, "store.request", peer, "connection lost: " + why);
      cv.notify_all();
    };
    message r;
    auto nonce = random_nonce();
    try {
      r = request({0, 0, hello{1, 1, 64, nonce}}, nullptr, 0, until);
    } catch (const error& e) {
      throw error(error_info{e.code(), "store.connect", peer, "cannot connect to the storage server", e.what(), 0, 0});
    }
    if (auto* ch = std::get_if<challenge>(&r.b)) {
      if (secret.empty())
        fail(errc::permission_denied, "store.connect", peer, "the server requires a shared secret (FERRY_SECRET_FILE)");
      r = request({0, 0, auth{proof(secret, ch->nonce, nonce)}}, nullptr, 0, until);
      if (auto* e = std::get_if<error_reply>(&r.b))
        fail(errc::permission_denied, "store.connect", peer, "authentication refused: " + e->message);
    }
    if (auto* e = std::get_if<error_reply>(&r.b))
      fail(errc::network_error, "store.connect", peer, "refused: " + e->message);
    if (!std::holds_alternative<welcome>(r.b))
      fail(errc::protocol_error, "store.connect", peer, "unexpected answer to the handshake");
    hello_reply = std::get<welcome>(r.b);
  }
  // Runs an idempotent request; after a lost connection (server restarted) it reconnects once and retries.
  template <typename F>
  auto retrying(F f, clk::time_point until) -> decltype(f()) {
    std::optional<error> lost;
    for (int attempt = 0;; ++attempt) {
      try {
        if (!c || !c->alive()) {
          reconnects++;
          try {
            connect(until);
          } catch (const error& re) {
            if (!lost) throw;
            throw error(error_info{errc::network_error, lost->op(), lost->resource(),
                                   "connection lost during the request, and reconnecting failed", re.what(), 0, 0});
          }
        }
        return f();
      } catch (const error& e) {
        if (e.code() != errc::network_error || attempt >= 1 || clk::now() >= until) throw;
        lost = e;
        log::info("store", "{}: {}; reconnecting", peer, e.what());
      }
    }
  }
  ~impl() {
    if (c) c->close();
  }
  void on_frame(message m) {
    std::lock_guard l(mu);
    auto it = pend.find(m.request_id);
    if (it == pend.end()) return;
    if (auto* cp = std::get_if<complete>(&m.b)) {
      it->second->completed = true;
      it->second->expect = cp->bytes;
      if (cp->status != 0 && !it->second->err)
        it->second->err = error(errc::io_error, "store.read", peer, fmt::format("server reported status {}", cp->status));
    }
    it->second->reply = std::move(m);
    cv.notify_all();
  }
  // Sends m (its request id is assigned here) and waits for the reply (and the data, for reads).
  message request(message m, std::byte* dst, std::uint64_t len, clk::time_point until) {
    auto p = std::make_shared<pending>();
    p->dst = dst;
    p->len = len;
    {
      std::lock_guard l(mu);
      m.request_id = next_id++;
      pend[m.request_id] = p;
    }
    std::uint64_t rid = m.request_id;
    struct cleanup {
      impl* s;
      std::uint64_t id;
      ~cleanup() {
        std::lock_guard l(s->mu);
        s->pend.erase(id);
      }
    } cl{this, rid};
    c->send_frame(m);
    std::unique_lock l(mu);
    bool ok = cv.wait_until(l, until, [&] {
      if (p->err) return true;
      if (!p->reply) return false;
      if (std::holds_alternative<error_reply>(p->reply->b)) return true;
      if (dst) return p->completed && p->received >= p->expect;
      return true;
    });
    if (!ok) fail(errc::timeout, "store.request", peer, fmt::format("no answer to request {} before the deadline", rid));
    if (p->err) throw *p->err;
    return *p->reply;
  }
};

client::client(const std::string& host, std::uint16_t port, std::chrono::nanoseconds timeout, std::string secret)
    : impl_(std::make_unique<impl>(host, port, clk::now() + timeout, std::move(secret))) {}

std::string read_secret_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail_errno(errno ? errno : ENOENT, "store.secret", path, "cannot read the secret file");
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  if (s.empty()) fail(errc::invalid_argument, "store.secret", path, "the secret file is empty");
  return s;
}
client::~client() = default;
const std::string& client::peer() const noexcept { return impl_->peer; }

namespace {
[[noreturn]] void rethrow_reply(const error_reply& e, std::string_view op, const std::string& peer, const std::string& path) {
  errc code = errc_from_errno(e.code);
  throw error(error_info{code, std::string(op), fmt::format("{} {}", peer, printable(path)), "the server refused", e.message,
                         e.code, 0});
}
}  // namespace

std::uint64_t client::read(const std::string& path, std::uint64_t offset, void* dst, std::uint64_t length,
                           std::chrono::nanoseconds timeout) {
  auto until = clk::now() + timeout;
  message r = impl_->retrying(
      [&] { return impl_->request({0, 0, read_req{path, offset, length}}, static_cast<std::byte*>(dst), length, until); }, until);
  if (auto* e = std::get_if<error_reply>(&r.b)) rethrow_reply(*e, "store.read", impl_->peer, path);
  return std::get<complete>(r.b).bytes;
}

stat_reply client::stat(const std::string& path, std::chrono::nanoseconds timeout) {
  auto until = clk::now() + timeout;
  message r = impl_->retrying([&] { return impl_->request({0, 0, stat_req{path}}, nullptr, 0, until); }, until);
  if (auto* e = std::get_if<error_reply>(&r.b)) rethrow_reply(*e, "store.stat", impl_->peer, path);
  return std::get<stat_reply>(r.b);
}

std::vector<list_entry> client::list(const std::string& path, std::chrono::nanoseconds timeout) {
  auto until = clk::now() + timeout;
  message r = impl_->retrying([&] { return impl_->request({0, 0, list_req{path}}, nullptr, 0, until); }, until);
  if (auto* e = std::get_if<error_reply>(&r.b)) rethrow_reply(*e, "store.list", impl_->peer, path);
  return std::get<list_reply>(r.b).entries;
}

}  // namespace ferry::store
