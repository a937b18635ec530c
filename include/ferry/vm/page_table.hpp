#pragma once
// The logical page table of a unified address space -- GMEM's idea (seeds/003), in user space: for
// every page of the device granularity (2 MiB with CUDA VMM) it records which locations hold a valid
// copy, hints, pins and replacement order, and it runs the coherence protocol through a small set of
// backend hooks (`page_mover`, GMEM's `gm_mmu`): copy a page between locations, drop a copy, point the
// shared mapping at a location. The policy lives here once; the CUDA backend and the CPU-only sim
// backend implement only the hooks, so the whole policy is tested on machines without a GPU.
//
// Coherence (single writer, multiple readers per page):
//  - every valid copy of a page holds the same bytes;
//  - a write from location L leaves L the only valid copy (others are dropped: "invalidated");
//  - a read from L migrates the page to L, or -- READ_MOSTLY -- adds L as another valid copy;
//  - a device copy is "dirty" exactly when the host holds no valid copy: evicting it copies it back,
//    evicting a clean one only drops it;
//  - a device never holds more than its capacity in pages: making room evicts by the replacement
//    policy (LRU by access, or FIFO by arrival), skipping pinned pages and pages being changed, and
//    pages whose PREFERRED_LOCATION is that device only when no other page can go;
//  - thrashing: a page evicted from a device and prefetched back to it within `thrash_policy::lapse`
//    shows that the device does not hold the working set (a stream over more than its capacity).
//    Such a page is held where it is for `thrash_policy::hold`: PREFETCH leaves it (its host copy
//    stays mapped and the device reads it in place over PCIe) instead of evicting another page
//    that will be wanted back just as soon. UVM does the same ("thrashing mitigation").
//  - return: a page a CPU fault took from a device (the CPU wrote or read it there) is "taken";
//    return_taken() moves taken pages back -- to their PREFERRED_LOCATION if that is a device, else
//    to the device they came from -- into free room only (never evicting). The address space calls
//    it before kernel launches and in the background after a quiet time. A page the CPU takes again
//    within `return_hold` of its return is one the CPU keeps using: it stays on the host for the
//    hold, doubled at each further time (at most 64 times). A PREFERRED_LOCATION of host, a pin or
//    an explicit PREFETCH ends the page's taken state.
// Concurrency: one mutex per page serializes its changes; different pages change in parallel. A page
// that must be made room for takes victims with try_lock only, so two faults never wait on each
// other's page. Pinned pages (a DMA registration uses them) are never moved; a change that would
// move one waits for the unpin until its deadline.
#include <ferry/core/export.hpp>
#include <ferry/device/device.hpp>
#include <ferry/vm/settings.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace ferry::vm {

// 0 is host memory; 1..max_locations-1 are the address space's device slots.
using location = int;
inline constexpr location host = 0;
inline constexpr int max_locations = 64;

using replacement = page_replacement;  // from the settings table

// What a backend does for the policy. Every call is made with the page's lock held; calls for
// different pages may run in parallel.
class FERRY_API page_mover {
 public:
  virtual ~page_mover();
  // Gives `to` a copy of page `page`'s bytes taken from `from` (a valid copy), allocating memory at
  // `to` if it has none. Throws (e.g. out_of_memory) without changing anything on failure.
  virtual void copy(std::uint64_t page, location from, location to) = 0;
  // A first touch: gives `at` zero-filled memory for the page.
  virtual void populate(std::uint64_t page, location at) = 0;
  // Frees `at`'s memory of the page (its copy is no longer valid). Must not fail.
  virtual void drop(std::uint64_t page, location at) noexcept = 0;
  // Points the shared mapping of the page at `at` (the copy CPU and GPU accesses go to). `writable`
  // is false while other locations hold copies too (READ_MOSTLY): a CPU write must then fault, so the
  // other copies are invalidated first.
  virtual void map(std::uint64_t page, location at, bool writable) = 0;
  // Removes the shared mapping of the page (it has no valid copy any more: freed memory).
  virtual void unmap(std::uint64_t page) = 0;

