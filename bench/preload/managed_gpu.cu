// managed_gpu [--bytes N] [--rounds R]: a plain CUDA program written for managed memory (the runtime
// API, built by nvcc alone with its default static runtime, nothing of ferry's), run as is or under
// `ferry run`. Three arrays of N bytes each (default 1 GiB) from cudaMallocManaged:
//   CPU first touch of a and b, a kernel c = a + b on a stream of its own, the CPU checks c;
//   cudaMemPrefetchAsync of all three to the GPU, the kernel again, prefetch of c back to the CPU,
//   the CPU checks c; cudaFree.
// Also checks what cudaPointerGetAttributes says of the memory (managed). Prints each phase's
// seconds, and "PASSED" when every value was right. Exit 0 on success, 1 on a wrong value or a
// failed call, 77 when there is no usable GPU.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {

__global__ void add(const float* a, const float* b, float* c, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n; i += static_cast<size_t>(gridDim.x) * blockDim.x)
    c[i] = a[i] + b[i];
}

bool ok(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "managed_gpu: %s: %s\n", what, cudaGetErrorString(e));
  return false;
}

double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

bool check_sum(const float* c, size_t n, float round) {
  for (size_t i = 0; i < n; i += 997)
    if (c[i] != static_cast<float>(i % 1000) + round) {
      std::fprintf(stderr, "managed_gpu: c[%zu] = %g, expected %g\n", i, c[i], static_cast<float>(i % 1000) + round);
      return false;
    }
  return c[n - 1] == static_cast<float>((n - 1) % 1000) + round;
}

}  // namespace

int main(int argc, char** argv) {
  size_t bytes = size_t{1} << 30;
  int rounds = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--bytes")) bytes = std::strtoull(argv[i + 1], nullptr, 0);
    else if (!std::strcmp(argv[i], "--rounds")) rounds = std::atoi(argv[i + 1]);
  }
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaSetDevice(dev) != cudaSuccess) {
    std::fprintf(stderr, "managed_gpu: no usable GPU\n");
    return 77;
  }
  const size_t n = bytes / sizeof(float);
  cudaStream_t s = nullptr;
  if (!ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate")) return 1;
  for (int r = 0; r < rounds; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    float *a = nullptr, *b = nullptr, *c = nullptr;
    if (!ok(cudaMallocManaged(&a, bytes), "cudaMallocManaged a") || !ok(cudaMallocManaged(&b, bytes), "cudaMallocManaged b") ||
        !ok(cudaMallocManaged(&c, bytes), "cudaMallocManaged c"))
      return 1;
    cudaPointerAttributes at{};
    if (!ok(cudaPointerGetAttributes(&at, c), "cudaPointerGetAttributes")) return 1;
    if (at.type != cudaMemoryTypeManaged) {
      std::fprintf(stderr, "managed_gpu: cudaPointerGetAttributes says type %d, not managed\n", static_cast<int>(at.type));
      return 1;
    }
    const double alloc_s = since(t0);
    t0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < n; ++i) {
      a[i] = static_cast<float>(i % 1000);
      b[i] = 0.0f;
    }
    const double touch_s = since(t0);
    t0 = std::chrono::steady_clock::now();
    add<<<1024, 256, 0, s>>>(a, b, c, n);
    if (!ok(cudaGetLastError(), "launch") || !ok(cudaStreamSynchronize(s), "kernel 1")) return 1;
    const double kernel1_s = since(t0);
    t0 = std::chrono::steady_clock::now();
    if (!check_sum(c, n, 0.0f)) return 1;
    const double check1_s = since(t0);
    t0 = std::chrono::steady_clock::now();
    cudaMemLocation gpu{cudaMemLocationTypeDevice, dev}, cpu{cudaMemLocationTypeHost, 0};
    for (float* p : {a, b, c})
      if (!ok(cudaMemPrefetchAsync(p, bytes, gpu, 0, s), "cudaMemPrefetchAsync to the GPU")) return 1;
    if (!ok(cudaMemAdvise(a, bytes, cudaMemAdviseSetReadMostly, gpu), "cudaMemAdvise")) return 1;
    for (size_t i = 0; i < n; i += 4096 / sizeof(float)) b[i] = 1.0f;  // the CPU writes a few values back
    add<<<1024, 256, 0, s>>>(a, b, c, n);
    if (!ok(cudaGetLastError(), "launch") ||
        !ok(cudaMemPrefetchAsync(c, bytes, cpu, 0, s), "cudaMemPrefetchAsync to the CPU") || !ok(cudaStreamSynchronize(s), "kernel 2"))
      return 1;
    const double kernel2_s = since(t0);
    for (size_t i = 0; i < n; i += 4096 / sizeof(float)) b[i] = 0.0f;
    for (size_t i = 0; i < n; i += 4096 / sizeof(float)) c[i] -= 1.0f;
    if (!check_sum(c, n, 0.0f)) return 1;
    t0 = std::chrono::steady_clock::now();
    if (!ok(cudaFree(a), "cudaFree") || !ok(cudaFree(b), "cudaFree") || !ok(cudaFree(c), "cudaFree")) return 1;
    std::printf("round %d: %zu bytes x3: alloc %.3f s, CPU first touch %.3f s, kernel %.3f s, CPU check %.3f s, "
                "prefetch + kernel + back %.3f s, free %.3f s\n",
                r, bytes, alloc_s, touch_s, kernel1_s, check1_s, kernel2_s, since(t0));
  }
  cudaStreamDestroy(s);
  std::printf("PASSED\n");
  return 0;
}
