#include <ferry/core/error.hpp>
#include <ferry/core/units.hpp>
#include <ferry/mem/pinned_pool.hpp>
#include <ferry/xfer/engine.hpp>

#include "core/executor.hpp"
#include "core/logging.hpp"
#include "mem/place_cuts.hpp"
#include "xfer/batch_state.hpp"
#include "xfer/stream_gates.hpp"

#include <fmt/format.h>


#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <deque>
#include <list>
#include <map>
#include <mutex>
#include <set>
#include <thread>

namespace ferry {

std::string_view to_string(request_state s) noexcept {
  switch (s) {
    case request_state::pending: return "pending";
    case request_state::done: return "done";
    case request_state::failed: return "failed";
    case request_state::cancelled: return "cancelled";
    case request_state::timed_out: return "timed_out";
  }
  return "?";
}

std::string_view to_string(transfer_path p) noexcept {
  switch (p) {
    case transfer_path::none: return "none";
    case transfer_path::direct: return "direct";
    case transfer_path::peer: return "peer";
    case transfer_path::registered: return "registered";
    case transfer_path::bounce: return "bounce";
    case transfer_path::staged: return "staged";
    case transfer_path::host: return "host";
  }
  return "?";
}

namespace {

struct segment {
  std::size_t req;
  std::byte* dst;
  const std::byte* src;
  std::uint64_t len;
};

struct work_item {
  std::shared_ptr<transfer_batch::state> b;
  transfer_path path = transfer_path::none;
  device* dev = nullptr;   // executing device (the source side for staged and peer copies)
  device* dev2 = nullptr;  // staged: destination device
  bool to_device = true;   // bounce: host -> device
  pinned_pool* pool = nullptr;
  std::shared_ptr<registration> hold;  // registered path: keeps the pin while copying
  std::vector<std::shared_ptr<registration>> unified;  // unified memory pinned in place while copying
  std::vector<segment> segs;
};


std::atomic<std::uint64_t> next_engine_serial{0};
struct known_stream {  // a helper stream of the calling thread (transfer_engine::impl::known_helper)
  std::uint64_t engine = 0;
  device* dev = nullptr;
  stream* s = nullptr;
};
thread_local std::array<known_stream, 4> t_known{};
}  // namespace

struct transfer_engine::impl {
  device_registry& devices;
  registration_cache& cache;
  xfer_settings cfg;
  ferry::stats st;
  // Queued items run on the executor (src/core/executor.hpp), in at most `nworkers` tasks at once,
  // each taking items until the queue is empty.
  int nworkers;
  std::mutex mu;
  std::deque<work_item> queue;  // with mu
  bool stop = false;            // with mu: the engine ends; items queued now fail
  detail::task_slots drains;    // taken and given back with mu
  unsigned most_drains = 0;     // with mu: the most tasks out at once so far ("tasks.most")
  // A running task's streams, one per device, by the task's place 0..nworkers-1 (taken from
  // `places` with mu when it starts, given back as it ends): as many streams per device as tasks
  // may run at once, whichever executor workers run them.
  std::vector<std::map<device*, std::unique_ptr<stream>>> place_streams;
  std::vector<unsigned> places;  // with mu: the free ones
  std::mutex pools_mu;
  std::map<int, std::unique_ptr<pinned_pool>> pools;
  std::mutex peer_mu;
  std::set<std::pair<device*, device*>> peers_enabled;
  // auto pageable policy: ranges seen once are bounced; seen again, registered.
  std::mutex seen_mu;
  std::list<std::pair<std::uintptr_t, std::uint64_t>> seen;

  stream_gates gates{cache, devices.workers()};  // stream order (transfer_options::on)

