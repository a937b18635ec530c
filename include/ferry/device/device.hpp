#pragma once
// The accelerator interface: ferry's user-space analog of GMEM's `struct gm_mmu`.
//
// A device offers exactly the hooks every layer above needs, and nothing about policy:
//   - physical memory in chunks of the device's granularity, on the device or in host memory;
//   - virtual address ranges, and mapping/unmapping/protecting chunks inside them;
//   - streams: ordered queues of asynchronous copies (and pattern/checksum ops used to verify data
//     in place), with events, cross-stream waits and deadline-bounded synchronization.
// Backends: `cuda` (CUDA driver VMM API, loaded at run time) and `sim` (a CPU-only model used to
// test everything above on machines without a GPU; never for performance claims).
//
// The public methods are non-virtual: they validate arguments, keep the mapping book-keeping and
// the statistics once for every backend, then call the private do_* hooks. So both backends
// refuse the same bad input with the same error text.
#include <ferry/core/error.hpp>
#include <ferry/core/export.hpp>
#include <ferry/core/stats.hpp>
#include <ferry/device/event.hpp>
#include <ferry/device/memory.hpp>
#include <ferry/device/stream.hpp>
#include <ferry/mem/memory.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <span>
#include <string>
#include <vector>

namespace ferry {

// What a device is. Fields a backend cannot know are 0 / empty / -1.
struct device_info {
  device_kind backend = device_kind::none;  // cuda or sim
  int ordinal = 0;      // index within the backend
  std::string name;     // "NVIDIA H200", "ferry sim device"
  std::string uuid;
  std::uint64_t total_memory = 0;
  std::uint64_t granularity = 0;  // physical chunk size unit for device memory
  int cc_major = 0, cc_minor = 0;
  std::string pci_bus_id;  // "0000:18:00.0"
  int numa_node = -1;      // host NUMA node closest to the device
  int copy_engines = 0;    // asynchronous copy engines
  // "cuda:0" / "sim:1": the canonical name used in URIs and errors.
  std::string id() const { return std::string(to_string(backend)) + ":" + std::to_string(ordinal); }
};

// Told of kernel launches on a device -- the user's own included (CUDA: CUPTI callbacks on the
// launch calls of the driver and runtime APIs, graph launches, and the runtime API's copies and
// memsets). before_launch runs on the launching thread before the launch is queued, after_launch
// once the call returns; neither may launch kernels itself. Launches captured into a CUDA graph are
// not reported (nothing runs then); the graph's launch is.
class FERRY_API launch_observer {
 public:
  virtual ~launch_observer();
  virtual void before_launch() noexcept = 0;
  virtual void after_launch() noexcept = 0;
};

class FERRY_API device {
 public:
  virtual ~device();
  device(const device&) = delete;
  device& operator=(const device&) = delete;

  const device_info& info() const noexcept { return info_; }
  std::string id() const { return info_.id(); }
  memory_usage memory() { return do_memory(); }
  // Chunk size unit for memory at `where` (device memory or host memory for this device).
  std::uint64_t granularity(location where = location::on_device());

  // Physical memory: bytes must be a positive multiple of granularity(where). Device memory is this
  // device's (id -1 or its ordinal) or a peer's of the same backend (the peer's ordinal): the chunk
  // belongs to this device, maps in its ranges and is granted like any other -- how one address range
  // spans several GPUs (a unified space over them). A peer's memory needs peer access (throws
  // not_supported) and counts against the peer's capacity. The peer must outlive the chunk.
  physical_chunk allocate(std::uint64_t bytes, location where = location::on_device());

  // Reserves `bytes` (a multiple of the device granularity) of virtual address space.
  va_range reserve(std::uint64_t bytes);
  // Maps a whole chunk at va (granularity-aligned, inside one of this device's reservations, not
  // overlapping another mapping). The range has no access until set_access grants it.
  void map(void* va, const physical_chunk& chunk);
  // Unmaps [va, va+bytes), which must consist of whole mappings.
  void unmap(void* va, std::uint64_t bytes);
  // Sets who may access [va, va+bytes), which must be mapped. The CPU can be granted access only
  // to host chunks; device chunks are never CPU-accessible (as on CUDA).
  void set_access(void* va, std::uint64_t bytes, std::span<const access_desc> grants);

  std::unique_ptr<stream> create_stream();
  // A view of a stream that someone else made (the user's cudaStream_t, torch's current stream,
  // the legacy or per-thread default stream): work ferry enqueues through it runs in that stream's
  // order. Destroying the view neither synchronizes nor destroys the stream; the stream must outlive
  // the view. A CUDA stream must belong to this device's primary context (the runtime API's, so
  // torch's and CuPy's); a stream of another device or context is refused (invalid_argument).
  std::unique_ptr<stream> wrap_stream(native_stream s);
  // The default wait deadline for this device's streams.
  std::chrono::nanoseconds default_timeout() const noexcept { return default_timeout_; }

  struct range_info {
    std::uintptr_t base = 0;
    std::uint64_t size = 0;
    std::uint64_t serial = 0;  // unique per reservation: a released and re-reserved VA gets a new one
  };
  // The reservation containing p, if any.
  std::optional<range_info> range_containing(const void* p) const;
  // Lets this device's copy engines reach memory of `peer` directly (CUDA: cuCtxEnablePeerAccess).
  // Idempotent. Throws not_supported when the pair has no peer access.
  void enable_peer_access(device& peer);

