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
#include <ferry/io/file_engine.hpp>
#include <ferry/io/mapped_file.hpp>
#include <ferry/store/root.hpp>
#include <ferry/store/server.hpp>

#include "core/logging.hpp"
#include "net/ucx.hpp"
#include "store/auth.hpp"
#include "store/door.hpp"
#include "store/lending.hpp"
#include "store/server/buffers.hpp"
#include "store/server/open_files.hpp"
#include "store/server/write_txn.hpp"

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

// steady_clock's time from the kernel's tick-granular clock (no TSC read, a few ns): for checks
// per request that only need to notice a deadline within `coarse_slack` (the tick is 1-10 ms).
clk::time_point coarse_now() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return clk::time_point(std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec));
}
constexpr std::chrono::milliseconds coarse_slack{20};
// Regions one connection may have mapped here at once (its landing region and the buffers it
// allocated); more are refused (their requests then move data by messages).
constexpr std::size_t max_lent = 64;

// The error as the client will show it: the code travels as the errno (the client names it once),
// so the message leaves it out.
error_reply to_reply(const error& e) {
  return error_reply{e.sys_errno() ? e.sys_errno() : errno_from_errc(e.code()), printable(format_error(e.info(), false), 1000)};
}


}  // namespace

struct server::impl {
  server_options o;
  file_engine& io;
  root_dir root;
  fd_cache files;
  std::atomic<std::uint64_t> connections{0}, bytes_sent{0}, bytes_received{0}, errors{0}, write_buffered{0}, direct_reads{0},
      direct_writes{0}, rma_puts{0}, rma_gets{0};
  // What each worker's progress thread counts itself (requests, and what it serves at once: most
  // small reads), summed -- with the shared counters above, the file completions' -- when stats are read:
  // no atomic add per request, and no cache line shared between workers.
  struct alignas(64) worker_counts {
    owned_counter requests, reads, writes, bytes_sent, inline_replies, mapped_reads, direct_reads, notify_records;
  };
  std::unique_ptr<worker_counts[]> counts;  // one per worker

  struct write_state {
    std::shared_ptr<write_txn> txn;
    std::shared_ptr<open_file> f;
    std::string path;
    std::uint64_t offset = 0, length = 0, announced = 0, written = 0;
    bool failed = false;
  };
  struct session : std::enable_shared_from_this<session> {
    std::atomic<int> outstanding{0};
    worker_counts* counts = nullptr;  // its worker's
    std::atomic<bool> welcomed{false};  // the handshake is complete (read by the janitor too)
    std::vector<std::uint8_t> ticket;   // the door's, which the client's hello must present
    std::string rma_transports;         // the lane's transports when they have remote memory access (verbs), else empty
    // Connection limits (the janitor reads these under sess_mu; `last` is written per request).
    std::weak_ptr<connection> conn;
    std::string peer_addr;              // the peer's address without its port
    clk::time_point since;              // accepted
    std::atomic<std::int64_t> last{0};  // coarse time of the last request, ns
    bool closing = false;               // a close was asked for (sess_mu)
    // RMA operations in flight, and the coarse time (ns) one last started or finished: the janitor
    // closes a connection whose RMA makes no progress (rma_timeout).
    std::atomic<int> rma_running{0};
    std::atomic<std::int64_t> rma_progress{0};
    unsigned lanes = 1;  // the client's, from its hello
    // The file its last small read used, until the file cache would reopen it (its worker's thread only).
    std::string last_path;
    std::shared_ptr<open_file> last_file;
    clk::time_point last_until{};
    std::map<std::uint64_t, std::shared_ptr<write_state>> writes;  // its worker's thread only
    // The client's lent regions (its landing region, buffers it allocated), mapped here; the newest
    // last (its worker's thread; jobs hold copies).
    std::vector<std::shared_ptr<lent_region>> lent;
    std::atomic<bool> mapped{false};       // for stats (read under sess_mu from any thread)
    // Lending: the token that ties descriptors passed on the lending socket to this session, and the
    // descriptors passed and not yet named by a `lend` (sess_mu; at most max_lent).
    std::vector<std::uint8_t> token;
    struct passed_region {
      std::uint64_t id;
      int fd;
      std::int64_t pid;  // of the process that passed it
    };
    std::vector<passed_region> passed;
    ~session() {
      for (auto& x : passed) ::close(x.fd);
    }
    // The lent region that holds [addr, addr + n), or null. Newest first: a region lent again at
    // an address that was given back is the live one.
    const std::shared_ptr<lent_region>* lent_at(std::uint64_t addr, std::uint64_t n) const {
      for (auto it = lent.rbegin(); it != lent.rend(); ++it) {
        auto& m = **it;
        if (addr >= m.addr && n <= m.len && addr - m.addr <= m.len - n) return &*it;
      }
      return nullptr;
    }
  };
  std::mutex sess_mu;
  std::map<connection*, std::shared_ptr<session>> sessions;
  std::map<std::vector<std::uint8_t>, std::weak_ptr<session>> by_token;  // welcomed sessions, for the lending socket
  // Where same-host clients pass the regions they lend (null: none, FERRY_NET_MAP=0); served by the
  // janitor thread. Bytes mapped from all clients together are bounded (address space).
  std::unique_ptr<lending_socket> lending;
  detail::lent_totals lent_total;
  static constexpr std::uint64_t max_lent_bytes = 1ull << 45, max_lent_regions = 16384;
  detail::lent_maps lent_maps;
  // Resident regions newly mapped, whose page-table entries the janitor makes ahead of the copies
  // into them, a slice at a time between its other work (populate_mu).
  std::mutex populate_mu;
  std::deque<std::weak_ptr<lent_mapping>> to_populate;
  static constexpr std::uint64_t populate_slice = 16ull << 20;  // each holds the mapping lock, briefly
  // Write data buffers UCX is receiving into, by (connection, request, offset); declared before the
  // workers so that they outlive them.
  buffer_pool write_buffers;  // before `receiving`: its buffers return here
  std::mutex recv_mu;
  std::map<std::tuple<connection*, std::uint64_t, std::uint64_t>, std::shared_ptr<std::byte[]>> receiving;

