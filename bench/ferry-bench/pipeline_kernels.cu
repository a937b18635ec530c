// The kernels of `ferry-bench pipeline`, `vm` and `gather`, playing a user's: compiled by nvcc into a fatbin that the
// benchmark loads itself and launches on its own streams (never through ferry's device layer).
#include <ferry/gpu/array.hpp>

#include <cstdint>

namespace {
__device__ __forceinline__ unsigned word_at(unsigned long long i, unsigned seed) {
  unsigned long long z = (i + seed) * 0x9E3779B97F4A7C15ull;
  return static_cast<unsigned>(z ^ (z >> 29));
}
}  // namespace

// Checks that src holds words first .. first + words of the benchmark's file (word_at(j, seed)),
// counting those that do not into *bad, then computes for `busy_ns` more (a kernel of known length:
// the benchmark sets it so that the kernels of all chunks take as long as reading them).
extern "C" __global__ void bench_consume(const unsigned* src, unsigned long long words, unsigned long long first,
                                         unsigned seed, unsigned long long busy_ns, unsigned long long* bad) {
  unsigned long long mine = 0;
  for (unsigned long long i = blockIdx.x * 1ull * blockDim.x + threadIdx.x; i < words; i += 1ull * gridDim.x * blockDim.x)
    mine += src[i] != word_at(first + i, seed);
  if (mine) atomicAdd(bad, mine);
  if (!busy_ns) return;
  unsigned long long start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  while (now - start < busy_ns);
}

// `ferry-bench vm`'s user kernel: a random gather, as a program written for managed memory runs
// it: out[i] = src[h(i, seed) % words] + i.
extern "C" __global__ void bench_gather(const unsigned* src, unsigned long long words, unsigned* out, unsigned long long n,
                                        unsigned seed) {
  for (unsigned long long i = blockIdx.x * 1ull * blockDim.x + threadIdx.x; i < n; i += 1ull * gridDim.x * blockDim.x)
    out[i] = src[word_at(i, seed) % words] + static_cast<unsigned>(i);
}

// `ferry-bench gather`: out[i] = the sum of the words of element idx[i] (W 4-byte words), the
// element read (1) through ferry's page cache, (2) zero-copy from pinned host memory holding the
// whole dataset, (3) from pages the CPU staged in device memory (slot_of[i]: where element idx[i]'s
// page is). Grid-stride loops: the grid is sized to fill the GPU.
namespace {
template <unsigned W>
struct words {
  unsigned w[W];
};
template <unsigned W>
__device__ __forceinline__ unsigned sum(const words<W>& e) {
  unsigned s = 0;
#pragma unroll
  for (unsigned k = 0; k < W; ++k) s += e.w[k];
  return s;
}
}  // namespace

#define FERRY_BENCH_GATHER(W)                                                                                          \
  extern "C" __global__ void bench_cache_gather_##W(ferry::gpu::array<words<W>> a, const unsigned long long* idx,      \
                                                    unsigned long long n, unsigned* out, unsigned* failed) {            \
    for (unsigned long long i = blockIdx.x * 1ull * blockDim.x + threadIdx.x; i < n; i += 1ull * gridDim.x * blockDim.x) { \
      words<W> e{};                                                                                                     \
      if (a.get(idx[i], e) != ferry::gpu::status::ok) atomicAdd(failed, 1u);                                            \
      out[i] = sum(e);                                                                                                  \
    }                                                                                                                   \
  }                                                                                                                     \
  extern "C" __global__ void bench_host_gather_##W(const words<W>* data, const unsigned long long* idx,                 \
                                                   unsigned long long n, unsigned* out) {                                \
    for (unsigned long long i = blockIdx.x * 1ull * blockDim.x + threadIdx.x; i < n; i += 1ull * gridDim.x * blockDim.x) \
      out[i] = sum(data[idx[i]]);                                                                                       \
  }                                                                                                                     \
  extern "C" __global__ void bench_staged_gather_##W(const unsigned char* slots, const unsigned* slot_of,               \
                                                     const unsigned long long* idx, unsigned long long n,                \
                                                     unsigned page_shift, unsigned* out) {                               \
    for (unsigned long long i = blockIdx.x * 1ull * blockDim.x + threadIdx.x; i < n; i += 1ull * gridDim.x * blockDim.x) { \
      unsigned long long at = idx[i] * sizeof(words<W>);                                                                \
      const words<W>* e = reinterpret_cast<const words<W>*>(slots + (static_cast<unsigned long long>(slot_of[i]) << page_shift) + \
                                                           (at & ((1ull << page_shift) - 1)));                          \
      out[i] = sum(*e);                                                                                                 \
    }                                                                                                                   \
  }
FERRY_BENCH_GATHER(2)
FERRY_BENCH_GATHER(16)
