#pragma once
// The registration cache: lazy unpinning of DMA registrations (the GPUDirect RDMA notes' advice:
// pinning costs milliseconds, so keep registrations until memory pressure or invalidation).
//
//  - acquire(p, n) returns a handle covering [p, p+n): cached registrations are reused (a hit is a
//    lookup), gaps are registered through the owning peer_memory_client; overlapping and adjacent
//    ranges are covered by several registrations, never registered twice.
//  - Registrations not held by any handle stay pinned until the pinned-bytes limit forces LRU
//    eviction (FERRY_PIN_LIMIT).
//  - Memory that goes away is never used through a stale entry: host munmap/brk are seen through
//    UCX's memory hooks (libucm), CUDA frees through buffer ids checked on every hit; affected
//    entries are dropped and the holders' invalidation callbacks run.
// Thread-safe.
#include <ferry/core/export.hpp>
#include <ferry/core/stats.hpp>
#include <ferry/mem/memory.hpp>

#include <functional>
#include <memory>
#include <span>
#include <vector>

namespace ferry {

class registration_cache;

struct registration_stats {
  std::uint64_t hits = 0, misses = 0, evictions = 0, invalidations = 0, stale_detected = 0;
  std::uint64_t classifications = 0;  // classify() calls: what a pointer is, asked
  std::uint64_t bytes_pinned = 0, entries = 0;
};

// A set of registrations covering one acquired range; releases them when destroyed.
class FERRY_API registration {
 public:
  registration() = default;
  registration(registration&&) noexcept;
  registration& operator=(registration&&) noexcept;
  ~registration();

  explicit operator bool() const noexcept { return cache_ != nullptr; }
  const memory_region& region() const noexcept { return region_; }
  // False once any covering registration was invalidated (the memory went away or moved).
  bool valid() const noexcept;
  // Called (once, from the invalidating thread) when a covering registration is invalidated.
  void on_invalidate(std::function<void()> cb);
  // The separately pinned pieces covering the acquired range, clipped to it, in address order.
  // A copy engine may not cross from one piece into the next (CUDA rejects a host range that spans
  // two registrations), so DMA is issued per piece.
  std::vector<std::pair<std::uintptr_t, std::uint64_t>> pieces() const;
  // The same pieces with what the client's pin() returned for each (e.g. a network key), and the
  // whole registered range they belong to.
  struct piece {
    std::uintptr_t addr = 0;
    std::uint64_t bytes = 0;
    std::uint64_t cookie = 0;
    std::uintptr_t reg_base = 0;
    std::uint64_t reg_size = 0;
  };
  std::vector<piece> registered_pieces() const;

 private:
  friend class registration_cache;
  struct entry;
  registration_cache* cache_ = nullptr;
  memory_region region_;
  std::vector<std::shared_ptr<entry>> entries_;
};

class FERRY_API registration_cache {
 public:
  // Clients are asked in order; the last one should accept any host pointer.
  registration_cache(std::vector<peer_memory_client*> clients, std::uint64_t pin_limit_bytes);
  ~registration_cache();
  registration_cache(const registration_cache&) = delete;
  registration_cache& operator=(const registration_cache&) = delete;

  void add_client(peer_memory_client* c, bool first = true);
  // Removes a client (after invalidating what it registered: its memory is going away).
  void remove_client(peer_memory_client* c);

  // What [p, p+n) is. Throws invalid_argument for null/overflowing ranges; unknown memory is
  // reported as memory_type::unknown, not thrown.
  memory_region classify(const void* p, std::uint64_t n);

  // Registers (or finds) [p, p+n) for DMA. Throws bad_address for unknown memory, or the client's
  // pinning error.
  registration acquire(const void* p, std::uint64_t n);
  // True if [p, p+n) is fully covered by valid cached registrations (no side effects but a check).
  bool cached(const void* p, std::uint64_t n);

  // Drops every registration overlapping [base, base+size) (memory unmapped or freed).
  void invalidate(std::uintptr_t base, std::uint64_t size);
  // The same from memory hooks: never blocks, never allocates -- recorded, and done soon by the
  // cache's own thread, in any case before its next classify, cached or acquire (a hook runs inside
  // the allocator, under its lock).
  void invalidate_soon(std::uintptr_t base, std::uint64_t size) noexcept;
  // Drops all unused registrations.
  void trim();

  registration_stats stats() const;
  std::uint64_t pin_limit() const noexcept { return pin_limit_; }

 private:
  friend class registration;
  friend void remove_process_client(peer_memory_client* c) noexcept;
  struct impl;
  void release(registration& r) noexcept;
  // Removes a client and drops what it registered, after any classify still asking it; returns the
  // holders' invalidation callbacks for the caller to run.
  std::vector<std::function<void()>> withdraw(peer_memory_client* c);
  void apply_pending();
  std::uint64_t pin_limit_;
  std::unique_ptr<impl> impl_;
};

// Memory the whole process knows (a unified memory space): every registration cache, those alive
// now and those made later, asks `c` before its own clients, until it is withdrawn. Withdrawing
// waits for classifications asking `c`, invalidates what each cache registered through it (holders
// are told on this thread, after the caches' locks are let go); nothing calls `c` afterwards.
// Process-wide on purpose: memory a space maps is the whole process's, and every runtime's
// transfers must hold its pages (a space known to one cache was copied by another as plain device
// memory).
FERRY_API void add_process_client(peer_memory_client* c);
FERRY_API void remove_process_client(peer_memory_client* c) noexcept;

// True in a process forked from the one that installed the process's memory hooks (libucm's). Such a
// child may have inherited libucm's event lock held by a thread of its parent that was inside an
// munmap at the fork (the thread is not in the child, so it is never let go). Readers still pass
// then, but nothing in the child may add or remove a hook handler (it would wait forever): the
// child's UCX is configured not to (net/ucx.cpp).
FERRY_API bool memory_hooks_inherited() noexcept;

// Peer-memory client for host memory: pins with cuMemHostRegister when a CUDA driver is present,
// else mlock (so the cache's behaviour is the same on CPU-only machines).
FERRY_API std::unique_ptr<peer_memory_client> make_host_client(const std::string& cuda_driver);
// Peer-memory client for CUDA device, managed and already-pinned host memory (cuPointerGetAttributes);
// null when no CUDA driver is usable.
FERRY_API std::unique_ptr<peer_memory_client> make_cuda_client(const std::string& cuda_driver);

// Pins read-only host mappings for one GPU's copy engine to read where they are, such as a file's
// pages in the page cache mapped PROT_READ: CU_MEMHOSTREGISTER_READ_ONLY (a writable registration of
// a PROT_READ mapping is refused), in that GPU's primary context only (a portable registration is made
// for every GPU of the machine, and costs as many times more to make and undo). Outside the
// registration cache: such a pin is held for one copy and let go (a page-cache page kept pinned would
// outlive a truncation of its file), and making one holds no lock that other transfers wait for.
// Thread-safe.
class FERRY_API read_only_pins {
 public:
  // Null when no CUDA driver is usable (no copy engine would read the pages).
  static std::unique_ptr<read_only_pins> make(const std::string& cuda_driver);
  virtual ~read_only_pins();
  // [p, p+n), page-aligned, pinned for cuda:`ordinal`: the region a copy reads it through (host
  // pinned memory). Throws naming the range and the driver's error.
  virtual memory_region pin(const void* p, std::uint64_t n, int ordinal) = 0;
  // Undoes pin(p, ..., ordinal).
  virtual void unpin(const void* p, int ordinal) noexcept = 0;
};

}  // namespace ferry
