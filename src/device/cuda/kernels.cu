// Device-side helpers of the cuda backend, compiled by nvcc into a fatbin embedded in libferry and
// loaded with cuModuleLoadData (no CUDA runtime). They implement stream::fill_pattern and
// stream::checksum with exactly the definitions of src/core/checksum.cpp.
#include <cstdint>

namespace {
constexpr unsigned long long golden = 0x9E3779B97F4A7C15ull;

__device__ __forceinline__ unsigned long long splitmix64(unsigned long long x) {
  unsigned long long z = x + golden;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
}  // namespace

extern "C" __global__ void ferry_fill_pattern(unsigned long long* dst, unsigned long long bytes,
                                              unsigned long long seed) {
  const unsigned long long words = bytes / 8;
  const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  for (unsigned long long i = blockIdx.x * static_cast<unsigned long long>(blockDim.x) + threadIdx.x; i < words;
       i += stride)
    dst[i] = splitmix64(seed + i);
  if (blockIdx.x == 0 && threadIdx.x == 0 && bytes % 8) {
    unsigned long long w = splitmix64(seed + words);
    auto* tail = reinterpret_cast<unsigned char*>(dst + words);
    for (unsigned k = 0; k < bytes % 8; ++k) tail[k] = static_cast<unsigned char>(w >> (8 * k));
  }
}

// *out must be zero before the launch; blocks add their partial sums atomically.
extern "C" __global__ void ferry_checksum(const unsigned long long* src, unsigned long long bytes,
                                          unsigned long long* out) {
  const unsigned long long words = bytes / 8;
  const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  const unsigned long long tid = blockIdx.x * static_cast<unsigned long long>(blockDim.x) + threadIdx.x;
  unsigned long long sum = 0;
  for (unsigned long long i = tid; i < words; i += stride) sum += splitmix64(src[i] ^ (i * golden));
  if (tid == 0) {
    sum += bytes * golden;
    if (bytes % 8) {
      const auto* tail = reinterpret_cast<const unsigned char*>(src + words);
      unsigned long long w = 0;
      for (unsigned k = 0; k < bytes % 8; ++k) w |= static_cast<unsigned long long>(tail[k]) << (8 * k);
      sum += splitmix64(w ^ (words * golden));
    }
  }
  for (int off = 16; off > 0; off /= 2) sum += __shfl_down_sync(0xffffffffu, sum, off);
  if ((threadIdx.x & 31) == 0) atomicAdd(out, sum);
}
