#pragma once
// What a pointer points to, and who can make it DMA-able: the PeerDirect idea in user space.
//
// A peer_memory_client owns one kind of memory (host, CUDA device, sim device, later unified memory
// and network registrations). The registration cache asks each client in turn whether it owns a
// range (acquire), asks the owner to pin it for DMA, releases it later (lazy unpinning), and
// tells the owner's callers when the memory goes away (invalidation; the dma-buf move_notify idea).
#include <ferry/core/export.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace ferry {

enum class memory_type {
  unknown,        // null, unmapped, or owned by nobody we know
  host_pageable,  // ordinary process memory
  host_pinned,    // page-locked and registered with the CUDA driver (cudaHostAlloc / cudaHostRegister)
  device,         // device memory (CUDA or sim)
  managed,        // CUDA managed memory
  unified,        // ferry unified memory (vm::address_space): pages move between host and a device;
                  // the device's copy engines reach every page; pinned in place while a registration holds it
};
FERRY_API std::string_view to_string(memory_type t) noexcept;

// The kind of device memory belongs to (none: host memory). With an ordinal it names the device:
// the device layer looks it up by these (device_registry::get), nothing parses a name.
enum class device_kind : std::uint8_t { none, cuda, sim };
FERRY_API std::string_view to_string(device_kind k) noexcept;  // "host", "cuda", "sim"

class peer_memory_client;

// The allocation (or mapping) a pointer belongs to.
struct memory_region {
  memory_type type = memory_type::unknown;
  device_kind device = device_kind::none;  // whose memory: with `ordinal`, the device (none: host)
  int ordinal = -1;              // device ordinal for device/managed memory
  std::uintptr_t base = 0;       // start of the allocation when known, else of the asked range
  std::uint64_t size = 0;
  std::uint64_t buffer_id = 0;   // CUDA buffer id: changes when memory is freed and re-allocated
  peer_memory_client* client = nullptr;
  bool contains(std::uintptr_t p, std::uint64_t n) const { return p >= base && p + n <= base + size; }
  // "cuda:0", "sim:1", "host": for messages.
  std::string device_id() const {
    return device == device_kind::none ? std::string("host") : std::string(to_string(device)) + ":" + std::to_string(ordinal);
  }
};

class FERRY_API peer_memory_client {
 public:
  virtual ~peer_memory_client();
  virtual std::string_view name() const noexcept = 0;
  // Does this client own [p, p+n)? If so, describe the region it belongs to.
  virtual std::optional<memory_region> acquire(const void* p, std::uint64_t n) = 0;
  // Pins [base, base+size) of a region this client owns so that copy engines can DMA to/from it
  // (get_pages + dma_map). Returns an opaque cookie for unpin. Throws on failure.
  virtual std::uint64_t pin(const memory_region& r, std::uintptr_t base, std::uint64_t size) = 0;
  // Undoes pin (put_pages). Must tolerate memory that is already gone.
  virtual void unpin(std::uint64_t cookie, std::uintptr_t base, std::uint64_t size) noexcept = 0;
  // Cheap check on a cache hit: is the region still the same memory (not freed and re-allocated)?
  virtual bool still_valid(const memory_region& r) = 0;
  // Pinning costs real time (milliseconds per GiB); device memory needs no pinning.
  virtual bool pin_is_free() const noexcept { return false; }
  // False: a registration pins only while a handle holds it -- released at once, never kept in the
  // cache (memory that must stay free to move, e.g. unified memory).
  virtual bool keep_cached() const noexcept { return true; }
  // True: its memory is ordinary process mappings, and an munmap over it (seen by the memory hooks)
  // means the memory is gone. False for memory remapped in place as its pages move (unified memory).
  virtual bool host_mappings() const noexcept { return true; }
  // Bytes from p (at most n, at least 1) that one copy may cover: memory in one place, which the
  // copy engines and the driver see as one kind. Unified memory: the pages from p's on that are
  // mapped where p's is (asked while they are pinned, so that the answer holds for the copy).
  virtual std::uint64_t one_place(std::uintptr_t p, std::uint64_t n) { return (void)p, n; }
};

}  // namespace ferry
