#pragma once
// A unified address space (GMEM's MAP_PEER_SHARED, in user space): one virtual range, valid on the CPU
// and on an attached device, whose 2 MiB pages live in device memory or host memory and move on
// demand. Built on ferry's device interface only (reserve / allocate / map / set_access / stream
// copies), so it runs on the `cuda` backend and on the CPU-only `sim` backend alike.
//
//  - Host-resident pages are host chunks mapped for the CPU and the device: the GPU reads them over
//    the bus and never sees an unmapped address. Device-resident pages are device chunks, which the
//    CPU cannot access: a CPU touch raises SIGSEGV.
//  - CPU faults: the SIGSEGV handler does no work beyond passing the address to this space's service
//    thread (a pipe write) and waiting on a futex; the service thread migrates the page to host
//    memory (copies, remaps -- CUDA calls happen there, never in the handler) and wakes it; the access
//    is retried. Many threads may fault at once. Why not userfaultfd: device-resident pages are
//    mappings of device memory, not anonymous memory, so only the signal reaches us for them.
//  - Copies go through private "mirror" mappings of every chunk, so migrations never touch the
//    shared range; the shared range is remapped (new copy first, old one dropped after). Host
//    chunks stay with their page once made (host memory is the pages' backing store, as in GMEM);
//    device chunks form a pool of slots reused by whichever pages live on the device.
//  - Ranges move in batches: the shared mappings of a batch are unmapped in runs, device targets
//    mapped before their copies, host targets after, access set per run, and the next batch's copies
//    are queued before this one's host mappings are made.
//  - Policy (coherence, capacity, eviction, hints, return) is the page_table's.
//  - Return: pages a CPU fault took from a device go back to it before the next kernel launch on
//    that device and, after `return_quiet`, in the background when the attached streams are idle
//    (page_table.hpp). Launches are seen through the device's launch callbacks (CUPTI with CUDA);
//    while a page goes back in the background, launches on the space's devices wait (a kernel never
//    runs into a mapping being switched). Without launch callbacks pages stay where the CPU took them.
// Several devices per space (all of one backend, with peer access between them): every page is
// mapped for all of them, a device-resident page lives in one device's memory (or, READ_MOSTLY, in
// several) and the others read it over NVLink / PCIe peer-to-peer; PREFETCH names the device. The
// first device reserves the ranges and makes every chunk (device::allocate on a peer); each device's
// own copy engines move pages to it. Streams that work on the space must be attached
// (attach_stream): migrations wait for them. The space is a peer-memory client of every
// registration cache of the process (add_process_client): memory type `unified`, pages pinned in
// place (and made exclusive) only while a transfer holds the registration, so file, remote and
// engine transfers into its pointers see the pages as they are; the space's memory is invalidated in
// the caches when the space goes. Faults from inside a page_table callback on the same page deadlock.
#include <ferry/core/export.hpp>
#include <ferry/device/device.hpp>
#include <ferry/mem/registration.hpp>
#include <ferry/vm/page_table.hpp>
#include <ferry/vm/settings.hpp>

#include <memory>
#include <span>
#include <string>
#include <vector>

