// The storage server: a door (store/door.hpp: its TCP port, where clients authenticate), a few UCX
// workers (progress threads) for the protocol -- after a client authenticated, they connect to its
// lanes, spread over the workers, so several clients' (or one client's lanes') messages are handled
// in parallel -- and the runtime's file engine (the io layer: io_uring, its
// O_DIRECT policy and size checks, its threads, shared with the rest of the process) for file data.
// Small reads are served inline on the progress thread (one reply message); larger reads and all
// writes are requests of the file engine whose completions carry the work on (send, answer, next
// chunk): no thread of the server waits for a file. A same-host client may lend shared memory (a
// sealed memfd passed on the lending socket, store/lending.hpp): reads and writes into it are then
// one file request, no data message. Every per-connection resource lives in the session, which goes
// when the connection does; buffers UCX may still write into are owned by the in-flight table until
// UCX reports the receive finished (or failed).
//
// The parts (store/server/): core.hpp -- what they share (options, files, counters, sessions, file
// requests in flight, replies); reads.hpp and writes.hpp -- the read and write paths; open_files.hpp,
// write_txn.hpp, buffers.hpp. This file: admission (the door's tickets, the lanes' connections),
// sessions, the janitor and the message handlers that hand each request to its path.
#include <ferry/io/file_engine.hpp>
#include <ferry/io/mapped_file.hpp>
#include <ferry/store/root.hpp>
#include <ferry/store/server.hpp>

#include "core/logging.hpp"
#include "net/ucx.hpp"
#include "store/auth.hpp"
#include "store/door.hpp"
#include "store/lending.hpp"
#include "store/server/core.hpp"
#include "store/server/lent_files.hpp"
#include "store/server/reads.hpp"
#include "store/server/writes.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <time.h>
#include <unistd.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <future>
#include <optional>
#include <map>
#include <thread>
#include <unordered_map>

namespace ferry::store {

using namespace ferry::net;
using ferry::store::detail::lending_socket;
using ferry::store::detail::lent_region;
using ferry::store::detail::lent_mapping;
using namespace ferry::store::detail;
using clk = std::chrono::steady_clock;


namespace {
// The host part of "host:port".
std::string host_of(const std::string& peer) {
  auto colon = peer.rfind(':');
  return colon == std::string::npos ? peer : peer.substr(0, colon);
}
// Each connection costs descriptors (its sockets, UCX's); a server at the soft limit would refuse
// everyone, so it runs at the hard limit, and max_connections bounds what clients may take.
void raise_descriptor_limit() {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) == 0 && r.rlim_cur < r.rlim_max) {
    r.rlim_cur = r.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &r);
  }
}
}  // namespace

struct server::impl {
  server_core core;
  std::mutex sess_mu;
  std::map<connection*, std::shared_ptr<session>> sessions;
  std::map<std::vector<std::uint8_t>, std::weak_ptr<session>> by_token;  // welcomed sessions, for the lending socket
  // Where same-host clients pass the regions they lend (null: none, FERRY_NET_MAP=0); served by the
  // janitor thread. Bytes mapped from all clients together are bounded (address space).
  detail::file_lender lender{core.root};  // the files lent to same-host clients (lend_file)
  std::unique_ptr<lending_socket> lending;
  detail::lent_totals lent_total;
  static constexpr std::uint64_t max_lent_bytes = 1ull << 45, max_lent_regions = 16384;
  detail::lent_maps lent_maps;
  // Resident regions newly mapped, whose page-table entries the janitor makes ahead of the copies
  // into them, a slice at a time between its other work (populate_mu).
  std::mutex populate_mu;
  std::deque<std::weak_ptr<lent_mapping>> to_populate;
  static constexpr std::uint64_t populate_slice = 16ull << 20;  // each holds the mapping lock, briefly
  write_path writes{core};
  read_path reads{core, writes};
  std::atomic<std::size_t> rotation{0};     // where the next client's lanes start among the workers
  std::unique_ptr<std::atomic<std::uint64_t>[]> per_worker;  // connections each worker took
  std::uint16_t port = 0;
  std::thread janitor_thread;  // closes connections past their handshake or idle time
  std::vector<std::unique_ptr<ucx_worker>> workers;  // stopped after the door
  std::unique_ptr<detail::door> front;               // last: stopped first (no new client meanwhile)

