// The file side of stream-ordered file I/O (transfer_options::on): each request a pipeline of chunks
// through a few staging buffers, ordered on the user's stream by gates (docs/design/stream-ordering.md).
#include "io/file_engine_impl.hpp"
#include "mem/place_cuts.hpp"

namespace ferry {

// ---- stream order (transfer_options::on) --------------------------------------------------------

namespace {

// One request of a stream-ordered batch: a pipeline of chunks through a few staging buffers. Chunk
// k has the gate number seq0 + k. A read: the file side fills the chunk's buffer and releases k; the
// stream waits for k, copies the buffer into the destination and writes `started = k`, which frees
// the buffer for chunk k + slots. A write: the stream waits for k (the buffer is free), copies the
// source into it and writes `started = k`; the file side then writes it out and releases
// k + slots. Held by every callback that may still touch it, so its buffers stay until the stream
// passed its last copy and the file side its last I/O.
struct stream_op {
  std::shared_ptr<transfer_batch::state> b;
  std::size_t idx = 0;
  file_request r;
  file_engine* files = nullptr;
  stream_gates* gates = nullptr;
  stream_gates::gate* g = nullptr;
  std::uint32_t seq0 = 0;
  std::uint64_t chunk = 0;
  std::size_t n = 0;
  std::vector<pinned_pool::buffer> slots;
  std::shared_ptr<registration> hold;  // pageable memory pinned for the stream's copies, or unified memory kept in place
  // Unified memory: where in the request its pages' place changes (one_place, asked before the gate's
  // lock: the answer takes page locks, which a migration holds while it waits for the stream). A copy
  // covers pages mapped in one place only.
  std::vector<std::uint64_t> cuts;
  std::mutex mu;
  std::optional<error> err;     // the first failure: later chunks are not read or written
  std::vector<bool> released;   // chunk k's number was released
  std::vector<bool> started_io; // a read: chunk k's read was started
  std::size_t settled = 0;      // chunks the batch has a result for

