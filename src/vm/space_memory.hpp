#pragma once
// The memory behind a unified address space (vm layer, its own sources only): the virtual ranges it
// reserves and the physical chunks mapped there -- a host chunk per page, kept once made, and per
// device a pool of slots that pages take and give back. It makes, maps and copies memory; which page
// lives where, and what the shared range points at, is the space's (address_space.cpp).
#include <ferry/device/device.hpp>
#include <ferry/vm/page_table.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace ferry::vm {

// The page table's location of the space's device k (0-based) is k + 1; 0 is host memory.
constexpr location loc_of(std::size_t k) { return static_cast<location>(k + 1); }

// Where a space's time goes (address_space::timings), in nanoseconds, added to by whichever thread
// spends it.
struct space_clock {
  std::atomic<std::uint64_t> quiesce{0}, allocate{0}, unmap{0}, map{0}, access{0}, copy_wait{0}, cpu_fault{0}, write_wait{0};
};

// Adds the time from its making to its end to `into`.
struct timed {
  using clk = std::chrono::steady_clock;
  std::atomic<std::uint64_t>& into;
  clk::time_point t0 = clk::now();
  ~timed() { into += std::chrono::duration_cast<std::chrono::nanoseconds>(clk::now() - t0).count(); }
};

class space_memory {
 public:
  // A range of addresses, read as bytes at offsets.
  struct view {
    std::uintptr_t base_ = 0;
    std::uint64_t size_ = 0;
    void* base() const noexcept { return reinterpret_cast<void*>(base_); }
    std::uintptr_t address() const noexcept { return base_; }
    std::uint64_t size() const noexcept { return size_; }
    template <typename T = std::byte>
    T* at(std::uint64_t offset) const noexcept { return reinterpret_cast<T*>(base_ + offset); }
  };
  // Per device k: its pool of slots (device chunks, mapped in `pool` at their index) and which slot
  // each page uses there (-1: none; the page's lock). A page may have copies on several devices
  // (READ_MOSTLY).
  struct devmem {
    va_range pool;
    std::vector<std::int64_t> slot_of;
    std::vector<physical_chunk> slots;      // slot_mu
    std::vector<std::uint32_t> idle, holes; // slot_mu: made and unused / never made or trimmed
    std::uint32_t made = 0;                 // slot_mu: slots below this index exist or are holes
    std::unique_ptr<stream> st;             // this device's copy engines: copies to (or from) it
    std::mutex st_mu;
  };

  // The page size for `devs` (their common granularity, which they must share) and a wish.
  static std::uint64_t page_for(const std::vector<device*>& devs, std::uint64_t wish);
  // Reserves the ranges of `npages` pages of `page` bytes on devs[0], the home device, which makes
  // every chunk (a peer's memory too, so one range holds them all); every device is let reach every
  // other's memory. `deadline`: each copy's wait.
  space_memory(const std::vector<device*>& devs, std::uint64_t page, std::uint64_t npages, std::chrono::nanoseconds deadline,
               space_clock& clock);
  // Waits for the copies still queued, then lets the ranges go.
  ~space_memory();
  space_memory(const space_memory&) = delete;
  space_memory& operator=(const space_memory&) = delete;

  // Every device may read and write every chunk (mirrors, shared range): the CPU host chunks only.
  std::vector<access_desc> device_grants() const;
  devmem& on(location at) { return *dm[static_cast<std::size_t>(at - 1)]; }
  // Where page p's copy at `at` is mapped for the space's own copies (host mirror or device pool).
  std::byte* mirror(location at, std::uint64_t p) {
    return at == host ? host_mirror.at(p * page) : on(at).pool.at(static_cast<std::uint64_t>(on(at).slot_of[p]) * page);
  }
  physical_chunk& chunk(location at, std::uint64_t p) { return at == host ? hostc[p] : on(at).slots[on(at).slot_of[p]]; }
  // Page p has memory at `at`: its host chunk (made once, page locked), or a device slot.
  void ensure_chunk(location at, std::uint64_t p);
  // Device page p's slot is free for other pages (page locked).
  void drop(std::uint64_t p, location at) noexcept;
  // Gives device memory no page uses back to the devices.
  void trim();
  // The copy engines that move a page from -> to: the target device's, or the source device's when
  // the target is host memory (each device's engines reach its own memory at full speed; a peer's
  // over NVLink / PCIe peer-to-peer).
  devmem& engine(location from, location to) { return on(to != host ? to : from != host ? from : loc_of(0)); }
  // One page from -> to, waited for.
  void copy_sync(location from, location to, std::byte* dst, const std::byte* src);
  // Page memory at dst (a mirror of location `at`) set to zeros, waited for: a page made fresh, copied
  // from one zeroed chunk of the device granularity (not a whole zeroed page: the space is made at a
  // program's first allocation, and a page-sized pinned chunk is most of what that costs).
  void zero_sync(location at, std::byte* dst);

  const std::vector<device*>& devs;
  device& dev;
  const std::uint64_t page, npages;
  // The pages' addresses: `shared`, inside a reservation with `pad` bytes more at each end (the device
  // granularity, what CUDA's own allocations are rounded to). Those two pads are always mapped (to
  // host chunks of their own, every device and the CPU may read and write them), so that a small
  // out-of-bounds access before the first allocation or after the last one touches memory, as it
  // does next to a cudaMalloc or managed allocation, instead of killing the process; what is written
  // there is never read back as anyone's data.
  va_range padded;
  std::uint64_t pad = 0;
  view shared;
  va_range host_mirror;                     // host mirror: a host chunk per page, and the zeroed chunk after them
  std::vector<std::unique_ptr<devmem>> dm;
  std::vector<physical_chunk> hostc;        // per page, kept once made; guarded by the page's lock

 private:
  void map_mirror(void* va, const physical_chunk& c, bool host_chunk);
  std::chrono::nanoseconds deadline_;
  space_clock& t_;
  std::mutex slot_mu_;
  physical_chunk zero_;                     // `pad` zeroed bytes of host memory, at the end of the host mirror
  physical_chunk pad_before_, pad_after_;   // mapped on each side of `shared`
};

}  // namespace ferry::vm
