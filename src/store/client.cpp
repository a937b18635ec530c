// The ferry:// client's data path (see client_impl.hpp for its parts): requests split into pieces
// (one wire request and one credit each), replies matched by request id on the progress thread,
// pieces that landed in a slot copied on by the transfer engine, every wait bounded by the request's
// deadline.
#include "store/client_impl.hpp"

#include <ferry/store/secret.hpp>

#include "core/logging.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace ferry::store {

[[noreturn]] void rethrow_reply(const error_reply& e, std::string_view op, const std::string& peer, const std::string& path) {
  errc code = errc_from_errno(e.code);
  throw error(error_info{code, std::string(op), fmt::format("{} {}", peer, printable(path)), "the server refused", e.message,
                         e.code, 0});
}

void client::impl::release_land(piece& p, bool server_may_write) {
  if (server_may_write) n_quarantined += (p.land_slot >= 0) + (p.rec >= 0);
  // The region itself stays with the piece: its waiter may still be looking at the notify record.
  if (p.land_slot >= 0) p.region->give_back_slot(std::exchange(p.land_slot, -1), !server_may_write);
  if (p.rec >= 0) p.region->give_back_record(std::exchange(p.rec, -1), !server_may_write);
}

void client::impl::copy_bytes(std::byte* dst, const std::byte* src, std::uint64_t n, bool to_user, const memory_region& user,
                              const memory_region* buf, clk::time_point until) {
  // Memory never classified (no registration cache) is the engine's to classify: it may be a GPU's.
  const bool user_on_host = user.type == memory_type::host_pageable || user.type == memory_type::host_pinned;
  if (!o.engine || user_on_host) return void(std::memcpy(dst, src, n));
  const memory_region* u = user.type == memory_type::unknown ? nullptr : &user;
  transfer_request r{dst, src, n, to_user ? u : buf, to_user ? buf : u};
  o.engine->copy(r, {until});
}

void client::impl::release_buffers(piece& p) {
  p.slot.reset();
  release_land(p, !p.replied);
}

std::shared_ptr<client::impl::piece> client::impl::maybe_settle(const std::shared_ptr<piece>& pp) {
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
  // The client moved: a submitted request waiting behind this one is not idle. (No clock read for
  // a synchronous call's piece when no request is submitted.)
  if (!p.err && !live.empty()) moved_at = clk::now();
  if (p.owner && !p.err) {  // a submitted request's deadline by progress moves on (owner: still under way)
    p.owner->moved_at = moved_at;
    if (p.owner->r.moved) p.owner->r.moved();
    // Cancelled meanwhile: the lanes' look gives it up at its next turn, not at its next quiet moment
    // (a lane busy with the request's own pieces may have none before they are all in).
    // (mu held: a shutdown that stops the lanes has not begun while `stopping` is false.)
    if (!stopping && p.owner->r.cancelled && p.owner->r.cancelled()) lanes[0]->w->kick();
  }
  // An answer (not a refusal): the caller's hook takes its ranges (copy_out), then the slot goes back.
  if (!p.err && p.answer && p.reply && std::holds_alternative<complete>(p.reply->b)) return keep;
  if (!p.err && !p.write && p.final_dst && p.received) {
    p.landed = clk::now();
    return keep;
  }
  release_buffers(p);
  p.done.store(true, std::memory_order_release);
  cv.notify_all();
  ended(p);
  return nullptr;
}

