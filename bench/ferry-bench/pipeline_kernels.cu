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

// `ferry-bench bfs`: one level of a top-down breadth-first search over a graph in CSR form (offsets:
// V + 1 8-byte words, cols: 4-byte vertex numbers), one warp per vertex of the frontier; a vertex
// first reached sets dist and joins the next frontier. The graph read (1) through ferry's page cache,
// (2) zero-copy from pinned host memory holding it all, (3) host-orchestrated: the CPU already
// read each frontier vertex's [begin, end) and staged the pages of cols those lists span
// (slot_of[page]: where a page is).
namespace {
__device__ __forceinline__ void visit(unsigned u, unsigned level, unsigned* dist, unsigned* next, unsigned* nnext) {
  if (atomicCAS(&dist[u], ~0u, level + 1) == ~0u) next[atomicAdd(nnext, 1u)] = u;
}
__device__ __forceinline__ unsigned lane_id() { return threadIdx.x & 31; }
__device__ __forceinline__ unsigned long long warp_id() { return (blockIdx.x * 1ull * blockDim.x + threadIdx.x) >> 5; }
__device__ __forceinline__ unsigned long long warps() { return (1ull * gridDim.x * blockDim.x) >> 5; }
}  // namespace

extern "C" __global__ void bench_bfs_cache(ferry::gpu::array<unsigned long long> offs, ferry::gpu::array<unsigned> cols,
                                           const unsigned* frontier, unsigned nf, unsigned level, unsigned* dist, unsigned* next,
                                           unsigned* nnext, unsigned* failed) {
  for (unsigned long long w = warp_id(); w < nf; w += warps()) {
    const unsigned v = frontier[w];
    unsigned long long be[2] = {0, 0};
    if (lane_id() == 0 && offs.read(v, 2, be) != ferry::gpu::status::ok) atomicAdd(failed, 1u);
    const unsigned long long b = __shfl_sync(~0u, be[0], 0), e = __shfl_sync(~0u, be[1], 0);
    for (unsigned long long k = b + lane_id(); k < e; k += 32) {
      unsigned u = 0;
      if (cols.get(k, u) != ferry::gpu::status::ok) {
        atomicAdd(failed, 1u);
        continue;
      }
      visit(u, level, dist, next, nnext);
    }
  }
}

extern "C" __global__ void bench_bfs_host(const unsigned long long* offs, const unsigned* cols, const unsigned* frontier, unsigned nf,
                                          unsigned level, unsigned* dist, unsigned* next, unsigned* nnext) {
  for (unsigned long long w = warp_id(); w < nf; w += warps()) {
    const unsigned v = frontier[w];
    const unsigned long long b = offs[v], e = offs[v + 1];
    for (unsigned long long k = b + lane_id(); k < e; k += 32) visit(cols[k], level, dist, next, nnext);
  }
}

extern "C" __global__ void bench_bfs_staged(const unsigned char* slots, const unsigned* slot_of, unsigned page_shift,
                                            unsigned long long cols_at, const unsigned long long* begin,
                                            const unsigned long long* end, unsigned nf, unsigned level, unsigned* dist, unsigned* next,
                                            unsigned* nnext) {
  const unsigned long long in_page = (1ull << page_shift) - 1;
  for (unsigned long long w = warp_id(); w < nf; w += warps()) {
    const unsigned long long b = begin[w], e = end[w];
    for (unsigned long long k = b + lane_id(); k < e; k += 32) {
      const unsigned long long at = cols_at + k * 4;
      const unsigned u = *reinterpret_cast<const unsigned*>(slots + (static_cast<unsigned long long>(slot_of[at >> page_shift]) << page_shift) +
                                                            (at & in_page));
      visit(u, level, dist, next, nnext);
    }
  }
}
