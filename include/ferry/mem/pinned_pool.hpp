#pragma once
// Pinned staging buffers, the one staging pool of a process (per NUMA node): the transfer engine's
// bounce and GPU-to-GPU paths, the file engine's I/O slots and ferry:// staging all take buffers
// from it. Memory is allocated on the NUMA node (mbind) in segments of one buffer, then two, four...,
// the first when the pool is made and more only while every buffer is in use (for try_get, only once
// the pool has been used eight times over since it last grew), up to `count`; each segment is
// registered through the registration cache, where the pool keeps it held so it is never evicted.
// A process that stages little pins little.
#include <ferry/core/export.hpp>
#include <ferry/mem/registration.hpp>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace ferry {

class FERRY_API pinned_pool {
 public:
  // At most `count` buffers of `bytes` each on NUMA node `numa_node` (-1: wherever the kernel puts
  // them); the first segment is made now (errors surface here).
  pinned_pool(registration_cache& cache, std::size_t bytes, int count, int numa_node);
  ~pinned_pool();
  pinned_pool(const pinned_pool&) = delete;
  pinned_pool& operator=(const pinned_pool&) = delete;

  class buffer {
   public:
    buffer() = default;
    buffer(buffer&& o) noexcept : pool_(std::exchange(o.pool_, nullptr)), data_(o.data_), region_(o.region_) {}
    buffer& operator=(buffer&& o) noexcept;
    ~buffer() { reset(); }
    std::byte* data() const noexcept { return data_; }
    std::size_t size() const noexcept;
    explicit operator bool() const noexcept { return pool_ != nullptr; }
    void reset() noexcept;
    // The buffer's memory as the cache registered it (its segment): callers that hand it to the
    // transfer engine say so instead of having it classified again.
    const memory_region& region() const noexcept { return *region_; }

   private:
    friend class pinned_pool;
    buffer(pinned_pool* p, std::byte* d, const memory_region* r) : pool_(p), data_(d), region_(r) {}
    pinned_pool* pool_ = nullptr;
    std::byte* data_ = nullptr;
    const memory_region* region_ = nullptr;
  };

  // Waits for a free buffer until `until` (a new segment is made first while the pool may grow);
  // throws timeout naming the pool when none frees up.
  buffer get(std::chrono::steady_clock::time_point until);
  // A free buffer now, or an empty one. `when_used`: for callers with buffers out, which come back
  // and ask again -- the pool grows only once it has handed out eight times its buffers since it
  // last grew. `now`: for callers that ask once (a pipeline's depth, set when it starts) -- the pool
  // grows while it may.
  enum class growth { when_used, now };
  buffer try_get(growth g = growth::when_used);

  std::size_t buffer_bytes() const noexcept { return bytes_; }
  int count() const noexcept { return count_; }
  int numa_node() const noexcept { return numa_; }
  int allocated() const;  // buffers made so far (<= count)

 private:
  struct segment {
    std::byte* base = nullptr;
    std::size_t bytes = 0;
    registration reg;
  };
  struct free_buffer {
    std::byte* data;
    const memory_region* region;
  };
  void put(std::byte* d, const memory_region* r) noexcept;
  // With l holding mu_: makes the next segment (releasing l meanwhile); false when the pool is at
  // its size. While another thread grows the pool it returns true at once.
  bool grow(std::unique_lock<std::mutex>& l);
  std::unique_ptr<segment> make_segment(int n) const;
  registration_cache& cache_;
  std::size_t bytes_;
  int count_;
  int numa_;
  int per_segment_;
  bool growing_ = false;  // a segment is being made (without the lock)
  int next_segment_ = 1;  // buffers of the next segment: doubling up to per_segment_
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<segment>> segments_;
  int allocated_ = 0;
  std::uint64_t handed_ = 0;  // buffers handed out since the pool last grew
  std::vector<free_buffer> free_;
};

}  // namespace ferry