namespace ferry::vm {

enum class advice { prefetch, dontneed, read_mostly, no_read_mostly, preferred_location, no_preferred_location };

struct FERRY_API space_options {
  // Bytes of device memory the space's pages may use (0: what the device has free when the space is
  // made, minus `reserve`). Beyond it pages are evicted to host memory. Device memory the space has
  // used stays with it (reused for other pages) until free() or the space's end, plus up to one batch
  // while a migration is under way.
  std::uint64_t device_capacity = 0;
  std::uint64_t reserve = 1ull << 30;
  std::uint64_t page_bytes = 0;  // the unit that migrates, rounded up to the device granularity (0: the granularity)
  replacement policy = replacement::lru;
  std::chrono::nanoseconds deadline = std::chrono::seconds(30);  // per fault / advice batch
  std::uint64_t batch = 16;        // pages per batched migration (PREFETCH, eviction, fault-ahead)
  // Pages a CPU fault moves to host: the faulting one, then (after the faulting thread runs on)
  // those after it in its allocation; doubling while faults come in sequence, up to 8 times.
  std::uint64_t fault_ahead = 8;
  // A page evicted and prefetched back within `thrash_lapse` stays on the host for `thrash_hold`
  // (the device reads it in place); lapse 0: every PREFETCH migrates. See page_table.hpp.
  std::chrono::nanoseconds thrash_lapse = std::chrono::seconds(1);
  std::chrono::nanoseconds thrash_hold = std::chrono::seconds(1);
  // Return of pages the CPU took from a device (page_table.hpp): before launches, after a quiet time
  // (0: only at launches), and how long a page the CPU takes back soon stays on the host.
  bool return_at_launch = true;
  std::chrono::nanoseconds return_quiet = std::chrono::milliseconds(200);
  // How long a prefetch waits for the attached streams' work before the service thread takes it over.
  std::chrono::nanoseconds prefetch_wait = std::chrono::milliseconds(200);
  std::chrono::nanoseconds return_hold = std::chrono::seconds(1);
  bool report = false;  // print report() to stderr when the space ends (FERRY_VM_REPORT)
  // FERRY_VM_* and FERRY_DEADLINE (docs/settings.md).
  static space_options from(const vm_settings& s);
};

// Where a space's migrations spend their time (the CUDA VMM calls are the expensive part), in ns.
struct space_timings {
  std::uint64_t quiesce = 0;  // waiting for attached streams
  std::uint64_t allocate = 0; // new physical chunks (first use of a page or device slot)
  std::uint64_t unmap = 0, map = 0, access = 0;  // shared-range remaps
  std::uint64_t copy_wait = 0;  // waiting for a batch's copies
  std::uint64_t cpu_fault = 0;  // serving CPU faults, each from its message to its page mapped (the faulting thread waits)
  // CPU writes to host pages waiting for the work launched since a launch took their write access
  // (part of cpu_fault: such a write faults).
  std::uint64_t write_wait = 0;
};

// The size of a space that can hold all the memory a program could have with `dev`: the device's
// memory plus the host's, rounded up to the device granularity (what managed memory is sized by).
FERRY_API std::uint64_t whole_memory_size(device& dev);

class FERRY_API address_space {
 public:
  // Reserves `bytes` (rounded up to the device granularity) of shared address space on `dev`.
  address_space(device& dev, std::uint64_t bytes, space_options o = {});
  // A space over several devices of one backend (the first reserves): pointers are valid on the CPU
  // and on each of them. Throws invalid_argument for mixed backends, a device given twice or unequal
  // granularities, not_supported when two of them have no peer access. The devices must outlive it.
  // space_options::device_capacity applies to each device.
  address_space(std::span<device* const> devs, std::uint64_t bytes, space_options o = {});
  ~address_space();
  address_space(const address_space&) = delete;
  address_space& operator=(const address_space&) = delete;

  // A range valid on the CPU and the device (first-fit, page-aligned). Throws out_of_memory when
  // the space has no room.
  void* alloc(std::uint64_t bytes);
  void free(void* p);
  // Hints for [p, p+bytes): prefetch to `where` (host or one of the space's devices, by ordinal; id -1:
  // the first), drop the device copy (dontneed: that device's, or with id -1 every device's), read
  // duplication on/off, preferred location (set, or none). A device not in the space is invalid_argument.
  void advise(void* p, std::uint64_t bytes, advice a, ferry::location where);
  void advise(void* p, std::uint64_t bytes, advice a, memory_kind where = memory_kind::device);

  void* base() const noexcept;
  std::uint64_t size() const noexcept;
  std::uint64_t page_bytes() const noexcept;
  // Streams whose work may touch this space: before a migration copies a page or remaps it, the
  // space waits (up to its deadline) for the work queued on them, so a migration never races a
  // running kernel or copy. Detach before destroying the stream.
  void attach_stream(stream& s);
  void detach_stream(stream& s);
  page_table& pages() noexcept;
  vm_stats stats() const;
  std::uint64_t cpu_faults() const noexcept;  // faults resolved for the CPU by the service thread
  // Whether pages the CPU took go back to the devices (launch callbacks seen on every device).
  bool returns_pages() const noexcept;
  space_timings timings() const noexcept;
  // Where the space's time went, in words for its user: faults, migrations, evictions, the time in
  // each part of a migration, and the largest part named with what usually helps.
  std::string report() const;
  std::uint64_t device_capacity() const noexcept;  // bytes, of the first device
  std::uint64_t device_capacity(const device& d) const;  // bytes, of one of the space's devices
  std::vector<device*> devices() const;  // the first one first
  std::uint64_t resident(const device& d) const;  // pages with a valid copy on d

  struct impl;

 private:
  std::unique_ptr<impl> impl_;
};

}  // namespace ferry::vm
