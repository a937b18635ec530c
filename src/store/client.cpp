// The ferry:// client: requests split into pieces (one wire request and one credit each), replies
// matched by request id on the progress thread, staged pieces moved on by a stager thread, every
// wait bounded by the request's deadline.
#include <ferry/mem/pinned_pool.hpp>
#include <ferry/mem/registration.hpp>
#include <ferry/store/service.hpp>
#include <ferry/xfer/engine.hpp>

#include "core/logging.hpp"
#include "net/ucx.hpp"
#include "store/auth.hpp"

#include <fmt/format.h>

#include <condition_variable>
#include <deque>
#include <fstream>
#include <map>
#include <thread>

namespace ferry::store {

using namespace ferry::net;
using clk = std::chrono::steady_clock;

namespace {
[[noreturn]] void rethrow_reply(const error_reply& e, std::string_view op, const std::string& peer, const std::string& path) {
  errc code = errc_from_errno(e.code);
  throw error(error_info{code, std::string(op), fmt::format("{} {}", peer, printable(path)), "the server refused", e.message,
                         e.code, 0});
}
}  // namespace

struct client::impl {
  // One wire request.
  struct piece {
    std::uint64_t rid = 0;
    connection* conn = nullptr;
    bool write = false;
    std::byte* land = nullptr;       // where read data lands (the destination or a staging buffer)
    std::uint64_t len = 0;
    std::byte* final_dst = nullptr;  // staged reads: copied here by the stager
    pinned_pool::buffer slot;
    std::uint64_t received = 0, expect = 0;
    bool replied = false, settled = false, credit = false;
    std::optional<message> reply;
    std::optional<error> err;
    std::atomic<bool> done{false};
  };
  struct op {
    std::string path;
    bool write = false;
    std::uint64_t offset = 0, length = 0;
    clk::time_point until;
    std::vector<std::shared_ptr<piece>> pieces;
  };

  client_options o;
  std::string host;
  std::uint16_t port;
  std::string peer;
  std::mutex mu;
  std::condition_variable cv;
  std::uint64_t next_id = 1;
  std::map<std::uint64_t, std::shared_ptr<piece>> pend;  // by request id, until settled
  std::map<ticket, op> ops;
  ticket next_ticket = 1;
  std::uint32_t credits = 1, inflight = 0;
  welcome hello_reply;
  std::atomic<std::uint64_t> n_requests{0}, n_pieces{0}, n_read{0}, n_written{0}, n_staged{0}, n_reconnects{0};

  // Staging for GPU/sim memory and the thread that moves staged pieces on.
  std::unique_ptr<pinned_pool> staging;
  std::mutex stage_mu;
  std::condition_variable stage_cv;
  std::deque<std::shared_ptr<piece>> stage_q;
  bool stage_stop = false;
  std::thread stager;

  ucx_worker w;  // last: its progress thread (and callbacks) stop before the rest goes
  std::shared_ptr<connection> c;

  impl(const std::string& h, std::uint16_t p, client_options opt)
      : o(std::move(opt)), host(h), port(p), peer(fmt::format("{}:{}", h, p)), w("ferry-client", o.spin) {
    expects(o.piece >= 4096 && o.piece <= max_data, "store.client", peer,
            fmt::format("piece size {} must be between 4KiB and {}", o.piece, max_data));
    w.on_frame([this](connection& cn, message m) { on_frame(cn, std::move(m)); });
    w.on_reply([this](connection& cn, message m, const std::byte* d, std::size_t n) { on_inline(cn, std::move(m), d, n); });
    w.on_data(
        [this](connection&, std::uint64_t rid, std::uint64_t off, std::size_t n) -> void* {
          std::lock_guard l(mu);
          auto it = pend.find(rid);
          if (it == pend.end() || !it->second->land || it->second->write || off > it->second->len ||
              n > it->second->len - off)
            return nullptr;
          return it->second->land + off;
        },
        [this](connection&, std::uint64_t rid, std::uint64_t, std::size_t n, ucs_status_t s) {
          std::lock_guard l(mu);
          auto it = pend.find(rid);
          if (it == pend.end()) return;
          auto pp = it->second;
          if (s != UCS_OK && !pp->err)
            pp->err = error(errc::network_error, "store.read", peer, std::string("data receive failed: ") + ucs_status_string(s));
          pp->received += n;
          maybe_settle(pp);
        });
    connect(clk::now() + o.timeout);
  }
  ~impl() {
    if (c) c->close();
    {
      std::lock_guard l(stage_mu);
      stage_stop = true;
    }
    stage_cv.notify_all();
    if (stager.joinable()) stager.join();
  }