  // Batched migrations. A step copies the page's bytes `from` -> `to` (when `copy`; `to` holds no
  // valid copy yet) and then points its shared mapping at `to` (when `map`). start() begins every step
  // of a batch -- copies may still run when it returns -- and finish(ticket) completes them. The
  // page table keeps every page of the batch locked from start to finish and may start the next
  // batch before finishing this one, so a backend can queue the next copies while it remaps. On
  // failure either call throws and leaves every page as it was: old copies and mappings (with
  // `was_writable`), no memory at `to`. The defaults run copy() and map() inside start().
  struct step {
    std::uint64_t page = 0;
    location from = 0, to = 0;
    bool copy = true, map = true, writable = true;
    location was_at = -1;  // where the mapping pointed before (-1: nowhere)
    bool was_writable = true;
    // Host targets: the CPU is about to use the page (a CPU fault moves it), so the backend may let
    // the CPU reach it right away instead of on its first touch.
    bool cpu = false;
  };
  virtual std::uint64_t start(const std::vector<step>& steps);
  virtual void finish(std::uint64_t ticket);
};

// Thrashing mitigation (see above); lapse 0: off -- every PREFETCH migrates.
struct thrash_policy {
  std::chrono::nanoseconds lapse{0};  // evicted and prefetched back within this: the page thrashes
  std::chrono::nanoseconds hold{0};   // how long a thrashing page then stays where it is
};

struct page_snapshot {
  std::uint64_t valid = 0;  // bit L set: location L holds a valid copy; 0: never touched
  location mapped = -1;     // where the shared mapping points (-1: nowhere yet)
  bool read_mostly = false;
  location preferred = -1;  // PREFERRED_LOCATION hint (-1: none)
  std::uint32_t pins = 0;
};

struct vm_stats {
  std::uint64_t faults = 0;            // accesses that had to change the page (populate, migrate, duplicate)
  std::uint64_t populated = 0;         // first touches
  std::uint64_t migrations_h2d = 0, migrations_d2h = 0, migrations_d2d = 0;
  std::uint64_t bytes_h2d = 0, bytes_d2h = 0, bytes_d2d = 0;
  std::uint64_t duplicates = 0;        // READ_MOSTLY copies made
  std::uint64_t invalidations = 0;     // copies dropped because another location wrote
  std::uint64_t evictions = 0;         // device pages made room for
  std::uint64_t writebacks = 0;        // evictions that copied a dirty page to host
  std::uint64_t clean_drops = 0;       // evictions that only dropped a clean copy
  std::uint64_t prefetches = 0;
  std::uint64_t dontneeds = 0;
  std::uint64_t fault_ahead = 0;       // pages moved along with a faulting page
  std::uint64_t batches = 0;           // batched migrations (start/finish pairs), evictions included
  std::uint64_t thrash_holds = 0;      // pages found thrashing and held where they were
  std::uint64_t held_prefetches = 0;   // page prefetches that left a held page where it was
  std::uint64_t returns = 0;           // taken pages moved back to their device
  std::uint64_t return_holds = 0;      // pages the CPU took back soon after a return (held on the host)
};

class FERRY_API page_table {
 public:
  // `pages` logical pages of `page_bytes` each; `capacity[d]` pages may live on device slot d
  // (index 0, the host, is unbounded and ignored).
  page_table(std::uint64_t pages, std::uint64_t page_bytes, std::vector<std::uint64_t> capacity, replacement policy,
             page_mover& mover, thrash_policy thrash = {}, std::chrono::nanoseconds return_hold = {});
  ~page_table();
  page_table(const page_table&) = delete;
  page_table& operator=(const page_table&) = delete;

  std::uint64_t pages() const noexcept;
  std::uint64_t page_bytes() const noexcept;

  // Makes `at` hold a valid copy for an access (a fault), maps the page there, and runs `use` (if
  // given) with the page locked -- nothing moves the page while it runs. A write leaves `at` the only
  // valid copy. Throws timeout when the page stays pinned elsewhere past `until`, out_of_memory when
  // no room can be made on a device before `until`.
  template <typename F>
  void access(std::uint64_t page, location at, bool write, deadline until, F&& use);
  void access(std::uint64_t page, location at, bool write, deadline until);

