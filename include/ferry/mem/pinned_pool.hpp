#pragma once
// Pinned bounce buffers, reused by every staged path (pageable host memory, GPU<->GPU without peer
// access, files, network). Buffers are allocated once per pool on a NUMA node (hwloc membind) and
// registered through the registration cache, where the pool keeps them held so they are never evicted.
#include <ferry/core/export.hpp>
#include <ferry/mem/registration.hpp>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <vector>

namespace ferry {

class FERRY_API pinned_pool {
 public:
  // `count` buffers of `bytes` each on NUMA node `numa_node` (-1: wherever the kernel puts them).
  pinned_pool(registration_cache& cache, std::size_t bytes, int count, int numa_node);
  ~pinned_pool();
  pinned_pool(const pinned_pool&) = delete;
  pinned_pool& operator=(const pinned_pool&) = delete;

  class buffer {
   public:
    buffer() = default;
    buffer(buffer&& o) noexcept : pool_(std::exchange(o.pool_, nullptr)), data_(o.data_) {}
    buffer& operator=(buffer&& o) noexcept;
    ~buffer() { reset(); }
    std::byte* data() const noexcept { return data_; }
    std::size_t size() const noexcept;
    explicit operator bool() const noexcept { return pool_ != nullptr; }
    void reset() noexcept;

   private:
    friend class pinned_pool;
    buffer(pinned_pool* p, std::byte* d) : pool_(p), data_(d) {}
    pinned_pool* pool_ = nullptr;
    std::byte* data_ = nullptr;
  };

  // Waits for a free buffer until `until`; throws timeout naming the pool when none frees up.
  buffer get(std::chrono::steady_clock::time_point until);
  // A free buffer now, or an empty one.
  buffer try_get();

  std::size_t buffer_bytes() const noexcept { return bytes_; }
  int count() const noexcept { return count_; }
  int numa_node() const noexcept { return numa_; }
  // The pool's memory as the cache registered it (one region holding every buffer): callers that
  // hand a buffer to the transfer engine say so instead of having it classified again.
  const memory_region& region() const noexcept { return reg_.region(); }

 private:
  void put(std::byte* d) noexcept;
  std::size_t bytes_;
  int count_;
  int numa_;
  std::byte* base_ = nullptr;
  std::size_t mapped_ = 0;
  registration reg_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::byte*> free_;
};

}  // namespace ferry