  std::uint64_t len(std::size_t k) const { return std::min(chunk, r.bytes - k * chunk); }
  std::uint64_t off(std::size_t k) const { return r.offset + k * chunk; }
  std::byte* slot(std::size_t k) const { return slots[k % slots.size()].data(); }
  std::uint32_t seq(std::size_t k) const { return seq0 + static_cast<std::uint32_t>(k); }
  std::string where(std::size_t k) const {
    return fmt::format("request {} {} offset {} (stream-ordered {}, chunk {} of {})", idx, r.f->path(), off(k),
                       r.write ? "write" : "read", k + 1, n);
  }
};
using op_ptr = std::shared_ptr<stream_op>;

// The batch learns the fate of chunk k; the request's item ends with its last chunk.
void settle(const op_ptr& op, std::size_t k, const error* e) {
  op->b->finish(op->idx, e ? 0 : op->len(k), e);
  bool last = false;
  {
    std::lock_guard l(op->mu);
    last = ++op->settled == op->n;
  }
  if (last) op->b->item_done();
}

// Releases chunk k's number once.
void release_chunk(const op_ptr& op, std::size_t k) {
  {
    std::lock_guard l(op->mu);
    if (op->released[k]) return;
    op->released[k] = true;
  }
  op->gates->release(*op->g, op->seq(k));
}

// The request failed: the stream is let past every chunk not yet released (what it then copies is
// not the file's; the result says so). Reads in flight release their own chunks when they end.
void fail_op(const op_ptr& op, const error& e) {
  std::vector<std::size_t> rest;
  {
    std::lock_guard l(op->mu);
    if (op->err) return;
    op->err = e;
    for (std::size_t k = 0; k < op->n; ++k)
      if (!op->released[k] && (op->r.write || !op->started_io[k])) {
        op->started_io[k] = true;  // a read never starts now
        rest.push_back(k);
      }
  }
  for (std::size_t k : rest) release_chunk(op, k);
}

error io_error(const stream_op& op, std::size_t k, const request_result& res) {
  if (res.err) return res.err->with_context(op.where(k));
  return error(errc::out_of_range, "file.read", op.where(k),
               fmt::format("the file ends within the range (read {} of {} bytes of the chunk)", res.bytes_done, op.len(k)));
}

// Starts the read of chunk k into its buffer, unless the request failed.
void read_chunk(const op_ptr& op, std::size_t k) {
  {
    std::lock_guard l(op->mu);
    if (op->err || op->started_io[k]) return;
    op->started_io[k] = true;
  }
  file_request q{op->r.f, op->off(k), op->slot(k), op->len(k), false};
  transfer_options o;
  o.until = op->b->until();
  op->files->submit({&q, 1}, o, [op, k](std::span<const request_result> res) {
    if (res[0].state != request_state::done || res[0].bytes_done != op->len(k)) {
      std::memset(op->slot(k), 0, op->len(k));  // never another file's bytes in the destination
      error e = io_error(*op, k, res[0]);
      release_chunk(op, k);
      fail_op(op, e);
      return;
    }
    release_chunk(op, k);
  });
}

void write_chunk(const op_ptr& op, std::size_t k) {
  file_request q{op->r.f, op->off(k), op->slot(k), op->len(k), true};
  transfer_options o;
  o.until = op->b->until();
  op->files->submit({&q, 1}, o, [op, k](std::span<const request_result> res) {
    if (res[0].state != request_state::done) {
      error e = io_error(*op, k, res[0]);
      settle(op, k, &e);
      return fail_op(op, e);
    }
    settle(op, k, nullptr);
    // Chunk k's buffer is free again: the chunk that uses it next may be copied into it.
    if (k + op->slots.size() < op->n) release_chunk(op, k + op->slots.size());
  });
}

// The stream reached chunk k's `started` (or the deadline came first).
void reached(const op_ptr& op, std::size_t k, bool yes) {
  if (!yes) {
    error e = op->b->cancelled
                  ? error(errc::cancelled, "file.stream_order", op->where(k),
                          "cancelled before the stream got there (its handle was destroyed or cancel() called; the stream is released)")
                  : error(errc::timeout, "file.stream_order", op->where(k),
                          "deadline passed before the stream got there (its earlier work had not finished; the stream is released)");
    settle(op, k, &e);
    return fail_op(op, e);
  }
  std::optional<error> failed;
  {
    std::lock_guard l(op->mu);
    failed = op->err;
  }
  if (!op->r.write) {  // chunk k is in the destination: its buffer takes chunk k + slots
    settle(op, k, failed ? &*failed : nullptr);
    if (k + op->slots.size() < op->n) read_chunk(op, k + op->slots.size());
    return;
  }
  if (failed) return settle(op, k, &*failed);
  write_chunk(op, k);  // the stream filled the buffer
}

}  // namespace

void file_engine::start_on(const std::shared_ptr<transfer_batch::state>& b, std::span<const file_request> reqs, stream& s) {
  impl& I = *impl_;
  stream_gates& gates = I.xfer.gates();
  device& dev = s.owner();
  memory_region near{memory_type::device, dev.info().backend, dev.info().ordinal, 0, 0, 0, nullptr};
  pinned_pool& pool = I.xfer.staging_for(near);
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    b->sizes[i] = reqs[i].bytes;
    b->bytes_total += reqs[i].bytes;
  }
  {
    std::lock_guard l(b->mu);
    b->items_inflight = 1;  // held until every request is on the stream: none completes the batch early
  }
  // Each request takes its buffers and goes onto the stream before the next takes any: a request
  // that waits for buffers waits for those of requests already on the stream (which the stream
  // frees as it passes them), never for those of a request still waiting to be enqueued.
  int items = 0;
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    const file_request& r = reqs[i];
    op_ptr op;
    try {
      check_request(r, i);
      memory_region m = I.cache.classify(r.mem, r.bytes);
      if (m.type == memory_type::unknown)
        fail(errc::bad_address, "file.submit", describe(r, i), "memory is not mapped memory ferry knows (freed or invalid?)");
      op = std::make_shared<stream_op>();
      op->b = b;
      op->idx = i;
      op->r = r;
      op->files = this;
      op->gates = &gates;
      op->chunk = pool.buffer_bytes();
      op->n = static_cast<std::size_t>((r.bytes + op->chunk - 1) / op->chunk);
      op->released.assign(op->n, false);
      op->started_io.assign(op->n, false);
      // The stream's copy engine reads / writes `mem` directly: pageable memory is pinned for it,
      // unified memory stays where it is.
      if ((m.type == memory_type::host_pageable && dev.info().backend == device_kind::cuda) || m.type == memory_type::unified)
        op->hold = std::make_shared<registration>(I.cache.acquire(r.mem, r.bytes));
      add_place_cuts(m, r.mem, r.bytes, op->cuts);  // pinned by the hold: the places stay as found
      // One buffer at least (waiting for it is the back-pressure of a busy pool), the rest of the
      // pipeline's depth as far as the pool has them now.
      std::size_t nslots = std::min<std::size_t>(op->n, static_cast<std::size_t>(I.cfg.stream_slots));
      op->slots.push_back(pool.get(b->until()));
      while (op->slots.size() < nslots) {
        auto more = pool.try_get(pinned_pool::growth::now);  // asked once per request: not "when used"
        if (!more) break;
        op->slots.push_back(std::move(more));
      }
      b->segs_left[i] = static_cast<int>(op->n);
      b->results[i].path = transfer_path::staged;
    } catch (const error& e) {
      b->fail_now(i, e);
      continue;
    }
    {
      std::lock_guard l(b->mu);
      ++b->items_inflight;
    }
    ++items;
    std::size_t enqueued = 0;  // chunks whose ops are all on the stream
    std::optional<error> refused;
    {
      auto o = gates.lock(s);
      op->g = &o.the_gate();
      for (std::size_t k = 0; k < op->n; ++k) {
        std::uint32_t q = o.take();
        if (k == 0) op->seq0 = q;
        if (refused) continue;  // numbers still taken for every chunk: released below
        bool copying = false;  // a copy of this chunk is on the stream
        try {
          auto* user = static_cast<std::byte*>(op->r.mem) + k * op->chunk;
          s.wait_value(o.finished(), q);
          const std::uint64_t lo = k * op->chunk, hi = lo + op->len(k);
          auto cut = std::upper_bound(op->cuts.begin(), op->cuts.end(), lo);
          for (std::uint64_t at = lo; at < hi;) {
            const std::uint64_t to = cut != op->cuts.end() && *cut < hi ? *cut++ : hi;
            if (op->r.write) s.copy(op->slot(k) + (at - lo), user + (at - lo), to - at);
            else s.copy(user + (at - lo), op->slot(k) + (at - lo), to - at);
            copying = true;
            at = to;
          }
          s.write_value(o.started(), q);
          ++enqueued;
        } catch (const error& e) {
          refused = e.with_context(op->where(k));
          // Copies of the chunk already on the stream use its buffer: the chunk counts as enqueued, so
          // that the buffers wait for the stream to pass it.
          if (copying) {
            try {
              s.write_value(o.started(), q);
            } catch (const error&) {
            }
            ++enqueued;
          }
        }
      }
    }
    if (refused) {
      for (auto& sl : op->slots) std::memset(sl.data(), 0, sl.size());
      {
        std::lock_guard l(op->mu);
        op->err = refused;
      }
      for (std::size_t k = 0; k < op->n; ++k) {
        release_chunk(op, k);
        if (k >= enqueued) settle(op, k, &*refused);
      }
      if (enqueued) gates.watch(*op->g, op->seq(enqueued - 1), deadline::max(), {}, [op](bool) {});
    } else {
      // The buffers go back to the pool once the stream passed its last copy (no deadline: the
      // stream may still copy into or out of them until then).
      gates.watch(*op->g, op->seq(op->n - 1), deadline::max(), {}, [op](bool) {});
    }
    // The first chunks start before any chunk is watched: a read started when the stream passed
    // chunk k (chunk k + slots) must come after every chunk before it was started, so that a
    // failure of one lets the stream past the chunks after it only.
    if (!refused)
      for (std::size_t k = 0; k < std::min(enqueued, op->slots.size()); ++k) {
        if (op->r.write) release_chunk(op, k);  // every buffer is free
        else read_chunk(op, k);
      }
    for (std::size_t k = 0; k < enqueued; ++k)
      gates.watch(*op->g, op->seq(k), b->until(), [b] { return b->cancelled.load(); }, [op, k](bool yes) { reached(op, k, yes); });
  }
  I.st.get("requests.stream_ordered").add(static_cast<std::uint64_t>(items));
  b->item_done();  // the hold taken above
}

}  // namespace ferry
