#pragma once
// The shared state behind a transfer_batch handle. Internal to ferry: the transfer engine and the
// file engine (io) both report into it, so their batches poll, wait, cancel and time out the same way.
#include <ferry/xfer/engine.hpp>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <span>
#include <fmt/format.h>

#include <string>

namespace ferry {

struct transfer_batch::state {
  mutable std::mutex mu;
  std::condition_variable cv;
  std::vector<request_result> results;
  std::vector<std::uint64_t> sizes;
  // Per request, where known (remote files'): what a timeout names instead of the request's index --
  // its file (one of `names`, one per file of the batch) and offset, put in words only when needed.
  struct label {
    std::uint32_t name = 0;
    std::uint64_t offset = 0;
  };
  std::vector<std::string> names;
  std::vector<label> labels;  // empty, or one per request (name 0: none)
  std::string label_of(std::size_t i) const {
    if (i < labels.size() && labels[i].name > 0 && labels[i].name <= names.size())
      return fmt::format("{} offset {}", names[labels[i].name - 1], labels[i].offset);
    return fmt::format("request {}", i);
  }
  std::vector<int> segs_left;
  std::size_t unfinished = 0;
  int items_inflight = 0;  // queued or running work items
  std::atomic<std::uint64_t> bytes_done{0};
  std::uint64_t bytes_total = 0;
  std::atomic<bool> cancelled{false};
  std::vector<std::shared_ptr<void>> keep;  // what the work items use by pointer (the files of a file batch)
  // The batch's deadline. With an idle window it moves on with progress: the batch fails when no byte
  // has moved for that long, whatever its size (transfer_options::idle).
  std::atomic<deadline::rep> until_ticks{0};
  std::chrono::nanoseconds idle{0};
  deadline until() const noexcept { return deadline(deadline::duration(until_ticks.load(std::memory_order_relaxed))); }
  void set_deadline(const transfer_options& o, std::chrono::nanoseconds default_idle) {
    idle = o.until ? std::chrono::nanoseconds(0) : o.idle.value_or(default_idle);
    until_ticks = (o.until ? *o.until : deadline_after(idle)).time_since_epoch().count();
  }
  // Bytes moved: a deadline that follows progress starts its window again.
  void moved() noexcept {
    if (idle.count() == 0) return;
    const deadline::rep t = deadline_after(idle).time_since_epoch().count();
    deadline::rep cur = until_ticks.load(std::memory_order_relaxed);
    while (cur < t && !until_ticks.compare_exchange_weak(cur, t, std::memory_order_relaxed)) {
    }
  }
  void* engine = nullptr;  // transfer_engine::impl, for wait() to run its own queued work
  transfer_engine::completion on_done;  // set: called once when the last request is final (no handle waits)
  // Called once when no work item is left (queued or running), so nothing touches the buffers any
  // more: for a stream-ordered batch, the point at which the user's stream may go on; for one whose
  // items hold it by pointer, where it lets go of itself.
  std::function<void()> on_quiet;
  enum class ordering { none, waiting_for_stream, stream_reached };
  std::atomic<ordering> order{ordering::none};

  // Under mu: records the end of one segment of request i; true when that made every request final.
  // `progress`: whether bytes moved restart an idle deadline here (callers that end many segments at
  // once do that once, after them).
  bool finish_locked(std::size_t i, std::uint64_t len, const error* e, request_state fail_state, bool progress = true) {
    request_result& r = results[i];
    if (r.state != request_state::pending) return false;  // already timed out / cancelled
    if (e && !r.err) r.err = *e;
    if (!e) {
      r.bytes_done += len;
      bytes_done += len;
      if (len && progress) moved();
    }
    if (--segs_left[i] > 0) return false;
    r.state = r.err ? (r.err->code() == errc::cancelled ? request_state::cancelled
                                                        : r.err->code() == errc::timeout ? request_state::timed_out
                                                                                          : fail_state)
                    : request_state::done;
    return --unfinished == 0;
  }

  // Calls on_done, once, outside the lock (it may submit more work or take its owner's locks).
  void completed(std::unique_lock<std::mutex>& l) {
    cv.notify_all();
    if (!on_done) return;
    auto f = std::move(on_done);
    on_done = nullptr;
    l.unlock();
    f(results);  // final: nothing changes them any more
  }

  // Records the end of one segment of request i.
  void finish(std::size_t i, std::uint64_t len, const error* e, request_state fail_state = request_state::failed) {
    std::unique_lock l(mu);
    if (finish_locked(i, len, e, fail_state)) completed(l);
  }
  // The end of one work item: segment `i` of its request ended (`len` bytes, or the error `e`).
  struct item_end {
    std::size_t i;
    std::uint64_t len;
    const error* e;
  };
  // Under mu: the ends of several segments, an idle deadline restarted once after them; true when
  // that made every request final.
  bool finish_all_locked(std::span<const item_end> xs) {
    bool final_now = false, any_bytes = false;
    for (const item_end& x : xs) {
      // Bytes of a request already final (timed out or cancelled meanwhile) move no deadline on.
      any_bytes = any_bytes || (!x.e && x.len && results[x.i].state == request_state::pending);
      final_now = finish_locked(x.i, x.len, x.e, request_state::failed, false) || final_now;
    }
    if (any_bytes) moved();
    return final_now;
  }
  // The ends of several segments under one lock (a work item's blocks, synchronized once).
  void finish_many(std::span<const item_end> xs) {
    std::unique_lock l(mu);
    if (finish_all_locked(xs)) completed(l);
  }
  // The ends of several work items under one lock (a worker reports what a round finished together):
  // finish() and item_done() for each, in that order of effects.
  void end_items(std::span<const item_end> xs) {
    std::function<void()> quiet;
    std::unique_lock l(mu);
    const bool final_now = finish_all_locked(xs);
    items_inflight -= static_cast<int>(xs.size());
    if (items_inflight == 0) {
      quiet = std::move(on_quiet);
      on_quiet = nullptr;
    }
    if (final_now) completed(l);
    else if (items_inflight == 0) cv.notify_all();
    if (l.owns_lock()) l.unlock();
    if (quiet) quiet();
  }
  // Progress of request i before it finishes (bytes delivered so far).
  void progress(std::size_t i, std::uint64_t n) {
    std::lock_guard l(mu);
    if (results[i].state != request_state::pending) return;
    results[i].bytes_done += n;
    bytes_done += n;
    if (n) moved();
  }
  // A request that never reaches the workers (bad input, classification error).
  void fail_now(std::size_t i, error e) {
    std::unique_lock l(mu);
    results[i].state = request_state::failed;
    results[i].err = std::move(e);
    segs_left[i] = 0;
    if (--unfinished == 0) completed(l);
  }
  void item_done(int n = 1) {
    std::function<void()> quiet;
    {
      std::lock_guard l(mu);
      if ((items_inflight -= n) != 0) return;
      cv.notify_all();
      quiet = std::move(on_quiet);
      on_quiet = nullptr;
    }
    if (quiet) quiet();
  }
};


// Builds a batch handle around fresh state (for engines other than the transfer engine).
std::shared_ptr<transfer_batch::state> make_batch_state(std::size_t requests, const transfer_options& o, std::chrono::nanoseconds default_idle);
transfer_batch make_batch(std::shared_ptr<transfer_batch::state> s);

}  // namespace ferry
