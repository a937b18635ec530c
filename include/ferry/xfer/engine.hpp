#pragma once
// The transfer engine: one asynchronous API for batches of {dst, src, bytes} between host memory
// (pageable or pinned), GPU memory (same GPU or another) and sim devices.
//
// Shaped like io_uring: submit a batch -> poll or wait -> read per-request results. For each
// request the engine classifies both pointers (registration cache) and picks a path:
//   direct      both sides reachable by one device's copy engine (device<->pinned host, same device)
//   peer        GPU<->GPU with peer access (NVLink/PCIe), after enabling it once per pair
//   registered  pageable host memory registered through the cache (cached: lazy unpinning)
//   bounce      pageable host memory pipelined through pinned staging buffers on several workers
//   staged      device<->device without peer access: through a pinned host buffer
//   host        host<->host memcpy
// The choice is counted in stats ("path.*") and logged at debug level. Large requests are split
// into chunks spread over workers (each with its own streams, so over the GPU's copy engines);
// small requests are grouped into one work item. Every batch has a deadline; cancel() stops what
// has not started; one failing request never hides the others: each has its own result.
#include <ferry/core/export.hpp>
#include <ferry/core/stats.hpp>
#include <ferry/device/registry.hpp>
#include <ferry/mem/registration.hpp>
#include <ferry/xfer/settings.hpp>

#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

namespace ferry {

class pinned_pool;
class stream_gates;

struct transfer_request {
  void* dst = nullptr;
  const void* src = nullptr;
  std::uint64_t bytes = 0;
  // What the caller already knows the memory to be (from registration_cache::classify, for this
  // range or one holding it): the engine then does not classify that side again. Null: it does.
  const memory_region* dst_region = nullptr;
  const memory_region* src_region = nullptr;
};

enum class request_state { pending, done, failed, cancelled, timed_out };
enum class transfer_path { none, direct, peer, registered, bounce, staged, host };
FERRY_API std::string_view to_string(request_state s) noexcept;
FERRY_API std::string_view to_string(transfer_path p) noexcept;

struct request_result {
  request_state state = request_state::pending;
  transfer_path path = transfer_path::none;
  std::uint64_t bytes_done = 0;
  std::optional<error> err;  // set for failed / cancelled / timed_out
};

struct transfer_options {
  // The deadline. `until`: a fixed point in time. Without it the batch fails once no byte has moved
  // for `idle` (default FERRY_DEADLINE): a large transfer from slow storage is not cut off at a time
  // that assumes a speed, and a stalled one still ends.
  std::optional<deadline> until;
  std::optional<std::chrono::nanoseconds> idle = std::nullopt;
  // Stream order (a user's stream: device::wrap_stream): the batch starts once the work enqueued on
  // `on` before submit completed, and work enqueued on `on` after submit returns waits for the
  // batch -- on the GPU, through stream memory operations; no CPU thread synchronizes the stream.
  // The stream is released when the batch ends however it ends (done, failed, cancelled, deadline):
  // later work then runs, and the batch's results say whether the data is there. The stream must
  // stay alive until then. docs/design/stream-ordering.md.
  stream* on = nullptr;
};

class transfer_engine;

// A submitted batch. Destroying it cancels what has not started and waits for what has.
class FERRY_API transfer_batch {
 public:
  transfer_batch() = default;
  transfer_batch(transfer_batch&&) noexcept = default;
  transfer_batch& operator=(transfer_batch&&) noexcept;
  ~transfer_batch();

  // True once every request reached a final state. Never blocks.
  bool poll() const;
  // Blocks until every request is final or the batch deadline passes; then unfinished requests
  // become timed_out. Returns true when all requests are done (none failed). After a timeout, a
  // piece already running may still touch the buffers until it stops at its own deadline: keep
  // the buffers until the batch is destroyed (the destructor waits for running pieces).
  bool wait();
  // As wait() -- the same result, and the batch settled if its own deadline passes first -- but it
  // also returns false at `t` if the batch is not over by then (nothing changes then: wait again, or
  // cancel); poll() tells the two falses apart. Unlike wait() it runs none of the batch's queued work
  // on this thread. For a caller that must look up now and then (a Python thread lets its signal
  // handlers run: Ctrl-C).
  bool wait(deadline t);
  // True once the batch's deadline has passed (a deadline that follows progress: no byte moved for
  // its window); wait() then returns at once. Never blocks.
  bool expired() const;
  // Requests not yet started become cancelled; started chunks finish; remote files' requests under
  // way end now (their source sees the batch's deadline pulled to the past), failing as cancelled.
  // wait() then returns as soon as the work under way has stopped.
  void cancel();
  std::uint64_t bytes_done() const;
  std::uint64_t bytes_total() const;
  std::vector<request_result> results() const;
  // Throws the first failed request's error (with its index) if any request did not complete.
  void check() const;

  struct state;  // opaque

 private:
  friend class transfer_engine;
  friend transfer_batch make_batch(std::shared_ptr<state> s);
  std::shared_ptr<state> s_;
};

class FERRY_API transfer_engine {
 public:
  transfer_engine(device_registry& devices, registration_cache& cache, const xfer_settings& s);
  ~transfer_engine();
  transfer_engine(const transfer_engine&) = delete;
  transfer_engine& operator=(const transfer_engine&) = delete;

  struct impl;  // opaque

  transfer_batch submit(std::span<const transfer_request> requests, transfer_options o = {});
  // Submits a batch that no thread waits for: `done` is called once, with every request's result,
  // when all are final -- on the engine thread that finished the last one (or on this thread, before
  // submit returns, if none could start). The batch runs until it is done or its deadline passes; it
  // cannot be cancelled. `done` must not block: it runs where the engine's next copy would.
  using completion = std::function<void(std::span<const request_result>)>;
  void submit(std::span<const transfer_request> requests, transfer_options o, completion done);
  // Submit one request and wait; throws its error. A request that makes one unit of work (one
  // chunk, one device copy) runs on the calling thread, on its own stream: no worker hand-off.
  void copy(void* dst, const void* src, std::uint64_t bytes, transfer_options o = {});
  void copy(const transfer_request& r, transfer_options o = {});  // with regions the caller classified

  // The engine's pinned staging buffers near `device_memory`'s device (its NUMA node): the one
  // staging pool of a process, for layers above that land data in host memory before the engine
  // copies it on (FERRY_STAGING_BYTES each, FERRY_STAGING_BUFFERS per NUMA node).
  pinned_pool& staging_for(const memory_region& device_memory);

  ferry::stats& counters() noexcept;
  int workers() const noexcept;
  // Internal (src/xfer/stream_gates.hpp): the gates that order work on streams, shared with the
  // file engine.
  stream_gates& gates() noexcept;

 private:
  static transfer_batch submit_to(impl& I, std::span<const transfer_request> requests, transfer_options o, bool here,
                                  completion done = {});
  std::unique_ptr<impl> impl_;
};

}  // namespace ferry