  counter* path_count[7] = {};
  counter& c_requests = st.get("requests");  // per request: not looked up by name each time
  counter& c_bytes = st.get("bytes");
  counter& c_on_caller = st.get("copies_on_caller");
  counter& c_most = st.get("tasks.most");
  counter& c_cut = st.get("copies.cut_at_place");  // unified memory: pieces a place boundary cut short
  impl(device_registry& d, registration_cache& c, const xfer_settings& s)
      : devices(d), cache(c), cfg(s), nworkers(s.xfer_threads > 0 ? s.xfer_threads : default_xfer_threads()),
        drains(d.workers(), static_cast<unsigned>(nworkers)), place_streams(static_cast<std::size_t>(nworkers)) {
    for (int k = nworkers - 1; k >= 0; --k) places.push_back(static_cast<unsigned>(k));
    for (int p = 0; p <= static_cast<int>(transfer_path::host); ++p)
      path_count[p] = &st.get(fmt::format("path.{}", to_string(static_cast<transfer_path>(p))));
  }
  ~impl() {
    {
      std::lock_guard l(mu);
      stop = true;
    }
    drains.wait_none();  // they run what is queued first
  }
  // Starts tasks for the queued items, as many as slots are free and items queued (called with mu).
  // Every running task is busy with an item: one that runs out of items ends.
  std::size_t take_drains() noexcept {
    std::size_t n = 0;
    while (n < queue.size() && drains.take()) ++n;
    if (unsigned out = drains.out(); out > most_drains) {
      c_most.add(out - most_drains);
      most_drains = out;
    }
    return n;
  }
  // Starts the `n` tasks take_drains() counted (without mu). One that cannot be started gives its
  // slot back; with no task out at all, the queued items fail (nothing else would run them: a batch
  // with a completion has no waiter that helps).
  void start_drains(std::size_t n) noexcept {
    for (std::size_t k = 0; k < n; ++k) {
      try {
        drains.start(mu, [this] { drain(); });
      } catch (const std::exception& e) {
        {
          std::lock_guard l(mu);
          for (std::size_t rest = k + 1; rest < n; ++rest) drains.give_back();
        }
        log::warn("xfer", "no more transfer tasks ({}); {} run the copies", e.what(), drains.out());
        if (drains.out() == 0) fail_queued(error(errc::unavailable, "xfer.worker", "thread", e.what()));
        return;
      }
    }
  }
  // Ends every queued item with `e` (no worker could be made to run them).
  void fail_queued(const error& e) noexcept {
    std::deque<work_item> gone;
    {
      std::lock_guard l(mu);
      gone.swap(queue);
    }
    for (auto& w : gone) {
      for (auto& sg : w.segs) w.b->finish(sg.req, sg.len, &e);
      w.b->item_done();
    }
  }

  // A stream-ordered batch: "started = k" then "wait finished >= k" on the stream; its items go to
  // the workers when the stream reached k, and k is released when the last item ended.
  void gate_batch(stream& s, std::shared_ptr<transfer_batch::state> b, std::vector<work_item> items) {
    auto o = gates.lock(s);
    std::uint32_t seq = o.take();
    stream_gates::gate& g = o.the_gate();
    s.write_value(o.started(), seq);
    try {
      s.wait_value(o.finished(), seq);
    } catch (...) {
      // The stream will write `started` but wait for nothing: the number is spent, ended at once.
      o.unlock();
      gates.release(g, seq);
      throw;
    }
    b->order = transfer_batch::state::ordering::waiting_for_stream;
    {
      std::lock_guard bl(b->mu);
      b->on_quiet = [this, &g, seq] { gates.release(g, seq); };
    }
    auto held = std::make_shared<std::vector<work_item>>(std::move(items));
    auto gated = [this, b, held, seq](bool reached) {
      if (!reached) return drop(*b, *held, seq);
      b->order = transfer_batch::state::ordering::stream_reached;
      if (held->empty()) return b->item_done(0);
      enqueue(*held);
    };
    o.unlock();
    gates.watch(g, seq, b->until(), [b] { return b->cancelled.load(); }, std::move(gated));
  }
  // A batch whose stream did not reach it by its deadline, or that was cancelled first: it ends
  // without running (its number is released when its items are counted off).
  void drop(transfer_batch::state& b, std::vector<work_item>& items, std::uint32_t seq) {
    bool cancelled = b.cancelled && std::chrono::steady_clock::now() < b.until();
    std::string what = fmt::format("stream-ordered batch #{}", seq);
    error e = cancelled ? error(errc::cancelled, "xfer.stream_order", what, "batch cancelled before its stream reached it")
                        : error(errc::timeout, "xfer.stream_order", what,
                                "deadline passed before the stream's earlier work finished (the batch did not run; the stream was released)");
    for (auto& w : items)
      for (auto& sg : w.segs) b.finish(sg.req, sg.len, &e);
    b.item_done(static_cast<int>(items.size()));
  }

  pinned_pool& pool(int numa) {
    std::lock_guard l(pools_mu);
    auto& p = pools[numa];
    if (!p) p = std::make_unique<pinned_pool>(cache, cfg.staging_bytes, cfg.staging_buffers, numa);
    return *p;
  }

  bool enable_peer(device& a, device& b) {
    std::lock_guard l(peer_mu);
    if (peers_enabled.count({&a, &b})) return true;
    if (!devices.peer(a, b).access) return false;
    a.enable_peer_access(b);
    b.enable_peer_access(a);
    peers_enabled.insert({&a, &b});
    peers_enabled.insert({&b, &a});
    return true;
  }

  bool seen_before(const void* p, std::uint64_t n) {
    auto key = std::make_pair(reinterpret_cast<std::uintptr_t>(p), n);
    std::lock_guard l(seen_mu);
    for (auto it = seen.begin(); it != seen.end(); ++it)
      if (*it == key) {
        seen.erase(it);
        return true;
      }
    seen.push_front(key);
    if (seen.size() > 256) seen.pop_back();
    return false;
  }