  // ---- progress thread ----
  // A piece is finished when its reply came and all its data arrived, or when it failed. Called with mu held.
  void maybe_settle(const std::shared_ptr<piece>& pp) {
    piece& p = *pp;
    if (p.settled) return;
    bool ready = p.err || (p.replied && (!p.reply || !std::holds_alternative<complete>(p.reply->b) || p.write ||
                                         p.received >= p.expect));
    if (!ready) return;
    p.settled = true;
    auto keep = pp;  // pp may be the map's own reference
    pend.erase(p.rid);
    if (p.credit) {
      p.credit = false;
      inflight--;
    }
    if (!p.err && !p.write && p.final_dst && p.received) {
      std::lock_guard l(stage_mu);
      stage_q.push_back(pp);
      stage_cv.notify_one();
      return;
    }
    p.slot.reset();
    p.done.store(true, std::memory_order_release);
    cv.notify_all();
  }

  void on_frame(connection&, message m) {
    std::lock_guard l(mu);
    auto it = pend.find(m.request_id);
    if (it == pend.end()) return;
    auto pp = it->second;
    auto& p = *pp;
    if (auto* cp = std::get_if<complete>(&m.b)) {
      p.expect = cp->bytes;
      if (cp->status != 0 && !p.err)
        p.err = error(errc::io_error, p.write ? "store.write" : "store.read", peer, fmt::format("server reported status {}", cp->status));
      if (!p.err && cp->bytes > p.len)
        p.err = error(errc::protocol_error, "store.request", peer, fmt::format("the server claims {} bytes for a {}-byte request", cp->bytes, p.len));
    }
    p.replied = true;
    p.reply = std::move(m);
    maybe_settle(pp);
  }
  void on_inline(connection&, message m, const std::byte* d, std::size_t n) {
    std::lock_guard l(mu);
    auto it = pend.find(m.request_id);
    if (it == pend.end()) return;
    auto pp = it->second;
    auto& p = *pp;
    auto* cp = std::get_if<complete>(&m.b);
    if (!cp || p.write || cp->bytes != n || n > p.len || (n && !p.land)) {
      if (!p.err) p.err = error(errc::protocol_error, "store.read", peer, "malformed inline reply");
    } else if (n) {
      std::memcpy(p.land, d, n);
      p.received = n;
    }
    p.expect = n;
    p.replied = true;
    p.reply = std::move(m);
    maybe_settle(pp);
  }
  void conn_failed(connection* cn, const std::string& why) {
    std::lock_guard l(mu);
    std::vector<std::shared_ptr<piece>> hit;
    for (auto& [id, p] : pend)
      if (p->conn == cn) hit.push_back(p);
    for (auto& p : hit) {
      if (!p->err) p->err = error(errc::network_error, "store.request", peer, "connection lost: " + why);
      maybe_settle(p);
    }
    cv.notify_all();
  }

  // ---- stager: staged read pieces -> their destination through the transfer engine ----
  void stage_loop() {
    for (;;) {
      std::shared_ptr<piece> p;
      {
        std::unique_lock l(stage_mu);
        stage_cv.wait(l, [&] { return stage_stop || !stage_q.empty(); });
        if (stage_q.empty()) return;
        p = std::move(stage_q.front());
        stage_q.pop_front();
      }
      std::optional<error> err;
      try {
        o.engine->copy(p->final_dst, p->slot.data(), p->received);
        n_staged += p->received;
      } catch (const error& e) {
        err = e;
      }
      std::lock_guard l(mu);
      if (err) p->err = err;
      p->slot.reset();
      p->done.store(true, std::memory_order_release);
      cv.notify_all();
    }
  }