  std::mutex mu;
  bool stopping = false;
  // File requests whose completion has not run yet: the server does not go before they have.
  std::atomic<int> io_in_flight{0};
  std::condition_variable io_cv;  // with `mu`
  data_buffers buffers{o.chunk, 32};
  std::atomic<std::size_t> rotation{0};     // where the next client's lanes start among the workers
  std::unique_ptr<std::atomic<std::uint64_t>[]> per_worker;  // connections each worker took
  std::uint16_t port = 0;
  std::uint64_t instance = 0;                // random per start: a client's lanes check they reached one server
  // Open writes by handle; any of a client's lanes may fill one (the handle is the capability),
  // the session that opened it owns it.
  std::mutex txn_mu;
  std::unordered_map<std::uint64_t, std::shared_ptr<write_txn>> txns;
  static constexpr std::size_t max_txns_per_session = 256, max_txns = 16384;
  std::shared_ptr<write_txn> txn(std::uint64_t handle, const std::string& path) {
    std::lock_guard l(txn_mu);
    auto it = txns.find(handle);
    if (it == txns.end() || !handle)
      fail(errc::invalid_argument, "store.write", printable(path),
           handle ? "no open write with this handle (committed, aborted, or its connection closed)"
                  : "a write needs an open write (open_write; protocol 4)");
    if (it->second->path() != path)
      fail(errc::invalid_argument, "store.write", printable(path), fmt::format("the handle belongs to '{}'", printable(it->second->path())));
    return it->second;
  }
  std::atomic<std::uint64_t> refused{0}, closed_handshake{0}, closed_idle{0}, commits{0};
  std::thread janitor_thread;  // closes connections past their handshake or idle time
  std::vector<std::unique_ptr<ucx_worker>> workers;  // stopped after the door
  std::unique_ptr<detail::door> front;               // last: stopped first (no new client meanwhile)

