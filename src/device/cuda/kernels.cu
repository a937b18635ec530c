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

// stream::copy(..., copy_engine::sm): a copy done by the SMs instead of a copy engine. 16-byte
// vectors, four in flight per thread (loads from host memory over PCIe need many outstanding
// requests), when both ends are 16-byte aligned; bytes otherwise.
extern "C" __global__ void ferry_copy(unsigned char* dst, const unsigned char* src, unsigned long long bytes) {
  const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  const unsigned long long tid = blockIdx.x * static_cast<unsigned long long>(blockDim.x) + threadIdx.x;
  unsigned long long done = 0;
  if (((reinterpret_cast<unsigned long long>(dst) | reinterpret_cast<unsigned long long>(src)) & 15) == 0) {
    auto* d = reinterpret_cast<uint4*>(dst);
    const auto* s = reinterpret_cast<const uint4*>(src);
    const unsigned long long vecs = bytes / 16;
    unsigned long long i = tid;
    for (; i + 3 * stride < vecs; i += 4 * stride) {
      uint4 a = s[i], b = s[i + stride], c = s[i + 2 * stride], e = s[i + 3 * stride];
      d[i] = a;
      d[i + stride] = b;
      d[i + 2 * stride] = c;
      d[i + 3 * stride] = e;
    }
    for (; i < vecs; i += stride) d[i] = s[i];
    done = vecs * 16;
  }
  for (unsigned long long i = done + tid; i < bytes; i += stride) dst[i] = src[i];
}
