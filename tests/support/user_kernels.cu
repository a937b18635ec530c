// Kernels that play a user's own: compiled by nvcc into a fatbin the GPU tests load themselves, and
// launched on the tests' own streams -- never through ferry's device layer.
#include <cstdint>

namespace {
__device__ __forceinline__ unsigned value_at(unsigned long long i, unsigned seed) {
  unsigned long long z = (i + seed) * 0x9E3779B97F4A7C15ull;
  return static_cast<unsigned>(z ^ (z >> 29));
}
// Spins about `ns` nanoseconds of GPU time (a long kernel of the user's).
__device__ void spin(unsigned long long ns) {
  unsigned long long start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  while (now - start < ns);
}
}  // namespace

// The producer: after `spin_ns`, dst[i] = value_at(i, seed).
extern "C" __global__ void user_produce(unsigned* dst, unsigned long long words, unsigned seed, unsigned long long spin_ns) {
  if (spin_ns) spin(spin_ns);
  for (unsigned long long i = blockIdx.x * 1ull * blockDim.x + threadIdx.x; i < words; i += 1ull * gridDim.x * blockDim.x)
    dst[i] = value_at(i, seed);
}

// The consumer: counts the words of src that are not value_at(i, seed) into *bad.
extern "C" __global__ void user_consume(const unsigned* src, unsigned long long words, unsigned seed, unsigned long long* bad) {
  unsigned long long mine = 0;
  for (unsigned long long i = blockIdx.x * 1ull * blockDim.x + threadIdx.x; i < words; i += 1ull * gridDim.x * blockDim.x)
    mine += src[i] != value_at(i, seed);
  if (mine) atomicAdd(bad, mine);
}

// A random gather, as a UVM program's kernel: out[i] = src[h(i, seed) % words] + i.
extern "C" __global__ void user_gather(const unsigned* src, unsigned long long words, unsigned* out, unsigned long long n,
                                       unsigned seed) {
  for (unsigned long long i = blockIdx.x * 1ull * blockDim.x + threadIdx.x; i < n; i += 1ull * gridDim.x * blockDim.x)
    out[i] = src[value_at(i, seed) % words] + static_cast<unsigned>(i);
}

// A long kernel that keeps touching its data: reads src over and over for about `ns` of GPU time,
// counting the words that are not value_at(i, seed) into *bad.
extern "C" __global__ void user_reread(const unsigned* src, unsigned long long words, unsigned seed, unsigned long long ns,
                                       unsigned long long* bad) {
  const volatile unsigned* v = src;  // every pass reads memory again
  unsigned long long start = 0, now = 0, mine = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    for (unsigned long long i = blockIdx.x * 1ull * blockDim.x + threadIdx.x; i < words; i += 1ull * gridDim.x * blockDim.x)
      mine += v[i] != value_at(i, seed);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
  if (mine) atomicAdd(bad, mine);
}
