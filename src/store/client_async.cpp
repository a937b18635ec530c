// The ferry:// client's submitted requests (see client_impl.hpp for its parts): a queue of requests
// waiting for credits, landing slots or staging buffers, started by whichever thread gives one back;
// completions told on the thread that ends a request; the lanes' idle look for what must wait
// (deadlines, cancels, a reconnect, a stat, a landing region's renewal). No thread of its own: the
// lanes' progress threads carry it.
#include "store/client_impl.hpp"

#include "core/logging.hpp"
#include "store/lost_connection.hpp"

#include <fmt/format.h>

#include <cstring>

namespace ferry::store {

thread_local bool client::impl::in_tick = false;
thread_local bool client::impl::in_copy_end = false;

namespace {
// The end of the run of reads from `at` that may go as one request with it: same file and version,
// at most impl::together_most of them and impl::together_bytes in all; `ok(k)` says whether the k-th may.
template <typename At, typename Ok>
std::size_t run_end(std::size_t at, std::size_t n, const At& item, const Ok& ok) {
  const auto& first = item(at);
  std::uint64_t bytes = first.r.length;
  std::size_t j = at + 1;
  while (j < n && j - at < client::impl::together_most && bytes + item(j).r.length <= client::impl::together_bytes && ok(j) &&
         item(j).r.path == first.r.path &&
         item(j).r.version == first.r.version)
    bytes += item(j++).r.length;
  return j;
}

// A request being told: its completion, taken with the caller's other functions, which go with it --
// a batch's requests share one allocation, which lives as long as the last of them (what the
// functions capture need not).
auto let_go(client::request& r) {
  r.cancelled = nullptr;
  r.moved = nullptr;
  return std::exchange(r.done, nullptr);
}

// Each submitted request's error names the peer, the path and the offset it failed at.
error request_error(errc code, const client::request& r, const std::string& peer, std::uint64_t at, std::string_view why) {
  return error(code, r.write ? "store.write" : "store.read", fmt::format("{} {} offset {}", peer, printable(r.path), at), std::string(why));
}
}  // namespace

std::shared_ptr<client::impl::notice> client::impl::notice_for(std::uint64_t id) {
  auto n = std::make_shared<notice>();
  n->fn = [this, id] {
    std::lock_guard e(ended_mu);
    ended_ids.push_back(id);
    async_work = true;
  };
  return n;
}

void client::submit(request r) { impl_->submit({&r, 1}); }
void client::submit(std::span<request> rs) noexcept { impl_->submit(rs); }
bool client::defer(std::function<void()> f) {
  auto& I = *impl_;
  {
    std::lock_guard l(I.mu);
    if (I.stopping) return false;
    I.afterwards.push_back(std::move(f));
  }
  I.kick();
  return true;
}
bool client::own_thread() const noexcept { return impl_->own_thread(); }
bool client::may_wait() const noexcept { return impl::in_tick || !impl_->own_thread(); }

void client::impl::submit(std::span<client::request> rs) noexcept {
  const auto now = clk::now();
  auto as_error = [&](const std::exception& e) {
    return dynamic_cast<const error*>(&e) ? *dynamic_cast<const error*>(&e) : error(errc::out_of_memory, "store.request", peer, e.what());
  };
  auto tell = [](client::request& r, const error& e) {
    if (r.done) r.done(0, &e);
  };
  // Made first, then queued under one lock: the requests of a batch are all in the queue before a
  // pump looks (a lane's, on a credit given back, may run meanwhile), so that its small reads go
  // together (gather) rather than in whatever handful had been queued by then.
  std::vector<std::shared_ptr<async_op>> made;
  std::vector<std::pair<std::shared_ptr<async_op>, error>> refused;
  try {
    made.reserve(rs.size());
    refused.reserve(rs.size());
    // One allocation for the batch (each request's pointer shares it): the thread that submits pays
    // for every allocation, and the lanes that end the requests for every free.
    auto block = std::make_shared<async_op[]>(rs.size());
    std::uint64_t id = next_async.fetch_add(rs.size());
    for (std::size_t i = 0; i < rs.size(); ++i) {
      std::shared_ptr<async_op> a(block, &block[i]);
      a->r = std::move(rs[i]);
      a->moved_at = now;
      a->began_after = connects.load(std::memory_order_acquire);
      // Several pieces of a file that may change come from one version of it: a stat first (the
      // lanes' idle look makes it: it waits for an answer).
      a->need_stat = !a->r.write && !a->r.version && a->r.length > o.piece;
      a->id = id++;
      made.push_back(std::move(a));  // (its notice once it is sent alone or ended unsent: ends_of)
    }
  } catch (const std::exception& e) {
    const error err = as_error(e);
    for (auto& a : made) tell(a->r, err);
    for (std::size_t i = made.size(); i < rs.size(); ++i) tell(rs[i], err);
    return;
  }
  // Small reads of one file into host memory next to each other in the batch go as one request,
  // joined here: a read queued alone costs an entry in `live` and in the queue, made and taken
  // again by the pump's gather -- most of what a batch's read costs the thread that submits it.
  // The requests are made outside the lock (the lanes take it for every answer), which is held
  // only to queue them.
  std::vector<std::shared_ptr<async_op>> units;  // groups, and reads that go alone
  if (made.size() == 1) units = std::move(made);  // (nothing to join)
  else try {
    std::vector<char> may_group(made.size());
    memory_region known{};
    for (std::size_t i = 0; i < made.size(); ++i) may_group[i] = groupable(*made[i], known);
    if (refused_ranges.load(std::memory_order_acquire)) {
      std::lock_guard l(mu);
      for (std::size_t i = 0; i < made.size(); ++i) may_group[i] = may_group[i] && !one_by_one.contains(made[i]->r.path);
    }
    units.reserve(made.size());
    for (std::size_t i = 0; i < made.size();) {
      std::size_t j = i + 1;
      if (may_group[i])
        j = run_end(i, made.size(), [&](std::size_t k) -> const async_op& { return *made[k]; }, [&](std::size_t k) { return may_group[k] != 0; });
      if (j - i > 1) units.push_back(make_group(std::span(made).subspan(i, j - i)));
      else units.push_back(made[i]);
      i = j;
    }
  } catch (const std::exception&) {
    try {
      units = made;  // (memory: each goes alone, as the pump's gather finds them)
    } catch (const std::exception& e) {
      const error err = as_error(e);
      for (auto& a : made) tell(a->r, err);
      return;
    }
  }
  {
    std::lock_guard l(mu);
    for (auto& a : units) {
      auto refuse = [&](const error& e) {
        if (!a->grp) return void(refused.emplace_back(a, e));
        for (auto& m : a->grp->members) refused.emplace_back(m, e);
      };
      if (stopping) {
        refuse(error(errc::cancelled, "store.request", peer, "the client is closing"));
        continue;
      }
      try {
        live.emplace(a->id, a);
        if (a->need_stat) stat_wanted = true;  // (queued once the idle look has its version)
        else waiting.push_back(a);
      } catch (const std::exception& e) {
        live.erase(a->id);
        refuse(as_error(e));
      }
    }
    async_work = true;
  }
  for (auto& [a, e] : refused) tell(a->r, e);
  // One request the caller sends itself (a synchronous read waits for it: a hand-off would only add
  // a thread's wake to its latency). Many a lane sends, running what ended meanwhile: the submitting
  // thread (a GPU cache's proxy) only queues, as its cost per request bounds how fast it can ask --
  // one hand-off per batch, none while a pump is under way (it looks at the queue again before it
  // stops).
  if (rs.size() == 1) {
    pump();
    drain_if_any();
  } else {
    pump_again = true;
    if (!pumping.load()) lanes[next_pump.fetch_add(1, std::memory_order_relaxed) % lanes.size()]->w->post([this] {
      pump();
      drain_if_any();
    });
  }
  if (stat_wanted.exchange(false)) kick();
}

void client::impl::kick() {
  lane* to = lanes[0].get();
  {
    std::lock_guard l(mu);
    if (stopping) return;  // (the lanes are going)
    for (auto& ln : lanes)
      if (!ln->c || !ln->c->alive()) {
        to = ln.get();
        break;
      }
  }
  to->w->kick();
}

bool client::impl::groupable(const async_op& x, memory_region& known) const {
  if (x.r.write || x.lost || x.grp || x.need_stat || x.ended || x.planned || x.r.length == 0 || x.r.length > net::max_read_range) return false;
  if (!o.cache) return true;
  // A batch's reads land mostly in one buffer (a GPU cache's staging area): one classification
  // serves them all, each a look-up under the registration cache's lock.
  if (known.type == memory_type::unknown || !known.contains(reinterpret_cast<std::uintptr_t>(x.r.mem), x.r.length))
    known = o.cache->classify(x.r.mem, x.r.length);
  return known.type == memory_type::host_pageable || known.type == memory_type::host_pinned;
}

std::shared_ptr<client::impl::async_op> client::impl::make_group(std::span<const std::shared_ptr<async_op>> members) {
  const std::size_t j = members.size();
  const auto& first = members.front();
  auto g = std::make_shared<async_op>();
  g->grp = std::make_shared<group>();
  g->grp->state.reset(new std::atomic<int>[j]);
  g->grp->got.resize(j);
  g->grp->members.reserve(j);
  g->r.path = first->r.path;
  g->r.version = first->r.version;
  g->r.until = clk::time_point::min();
  g->moved_at = clk::now();
  g->began_after = first->began_after;
  for (std::size_t i = 0; i < j; ++i) {
    const auto& m = members[i];
    g->began_after = std::min(g->began_after, m->began_after);
    g->grp->state[i].store(group::open);
    g->r.until = std::max(g->r.until, m->deadline());  // each member ends at its own (the idle look)
    g->grp->members.push_back(m);
  }
  g->id = next_async++;
  g->ends = notice_for(g->id);
  g->planned = true;
  return g;
}

std::shared_ptr<client::impl::async_op> client::impl::gather(std::size_t& taken) {
  // mu held. What the queue holds at its front of one file -- reads alone, and groups not sent yet
  // (a batch's, joined as it was submitted) -- goes as one request: batches of a few reads each,
  // queued while the lanes were busy, still make full requests.
  taken = 0;
  if (waiting.size() < 2) return nullptr;  // (nothing to join: a request submitted alone asks nothing more)
  memory_region known{};
  const async_op& front = *waiting.front();
  if (one_by_one.contains(front.r.path)) return nullptr;
  std::vector<std::shared_ptr<async_op>> members;
  std::uint64_t bytes = 0;
  std::size_t j = 0;
  for (; j < waiting.size(); ++j) {
    const auto& x = waiting[j];
    if (x->r.path != front.r.path || x->r.version != front.r.version) break;
    if (unsent_group(*x)) {
      // Its reads still open (the lanes' look may have ended some at their deadlines: told already).
      std::size_t n = 0;
      std::uint64_t b = 0;
      for (std::size_t k = 0; k < x->grp->members.size(); ++k)
        if (x->grp->at(k) == group::open) ++n, b += x->grp->members[k]->r.length;
      if (members.size() + n > together_most || bytes + b > together_bytes) break;
      for (std::size_t k = 0; k < x->grp->members.size(); ++k)
        if (x->grp->at(k) == group::open) members.push_back(x->grp->members[k]);
      bytes += b;
    } else if (groupable(*x, known)) {
      if (members.size() + 1 > together_most || bytes + x->r.length > together_bytes) break;
      members.push_back(x);
      bytes += x->r.length;
    } else {
      break;
    }
  }
  if (j < 2 || members.size() < 2) return nullptr;
  auto g = make_group(members);
  for (std::size_t i = 0; i < j; ++i) live.erase(waiting[i]->id);  // (a group taken in is dropped untold: its reads are g's)
  live.emplace(g->id, g);
  taken = j;
  return g;
}

bool client::impl::split_group(const std::shared_ptr<async_op>& a, std::size_t keep) {
  std::lock_guard l(mu);
  if (stopping || a->gave_up) return false;  // (the shutdown's sweep, or the look, has it: nothing new is queued)
  auto& ms = a->grp->members;
  std::vector<std::shared_ptr<async_op>> rest;
  std::shared_ptr<async_op> g;
  try {
    for (std::size_t i = keep; i < ms.size(); ++i)
      if (a->grp->at(i) == group::open) rest.push_back(ms[i]);  // (the others ended at their deadlines: told)
    if (!rest.empty()) {
      g = make_group(rest);
      live.emplace(g->id, g);
      auto at = std::find(waiting.begin(), waiting.end(), a);
      waiting.insert(at == waiting.end() ? waiting.end() : std::next(at), g);
    }
  } catch (const std::exception&) {
    if (g) live.erase(g->id);
    return false;
  }
  ms.resize(keep);
  return true;
}

bool client::impl::advance(const std::shared_ptr<async_op>& a, bool& all_down) {
  async_op& x = *a;
  if (x.grp) {
    // On one host the answer lands in a slot of the landing region, taken now: a group slot (sized for
    // a whole answer), else any that holds it. A group of more reads than any free slot holds goes with
    // those the smallest slot holds (the others stay queued as a group of their own), and with no slot
    // free it waits for one: an answer sent by messages costs the server and the lanes far more than
    // that wait, and every answer gives a slot back.
    std::shared_ptr<detail::landing_region> lr;
    int slot = -1;
    if (direct_available()) {
      lr = current_landing();
      if (lr && lr->spent()) {  // (renewed by the lanes' idle look: a submitted request cannot wait for it here)
        renew_wanted = true;
        kick();
        lr = nullptr;
      }
    }
    // The slot taken, until the piece has it.
    struct held_slot {
      std::shared_ptr<detail::landing_region>& lr;
      int& slot;
      ~held_slot() {
        if (lr && slot >= 0) lr->give_back_slot(std::exchange(slot, -1), true);
      }
    } hold{lr, slot};
    if (lr) {
      const auto& ms = x.grp->members;
      std::uint64_t all = 0, fit = 0;
      std::size_t k = 0;
      for (auto& mb : ms) all += 8 + mb->r.length;
      for (; k < ms.size() && fit + 8 + ms[k]->r.length <= lr->smallest_slot(); ++k) fit += 8 + ms[k]->r.length;
      if ((slot = lr->try_take_group_slot(all)) < 0 && (slot = lr->try_take_slot(all)) < 0 && k > 0 && k < ms.size() &&
          (slot = lr->try_take_slot(fit)) >= 0 && !split_group(a, k))
        lr->give_back_slot(std::exchange(slot, -1), true);
      // A group whose first read no small slot holds comes by messages when no slot is free: it would
      // wait for the few piece-sized slots, which the synchronous reads' waits take first.
      if (slot < 0 && k > 0) return false;
      if (slot < 0) lr = nullptr;
    }
    std::vector<net::read_range> ranges;
    ranges.reserve(x.grp->members.size());
    for (auto& m : x.grp->members) ranges.push_back({m->r.offset, m->r.length});
    net::read_many m{x.r.path, x.r.version, std::move(ranges)};
    // Each read's bytes go into its memory as the answer comes, on the thread that takes it, unless
    // the idle look ended the read first.
    auto answer = [g = x.grp](std::size_t i, const std::byte* data, std::uint64_t n) {
      if (!g->take(i, group::copying)) return;
      std::memcpy(g->members[i]->r.mem, data, n);
      g->got[i] = n;
      g->state[i].store(group::answered, std::memory_order_release);
    };
    auto p = reads_piece(m, std::move(answer), x.r.until, lr, slot);
    slot = -1;  // (the piece's now)
    p->owner = a.get();
    p->ends = x.ends;
    x.ends->left.fetch_add(1, std::memory_order_relaxed);
    {
      op sent_as{x.r.path, false, x.grp->members.front()->r.offset, p->len, x.r.until, {}};
      std::lock_guard l(mu);  // (the look reads x.x under it)
      x.x = std::move(sent_as);
    }
    auto sent = send({0, 0, std::move(m)}, p, true, x.r.until, nullptr, nullptr, false, &all_down);
    if (!sent) {
      x.ends->left.fetch_sub(1, std::memory_order_relaxed);
      std::lock_guard l(mu);
      release_land(*p, false);
      return false;
    }
    std::lock_guard l(mu);
    x.x.pieces.push_back(sent);
    n_requests++;
    return true;
  }
  while (!x.pl.sent_all()) {
    {
      std::lock_guard l(mu);
      if (x.gave_up) return false;
    }
    message m;
    const auto until = std::min(x.deadline(), clk::now() + o.timeout);  // (a bound for the copies on)
    auto p = next_piece(x.pl, m, until, false);
    if (!p) return false;
    p->owner = a.get();
    p->ends = x.ends;
    x.ends->left.fetch_add(1, std::memory_order_relaxed);
    auto sent = send(std::move(m), p, true, until, nullptr, nullptr, false, &all_down);
    if (!sent) {
      x.ends->left.fetch_sub(1, std::memory_order_relaxed);
      std::lock_guard l(mu);
      p->slot.reset();
      release_land(*p, false);  // never sent: the server never saw its slot
      return false;
    }
    if (!x.pl.first_lane) x.pl.first_lane = sent->ln;
    {
      std::lock_guard l(mu);
      x.x.pieces.push_back(sent);
      if (!x.pl.sent_any) n_requests++;
    }
    send_write_data(sent);
    x.pl.off += sent->len;
    x.pl.sent_any = true;
  }
  return true;
}

void client::impl::pump() {
  // One thread pumps at a time; another that would have asks it to look again.
  pump_again = true;
  bool expected = false;
  while (pump_again.load() && pumping.compare_exchange_strong(expected, true)) {
    pump_again = false;
    bool down = false;
    for (;;) {
      std::shared_ptr<async_op> a;
      {
        std::lock_guard l(mu);
        while (!waiting.empty() && (waiting.front()->ended || waiting.front()->need_stat)) {
          down = down || waiting.front()->need_stat;  // (the idle look stats it, then queues it again)
          waiting.pop_front();
        }
        if (waiting.empty() || stopping) break;
        std::size_t taken = 0;
        if (!waiting.front()->planned || unsent_group(*waiting.front())) {
          if (auto g = gather(taken)) {
            for (std::size_t i = 0; i < taken; ++i) waiting.pop_front();
            waiting.push_front(g);
          }
        }
        a = waiting.front();
        a->advancing = true;
        ends_of(*a);
      }
      if (!a->planned) {
        a->pl = plan{};
        a->pl.path = a->r.path;
        a->pl.write = a->r.write != 0;
        a->pl.offset = a->r.offset;
        a->pl.length = a->r.length;
        a->pl.handle = a->r.write ? a->r.write : a->r.version;
        a->pl.mem = static_cast<std::byte*>(a->r.mem);
        try {
          plan_request(a->pl, a->deadline(), false);
          a->planned = true;
        } catch (const error& e) {
          std::vector<std::shared_ptr<connection>> none;
          std::lock_guard l(mu);
          a->advancing = false;
          // Nothing sent: it ends now -- and if the look gave it up meanwhile, the sending's hold
          // left to this thread goes now.
          if (!a->gave_up) give_up(*a, e, none);
          else if (std::exchange(a->hold_to_pump, false)) a->ends->release();
          continue;
        }
      }
      bool out = false;
      try {
        out = advance(a, down);
      } catch (const std::exception& e) {  // (a staged write's copy, memory): the request fails, the queue goes on
        const error err = dynamic_cast<const error*>(&e) ? *dynamic_cast<const error*>(&e) : error(errc::internal, "store.request", peer, e.what());
        std::vector<std::shared_ptr<connection>> close;
        {
          std::lock_guard l(mu);
          a->advancing = false;
          if (!a->gave_up) {
            give_up(*a, err, close);
          } else {
            abandon_pieces(*a, *a->gave_up, close);
            if (std::exchange(a->hold_to_pump, false)) a->ends->release();
          }
        }
        close_for(close);
        continue;
      }
      std::vector<std::shared_ptr<connection>> close;
      std::unique_lock l(mu);
      a->advancing = false;
      if (a->gave_up) {
        // Given up while its pieces were being sent (the idle look took it out of the queue): those
        // sent since fail too, and the sending's hold goes now. Then the next.
        abandon_pieces(*a, *a->gave_up, close);
        if (std::exchange(a->hold_to_pump, false)) a->ends->release();
        l.unlock();
        close_for(close);
        continue;
      }
      if (waiting.empty() || waiting.front() != a) continue;
      if (!out) break;  // waits for credits (or every lane is down: the look reconnects)
      waiting.pop_front();
      a->ends->release();  // every piece is out: the last one to land tells
    }
    {
      std::lock_guard l(mu);
      if (!waiting.empty()) async_work = true;  // the next credit given back pumps again
    }
    pumping = false;
    if (down && !stopping) kick();
    expected = false;
  }
}

void client::impl::abandon_pieces(async_op& a, const error& e, std::vector<std::shared_ptr<connection>>& close) {
  a.x.pieces.each([&](const std::shared_ptr<piece>& p) {
    if (p->settled) return;
    if (!p->err) p->err = e;
    // An RMA piece's memory may still be written by the server: revoke its network key.
    if (p->rma && net_cache) net_cache->invalidate(reinterpret_cast<std::uintptr_t>(p->rma_mem), p->len);
    // Its connection, unless the lane was connected again since (the old one failed the piece).
    auto& c = p->ln->c;
    if (!c || c.get() != p->conn || closing.contains(c.get())) return;
    closing.emplace(c.get(), c);
    close.push_back(c);
  });
}

void client::impl::close_for(const std::vector<std::shared_ptr<connection>>& close) {
  for (auto& c : close) c->close();  // its pieces fail there (conn_failed): nothing lands after
}

void client::impl::give_up(async_op& a, const error& e, std::vector<std::shared_ptr<connection>>& close) {
  if (a.gave_up || a.ended) return;
  a.gave_up = e;
  const bool queued = std::find_if(waiting.begin(), waiting.end(), [&](auto& w) { return w.get() == &a; }) != waiting.end();
  if (queued) std::erase_if(waiting, [&](auto& w) { return w.get() == &a; });
  abandon_pieces(a, e, close);
  // Still queued (its sending's hold not let go), or waiting for its stat: the hold goes now --
  // unless pump is sending it, which lets it go once it is done with it.
  if (queued && a.advancing) a.hold_to_pump = true;
  else if (queued || a.need_stat) ends_of(a).release();
}

void client::impl::tick() {
  bool expected = false;
  if (stopping || !ticking.compare_exchange_strong(expected, true)) return;
  in_tick = true;
  struct done_ticking {
    std::atomic<bool>& f;
    ~done_ticking() {
      f = false;
      in_tick = false;
    }
  } guard{ticking};
  if (stopping) return;  // (shutdown set it, then waits for `ticking` to fall: one of the two sees the other)
  const auto now = clk::now();
  std::vector<std::shared_ptr<connection>> close;
  std::vector<std::shared_ptr<async_op>> ended_members, stats;
  std::vector<std::function<void()>> later;
  bool want_connection = false;
  {
    std::lock_guard l(mu);
    later.swap(afterwards);
    for (auto& [id, ap] : live) {
      async_op& a = *ap;
      if (a.ended || a.gave_up) continue;
      // A deadline by progress is the client's: a request queued here or at the server behind others
      // that move has not stalled (as a batch's moving deadline: nothing in it moved for that long).
      a.moved_at = std::max(a.moved_at, moved_at);
      if (a.grp) {
        // Members over end now (unless their answer came); once none is left open and none was
        // answered, the request is given up.
        bool open = false, answered = false;
        for (std::size_t i = 0; i < a.grp->members.size(); ++i) {
          if (a.grp->at(i) == group::open && a.grp->members[i]->over(now) && a.grp->take(i, group::ended))
            ended_members.push_back(a.grp->members[i]);
          open = open || a.grp->at(i) == group::open;
          answered = answered || a.grp->answer_in(i);
        }
        if (!open && !answered) give_up(a, request_error(errc::cancelled, a.r, peer, a.r.offset, "every read of the request ended"), close);
        continue;
      }
      if (a.over(now)) {
        const bool cancelled = a.r.cancelled && a.r.cancelled();
        // The first byte not in: the pieces go out in order, and those before it are done.
        std::uint64_t at = a.r.offset;
        bool gap = false;
        a.x.pieces.each([&](const std::shared_ptr<piece>& p) {
          gap = gap || !p->done.load(std::memory_order_acquire);
          if (!gap) at += p->len;
        });
        log::warn("store", "{}: {} {} offset {} {}; closing its connection", peer, a.r.write ? "write of" : "read of", printable(a.r.path), at,
                  cancelled ? "cancelled" : "timed out");
        give_up(a, request_error(cancelled ? errc::cancelled : errc::timeout, a.r, peer, at,
                                 cancelled ? "cancelled while under way" : "no progress before the deadline"),
                close);
        continue;
      }
      if (a.need_stat) stats.push_back(ap);
    }
    want_connection = !waiting.empty() || !stats.empty();
  }
  // The connections of what was given up close before anything ended is told, as a request given up
  // under way promises (client.hpp): a caller told may go on at once.
  close_for(close);
  close.clear();
  for (auto& m : ended_members) {
    const bool cancelled = m->r.cancelled && m->r.cancelled();
    error e = request_error(cancelled ? errc::cancelled : errc::timeout, m->r, peer, m->r.offset,
                            cancelled ? "cancelled while under way" : "no answer before the deadline");
    let_go(m->r)(0, &e);
  }
  for (auto& f : later) f();
  if (want_connection && lane_events.load() != lanes_checked.load()) {
    // A reconnect holds this lane's thread, the only one left when the client has one lane: it waits
    // no longer than the nearest deadline of what waits for it, so that each of those still ends at
    // its own deadline (by the next look, naming its file and offset).
    clk::time_point need_by = now + o.timeout;
    {
      std::lock_guard l(mu);
      for (auto& a : waiting) need_by = std::min(need_by, a->deadline());
      for (auto& a : stats) need_by = std::min(need_by, a->deadline());
    }
    {
      try {
        ensure_connected(need_by);
      } catch (const error& e) {
        if (e.code() == errc::busy) {  // another thread is reconnecting: the next look goes on,
          drain();                     // and what ended meanwhile (given up, say) is told now
          return;
        }
        if (e.code() == errc::timeout && need_by < now + o.timeout && clk::now() >= need_by) {
          drain();  // cut short by a waiting request's deadline: the next look ends it, and tries again
          return;
        }
        // The server cannot be reached: what waits for a lane fails with that (a request sent again
        // says both).
        std::vector<std::shared_ptr<async_op>> hit;
        {
          std::lock_guard l(mu);
          bool any_up = false;
          for (auto& ln : lanes) any_up = any_up || (ln->c && ln->c->alive());
          if (!any_up) {
            for (auto& a : waiting) hit.push_back(a);
            for (auto& a : stats) hit.push_back(a);
          }
        }
        for (auto& a : hit) {
          std::lock_guard l(mu);
          give_up(*a, a->lost && e.op() == "store.connect" ? detail::lost_and_unreachable(*a->lost, e) : e, close);
        }
        stats.clear();
      }
    }
  }
  if (lane_events.load() != lanes_checked.load()) stats.clear();  // (the next look, once connected)
  for (auto& a : stats) {
    std::optional<error> failed;
    try {
      auto st = std::get<stat_reply>(query({0, 0, stat_req{a->r.path}}, "store.stat", a->r.path,
                                             std::min<clk::duration>(a->deadline() - clk::now(), o.timeout)).b);
      a->r.version = st.version;
    } catch (const error& e) {
      failed = e;
    }
    std::lock_guard l(mu);
    if (failed) give_up(*a, *failed, close);
    a->need_stat = false;
    if (!failed && !a->ended && !a->gave_up) waiting.push_back(a);
  }
  close_for(close);  // (what the failures above gave up was not under way: normally none)
  {
    // A closing that found its connection already failed (its pieces failed then): nothing more
    // will come of it once no lane holds that connection.
    std::lock_guard l(mu);
    std::erase_if(closing, [&](const auto& kv) {
      return !kv.second->alive() && std::none_of(lanes.begin(), lanes.end(), [&](auto& ln) { return ln->c == kv.second; });
    });
  }
  if (renew_wanted.exchange(false)) {
    if (auto lr = current_landing(); lr && lr->spent()) {
      try {
        renew_landing(lr, clk::now() + o.timeout);
      } catch (const error& e) {
        log::info("store", "{}: the landing region was not renewed: {}", peer, e.what());
      }
    }
  }
  pump();
  drain();
}

void client::impl::drain() {
  thread_local bool in_drain = false;
  if (in_drain) return;  // (a completion that submits: the outer loop takes what it ended)
  in_drain = true;
  struct leave {
    ~leave() { in_drain = false; }
  } g;
  for (;;) {
    async_work = false;
    std::vector<std::uint64_t> ids;
    {
      std::lock_guard l(ended_mu);
      ids.swap(ended_ids);
    }
    pump();
    if (ids.empty()) {
      std::lock_guard l(ended_mu);
      if (ended_ids.empty()) break;
      continue;
    }
    for (auto id : ids) {
      std::shared_ptr<async_op> a;
      {
        std::lock_guard l(mu);
        auto it = live.find(id);
        if (it == live.end()) continue;
        a = it->second;
      }
      conclude(a);
    }
  }
  if (stat_wanted.exchange(false)) kick();  // (a read sent again that needs its version)
}

void client::impl::conclude(const std::shared_ptr<async_op>& a) {
  std::optional<error> err;
  std::uint64_t n = 0;
  // Sent again (once) within its deadline: a read whose connection was lost, a small read of a group
  // the server refused (ranges in one request only from local file systems).
  // A loss that was another request's ending (its connection closed under this one) is not this
  // one's retry: it goes again as often as that happens, within its deadline.
  bool victim = false;
  {
    // Ended from here on (the look gives up no ended request), what the look gave it up with read
    // under the lock it writes under, and out of `live` (sent again, it goes back in) -- one lock
    // for all of it: the lanes take it for every answer.
    std::lock_guard l(mu);
    a->ended = true;
    err = a->gave_up;
    a->x.pieces.each([&](const std::shared_ptr<piece>& p) {
      victim = victim || (p->victim && p->err && p->err->code() == errc::network_error);
      p->owner = nullptr;  // (the request ends: a piece that lands later moves nothing on)
    });
    live.erase(a->id);
  }
  if (!err) {
    try {
      n = finish(a->x);  // every piece is done: nothing waits here
    } catch (const error& e) {
      err = e;
    } catch (const std::exception& e) {
      err = error(errc::internal, "store.request", peer, e.what());
    }
  }
  auto again = [&](const std::shared_ptr<async_op>& x, const error& e, bool grouped) {
    if (x->r.write || (x->lost && !victim) || x->over(clk::now())) return false;
    if (e.code() != errc::network_error && !(grouped && e.code() == errc::not_supported)) return false;
    // (Under the lock shutdown's sweep of the queue takes: queued before it, or not at all.)
    std::lock_guard l(mu);
    if (stopping) return false;
    if (!victim || e.code() != errc::network_error) x->lost = e;
    x->planned = x->ended = false;
    x->gave_up.reset();
    x->x = op{};
    x->ends = notice_for(x->id);
    x->need_stat = !x->r.version && x->r.length > o.piece;
    live.emplace(x->id, x);
    if (x->need_stat) stat_wanted = true;
    else waiting.push_back(x);
    async_work = true;
    return true;
  };
  auto tell = [&](const std::shared_ptr<async_op>& x, std::uint64_t bytes, const error* e) {
    const bool cancelled = e && x->r.cancelled && x->r.cancelled();
    const auto done = let_go(x->r);
    if (cancelled && e->code() != errc::cancelled) {
      // Another request's cancel closed the lane under it, and its own batch was cancelled too.
      const error c = request_error(errc::cancelled, x->r, peer, x->r.offset, std::string("cancelled: ") + e->what());
      return done(0, &c);
    }
    if (e && x->lost && x->lost->code() == errc::network_error && e->op() == "store.connect") {
      const error both = detail::lost_and_unreachable(*x->lost, *e);
      return done(0, &both);
    }
    done(bytes, e);
  };
  if (err && err->code() == errc::not_supported && a->grp) {
    std::lock_guard l(mu);
    one_by_one.insert(a->r.path);
    refused_ranges.store(true, std::memory_order_release);
  }
  bool told = true;
  if (a->grp) {
    group& g = *a->grp;
    for (std::size_t i = 0; i < g.members.size(); ++i) {
      // (A hook still copying -- only where the request was given up while its answer was being
      // handed over -- is a memcpy away from answered.)
      while (g.at(i) == group::copying) std::this_thread::yield();
      auto& m = g.members[i];
      if (g.at(i) == group::answered) {
        tell(m, g.got[i], nullptr);
      } else if (g.take(i, group::ended)) {
        const error e = err ? *err : request_error(errc::internal, m->r, peer, m->r.offset, "the answer did not hand this range over");
        // (A member of a refused group goes alone, not as its one retry.)
        bool alone = false;
        if (err && err->code() == errc::not_supported && !m->lost) {
          std::lock_guard l(mu);
          if ((alone = !stopping)) {  // (as `again`: queued before shutdown's sweep, or told)
            m->ended = false;
            live.emplace(m->id, m);
            waiting.push_back(m);
            async_work = true;
          }
        }
        if (alone) continue;
        if (!err || !again(m, e, true)) {
          tell(m, 0, &e);
        }
      }
    }
  } else if (!err || !again(a, *err, false)) {
    tell(a, n, err ? &*err : nullptr);
  } else {
    told = false;  // (queued again: the pump plans it anew)
  }
  std::lock_guard l(mu);
  if (told) {
    // What it held for its sending (registrations, the landing region, its pieces) goes now, not with
    // its batch's allocation.
    a->pl = plan{};
    a->x = op{};
  }
  if (live.empty()) live_cv.notify_all();
}

}  // namespace ferry::store