  // PREFETCH: migrate the page to `at` (or add a copy there when READ_MOSTLY); a never-touched page
  // is populated there. A thrashing page is left where it is (thrash_policy), unless `at` is its
  // PREFERRED_LOCATION.
  void prefetch(std::uint64_t page, location at, deadline until);
  // PREFETCH of pages [first, end) in batches of up to `batch` pages (each batch's copies queued
  // together and its remaps grouped; the next batch is prepared while one copies; room on a device
  // is made by evicting in batches too). Pages that need something else (first touch, pinned, only
  // a remap) take the single-page path afterwards. Each batch must finish within `per_batch`.
  void prefetch_range(std::uint64_t first, std::uint64_t end, location at, std::uint64_t batch,
                      std::chrono::nanoseconds per_batch);
  // A fault at `page` for `at` that also moves the pages after it, up to `end`, which hold a valid
  // copy elsewhere only (fault-ahead: a sequential reader then faults once per batch). The faulting
  // page gets access() semantics (a write leaves `at` alone); the others prefetch semantics.
  // `use` runs like access()'s, with the faulting page locked and valid at `at`.
  void fault_range(std::uint64_t page, std::uint64_t end, location at, bool write, std::uint64_t batch,
                   std::chrono::nanoseconds per_batch, const std::function<void()>& use = {});
  // Fault-ahead after the faulting thread was let go: pages [first, end) that hold a valid copy
  // elsewhere only move to `at`, as fault_range's others do. Returns the pages moved.
  std::uint64_t move_ahead(std::uint64_t first, std::uint64_t end, location at, std::uint64_t batch);
  // A page handed out by alloc: zero-filled and mapped before anyone can touch it (a GPU cannot
  // fault), on device `prefer` when it has room there without evicting, else in host memory. Copies
  // and hints left from an earlier allocation of the page are dropped. Returns where it went.
  location populate_fresh(std::uint64_t page, location prefer, deadline until);
  // free(): the page's bytes are dead. Every copy is dropped without a write-back and the mapping
  // removed; the next populate_fresh makes it anew. Waits for a pin (a transfer) until `until`.
  void discard(std::uint64_t page, deadline until);
  // DONTNEED on device `at`: its copy is dropped, after copying it to host memory if it was the only one.
  void dontneed(std::uint64_t page, location at, deadline until);
  void set_read_mostly(std::uint64_t page, bool on);
  void set_preferred(std::uint64_t page, location at);
  // Pages the CPU took from a device that are still on the host (see "return" above).
  std::uint64_t cpu_taken() const noexcept;
  // Runs f with page `page` locked (no change of the page runs meanwhile).
  void locked(std::uint64_t page, const std::function<void()>& f);
  // Moves up to `max_pages` taken pages that the CPU took at least `quiet` ago, and that are not
  // held, back to their device, in batches, into free room only. Returns the pages moved. `ready`,
  // when given, is asked once there are pages to move (a caller waits there for work that may use
  // them); false: nothing moves. Pages [keep.first, keep.second) stay (the CPU is on its way to them).
  std::uint64_t return_taken(std::chrono::nanoseconds quiet, std::uint64_t max_pages, std::uint64_t batch,
                             const std::function<bool()>& ready = {},
                             std::pair<std::uint64_t, std::uint64_t> keep = {0, 0});
  // Evicts one page of device `at` by the replacement policy; false when none can be evicted now.
  bool evict_one(location at);

  // Pins the page where it is (a DMA registration uses it); unpin lets it move again.
  void pin(std::uint64_t page);
  // For DMA into the page: makes it resident and mapped (a never-touched page is populated on the
  // host), its mapped copy the only one (the DMA may write), then pins it.
  void pin_in_place(std::uint64_t page, deadline until);
  void unpin(std::uint64_t page);

  page_snapshot snapshot(std::uint64_t page) const;
  std::uint64_t resident(location at) const;  // pages with a valid copy on device `at`
  vm_stats stats() const;

  struct impl;

 private:
  void lock_page(std::uint64_t page, location at, bool write, deadline until);
  void unlock_page(std::uint64_t page) noexcept;
  std::unique_ptr<impl> impl_;
};

template <typename F>
void page_table::access(std::uint64_t page, location at, bool write, deadline until, F&& use) {
  lock_page(page, at, write, until);  // returns with the page locked and valid at `at`
  struct unlock {
    page_table* t;
    std::uint64_t p;
    ~unlock() { t->unlock_page(p); }
  } u{this, page};
  use();
}

}  // namespace ferry::vm
