// The file engine's workers: each one io_uring, FERRY_IO_DEPTH slots shared by the requests it runs,
// made as the work asks for them (see io/file_engine_impl.hpp).
#include "io/file_engine_impl.hpp"

namespace ferry {

file_engine::impl::impl(transfer_engine& x, device_registry& d, registration_cache& c, const io_settings& s)
    : xfer(x), devices(d), cache(c), cfg(s), loops(d.workers(), static_cast<unsigned>(s.io_threads > 0 ? s.io_threads : default_io_threads())) {
  inject_partial = s.io_inject.find("partial") != std::string::npos;
  inject_eintr = s.io_inject.find("eintr") != std::string::npos;
  if (s.io_mapped) mapped_pages = read_only_pins::make(d.config().cuda_driver);
  const int n = s.io_threads > 0 ? s.io_threads : default_io_threads();
  workers.resize(static_cast<std::size_t>(n));
  // Two at first (one if that is all there may be): a first small read needs no more. The first
  // worker's failure (no io_uring) is the engine's.
  workers[0] = std::make_unique<worker>(*this);
  live = 1;
  st.get("workers.made").add(1);
  grow(2);
}

// Makes workers up to `want` (at most the configured number). A worker that cannot be made (no
// ring) leaves the engine with those it has.
void file_engine::impl::grow(std::size_t want) {
  want = std::min(want, workers.size());
  if (live.load(std::memory_order_acquire) >= want) return;
  std::lock_guard l(grow_mu);
  for (std::size_t k = live.load(); k < want && !stop; ++k) {
    try {
      workers[k] = std::make_unique<worker>(*this);
    } catch (const std::exception& e) {
      workers[k].reset();
      log::warn("io", "file engine: a worker more could not be made ({}); going on with {}", e.what(), k);
      return;
    }
    live.store(k + 1, std::memory_order_release);
    st.get("workers.made").add(1);
  }
}

file_engine::impl::~impl() {
  {
    std::lock_guard g(grow_mu);
    stop = true;
    for (std::size_t k = 0; k < live.load(); ++k) {
      auto& w = workers[k];
      { std::lock_guard l(w->qmu); }  // a worker between its look at `stop` and its wait sees the wake
      w->wake();
    }
  }
  loops.wait_none();  // each ends what it runs and what is queued first
}

void file_engine::impl::hand_over(std::size_t k, std::span<job> js, std::span<const std::size_t> which) {
  worker& w = *workers[k];
  bool start = false;
  {
    std::lock_guard l(w.qmu);
    std::uint64_t load = 0;
    for (std::size_t x : which) {
      load += load_of(js[x]);
      w.queue.push_back(std::move(js[x]));
    }
    w.queued = w.queue.size() - w.qhead;
    w.queued_load.fetch_add(load, std::memory_order_relaxed);
    if (!w.looping && loops.take()) start = w.looping = true;
  }
  if (!start) return w.wake();
  try {
    loops.start(w.qmu, [&w] { w.loop(); });
  } catch (const std::exception& ex) {
    // No loop can run (no thread): what is queued on this worker fails, named, instead of waiting.
    std::vector<job> gone;
    {
      std::lock_guard l(w.qmu);
      w.looping = false;
      gone.assign(std::make_move_iterator(w.queue.begin() + static_cast<std::ptrdiff_t>(w.qhead)),
                  std::make_move_iterator(w.queue.end()));
      w.queue.clear();
      w.qhead = 0;
      w.queued = 0;
      w.queued_load = 0;
    }
    for (job& j : gone) {
      error x(errc::unavailable, j.r.write ? "file.write" : "file.read", j.r.f->path(), fmt::format("no worker to run it ({})", ex.what()));
      std::vector<transfer_batch::state::item_end> es;
      if (j.group)
        for (const member& m : *j.group) es.push_back({m.idx, 0, &x});
      else
        es.push_back({j.idx, 0, &x});
      j.b->end_items(es);
    }
  }
}

// Takes queued requests while a slot is free (waiting for one when it runs none); false: stop.
// Asleep from before it looks at the queue until the round's wait is over: a request queued after
// the look finds it set and wakes the ring (a wake that comes while it is still busy only makes
// the next wait return at once).
bool file_engine::impl::worker::admit() {
  took.clear();
  if (runs.empty()) {
    // Out of work: a short look for more before sleeping, so that batches that follow each other
    // closely (a GPU proxy's, a server's) find the worker awake instead of paying a wake-up each.
    constexpr auto spin = std::chrono::microseconds(30);
    const auto until = std::chrono::steady_clock::now() + spin;
    while (!queued.load(std::memory_order_relaxed) && !e.stop.load(std::memory_order_relaxed) && std::chrono::steady_clock::now() < until)
      std::this_thread::yield();
  }
  asleep = true;
  {
    std::unique_lock l(qmu);
    if (runs.empty()) {
      auto work = [&] { return e.stop.load() || qhead < queue.size(); };
      // Idle for a second: its registered descriptors go, and its loop ends (the executor's worker
      // is free for other work; the next job handed over starts the loop again). A second, not at
      // once: work that comes in bursts finds the loop still there.
      if (!cv.wait_for(l, std::chrono::seconds(1), work)) {
        if (registering()) {
          l.unlock();
          unregister(std::chrono::steady_clock::now(), true);
          l.lock();
        }
        if (!work()) {
          asleep = false;
          looping = false;
          e.loops.give_back();
          return false;
        }
      }
    }
    if (runs.empty() && qhead == queue.size()) {  // stopping, nothing left
      looping = false;
      e.loops.give_back();
      return false;
    }
    std::uint64_t taken = 0;
    while (qhead < queue.size() && runs.size() + took.size() < slots.size()) {
      taken += load_of(queue[qhead]);
      took.push_back(std::move(queue[qhead++]));
    }
    // Taken jobs leave moved-from entries behind: dropped when the queue empties, or once they
    // are half of it (a queue that never empties stays bounded).
    if (qhead == queue.size() || qhead * 2 >= queue.size()) {
      queue.erase(queue.begin(), queue.begin() + static_cast<std::ptrdiff_t>(qhead));
      qhead = 0;
    }
    queued = queue.size() - qhead;
    queued_load.fetch_sub(taken, std::memory_order_relaxed);
    running_now = runs.size() + took.size();
    // (Taken jobs that fail as they start leave it high until the round's end says it again.)
    running_load.fetch_add(taken, std::memory_order_relaxed);
  }
  for (auto& j : took) {
    // Counted: a request that starts beside others on this worker (not behind them).
    if (!runs.empty()) ++t.beside;
    start(std::move(j));
  }
  return true;
}

void file_engine::impl::worker::loop() {
  while (admit()) {
    // Issue I/O for every request in turn, one slot each per round.
    for (bool more = true; more;) {
      more = false;
      for (auto& r : runs)
        if (auto x = catching([&] { more = issue(r) || more; })) abort(r, *x);
    }
    if (to_submit) {
      int n = io_uring_submit(&ring);
      if (n < 0) fail_errno(-n, "io.submit", "io_uring_submit");
      to_submit = false;
    }
    // Wait for a completion, new work, or the nearest deadline (cancellation is noticed within 50 ms).
    auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(50);
    for (auto& r : runs) until = std::min(until, r.j.b->until());
    io_uring_cqe* first = nullptr;
    if (!runs.empty()) wait_one(&first, until);  // (it is handled with the others below)
    asleep = false;
    unsigned head;
    io_uring_cqe* cqe;
    completed.clear();
    io_uring_for_each_cqe(&ring, head, cqe) completed.emplace_back(io_uring_cqe_get_data64(cqe), cqe->res);
    io_uring_cq_advance(&ring, static_cast<unsigned>(completed.size()));
    for (auto [tag, res] : completed) {
      if (tag == wake_tag) {
        arm_wake();
        continue;
      }
      if (tag >= slots.size() || !slots[tag].r) continue;  // a cancellation's own completion
      slot& s = slots[tag];
      if (s.reg >= 0) --regs[static_cast<std::size_t>(s.reg)].inflight, s.reg = -1;
      running& r = *s.r;
      auto x = catching([&] { on_io(s, res); });
      if (s.r && s.state == slot::free) release(s);
      if (x) abort(r, *x);
    }
    copies.clear();
    {
      std::lock_guard l(copied_mu);
      copies.swap(copied);
    }
    for (auto& [i, err] : copies) {
      slot& s = slots[i];
      running& r = *s.r;
      auto x = catching([&] { on_copied(s, err); });
      if (s.r && s.state == slot::free) release(s);
      if (x) abort(r, *x);
    }
    // Deadlines and cancellation; then the requests that are over.
    auto now = std::chrono::steady_clock::now();
    unregister(now, false);
    ++round;
    for (auto& r : runs) {
      if (r.err) continue;
      const char* op = r.j.r.write ? "file.write" : "file.read";
      if (r.j.b->cancelled) abort(r, error(errc::cancelled, op, r.j.r.f->path(), "cancelled"));
      else if (now >= r.j.b->until() && !(r.issued() && !r.busy))
        abort(r, error(errc::timeout, op, r.j.r.f->path(), "deadline passed"));
    }
    // The load without the requests that end here, said before their batches are told: a caller
    // that a batch's end lets submit again sees this worker as it is by then.
    auto ending = [](const running& r) { return !r.busy && (r.err || r.issued()); };
    std::uint64_t load = 0;
    for (const running& r : runs)
      if (!ending(r)) load += load_of(r.j);
    running_load.store(load, std::memory_order_relaxed);
    for (auto it = runs.begin(); it != runs.end();) {
      if (ending(*it)) {
        end(*it);
        *it = running{};  // lets go of its file, memory and batch now
        spare.splice(spare.begin(), runs, it++);
      } else {
        ++it;
      }
    }
    running_now = runs.size();
    report();
  }
}

void file_engine::impl::worker::start(job j) {
  const char* op = j.r.write ? "file.write" : "file.read";
  if (j.b->cancelled) {
    error c(errc::cancelled, "io.request", fmt::format("request {} {}", j.idx, j.r.f->path()), "batch cancelled before it ran");
    return done(j, 0, &c);
  }
  // cuFile's calls block: a worker runs them one at a time, beside nothing else. (Not for a group:
  // its members are not one range of memory.)
  if (auto x = catching([&] {
        if (j.group || !e.use_cufile(j)) return;
        auto& b = *j.b;
        std::uint64_t moved = 0;
        auto progress = [&](std::uint64_t n) {
          moved += n;
          b.progress(j.idx, n);
        };
        try {
          if (j.r.write) {
            e.cufile().write(*j.r.f, j.dev->info().ordinal, j.r.mem, j.r.offset, j.r.bytes, e.cfg.io_chunk, b.until(), progress);
          } else {
            std::uint64_t size0 = j.r.f->size();
            std::uint64_t n = j.r.offset >= size0 ? 0 : std::min(j.r.bytes, size0 - j.r.offset);
            std::uint64_t got =
                n ? e.cufile().read(*j.r.f, j.dev->info().ordinal, j.r.mem, j.r.offset, n, 64ull << 20, b.until(), progress) : 0;
            if (got < n)
              fail(errc::io_error, "file.read", fmt::format("{} offset {}", j.r.f->path(), j.r.offset + got),
                   "the file ended early (truncated while reading?)");
          }
        } catch (const error& probe) {
          // The probe: if cuFile's first transfer on a file fails, auto mode falls back for good.
          if (e.cfg.file_backend == file_backend_kind::cufile || moved > 0) throw;
          e.cufile().refuse(*j.r.f, probe.what());
          log::info("io", "{}: cuFile probe failed ({}); io_uring instead", j.r.f->path(), probe.what());
          return;
        }
        e.st.get("requests.cufile").add();
        {
          std::lock_guard l(b.mu);
          b.results[j.idx].path = transfer_path::direct;
        }
        b.finish(j.idx, 0, nullptr);
        b.item_done();
        j.b = nullptr;  // done
      })) {
    return done(j, 0, &*x);
  }
  if (!j.b) return;

  running r;
  r.j = std::move(j);
  file& f = *r.j.r.f;
  const std::string& path = f.path();
  auto x = catching([&] {
    r.lo = r.j.r.offset;
    r.hi = r.j.r.offset + r.j.r.bytes;
    if (!r.j.r.write) {
      // The pieces of one request share the size it was cut at, so that a file cut short under them
      // fails the request instead of leaving a hole in what reads as a short read.
      r.size0 = r.j.size ? *r.j.size : f.size();
      r.hi = std::min(r.hi, r.size0);
      if (r.lo >= r.hi) return;  // entirely past the end: a short (empty) read
      if (e.cfg.io_direct == direct_io::always && f.direct_fd() < 0)
        fail(errc::not_supported, op, path, "O_DIRECT refused here (FERRY_IO_DIRECT=always)");
      // A small read in automatic mode first asks the page cache only (RWF_NOWAIT: no waiting for
      // the disk); what it does not find there is then read with O_DIRECT (on_io). That costs
      // nothing when the page cache has the range, where asking cachestat first would cost a system
      // call per read. A larger read asks cachestat once and is planned accordingly.
      const bool nowait = e.cfg.io_direct == direct_io::automatic && f.direct_fd() >= 0 &&
                          r.hi - r.lo <= std::min(e.cfg.io_inline, e.cfg.io_chunk);
      const bool direct = !nowait && reads_direct(e.cfg, f, r.lo, r.hi - r.lo);
      // Buffered into host memory: the kernel copies from the page cache straight into the
      // destination (no staging, no second copy); exactly the asked range, nothing past it.
      const bool in_place = !r.j.dev && !direct;
      // Into a GPU from the page cache: its copy engine reads the file's pages themselves, pinned.
      // Not a small read that asks the page cache first, nor a range the page cache lacks (this
      // thread would read it from the disk as it maps it); not a sim device, whose copies are the
      // CPU's and would fault on pages a truncation took away.
      r.mapped = r.j.dev && r.j.dev->info().backend == device_kind::cuda && !direct && !nowait && e.mapped_pages && !r.j.group &&
                 ((e.cfg.io_direct == direct_io::automatic && f.direct_fd() >= 0) || cached_fraction(f.fd(), r.lo, r.hi - r.lo) >= 0.9);
      const std::uint64_t a = direct ? f.dio_align() : in_place ? 1 : 4096;
      r.add_part(align_down(r.lo, a), align_up(r.hi, a), direct, nowait);
      ++(direct ? t.direct : in_place ? t.in_place : r.mapped ? t.mapped : t.buffered);
      log::debug("io", "read {} [{}, {}) {} into {}", path, r.lo, r.hi, direct ? "O_DIRECT" : "buffered",
                 r.j.dev ? r.j.dev->id() : "host");
    } else {
      if (!f.writable()) fail(errc::permission_denied, op, path, "opened read-only");
      // O_DIRECT for the aligned middle; an unaligned head and tail go through the page cache.
      const bool direct = e.cfg.io_direct != direct_io::never && f.direct_fd() >= 0;
      const std::uint64_t a = direct ? f.dio_align() : 1;
      std::uint64_t mid_lo = direct ? align_up(r.lo, a) : r.lo, mid_hi = direct ? align_down(r.hi, a) : r.hi;
      if (mid_lo >= mid_hi) mid_lo = mid_hi = r.hi;  // too small for O_DIRECT: all buffered
      if (r.lo < mid_lo) r.add_part(r.lo, mid_lo, false);
      if (mid_lo < mid_hi) r.add_part(mid_lo, mid_hi, direct);
      if (mid_hi < r.hi) r.add_part(std::max(mid_hi, r.lo), r.hi, false);
    }
    plan_io(r);
  });
  if (x) return done(r.j, 0, &*x);
  if (!r.parts) return done(r.j, 0, nullptr);
  // A node from the spare list: no allocation per request once the worker has run as many at once.
  if (spare.empty()) {
    runs.push_back(std::move(r));
  } else {
    runs.splice(runs.end(), spare, spare.begin());
    runs.back() = std::move(r);
  }
}

// Its parts planned: the staging pool it needs (device memory or an O_DIRECT part), the bytes per
// I/O, and whether it is one I/O.
void file_engine::impl::worker::plan_io(running& r) {
  bool staged = r.j.dev != nullptr && !r.mapped;
  for (std::size_t k = 0; k < r.parts; ++k) staged = staged || r.part_of[k].direct;
  r.pool = staged ? &e.xfer.staging_for(r.j.where) : nullptr;
  std::uint64_t most = r.mapped ? e.cfg.io_mapped
                       : r.pool ? std::min<std::uint64_t>(e.cfg.io_chunk, r.pool->buffer_bytes())
                                : e.cfg.io_chunk;
  r.chunk = std::max<std::uint64_t>(4096, align_down(most, 4096));
  // (A group tells its members' bytes when it ends: their progress is not the range's.)
  r.one_io = (r.parts == 1 && r.part_of[0].end - r.part_of[0].pos <= r.chunk) || r.j.group;
}

// Issues the next I/O of `r` into a free slot; false when it has none to issue or no slot is free.
bool file_engine::impl::worker::issue(running& r) {
  if (r.err) return false;
  while (!r.issued() && r.part_of[r.next].pos >= r.part_of[r.next].end) ++r.next;
  if (r.issued() || r.busy >= static_cast<int>(slots.size())) return false;
  // Mapped pieces: two at a time per thread keep the copy engine busy (each is large); more would
  // only pin more of the page cache at once.
  if (r.mapped && std::count_if(slots.begin(), slots.end(), [](const slot& x) { return x.map != nullptr; }) >= 2) return false;
  slot* s = free_slot();
  if (!s) return false;
  auto& p = r.part_of[r.next];
  const bool write = r.j.r.write;
  // Staging: device memory (unless mapped), or an O_DIRECT range (aligned buffers). Buffered I/O on
  // host memory goes to/from the request's memory itself.
  const bool staged = (r.j.dev && !r.mapped) || p.direct;
  if (staged) {
    // One buffer waited for (until the deadline) when this worker has nothing else in flight; else
    // only one free now: a busy pool makes shallower pipelines, never a stall.
    s->held = slots_busy() == 0 ? r.pool->get(r.j.b->until()) : r.pool->try_get();
    if (!s->held) return false;
    s->buf = s->held.data();
  }
  s->r = &r;
  r.busy++;
  s->off = p.pos;
  s->len = std::min<std::uint64_t>(r.chunk, p.end - p.pos);
  s->got = 0;
  s->direct = p.direct;
  s->nowait = p.nowait;
  s->retries = 0;
  p.pos += s->len;
  auto* mem = static_cast<std::byte*>(r.j.r.mem);
  if (r.mapped && !map_window(*s)) {
    // Not mappable (or not pinnable) here: this request is staged from now on, this piece included.
    p.pos -= s->len;
    r.busy--;
    s->r = nullptr;
    r.mapped = false;
    plan_io(r);
    return issue(r);
  }
  try {
    if (r.mapped) {
      return true;  // its copy is under way
    } else if (!staged) {
      s->buf = mem + (s->off - r.lo);
      submit_io(*s);
    } else if (!write) {
      submit_io(*s);
    } else if (r.j.dev) {
      s->state = slot::staging;
      copy(*s, s->buf, mem + (s->off - r.lo), s->len, &s->held.region(), &r.j.where);
    } else {
      std::memcpy(s->buf, mem + (s->off - r.lo), s->len);
      submit_io(*s);
    }
  } catch (...) {
    release(*s);
    throw;
  }
  return true;
}

// Maps the file's pages of the slot's range, pins them read-only and starts their copy to the
// device; false (nothing started, nothing held) when the pages cannot be mapped or pinned here.
bool file_engine::impl::worker::map_window(slot& s) {
  running& r = *s.r;
  file& f = *r.j.r.f;
  const std::uint64_t lo = std::max(s.off, r.lo), hi = std::min(s.off + s.len, r.hi);
  const std::uint64_t page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  const std::uint64_t moff = align_down(lo, page), mlen = align_up(hi, page) - moff;
  // Populated now: the pages are cached (the plan asked), and pinning mapped pages is cheaper.
  void* m = ::mmap(nullptr, mlen, PROT_READ, MAP_SHARED | MAP_POPULATE, f.fd(), static_cast<off_t>(moff));
  if (m == MAP_FAILED) {
    std::lock_guard l(e.told_mu);
    if (e.told.insert(f.path() + " map").second)
      log::debug("io", "{}: cannot map ({}); its reads into device memory are staged", f.path(), std::strerror(errno));
    return false;
  }
  s.map = m;
  s.map_len = mlen;
  const std::byte* src = static_cast<const std::byte*>(m) + (lo - moff);
  if (auto x = catching([&] {
        s.window = e.mapped_pages->pin(m, mlen, r.j.dev->info().ordinal);
        s.pinned_for = r.j.dev->info().ordinal;
      })) {
    unmap(s);
    std::lock_guard l(e.told_mu);
    if (e.told.insert(f.path() + " map").second)
      log::debug("io", "{}: cannot pin its mapped pages ({}); its reads into device memory are staged", f.path(), x->what());
    return false;
  }
  s.got = hi - s.off;  // what the copy covers, checked against the file's size when it is done
  s.deliver = hi - lo;
  s.state = slot::copying;
  copy(s, static_cast<std::byte*>(r.j.r.mem) + (lo - r.lo), src, hi - lo, &r.j.where, &s.window);
  return true;
}

void file_engine::impl::worker::on_io(slot& s, int res) {
  running& r = *s.r;
  const std::string& path = r.j.r.f->path();
  const bool write = r.j.r.write;
  const char* op = write ? "file.write" : "file.read";
  res = inject(res);
  s.state = slot::free;  // its completion is consumed; a resubmission or a copy sets it again
  if (r.err) return;     // cancelled: nothing more for this request
  if (s.nowait && (res == -EAGAIN || res == -EOPNOTSUPP || res == -EINVAL)) {
    // The page cache lacks (the rest of) the range. The request's only I/O, nothing delivered: it
    // is read with O_DIRECT instead, planned afresh. Otherwise (part delivered, or another I/O of it
    // under way: planning afresh would read that part twice) this I/O goes on buffered. A file
    // system that refuses RWF_NOWAIT (-EOPNOTSUPP; -EINVAL on older kernels) is read buffered.
    if (res == -EAGAIN && s.got == 0 && r.delivered == 0 && r.busy == 1) return go_direct(s);
    s.nowait = false;
    return submit_io(s);
  }
  if (res == -EINTR || res == -EAGAIN) {
    if (++s.retries > 100) fail_errno(-res, op, fmt::format("{} offset {}", path, s.off + s.got), "retried 100 times");
    e.st.get("io.retries").add();
    return submit_io(s);
  }
  if (res < 0) fail_errno(-res, op, fmt::format("{} offset {}", path, s.off + s.got));
  if (write && res == 0) fail(errc::io_error, op, fmt::format("{} offset {}", path, s.off + s.got), "wrote nothing (disk full?)");
  s.got += static_cast<std::uint64_t>(res);
  if (s.got < s.len && (write || res > 0)) {  // partial completion: ask for the rest
    e.st.get("io.partial").add();
    return submit_io(s);
  }
  if (write) {
    r.deliver(s.len);
    return release(s);
  }
  // The slot holds [s.off, s.off + s.got). A file that ends before the size seen at the start was
  // truncated under us: an error, never garbage.
  std::uint64_t have_hi = s.off + s.got;
  if (have_hi < std::min(s.off + s.len, r.hi))
    fail(errc::io_error, op, fmt::format("{} offset {}", path, have_hi),
         fmt::format("the file ended at {} but was {} bytes when the read started (truncated while reading?)", have_hi, r.size0));
  std::uint64_t lo = std::max(s.off, r.lo), hi = std::min(have_hi, r.hi);
  if (lo >= hi) return release(s);
  auto* dst = static_cast<std::byte*>(r.j.r.mem) + (lo - r.lo);
  if (r.j.group) {  // each member's part of [lo, hi) to its memory
    group_copies.clear();
    for (const member& m : *r.j.group) {
      const std::uint64_t a = std::max(lo, m.offset), z = std::min(hi, m.offset + m.bytes);
      if (a < z) group_copies.push_back({m.mem + (a - m.offset), s.buf + (a - s.off), z - a, &m.where, &s.held.region()});
    }
    s.deliver = hi - lo;
    s.state = slot::copying;
    return copy(s, group_copies);
  }
  if (r.j.dev) {
    s.deliver = hi - lo;
    s.state = slot::copying;
    return copy(s, dst, s.buf + (lo - s.off), hi - lo, &r.j.where, &s.held.region());
  }
  if (s.held) std::memcpy(dst, s.buf + (lo - s.off), hi - lo);
  r.deliver(hi - lo);
  release(s);
}

// A small read the page cache did not have: its slot freed, the request planned again as one
// O_DIRECT read through a staging buffer (issue() takes it up in the next round).
void file_engine::impl::worker::go_direct(slot& s) {
  running& r = *s.r;
  file& f = *r.j.r.f;
  const std::uint64_t a = f.dio_align();
  r.parts = 0;
  r.next = 0;
  r.mapped = false;
  r.add_part(align_down(r.lo, a), align_up(r.hi, a), true);
  plan_io(r);
  ++t.missed_cache;
  ++t.direct;
  release(s);
}

void file_engine::impl::worker::on_copied(slot& s, const std::optional<error>& err) {
  running& r = *s.r;
  const bool to_file = s.state == slot::staging;
  s.state = slot::free;
  if (r.err) return;
  if (err) throw *err;
  if (to_file) return submit_io(s);
  if (s.map) {
    // The pages copied were the file's when the copy began; a file cut short meanwhile fails the
    // read as a staged read would (its bytes past the new end are no longer the file's).
    struct stat st {};
    const std::uint64_t end = s.off + s.got;
    if (::fstat(r.j.r.f->fd(), &st) == 0 && static_cast<std::uint64_t>(st.st_size) < end)
      fail(errc::io_error, "file.read", fmt::format("{} offset {}", r.j.r.f->path(), st.st_size),
           fmt::format("the file ended at {} but was {} bytes when the read started (truncated while reading?)", st.st_size, r.size0));
  }
  r.deliver(s.deliver);
  release(s);
}

// The request's first error: it issues nothing more; its I/O in the kernel is cancelled (a buffer
// is reused, or the request's memory given back, only once its I/O has come back).
void file_engine::impl::worker::abort(running& r, error x) {
  if (!r.err) r.err = std::move(x);
  for (auto& s : slots)
    if (s.r == &r && s.state == slot::io) {
      io_uring_sqe* q = sqe();
      io_uring_prep_cancel64(q, static_cast<__u64>(index(s)), 0);
      io_uring_sqe_set_data64(q, wake_tag - 1);
    }
}

void file_engine::impl::worker::end(running& r) {
  if (!r.err) (r.j.r.write ? t.written : t.read) += r.delivered;
  done(r.j, r.delivered - r.reported, r.err ? &*r.err : nullptr, r.hi);
}

// Tells the batches what this round ended, one lock per batch (the requests of a batch that end
// together are reported together), and the counters what it counted.
void file_engine::impl::worker::report() {
  auto flush = [](counter& c, std::uint64_t& n) {
    if (n) c.add(n);
    n = 0;
  };
  flush(e.beside_others, t.beside);
  flush(e.reads_direct_n, t.direct);
  flush(e.reads_in_place, t.in_place);
  flush(e.reads_buffered, t.buffered);
  flush(e.reads_mapped, t.mapped);
  flush(e.bytes_read, t.read);
  flush(e.bytes_written, t.written);
  flush(e.reads_missed_cache, t.missed_cache);
  flush(e.files_registered, t.registered);
  for (std::size_t a = 0; a < ends.size();) {
    std::size_t z = a;
    together.clear();
    for (; z < ends.size() && ends[z].b == ends[a].b; ++z)
      together.push_back({ends[z].idx, ends[z].len, ends[z].err ? &*ends[z].err : nullptr});
    ends[a].b->end_items(together);
    a = z;
  }
  ends.clear();
}

}  // namespace ferry
