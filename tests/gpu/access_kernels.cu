// Kernels of the gpu layer's GPU tests: requesters on the GPU, through ferry/gpu/ring.hpp and the page cache of ferry/gpu/array.hpp, compiled by
// nvcc into a fatbin the tests load themselves.
#include <ferry/gpu/array.hpp>

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
    unsigned long long t = ferry::gpu::submit(v, r, wait_ns, static_cast<unsigned>(warp));
    statuses[k] = t == ferry::gpu::no_ticket ? 100u : static_cast<unsigned>(ferry::gpu::wait(v, done + warp, t, wait_ns));
  }
}

// The page cache's kernels (ferry/gpu/array.hpp): every thread of the grid is a requester.
namespace {
template <std::size_t N>
struct bytes_of {
  unsigned char b[N];
};

// Thread i reads element mix(i, seed) % size into out[i] and its status into statuses[i].
template <typename T>
__device__ void gather(const ferry::gpu::array<T>& a, T* out, unsigned long long n, unsigned seed, unsigned* statuses) {
  unsigned long long i = blockIdx.x * 1ull * blockDim.x + threadIdx.x;
  if (i >= n) return;
  T v{};
  statuses[i] = static_cast<unsigned>(a.get(mix(i, seed) % a.size(), v));
  out[i] = v;
}
}  // namespace

#define FERRY_GATHER(name, T)                                                                                   \
  extern "C" __global__ void name(ferry::gpu::array<T> a, T* out, unsigned long long n, unsigned seed, unsigned* st) { \
    gather(a, out, n, seed, st);                                                                                \
  }
FERRY_GATHER(cache_gather_1, unsigned char)
FERRY_GATHER(cache_gather_2, unsigned short)
FERRY_GATHER(cache_gather_4, unsigned)
FERRY_GATHER(cache_gather_8, unsigned long long)
FERRY_GATHER(cache_gather_12, bytes_of<12>)
FERRY_GATHER(cache_gather_16, bytes_of<16>)
FERRY_GATHER(cache_gather_24, bytes_of<24>)

// Thread i writes value(i) to element first + i (threads of one page write distinct elements of it).
extern "C" __global__ void cache_write_4(ferry::gpu::array<unsigned> a, unsigned long long first, unsigned long long n,
                                         unsigned* statuses) {
  unsigned long long i = blockIdx.x * 1ull * blockDim.x + threadIdx.x;
  if (i >= n) return;
  statuses[i] = static_cast<unsigned>(a.set(first + i, static_cast<unsigned>((first + i) * 2654435761u + 7)));
}

// One thread reads the first element of every page in turn (a miss each, slowly enough for the
// host to cut the file short meanwhile); out[p] and statuses[p] per page.
extern "C" __global__ void cache_sweep_8(ferry::gpu::array<unsigned long long> a, unsigned long long per_page,
                                         unsigned long long pages, unsigned long long* out, unsigned* statuses) {
  if (blockIdx.x || threadIdx.x) return;
  for (unsigned long long p = 0; p < pages; ++p) {
    unsigned long long v = 0;
    statuses[p] = static_cast<unsigned>(a.get(p * per_page, v));
    out[p] = v;
  }
}