  // Streams of threads that help (callers in wait()), per thread and device; kept for the engine's life.
  std::mutex helper_mu;
  std::map<std::pair<std::thread::id, device*>, std::unique_ptr<stream>> helper_streams;
  // The calling thread's last few of them, without the lock: a caller of single copies looks its
  // stream up twice per copy. Keyed by the engine's serial number, never its address (an engine made
  // where a destroyed one was must not find the old one's streams).
  const std::uint64_t serial = next_engine_serial.fetch_add(1) + 1;
  stream* known_helper(device* d) const noexcept {
    for (const known_stream& k : t_known)
      if (k.engine == serial && k.dev == d) return k.s;
    return nullptr;
  }
  void remember_helper(device* d, stream* s) noexcept {
    std::move_backward(t_known.begin(), t_known.end() - 1, t_known.end());
    t_known[0] = {serial, d, s};
  }

  // Runs queued items of batch `b` on the calling thread: for small batches this saves the wake-up
  // of a worker and of the waiter. Returns when none of b's items is left in the queue, or when this
  // thread may not have a stream of its own (the bound below): the workers take the rest.
  void help(transfer_batch::state* b) {
    for (;;) {
      work_item w;
      {
        std::lock_guard l(mu);
        auto it = std::find_if(queue.begin(), queue.end(), [&](const work_item& x) { return x.b.get() == b; });
        if (it == queue.end()) return;
        w = std::move(*it);
        queue.erase(it);
      }
      if (!may_run_here(w)) {
        std::size_t n;
        {
          std::lock_guard l(mu);
          queue.push_front(std::move(w));
          n = take_drains();
        }
        start_drains(n);
        return;
      }
      run_here(w);
    }
  }
  // Whether the calling thread may run `w` itself (help(), copy()): it has the streams already, or
  // making them keeps the helper streams bounded (callers that come and go -- short-lived threads --
  // would otherwise leave a stream each behind; past the bound their work goes to the workers). The
  // streams are made here, under the same lock as the count, so racing callers cannot pass the bound.
  bool may_run_here(const work_item& w) {
    if ((!w.dev || known_helper(w.dev)) && (!w.dev2 || known_helper(w.dev2))) return true;
    std::lock_guard l(helper_mu);
    auto me = std::this_thread::get_id();
    std::size_t missing = 0;
    for (device* d : {w.dev, w.dev2})
      if (d && !helper_streams.count({me, d})) missing++;
    if (missing && helper_streams.size() + missing > 64) return false;
    try {
      for (device* d : {w.dev, w.dev2})
        if (d && !helper_streams.count({me, d})) {
          auto made = d->create_stream();
          helper_streams.emplace(std::make_pair(me, d), std::move(made));
        }
    } catch (const std::exception& e) {
      log::debug("xfer", "no stream for the calling thread ({}); the copy goes to a worker", e.what());
      return false;
    }
    return true;
  }
  // Runs one item on the calling thread, on that thread's own stream of the device (made by
  // may_run_here, which every caller asks first).
  void run_here(work_item& w) {
    auto stream_of = [&](device* d) -> stream& {
      if (stream* s = known_helper(d)) return *s;
      std::lock_guard l(helper_mu);
      stream& s = *helper_streams.at({std::this_thread::get_id(), d});
      remember_helper(d, &s);
      return s;
    };
    run(w, stream_of);
    w.b->item_done();
  }

  void enqueue(std::vector<work_item>& items) {
    if (items.empty()) return;
    std::size_t n = 0;
    bool ending = false;
    {
      std::lock_guard l(mu);
      if (!(ending = stop)) {
        for (auto& w : items) queue.push_back(std::move(w));
        n = take_drains();
      }
    }
    if (ending) {
      error e(errc::cancelled, "xfer.request", "engine", "the transfer engine is ending");
      for (auto& w : items) {
        for (auto& sg : w.segs) w.b->finish(sg.req, sg.len, &e);
        w.b->item_done();
      }
      return;
    }
    start_drains(n);
  }

  // A task on the executor: runs queued items until none is left, each on its place's own stream of
  // the item's device (made on first use there, kept for the engine's life).
  void drain() {
    unsigned place;
    {
      std::lock_guard l(mu);
      place = places.back();  // a slot is held: a place is free
      places.pop_back();
    }
    auto& mine = place_streams[place];
    auto stream_of = [&](device* d) -> stream& {
      auto& s = mine[d];
      if (!s) s = d->create_stream();
      return *s;
    };
    for (;;) {
      work_item w;
      {
        std::lock_guard l(mu);
        if (queue.empty()) {
          places.push_back(place);
          drains.give_back();
          return;
        }
        w = std::move(queue.front());
        queue.pop_front();
      }
      try {
        // Its streams first: a device that cannot make one fails this item, named, not the task.
        for (device* d : {w.dev, w.dev2})
          if (d) stream_of(d);
      } catch (const std::exception& ex) {
        const error* fe = dynamic_cast<const error*>(&ex);
        error e = fe ? *fe : error(errc::internal, "xfer.run", "stream", ex.what());
        for (auto& sg : w.segs) w.b->finish(sg.req, sg.len, &e);
        w.b->item_done();
        continue;
      }
      run(w, stream_of);
      w.b->item_done();
    }
  }

