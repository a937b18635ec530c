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

class device;
class stream;

using deadline = std::chrono::steady_clock::time_point;
inline deadline deadline_after(std::chrono::nanoseconds d) { return std::chrono::steady_clock::now() + d; }

// Where physical memory lives.
enum class memory_kind { device, host };

struct location {
  memory_kind kind = memory_kind::device;
  // device: ordinal of a device of the same backend (-1: the device asked); host: NUMA node (-1: any).
  int id = -1;
  static location on_device(int ordinal = -1) { return {memory_kind::device, ordinal}; }
  static location on_host(int numa_node = -1) { return {memory_kind::host, numa_node}; }
};

// Who moves the bytes of a stream copy: the device's DMA copy engines (the default), or its SMs (a
// copy kernel: both ends must be mapped in the device's ranges). SM copies reach about the same PCIe
// bandwidth but occupy the SMs, and with CUDA every VMM map/set_access waits for running kernels, so
// unified-memory migrations keep DMA (docs/design/unified-memory.md). The sim backend has one kind.
enum class copy_engine { dma, sm };

enum class access : unsigned { none = 0, read = 1, read_write = 3 };

// Grants `who` (a device of this backend, or the host CPUs) access to a mapped range.
struct access_desc {
  location who;
  access flags = access::read_write;
};

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
  std::uint64_t bar1_total = 0;
  int pcie_gen_current = 0, pcie_width_current = 0, pcie_gen_max = 0, pcie_width_max = 0;
  int copy_engines = 0;    // asynchronous copy engines
  // "cuda:0" / "sim:1": the canonical name used in URIs and errors.
  std::string id() const { return std::string(to_string(backend)) + ":" + std::to_string(ordinal); }
};

struct memory_usage {
  std::uint64_t free = 0;
  std::uint64_t total = 0;
};

// A chunk of physical memory. Move-only; freed when the last owner lets go. A chunk released
// while still mapped stays alive until its last mapping is unmapped (as with cuMemRelease).
class FERRY_API physical_chunk {
 public:
  physical_chunk() = default;
  physical_chunk(physical_chunk&& o) noexcept { *this = std::move(o); }
  physical_chunk& operator=(physical_chunk&& o) noexcept;
  physical_chunk(const physical_chunk&) = delete;
  physical_chunk& operator=(const physical_chunk&) = delete;
  ~physical_chunk() { reset(); }

  explicit operator bool() const noexcept { return owner_ != nullptr; }
  std::uint64_t size() const noexcept { return size_; }
  location where() const noexcept { return where_; }
  std::uint64_t handle() const noexcept { return handle_; }  // backend-specific
  device* owner() const noexcept { return owner_; }
  void reset() noexcept;

 private:
  friend class device;
  device* owner_ = nullptr;
  std::uint64_t handle_ = 0;
  std::uint64_t size_ = 0;
  location where_;
};

// A reserved virtual address range: no memory behind it until chunks are mapped. Move-only; on
// destruction every chunk still mapped in it is unmapped and the range is returned.
class FERRY_API va_range {
 public:
  va_range() = default;
  va_range(va_range&& o) noexcept { *this = std::move(o); }
  va_range& operator=(va_range&& o) noexcept;
  va_range(const va_range&) = delete;
  va_range& operator=(const va_range&) = delete;
  ~va_range() { reset(); }

  explicit operator bool() const noexcept { return owner_ != nullptr; }
  void* base() const noexcept { return reinterpret_cast<void*>(base_); }
  std::uintptr_t address() const noexcept { return base_; }
  std::uint64_t size() const noexcept { return size_; }
  template <typename T = std::byte>
  T* at(std::uint64_t offset) const noexcept { return reinterpret_cast<T*>(base_ + offset); }
  device* owner() const noexcept { return owner_; }
  void reset() noexcept;

 private:
  friend class device;
  device* owner_ = nullptr;
  std::uintptr_t base_ = 0;
  std::uint64_t size_ = 0;
};

// A backend's own handle of a stream. For CUDA it is the CUstream (cudaStream_t is the same value):
// 0 and legacy() name the legacy default stream, per_thread() the per-thread default stream. The
// sim backend's streams have handles too, so that tests can play a user's streams without a GPU.
struct native_stream {
  std::uintptr_t handle = 0;
  static constexpr native_stream legacy() noexcept { return {1}; }      // CU_STREAM_LEGACY
  static constexpr native_stream per_thread() noexcept { return {2}; }  // CU_STREAM_PER_THREAD
  friend bool operator==(native_stream, native_stream) = default;
};