void client::impl::answer_ranges(const std::shared_ptr<piece>& pp) {
  piece& p = *pp;
  // The hook leaves the piece here: it is let go after the client's lock (its captures may hold the
  // caller's last references).
  range_answer hook = std::move(p.answer);
  std::optional<error> bad;
  const std::size_t n = p.range_len.size();
  const std::byte* a = p.land;
  std::vector<std::uint64_t> counts(n);
  if (p.received != p.len) {
    bad = error(errc::protocol_error, "store.read", peer, fmt::format("an answer of {} bytes for {} ranges of {}", p.received, n, p.len));
  } else {
    for (std::size_t i = 0; i < n && !bad; ++i) {
      for (int k = 0; k < 8; ++k) counts[i] |= static_cast<std::uint64_t>(a[8 * i + k]) << (8 * k);
      if (counts[i] > p.range_len[i])
        bad = error(errc::protocol_error, "store.read", peer, fmt::format("the server claims {} bytes for a {}-byte range", counts[i], p.range_len[i]));
    }
  }
  if (!bad) {
    const std::byte* data = a + 8 * n;
    try {
      for (std::size_t i = 0; i < n; ++i) {
        hook(i, data, counts[i]);
        data += p.range_len[i];
      }
    } catch (const std::exception& e) {  // (a hook must not throw: its request fails instead)
      bad = error(errc::internal, "store.read", peer, std::string("the caller's answer hook threw: ") + e.what());
    } catch (...) {
      bad = error(errc::internal, "store.read", peer, "the caller's answer hook threw");
    }
  }
  {
    std::lock_guard l(mu);
    if (bad) p.err = std::move(bad);
    else p.counts = std::move(counts);
    release_land(p, false);  // answered: the server is done with the slot
    p.done.store(true, std::memory_order_release);
    cv.notify_all();
    ended(p);
  }
  drain_if_any();
}

void client::impl::copy_out(std::shared_ptr<piece> pp) {
  piece& p = *pp;
  if (!p.range_len.empty()) return answer_ranges(pp);
  const bool here = p.waiter.load(std::memory_order_acquire) == std::this_thread::get_id();
  auto finished = [this, pp](const error* e) {
    auto& q = *pp;
    n_staged_pieces.fetch_add(1, std::memory_order_relaxed);
    copy_out_ns.fetch_add(static_cast<std::uint64_t>((clk::now() - q.landed).count()), std::memory_order_relaxed);
    {
      std::lock_guard l(mu);
      if (e) q.err = *e;
      else n_staged += q.received;
      release_buffers(q);
      q.done.store(true, std::memory_order_release);
      cv.notify_all();
      ended(q);
    }
    drain_if_any();
  };
  // A small piece for host memory is a short memcpy: cheaper right here than the hand-off to an
  // engine worker and back (a GPU cache's misses land hundreds at a time in pinned host memory).
  const bool small_host =
      p.received <= small_piece && (p.user.type == memory_type::host_pageable || p.user.type == memory_type::host_pinned);
  if (here || !o.engine || small_host) {
    if (here) n_copied_by_waiter.fetch_add(1, std::memory_order_relaxed);
    try {
      copy_bytes(p.final_dst, p.land, p.received, true, p.user, buffer_region(p), p.until);
    } catch (const error& e) {
      return finished(&e);
    }
    return finished(nullptr);
  }
  copies->start({p.final_dst, p.land, p.received, p.user.type == memory_type::unknown ? nullptr : &p.user, buffer_region(p)}, p.until,
                [finished](const error* e) {
                  // (The client's shutdown waits for this very completion: nothing it runs may end the client.)
                  struct own {
                    own() { in_copy_end = true; }
                    ~own() { in_copy_end = false; }
                  } mark;
                  finished(e);
                });
}

void client::impl::on_frame(message m) {
  std::uint64_t rid = m.request_id;
  update(rid, [&](piece& p) { take_reply(p, std::move(m)); });
}