  impl(file_engine& engine, server_options opt) : o(std::move(opt)), io(engine), root(o.root), files(root, o.fd_cache_ttl) {
    if (o.writable && o.secret.empty() && !o.insecure)
      fail(errc::permission_denied, "store.serve", o.root,
           "refusing to serve writable without a shared secret (give a secret file, or --insecure to let anyone write)");
    expects(o.chunk > 0 && o.max_outstanding > 0 && o.workers > 0, "store.serve", o.root,
            "chunk, credits and workers must be positive");
    auto ctx = std::make_shared<ucx_context>(interface_for(o.host, true));
    for (int i = 0; i < o.workers; ++i) {
      auto& w = *workers.emplace_back(std::make_unique<ucx_worker>(fmt::format("ferry-serve-{}", i), o.spin, ctx));
      w.on_frame([this](connection& c, message m) { on_frame(c, std::move(m)); });
      w.on_data([this](connection& c, std::uint64_t rid, std::uint64_t off, std::size_t n) { return data_sink(c, rid, off, n); },
                [this](connection& c, std::uint64_t rid, std::uint64_t off, std::size_t n, ucs_status_t st) {
                  data_done(c, rid, off, n, st);
                });
    }
    per_worker = std::make_unique<std::atomic<std::uint64_t>[]>(workers.size());
    counts = std::make_unique<worker_counts[]>(workers.size());
    auto nonce = detail::random_nonce();
    std::memcpy(&instance, nonce.data(), sizeof instance);
    raise_descriptor_limit();
    detail::door_limits lim;
    lim.max_waiting = o.max_unauthenticated;
    lim.deadline = o.handshake_timeout;
    lim.auth_rate = o.auth_rate;
    lim.auth_failures = o.auth_failures;
    lim.secret = o.secret;
    front = std::make_unique<detail::door>(o.host, o.port, std::move(lim),
                                           [this](const std::string& host, const std::string& peer, const std::vector<std::uint16_t>& lanes) {
                                             return issue(host, peer, lanes);
                                           });
    port = front->port();
    // Last: a constructor that threw above leaves no running thread behind.
    if (o.map) {
      try {
        lending = std::make_unique<lending_socket>(instance, [this](std::span<const std::uint8_t> token, std::uint64_t id, int fd, std::int64_t pid) {
          return take_passed(token, id, fd, pid);
        });
      } catch (const error& e) {
        log::warn("store", "no lending socket ({}); same-host clients move data by messages", e.what());
      }
    }
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
  // No new client or request from here on; waits up to `wait` for the file requests in flight (their
  // completions use this server). Returns how many are still in the file system.
  std::size_t stop(std::chrono::nanoseconds wait) {
    front.reset();
    {
      std::lock_guard l(mu);
      stopping = true;
    }
    cv_janitor.notify_all();
    if (lending) lending->wake();
    if (janitor_thread.joinable()) janitor_thread.join();
    std::unique_lock l(mu);
    io_cv.wait_for(l, wait, [&] { return io_in_flight.load() == 0; });
    return static_cast<std::size_t>(io_in_flight.load());
  }
  ~impl() {
    // File requests end by their deadline, or when their file system answers: one that never does
    // keeps its buffer (the kernel may still write into it), and so this server.
    while (std::size_t left = stop(std::chrono::seconds(10)))
      log::error("store", "stopping: {} file requests still in the file system", left);
    // Sessions go while the workers still run: their mapped regions are released on those threads.
    std::map<connection*, std::shared_ptr<session>> gone;
    {
      std::lock_guard l(sess_mu);
      gone.swap(sessions);
    }
    gone.clear();
  }
  static std::string host_of(const std::string& peer) {
    auto colon = peer.rfind(':');
    return colon == std::string::npos ? peer : peer.substr(0, colon);
  }
  // Each connection costs descriptors (its sockets, UCX's); a server at the soft limit would refuse
  // everyone, so it runs at the hard limit, and max_connections bounds what clients may take.
  static void raise_descriptor_limit() {
    rlimit r{};
    if (::getrlimit(RLIMIT_NOFILE, &r) == 0 && r.rlim_cur < r.rlim_max) {
      r.rlim_cur = r.rlim_max;
      ::setrlimit(RLIMIT_NOFILE, &r);
    }
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
    connections++;
    std::size_t wi = 0;
    for (std::size_t i = 0; i < workers.size(); ++i)
      if (workers[i].get() == &c->worker()) per_worker[wi = i]++;
    {
      std::lock_guard l(sess_mu);
      auto& s = sessions[c.get()];
      s = std::make_shared<session>();
      s->counts = &counts[wi];
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
      if (s) {
        std::lock_guard l(txn_mu);  // its open writes go: their targets stay as they were
        std::erase_if(txns, [&](const auto& kv) { return kv.second->owner == s.get(); });
      }
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
      if (live + lanes.size() > static_cast<std::size_t>(o.max_connections)) {
        if (refused++ % 1000 == 0) log::warn("store", "refusing {}: {} connections (FERRY_SERVE_MAX_CONNECTIONS)", peer, live);
        fail(errc::busy, "store.connect", peer, fmt::format("the server holds {} connections (FERRY_SERVE_MAX_CONNECTIONS)", live));
      }
    }
    welcome w;
    w.instance = instance;
    auto t = detail::random_nonce();
    w.ticket.assign(t.begin(), t.begin() + ticket_size);
    const auto until = clk::now() + o.handshake_timeout;
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
        if (stopping_now()) return;
      } else {
        std::unique_lock l(mu);
        if (cv_janitor.wait_for(l, std::chrono::milliseconds(100), [&] { return stopping; })) return;
      }
      auto now = clk::now();
      auto coarse = coarse_now().time_since_epoch().count();
      std::lock_guard l(sess_mu);
      for (auto& [k, s] : sessions) {
        if (s->closing) continue;
        if (!s->welcomed) {
          if (now - s->since > o.handshake_timeout) {
            closed_handshake++;
            close_locked(*s, "no handshake within FERRY_SERVE_HANDSHAKE_TIMEOUT");
          }
        } else if (s->rma_running.load() > 0 &&
                   coarse - s->rma_progress.load() > std::chrono::duration_cast<std::chrono::nanoseconds>(rma_timeout).count()) {
          close_locked(*s, fmt::format("RMA made no progress for {} s", rma_timeout.count()));
        } else if (s->outstanding.load() == 0 && coarse - s->last.load(std::memory_order_relaxed) > o.idle_timeout.count()) {
          closed_idle++;
          close_locked(*s, "idle for FERRY_SERVE_IDLE_TIMEOUT");
        }
      }
    }
  }
  std::condition_variable cv_janitor;  // with `mu` and `stopping`
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

  bool stopping_now() {
    std::lock_guard l(mu);
    return stopping;
  }
  // A request of the file engine; `then` gets its result on the thread that finished it (it must
  // not block). Counted, so that the server does not go while a completion may still come.
  void file_io(std::shared_ptr<ferry::file> f, bool write, std::uint64_t offset, void* mem, std::uint64_t n,
               std::function<void(const request_result&)> then) {
    io_in_flight++;
    file_request r{std::move(f), offset, mem, n, write};
    io.submit({&r, 1}, {}, [this, then = std::move(then)](std::span<const request_result> res) {
      try {
        then(res[0]);
      } catch (const std::exception& e) {
        log::debug("store", "file request completion: {}", e.what());  // a connection that went, say
      }
      if (--io_in_flight == 0) {
        std::lock_guard l(mu);
        io_cv.notify_all();
      }
    });
  }
  static const error& error_of(const request_result& r) {
    static const error none(errc::internal, "store.io", "", "file request did not finish");
    return r.err ? *r.err : none;
  }
  // The connection's session, or null once it went. No lock and no map lookup (this runs per
  // request): the connection points at its session, and callers are the connection's worker's
  // holder -- frame and data callbacks -- the same serialized context that clears the pointer
  // when the session goes.
  std::shared_ptr<session> session_of(connection& c) {
    auto* s = static_cast<session*>(c.user);
    return s ? s->shared_from_this() : nullptr;
  }
  // A request's credit, given back just before its answer goes out: the client may send its next
  // request the moment the answer arrives, and must not find the credit still taken (it would be
  // refused as one too many). Given back once; the job gives it back if nothing did.
  struct credit {
    std::atomic<int>* n = nullptr;
    explicit credit(std::atomic<int>& c) : n(&c) { c++; }
    credit(credit&& o) noexcept : n(std::exchange(o.n, nullptr)) {}
    credit(const credit&) = delete;
    ~credit() { give_back(); }
    void give_back() {
      if (n) n->fetch_sub(1);
      n = nullptr;
    }
  };
  void answer(connection& c, credit& cr, const message& m) {
    cr.give_back();
    c.send_frame(m);
  }
  void answer_error(connection& c, credit& cr, std::uint64_t rid, const error& e) {
    cr.give_back();
    reply_error(c, rid, e);
  }
  void reply_error(connection& c, std::uint64_t rid, const error& e) {
    errors++;
    try {
      c.send_frame({rid, 0, to_reply(e)});
    } catch (...) {
    }
  }
  // A lane's welcome: its limits and, for a same-host client, where it lends memory.
  welcome welcome_msg(connection& c) {
    welcome w;
    w.credits = o.max_outstanding;
    w.max_request = o.max_request;
    w.writable = o.writable;
    w.instance = instance;
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
          reply_error(c, rid, error(errc::permission_denied, "store.connect", c.peer(), "not the ticket this lane was connected for"));
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
      c.send_frame({rid, o.max_outstanding, welcome_msg(c)});
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
        return direct(c, *s, rid, r->path, r->offset, r->length, r->addr, false, r->notify, 0, r->version);
      }
      if (auto* r = std::get_if<write_from>(&m.b)) {
        n.writes.add();
        if (!o.writable) fail(errc::permission_denied, "store.write", r->path, "this server is read-only (started without --writable)");
        return direct(c, *s, rid, r->path, r->offset, r->length, r->addr, true, 0, r->handle);
      }
      if (auto* r = std::get_if<read_rma>(&m.b)) {
        n.reads.add();
        return rma(c, s->shared_from_this(), rid, r->path, r->offset, r->length, r->addr, r->rkey, false, 0, r->version);
      }
      if (auto* r = std::get_if<write_rma>(&m.b)) {
        n.writes.add();
        if (!o.writable) fail(errc::permission_denied, "store.write", r->path, "this server is read-only (started without --writable)");
        return rma(c, s->shared_from_this(), rid, r->path, r->offset, r->length, r->addr, r->rkey, true, r->handle);
      }
      if (auto* r = std::get_if<read_req>(&m.b)) {
        n.reads.add();
        if (r->length > o.max_request)
          fail(errc::out_of_range, "store.read", r->path, fmt::format("request of {} bytes exceeds the limit {}", r->length, o.max_request));
        if (r->length <= o.inline_max && read_inline(c, *s, rid, *r)) return;
      } else if (auto* wr = std::get_if<write_req>(&m.b)) {
        n.writes.add();
        return begin_write(c, *s, rid, *wr);
      }
    } catch (const error& e) {
      reply_error(c, rid, e);
      return;
    }
    // (Work that goes on elsewhere holds the session, so the credit's counter outlives it.)
    auto cr = std::make_shared<credit>(s->outstanding);
    try {
      serve(c, s->shared_from_this(), m, cr);
    } catch (const error& e) {
      answer_error(c, *cr, rid, e);
    } catch (const std::exception& e) {
      answer_error(c, *cr, rid, error(errc::internal, "store.request", c.peer(), e.what()));
    }
  }

  // A read into / write from a region the client lent: a small read on this thread from the file's
  // mapping (as read_inline, but into the client's memory, and only the completion is sent), else
  // one file engine request, then the completion. The request holds the mapping, so a client that
  // leaves or gives the region back meanwhile cannot make it vanish.
  // A read with a notify record (read_into::notify) served at once also writes the record, in
  // a region the client lent, before the completion goes: the client, polling it, is done without
  // receiving a message. (A queued read only sends the completion; the client waits for that.)
  void direct(connection& c, session& sn, std::uint64_t rid, const std::string& path, std::uint64_t offset,
              std::uint64_t length, std::uint64_t addr, bool write, std::uint64_t notify = 0, std::uint64_t handle = 0,
              std::uint64_t version = 0) {
    const char* op = write ? "store.write" : "store.read";
    if (length > o.max_request)
      fail(errc::out_of_range, op, path, fmt::format("request of {} bytes exceeds the limit {}", length, o.max_request));
    if (sn.lent.empty()) fail(errc::protocol_error, op, c.peer(), "direct request without a mapped region (lend first)");
    auto* at = sn.lent_at(addr, length);
    if (!at) fail(errc::out_of_range, op, c.peer(), fmt::format("[{:#x}, +{}) is outside every region the client lent", addr, length));
    auto t = write ? txn(handle, path) : nullptr;
    if (write && length <= o.inline_max && t->file()->local) {  // as a small read below: on this thread
      t->file()->f->write_here((*at)->base + (addr - (*at)->addr), length, offset);
      t->wrote(offset, length);
      bytes_received += length;
      direct_writes++;
      return c.send_frame({rid, 0, complete{0, length}});
    }
    if (!write && length <= o.inline_max) {
      std::uint64_t* record = nullptr;
      if (notify) {
        auto* nm = sn.lent_at(notify, 2 * sizeof(std::uint64_t));
        if (!nm) fail(errc::out_of_range, op, c.peer(), fmt::format("notify record {:#x} is outside every region the client lent", notify));
        record = reinterpret_cast<std::uint64_t*>((*nm)->base + (notify - (*nm)->addr));
      }
      if (read_direct_here(c, sn, rid, path, offset, length, (*at)->base + (addr - (*at)->addr), record, version)) return;
    }
    // The request holds the session and the mapping (a plain reference suffices above, on this
    // thread; taking one costs two atomic operations per request).
    auto s = sn.shared_from_this();
    std::shared_ptr<lent_region> m = *at;
    auto f = write ? t->file() : same_version(files.get(path), version, path, offset);
    auto self = c.shared_from_this();
    auto cr = std::make_shared<credit>(s->outstanding);
    file_io(f->f, write, offset, m->base + (addr - m->addr), length, [this, self, s, cr, m, t, rid, write, offset](const request_result& r) {
      if (r.state != request_state::done) return answer_error(*self, *cr, rid, error_of(r));
      if (write) {
        t->wrote(offset, r.bytes_done);
        bytes_received += r.bytes_done;
        direct_writes++;
      } else {
        bytes_sent += r.bytes_done;
        direct_reads++;
      }
      answer(*self, *cr, {rid, 0, complete{0, r.bytes_done}});
    });
  }

  // A read into / write from registered client memory by RMA (NVMe-oF style): the file a chunk at a
  // time through a data buffer -- a file request, then a put to the client (or a get from the
  // client, then a file request) -- each step started by the completion of the one before; the
  // completion goes after a fence, so it cannot overtake the data. The rkey is unpacked here, on
  // the progress thread. RMA that makes no progress for `rma_timeout` closes the connection (the
  // janitor), which fails what is in flight.
  static constexpr std::chrono::seconds rma_timeout{30};
  struct rma_op {
    std::shared_ptr<connection> c;
    std::shared_ptr<session> s;
    std::shared_ptr<credit> cr;
    std::shared_ptr<remote_key> key;
    std::shared_ptr<write_txn> t;
    std::shared_ptr<open_file> f;
    std::string path;
    std::uint64_t rid = 0, offset = 0, length = 0, addr = 0, done = 0;
    bool write = false;
    std::byte* buf = nullptr;
  };
  void rma(connection& c, const std::shared_ptr<session>& s, std::uint64_t rid, const std::string& path, std::uint64_t offset,
           std::uint64_t length, std::uint64_t addr, const std::vector<std::uint8_t>& rkey, bool write, std::uint64_t handle,
           std::uint64_t version = 0) {
    const char* op = write ? "store.write" : "store.read";
    if (length > o.max_request)
      fail(errc::out_of_range, op, path, fmt::format("request of {} bytes exceeds the limit {}", length, o.max_request));
    if (s->rma_transports.empty())
      fail(errc::not_supported, op, c.peer(), fmt::format("RMA needs a lane with remote memory access (verbs); this one has {}", c.transports()));
    auto key = c.unpack_rkey(std::as_bytes(std::span(rkey.data(), rkey.size())));
    if (!key) fail(errc::protocol_error, op, c.peer(), "the client's rkey cannot be unpacked on this endpoint");
    auto r = std::make_shared<rma_op>();
    r->t = write ? txn(handle, path) : nullptr;
    r->f = write ? r->t->file() : same_version(files.get(path), version, path, offset);
    r->c = c.shared_from_this();
    r->s = s;
    r->cr = std::make_shared<credit>(s->outstanding);
    r->key = std::move(key);
    r->path = path;
    r->rid = rid, r->offset = offset, r->length = length, r->addr = addr, r->write = write;
    buffers.take([this, r](std::byte* b) {
      r->buf = b;
      rma_step(r);
    });
  }
  void rma_step(const std::shared_ptr<rma_op>& r) {
    if (r->done >= r->length) return rma_end(r, nullptr);
    std::uint64_t n = std::min<std::uint64_t>(buffers.bytes(), r->length - r->done);
    if (r->write) {
      return rma_move(r, true, n, [this, r, n] {
        file_io(r->f->f, true, r->offset + r->done, r->buf, n, [this, r, n](const request_result& x) {
          if (x.state != request_state::done) return rma_end(r, &error_of(x));
          r->done += n;
          rma_step(r);
        });
      });
    }
    file_io(r->f->f, false, r->offset + r->done, r->buf, n, [this, r, n](const request_result& x) {
      if (x.state != request_state::done) return rma_end(r, &error_of(x));
      std::uint64_t got = x.bytes_done;
      if (got == 0) return rma_end(r, nullptr);  // end of file
      rma_move(r, false, got, [this, r, n, got] {
        r->done += got;
        if (got < n) return rma_end(r, nullptr);  // end of file
        rma_step(r);
      });
    });
  }
  // One RMA operation between the data buffer and the client's memory at the current offset.
  void rma_move(const std::shared_ptr<rma_op>& r, bool get, std::uint64_t n, std::function<void()> next) {
    auto& s = *r->s;
    if (s.rma_running++ == 0) s.rma_progress = coarse_now().time_since_epoch().count();
    try {
      r->c->rma(get, r->buf, n, r->addr + r->done, r->key, [this, r, get, next = std::move(next)](ucs_status_t st) {
        r->s->rma_running--;
        r->s->rma_progress = coarse_now().time_since_epoch().count();
        if (st != UCS_OK) {
          error e(errc::network_error, get ? "store.write" : "store.read", fmt::format("{} {}", r->c->peer(), printable(r->path)),
                  std::string(get ? "RMA get" : "RMA put") + " failed: " + ucs_status_string(st));
          return rma_end(r, &e);
        }
        next();
      });
    } catch (const error& e) {
      s.rma_running--;
      rma_end(r, &e);
    }
  }
  void rma_end(const std::shared_ptr<rma_op>& r, const error* e) {
    buffers.give_back(std::exchange(r->buf, nullptr));
    if (e) return answer_error(*r->c, *r->cr, r->rid, *e);
    if (r->write) {
      r->t->wrote(r->offset, r->done);
      bytes_received += r->done;
      rma_gets++;
    } else {
      bytes_sent += r->done;
      rma_puts++;
    }
    r->cr->give_back();
    try {
      r->c->send_frame_fenced({r->rid, 0, complete{0, r->done}});
    } catch (...) {
    }
  }

  // False: the file is not read on this thread (read_small); the request goes to the file engine.
  bool read_inline(connection& c, session& s, std::uint64_t rid, const read_req& r) {
    // The file data is read straight into the worker's reply space, which the reply is sent from:
    // nothing allocated, one copy before UCX's.
    std::byte* buf = c.reply_space(r.length);
    auto got = read_small(s, r.path, buf, r.length, r.offset, r.version);
    if (!got) return false;
    s.counts->bytes_sent.add(*got);
    s.counts->inline_replies.add();
    c.send_reply_space({rid, 0, complete{0, *got}}, *got);
    return true;
  }
  // A small read straight into the client's lent memory: only the completion travels. False as
  // read_inline.
  bool read_direct_here(connection& c, session& s, std::uint64_t rid, const std::string& path, std::uint64_t offset,
                        std::uint64_t length, std::byte* dst, std::uint64_t* record, std::uint64_t version) {
    auto opt = read_small(s, path, dst, length, offset, version);
    if (!opt) return false;
    std::uint64_t got = *opt;
    // A client that truncated its region under the record is told by the completion alone.
    if (record) {
      guarded_publish(record, rid, got);
      s.counts->notify_records.add();
    }
    s.counts->bytes_sent.add(got);
    s.counts->direct_reads.add();
    c.send_frame({rid, 0, complete{0, got}});
    return true;
  }
  // Reads a small range on the worker's thread. The session's last file first: a client reading
  // one file in small pieces costs no lock and no lookup in the shared cache per request. From the
  // file's mapping when the range lies in it (a pread would cost a third of the whole request);
  // past the mapped size (the file grew, or the read ends at EOF) or after the file shrank under
  // the mapping -- or the client's region under the destination -- pread says what is there now.
  // Either way the file must still be linked (a deleted or replaced file is never served; one
  // fstat, no path lookup), and a read from the mapping counts only the bytes the file still has
  // after the copy: a page of the mapping past a shrunken file's end reads as zeros, not data.
  // Nothing (and nothing read) for a file that is not on a local file system: it may never answer,
  // and this thread serves other clients too.
  std::optional<std::uint64_t> read_small(session& s, const std::string& path, std::byte* dst, std::uint64_t length,
                                          std::uint64_t offset, std::uint64_t version) {
    auto reopen = [&] {
      clk::time_point opened;
      s.last_file.reset();
      s.last_path.clear();
      s.last_file = files.get(path, &opened);
      s.last_path = path;
      s.last_until = opened + o.fd_cache_ttl - coarse_slack;
    };
    std::uint64_t size = 0;
    if (s.last_path != path || coarse_now() >= s.last_until) reopen();
    if (!s.last_file->local) return std::nullopt;
    same_version(s.last_file, version, path, offset);
    if (s.last_file->map.read(dst, length, offset)) {
      if (fd_cache::still_linked(*s.last_file, &size)) {
        s.counts->mapped_reads.add();
        return size <= offset ? 0 : std::min(length, size - offset);
      }
      reopen();  // replaced or deleted
    } else if (!fd_cache::still_linked(*s.last_file, &size)) {
      reopen();
    }
    if (!s.last_file->local) return std::nullopt;
    return same_version(s.last_file, version, path, offset)->f->read_here(dst, length, offset);
  }

  // ---- writes: the frame opens the request; data arrives as AM data (rendezvous for large pieces) ----
  void begin_write(connection& c, session& s, std::uint64_t rid, const write_req& r) {
    if (!o.writable) fail(errc::permission_denied, "store.write", r.path, "this server is read-only (started without --writable)");
    if (r.length > o.max_request)
      fail(errc::out_of_range, "store.write", r.path, fmt::format("request of {} bytes exceeds the limit {}", r.length, o.max_request));
    if (s.writes.count(rid)) fail(errc::protocol_error, "store.write", c.peer(), fmt::format("request id {} is already in use", rid));
    auto ws = std::make_shared<write_state>();
    ws->txn = txn(r.handle, r.path);
    ws->f = ws->txn->file();
    ws->path = r.path;
    ws->offset = r.offset;
    ws->length = r.length;
    if (r.length == 0) {
      c.send_frame({rid, 0, complete{0, 0}});
      return;
    }
    s.outstanding++;
    s.writes[rid] = std::move(ws);
  }
  void fail_write(connection& c, session& s, std::uint64_t rid, const error& e) {
    auto it = s.writes.find(rid);
    if (it == s.writes.end() || it->second->failed) return;
    it->second->failed = true;
    s.writes.erase(it);
    s.outstanding--;
    reply_error(c, rid, e);
  }
  void* data_sink(connection& c, std::uint64_t rid, std::uint64_t off, std::size_t n) {
    auto s = session_of(c);
    if (!s) return nullptr;
    auto it = s->writes.find(rid);
    if (it == s->writes.end()) return nullptr;  // unknown, finished or failed request: dropped
    auto& ws = *it->second;
    if (n == 0 || n > max_data || off > ws.length || n > ws.length - off || ws.announced + n > ws.length) {
      fail_write(c, *s, rid, error(errc::protocol_error, "store.write", ws.path,
                                   fmt::format("data piece [{}, +{}) does not fit the request (length {}, message limit {})", off,
                                               n, ws.length, max_data)));
      return nullptr;
    }
    if (write_buffered.fetch_add(n) + n > o.max_write_buffer) {
      write_buffered -= n;
      fail_write(c, *s, rid, error(errc::busy, "store.write", ws.path,
                                   fmt::format("the server buffers at most {} bytes of write data at once; try again", o.max_write_buffer)));
      return nullptr;
    }
    ws.announced += n;
    auto buf = write_buffers.get();
    std::lock_guard l(recv_mu);
    receiving[{&c, rid, off}] = buf;
    return buf.get();
  }
  void data_done(connection& c, std::uint64_t rid, std::uint64_t off, std::size_t n, ucs_status_t st) {
    std::shared_ptr<std::byte[]> buf;
    {
      std::lock_guard l(recv_mu);
      auto node = receiving.extract({&c, rid, off});
      if (node.empty()) return;
      buf = std::move(node.mapped());
    }
    auto s = session_of(c);
    std::shared_ptr<write_state> ws;
    if (s) {
      auto it = s->writes.find(rid);
      if (it != s->writes.end()) ws = it->second;
    }
    if (!ws || st != UCS_OK) {
      write_buffered -= n;
      if (ws) fail_write(c, *s, rid, error(errc::network_error, "store.write", ws->path, std::string("data receive failed: ") + ucs_status_string(st)));
      return;
    }
    bytes_received += n;
    if (n <= o.inline_max && ws->f->local) {
      // A small piece is written on this thread, as a small read is read here: the hand-off to the
      // file engine and back would cost more than the write.
      std::optional<error> err;
      try {
        ws->f->f->write_here(buf.get(), n, ws->offset + off);
        ws->txn->wrote(ws->offset + off, n);
      } catch (const error& e) {
        err = e;
      }
      write_buffered -= n;
      return piece_written(c, *s, ws, rid, n, err);
    }
    auto self = c.shared_from_this();
    file_io(ws->f->f, true, ws->offset + off, buf.get(), n, [this, self, s, ws, rid, n, buf, off](const request_result& r) {
      std::optional<error> err;
      if (r.state == request_state::done) ws->txn->wrote(ws->offset + off, n);
      else err = error_of(r);
      write_buffered -= n;
      // Completion bookkeeping belongs to the connection's progress thread (it owns the write table).
      self->worker().post([this, self, s, ws, rid, n, err] { piece_written(*self, *s, ws, rid, n, err); });
    });
  }
  // A piece of write `rid` is in the file (or failed): the request is answered once all are. On the
  // connection's progress thread.
  void piece_written(connection& c, session& s, const std::shared_ptr<write_state>& ws, std::uint64_t rid, std::uint64_t n,
                     const std::optional<error>& err) {
    auto it = s.writes.find(rid);
    if (it == s.writes.end() || it->second != ws) return;
    if (err) return fail_write(c, s, rid, *err);
    ws->written += n;
    if (ws->written < ws->length) return;
    s.writes.erase(it);
    s.outstanding--;  // before the answer (see credit)
    try {
      c.send_frame({rid, 0, complete{0, ws->written}});
    } catch (...) {
    }
  }

  // ---- requests that are not small reads: on the progress thread, file data by the file engine ----
  void serve(connection& c, const std::shared_ptr<session>& sp, const message& m, const std::shared_ptr<credit>& cr) {
    session& sn = *sp;
    std::uint64_t rid = m.request_id;
    if (auto* r = std::get_if<open_write>(&m.b)) {
      if (!o.writable) fail(errc::permission_denied, "store.write", r->path, "this server is read-only (started without --writable)");
      std::uint64_t id = 0;
      while (!id) {
        auto nonce = detail::random_nonce();
        std::memcpy(&id, nonce.data(), sizeof id);
      }
      auto t = std::make_shared<write_txn>(root, r->path, r->mode, id, std::min(r->size_hint, o.max_write_hint));
      t->owner = &sn;
      {
        std::lock_guard l(txn_mu);
        std::size_t mine = 0;
        for (auto& [k, x] : txns) mine += x->owner == &sn;
        if (mine >= max_txns_per_session || txns.size() >= max_txns)
          fail(errc::busy, "store.write", r->path,
               fmt::format("too many open writes ({} on this connection, {} in all); commit or abort some", mine, txns.size()));
        txns[id] = t;
      }
      if (t->keeps()) {
        try {
          return keep(c.shared_from_this(), t, cr, rid);
        } catch (...) {
          std::lock_guard l(txn_mu);
          txns.erase(id);
          throw;
        }
      }
      answer(c, *cr, {rid, 0, complete{0, id}});
      return;
    }
    if (auto* r = std::get_if<end_write>(&m.b)) {
      std::shared_ptr<write_txn> t;
      {
        std::lock_guard l(txn_mu);
        auto it = txns.find(r->handle);
        if (it == txns.end())
          fail(errc::invalid_argument, "store.commit", c.peer(), "no open write with this handle (committed, aborted, or its connection closed)");
        t = std::move(it->second);
        txns.erase(it);
      }
      std::uint64_t n = 0;
      if (r->how != write_end::abort) {
        n = t->commit(r->how == write_end::commit_size ? std::optional<std::uint64_t>(r->size) : std::nullopt);
        log::debug("store", "client {} committed {} ({} bytes)", c.peer(), printable(t->path()), n);
        commits++;
      }
      answer(c, *cr, {rid, 0, complete{0, n}});
      return;
    }
    if (auto* r = std::get_if<read_req>(&m.b)) {
      auto st = std::make_shared<streamed>();
      st->c = c.shared_from_this();
      st->s = sp;
      st->cr = cr;
      st->f = same_version(files.get(r->path), r->version, r->path, r->offset);
      st->rid = rid, st->offset = r->offset, st->length = r->length;
      return stream(st);
    }
    if (auto* r = std::get_if<stat_req>(&m.b)) {
      int fd = root.open(r->path.empty() ? "." : r->path, O_RDONLY | O_PATH);
      struct stat st{};
      ::fstat(fd, &st);
      ::close(fd);
      answer(c, *cr, {rid, 0, stat_reply{static_cast<std::uint64_t>(st.st_size), st.st_mode,
                                       static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec,
                                       net::file_version(st.st_dev, st.st_ino)}});
      return;
    }
    if (auto* r = std::get_if<list_req>(&m.b)) {
      int fd = root.open(r->path.empty() ? "." : r->path, O_RDONLY | O_DIRECTORY);
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
      answer(c, *cr, {rid, 0, std::move(rep)});
      return;
    }
    fail(errc::protocol_error, "store.request", c.peer(), "unexpected message type");
  }

  // A read answered by data messages: a chunk at a time into a data buffer by a file request, then
  // sent; the next chunk's request starts when the last one's data is on its way. The completion
  // frame may overtake the data: the client waits for both.
  struct streamed {
    std::shared_ptr<connection> c;
    std::shared_ptr<session> s;
    std::shared_ptr<credit> cr;
    std::shared_ptr<open_file> f;
    std::uint64_t rid = 0, offset = 0, length = 0, done = 0;
  };
  void stream(const std::shared_ptr<streamed>& st) {
    std::uint64_t want = std::min<std::uint64_t>(buffers.bytes(), st->length - st->done);
    if (want == 0 || !st->c->alive() || stopping_now()) {
      if (st->c->alive()) answer(*st->c, *st->cr, {st->rid, 0, complete{0, st->done}});
      return;
    }
    buffers.take([this, st, want](std::byte* b) {
      file_io(st->f->f, false, st->offset + st->done, b, want, [this, st, want, b](const request_result& r) {
        std::uint64_t got = r.bytes_done;
        if (r.state != request_state::done || got == 0) {
          buffers.give_back(b);
          if (r.state != request_state::done) return answer_error(*st->c, *st->cr, st->rid, error_of(r));
          return answer(*st->c, *st->cr, {st->rid, 0, complete{0, st->done}});
        }
        try {
          st->c->send_data(st->rid, st->done, b, static_cast<std::size_t>(got), [this, b](ucs_status_t) { buffers.give_back(b); });
        } catch (const error& e) {
          buffers.give_back(b);
          return answer_error(*st->c, *st->cr, st->rid, e);
        }
        st->done += got;
        bytes_sent += got;
        if (got < want) st->length = st->done;  // end of file
        stream(st);
      });
    });
  }

  // write_mode::keep of an existing file: its current content is copied into the new version first,
  // a chunk at a time through a data buffer (a file request to read, one to write, each started by
  // the completion of the one before); the open is answered when the copy is done.
  struct keeping {
    std::shared_ptr<connection> c;
    std::shared_ptr<credit> cr;
    std::shared_ptr<write_txn> t;
    std::shared_ptr<ferry::file> from;
    std::uint64_t rid = 0, done = 0;
    std::byte* buf = nullptr;
  };
  void keep(std::shared_ptr<connection> c, const std::shared_ptr<write_txn>& t, const std::shared_ptr<credit>& cr, std::uint64_t rid) {
    auto k = std::make_shared<keeping>();
    k->c = std::move(c), k->cr = cr, k->t = t, k->rid = rid;
    k->from = ferry::file::adopt(root.open_regular(t->path(), O_RDONLY), printable(t->path()), false);
    buffers.take([this, k](std::byte* b) {
      k->buf = b;
      keep_step(k);
    });
  }
  void keep_step(const std::shared_ptr<keeping>& k) {
    auto fail_keep = [this, k](const error& e) {
      buffers.give_back(std::exchange(k->buf, nullptr));
      {
        std::lock_guard l(txn_mu);
        txns.erase(k->t->id());
      }
      answer_error(*k->c, *k->cr, k->rid,
                   error(error_info{e.code(), "store.write", printable(k->t->path()), "cannot copy its current content (write_mode::keep)",
                                    e.what(), e.sys_errno(), 0}));
    };
    if (!k->c->alive() || stopping_now()) return fail_keep(error(errc::cancelled, "store.write", k->c->peer(), "connection gone"));
    file_io(k->from, false, k->done, k->buf, buffers.bytes(), [this, k, fail_keep](const request_result& r) {
      if (r.state != request_state::done) return fail_keep(error_of(r));
      std::uint64_t got = r.bytes_done;
      if (got == 0) {
        buffers.give_back(std::exchange(k->buf, nullptr));
        return answer(*k->c, *k->cr, {k->rid, 0, complete{0, k->t->id()}});
      }
      file_io(k->t->file()->f, true, k->done, k->buf, got, [this, k, fail_keep, got](const request_result& w) {
        if (w.state != request_state::done) return fail_keep(error_of(w));
        k->t->wrote(k->done, got);
        k->done += got;
        keep_step(k);
      });
    });
  }
};

