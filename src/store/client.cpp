// The ferry:// client: requests split into pieces (one wire request and one credit each), replies
// matched by request id on the progress thread, pieces that landed in a slot copied on by the
// transfer engine, every wait bounded by the request's deadline.
#include <ferry/mem/pinned_pool.hpp>
#include <ferry/mem/registration.hpp>
#include <ferry/store/service.hpp>
#include <ferry/xfer/engine.hpp>

#include "core/logging.hpp"
#include "net/ucx.hpp"
#include "store/auth.hpp"
#include "store/landing.hpp"
#include "store/lending.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <fstream>
#include <sys/stat.h>
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
  struct piece;
  // One connection to the server with its own UCX worker (progress thread) and credits.
  struct lane {
    int index = 0;
    std::unique_ptr<ucx_worker> w;
    std::shared_ptr<connection> c;                // mu
    std::uint32_t credits = 1, inflight = 0;      // mu
    bool mapped = false;                          // the server mapped our landing region (mu)
    // From its welcome: where to pass regions it may map, and the session's token.
    std::string lending;
    std::vector<std::uint8_t> token;
  };
  // One wire request.
  struct piece {
    std::uint64_t rid = 0;
    lane* ln = nullptr;
    connection* conn = nullptr;
    bool write = false, direct = false, rma = false, lent = false;
    std::shared_ptr<registration> net;  // network registration of the memory an RMA piece uses
    std::byte* rma_mem = nullptr;
    std::byte* land = nullptr;       // where read data lands (the destination, a staging buffer or a landing slot)
    std::uint64_t len = 0;
    std::byte* final_dst = nullptr;  // staged reads: copied here by the transfer engine
    memory_region user;              // staged pieces: the caller's memory, as classified once at the start
    pinned_pool::buffer slot;
    int land_slot = -1;              // slot of the landing region, while the server may use it
    int rec = -1;                    // notify record of a small direct read, while the server may write it
    const std::uint64_t* record = nullptr;  // that record (set before sending)
    clk::time_point until{};         // the request's deadline (its copy on has the same)
    clk::time_point landed{};        // staged reads: when the piece went to the engine
    std::uint64_t received = 0, expect = 0;
    bool replied = false, settled = false, credit = false;
    std::optional<message> reply;
    std::optional<error> err;
    std::atomic<bool> done{false};
    // The thread waiting for it, while it waits (wait_piece): a piece it settles itself, driving
    // its lane, it also copies on itself -- it would only wait for another thread to do it.
    std::atomic<std::thread::id> waiter{};
  };
  // The pieces of one request; most requests are one piece, kept without a vector.
  struct piece_list {
    std::shared_ptr<piece> first;
    std::vector<std::shared_ptr<piece>> rest;
    void push_back(std::shared_ptr<piece> p) {
      if (!first) first = std::move(p);
      else rest.push_back(std::move(p));
    }
    template <typename F>
    void each(F&& f) const {
      if (first) f(first);
      for (auto& p : rest) f(p);
    }
  };
  struct op {
    std::string path;
    bool write = false;
    std::uint64_t offset = 0, length = 0;
    clk::time_point until;
    piece_list pieces;
  };
  // A map whose nodes are recycled: every request inserts and erases one entry in `pend` and in
  // `ops`, and the allocator round trips would cost more than the entries' bookkeeping.
  template <typename K, typename V>
  struct recycling_map {
    std::map<K, V> m;
    std::vector<typename std::map<K, V>::node_type> spare;
    void put(K k, V v) {
      if (spare.empty()) {
        m.insert_or_assign(k, std::move(v));
        return;
      }
      auto nh = std::move(spare.back());
      spare.pop_back();
      nh.key() = k;
      nh.mapped() = std::move(v);
      auto r = m.insert(std::move(nh));
      if (!r.inserted) r.position->second = std::move(r.node.mapped());
    }
    void erase(typename std::map<K, V>::iterator it) {
      auto nh = m.extract(it);
      nh.mapped() = V{};
      if (spare.size() < 64) spare.push_back(std::move(nh));
    }
    void erase(const K& k) {
      auto it = m.find(k);
      if (it != m.end()) erase(it);
    }
    // Removes k's entry and returns its value (moved out), or a default value.
    V take(const K& k) {
      auto it = m.find(k);
      if (it == m.end()) return V{};
      V v = std::move(it->second);
      erase(it);
      return v;
    }
    auto find(const K& k) { return m.find(k); }
    auto begin() { return m.begin(); }
    auto end() { return m.end(); }
    void clear() {
      m.clear();
      spare.clear();
    }
  };

  client_options o;
  std::string host;
  std::uint16_t port;
  std::string peer;
  std::mutex mu;
  std::condition_variable cv;
  std::uint64_t next_id = 1;
  recycling_map<std::uint64_t, std::shared_ptr<piece>> pend;  // by request id, until settled
  recycling_map<ticket, op> ops;
  ticket next_ticket = 1;
  welcome hello_reply;
  bool connected_once = false;
  // Counted under mu, where each request already is (an atomic add each would cost more than the
  // lock on some machines); staged bytes and reconnects by the threads that make them.
  std::uint64_t n_requests = 0, n_pieces = 0, n_read = 0, n_written = 0, n_direct = 0, n_rma = 0, n_lent = 0, n_noticed = 0;
  std::atomic<std::uint64_t> n_staged{0}, n_reconnects{0};
  std::atomic<std::uint64_t> n_staged_pieces{0}, copy_out_ns{0}, n_copied_by_waiter{0};
  std::shared_ptr<ucx_context> ctx;  // the lanes' workers'
  // RMA: memory registered for the network through a registration cache of our own (lazily
  // deregistered, dropped when the memory goes); decided when lane 0 connects.
  std::unique_ptr<ucx_net_client> net_client;
  std::unique_ptr<registration_cache> net_cache;
  std::atomic<bool> use_rma{false};

  // Staging for GPU/sim memory whose data moves by messages: the transfer engine's pinned buffers
  // (set on first use, under buffers_mu); and the copies on of landed pieces the engine still runs:
  // their completions use this client, which waits for them.
  std::atomic<pinned_pool*> staging{nullptr};
  std::mutex buffers_mu;
  std::mutex copies_mu;
  std::condition_variable copies_cv;
  std::uint64_t copies_running = 0;  // copies_mu

  // The landing region lent to the server (shared memory, mapped by a same-host server); null where
  // none could be made or FERRY_NET_MAP is off.
  std::unique_ptr<detail::landing_region> landing;
  // Buffers the caller allocated from this client (allocate); lend_mu orders lending them against
  // (re)connects.
  detail::lent_buffers buffers;
  std::mutex lend_mu;
  // Whether every lane's server mapped the landing region: recomputed when a lane (re)connects, read
  // per request without a lock.
  std::atomic<bool> all_mapped{false};
  // Connection failures (and closes) counted, and the count when every lane was last seen alive:
  // while they are equal, requests skip the per-lane check.
  std::atomic<std::uint64_t> lane_events{1}, lanes_checked{0};

  std::vector<std::unique_ptr<lane>> lanes;  // last: their progress threads (and callbacks) stop first

  impl(const std::string& h, std::uint16_t p, client_options opt)
      : o(std::move(opt)), host(h), port(p), peer(fmt::format("{}:{}", h, p)) {
    expects(o.piece >= 4096 && o.piece <= max_data, "store.client", peer,
            fmt::format("piece size {} must be between 4KiB and {}", o.piece, max_data));
    expects(o.lanes >= 1 && o.lanes <= 64, "store.client", peer, fmt::format("lanes {} must be between 1 and 64", o.lanes));
    ctx = std::make_shared<ucx_context>(interface_for(host, false));
    for (int i = 0; i < o.lanes; ++i) {
      auto ln = std::make_unique<lane>();
      ln->index = i;
      ln->w = std::make_unique<ucx_worker>(fmt::format("ferry-client-{}", i), o.spin, ctx);
      auto& w = *ln->w;
      w.on_frame([this](connection&, message m) { on_frame(std::move(m)); });
      w.on_reply([this](connection&, message m, const std::byte* d, std::size_t n) { on_inline(std::move(m), d, n); });
      auto sink = [](const piece& pc, std::uint64_t off, std::size_t n) -> void* {
        if (!pc.land || pc.write || pc.direct || off > pc.len || n > pc.len - off) return nullptr;
        return pc.land + off;
      };
      auto received = [this](piece& pc, std::size_t n, ucs_status_t s) {
        if (s != UCS_OK && !pc.err)
          pc.err = error(errc::network_error, "store.read", peer, std::string("data receive failed: ") + ucs_status_string(s));
        pc.received += n;
      };
      w.on_data(
          [this, sink](connection&, std::uint64_t rid, std::uint64_t off, std::size_t n) -> void* {
            std::lock_guard l(mu);
            auto it = pend.find(rid);
            return it == pend.end() ? nullptr : sink(*it->second, off, n);
          },
          [this, received](connection&, std::uint64_t rid, std::uint64_t, std::size_t n, ucs_status_t s) {
            std::shared_ptr<piece> due;
            {
              std::lock_guard l(mu);
              auto it = pend.find(rid);
              if (it == pend.end()) return;
              auto pp = it->second;
              received(*pp, n, s);
              due = maybe_settle(pp);
            }
            if (due) copy_out(std::move(due));
          });
      lanes.push_back(std::move(ln));
    }
    if (o.map) {
      int count = static_cast<int>(std::max<std::uint64_t>(2, o.landing / o.piece));
      try {
        landing = std::make_unique<detail::landing_region>(o.piece, count, 256);
      } catch (const error& e) {
        log::info("store", "{}: no landing region ({}); data moves by messages", peer, e.what());
      }
    }
    try {
      ensure_connected(clk::now() + o.timeout);
    } catch (...) {
      shutdown();
      throw;
    }
  }
  ~impl() {
    shutdown();
    std::lock_guard l(mu);  // network registrations held by unfinished requests go before their cache
    ops.clear();
    pend.clear();
  }
  void shutdown() {
    for (auto& ln : lanes) {
      std::shared_ptr<connection> cn;
      {
        std::lock_guard l(mu);
        cn = ln->c;
      }
      if (cn) cn->close();
    }
    // A copy on ends by its request's deadline at the latest (the engine's bound): its completion
    // must not outlive this client.
    std::unique_lock l(copies_mu);
    copies_cv.wait(l, [&] { return copies_running == 0; });
  }

  // Gives a piece's landing slot and notify record back, or keeps them out of use when the server
  // may still write into them.
  void release_land(piece& p) {
    if (p.land_slot >= 0) landing->give_back_slot(std::exchange(p.land_slot, -1), p.replied);
    if (p.rec >= 0) landing->give_back_record(std::exchange(p.rec, -1), p.replied);
  }
  bool direct_available() const { return all_mapped.load(std::memory_order_relaxed); }
  std::size_t home_lane() const {
    thread_local const std::size_t h = std::hash<std::thread::id>{}(std::this_thread::get_id());
    return h % lanes.size();
  }
  std::uint64_t all_lanes() const { return lanes.size() >= 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << lanes.size()) - 1; }
  // Lends (or, with `give_back`, takes back) one region to one lane's server; true if it mapped it.
  // Lending is passing the region's descriptor on the server's lending socket, then naming it on the
  // lane; a server on another host (or network namespace) cannot be reached there.
  bool lend_to(lane& ln, const detail::shared_region& r, bool give_back, clk::time_point until) {
    if (!give_back) {
      std::string why;
      if (!detail::pass_region(ln.lending, ln.token, r.fd(), r.id(), until, why)) {
        log::debug("store", "{}: lane {} lends no memory: {}", peer, ln.index, why);
        return false;
      }
    }
    message lr = request({0, 0, lend{reinterpret_cast<std::uint64_t>(r.data()), give_back ? 0 : r.size(), r.id()}}, until, false, &ln);
    auto* cp = std::get_if<complete>(&lr.b);
    return cp && cp->status == 0 && cp->bytes == 1;
  }
  void* allocate(std::uint64_t bytes) {
    expects(bytes > 0 && bytes <= (1ull << 40), "store.allocate", peer, fmt::format("{} bytes: must be between 1 and 1 TiB", bytes));
    std::lock_guard g(lend_mu);
    auto& u = buffers.make(static_cast<std::size_t>(bytes));
    auto until = clk::now() + o.timeout;
    if (o.map && landing) {  // only where the landing region could be made: a transport that maps regions
      for (auto& ln : lanes) {
        std::shared_ptr<connection> cn;
        {
          std::lock_guard l(mu);
          cn = ln->c;
        }
        if (!cn || !cn->alive()) continue;  // its reconnect lends it
        try {
          if (lend_to(*ln, *u.r, false, until)) u.lanes.fetch_or(std::uint64_t{1} << ln->index);
        } catch (const error& e) {
          log::info("store", "{}: lane {} cannot take buffer {} ({}); requests on it move data by messages", peer, ln->index,
                    static_cast<void*>(u.r->data()), e.what());
        }
      }
    }
    buffers.publish(u);
    return u.r->data();
  }
  void deallocate(void* p) {
    std::lock_guard g(lend_mu);
    auto* u = buffers.withdraw(p);
    if (!u) fail(errc::invalid_argument, "store.deallocate", fmt::format("{}", p), "not a buffer this client allocated (or freed already)");
    // The servers forget it before the memory goes (a region allocated later at the same address
    // must not be taken for this one); a lane that is down has no session holding it any more.
    auto until = clk::now() + o.timeout;
    for (auto& ln : lanes) {
      if (!(u->lanes.load() >> ln->index & 1)) continue;
      try {
        lend_to(*ln, *u->r, true, until);
      } catch (const error& e) {
        log::debug("store", "{}: lane {} did not take buffer {} back ({})", peer, ln->index, p, e.what());
      }
    }
    buffers.retire(*u);  // the memory goes; the entry stays for requests that may still look at it
  }
  // Host memory or not: device-side copies go through the transfer engine (told what the caller's
  // side is, classified when the request started), host ones are a memcpy.
  void copy_bytes(std::byte* dst, const std::byte* src, std::uint64_t n, const memory_region* dst_r = nullptr,
                  const memory_region* src_r = nullptr) {
    if (!o.engine) return void(std::memcpy(dst, src, n));
    transfer_request r{dst, src, n, dst_r, src_r};
    o.engine->copy(r);
  }
  // A finished piece gives back whatever buffer it borrowed (staging buffer, landing slot). mu held.
  void release_buffers(piece& p) {
    p.slot.reset();
    release_land(p);
  }

  // ---- progress threads ----
  // A piece is finished when its reply came and all its data arrived, or when it failed. Called with mu held.
  static bool ready(const piece& p) {
    return p.err || (p.replied && (!p.reply || !std::holds_alternative<complete>(p.reply->b) || p.write || p.received >= p.expect));
  }
  // Settles a piece that is ready. Returns it when its data must still be copied on from where it
  // landed: the caller hands it to copy_out once mu is released.
  [[nodiscard]] std::shared_ptr<piece> maybe_settle(const std::shared_ptr<piece>& pp) {
    piece& p = *pp;
    if (p.settled || !ready(p)) return nullptr;
    p.settled = true;
    // The map's reference moves out (pp may be that very reference): no reference-count traffic.
    std::shared_ptr<piece> keep = pend.take(p.rid);
    if (!keep) keep = pp;
    if (p.credit) {
      p.credit = false;
      p.ln->inflight--;
    }
    if (!p.err && p.reply)
      if (auto* cp = std::get_if<complete>(&p.reply->b)) (p.write ? n_written : n_read) += cp->bytes;
    if (!p.err && !p.write && p.final_dst && p.received) {
      p.landed = clk::now();
      return keep;
    }
    release_buffers(p);
    p.done.store(true, std::memory_order_release);
    cv.notify_all();
    return nullptr;
  }
  // A landed piece's data on to the caller's memory, by the transfer engine; the piece is done, and
  // its slot free, when the copy is. Settled by the thread that waits for it (driving its lane), the
  // copy runs right here (engine.copy runs one copy on its caller's thread; into host memory, a
  // memcpy): that thread would only wait for another to do it. Settled elsewhere (a progress thread), it goes to an engine worker as
  // a batch with a completion, so that the progress thread goes on. Without an engine every
  // destination is host memory: a memcpy here.
  void copy_out(std::shared_ptr<piece> pp) {
    piece& p = *pp;
    const bool here = p.waiter.load(std::memory_order_acquire) == std::this_thread::get_id();
    auto finished = [this, pp](const error* e) {
      auto& q = *pp;
      n_staged_pieces.fetch_add(1, std::memory_order_relaxed);
      copy_out_ns.fetch_add(static_cast<std::uint64_t>((clk::now() - q.landed).count()), std::memory_order_relaxed);
      std::lock_guard l(mu);
      if (e) q.err = *e;
      else n_staged += q.received;
      release_buffers(q);
      q.done.store(true, std::memory_order_release);
      cv.notify_all();
    };
    if (here) n_copied_by_waiter.fetch_add(1, std::memory_order_relaxed);
    // Host memory on the waiting thread: a memcpy, which is all the engine would do there.
    const bool to_host = p.user.type == memory_type::unknown || p.user.type == memory_type::host_pageable ||
                         p.user.type == memory_type::host_pinned;
    if (!o.engine || (here && to_host)) {
      std::memcpy(p.final_dst, p.land, p.received);
      return finished(nullptr);
    }
    transfer_request r{p.final_dst, p.land, p.received, p.user.type == memory_type::unknown ? nullptr : &p.user, buffer_region(p)};
    if (here) {
      try {
        o.engine->copy(r, {p.until});
      } catch (const error& e) {
        return finished(&e);
      }
      return finished(nullptr);
    }
    {
      std::lock_guard l(copies_mu);
      copies_running++;
    }
    o.engine->submit({&r, 1}, {p.until}, [this, finished](std::span<const request_result> res) {
      finished(res[0].err ? &*res[0].err : nullptr);
      std::lock_guard l(copies_mu);
      if (--copies_running == 0) copies_cv.notify_all();
    });
  }

  void on_frame(message m) {
    std::shared_ptr<piece> due;
    {
      std::lock_guard l(mu);
      auto it = pend.find(m.request_id);
      if (it == pend.end()) return;
      const auto& pp = it->second;  // maybe_settle moves it out of the map last
      take_reply(*pp, std::move(m));
      due = maybe_settle(pp);
    }
    if (due) copy_out(std::move(due));
  }
  // A piece's answer (a frame): what it says about the data, kept for finish.
  void take_reply(piece& p, message&& m) {
    if (auto* cp = std::get_if<complete>(&m.b)) {
      if (p.land) p.expect = cp->bytes;  // data still to come by messages (a lend's answer carries none)
      if (cp->status != 0 && !p.err)
        p.err = error(errc::io_error, p.write ? "store.write" : "store.read", peer, fmt::format("server reported status {}", cp->status));
      if (!p.err && cp->bytes > p.len && p.len)
        p.err = error(errc::protocol_error, "store.request", peer, fmt::format("the server claims {} bytes for a {}-byte request", cp->bytes, p.len));
      if ((p.direct || p.rma) && !p.write && !p.err) p.received = cp->bytes;  // already in the landing slot / destination
    }
    p.replied = true;
    p.reply = std::move(m);
  }
  void on_inline(message m, const std::byte* d, std::size_t n) {
    std::shared_ptr<piece> due;
    {
      std::lock_guard l(mu);
      auto it = pend.find(m.request_id);
      if (it == pend.end()) return;
      const auto& pp = it->second;  // maybe_settle moves it out of the map last
      take_inline(*pp, std::move(m), d, n);
      due = maybe_settle(pp);
    }
    if (due) copy_out(std::move(due));
  }
  // A read's notify record, seen: as its completion (the message that follows finds it settled).
  void take_notice(piece& p, std::uint64_t bytes) {
    if (bytes > p.len) {
      p.err = error(errc::protocol_error, "store.read", peer, fmt::format("the server claims {} bytes for a {}-byte request", bytes, p.len));
    } else {
      p.received = p.expect = bytes;
      p.reply = message{p.rid, 0, complete{0, bytes}};
    }
    p.replied = true;
  }
  // A piece's answer with its data inline: copied to where the piece lands.
  void take_inline(piece& p, message&& m, const std::byte* d, std::size_t n) {
    auto* cp = std::get_if<complete>(&m.b);
    if (!cp || p.write || p.direct || cp->bytes != n || n > p.len || (n && !p.land)) {
      if (!p.err) p.err = error(errc::protocol_error, "store.read", peer, "malformed inline reply");
    } else if (n) {
      std::memcpy(p.land, d, n);
      p.received = n;
    }
    p.expect = n;
    p.replied = true;
    p.reply = std::move(m);
  }
  // Runs on the lane's worker (its holder), like every handler.
  void conn_failed(connection* cn, const std::string& why) {
    lane_events.fetch_add(1, std::memory_order_acq_rel);
    std::lock_guard l(mu);
    std::vector<std::shared_ptr<piece>> hit;
    for (auto& [id, p] : pend)
      if (p->conn == cn) hit.push_back(p);
    for (auto& p : hit) {
      if (!p->err) p->err = error(errc::network_error, "store.request", peer, "connection lost: " + why);
      (void)maybe_settle(p);  // failed: nothing to copy on
    }
    cv.notify_all();
  }

  // ---- caller threads ----
  // Registers a piece and sends its frame on `force` or the least loaded lane with a credit.
  // `until` bounds the wait for a credit.
  // `whole`: a request of this one piece, registered under the same lock (its ticket goes to `t`).
  std::shared_ptr<piece> send(message m, std::shared_ptr<piece> p, bool needs_credit, clk::time_point until, lane* force = nullptr,
                              op* whole = nullptr, ticket* t = nullptr) {
    std::unique_lock l(mu);
    lane* ln = force;
    if (needs_credit) {
      // Small pieces stay on the calling thread's own lane while it has credit: the caller drives
      // that lane's worker while it waits, so their replies are handled on this thread, without
      // waking the other lanes' progress threads (spread over four lanes, 4 KiB reads at queue
      // depth 4 took longer than one at a time). Large pieces spread for bandwidth.
      lane* home = p->len <= (64u << 10) && lanes.size() > 1 ? lanes[home_lane()].get() : nullptr;
      auto pick = [&]() -> lane* {
        if (home && home->c && home->c->alive() && home->inflight < home->credits) return home;
        lane* best = nullptr;
        for (auto& x : lanes) {
          if (!x->c || !x->c->alive()) {
            lane_events.fetch_add(1, std::memory_order_acq_rel);  // the next request reconnects it
            continue;
          }
          if (x->inflight < x->credits && (!best || x->inflight < best->inflight)) best = x.get();
        }
        return best;
      };
      if (!cv.wait_until(l, until, [&] { return (ln = pick()) != nullptr; }))
        fail(errc::timeout, "store.request", peer, "no credit from the server before the deadline (all lanes busy or down)");
      ln->inflight++;
      p->credit = true;
    }
    if (!ln) ln = lanes[0].get();
    auto cn = ln->c;
    p->ln = ln;
    p->rid = m.request_id = next_id++;
    p->conn = cn.get();
    pend.put(p->rid, p);
    n_pieces++;
    if (p->rma) n_rma++;
    else if (p->direct) n_direct++;
    if (p->lent) n_lent++;
    if (whole) {
      whole->pieces.push_back(p);
      *t = next_ticket++;
      ops.put(*t, std::move(*whole));
      n_requests++;
    }
    l.unlock();
    try {
      if (!cn) fail(errc::network_error, "store.request", peer, "not connected");
      cn->send_frame(m);
    } catch (const error& e) {
      std::lock_guard g(mu);
      if (!p->err) p->err = e;
      (void)maybe_settle(p);  // failed: nothing to copy on
    }
    return p;
  }
  // Waits for one piece until `until`; on timeout closes its connection so that nothing lands later.
  // `what` names the request in errors; it is built only when one is raised (formatting a string
  // per request would cost more than a shared-memory round trip).
  template <typename What>
  void wait_piece(const std::shared_ptr<piece>& pp, clk::time_point until, const What& what) {
    piece& p = *pp;
    p.waiter.store(std::this_thread::get_id(), std::memory_order_release);
    // Drive the worker from this thread for a while: a small request then completes without any
    // thread hand-off (the progress thread takes over if this one gives up and sleeps). A read the
    // server answered at once into a landing slot also wrote the slot's notify record: seen, the
    // read is done without taking its completion message off the queue.
    const std::uint64_t* record = p.record;
    auto finished = [&] {
      if (p.done.load(std::memory_order_acquire)) return true;
      if (!record || std::atomic_ref<const std::uint64_t>(record[0]).load(std::memory_order_acquire) != p.rid) return false;
      std::shared_ptr<piece> due;
      {
        std::lock_guard l(mu);
        if (!p.settled) {
          take_notice(p, std::atomic_ref<const std::uint64_t>(record[1]).load(std::memory_order_relaxed));
          n_noticed++;
          due = maybe_settle(pp);
        }
      }
      if (due) copy_out(std::move(due));
      return p.done.load(std::memory_order_acquire);
    };
    if (p.ln->w->drive(finished, until, o.spin)) return;
    std::unique_lock l(mu);
    if (cv.wait_until(l, until, [&] { return p.done.load(); })) return;
    auto cn = p.ln->c;
    l.unlock();
    log::warn("store", "{}: {} timed out; closing the connection", peer, what());
    // An RMA piece's memory may still be written by the server: revoke its network key.
    if (p.rma && net_cache) net_cache->invalidate(reinterpret_cast<std::uintptr_t>(p.rma_mem), p.len);
    if (cn) {
      cn->close();
      try {
        p.ln->w->call([] {}, clk::now() + std::chrono::seconds(5));  // the close has run: no more data lands
      } catch (...) {
      }
    }
    l.lock();
    cv.wait_until(l, clk::now() + std::chrono::seconds(5), [&] { return p.done.load(); });
    fail(errc::timeout, "store.request", peer, fmt::format("{}: no answer before the deadline", what()));
  }
  message request(message m, clk::time_point until, bool needs_credit = true, lane* force = nullptr) {
    auto p = send(std::move(m), std::make_shared<piece>(), needs_credit, until, force);
    wait_piece(p, until, [] { return std::string("request"); });
    if (p->err) throw *p->err;
    return *p->reply;
  }

  void ensure_connected(clk::time_point until) {
    // Nothing failed or was closed since every lane was last seen alive: no lock, no look at each
    // lane (this runs per request).
    std::uint64_t seen = lane_events.load(std::memory_order_acquire);
    if (seen == lanes_checked.load(std::memory_order_relaxed)) return;
    for (auto& ln : lanes) {
      std::shared_ptr<connection> cn;
      {
        std::lock_guard l(mu);
        cn = ln->c;
      }
      if (cn && cn->alive()) continue;
      if (connected_once) n_reconnects++;
      connect(*ln, until);
    }
    connected_once = true;
    lanes_checked.store(seen, std::memory_order_release);  // a failure since `seen` is looked at next time
  }
  // (Re)connects one lane before `until`. Lane 0 goes to the server's well-known port; the others
  // to the worker ports its welcome named (each server worker listens on its own port), or, when
  // such a port cannot be reached (a NAT forwarding only the first, say), to the first port too.
  void connect(lane& ln, clk::time_point until) {
    std::uint16_t target = port;
    if (ln.index > 0) {
      std::lock_guard l(mu);
      if (!hello_reply.ports.empty()) target = hello_reply.ports[static_cast<std::size_t>(ln.index - 1) % hello_reply.ports.size()];
    }
    if (target == port) return connect_to(ln, port, until);
    try {
      return connect_to(ln, target, clk::now() + (until - clk::now()) / 2);  // leaves time for the fallback
    } catch (const error& e) {
      log::info("store", "{}: lane {} cannot use the server's port {} ({}); it connects to port {} instead", peer, ln.index,
                target, e.what(), port);
    }
    connect_to(ln, port, until);
  }
  // Connects one lane to `to` and completes its handshake (and lends the landing region).
  void connect_to(lane& ln, std::uint16_t to, clk::time_point until) {
    {
      std::lock_guard l(mu);
      if (ln.c) ln.c->close();
      ln.mapped = false;
      all_mapped = false;
      buffers.lane_lost(ln.index);
    }
    std::shared_ptr<connection> cn;
    connection* raw = nullptr;
    message r;
    auto nonce = detail::random_nonce();
    // A server flooded by connections that never speak closes some still in their handshake to
    // make room (FERRY_SERVE_MAX_UNAUTHENTICATED): a connection lost before the hello is answered
    // is tried again, a few times, within the deadline.
    for (int attempt = 0;; ++attempt) {
      cn = ln.w->connect(host, to, until);
      raw = cn.get();
      cn->on_failure = [this, raw](const std::string& why) { conn_failed(raw, why); };
      {
        std::lock_guard l(mu);
        ln.c = cn;
      }
      try {
        r = request({0, 0, hello{1, 1, 64, nonce, static_cast<std::uint16_t>(lanes.size())}}, until, false, &ln);
        break;
      } catch (const error& e) {
        auto pause = std::chrono::milliseconds(10 << attempt);
        if (e.code() != errc::network_error || attempt >= 4 || clk::now() + 2 * pause >= until)
          throw error(error_info{e.code(), "store.connect", peer, "cannot connect to the storage server", e.what(), 0, 0});
        cn->close();
        std::this_thread::sleep_for(pause);
      }
    }
    if (auto* ch = std::get_if<challenge>(&r.b)) {
      if (o.secret.empty())
        fail(errc::permission_denied, "store.connect", peer, "the server requires a shared secret (FERRY_SECRET_FILE)");
      r = request({0, 0, auth{detail::proof(o.secret, ch->nonce, nonce)}}, until, false, &ln);
      if (auto* e = std::get_if<error_reply>(&r.b))
        fail(errc::permission_denied, "store.connect", peer, "authentication refused: " + e->message);
    }
    if (auto* e = std::get_if<error_reply>(&r.b)) fail(errc::network_error, "store.connect", peer, "refused: " + e->message);
    if (!std::holds_alternative<welcome>(r.b)) fail(errc::protocol_error, "store.connect", peer, "unexpected answer to the handshake");
    if (ln.index > 0) {
      std::lock_guard l(mu);
      if (std::get<welcome>(r.b).instance != hello_reply.instance)
        fail(errc::protocol_error, "store.connect", fmt::format("{}:{}", host, to),
             fmt::format("lane {} reached another server than lane 0 (restarted, or another server on that port)", ln.index));
    }
    {
      auto& w = std::get<welcome>(r.b);
      ln.lending = w.lending;
      ln.token = w.token;
    }
    bool mapped = landing && lend_to(ln, landing->region(), false, until);
    if (ln.index == 0) decide_rma(*cn);
    if (landing && buffers.any()) {  // the caller's buffers too (a new session knows none of them)
      std::lock_guard g(lend_mu);
      for (auto* u : buffers.live())
        if (lend_to(ln, *u->r, false, until)) u->lanes.fetch_or(std::uint64_t{1} << ln.index);
    }
    std::lock_guard l(mu);
    auto& w = std::get<welcome>(r.b);
    if (ln.index == 0) hello_reply = w;
    ln.credits = std::max<std::uint32_t>(1, w.credits);
    ln.mapped = mapped;
    all_mapped = landing && std::all_of(lanes.begin(), lanes.end(), [](auto& x) { return x->mapped; });
    ln.inflight = 0;
    for (auto& [id, p] : pend)
      if (p->credit && p->conn == raw) ln.inflight++;
    cv.notify_all();
  }

  // RMA for bulk data: on request, or (auto) when UCX put a transport with real RMA on the lanes.
  void decide_rma(connection& cn) {
    bool want = o.rma == rma_use::on;
    if (o.rma == rma_use::automatic) {
      // Real RMA: the reliable verbs transports (rc_verbs, rc_mlx5, dc_mlx5); ud_* has none.
      std::string t = cn.transports();
      want = t.find("rc_") != std::string::npos || t.find("dc_") != std::string::npos;
    }
    if (want && !net_cache) {
      net_client = std::make_unique<ucx_net_client>(ctx, o.cache);
      net_cache = std::make_unique<registration_cache>(std::vector<peer_memory_client*>{net_client.get()}, 1ull << 62);
    }
    use_rma = want;
  }

  // Does [p, p+n) need host staging (GPU or sim memory UCX cannot reach)? `r` gets what it is: the
  // one classification of the caller's memory for the whole request.
  bool needs_staging(const void* p, std::uint64_t n, const char* what, memory_region& r) {
    if (!o.cache || n == 0) return false;
    r = o.cache->classify(p, n);
    if (r.type == memory_type::unknown)
      fail(errc::bad_address, what, fmt::format("{}+{}", p, n), "not memory ferry knows (freed, or never mapped?)");
    if (r.type != memory_type::device && r.type != memory_type::unified) return false;
    if (lanes[0]->w->cuda_memory() && r.device == device_kind::cuda) return false;  // UCX registers it itself
    if (!o.engine) fail(errc::invalid_argument, what, r.device_id(), "device memory needs a transfer engine for staging (client_options::engine)");
    if (!staging.load(std::memory_order_acquire)) staging.store(&o.engine->staging_for(r), std::memory_order_release);
    return true;
  }
  // What a piece's buffer is (a landing slot, a staging buffer), as registered: null when unknown.
  const memory_region* buffer_region(const piece& p) {
    if (p.land_slot >= 0) return landing->pinned();
    if (p.slot) return &staging.load(std::memory_order_acquire)->region();
    return nullptr;
  }
  // `handle`: the open write that write pieces fill (0 for reads).
  ticket start(const std::string& path, std::uint64_t offset, std::byte* mem, std::uint64_t length, bool write,
               clk::time_point until, std::uint64_t handle = 0) {
    const char* opname = write ? "store.write" : "store.read";
    if (length && !mem) fail(errc::invalid_argument, opname, path, "null buffer");
    if (offset + length < offset) fail(errc::invalid_argument, opname, path, "offset + length overflows");
    // The caller's allocated buffer, mapped by every lane's server: straight in or out, for any size.
    bool lent = buffers.covers(mem, length, all_lanes());
    memory_region user;
    bool staged = !lent && needs_staging(mem, length, opname, user);
    ensure_connected(until);
    if (write && !hello_reply.writable)
      fail(errc::permission_denied, opname, fmt::format("{} {}", peer, printable(path)), "the server is read-only");
    // Through the landing region when the server maps it: reads always (a small one answered at once
    // also writes the slot's notify record, which the waiter sees before any message: sent inline,
    // the data would cross into this process twice -- the server copies it into UCX's queue, this side
    // takes the message off it); writes of GPU/sim memory and of host memory above the inline size
    // (a small write is one message either way).
    bool direct = lent || (direct_available() && (!write || staged || length > (16u << 10)));
    if (direct && staged && o.cache && landing) landing->pinned(*o.cache, peer);  // pinned once, on first use
    // RMA into/out of the caller's memory, registered for the network (cached); memory UCX cannot
    // register (GPU memory without CUDA support in UCX) keeps the staged path.
    std::shared_ptr<registration> net;
    std::vector<registration::piece> net_pieces;
    if (!direct && !staged && use_rma && net_cache && length > (16u << 10)) {
      try {
        net = std::make_shared<registration>(net_cache->acquire(mem, length));
        net_pieces = net->registered_pieces();
      } catch (const error& e) {
        log::debug("store", "{}: no network registration for {}+{} ({}); data moves by messages", peer, static_cast<void*>(mem), length, e.what());
        net.reset();
      }
    }
    op o2{path, write, offset, length, until, {}};
    // Staged through the engine's buffers, a piece is at most one of them.
    pinned_pool* pool = staged && !direct ? staging.load(std::memory_order_acquire) : nullptr;
    const std::uint64_t piece_len = pool ? std::min<std::uint64_t>(o.piece, pool->buffer_bytes()) : o.piece;
    // A read of one piece (most small ones) is registered with its piece, under one lock.
    bool one_piece = !write && length <= piece_len && !net;
    ticket registered = 0;
    try {
      std::uint64_t off = 0;
      do {
        std::uint64_t n = std::min<std::uint64_t>(piece_len, length - off);
        auto p = std::make_shared<piece>();
        p->write = write;
        p->until = until;
        message m;
        const registration::piece* rp = nullptr;
        if (net && n) {
          auto a = reinterpret_cast<std::uintptr_t>(mem + off);
          for (auto& x : net_pieces)
            if (a >= x.addr && a < x.addr + x.bytes) rp = &x;
          if (rp) n = std::min<std::uint64_t>(n, rp->addr + rp->bytes - a);  // one wire piece, one network key
        }
        p->len = n;
        if (rp) {
          auto key = ucx_net_client::rkey_of(rp->cookie);
          std::vector<std::uint8_t> rk(reinterpret_cast<const std::uint8_t*>(key.data()), reinterpret_cast<const std::uint8_t*>(key.data()) + key.size());
          auto addr = reinterpret_cast<std::uint64_t>(mem + off);
          p->rma = true;
          p->net = net;
          p->rma_mem = mem + off;
          m = {0, 0, write ? body{write_rma{path, offset + off, n, addr, std::move(rk), handle}} : body{read_rma{path, offset + off, n, addr, std::move(rk)}}};
        } else if (direct && n) {
          p->direct = true;
          if (lent) {
            p->land = mem + off;
            p->lent = true;
          } else {
            p->land_slot = landing->take_slot(until, peer);
            p->land = landing->slot(p->land_slot);
            if (write) {
              copy_bytes(p->land, mem + off, n, buffer_region(*p), user.type == memory_type::unknown ? nullptr : &user);
            } else {
              p->final_dst = mem + off;
              p->user = user;
            }
          }
          auto addr = reinterpret_cast<std::uint64_t>(p->land);
          if (!write && n <= (16u << 10) && landing && (p->rec = landing->try_take_record()) >= 0) p->record = landing->record(p->rec);
          m = {0, 0, write ? body{write_from{path, offset + off, n, addr, handle}}
                           : body{read_into{path, offset + off, n, addr, reinterpret_cast<std::uint64_t>(p->record)}}};
        } else {
          if (staged) {
            p->slot = pool->get(until);
            if (write) copy_bytes(p->slot.data(), mem + off, n, buffer_region(*p), &user);
            else p->final_dst = mem + off, p->user = user;
            p->land = p->slot.data();
          } else {
            p->land = mem ? mem + off : nullptr;
          }
          m = {0, 0, write ? body{write_req{path, offset + off, n, handle}} : body{read_req{path, offset + off, n}}};
        }
        if (one_piece) {
          p = send(std::move(m), std::move(p), true, until, nullptr, &o2, &registered);
          return registered;
        }
        p = send(std::move(m), std::move(p), true, until);
        o2.pieces.push_back(p);
        if (write && n && !p->direct && !p->rma) {
          // Data follows the frame, on the same connection, in messages of at most max_data (the server's limit).
          std::shared_ptr<connection> cn;
          {
            std::lock_guard l(mu);
            cn = p->ln->c;
          }
          for (std::uint64_t d = 0; cn && d < n; d += max_data) {
            std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(max_data, n - d));
            auto pp = p;
            cn->send_data(p->rid, d, p->land + d, k, [this, pp](ucs_status_t s) {
              if (s == UCS_OK) return;
              std::lock_guard l(mu);
              if (!pp->err) pp->err = error(errc::network_error, "store.write", peer, std::string("data send failed: ") + ucs_status_string(s));
              (void)maybe_settle(pp);  // a write: nothing to copy on
            });
          }
        }
        off += n;
      } while (off < length);
    } catch (...) {
      // Pieces already on the wire may still land: wait for them (bounded) before the buffer is given back.
      o2.pieces.each([&](const std::shared_ptr<piece>& p) {
        try {
          wait_piece(p, until, [] { return std::string("request"); });
        } catch (...) {
        }
      });
      throw;
    }
    std::lock_guard l(mu);
    ticket t = next_ticket++;
    ops.put(t, std::move(o2));
    n_requests++;
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
    x.pieces.each([&](const std::shared_ptr<piece>& p) {
      try {
        wait_piece(p, x.until, [&] { return fmt::format("{} {} offset {}", opname, printable(x.path), x.offset); });
      } catch (const error& e) {
        if (!first) first = e;
      }
    });
    if (first) throw *first;
    // A read counts up to its first short piece only: there the file ended when that piece was
    // served, and a later piece served before the file shrank holds bytes after a gap -- never
    // data the caller can take as contiguous.
    std::uint64_t total = 0;
    bool ended = false;
    x.pieces.each([&](const std::shared_ptr<piece>& p) {
      std::uint64_t n = outcome(*p, opname, x.path);
      if (!ended) total += n;
      ended = ended || n < p->len;
    });
    return total;
  }
  // A settled piece's bytes, or the error it ended with (naming the peer and path).
  std::uint64_t outcome(const piece& p, const char* opname, const std::string& path) {
    if (p.err) {
      if (p.err->code() == errc::network_error || p.err->code() == errc::timeout) throw *p.err;
      throw error(error_info{p.err->code(), opname, fmt::format("{} {}", peer, printable(path)), "", p.err->what(), 0, 0});
    }
    if (auto* e = std::get_if<error_reply>(&p.reply->b)) rethrow_reply(*e, opname, peer, path);
    auto bytes = std::get<complete>(p.reply->b).bytes;
    if (p.write && bytes != p.len)
      fail(errc::io_error, opname, fmt::format("{} {}", peer, printable(path)), fmt::format("the server wrote {} of {} bytes", bytes, p.len));
    return bytes;
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
client::ticket client::start_write(const write_handle& h, std::uint64_t offset, const void* src, std::uint64_t length,
                                   clk::time_point until) {
  if (!h.id) fail(errc::invalid_argument, "store.write", h.path, "not an open write (use open_write)");
  // The buffer is only read (sent), never written.
  return impl_->start(h.path, offset, static_cast<std::byte*>(const_cast<void*>(src)), length, true, until, h.id);
}
std::uint64_t client::finish(ticket t) { return impl_->finish(t); }
void* client::allocate(std::uint64_t bytes) { return impl_->allocate(bytes); }
void client::deallocate(void* buffer) { impl_->deallocate(buffer); }

std::uint64_t client::read(const std::string& path, std::uint64_t offset, void* dst, std::uint64_t length,
                           std::chrono::nanoseconds timeout) {
  return read(path, offset, dst, length, clk::now() + timeout);
}
std::uint64_t client::read(const std::string& path, std::uint64_t offset, void* dst, std::uint64_t length,
                           clk::time_point until) {
  return impl_->retrying(
      [&] {
        return finish(start_read(path, offset, dst, length, until));
      },
      until);
}

client::write_handle client::open_write(const std::string& path, net::write_mode mode, std::chrono::nanoseconds timeout,
                                        std::uint64_t size_hint) {
  if (!impl_->hello_reply.writable)
    fail(errc::permission_denied, "store.write", fmt::format("{} {}", impl_->peer, printable(path)), "the server is read-only");
  auto r = impl_->query({0, 0, net::open_write{path, mode, size_hint}}, "store.write", path, timeout);
  auto* cp = std::get_if<complete>(&r.b);
  if (!cp || cp->bytes == 0) fail(errc::protocol_error, "store.write", impl_->peer, "open_write was not answered with a handle");
  return {cp->bytes, path};
}

void client::write(const write_handle& h, std::uint64_t offset, const void* src, std::uint64_t length,
                   std::chrono::nanoseconds timeout) {
  // Not retried: the open write goes with a lost connection (the caller starts it again).
  finish(start_write(h, offset, src, length, clk::now() + timeout));
}

std::uint64_t client::commit(const write_handle& h, std::optional<std::uint64_t> size, std::chrono::nanoseconds timeout) {
  // Sent once: a commit that may have happened is not repeated blindly; an error names the path.
  auto until = clk::now() + timeout;
  impl_->ensure_connected(until);
  auto r = impl_->request({0, 0, net::end_write{h.id, size.value_or(0), size ? net::write_end::commit_size : net::write_end::commit}}, until);
  if (auto* e = std::get_if<error_reply>(&r.b)) rethrow_reply(*e, "store.commit", impl_->peer, h.path);
  auto* cp = std::get_if<complete>(&r.b);
  if (!cp) fail(errc::protocol_error, "store.commit", impl_->peer, "commit was not answered with a completion");
  return cp->bytes;
}

void client::abort(const write_handle& h, std::chrono::nanoseconds timeout) noexcept {
  try {
    auto until = clk::now() + timeout;
    impl_->ensure_connected(until);
    impl_->request({0, 0, net::end_write{h.id, 0, net::write_end::abort}}, until);
  } catch (const error& e) {
    log::debug("store", "{}: abort of the write to {}: {}", impl_->peer, printable(h.path), e.what());
  }
}

void client::put(const std::string& path, const void* src, std::uint64_t length, std::chrono::nanoseconds timeout) {
  auto until = clk::now() + timeout;
  impl_->retrying(
      [&] {
        auto h = open_write(path, net::write_mode::replace, until - clk::now(), length);
        try {
          finish(start_write(h, 0, src, length, until));
        } catch (...) {
          abort(h, std::chrono::seconds(1));
          throw;
        }
        auto n = commit(h, length, until - clk::now());
        if (n != length)
          fail(errc::io_error, "store.commit", fmt::format("{} {}", impl_->peer, printable(path)),
               fmt::format("the server committed {} of {} bytes", n, length));
        return n;
      },
      until);
}

stat_reply client::stat(const std::string& path, std::chrono::nanoseconds timeout) {
  return std::get<stat_reply>(impl_->query({0, 0, stat_req{path}}, "store.stat", path, timeout).b);
}

std::vector<list_entry> client::list(const std::string& path, std::chrono::nanoseconds timeout) {
  return std::get<list_reply>(impl_->query({0, 0, list_req{path}}, "store.list", path, timeout).b).entries;
}

client_stats client::stats() const {
  auto& i = *impl_;
  std::uint64_t wakeups = 0;
  for (auto& ln : i.lanes) wakeups += ln->w->wakeups();
  bool direct = i.direct_available();
  std::unique_lock l(i.mu);
  client_stats s{i.n_requests, i.n_pieces, i.n_read, i.n_written, i.n_staged.load(),
                 i.n_reconnects.load(), wakeups, i.lanes[0]->w->cuda_memory(), "",
                 direct ? "mapped landing region (server reads/writes it in place; shared memory)"
                        : "active messages (rendezvous above the eager limit)",
                 static_cast<int>(i.lanes.size()), i.n_direct, i.landing ? i.landing->quarantined() : 0, i.n_rma, i.use_rma.load(), i.n_lent,
                 i.n_noticed, i.n_copied_by_waiter.load(), i.n_staged_pieces.load(), i.copy_out_ns.load()};
  std::shared_ptr<connection> cn = i.lanes[0]->c;
  l.unlock();
  if (s.rma && !direct) s.data_path = "RMA into registered client memory (server puts reads, gets writes)";
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
  struct ::stat st{};
  if (::stat(path.c_str(), &st) == 0 && (st.st_mode & 0077))
    log::warn("store", "secret file {} is readable by group or others (mode {:o}); chmod 600 it", path, st.st_mode & 07777);
  if (s.size() < 16)
    log::warn("store", "the secret in {} is only {} bytes; use at least 16 random bytes (e.g. head -c 32 /dev/urandom | base64)", path, s.size());
  return s;
}

client_options client_options_from(const settings& s, registration_cache* cache, transfer_engine* engine) {
  client_options o;
  o.timeout = s.deadline;
  if (!s.secret_file.empty()) o.secret = read_secret_file(s.secret_file);
  o.cache = cache;
  o.engine = engine;
  o.piece = s.net_piece;
  o.landing = s.net_landing;
  o.spin = s.net_spin;
  o.lanes = s.net_lanes;
  o.map = s.net_map;
  o.rma = s.net_rma;
  return o;
}

}  // namespace ferry::store
