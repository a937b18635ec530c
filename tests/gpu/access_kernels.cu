// Kernels of the gpu layer's GPU tests: requesters on the GPU, through ferry/gpu/ring.hpp, compiled by
// nvcc into a fatbin the tests load themselves.
#include <ferry/gpu/ring.hpp>

namespace {
__device__ __forceinline__ unsigned long long mix(unsigned long long i, unsigned seed) {
  unsigned long long z = (i + seed) * 0x9E3779B97F4A7C15ull;
  return z ^ (z >> 29);
}
}  // namespace

// Lane 0 of each of the first `warps` warps reads `per_warp` chunks of `chunk` bytes of source 0, chunk k of the whole
// kernel from chunk-aligned offset (mix(k, seed) % chunks) * chunk -- or, when `past_end` is set,
// every 7th from just before the end of the file -- into dst + k * chunk, one request at a time,
// and records each answer's status in statuses[k] (100: no slot within `wait_ns`).
extern "C" __global__ void gpu_access_read(ferry::gpu::ring_view v, unsigned* done, unsigned char* dst,
                                           unsigned long long file_bytes, unsigned long long chunk, unsigned warps, unsigned per_warp,
                                           unsigned seed, unsigned past_end, unsigned long long wait_ns, unsigned* statuses) {
  unsigned long long gt = blockIdx.x * 1ull * blockDim.x + threadIdx.x;
  if (gt % 32) return;
  unsigned long long warp = gt / 32;
  if (warp >= warps) return;
  for (unsigned j = 0; j < per_warp; ++j) {
    unsigned long long k = warp * per_warp + j;
    ferry::gpu::request r;
    r.offset = past_end && k % 7 == 0 ? file_bytes - chunk / 2 : (mix(k, seed) % (file_bytes / chunk)) * chunk;
    r.bytes = chunk;
    r.addr = reinterpret_cast<unsigned long long>(dst + k * chunk);
    r.done = reinterpret_cast<unsigned long long>(done + warp);
    r.source = 0;
    unsigned long long t = ferry::gpu::submit(v, r, wait_ns);
    statuses[k] = t == ferry::gpu::no_ticket ? 100u : static_cast<unsigned>(ferry::gpu::wait(done + warp, t, wait_ns));
  }
}