  // ---- caller threads ----
  // Registers a piece and sends its frame. `until` bounds the wait for a credit.
  std::shared_ptr<piece> send(message m, std::shared_ptr<piece> p, bool needs_credit, clk::time_point until) {
    std::unique_lock l(mu);
    if (needs_credit) {
      if (!cv.wait_until(l, until, [&] { return inflight < credits; }))
        fail(errc::timeout, "store.request", peer, fmt::format("no credit from the server before the deadline ({} requests outstanding)", inflight));
      inflight++;
      p->credit = true;
    }
    p->rid = m.request_id = next_id++;
    p->conn = c.get();
    pend[p->rid] = p;
    n_pieces++;
    l.unlock();
    try {
      c->send_frame(m);
    } catch (const error& e) {
      std::lock_guard g(mu);
      if (!p->err) p->err = e;
      maybe_settle(p);
    }
    return p;
  }
  // Waits for one piece until `until`; on timeout closes the connection so that nothing lands later.
  void wait_piece(piece& p, clk::time_point until, std::string_view what) {
    // Drive the worker from this thread for a while: a small request then completes without any
    // thread hand-off (the progress thread takes over if this one gives up and sleeps).
    auto spin_end = clk::now() + o.spin;
    while (!p.done.load(std::memory_order_acquire) && clk::now() < spin_end) w.try_progress();
    std::unique_lock l(mu);
    if (cv.wait_until(l, until, [&] { return p.done.load(); })) return;
    l.unlock();
    log::warn("store", "{}: {} timed out; closing the connection", peer, what);
    auto cn = c;
    if (cn) {
      cn->close();
      try {
        w.call([] {}, clk::now() + std::chrono::seconds(5));  // the close has run: no more data lands
      } catch (...) {
      }
    }
    l.lock();
    cv.wait_until(l, clk::now() + std::chrono::seconds(5), [&] { return p.done.load(); });
    fail(errc::timeout, "store.request", peer, fmt::format("{}: no answer before the deadline", what));
  }
  message request(message m, clk::time_point until, bool needs_credit = true) {
    auto p = send(std::move(m), std::make_shared<piece>(), needs_credit, until);
    wait_piece(*p, until, "request");
    if (p->err) throw *p->err;
    return *p->reply;
  }

  void ensure_connected(clk::time_point until) {
    if (c && c->alive()) return;
    n_reconnects++;
    connect(until);
  }
  // (Re)connects and completes the handshake before `until`.
  void connect(clk::time_point until) {
    if (c) c->close();
    auto cn = w.connect(host, port, until);
    connection* raw = cn.get();
    cn->on_failure = [this, raw](const std::string& why) { conn_failed(raw, why); };
    {
      std::lock_guard l(mu);
      c = cn;
    }
    message r;
    auto nonce = detail::random_nonce();
    try {
      r = request({0, 0, hello{1, 1, 64, nonce}}, until, false);
    } catch (const error& e) {
      throw error(error_info{e.code(), "store.connect", peer, "cannot connect to the storage server", e.what(), 0, 0});
    }
    if (auto* ch = std::get_if<challenge>(&r.b)) {
      if (o.secret.empty())
        fail(errc::permission_denied, "store.connect", peer, "the server requires a shared secret (FERRY_SECRET_FILE)");
      r = request({0, 0, auth{detail::proof(o.secret, ch->nonce, nonce)}}, until, false);
      if (auto* e = std::get_if<error_reply>(&r.b))
        fail(errc::permission_denied, "store.connect", peer, "authentication refused: " + e->message);
    }
    if (auto* e = std::get_if<error_reply>(&r.b)) fail(errc::network_error, "store.connect", peer, "refused: " + e->message);
    if (!std::holds_alternative<welcome>(r.b)) fail(errc::protocol_error, "store.connect", peer, "unexpected answer to the handshake");
    std::lock_guard l(mu);
    hello_reply = std::get<welcome>(r.b);
    credits = std::max<std::uint32_t>(1, hello_reply.credits);
    inflight = 0;
    for (auto& [id, p] : pend)
      if (p->credit && p->conn == raw) inflight++;
    cv.notify_all();
  }

  // Does [p, p+n) need host staging (GPU or sim memory UCX cannot reach)?
  bool needs_staging(const void* p, std::uint64_t n, const char* what) {
    if (!o.cache || n == 0) return false;
    memory_region r = o.cache->classify(p, n);
    if (r.type == memory_type::unknown)
      fail(errc::bad_address, what, fmt::format("{}+{}", p, n), "not memory ferry knows (freed, or never mapped?)");
    if (r.type != memory_type::device) return false;
    if (w.cuda_memory() && r.owner.starts_with("cuda")) return false;  // UCX registers it itself
    if (!o.engine) fail(errc::invalid_argument, what, r.owner, "device memory needs a transfer engine for staging (client_options::engine)");
    std::lock_guard l(stage_mu);
    if (!staging) {
      int count = static_cast<int>(std::max<std::uint64_t>(2, o.staging / o.piece));
      staging = std::make_unique<pinned_pool>(*o.cache, o.piece, count, -1);
      stager = std::thread([this] { stage_loop(); });
    }
    return true;
  }