  impl(file_engine& engine, server_options opt) : core(engine, std::move(opt)) {
    if (core.o.writable && core.o.secret.empty() && !core.o.insecure)
      fail(errc::permission_denied, "store.serve", core.o.root,
           "refusing to serve writable without a shared secret (give a secret file, or --insecure to let anyone write)");
    expects(core.o.chunk > 0 && core.o.max_outstanding > 0 && core.o.workers > 0, "store.serve", core.o.root,
            "chunk, credits and workers must be positive");
    auto ctx = std::make_shared<ucx_context>(interface_for(core.o.host, true));
    for (int i = 0; i < core.o.workers; ++i) {
      auto& w = *workers.emplace_back(std::make_unique<ucx_worker>(fmt::format("ferry-serve-{}", i), core.o.spin, ctx));
      w.on_frame([this](connection& c, message m) { on_frame(c, std::move(m)); });
      w.on_data([this](connection& c, std::uint64_t rid, std::uint64_t off, std::size_t n) { return writes.data_sink(c, rid, off, n); },
                [this](connection& c, std::uint64_t rid, std::uint64_t off, std::size_t n, ucs_status_t st) {
                  writes.data_done(c, rid, off, n, st);
                });
    }
    per_worker = std::make_unique<std::atomic<std::uint64_t>[]>(workers.size());
    core.counts = std::make_unique<worker_counts[]>(workers.size());
    auto nonce = detail::random_nonce();
    std::memcpy(&core.instance, nonce.data(), sizeof core.instance);
    raise_descriptor_limit();
    detail::door_limits lim;
    lim.max_waiting = core.o.max_unauthenticated;
    lim.deadline = core.o.handshake_timeout;
    lim.auth_rate = core.o.auth_rate;
    lim.auth_failures = core.o.auth_failures;
    lim.secret = core.o.secret;
    front = std::make_unique<detail::door>(core.o.host, core.o.port, std::move(lim),
                                           [this](const std::string& host, const std::string& peer, const std::vector<std::uint16_t>& lanes) {
                                             return issue(host, peer, lanes);
                                           });
    port = front->port();
    // Last: a constructor that threw above leaves no running thread behind.
    if (core.o.map) {
      try {
        lending_socket::open_fn files;
        if (core.o.files)
          files = [this](std::span<const std::uint8_t> token, const std::string& path, std::int64_t uid, lending_socket::answer_fn answer) {
            lend_file(token, path, uid, std::move(answer));
          };
        lending = std::make_unique<lending_socket>(
            core.instance,
            [this](std::span<const std::uint8_t> token, std::uint64_t id, int fd, std::int64_t pid) { return take_passed(token, id, fd, pid); },
            std::move(files));
      } catch (const error& e) {
        log::warn("store", "no lending socket ({}); same-host clients move data by messages", e.what());
      }
    }
    // Dedicated, not the executor's: it must run when the server's other threads are stuck on a client.
    janitor_thread = std::thread([this] { janitor(); });
  }
  // A descriptor passed on the lending socket: kept for the live session the token names, until a
  // `lend` on that session names it. Janitor thread.
  bool take_passed(std::span<const std::uint8_t> token, std::uint64_t id, int fd, std::int64_t pid) {
    std::lock_guard l(sess_mu);
    auto it = by_token.find(std::vector<std::uint8_t>(token.begin(), token.end()));
    auto s = it == by_token.end() ? nullptr : it->second.lock();
    if (!s || s->closing || s->passed.size() >= max_lent) {
      ::close(fd);
      return false;
    }
    s->passed.push_back({id, fd, pid});
    return true;
  }
  // A file a same-host client asked for on the lending socket, for a live session the token names
  // (checked here, on the janitor's thread); the lender opens it. The client then reads it itself,
  // and what it could read through the server is all that descriptor gives it.
  void lend_file(std::span<const std::uint8_t> token, const std::string& path, std::int64_t uid, lending_socket::answer_fn answer) {
    {
      std::lock_guard l(sess_mu);
      auto it = by_token.find(std::vector<std::uint8_t>(token.begin(), token.end()));
      auto s = it == by_token.end() ? nullptr : it->second.lock();
      if (!s || s->closing) return answer(-1, "no live session of this server has that token");
    }
    lender.open(path, uid, std::move(answer));
  }
  // No new client or request from here on; waits up to `wait` for the file requests in flight (their
  // completions use this server). Returns how many are still in the file system.
  std::size_t stop(std::chrono::nanoseconds wait) {
    front.reset();
    {
      std::lock_guard l(core.mu);
      core.stopping = true;
    }
    cv_janitor.notify_all();
    if (lending) lending->wake();
    if (janitor_thread.joinable()) janitor_thread.join();
    std::unique_lock l(core.mu);
    core.io_cv.wait_for(l, wait, [&] { return core.io_in_flight.load() == 0; });
    return static_cast<std::size_t>(core.io_in_flight.load());
  }
  ~impl() {
    // File requests end by their deadline, or when their file system answers: one that never does
    // keeps its buffer (the kernel may still write into it), and so this server.
    while (std::size_t left = stop(std::chrono::seconds(10)))
      log::error("store", "core.stopping: {} file requests still in the file system", left);
    // Sessions go while the workers still run, each on its connection's worker, as a client's leaving
    // does (on_failure): frame handlers there use the session by plain pointer. The release clears the
    // connection's pointer, so later frames are dropped; a session whose connection is gone has no
    // handler left and goes here.
    std::map<connection*, std::shared_ptr<session>> gone;
    {
      std::lock_guard l(sess_mu);
      gone.swap(sessions);
      by_token.clear();
    }
    // (post may throw only for want of memory, which ends the process here: a destructor.)
    for (auto& [raw, s] : gone) {
      if (auto c = s->conn.lock()) {
        c->worker().post([c, s = std::move(s)]() mutable {
          c->user = nullptr;
          s.reset();
        });
      }
    }
    gone.clear();
  }
  // Closes a session's connection (its session goes when the close is seen). sess_mu held.
  void close_locked(session& s, const std::string& why) {
    if (s.closing) return;
    s.closing = true;
    if (auto c = s.conn.lock()) {
      log::info("store", "closing client {}: {}", c->peer(), why);
      c->close();
    }
  }
  // A connection to a client's lane, made for the door's ticket: its session (the client's hello
  // must present that ticket), and its end when the connection goes.
  void adopt_session(const std::shared_ptr<connection>& c, const std::vector<std::uint8_t>& ticket) {
    core.connections++;
    std::size_t wi = 0;
    for (std::size_t i = 0; i < workers.size(); ++i)
      if (workers[i].get() == &c->worker()) per_worker[wi = i]++;
    {
      std::lock_guard l(sess_mu);
      auto& s = sessions[c.get()];
      s = std::make_shared<session>();
      s->counts = &core.counts[wi];
      s->conn = c;
      s->peer_addr = host_of(c->peer());
      s->since = clk::now();
      s->last = coarse_now().time_since_epoch().count();
      s->ticket = ticket;
      c->user = s.get();  // for session_of (the map keeps it; cleared when it goes)
    }
    // A client that dies or leaves: its session goes; running jobs hold their own reference.
    connection* raw = c.get();
    c->on_failure([this, raw](const std::string& why) {
      std::shared_ptr<session> s;
      {
        std::lock_guard l(sess_mu);
        auto it = sessions.find(raw);
        if (it != sessions.end()) s = std::move(it->second), sessions.erase(it);
        if (s && !s->token.empty()) by_token.erase(s->token);
      }
      raw->user = nullptr;  // runs where the connection's frames are handled (the worker's holder)
      if (s) writes.drop_owned(s.get());  // its open writes go: their targets stay as they were
      // Freed only after the handler that may be running returns (a send from it can be what
      // failed): frame handlers use the session by plain pointer.
      if (s) raw->worker().post([s = std::move(s)] {});
      log::info("store", "client {} gone: {}", raw->peer(), why);
    });
    log::info("store", "client {} connected on {}", c->peer(), c->worker().name());
  }
  // For a client the door admitted: a ticket, and a connection from a worker to each of the ports its
  // lanes listen on (rotated over the workers so that all clients' lanes spread evenly), each told the
  // ticket first. A lane that cannot be reached is left out: the client's lane waits for it in vain and
  // knocks again. Door thread (the connections are made on the workers' threads).
  welcome issue(const std::string& host, const std::string& peer, const std::vector<std::uint16_t>& lanes) {
    {
      std::lock_guard l(sess_mu);
      std::size_t live = 0;
      for (auto& [k, x] : sessions) live += !x->closing;
      if (live + lanes.size() > static_cast<std::size_t>(core.o.max_connections)) {
        if (core.refused++ % 1000 == 0) log::warn("store", "refusing {}: {} core.connections (FERRY_SERVE_MAX_CONNECTIONS)", peer, live);
        fail(errc::busy, "store.connect", peer, fmt::format("the server holds {} core.connections (FERRY_SERVE_MAX_CONNECTIONS)", live));
      }
    }
    welcome w;
    w.instance = core.instance;
    auto t = detail::random_nonce();
    w.ticket.assign(t.begin(), t.begin() + ticket_size);
    const auto until = clk::now() + core.o.handshake_timeout;
    const std::size_t start = rotation.fetch_add(lanes.size());
    // Each connection is made on its worker's thread: the door goes on with other clients meanwhile.
    for (std::size_t i = 0; i < lanes.size(); ++i) {
      auto& wk = *workers[(start + i) % workers.size()];
      wk.post([this, &wk, host, peer, lane = lanes[i], ticket = w.ticket, until] {
        std::shared_ptr<connection> c;
        try {
          c = wk.connect(host, lane, until);
        } catch (const error& e) {
          log::info("store", "cannot connect to a lane of {} at port {}: {}", peer, lane, e.what());
          return;
        }
        adopt_session(c, ticket);
        try {
          c->send_frame({0, 0, hello{1, 1, 0, {}, 1, ticket, {}}});
        } catch (const error& e) {
          log::debug("store", "lane of {} lost before its hello: {}", peer, e.what());
        }
      });
    }
    return w;
  }
  // Closes connections that did not complete their handshake in time, and idle ones; takes the
  // descriptors clients pass on the lending socket.
  void janitor() {
    for (;;) {
      if (lending) {
        // Without regions to populate it waits for the socket (woken by the destructor, or by a lend).
        lending->serve(std::chrono::milliseconds(populate_step() ? 0 : 100));
        if (core.stopping_now()) return;
      } else {
        std::unique_lock l(core.mu);
        if (cv_janitor.wait_for(l, std::chrono::milliseconds(100), [&] { return core.stopping.load(); })) return;
      }
      auto now = clk::now();
      auto coarse = coarse_now().time_since_epoch().count();
      std::lock_guard l(sess_mu);
      for (auto& [k, s] : sessions) {
        if (s->closing) continue;
        if (!s->welcomed) {
          if (now - s->since > core.o.handshake_timeout) {
            core.closed_handshake++;
            close_locked(*s, "no handshake within FERRY_SERVE_HANDSHAKE_TIMEOUT");
          }
        } else if (s->rma_running.load() > 0 &&
                   coarse - s->rma_progress.load() > std::chrono::duration_cast<std::chrono::nanoseconds>(rma_timeout).count()) {
          close_locked(*s, fmt::format("RMA made no progress for {} s", rma_timeout.count()));
        } else if (s->outstanding.load() == 0 && coarse - s->last.load(std::memory_order_relaxed) > core.o.idle_timeout.count()) {
          core.closed_idle++;
          close_locked(*s, "idle for FERRY_SERVE_IDLE_TIMEOUT");
        }
      }
    }
  }
  std::condition_variable cv_janitor;  // with `core.mu` and `core.stopping`
  // One slice of the oldest region waiting to be populated; true while more wait.
  bool populate_step() {
    std::shared_ptr<lent_mapping> m;
    {
      std::lock_guard l(populate_mu);
      while (!to_populate.empty() && !(m = to_populate.front().lock())) to_populate.pop_front();
      if (!m) return false;
    }
    bool more = detail::populate_lent(*m, populate_slice);
    std::lock_guard l(populate_mu);
    if (!more) to_populate.pop_front();  // still `m`: lends only append, and only this thread pops
    return !to_populate.empty();
  }

