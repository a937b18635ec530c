#pragma once
// What a kernel holds: an array of T over a byte range of a source (a file the cache mapped), read
// and written element by element through the GPU page cache (page_cache.hpp). Passed to kernels by
// value (gpu::cache::map makes them). On a GPU, the threads of a warp that touch the same page in
// one call take it with one acquire -- one miss, one request -- and give it back together.
//
//   __global__ void k(ferry::gpu::array<float> a, float* out) {
//     out[i] = a[idx[i]];                        // a failure reads T{} and is kept for cache::check()
//     if (a.get(j, v) != ferry::gpu::status::ok) // or the status, per access
//   }
//
// Elements of any size: one that straddles two pages (the page size is not a multiple of sizeof(T))
// is copied from both. Every wait is bounded by the cache's wait (cache_options::wait).
#include <ferry/gpu/page_cache.hpp>

#include <cstring>

namespace ferry::gpu {

template <typename T>
class array {
 public:
  array() = default;
  FERRY_GPU_HD array(const cache_view& c, const array_desc& a) : c_(c), a_(a), n_(a.bytes / sizeof(T)) {}

  FERRY_GPU_HD std::uint64_t size() const { return n_; }

  FERRY_GPU_HD status get(std::uint64_t i, T& out) const { return element(i, &out, false); }
  FERRY_GPU_HD status set(std::uint64_t i, const T& v) const { return element(i, const_cast<T*>(&v), true); }
  // n elements from i, to or from memory of the caller's (the thread's own: no coalescing).
  FERRY_GPU_HD status read(std::uint64_t i, std::uint64_t n, T* dst) const { return span(i, n, dst, false); }
  FERRY_GPU_HD status write(std::uint64_t i, std::uint64_t n, const T* src) const {
    return span(i, n, const_cast<T*>(src), true);
  }

  // a[i] reads, a[i] = v writes; a failure reads T{} (or drops the write) and stays in the cache's
  // error word, which the host sees (cache::check).
  class reference {
   public:
    FERRY_GPU_HD operator T() const {
      T v{};
      a_.get(i_, v);
      return v;
    }
    FERRY_GPU_HD const reference& operator=(const T& v) const {
      a_.set(i_, v);
      return *this;
    }

   private:
    friend class array;
    FERRY_GPU_HD reference(const array& a, std::uint64_t i) : a_(a), i_(i) {}
    const array& a_;
    std::uint64_t i_;
  };
  FERRY_GPU_HD reference operator[](std::uint64_t i) const { return reference(*this, i); }

  FERRY_GPU_HD const cache_view& cache() const { return c_; }
  FERRY_GPU_HD const array_desc& desc() const { return a_; }

 private:
  FERRY_GPU_HD status element(std::uint64_t i, T* v, bool write) const {
    if (i >= n_) return detail::note_failure(c_, status::out_of_range);
    const std::uint64_t at = i * sizeof(T);
    const std::uint64_t in = at & ((1ull << c_.page_shift) - 1);
    if (in + sizeof(T) > (1ull << c_.page_shift)) return span(i, 1, v, write);
    const std::uint64_t page = at >> c_.page_shift;
    std::uint64_t frame = 0;
#if defined(__CUDA_ARCH__)
    // The warp's threads on this page take it once: the lowest of them acquires for all.
    const unsigned mask = __activemask();
    const unsigned peers = __match_any_sync(mask, reinterpret_cast<unsigned long long>(a_.entries + page));
    const int leader = __ffs(peers) - 1;
    unsigned lane;
    asm("mov.u32 %0, %%laneid;" : "=r"(lane));
    const bool lead = lane == static_cast<unsigned>(leader);
    status s = status::ok;
    // Peers may mix reads and writes (the same call, grouped by the scheduler): any write makes it one.
    const bool any_write = __any_sync(peers, write);
    if (lead) s = acquire(c_, a_, page, __popc(peers), any_write, frame);
    s = static_cast<status>(__shfl_sync(peers, static_cast<unsigned>(s), leader));
    frame = __shfl_sync(peers, frame, leader);
    __syncwarp(peers);  // orders the leader's acquire before its peers' accesses
    if (s == status::ok) {
      T* p = reinterpret_cast<T*>(c_.frames + (frame << c_.page_shift) + in);
      if (write) *p = *v;
      else *v = *p;
    }
    __syncwarp(peers);  // and their accesses before the leader's release
    if (s == status::ok && lead) release(a_, page, __popc(peers));
    return s;
#else
    status s = acquire(c_, a_, page, 1, write, frame);
    if (s != status::ok) return s;
    unsigned char* p = c_.frames + (frame << c_.page_shift) + in;
    if (write) std::memcpy(p, v, sizeof(T));
    else std::memcpy(v, p, sizeof(T));
    release(a_, page, 1);
    return s;
#endif
  }

  FERRY_GPU_HD status span(std::uint64_t i, std::uint64_t n, T* mem, bool write) const {
    if (i > n_ || n > n_ - i) return detail::note_failure(c_, status::out_of_range);
    const std::uint64_t ps = 1ull << c_.page_shift;
    std::uint64_t at = i * sizeof(T), left = n * sizeof(T);
    unsigned char* m = reinterpret_cast<unsigned char*>(mem);
    while (left) {
      const std::uint64_t page = at >> c_.page_shift, in = at & (ps - 1);
      const std::uint64_t k = ps - in < left ? ps - in : left;
      std::uint64_t frame = 0;
      status s = acquire(c_, a_, page, 1, write, frame);
      if (s != status::ok) return s;
      unsigned char* p = c_.frames + (frame << c_.page_shift) + in;
      if (write) std::memcpy(p, m, k);
      else std::memcpy(m, p, k);
      release(a_, page, 1);
      at += k;
      m += k;
      left -= k;
    }
    return status::ok;
  }

  cache_view c_;
  array_desc a_;
  std::uint64_t n_ = 0;
};

}  // namespace ferry::gpu