void client::impl::take_reply(piece& p, message&& m) {
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

void client::impl::on_inline(message m, const std::byte* d, std::size_t n) {
  std::uint64_t rid = m.request_id;
  update(rid, [&](piece& p) { take_inline(p, std::move(m), d, n); });
}

void client::impl::take_notice(piece& p, std::uint64_t bytes) {
  if (bytes > p.len) {
    p.err = error(errc::protocol_error, "store.read", peer, fmt::format("the server claims {} bytes for a {}-byte request", bytes, p.len));
  } else {
    p.received = p.expect = bytes;
    p.reply = message{p.rid, 0, complete{0, bytes}};
  }
  p.replied = true;
}

void client::impl::take_inline(piece& p, message&& m, const std::byte* d, std::size_t n) {
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

std::shared_ptr<client::impl::piece> client::impl::send(message m, std::shared_ptr<piece> p, bool needs_credit, clk::time_point until, lane* force,
                                                        op* whole, bool wait, bool* all_down) {
  std::unique_lock l(mu);
  lane* ln = force;
  if (needs_credit) {
    // Small pieces stay on the calling thread's own lane while it has credit: the caller drives
    // that lane's worker while it waits, so their replies are handled on this thread, without
    // waking the other lanes' progress threads (spread over four lanes, 4 KiB reads at queue
    // depth 4 took longer than one at a time). Large pieces whose data travels on the lane (by
    // messages or RMA) spread for bandwidth; a direct piece's data does not (the server reads or
    // writes the landing region or a lent buffer itself), and it follows its request's first piece
    // while that lane has credit: spread over the lanes, one request's pieces keep a progress
    // thread busy on each lane and on each server worker for nothing (the server's file engine
    // copies them in parallel whichever worker took them). docs/design/storage-service.md.
    // (Not ranges in one request: their caller waits for none of them, and spread over the lanes,
    // their answers are handed over on several threads at once.)
    lane* home = p->prefer                                                  ? p->prefer
                 : p->len <= small_piece && lanes.size() > 1 && !p->answer ? lanes[home_lane()].get()
                                                                           : nullptr;
    // Credit comes back with the answers of a lane that is up. With every lane down none will come,
    // and only a request reconnects (ensure_connected): the request fails at once with what the
    // connection died of, and the caller's retry reconnects -- waiting for credit here held it (and
    // a stream-ordered read behind it) until the deadline.
    bool any_up = false;
    std::string lost;
    // (A lane whose connection is being closed to end a request counts as up -- its credits come
    // back as its closing fails its pieces -- but takes nothing more: what went there would fail too.)
    // A lane being connected again has its new connection before its handshake is done: it takes
    // requests only once `ready` (the server refuses a request before the handshake), and counts as
    // up meanwhile (its credits come with the welcome).
    auto usable = [&](const lane& x) { return x.ready && (closing.empty() || !closing.contains(x.c.get())); };
    auto pick = [&]() -> lane* {
      any_up = false;
      if (home && home->c && home->c->alive() && home->inflight < home->credits && usable(*home)) return home;
      lane* best = nullptr;
      for (auto& x : lanes) {
        if (!x->c || !x->c->alive()) {
          lane_events.fetch_add(1, std::memory_order_acq_rel);  // the next request reconnects it
          if (x->c && lost.empty()) lost = x->c->failure();
          continue;
        }
        any_up = true;
        if (x->inflight < x->credits && usable(*x) && (!best || x->inflight < best->inflight)) best = x.get();
      }
      return best;
    };
    if (!wait) {
      ln = pick();
      if (all_down) *all_down = !any_up;
      if (!ln) return nullptr;
    }
    if (wait) {
      // On a lane's own thread (its idle look: a stat, a deferred commit) nothing else takes that
      // lane's answers, which give its credits back: this thread drives its worker meanwhile.
      ucx_worker* own = own_worker();
      while ((ln = pick()) == nullptr && any_up) {
        if (clk::now() >= until)
          fail(errc::timeout, "store.request", peer, "no credit from the server before the deadline (all lanes busy)");
        if (!own) {
          cv.wait_until(l, until);
          continue;
        }
        l.unlock();
        (void)own->drive(
            [&] {
              std::lock_guard g(mu);
              return pick() != nullptr || !any_up;
            },
            std::min(until, clk::now() + std::chrono::milliseconds(10)));
        l.lock();
      }
    }
    if (!ln)
      fail(errc::network_error, "store.request", peer, "connection lost" + (lost.empty() ? std::string(" (every lane is down)") : ": " + lost));
    ln->inflight++;
    p->credit = true;
  }
  if (!ln) ln = lanes[0].get();
  auto cn = ln->c;
  p->ln = ln;
  p->rid = m.request_id = next_id++;
  p->conn = cn.get();
  p->conn_no = ln->conn_no;
  pend.put(p->rid, p);
  n_pieces++;
  if (p->rma) n_rma++;
  else if (p->direct) n_direct++;
  if (p->lent) n_lent++;
  if (whole) {
    whole->pieces.push_back(p);
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

bool client::impl::needs_staging(const void* p, std::uint64_t n, const char* what, memory_region& r) {
  if (!o.cache || n == 0) return false;
  r = o.cache->classify(p, n);
  if (r.type == memory_type::unknown)
    fail(errc::bad_address, what, fmt::format("{}+{}", p, n), "not memory ferry knows (freed, or never mapped?)");
  if (r.type != memory_type::device && r.type != memory_type::unified) return false;
  if (lanes[0]->w->cuda_memory() && r.device == device_kind::cuda) return false;  // UCX registers it itself
  if (!o.engine) fail(errc::invalid_argument, what, r.device_id(), "device memory needs a transfer engine for staging (client_options::engine)");
  return true;
}

const memory_region* client::impl::buffer_region(const piece& p) {
  if (p.land_slot >= 0) return p.region->pinned();
  if (p.slot) return &p.slot.region();
  return nullptr;
}

void client::impl::plan_request(plan& pl, clk::time_point until, bool connect) {
  pl.opname = pl.write ? "store.write" : "store.read";
  if (pl.length && !pl.mem) fail(errc::invalid_argument, pl.opname, pl.path, "null buffer");
  if (pl.offset + pl.length < pl.offset) fail(errc::invalid_argument, pl.opname, pl.path, "offset + length overflows");
  // The caller's allocated buffer, mapped by every lane's server: straight in or out, for any size.
  pl.lent = buffers.covers(pl.mem, pl.length, all_lanes());
  pl.staged = !pl.lent && needs_staging(pl.mem, pl.length, pl.opname, pl.user);
  if (connect) ensure_connected(until);
  if (pl.write && !hello_reply.writable)
    fail(errc::permission_denied, pl.opname, fmt::format("{} {}", peer, printable(pl.path)), "the server is read-only");
  // Through the landing region when the server maps it: reads always (a small one answered at once
  // also writes the slot's notify record, which the waiter sees before any message: sent inline,
  // the data would cross into this process twice -- the server copies it into UCX's queue, this side
  // takes the message off it); writes of GPU/sim memory and of host memory above the inline size
  // (a small write is one message either way).
  // The region is looked up only where it may be used (a client across hosts never maps one), and
  // before the decision: one replaced meanwhile is found spent below, and its successor taken.
  if (pl.lent || direct_available()) {
    pl.lr = current_landing();
    pl.direct = pl.lent || !pl.write || pl.staged || pl.length > (16u << 10);
  }
  if (pl.direct && pl.staged && o.cache && pl.lr) pl.lr->pinned(*o.cache, peer);  // pinned once, on first use
  // RMA into/out of the caller's memory, registered for the network (cached); memory UCX cannot
  // register (GPU memory without CUDA support in UCX) keeps the staged path.
  if (!pl.direct && !pl.staged && use_rma && net_cache && pl.length > (16u << 10)) {
    try {
      pl.net = std::make_shared<registration>(net_cache->acquire(pl.mem, pl.length));
      pl.net_pieces = pl.net->registered_pieces();
    } catch (const error& e) {
      log::debug("store", "{}: no network registration for {}+{} ({}); data moves by messages", peer, static_cast<void*>(pl.mem),
                 pl.length, e.what());
      pl.net.reset();
    }
  }
  // Staged through the engine's buffers, a piece is at most one of them (also through the landing
  // region: a request whose region is replaced may go on through them).
  pl.pool = pl.staged ? &o.engine->staging_for(pl.user) : nullptr;
  pl.piece_len = pl.pool ? std::min<std::uint64_t>(o.piece, pl.pool->buffer_bytes()) : o.piece;
}

std::shared_ptr<client::impl::piece> client::impl::next_piece(plan& pl, message& m, clk::time_point until, bool wait) {
  const bool write = pl.write;
  const std::uint64_t off = pl.off;
  std::byte* const mem = pl.mem;
  std::uint64_t n = std::min<std::uint64_t>(pl.piece_len, pl.length - off);
  auto p = std::make_shared<piece>();
  p->write = write;
  p->until = until;
  const registration::piece* rp = nullptr;
  if (pl.net && n) {
    auto a = reinterpret_cast<std::uintptr_t>(mem + off);
    for (auto& x : pl.net_pieces)
      if (a >= x.addr && a < x.addr + x.bytes) rp = &x;
    if (rp) n = std::min<std::uint64_t>(n, rp->addr + rp->bytes - a);  // one wire piece, one network key
  }
  p->len = n;
  if (!rp && pl.direct && n && !pl.lent) {
    // A slot of the landing region. A spent region (half its slots lost to requests the server
    // never answered) is replaced; where not every lane maps its successor yet, the rest of the
    // request moves data by messages. Without waiting: a slot free now, else none (the lanes' idle
    // look renews a spent region).
    while ((p->land_slot = wait ? pl.lr->take_slot(n, until, peer) : pl.lr->try_take_slot(n)) < 0) {
      if (!wait) {
        if (pl.lr->spent()) {
          // Renewed since the request was planned (it waited in the queue): the fresh region.
          if (auto fresh = current_landing(); fresh && fresh != pl.lr && !fresh->spent()) {
            pl.lr = fresh;
          } else {
            renew_wanted = true;
            kick();
            return nullptr;
          }
        } else {
          return nullptr;  // a slot given back pumps the queue again
        }
      } else {
        renew_landing(pl.lr, until);
        pl.lr = current_landing();
      }
      if (!direct_available()) {
        log::info("store", "{}: {} {}: the rest by messages until every lane maps the fresh landing region", peer, pl.opname,
                  printable(pl.path));
        pl.direct = false;
        break;
      }
      if (pl.staged && o.cache) pl.lr->pinned(*o.cache, peer);
    }
    if (p->land_slot >= 0) p->region = pl.lr;
  }
  const std::string& path = pl.path;
  const std::uint64_t at = pl.offset + off;
  if (rp) {
    auto key = ucx_net_client::rkey_of(rp->cookie);
    std::vector<std::uint8_t> rk(reinterpret_cast<const std::uint8_t*>(key.data()), reinterpret_cast<const std::uint8_t*>(key.data()) + key.size());
    auto addr = reinterpret_cast<std::uint64_t>(mem + off);
    p->rma = true;
    p->net = pl.net;
    p->rma_mem = mem + off;
    m = {0, 0, write ? body{write_rma{path, at, n, addr, std::move(rk), pl.handle}} : body{read_rma{path, at, n, addr, std::move(rk), pl.handle}}};
  } else if (pl.direct && n) {
    p->direct = true;
    p->prefer = pl.first_lane;
    if (pl.lent) {
      p->land = mem + off;
      p->lent = true;
    } else {
      p->land = pl.lr->slot(p->land_slot);
      if (write) {
        copy_bytes(p->land, mem + off, n, false, pl.user, buffer_region(*p), until);
      } else {
        p->final_dst = mem + off;
        p->user = pl.user;
      }
    }
    auto addr = reinterpret_cast<std::uint64_t>(p->land);
    auto& lr = pl.lr;
    if (!write && n <= (16u << 10) && lr && (!p->region || p->region == lr) && (p->rec = lr->try_take_record()) >= 0) {
      p->region = lr;
      p->record = lr->record(p->rec);
    }
    m = {0, 0, write ? body{write_from{path, at, n, addr, pl.handle}}
                     : body{read_into{path, at, n, addr, reinterpret_cast<std::uint64_t>(p->record), pl.handle}}};
  } else {
    if (pl.staged) {
      p->slot = wait ? pl.pool->get(until) : pl.pool->try_get();
      if (!p->slot) return nullptr;
      if (write) copy_bytes(p->slot.data(), mem + off, n, false, pl.user, buffer_region(*p), until);
      else p->final_dst = mem + off, p->user = pl.user;
      p->land = p->slot.data();
    } else {
      p->land = mem ? mem + off : nullptr;
    }
    m = {0, 0, write ? body{write_req{path, at, n, pl.handle}} : body{read_req{path, at, n, pl.handle}}};
  }
  return p;
}

void client::impl::send_write_data(const std::shared_ptr<piece>& p) {
  if (!p->write || !p->len || p->direct || p->rma) return;
  // Data follows the frame, on the same connection, in messages of at most max_data (the server's limit).
  std::shared_ptr<connection> cn;
  {
    std::lock_guard l(mu);
    cn = p->ln->c;
  }
  for (std::uint64_t d = 0; cn && d < p->len; d += max_data) {
    std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(max_data, p->len - d));
    auto pp = p;
    cn->send_data(p->rid, d, p->land + d, k, [this, pp](ucs_status_t s) {
      if (s == UCS_OK) return;
      {
        std::lock_guard l(mu);
        if (!pp->err) pp->err = error(errc::network_error, "store.write", peer, std::string("data send failed: ") + ucs_status_string(s));
        (void)maybe_settle(pp);  // a write: nothing to copy on
      }
      drain_if_any();
    });
  }
}

client::impl::op client::impl::start(const std::string& path, std::uint64_t offset, std::byte* mem, std::uint64_t length,
                                     bool write, clk::time_point until, std::uint64_t handle) {
  plan pl;
  pl.path = path;
  pl.write = write;
  pl.offset = offset;
  pl.length = length;
  pl.handle = handle;
  pl.mem = mem;
  plan_request(pl, until, true);
  op o2{path, write, offset, length, until, {}};
  // A read of one piece (most small ones) is counted with its piece, under one lock.
  bool one_piece = !write && length <= pl.piece_len && !pl.net;
  // The piece being made until it is registered: a failure before then gives its landing slot and
  // record back (the server never saw them), so that they are neither lost nor quarantined.
  std::shared_ptr<piece> unsent;
  try {
    do {
      message m;
      auto p = next_piece(pl, m, until, true);
      unsent = p;
      if (one_piece) {
        p = send(std::move(m), std::move(p), true, until, nullptr, &o2);
        unsent.reset();
        return o2;
      }
      p = send(std::move(m), std::move(p), true, until);
      unsent.reset();
      if (!pl.first_lane) pl.first_lane = p->ln;
      o2.pieces.push_back(p);
      send_write_data(p);
      pl.off += p->len;
      pl.sent_any = true;
    } while (!pl.sent_all());
  } catch (...) {
    if (unsent) {
      std::lock_guard l(mu);
      release_land(*unsent, false);  // never sent: the server never saw its slot
    }
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
  n_requests++;
  return o2;
}

std::uint64_t client::impl::finish(op& x) {
  const char* opname = x.write ? "store.write" : "store.read";
  std::optional<error> first;
  x.pieces.each([&](const std::shared_ptr<piece>& p) {
    if (p->done.load(std::memory_order_acquire)) return;  // (a submitted request's, when it ends: all of them)
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

std::uint64_t client::impl::outcome(const piece& p, const char* opname, const std::string& path) {
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

client::client(const std::string& host, std::uint16_t port, std::chrono::nanoseconds timeout, std::string secret)
    : client(host, port, client_options{timeout, std::move(secret)}) {}
client::client(const std::string& host, std::uint16_t port, client_options o)
    : impl_(std::make_unique<impl>(host, port, std::move(o))) {}
client::~client() = default;
const std::string& client::peer() const noexcept { return impl_->peer; }
bool client::writable() const noexcept { return impl_->hello_reply.writable; }

std::shared_ptr<client::impl::piece> client::impl::reads_piece(net::read_many& m, range_answer answer, clk::time_point until,
                                                               std::shared_ptr<detail::landing_region> lr, int slot) {
  auto p = std::make_shared<piece>();
  p->until = until;
  p->len = net::read_many_answer_bytes(m.ranges);
  p->answer = std::move(answer);
  p->range_len.reserve(m.ranges.size());
  for (const auto& g : m.ranges) p->range_len.push_back(g.length);
  // On the same host the server writes the answer into the slot and sends only its completion: no
  // answer crosses UCX, and nothing is allocated here for it. The slot goes back when the hook has
  // taken the answer.
  if (slot >= 0) {
    p->land_slot = slot;
    p->region = std::move(lr);
    p->land = p->region->slot(slot);
    p->direct = true;
    m.into = reinterpret_cast<std::uint64_t>(p->land);
  } else {
    p->owned.resize(p->len);
    p->land = p->owned.data();
  }
  return p;
}

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
        // One piece is one request, from one file; more pieces name the version a stat found, and
        // what the file held then is what the read must return.
        std::optional<net::stat_reply> st;
        if (length > impl_->o.piece) st = stat(path, until - clk::now());
        impl::op x = impl_->start(path, offset, static_cast<std::byte*>(dst), length, false, until, st ? st->version : 0);
        std::uint64_t got = impl_->finish(x);
        std::uint64_t held = st && st->size > offset ? std::min(length, st->size - offset) : 0;
        if (got < held)
          fail(errc::io_error, "store.read", fmt::format("{} {} offset {}", impl_->peer, printable(path), offset + got),
               fmt::format("the file ended after {} of the {} bytes it held when the read began (it shrank under the read)", got, held));
        return got;
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

std::uint64_t client::impl::write_now(const write_handle& h, std::uint64_t offset, const void* src, std::uint64_t length,
                                      clk::time_point until) {
  if (!h.id) fail(errc::invalid_argument, "store.write", h.path, "not an open write (use open_write)");
  // The buffer is only read (sent), never written.
  op x = start(h.path, offset, static_cast<std::byte*>(const_cast<void*>(src)), length, true, until, h.id);
  return finish(x);
}

void client::write(const write_handle& h, std::uint64_t offset, const void* src, std::uint64_t length,
                   std::chrono::nanoseconds timeout) {
  // Not retried: the open write goes with a lost connection (the caller starts it again).
  impl_->write_now(h, offset, src, length, clk::now() + timeout);
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
          impl_->write_now(h, 0, src, length, until);
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

int client::lent_file(const std::string& path, std::uint64_t version, std::chrono::nanoseconds timeout) {
  auto& I = *impl_;
  if (!I.o.files || !I.o.map) return -1;
  // An answer comes at once unless the server's open waits on its file system: then this file is
  // read through the server after a connection attempt's wait, not the caller's whole timeout.
  const auto until = clk::now() + std::min(timeout, std::chrono::duration_cast<std::chrono::nanoseconds>(I.o.connect_timeout));
  try {
    I.ensure_connected(until);
  } catch (const error& e) {  // (its reads say what is wrong with the server)
    log::debug("store", "{}: {} is not lent: {}", I.peer, printable(path), e.what());
    return -1;
  }
  if (I.no_lending_at.load(std::memory_order_relaxed) == I.connects.load(std::memory_order_relaxed) + 1) return -1;
  // Any connected lane's session serves: the socket and the token come with its welcome.
  std::string name;
  std::vector<std::uint8_t> token;
  {
    std::lock_guard g(I.lend_mu);
    for (auto& ln : I.lanes)
      if (!ln->lending.empty() && !ln->token.empty()) {
        name = ln->lending;
        token = ln->token;
        break;
      }
  }
  std::string why;
  bool none = false;
  int fd = detail::ask_file(name, token, path, until, why, &none);
  if (none) I.no_lending_at.store(I.connects.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  if (fd < 0) {
    log::debug("store", "{}: {} is read through the server: {}", I.peer, printable(path), why);
    return -1;
  }
  struct ::stat st{};
  if (version && (::fstat(fd, &st) != 0 || net::file_version(st.st_dev, st.st_ino) != version)) {
    log::debug("store", "{}: {} was replaced since it was looked up: read through the server", I.peer, printable(path));
    ::close(fd);
    return -1;
  }
  return fd;
}

std::vector<list_entry> client::list(const std::string& path, std::chrono::nanoseconds timeout) {
  std::vector<list_entry> all;
  list_req q{path, ""};
  for (;;) {  // page by page, in name order, each its own deadline
    auto page = std::get<list_reply>(impl_->query({0, 0, q}, "store.list", path, timeout).b);
    if (page.more && (page.entries.empty() || page.entries.back().name <= q.after))
      fail(errc::protocol_error, "store.list", path, "the server's listing does not move past " + q.after);
    for (auto& e : page.entries) all.push_back(std::move(e));
    if (!page.more) return all;
    q.after = all.back().name;
  }
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
                 static_cast<int>(i.lanes.size()), i.n_direct, i.n_quarantined, i.n_rma, i.use_rma.load(), i.n_lent,
                 i.n_noticed, i.n_copied_by_waiter.load(), i.n_staged_pieces.load(), i.copy_out_ns.load(), i.n_renewals.load()};
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

// Refused, as sshd refuses its keys: a file others can read (the secret is theirs too), or a secret short
// enough to guess. The checks look at the descriptor read, not the path again.
std::string read_secret_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) fail_errno(errno, "store.secret", path, "cannot read the secret file");
  struct fd_closer {
    int fd;
    ~fd_closer() { ::close(fd); }
  } closer{fd};
  struct ::stat st{};
  if (::fstat(fd, &st) != 0) fail_errno(errno, "store.secret", path, "cannot read the secret file (fstat)");
  if (!S_ISREG(st.st_mode)) fail(errc::invalid_argument, "store.secret", path, "the secret file is not a regular file");
  if (st.st_mode & 0077)
    fail(errc::permission_denied, "store.secret", path,
         fmt::format("the secret file is readable or writable by group or others (mode {:o}); run: chmod 600 {}",
                     st.st_mode & 07777, path));
  if (st.st_size > (1 << 20)) fail(errc::invalid_argument, "store.secret", path, "the secret file is over 1 MiB");
  std::string s(static_cast<std::size_t>(st.st_size), '\0');
  std::size_t got = 0;
  while (got < s.size()) {
    ssize_t n = ::pread(fd, s.data() + got, s.size() - got, static_cast<off_t>(got));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail_errno(errno, "store.secret", path, "cannot read the secret file");
    if (n == 0) break;
    got += static_cast<std::size_t>(n);
  }
  s.resize(got);
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  if (s.empty()) fail(errc::invalid_argument, "store.secret", path, "the secret file is empty");
  if (s.size() < 16)
    fail(errc::invalid_argument, "store.secret", path,
         fmt::format("the secret is only {} bytes; use at least 16 random bytes: head -c 32 /dev/urandom | base64 > {} && chmod 600 {}",
                     s.size(), path, path));
  return s;
}

client_options client_options_from(const store_settings& s, registration_cache* cache, transfer_engine* engine) {
  client_options o;
  o.timeout = s.deadline;
  if (!s.secret_file.empty()) o.secret = read_secret_file(s.secret_file);
  o.cache = cache;
  o.engine = engine;
  o.piece = s.net_piece;
  o.landing = s.net_landing;
  o.spin = s.net_spin;
  o.retry_after = s.net_retry_after;
  o.connect_timeout = s.net_connect_timeout;
  o.lanes = s.net_lanes;
  o.map = s.net_map;
  o.files = s.net_files;
  o.rma = s.net_rma;
  return o;
}

std::string_view data_route(const client_stats& s) {
  return s.direct_pieces ? "mapped landing region" : s.rma_pieces ? "RMA" : "messages";
}

}  // namespace ferry::store