  // A lane's welcome: its limits and, for a same-host client, where it lends memory.
  welcome welcome_msg(connection& c) {
    welcome w;
    w.credits = core.o.max_outstanding;
    w.max_request = core.o.max_request;
    w.writable = core.o.writable;
    w.instance = core.instance;
    if (lending) {
      if (auto* s = static_cast<session*>(c.user)) {
        if (s->token.empty()) {  // one per session, however often it says hello
          auto nonce = detail::random_nonce();
          s->token.assign(nonce.begin(), nonce.begin() + lend_token_size);
          std::lock_guard l(sess_mu);
          by_token[s->token] = s->shared_from_this();
        }
        w.lending = lending->name();
        w.token = s->token;
      }
    }
    return w;
  }

  // ---- progress thread: handshake, checks, inline reads; file data goes to the file engine ----
  void on_frame(connection& c, message m) {
    // A plain pointer: this handler runs in the same serialized context that clears c.user, the
    // session is freed only after it returns (on_failure), and only work handed to other threads
    // takes a reference (two atomic operations per request less).
    auto* s = static_cast<session*>(c.user);
    if (!s) return;
    s->last.store(coarse_now().time_since_epoch().count(), std::memory_order_relaxed);
    std::uint64_t rid = m.request_id;
    // A lane's hello presents the ticket the door gave its client (the one this connection was made
    // for); the secret was checked at the door.
    if (auto* h = std::get_if<hello>(&m.b)) {
      s->lanes = h->lanes;
      if (!s->welcomed) {
        if (s->ticket.empty() || !detail::proof_matches(s->ticket, h->ticket)) {
          core.reply_error(c, rid, error(errc::permission_denied, "store.connect", c.peer(), "not the ticket this lane was connected for"));
          std::lock_guard l(sess_mu);
          close_locked(*s, "a hello with another ticket");
          return;
        }
        // RMA requests carry the client's packed keys, which UCX parses without bounds of its own:
        // taken only where RMA is real (verbs), as the client decides it (client::impl::decide_rma).
        const std::string t = c.transports();
        if (t.find("rc_") != std::string::npos || t.find("dc_") != std::string::npos) s->rma_transports = t;
        s->welcomed = true;
      }
      c.send_frame({rid, core.o.max_outstanding, welcome_msg(c)});
      return;
    }
    if (!s->welcomed) {
      core.reply_error(c, rid, error(errc::protocol_error, "store.request", c.peer(), "request before the handshake"));
      return;
    }
    if (s->outstanding.load() >= static_cast<int>(core.o.max_outstanding)) {
      core.reply_error(c, rid, error(errc::busy, "store.request", c.peer(),
                                fmt::format("more than {} outstanding requests (credits exhausted)", core.o.max_outstanding)));
      return;
    }
    if (auto* l = std::get_if<lend>(&m.b)) {
      // Length 0 gives the region at `addr` back (the client frees it); jobs still writing into it
      // hold their own reference.
      if (l->length == 0) {
        std::erase_if(s->lent, [&](const auto& x) { return x->addr == l->addr; });
        s->mapped = !s->lent.empty();
        c.send_frame({rid, 0, complete{0, 0}});
        return;
      }
      int fd = -1;
      std::int64_t pid = 0;
      {
        std::lock_guard g(sess_mu);
        auto it = std::find_if(s->passed.begin(), s->passed.end(), [&](auto& x) { return x.id == l->region; });
        if (it != s->passed.end()) fd = it->fd, pid = it->pid, s->passed.erase(it);
      }
      std::shared_ptr<lent_region> mapped;
      std::shared_ptr<lent_mapping> fresh;
      std::string why;
      if (fd < 0) why = "no region was passed under this id on the lending socket";
      else if (l->length > (1ull << 40)) why = "larger than 1 TiB";
      else if (s->lent.size() >= max_lent) why = fmt::format("it has {} regions mapped here already", max_lent);
      else if (lent_total.bytes.load() + l->length > max_lent_bytes || lent_total.regions.load() >= max_lent_regions)
        why = "the server maps too much lent memory already";
      else mapped = lent_maps.map(fd, pid, l->addr, l->length, why, fresh);
      if (fd >= 0) ::close(fd);
      if (fresh && fresh->resident && lending) {
        {
          std::lock_guard g(populate_mu);
          to_populate.push_back(fresh);
        }
        lending->wake();
      }
      if (mapped) {
        lent_total.bytes += l->length;
        lent_total.regions += 1;
        mapped->totals = &lent_total;
        s->lent.push_back(mapped);
      }
      s->mapped = !s->lent.empty();
      log::info("store", "client {} lent {} bytes: {}", c.peer(), l->length,
                mapped ? std::string("mapped (reads and writes go straight through it)") : "not mapped (" + why + "; data moves by messages)");
      c.send_frame({rid, 0, complete{0, mapped ? 1u : 0u}});
      return;
    }
    auto& n = *s->counts;
    n.requests.add();
    try {
      if (auto* r = std::get_if<read_into>(&m.b)) {
        n.reads.add();
        return reads.direct(c, *s, rid, r->path, r->offset, r->length, r->addr, false, r->notify, 0, r->version);
      }
      if (auto* r = std::get_if<write_from>(&m.b)) {
        n.writes.add();
        if (!core.o.writable) fail(errc::permission_denied, "store.write", r->path, "this server is read-only (started without --writable)");
        return reads.direct(c, *s, rid, r->path, r->offset, r->length, r->addr, true, 0, r->handle);
      }
      if (auto* r = std::get_if<read_rma>(&m.b)) {
        n.reads.add();
        return reads.rma(c, s->shared_from_this(), rid, r->path, r->offset, r->length, r->addr, r->rkey, false, 0, r->version);
      }
      if (auto* r = std::get_if<write_rma>(&m.b)) {
        n.writes.add();
        if (!core.o.writable) fail(errc::permission_denied, "store.write", r->path, "this server is read-only (started without --writable)");
        return reads.rma(c, s->shared_from_this(), rid, r->path, r->offset, r->length, r->addr, r->rkey, true, r->handle);
      }
      if (auto* r = std::get_if<read_req>(&m.b)) {
        n.reads.add();
        if (r->length > core.o.max_request)
          fail(errc::out_of_range, "store.read", r->path, fmt::format("request of {} bytes exceeds the limit {}", r->length, core.o.max_request));
        if (r->length <= core.o.inline_max && reads.read_inline(c, *s, rid, *r)) return;
      } else if (auto* rm = std::get_if<read_many>(&m.b)) {
        n.reads.add(rm->ranges.size());
        for (const auto& g : rm->ranges)
          if (g.length > core.o.max_request)
            fail(errc::out_of_range, "store.read", rm->path, fmt::format("a range of {} bytes exceeds the request limit {}", g.length, core.o.max_request));
        if (!reads.read_many(c, *s, rid, *rm))
          fail(errc::not_supported, "store.read", rm->path, "ranges in one request are served from local file systems only; read them one by one");
        return;
      } else if (auto* wr = std::get_if<write_req>(&m.b)) {
        n.writes.add();
        return writes.begin_write(c, *s, rid, *wr);
      }
    } catch (const error& e) {
      core.reply_error(c, rid, e);
      return;
    }
    // (Work that goes on elsewhere holds the session, so the credit's counter outlives it.)
    auto cr = std::make_shared<credit>(s->outstanding);
    try {
      serve(c, s->shared_from_this(), m, cr);
    } catch (const error& e) {
      core.answer_error(c, *cr, rid, e);
    } catch (const std::exception& e) {
      core.answer_error(c, *cr, rid, error(errc::internal, "store.request", c.peer(), e.what()));
    }
  }

