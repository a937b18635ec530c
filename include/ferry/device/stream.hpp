#pragma once
// Streams of the accelerator interface (ferry/device/device.hpp): ordered queues of asynchronous
// copies, pattern and checksum ops, stream memory operations and events on one device.
#include <ferry/core/export.hpp>
#include <ferry/core/stats.hpp>
#include <ferry/device/event.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

namespace ferry {

class device;

// Who moves the bytes of a stream copy: the device's DMA copy engines (the default), or its SMs (a
// copy kernel: both ends must be mapped in the device's ranges). SM copies reach about the same PCIe
// bandwidth but occupy the SMs, and with CUDA every VMM map/set_access waits for running kernels, so
// unified-memory migrations keep DMA (docs/design/unified-memory.md). The sim backend has one kind.
enum class copy_engine { dma, sm };

// A backend's own handle of a stream. For CUDA it is the CUstream (cudaStream_t is the same value):
// 0 and legacy() name the legacy default stream, per_thread() the per-thread default stream. The
// sim backend's streams have handles too, so that tests can play a user's streams without a GPU.
struct native_stream {
  std::uintptr_t handle = 0;
  static constexpr native_stream legacy() noexcept { return {1}; }      // CU_STREAM_LEGACY
  static constexpr native_stream per_thread() noexcept { return {2}; }  // CU_STREAM_PER_THREAD
  friend bool operator==(native_stream, native_stream) = default;
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

}  // namespace ferry