// Completion marker recorded on a stream.
class FERRY_API event {
 public:
  virtual ~event();
  // True once all work before the record point completed (successfully or not).
  bool done() { return do_query(); }
  // Waits until done or the deadline passes (then throws timeout naming the stream).
  void wait(deadline until);

 protected:
  event() = default;

 private:
  virtual bool do_query() = 0;
  virtual std::string do_describe() const = 0;
};

// An ordered queue of asynchronous work on one device. Work enqueued on one stream runs in order;
// different streams run concurrently. Errors found at enqueue time throw; errors found while
// running are reported by the next synchronize().
class FERRY_API stream {
 public:
  virtual ~stream();
  device& owner() const noexcept { return *owner_; }

  // Copies bytes between any two addresses this device can reach: its mapped ranges, host memory,
  // and peers' ranges that granted it access.
  void copy(void* dst, const void* src, std::size_t bytes, copy_engine by = copy_engine::dma);
  // Many copies at once (a batch of scattered blocks): as copy() of each, in order, enqueued in one
  // call where the backend has one (CUDA: cuMemcpyBatchAsync, driver 12.8+). On an error the
  // copies before the refused one may be enqueued (not by CUDA's batch call, which takes all or none).
  struct copy_desc {
    void* dst;
    const void* src;
    std::size_t bytes;
  };
  void copy_batch(std::span<const copy_desc> copies);
  // Writes ferry's data pattern (core/checksum.hpp) with `seed` to dst (8-byte aligned), on the device.
  void fill_pattern(void* dst, std::size_t bytes, std::uint64_t seed);
  // Computes checksum64 of src (8-byte aligned) on the device; *result (host memory) is valid
  // after the stream is synchronized.
  void checksum(const void* src, std::size_t bytes, std::uint64_t* result);

  // Stream memory operations on a 32-bit word of host memory the device can reach (pinned, or
  // registered with the device) or of the device's own memory. write_value stores `value` once the
  // work enqueued before it completed (and its writes are visible); wait_value holds the work
  // enqueued after it until (int32_t)(*addr - value) >= 0 -- a sequence number that only grows, so
  // wrap-around is harmless. Nothing runs on a CPU thread: how ferry orders its host-side work
  // with a user's kernels (docs/design/stream-ordering.md).
  void write_value(std::uint32_t* addr, std::uint32_t value);
  void wait_value(const std::uint32_t* addr, std::uint32_t value);

  // The backend's handle of this stream, for the user's own calls (a cudaStream_t).
  native_stream native_handle() const noexcept { return do_native_handle(); }
  // True for a view of a stream ferry did not make (device::wrap_stream).
  bool is_view() const noexcept { return view_; }

  // Records an event after the work enqueued so far.
  std::unique_ptr<event> record();
  // Work enqueued after this waits for `e` (which may belong to another stream of the same device).
  void wait(event& e);
  // True when all enqueued work completed.
  bool idle();
  // True while the stream captures a CUDA graph (a user's stream): work enqueued is recorded, not
  // run, and the stream must be neither queried nor waited for until the capture ends.
  bool capturing() { return do_capturing(); }
  // Waits for all enqueued work; throws timeout at the deadline, or the first asynchronous error.
  void synchronize(deadline until);
  void synchronize();  // with the device's default deadline (FERRY_DEADLINE)

 protected:
  explicit stream(device& owner, bool view = false);

 private:
  virtual void do_copy(void* dst, const void* src, std::size_t bytes) = 0;
  virtual void do_copy_sm(void* dst, const void* src, std::size_t bytes) { do_copy(dst, src, bytes); }
  // Copies already split at mappings; by default one do_copy each.
  virtual void do_copy_batch(std::span<const copy_desc> copies) {
    for (auto& c : copies) do_copy(c.dst, c.src, c.bytes);
  }
  virtual void do_fill_pattern(void* dst, std::size_t bytes, std::uint64_t seed) = 0;
  virtual void do_checksum(const void* src, std::size_t bytes, std::uint64_t* result) = 0;
  virtual std::unique_ptr<event> do_record() = 0;
  virtual void do_wait(event& e) = 0;
  virtual bool do_idle() = 0;
  virtual bool do_capturing() { return false; }
  virtual void do_synchronize(deadline until) = 0;
  virtual void do_write_value(std::uint32_t* addr, std::uint32_t value) = 0;
  virtual void do_wait_value(const std::uint32_t* addr, std::uint32_t value) = 0;
  virtual native_stream do_native_handle() const noexcept = 0;

  device* owner_;
  bool view_;
  counter* c_copies_;  // the device's, looked up once: copy() runs per request
  counter* c_copy_bytes_;
  counter* c_copy_batches_;  // copy_batch calls (each one enqueue of many copies)
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