  ticket start(const std::string& path, std::uint64_t offset, std::byte* mem, std::uint64_t length, bool write,
               clk::time_point until) {
    const char* opname = write ? "store.write" : "store.read";
    if (length && !mem) fail(errc::invalid_argument, opname, path, "null buffer");
    if (offset + length < offset) fail(errc::invalid_argument, opname, path, "offset + length overflows");
    bool staged = needs_staging(mem, length, opname);
    ensure_connected(until);
    if (write && !hello_reply.writable)
      fail(errc::permission_denied, opname, fmt::format("{} {}", peer, printable(path)), "the server is read-only");
    n_requests++;
    op o2{path, write, offset, length, until, {}};
    try {
      std::uint64_t off = 0;
      do {
        std::uint64_t n = std::min<std::uint64_t>(o.piece, length - off);
        auto p = std::make_shared<piece>();
        p->write = write;
        p->len = n;
        if (staged) {
          p->slot = staging->get(until);
          if (write) o.engine->copy(p->slot.data(), mem + off, n);
          else p->final_dst = mem + off;
          p->land = p->slot.data();
        } else {
          p->land = mem ? mem + off : nullptr;
        }
        message m{0, 0, write ? body{write_req{path, offset + off, n}} : body{read_req{path, offset + off, n}}};
        p = send(std::move(m), std::move(p), true, until);
        o2.pieces.push_back(p);
        if (write && n) {
          // Data follows the frame in messages of at most max_data (the server's limit).
          for (std::uint64_t d = 0; d < n; d += max_data) {
            std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(max_data, n - d));
            auto pp = p;
            c->send_data(p->rid, d, p->land + d, k, [this, pp](ucs_status_t s) {
              if (s == UCS_OK) return;
              std::lock_guard l(mu);
              if (!pp->err) pp->err = error(errc::network_error, "store.write", peer, std::string("data send failed: ") + ucs_status_string(s));
              maybe_settle(pp);
            });
          }
        }
        off += n;
      } while (off < length);
    } catch (...) {
      // Pieces already on the wire may still land: wait for them (bounded) before the buffer is given back.
      for (auto& p : o2.pieces) {
        try {
          wait_piece(*p, until, "request");
        } catch (...) {
        }
      }
      throw;
    }
    std::lock_guard l(mu);
    ticket t = next_ticket++;
    ops.emplace(t, std::move(o2));
    return t;
  }

  std::uint64_t finish(ticket t) {
    op x;
    {
      std::lock_guard l(mu);
      auto it = ops.find(t);
      if (it == ops.end()) fail(errc::invalid_argument, "store.finish", fmt::format("ticket {}", t), "unknown or already finished");
      x = std::move(it->second);
      ops.erase(it);
    }
    const char* opname = x.write ? "store.write" : "store.read";
    std::optional<error> first;
    for (auto& p : x.pieces) {
      try {
        wait_piece(*p, x.until, fmt::format("{} {} offset {}", opname, printable(x.path), x.offset));
      } catch (const error& e) {
        if (!first) first = e;
      }
    }
    if (first) throw *first;
    std::uint64_t total = 0;
    for (auto& p : x.pieces) {
      if (p->err) {
        if (p->err->code() == errc::network_error || p->err->code() == errc::timeout) throw *p->err;
        throw error(error_info{p->err->code(), opname, fmt::format("{} {}", peer, printable(x.path)), "", p->err->what(), 0, 0});
      }
      if (auto* e = std::get_if<error_reply>(&p->reply->b)) rethrow_reply(*e, opname, peer, x.path);
      auto bytes = std::get<complete>(p->reply->b).bytes;
      total += bytes;
      if (x.write && bytes != p->len)
        fail(errc::io_error, opname, fmt::format("{} {}", peer, printable(x.path)), fmt::format("the server wrote {} of {} bytes", bytes, p->len));
    }
    (x.write ? n_written : n_read) += total;
    return total;
  }

  // A request without data (stat, list), retried after a reconnect; a refusal is rethrown naming the path.
  message query(message m, std::string_view what, const std::string& path, std::chrono::nanoseconds timeout) {
    auto until = clk::now() + timeout;
    message r = retrying(
        [&] {
          ensure_connected(until);
          return request(m, until);
        },
        until);
    if (auto* e = std::get_if<error_reply>(&r.b)) rethrow_reply(*e, what, peer, path);
    return r;
  }

