// The kernels of `ferry-bench pipeline` and `ferry-bench vm`, playing a user's: compiled by nvcc into a fatbin that the
// benchmark loads itself and launches on its own streams (never through ferry's device layer).
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