  // ---- requests that are not small reads: on the progress thread, file data by the file engine ----
  void serve(connection& c, const std::shared_ptr<session>& sp, const message& m, const std::shared_ptr<credit>& cr) {
    session& sn = *sp;
    std::uint64_t rid = m.request_id;
    if (auto* r = std::get_if<open_write>(&m.b)) return writes.open(c, sn, rid, *r, cr);
    if (auto* r = std::get_if<end_write>(&m.b)) return writes.end(c, rid, *r, cr);
    if (auto* r = std::get_if<read_req>(&m.b)) return reads.stream(c, sp, rid, *r, cr);
    if (auto* r = std::get_if<stat_req>(&m.b)) {
      int fd = core.root.open(r->path.empty() ? "." : r->path, O_RDONLY | O_PATH);
      struct stat st{};
      ::fstat(fd, &st);
      ::close(fd);
      core.answer(c, *cr, {rid, 0, stat_reply{static_cast<std::uint64_t>(st.st_size), st.st_mode,
                                       static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec,
                                       net::file_version(st.st_dev, st.st_ino)}});
      return;
    }
    if (auto* r = std::get_if<list_req>(&m.b)) {
      int fd = core.root.open(r->path.empty() ? "." : r->path, O_RDONLY | O_DIRECTORY);
      DIR* d = ::fdopendir(fd);
      if (!d) {
        ::close(fd);
        fail_errno(errno, "store.list", r->path);
      }
      // A page: the smallest names after the cursor that fit one frame, kept while the directory is
      // read (the largest dropped when they would not fit), so a request holds one page whatever the
      // directory's size.
      std::map<std::string, list_entry> page;
      std::size_t bytes = 0;
      bool more = false;
      while (dirent* e = ::readdir(d)) {
        std::string name = e->d_name;
        if (name == "." || name == ".." || name.size() > 255 || name <= r->after) continue;
        if (more && !page.empty() && name > page.rbegin()->first) continue;  // past a full page
        struct stat st{};
        if (::fstatat(::dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
        bytes += 11 + name.size();
        page.emplace(name, list_entry{name, static_cast<std::uint8_t>(S_ISREG(st.st_mode) ? 0 : S_ISDIR(st.st_mode) ? 1 : 2),
                                      static_cast<std::uint64_t>(st.st_size)});
        while (bytes > max_message - 64) {  // one frame's worth: the largest goes to a later page
          bytes -= 11 + page.rbegin()->first.size();
          page.erase(std::prev(page.end()));
          more = true;
        }
      }
      ::closedir(d);
      list_reply rep;
      rep.more = more;
      rep.entries.reserve(page.size());
      for (auto& [name, entry] : page) rep.entries.push_back(std::move(entry));
      core.answer(c, *cr, {rid, 0, std::move(rep)});
      return;
    }
    fail(errc::protocol_error, "store.request", c.peer(), "unexpected message type");
  }

};

server_options server_options_from(const store_settings& s) {
  server_options o;
  o.workers = s.serve_workers;
  o.map = s.net_map;
  o.files = s.serve_lend_files;
  o.spin = s.net_spin;
  o.max_connections = s.serve_max_connections;
  o.max_unauthenticated = s.serve_max_unauthenticated;
  o.handshake_timeout = s.serve_handshake_timeout;
  o.idle_timeout = s.serve_idle_timeout;
  o.auth_failures = s.serve_auth_failures;
  o.auth_rate = s.serve_auth_rate;
  return o;
}

server::server(file_engine& io, server_options o) : impl_(std::make_unique<impl>(io, std::move(o))) {}
server::~server() = default;
std::size_t server::stop(std::chrono::nanoseconds wait) { return impl_->stop(wait); }
std::uint16_t server::port() const noexcept { return impl_->port; }
namespace {
std::vector<std::uint64_t> per_worker(const server::impl& i) {
  std::vector<std::uint64_t> v;
  for (std::size_t k = 0; k < i.workers.size(); ++k) v.push_back(i.per_worker[k].load());
  return v;
}
}  // namespace

server_stats server::stats() const {
  auto& i = *impl_;
  std::lock_guard l(i.sess_mu);
  const std::uint64_t open_writes = i.writes.open_count();
  std::uint64_t mapped = 0;
  for (auto& [c, s] : i.sessions) mapped += s->mapped.load();
  const detail::door_counts door = i.front ? i.front->counts() : detail::door_counts{};
  detail::worker_counts sum;  // the workers' own counts
  std::vector<std::uint64_t> requests_of;
  for (std::size_t k = 0; k < i.workers.size(); ++k) {
    auto& w = i.core.counts[k];
    requests_of.push_back(w.requests.value());
    for (auto [to, from] : {std::pair{&sum.requests, &w.requests}, {&sum.reads, &w.reads}, {&sum.writes, &w.writes},
                            {&sum.bytes_sent, &w.bytes_sent}, {&sum.inline_replies, &w.inline_replies},
                            {&sum.mapped_reads, &w.mapped_reads}, {&sum.direct_reads, &w.direct_reads},
                            {&sum.notify_records, &w.notify_records}})
      to->add(from->value());
  }
  return {i.core.connections.load(),
          sum.requests.value(),
          sum.reads.value(),
          sum.writes.value(),
          i.core.bytes_sent.load() + sum.bytes_sent.value(),
          i.core.bytes_received.load(),
          i.core.errors.load(),
          sum.inline_replies.value(),
          sum.mapped_reads.value(),
          i.sessions.size(),
          i.core.write_buffered.load(),
          i.core.direct_reads.load() + sum.direct_reads.value(),
          i.core.direct_writes.load(),
          mapped,
          i.core.rma_puts.load(),
          i.core.rma_gets.load(),
          per_worker(i),
          std::move(requests_of),
          door.waiting,
          i.core.refused.load(),
          door.displaced + door.closed_deadline + i.core.closed_handshake.load(),
          i.core.closed_idle.load(),
          door.auth_failures,
          open_writes,
          i.core.commits.load(),
          sum.notify_records.value(),
          i.lender.lent()};
}

}  // namespace ferry::store