  // Bytes from p to the end of the mapping containing it, or 0 when p is not in one of this device's
  // mappings. Copies are split there: one DMA never spans two mapped chunks (with CUDA a range over
  // several VMM allocations -- host and device chunks mixed -- is not one copy).
  std::uint64_t mapping_rest(const void* p) const;
  // True if [p, p+bytes) lies inside one of this device's reservations.
  bool owns(const void* p, std::size_t bytes = 1) const;
  // Describes the mapping state of an address, for error messages: "mapped (device chunk, rw)".
  std::string describe_address(const void* p) const;

  // Throws bad_address unless every byte of [p, p+bytes) that lies in this device's ranges is
  // mapped with the access that device `engine_ordinal` (of the same backend) needs. Bytes outside
  // all ranges are not this device's business (host memory, other allocators) and pass.
  void check_access(const void* p, std::size_t bytes, bool write, int engine_ordinal, std::string_view op,
                    std::string_view side) const;

  ferry::stats& counters() noexcept { return stats_; }

  // Tells `o` of every kernel launch on this device until unwatch_launches(o). False, with the reason
  // in `why`, when the backend cannot see launches here (CUDA without CUPTI, or another CUPTI
  // subscriber such as a profiler). unwatch waits for the observer's calls under way.
  bool watch_launches(launch_observer& o, std::string& why);
  void unwatch_launches(launch_observer& o) noexcept;
  // True when the work of every launch reported to observers so far (on any stream, the user's own
  // included) has finished. Work is tracked only while an observer watches (launches made while
  // none does are not waited for); a backend whose launches run inside their report (sim) always
  // says true.
  bool launched_work_done() noexcept { return do_launched_work_done(); }

  // Backend-level: used by physical_chunk / va_range destructors.
  void release_chunk(physical_chunk& c) noexcept;
  void release_range(va_range& r) noexcept;

 protected:
  device(device_info info, std::chrono::nanoseconds default_timeout);
  device_info info_;

  struct mapping {
    std::uint64_t size;
    std::uint64_t chunk;  // backend handle
    location where;
    access device_access = access::none;  // for this device
    access host_access = access::none;
    std::uint64_t peer_read = 0;   // bit i: device ordinal i of the same backend may read
    std::uint64_t peer_write = 0;  // ... may write
  };
  // Looks up the mapping containing p (nullptr if none). Caller holds map_mu().
  const mapping* find_mapping(std::uintptr_t p, std::uintptr_t* base = nullptr) const;
  std::mutex& map_mu() const { return mu_; }
  // Backends call these around every kernel launch they see (on the launching thread; nested calls
  // count once).
  void launching() noexcept;
  void launched() noexcept;
  // Whether any observer watches launches now (a backend need not report or track them otherwise).
  bool watched() const noexcept { return watchers_.load(std::memory_order_relaxed) > 0; }

 private:
  virtual memory_usage do_memory() = 0;
  virtual std::uint64_t do_granularity(location where) = 0;
  virtual std::uint64_t do_allocate(std::uint64_t bytes, location where) = 0;  // returns handle
  virtual void do_free(std::uint64_t handle, std::uint64_t bytes, location where) noexcept = 0;
  virtual std::uintptr_t do_reserve(std::uint64_t bytes, std::uint64_t alignment) = 0;
  virtual void do_release(std::uintptr_t base, std::uint64_t bytes) noexcept = 0;
  virtual void do_map(std::uintptr_t va, std::uint64_t bytes, std::uint64_t handle, location where) = 0;
  virtual void do_unmap(std::uintptr_t va, std::uint64_t bytes) noexcept = 0;
  // Unmaps a run of several whole mappings in one call; false (nothing done) when the backend cannot.
  virtual bool do_unmap_run(std::uintptr_t, std::uint64_t) noexcept { return false; }
  virtual void do_set_access(std::uintptr_t va, std::uint64_t bytes, const mapping& m,
                             std::span<const access_desc> grants) = 0;
  virtual std::unique_ptr<stream> do_create_stream() = 0;
  virtual std::unique_ptr<stream> do_wrap_stream(native_stream s) = 0;
  virtual void do_enable_peer_access(device& peer) = 0;
  // Starts seeing launches (idempotent); false with the reason when it cannot.
  virtual bool do_watch_launches(std::string& why) {
    why = "this backend does not report kernel launches";
    return false;
  }
  virtual bool do_launched_work_done() noexcept { return true; }

  struct chunk_state {
    std::uint64_t size;
    location where;
    int mappings = 0;
    bool released = false;
  };
  void unmap_locked(std::uintptr_t va, std::uint64_t bytes);

  std::chrono::nanoseconds default_timeout_;
  mutable std::mutex mu_;
  struct range_rec {
    std::uint64_t size;
    std::uint64_t serial;
  };
  std::map<std::uintptr_t, range_rec> ranges_;  // base -> size, serial
  std::uint64_t next_range_serial_ = 0;
  std::map<std::uintptr_t, mapping> mappings_;      // va -> mapping
  std::map<std::uint64_t, chunk_state> chunks_;     // handle -> state
  ferry::stats stats_;
  // Held shared from launching() to launched() (observers are called under it); exclusive to change.
  std::shared_mutex launch_mu_;
  std::vector<launch_observer*> launch_obs_;
  std::atomic<std::size_t> watchers_{0};  // launch_obs_.size(), read without the lock
  counter& c_alloc_;
  counter& c_alloc_bytes_;
  counter& c_free_;
  counter& c_map_;
  counter& c_unmap_;
};

}  // namespace ferry