server_options server_options_from(const settings& s) {
  server_options o;
  o.workers = s.serve_workers;
  o.map = s.net_map;
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
  std::uint64_t open_writes = 0;
  {
    std::lock_guard t(i.txn_mu);
    open_writes = i.txns.size();
  }
  std::uint64_t mapped = 0;
  for (auto& [c, s] : i.sessions) mapped += s->mapped.load();
  const detail::door_counts door = i.front ? i.front->counts() : detail::door_counts{};
  server::impl::worker_counts sum;  // the workers' own counts
  for (std::size_t k = 0; k < i.workers.size(); ++k) {
    auto& w = i.counts[k];
    for (auto [to, from] : {std::pair{&sum.requests, &w.requests}, {&sum.reads, &w.reads}, {&sum.writes, &w.writes},
                            {&sum.bytes_sent, &w.bytes_sent}, {&sum.inline_replies, &w.inline_replies},
                            {&sum.mapped_reads, &w.mapped_reads}, {&sum.direct_reads, &w.direct_reads},
                            {&sum.notify_records, &w.notify_records}})
      to->add(from->value());
  }
  return {i.connections.load(),
          sum.requests.value(),
          sum.reads.value(),
          sum.writes.value(),
          i.bytes_sent.load() + sum.bytes_sent.value(),
          i.bytes_received.load(),
          i.errors.load(),
          sum.inline_replies.value(),
          sum.mapped_reads.value(),
          i.sessions.size(),
          i.write_buffered.load(),
          i.direct_reads.load() + sum.direct_reads.value(),
          i.direct_writes.load(),
          mapped,
          i.rma_puts.load(),
          i.rma_gets.load(),
          per_worker(i),
          door.waiting,
          i.refused.load(),
          door.displaced + door.closed_deadline + i.closed_handshake.load(),
          i.closed_idle.load(),
          door.auth_failures,
          open_writes,
          i.commits.load(),
          sum.notify_records.value()};
}

}  // namespace ferry::store