  // Runs an idempotent request; after a lost connection (server restarted) it reconnects once and retries.
  template <typename F>
  auto retrying(F f, clk::time_point until) -> decltype(f()) {
    std::optional<error> lost;
    for (int attempt = 0;; ++attempt) {
      try {
        return f();
      } catch (const error& e) {
        bool retry = e.code() == errc::network_error && attempt == 0 && clk::now() < until;
        if (!retry) {
          if (lost && e.op() == "store.connect")
            throw error(error_info{errc::network_error, lost->op(), lost->resource(),
                                   "connection lost during the request, and reconnecting failed", e.what(), 0, 0});
          throw;
        }
        lost = e;
        log::info("store", "{}: {}; reconnecting", peer, e.what());
      }
    }
  }
};

client::client(const std::string& host, std::uint16_t port, std::chrono::nanoseconds timeout, std::string secret)
    : client(host, port, client_options{timeout, std::move(secret)}) {}
client::client(const std::string& host, std::uint16_t port, client_options o)
    : impl_(std::make_unique<impl>(host, port, std::move(o))) {}
client::~client() = default;
const std::string& client::peer() const noexcept { return impl_->peer; }
bool client::writable() const noexcept { return impl_->hello_reply.writable; }

client::ticket client::start_read(const std::string& path, std::uint64_t offset, void* dst, std::uint64_t length,
                                  clk::time_point until) {
  return impl_->start(path, offset, static_cast<std::byte*>(dst), length, false, until);
}
client::ticket client::start_write(const std::string& path, std::uint64_t offset, const void* src, std::uint64_t length,
                                   clk::time_point until) {
  // The buffer is only read (sent), never written.
  return impl_->start(path, offset, static_cast<std::byte*>(const_cast<void*>(src)), length, true, until);
}
std::uint64_t client::finish(ticket t) { return impl_->finish(t); }

std::uint64_t client::read(const std::string& path, std::uint64_t offset, void* dst, std::uint64_t length,
                           std::chrono::nanoseconds timeout) {
  auto until = clk::now() + timeout;
  return impl_->retrying([&] { return finish(start_read(path, offset, dst, length, until)); }, until);
}

void client::write(const std::string& path, std::uint64_t offset, const void* src, std::uint64_t length,
                   std::chrono::nanoseconds timeout) {
  auto until = clk::now() + timeout;
  impl_->retrying([&] { return finish(start_write(path, offset, src, length, until)); }, until);
}

stat_reply client::stat(const std::string& path, std::chrono::nanoseconds timeout) {
  return std::get<stat_reply>(impl_->query({0, 0, stat_req{path}}, "store.stat", path, timeout).b);
}

std::vector<list_entry> client::list(const std::string& path, std::chrono::nanoseconds timeout) {
  return std::get<list_reply>(impl_->query({0, 0, list_req{path}}, "store.list", path, timeout).b).entries;
}

client_stats client::stats() const {
  auto& i = *impl_;
  client_stats s{i.n_requests.load(), i.n_pieces.load(), i.n_read.load(), i.n_written.load(), i.n_staged.load(),
                 i.n_reconnects.load(), i.w.wakeups(), i.w.cuda_memory(), "", "active messages (rendezvous above the eager limit)"};
  std::shared_ptr<connection> cn;
  {
    std::lock_guard l(i.mu);
    cn = i.c;
  }
  try {
    s.transports = cn && cn->alive() ? cn->transports() : "not connected";
  } catch (const error&) {
    s.transports = "?";
  }
  return s;
}

std::string read_secret_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail_errno(errno ? errno : ENOENT, "store.secret", path, "cannot read the secret file");
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  if (s.empty()) fail(errc::invalid_argument, "store.secret", path, "the secret file is empty");
  return s;
}

client_options client_options_from(const settings& s, registration_cache* cache, transfer_engine* engine) {
  client_options o;
  o.timeout = s.deadline;
  if (!s.secret_file.empty()) o.secret = read_secret_file(s.secret_file);
  o.cache = cache;
  o.engine = engine;
  o.piece = s.net_piece;
  o.staging = s.net_staging;
  o.spin = s.net_spin;
  return o;
}

}  // namespace ferry::store