  template <typename StreamOf>
  void run(work_item& w, StreamOf& stream_of) {
    auto& b = *w.b;
    // A segment that will not run: its batch was cancelled, or its deadline passed, before it ran.
    auto not_run = [&](const segment& sg, bool cancelled) {
      error e = cancelled ? error(errc::cancelled, "xfer.request", fmt::format("request {}", sg.req), "batch cancelled before it ran")
                          : error(errc::timeout, "xfer.request", fmt::format("request {}", sg.req), "batch deadline passed before it ran");
      b.finish(sg.req, sg.len, &e);
    };
    auto skip = [&](const segment& sg) {
      const bool cancelled = b.cancelled;
      if (!cancelled && std::chrono::steady_clock::now() < b.until()) return false;
      not_run(sg, cancelled);
      return true;
    };
    // The item's holds go before its last segment is reported: a caller woken by the completion
    // finds the pages free to move (and pageable memory unpinned when the cache keeps none).
    auto let_go = [&] {
      w.unified.clear();
      w.hold.reset();
    };
    auto fail_with = [&](const segment& sg, const std::exception& ex) {
      const error* fe = dynamic_cast<const error*>(&ex);
      error e = fe ? fe->with_context(fmt::format("request {} ({} path)", sg.req, to_string(w.path)))
                   : error(errc::internal, "xfer.run", fmt::format("request {}", sg.req), ex.what());
      b.finish(sg.req, sg.len, &e);
    };

    if (w.path == transfer_path::direct || w.path == transfer_path::peer || w.path == transfer_path::registered) {
      // All segments of the item on one stream, one synchronization, their ends reported under one
      // lock (a KV cache's thousands of blocks: one lock and one clock read, not one each).
      if (const bool cancelled = b.cancelled; cancelled || std::chrono::steady_clock::now() >= b.until()) {
        let_go();  // before the ends are reported, as below
        for (auto& sg : w.segs) not_run(sg, cancelled);
        return;
      }
      stream& s = stream_of(w.dev);
      std::vector<const segment*> enqueued;
      enqueued.reserve(w.segs.size());
      auto pieces = w.hold ? w.hold->pieces() : std::vector<std::pair<std::uintptr_t, std::uint64_t>>{};
      bool one_call = false;
      if (w.segs.size() > 1 && pieces.size() <= 1) {
        // Many blocks (a KV cache's): enqueued in one call. If that is refused, one by one below,
        // so that only the request at fault fails.
        std::vector<stream::copy_desc> all;
        all.reserve(w.segs.size());
        for (const segment& sg : w.segs) all.push_back({sg.dst, sg.src, sg.len});
        try {
          s.copy_batch(all);
          for (const segment& sg : w.segs) enqueued.push_back(&sg);
          one_call = true;
        } catch (const std::exception& ex) {
          log::debug("xfer", "a batch of {} copies was refused ({}); enqueueing them one by one", all.size(), ex.what());
        }
      }
      if (!one_call)
        for (const segment& sg : w.segs) {
          try {
            if (pieces.size() <= 1) {
              s.copy(sg.dst, sg.src, sg.len);
            } else {
              // Host side spans several registrations: one copy per registered piece.
              auto host = reinterpret_cast<std::uintptr_t>(w.to_device ? static_cast<const void*>(sg.src)
                                                                        : static_cast<const void*>(sg.dst));
              for (auto [pb, pn] : pieces) {
                std::uintptr_t a = std::max(host, pb), e = std::min(host + sg.len, pb + pn);
                if (a >= e) continue;
                std::uint64_t off = a - host;
                s.copy(sg.dst + off, sg.src + off, e - a);
              }
            }
            enqueued.push_back(&sg);
          } catch (const std::exception& ex) {
            fail_with(sg, ex);  // refused at enqueue: only this request fails
          }
        }
      try {
        s.synchronize(b.until());
        let_go();
        std::vector<transfer_batch::state::item_end> ends;
        ends.reserve(enqueued.size());
        for (const segment* sg : enqueued) ends.push_back({sg->req, sg->len, nullptr});
        b.finish_many(ends);
      } catch (const std::exception& ex) {
        let_go();  // as the end of the item would, a moment later
        for (const segment* sg : enqueued) fail_with(*sg, ex);
      }
      return;
    }

    for (segment& sg : w.segs) {
      if (skip(sg)) continue;
      try {
        switch (w.path) {
          case transfer_path::host:
            std::memcpy(sg.dst, sg.src, sg.len);
            break;
          case transfer_path::bounce: {
            stream& s = stream_of(w.dev);
            pinned_pool::buffer buf = w.pool->get(b.until());
            for (std::uint64_t off = 0; off < sg.len; off += buf.size()) {
              std::uint64_t n = std::min<std::uint64_t>(buf.size(), sg.len - off);
              if (w.to_device) {
                std::memcpy(buf.data(), sg.src + off, n);
                s.copy(sg.dst + off, buf.data(), n);
                s.synchronize(b.until());
              } else {
                s.copy(buf.data(), sg.src + off, n);
                s.synchronize(b.until());
                std::memcpy(sg.dst + off, buf.data(), n);
              }
            }
            break;
          }
          case transfer_path::staged: {
            stream& from = stream_of(w.dev);
            stream& to = stream_of(w.dev2);
            pinned_pool::buffer buf = w.pool->get(b.until());
            for (std::uint64_t off = 0; off < sg.len; off += buf.size()) {
              std::uint64_t n = std::min<std::uint64_t>(buf.size(), sg.len - off);
              from.copy(buf.data(), sg.src + off, n);
              from.synchronize(b.until());
              to.copy(sg.dst + off, buf.data(), n);
              to.synchronize(b.until());
            }
            break;
          }
          default:
            fail(errc::internal, "xfer.run", fmt::format("request {}", sg.req), "no path");
        }
        if (&sg == &w.segs.back()) let_go();
        b.finish(sg.req, sg.len, nullptr);
      } catch (const std::exception& ex) {
        if (&sg == &w.segs.back()) let_go();
        fail_with(sg, ex);
      }
    }
  }
};

// ---- batch ------------------------------------------------------------------------------------

transfer_batch& transfer_batch::operator=(transfer_batch&& o) noexcept {
  if (this != &o) {
    {
      transfer_batch old;  // the batch assigned over ends as a destroyed one does (cancelled, waited for)
      old.s_ = std::move(s_);
    }
    s_ = std::move(o.s_);
  }
  return *this;
}

transfer_batch::~transfer_batch() {
  if (!s_) return;
  // The caller's buffers may go away with the batch: nothing may run after this returns.
  s_->cancelled = true;
  std::unique_lock l(s_->mu);
  s_->cv.wait(l, [&] { return s_->items_inflight == 0; });
}

bool transfer_batch::poll() const {
  std::lock_guard l(s_->mu);
  return s_->unfinished == 0;
}

bool transfer_batch::wait() {
  bool over = false;
  {
    std::lock_guard l(s_->mu);
    over = s_->unfinished == 0;
  }
  // Queued items of this batch run here (none left to look for once every request is final).
  if (!over && s_->engine) static_cast<transfer_engine::impl*>(s_->engine)->help(s_.get());
  std::unique_lock l(s_->mu);
  // The deadline may move on while this waits (progress): waited for again until it stays put.
  bool finished = false;
  for (deadline until = s_->until();; until = s_->until()) {
    finished = s_->cv.wait_until(l, until, [&] { return s_->unfinished == 0; });
    if (finished || s_->until() <= until) break;
  }
  if (!finished) {
    s_->cancelled = true;  // queued work is skipped; running chunks stop at their own deadline
    for (std::size_t i = 0; i < s_->results.size(); ++i) {
      auto& r = s_->results[i];
      if (r.state != request_state::pending) continue;
      r.state = request_state::timed_out;
      bool unreached = s_->order == state::ordering::waiting_for_stream;
      r.err = error(errc::timeout, "xfer.wait",
                    s_->label_of(i),
                    fmt::format("deadline passed with {} of {} bytes done{}", r.bytes_done, s_->sizes[i],
                                unreached ? " (its stream had not reached it: the work enqueued before it had not finished; the stream is released)" : ""));
      --s_->unfinished;
    }
  }
  for (auto& r : s_->results)
    if (r.state != request_state::done) return false;
  return true;
}

bool transfer_batch::wait(deadline t) {
  {
    std::unique_lock l(s_->mu);
    for (;;) {
      const deadline until = s_->until();
      if (s_->cv.wait_until(l, std::min(t, until), [&] { return s_->unfinished == 0; })) break;
      const auto now = std::chrono::steady_clock::now();
      if (now >= s_->until()) break;  // the batch's own deadline: wait() settles it
      if (now >= t) return false;
    }
  }
  return wait();
}

bool transfer_batch::expired() const { return std::chrono::steady_clock::now() >= s_->until(); }
void transfer_batch::cancel() { s_->cancelled = true; }
std::uint64_t transfer_batch::bytes_done() const { return s_->bytes_done.load(); }
std::uint64_t transfer_batch::bytes_total() const { return s_->bytes_total; }
std::vector<request_result> transfer_batch::results() const {
  std::lock_guard l(s_->mu);
  return s_->results;
}
void transfer_batch::check() const {
  std::lock_guard l(s_->mu);
  for (auto& r : s_->results)
    if (r.state != request_state::done) {
      if (r.err) throw *r.err;
      fail(errc::internal, "xfer.check", "batch", "request not finished");
    }
}

std::shared_ptr<transfer_batch::state> make_batch_state(std::size_t requests, const transfer_options& o,
                                                        std::chrono::nanoseconds default_idle) {
  auto s = std::make_shared<transfer_batch::state>();
  s->set_deadline(o, default_idle);
  s->results.resize(requests);
  s->sizes.resize(requests, 0);
  s->segs_left.assign(requests, 0);
  s->unfinished = requests;
  return s;
}

transfer_batch make_batch(std::shared_ptr<transfer_batch::state> s) {
  transfer_batch b;
  b.s_ = std::move(s);
  return b;
}

// ---- engine -----------------------------------------------------------------------------------

transfer_engine::transfer_engine(device_registry& devices, registration_cache& cache, const xfer_settings& s)
    : impl_(std::make_unique<impl>(devices, cache, s)) {}
transfer_engine::~transfer_engine() = default;
ferry::stats& transfer_engine::counters() noexcept { return impl_->st; }
pinned_pool& transfer_engine::staging_for(const memory_region& m) {
  if (m.device == device_kind::none) return impl_->pool(-1);
  return impl_->pool(impl_->devices.get(m.device, m.ordinal).info().numa_node);
}
int transfer_engine::workers() const noexcept { return impl_->nworkers; }
stream_gates& transfer_engine::gates() noexcept { return impl_->gates; }

namespace {
bool is_host(memory_type t) { return t == memory_type::host_pageable || t == memory_type::host_pinned; }
}  // namespace

transfer_batch transfer_engine::submit(std::span<const transfer_request> reqs, transfer_options o) {
  return submit_to(*impl_, reqs, o, false);
}

// `here`: a batch of one work item runs on the calling thread before this returns (copy(), whose
// caller waits anyway): no worker to wake, no waiter to wake. On a machine whose threads outnumber
// its cores each wake-up can cost more than a 1 MiB copy itself (docs/design/transfer-engine.md).
transfer_batch transfer_engine::submit_to(impl& I, std::span<const transfer_request> reqs, transfer_options o, bool here,
                                          completion done) {
  transfer_batch tb;
  tb.s_ = std::make_shared<transfer_batch::state>();
  auto& b = *tb.s_;
  b.set_deadline(o, I.cfg.deadline);
  b.engine = &I;
  b.on_done = std::move(done);
  b.results.resize(reqs.size());
  for (auto& r : reqs) b.sizes.push_back(r.bytes);
  b.segs_left.assign(reqs.size(), 0);
  b.unfinished = reqs.size();

  std::vector<work_item> items;
  // Small direct requests of one device and direction are grouped into one item (one
  // synchronization); the two directions stay apart, so that both copy engines work.
  struct group {
    device* dev;
    device* peer_dst;  // peer copies to different GPUs stay apart (streams of their own)
    transfer_path path;
    bool to_device;
    std::size_t item;
    std::uint64_t bytes;
  };
  std::vector<group> open_groups;  // a handful at most: a linear search
  std::uint64_t chunk_cap = std::max<std::uint64_t>(I.cfg.xfer_chunk, 64 * KiB);
  // A group holds FERRY_XFER_CHUNK or, for a batch of many small requests, half its share per
  // worker where that is more: two items per worker, so that one worker's next enqueue overlaps its
  // last copies, and no more (each more item is one more synchronization and a gap in the copy
  // engine's queue).
  std::uint64_t small_total = 0;
  for (auto& r : reqs)
    if (r.bytes <= I.cfg.xfer_batch_small) small_total += r.bytes;
  const std::uint64_t items_wanted = 2 * static_cast<std::uint64_t>(std::max(I.nworkers, 1));
  const std::uint64_t group_cap = std::max(chunk_cap, (small_total + items_wanted - 1) / items_wanted);
  std::optional<memory_region> last_src, last_dst;

  for (std::size_t i = 0; i < reqs.size(); ++i) {
    const transfer_request& r = reqs[i];
    auto res_of = [&] {
      return fmt::format("request {} dst={} src={}", i, describe_range(r.dst, r.bytes), describe_range(r.src, r.bytes));
    };
    b.bytes_total += r.bytes;
    try {
      if (!r.dst || !r.src) fail(errc::invalid_argument, "xfer.submit", res_of(), "null pointer");
      if (r.bytes == 0) fail(errc::invalid_argument, "xfer.submit", res_of(), "zero length");
      auto d = reinterpret_cast<std::uintptr_t>(r.dst), s = reinterpret_cast<std::uintptr_t>(r.src);
      if (d + r.bytes < d || s + r.bytes < s) fail(errc::out_of_range, "xfer.submit", res_of(), "length overflows the address space");
      if (d < s + r.bytes && s < d + r.bytes) fail(errc::invalid_argument, "xfer.submit", res_of(), "source and destination overlap");
      // A region the caller classified is taken only if it holds the range (else classified here).
      auto known = [](const memory_region* k, std::uintptr_t p, std::uint64_t n) {
        return k && k->type != memory_type::unknown && k->contains(p, n);
      };
      // A batch of blocks in one pool (a KV cache's) classifies the pool once: a request inside the
      // region the previous one found takes that region.
      auto classify = [&](const memory_region* given, std::optional<memory_region>& last, const void* p, std::uintptr_t a) {
        if (known(given, a, r.bytes)) return *given;
        if (known(last ? &*last : nullptr, a, r.bytes)) return *last;
        last = I.cache.classify(p, r.bytes);
        return *last;
      };
      memory_region src = classify(r.src_region, last_src, r.src, s);
      memory_region dst = classify(r.dst_region, last_dst, r.dst, d);
      if (src.type == memory_type::unknown)
        fail(errc::bad_address, "xfer.submit", res_of(), "source is not mapped memory ferry knows (freed or invalid?)");
      if (dst.type == memory_type::unknown)
        fail(errc::bad_address, "xfer.submit", res_of(), "destination is not mapped memory ferry knows (freed or invalid?)");

      for (auto* m : {&src, &dst})
        if ((m->type == memory_type::device || m->type == memory_type::managed || m->type == memory_type::unified) && m->size &&
            !m->contains(m == &src ? s : d, r.bytes))
          fail(errc::out_of_range, "xfer.submit", res_of(),
               fmt::format("{} extends past the end of its allocation on {} ({})", m == &src ? "source" : "destination",
                           m->device_id(), describe_range(m->base, m->size)));
      work_item w;
      w.b = tb.s_;
      device* sdev = is_host(src.type) ? nullptr : &I.devices.get(src.device, src.ordinal);
      device* ddev = is_host(dst.type) ? nullptr : &I.devices.get(dst.device, dst.ordinal);
      std::uint64_t chunk = chunk_cap;
      if (!sdev && !ddev) {
        w.path = transfer_path::host;
      } else if (sdev && ddev) {
        if (sdev == ddev) {
          w.path = transfer_path::direct;
          w.dev = sdev;
        } else if (I.cfg.xfer_peer && sdev->info().backend == ddev->info().backend && I.enable_peer(*sdev, *ddev)) {
          // Pushed by the source's copy engine: its writes over the link are posted, where the
          // destination's engine, pulling, waits for each read to come back
          // (docs/design/transfer-engine.md, "Peer copies are pushed").
          w.path = transfer_path::peer;
          w.dev = sdev;
        } else {
          w.path = transfer_path::staged;
          w.dev = sdev;
          w.dev2 = ddev;
          w.pool = &I.pool(ddev->info().numa_node);
          chunk = I.cfg.staging_bytes;
        }
      } else {
        device* dev = sdev ? sdev : ddev;
        const memory_region& host = sdev ? dst : src;
        const void* hp = sdev ? static_cast<const void*>(r.dst) : r.src;
        w.dev = dev;
        w.to_device = ddev != nullptr;
        bool needs_pin = host.type == memory_type::host_pageable && dev->info().backend == device_kind::cuda;
        if (!needs_pin) {
          w.path = transfer_path::direct;
        } else {
          bool reg = I.cfg.xfer_pageable == pageable_policy::always_register ||
                     (I.cfg.xfer_pageable == pageable_policy::automatic && (I.cache.cached(hp, r.bytes) || I.seen_before(hp, r.bytes)));
          if (reg) {
            w.path = transfer_path::registered;
            w.hold = std::make_shared<registration>(I.cache.acquire(hp, r.bytes));
          } else {
            w.path = transfer_path::bounce;
            w.pool = &I.pool(dev->info().numa_node);
            chunk = I.cfg.staging_bytes;
          }
        }
      }
      // Unified memory: its pages stay where they are (and mapped) while the copy engines use them.
      if (src.type == memory_type::unified) w.unified.push_back(std::make_shared<registration>(I.cache.acquire(r.src, r.bytes)));
      if (dst.type == memory_type::unified) w.unified.push_back(std::make_shared<registration>(I.cache.acquire(r.dst, r.bytes)));
      b.results[i].path = w.path;
      I.path_count[static_cast<int>(w.path)]->add();
      if (log_enabled(log_level::debug))  // its arguments cost more than a small copy's own overhead
        log::debug("xfer", "{}: {} -> {} via {}", res_of(), is_host(src.type) ? std::string(to_string(src.type)) : src.device_id(),
                   is_host(dst.type) ? std::string(to_string(dst.type)) : dst.device_id(), to_string(w.path));

      auto* dp = static_cast<std::byte*>(r.dst);
      auto* sp = static_cast<const std::byte*>(r.src);
      // Unified memory: one copy covers pages mapped in one place only (asked now that they are
      // pinned). The driver decides how to copy a range from what it finds there: a range from a
      // device-mapped page on into host-mapped ones was copied by the CPU, which cannot reach the
      // device page, and the process ended in the fault.
      const std::vector<std::uint64_t> cuts = w.unified.empty() ? std::vector<std::uint64_t>{} : place_cuts(dst, r.dst, src, r.src, r.bytes);
      bool groupable = w.path == transfer_path::direct || w.path == transfer_path::peer || w.path == transfer_path::host;
      if (groupable && r.bytes <= I.cfg.xfer_batch_small && cuts.empty()) {
        device* const peer_dst = w.path == transfer_path::peer ? ddev : nullptr;
        auto g = std::find_if(open_groups.begin(), open_groups.end(), [&](const group& x) {
          return x.dev == w.dev && x.peer_dst == peer_dst && x.path == w.path && x.to_device == w.to_device;
        });
        if (g == open_groups.end() || g->bytes + r.bytes > group_cap) {
          if (g == open_groups.end())
            g = open_groups.insert(open_groups.end(), {w.dev, peer_dst, w.path, w.to_device, 0, 0});
          items.push_back(std::move(w));
          g->item = items.size() - 1;
          g->bytes = 0;
        }
        items[g->item].segs.push_back({i, dp, sp, r.bytes});
        // A request that joins a group brings its unified-memory holds along (the first one's moved in).
        for (auto& u : w.unified) items[g->item].unified.push_back(std::move(u));
        g->bytes += r.bytes;
        b.segs_left[i] = 1;
        continue;
      }
      // Copy-engine paths: one stream already saturates one direction of a link (splitting a copy
      // over several streams only adds overhead), so a request stays whole unless FERRY_XFER_SPLIT
      // asks for pieces; requests of a batch still run on different workers and streams (both
      // directions, several GPUs).
      // Staged and host paths go chunk by chunk over the workers.
      std::uint64_t piece = I.cfg.xfer_split ? std::max<std::uint64_t>(I.cfg.xfer_split, 1 * MiB) : r.bytes;
      if (w.path == transfer_path::bounce || w.path == transfer_path::staged) piece = chunk;
      if (w.path == transfer_path::host) piece = std::min(piece, chunk);
      auto cut = cuts.begin();
      for (std::uint64_t off = 0, len = 0; off < r.bytes; off += len) {
        len = std::min(piece, r.bytes - off);
        if (cut != cuts.end() && *cut < off + len) {
          len = *cut++ - off;
          I.c_cut.add();
        }
        work_item c;
        c.b = w.b;
        c.path = w.path;
        c.dev = w.dev;
        c.dev2 = w.dev2;
        c.to_device = w.to_device;
        c.pool = w.pool;
        c.hold = w.hold;
        c.unified = w.unified;  // every piece holds the pages in place until it is done
        c.segs.push_back({i, dp + off, sp + off, len});
        items.push_back(std::move(c));
        b.segs_left[i]++;
      }
    } catch (const error& e) {
      b.fail_now(i, e);
      I.st.get("requests_refused").add();
    }
  }
  I.c_requests.add(reqs.size());
  I.c_bytes.add(b.bytes_total);
  {
    std::lock_guard l(b.mu);
    b.items_inflight = static_cast<int>(items.size());
  }
  if (o.on) {
    const int n_items = static_cast<int>(items.size());
    try {
      I.gate_batch(*o.on, tb.s_, std::move(items));
    } catch (const error& e) {
      // Nothing was ordered on the stream: the batch fails as a whole, and no item ever runs.
      for (std::size_t i = 0; i < reqs.size(); ++i)
        if (b.results[i].state == request_state::pending) b.fail_now(i, e);
      b.item_done(n_items);
    }
    return tb;
  }
  if (here && items.size() == 1 && I.may_run_here(items.front())) {
    I.c_on_caller.add();
    I.run_here(items.front());
    return tb;
  }
  I.enqueue(items);
  return tb;
}

void transfer_engine::submit(std::span<const transfer_request> reqs, transfer_options o, completion done) {
  expects(static_cast<bool>(done), "xfer.submit", "batch", "a batch without a handle needs a completion");
  if (reqs.empty()) return done({});
  transfer_batch b = submit_to(*impl_, reqs, o, false, std::move(done));
  b.s_.reset();  // the queued items hold the state; dropping the handle this way cancels nothing
}

void transfer_engine::copy(void* dst, const void* src, std::uint64_t bytes, transfer_options o) {
  copy(transfer_request{dst, src, bytes}, o);
}

void transfer_engine::copy(const transfer_request& r, transfer_options o) {
  transfer_batch b = submit_to(*impl_, {&r, 1}, o, true);
  b.wait();
  b.check();
}

}  // namespace ferry
