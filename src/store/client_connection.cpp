// The ferry:// client's connection part (see client_impl.hpp): lanes, the handshake and
// authentication, reconnects, lending memory to a same-host server, the RMA decision.
#include "store/client_impl.hpp"

#include "core/logging.hpp"
#include "store/auth.hpp"
#include "store/door.hpp"

#include <ferry/core/units.hpp>

#include <fmt/format.h>

#include <algorithm>

namespace ferry::store {

client::impl::impl(const std::string& h, std::uint16_t p, client_options opt)
    : o(std::move(opt)), host(h), port(p), peer(fmt::format("{}:{}", h, p)) {
  ferry::detail::make_adaptive(mu);
  if (o.lanes == 0) o.lanes = default_net_lanes();
  if (o.engine) copies.emplace(*o.engine);
  expects(o.piece >= 4096 && o.piece <= max_data, "store.client", peer,
          fmt::format("piece size {} must be between 4KiB and {}", o.piece, max_data));
  expects(o.lanes >= 1 && o.lanes <= 64, "store.client", peer, fmt::format("lanes {} must be between 0 (one per four cores) and 64", o.lanes));
  ctx = std::make_shared<ucx_context>(interface_for(host, false));
  for (int i = 0; i < o.lanes; ++i) {
    auto ln = std::make_unique<lane>();
    ln->index = i;
    ln->w = std::make_unique<ucx_worker>(fmt::format("ferry-client-{}", i), o.spin, ctx);
    auto& w = *ln->w;
    w.on_frame([this, l = ln.get()](connection& c, message m) {
      // The server speaks first on a lane it connected: a hello with the door's ticket.
      if (auto* hi = std::get_if<hello>(&m.b)) return offered(*l, c, std::move(hi->ticket));
      on_frame(std::move(m));
    });
    w.on_reply([this](connection&, message m, const std::byte* d, std::size_t n) { on_inline(std::move(m), d, n); });
    auto sink = [](const piece& pc, std::uint64_t off, std::size_t n) -> void* {
      // (A read_many's answer comes inline only: its buffer is never a data message's target.)
      if (!pc.land || pc.write || pc.direct || !pc.owned.empty() || off > pc.len || n > pc.len - off) return nullptr;
      return pc.land + off;
    };
    auto received = [this](piece& pc, std::size_t n, ucs_status_t s) {
      pc.receiving--;
      if (s != UCS_OK && !pc.err)
        pc.err = error(errc::network_error, "store.read", peer, std::string("data receive failed: ") + ucs_status_string(s));
      pc.received += n;
    };
    w.on_data(
        [this, sink](connection&, std::uint64_t rid, std::uint64_t off, std::size_t n) -> void* {
          std::lock_guard l(mu);
          auto it = pend.find(rid);
          if (it == pend.end() || it->second->settled) return nullptr;
          void* at = sink(*it->second, off, n);
          if (at) it->second->receiving++;  // (its end, `received` below, is always told)
          return at;
        },
        [this, received](connection&, std::uint64_t rid, std::uint64_t, std::size_t n, ucs_status_t s) {
          update(rid, [&](piece& pc) { received(pc, n, s); });
        });
    w.on_idle([this] { tick(); });
    lanes.push_back(std::move(ln));
  }
  if (o.map) {
    try {
      landing = make_landing();
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

client::impl::~impl() {
  shutdown();
  std::lock_guard l(mu);  // network registrations held by unfinished requests go before their cache
  pend.clear();
}

void client::impl::shutdown() {
  std::vector<std::shared_ptr<connection>> close;
  {
    // Submitted requests end (with the connections' closing, those under way); none is sent again.
    std::lock_guard l(mu);
    stopping = true;
    afterwards.clear();
    const error e(errc::cancelled, "store.request", peer, "the client is closing");
    // (From a copy: give_up takes each out of the queue, which moves the others in it.)
    const auto queued = waiting;
    for (const auto& a : queued) give_up(*a, e, close);
    for (auto& [id, a] : live)
      if (a->need_stat) give_up(*a, e, close);
  }
  drain_if_any();
  // A lane's idle look or a pump under way on another thread uses the lanes: it ends before they go
  // (neither starts again once `stopping` is seen). A lane's own thread does not wait for itself.
  if (!in_tick)
    while (ticking.load() || pumping.load()) std::this_thread::yield();
  for (auto& ln : lanes) {
    std::shared_ptr<connection> cn;
    {
      std::lock_guard l(mu);
      cn = ln->c;
    }
    if (cn) cn->close();
  }
  if (!own_thread()) {  // (on a lane's own thread, the requests end as its worker stops)
    std::unique_lock l(mu);
    live_cv.wait_for(l, o.timeout, [&] { return live.empty(); });
  }
  // A copy on ends by its request's deadline at the latest (the engine's bound): its completion
  // must not outlive this client.
  if (copies) copies->wait();
}

bool client::impl::lend_to(lane& ln, const detail::shared_region& r, bool give_back, clk::time_point until) {
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

void client::impl::renew_landing(const std::shared_ptr<detail::landing_region>& spent, clk::time_point until) {
  // Under lend_mu: a request that finds the region spent while another renews it waits here, and
  // then sees the outcome (the fresh region, mapped or not). Each lend waits at most as long as a
  // connection attempt, so that one slow server does not hold the other requests to this one's deadline.
  std::lock_guard g(lend_mu);
  if (current_landing() != spent) return;  // renewed by another request already
  {
    // Requests move data by messages until the lanes map the fresh region.
    std::lock_guard l(mu);
    all_mapped = false;
    for (auto& ln : lanes) ln->mapped = false;
  }
  std::shared_ptr<detail::landing_region> fresh;
  try {
    fresh = make_landing();
  } catch (const error& e) {
    log::warn("store", "{}: no fresh landing region ({}); data moves by messages", peer, e.what());
    return;  // requests find the spent region and go by messages; the next one tries again
  }
  log::info("store", "{}: {} landing slots and records were left unanswered; a fresh landing region replaces them", peer,
            spent->quarantined());
  auto lend_until = [&] { return std::min(until, clk::now() + o.connect_timeout); };
  std::vector<std::pair<lane*, std::shared_ptr<connection>>> up;
  {
    std::lock_guard l(mu);
    for (auto& ln : lanes)
      if (ln->ready && ln->c && ln->c->alive()) up.emplace_back(ln.get(), ln->c);  // the others lend it when they reconnect
  }
  std::vector<std::pair<lane*, std::shared_ptr<connection>>> lent;
  for (auto& [ln, cn] : up) {
    try {
      if (lend_to(*ln, fresh->region(), false, lend_until())) lent.emplace_back(ln, cn);
    } catch (const error& e) {
      log::info("store", "{}: lane {} did not take the fresh landing region ({}); it moves data by messages", peer, ln->index, e.what());
    }
  }
  {
    std::lock_guard l(landing_mu);
    landing = fresh;
  }
  n_renewals++;
  // The servers forget replaced regions once no slot or record of them is held (one taken before
  // the region was spent may not have been sent yet); until then they stay mapped in the sessions
  // that had them. Quarantined slots are never handed out again either way, and jobs still using a
  // region keep their mapping.
  retiring.push_back(spent);
  std::erase_if(retiring, [&](const std::shared_ptr<detail::landing_region>& r) {
    if (r->in_use() != 0) return false;
    for (auto& [ln, cn] : up) {
      try {
        lend_to(*ln, r->region(), true, lend_until());
      } catch (const error& e) {
        log::debug("store", "{}: lane {} did not forget a replaced landing region ({})", peer, ln->index, e.what());
      }
    }
    return true;
  });
  std::lock_guard l(mu);
  // A lane that reconnected meanwhile (or is reconnecting) lends the fresh region itself.
  for (auto& [ln, cn] : lent) ln->mapped = ln->ready && ln->c == cn && cn->alive();
  all_mapped = std::all_of(lanes.begin(), lanes.end(), [](auto& x) { return x->mapped; });
}

void* client::impl::allocate(std::uint64_t bytes) {
  expects(bytes > 0 && bytes <= (1ull << 40), "store.allocate", peer, fmt::format("{} bytes: must be between 1 and 1 TiB", bytes));
  std::lock_guard g(lend_mu);
  auto& u = buffers.make(static_cast<std::size_t>(bytes));
  auto until = clk::now() + o.timeout;
  if (o.map && current_landing()) {  // only where the landing region could be made: a transport that maps regions
    for (auto& ln : lanes) {
      std::shared_ptr<connection> cn;
      {
        std::lock_guard l(mu);
        if (ln->ready) cn = ln->c;
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

void client::impl::deallocate(void* p) {
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

void client::impl::conn_failed(connection* cn, const std::string& why) {
  lane_events.fetch_add(1, std::memory_order_acq_rel);
  std::unique_lock l(mu);
  std::vector<std::shared_ptr<piece>> hit;
  // Closed to end another request: the other pieces it fails are sent again as not their own loss.
  std::shared_ptr<connection> closed_for_another;
  if (auto it = closing.find(cn); it != closing.end()) {
    closed_for_another = std::move(it->second);  // (let go outside mu, below)
    closing.erase(it);
  }
  for (auto& [id, p] : pend)
    if (p->conn == cn) {
      // Not its own loss: closed to end another request, or a connection made before its request
      // was queued (a server gone before it, noticed only now).
      p->victim = closed_for_another != nullptr || (p->owner && p->conn_no <= p->owner->began_after);
      hit.push_back(p);
    }
  for (auto& p : hit) {
    if (!p->err) p->err = error(errc::network_error, "store.request", peer, "connection lost: " + why);
    (void)maybe_settle(p);  // failed: nothing to copy on
  }
  cv.notify_all();
  l.unlock();
  drain_if_any();
}

message client::impl::request(message m, clk::time_point until, bool needs_credit, lane* force, bool ask_caller) {
  auto p = send(std::move(m), std::make_shared<piece>(), needs_credit, until, force);
  wait_piece(p, until, [] { return std::string("request"); }, ask_caller);
  if (p->err) throw *p->err;
  return *p->reply;
}

void client::impl::ensure_connected(clk::time_point until) {
  // Nothing failed or was closed since every lane was last seen alive: no lock, no look at each
  // lane (this runs per request).
  std::uint64_t seen = lane_events.load(std::memory_order_acquire);
  if (seen == lanes_checked.load(std::memory_order_relaxed)) return;
  // One reconnect at a time. A lane's idle look never waits for another's: the one reconnecting may
  // be waiting for this very lane's thread.
  std::unique_lock one(connect_mu, std::defer_lock);
  if (!in_tick) {
    one.lock();
  } else if (!one.try_lock()) {
    fail(errc::busy, "store.connect", peer, "another thread is reconnecting");
  }
  seen = lane_events.load(std::memory_order_acquire);
  if (seen == lanes_checked.load(std::memory_order_relaxed)) return;  // reconnected meanwhile
  {
    // A server just found unreachable is not tried again by every request (an attempt on a dead
    // server may take seconds): they fail at once, with its error, until the retry time; then the
    // first request tries while the others still fail at once (one attempt per period).
    std::lock_guard l(mu);
    if (down_err) {
      const auto now = clk::now();
      if (now < down_until) throw *down_err;
      down_until = now + o.retry_after;
    }
  }
  std::vector<lane*> down;
  for (auto& ln : lanes) {
    std::shared_ptr<connection> cn;
    {
      std::lock_guard l(mu);
      cn = ln->c;
    }
    if (!cn || !cn->alive()) down.push_back(ln.get());
  }
  if (!down.empty()) {
    // The lanes accept only while they are being connected (their listeners refuse until the next one);
    // what else their listeners took is closed.
    auto done_listening = [&] {
      for (lane* ln : down) {
        ln->w->stop_listening();
        std::vector<std::shared_ptr<connection>> extra;
        {
          std::lock_guard l(mu);
          for (auto& c : ln->arrived)
            if (c != ln->c) extra.push_back(c);
          ln->arrived.clear();
          ln->offers.clear();
        }
        for (auto& c : extra) c->close();
      }
    };
    try {
      welcome pass = knock(down, until);
      for (lane* ln : down) {
        if (connected_once) n_reconnects++;
        connect(*ln, pass, until);
      }
    } catch (const error& e) {
      done_listening();
      // Only the server's own failure (refused, reset, unreachable) marks it down: a caller's short
      // deadline running out says nothing about the server.
      if (e.code() == errc::network_error) {
        std::lock_guard l(mu);
        down_err = e;
        down_until = clk::now() + o.retry_after;
      }
      throw;
    }
    done_listening();
  }
  {
    std::lock_guard l(mu);
    down_err.reset();
  }
  connected_once = true;
  lanes_checked.store(seen, std::memory_order_release);  // a failure since `seen` is looked at next time
}

void client::impl::offered(lane& ln, connection& c, std::vector<std::uint8_t> ticket) {
  std::lock_guard l(mu);
  ln.offers.emplace_back(c.shared_from_this(), std::move(ticket));
  cv.notify_all();
}

welcome client::impl::knock(const std::vector<lane*>& down, clk::time_point until) {
  const std::string me = detail::local_address(host, port);
  for (lane* ln : down) {
    std::lock_guard l(mu);
    if (ln->c) ln->c->close();
    ln->c = nullptr;
    ln->ready = false;
    ln->mapped = false;
    all_mapped = false;
    buffers.lane_lost(ln->index);
    ln->arrived.clear();
    ln->offers.clear();
  }
  // The lanes listen once the door took a connection (made then, kept for the attempts after): while
  // a server is gone, reconnecting makes nothing of UCX's. (UCX 1.13 aborts the process when one
  // worker makes a listener with the descriptor number that another, still handling its connection's
  // failure, has just closed and has an event left for: async.c:643, openucx/ucx#9942.)
  std::vector<std::uint16_t> ports;
  auto listen = [&] {
    if (!ports.empty()) return ports;
    std::vector<std::uint16_t> made;
    for (lane* ln : down)
      made.push_back(ln->w->listen(me, 0, [this, ln](std::shared_ptr<connection> c) {
        std::lock_guard l(mu);
        ln->arrived.push_back(std::move(c));
      }));
    return ports = std::move(made);
  };
  for (int attempt = 0;; ++attempt) {
    // A server that died may leave an attempt without any error: it waits for the answer at most
    // FERRY_NET_CONNECT_TIMEOUT, then the server counts as unreachable.
    const clk::time_point attempt_until = std::min(until, clk::now() + o.connect_timeout);
    try {
      struct drive_own {
        explicit drive_own(ucx_worker* w) {
          if (w) detail::knock_waiting = [w] { w->drive([] { return false; }, clk::now() + std::chrono::microseconds(200)); };
        }
        ~drive_own() { detail::knock_waiting = nullptr; }
      } own(own_worker());
      return detail::knock(host, port, o.secret, listen, attempt_until);
    } catch (const error& e) {
      if (e.code() == errc::timeout && attempt_until < until)
        throw error(error_info{errc::network_error, "store.connect", peer, "cannot connect to the storage server",
                               fmt::format("no answer to the handshake within {} (FERRY_NET_CONNECT_TIMEOUT): {}",
                                           format_duration(o.connect_timeout), e.what()),
                               0, 0});
      // Refused outright (nothing listens) is not worth another try; closed during the handshake (a
      // door full of strangers displaced it) is, until the deadline.
      const auto pause = std::chrono::milliseconds(10 << std::min(attempt, 4));
      if (e.code() != errc::network_error || e.sys_errno() == ECONNREFUSED || clk::now() + 2 * pause >= until) throw;
      std::this_thread::sleep_for(pause);
    }
  }
}

void client::impl::connect(lane& ln, const welcome& pass, clk::time_point until) {
  // The server's connection to this lane: the one that said hello with the pass's ticket (a
  // stranger's connection to the lane's port cannot know it).
  const clk::time_point attempt_until = std::min(until, clk::now() + o.connect_timeout);
  std::shared_ptr<connection> cn;
  {
    std::unique_lock l(mu);
    auto found = [&] {
      for (auto& [c, t] : ln.offers)
        if (c->alive() && detail::proof_matches(pass.ticket, t)) return (cn = c, true);
      return false;
    };
    bool ok = false;
    if (ln.w->on_progress_thread()) {
      // The lane's own thread (its idle look reconnecting): what comes on the lane is driven here.
      while (!(ok = found()) && clk::now() < attempt_until) {
        l.unlock();
        ln.w->drive([] { return false; }, std::min(attempt_until, clk::now() + std::chrono::milliseconds(1)));
        l.lock();
      }
    } else {
      ok = cv.wait_until(l, attempt_until, found);
    }
    if (!ok)
      throw error(error_info{attempt_until < until ? errc::network_error : errc::timeout, "store.connect", peer,
                             "cannot connect to the storage server",
                             fmt::format("lane {}: the server did not connect to it within {} (FERRY_NET_CONNECT_TIMEOUT; "
                                         "the server must reach this host at the address it came from)",
                                         ln.index, format_duration(o.connect_timeout)),
                             0, 0});
    ln.c = cn;
    ln.conn_no = ++connects;
  }
  connection* raw = cn.get();
  cn->on_failure([this, raw](const std::string& why) { conn_failed(raw, why); });
  if (!cn->alive()) conn_failed(raw, cn->failure());
  message r;
  try {
    r = request({0, 0, hello{1, 1, 64, {}, static_cast<std::uint16_t>(lanes.size()), pass.ticket, {}}},
                attempt_until, false, &ln);
  } catch (const error& e) {
    cn->close();
    throw error(error_info{e.code() == errc::timeout && attempt_until < until ? errc::network_error : e.code(), "store.connect",
                           peer, "cannot connect to the storage server", fmt::format("lane {}: {}", ln.index, e.what()), 0, 0});
  }
  if (auto* e = std::get_if<error_reply>(&r.b)) fail(errc::network_error, "store.connect", peer, "refused: " + e->message);
  if (!std::holds_alternative<welcome>(r.b)) fail(errc::protocol_error, "store.connect", peer, "unexpected answer to the handshake");
  if (std::get<welcome>(r.b).instance != pass.instance)
    fail(errc::protocol_error, "store.connect", peer, fmt::format("lane {} reached another server than the door that admitted it", ln.index));
  if (ln.index == 0) decide_rma(*cn);
  // The landing region and the caller's buffers (a new session knows none of them), under lend_mu
  // until the lane says what it maps: a region renewed meanwhile is not taken for the one lent here,
  // and nothing else lends on this lane before its handshake is done (`ready`).
  std::lock_guard g(lend_mu);
  auto& w = std::get<welcome>(r.b);
  ln.lending = w.lending;
  ln.token = w.token;
  auto lr = current_landing();
  bool mapped = lr && lend_to(ln, lr->region(), false, until);
  if (lr && buffers.any())
    for (auto* u : buffers.live())
      if (lend_to(ln, *u->r, false, until)) u->lanes.fetch_or(std::uint64_t{1} << ln.index);
  std::lock_guard l(mu);
  if (ln.index == 0) hello_reply = w;
  ln.credits = std::max<std::uint32_t>(1, w.credits);
  ln.ready = true;
  ln.mapped = mapped;
  all_mapped = lr && std::all_of(lanes.begin(), lanes.end(), [](auto& x) { return x->mapped; });
  ln.inflight = 0;
  for (auto& [id, p] : pend)
    if (p->credit && p->conn == raw) ln.inflight++;
  cv.notify_all();
}

void client::impl::decide_rma(connection& cn) {
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

message client::impl::query(message m, std::string_view what, const std::string& path, std::chrono::nanoseconds timeout) {
  auto until = clk::now() + timeout;
  message r = retrying(
      [&] {
        ensure_connected(until);
        // The caller's interrupt check (a stat or listing: nothing of the client's is locked here).
        return request(m, until, true, nullptr, true);
      },
      until);
  if (auto* e = std::get_if<error_reply>(&r.b)) rethrow_reply(*e, what, peer, path);
  return r;
}

}  // namespace ferry::store
