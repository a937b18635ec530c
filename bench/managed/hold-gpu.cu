// hold-gpu FREE_GIB: holds GPU 0's memory down to FREE_GIB GiB free (device memory taken in 1 GiB
// allocations, the last one smaller), says how much is free and held, then keeps it until its standard
// input closes. run-suite --gpu-free uses it to run the oversubscribed programs on a machine whose host
// memory is smaller than 1.5x the GPU's: the programs see a smaller GPU, UVM's runs and ferry's alike.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>
#include <unistd.h>

int main(int argc, char** argv) {
  char* end = nullptr;
  double gib = argc == 2 ? std::strtod(argv[1], &end) : -1;
  if (argc != 2 || *end || gib < 0) {
    std::fprintf(stderr, "usage: hold-gpu FREE_GIB (GiB to leave free on GPU 0)\n");
    return 2;
  }
  const size_t want = static_cast<size_t>(gib * (1ull << 30));
  size_t free_b = 0, total = 0;
  if (cudaError_t e = cudaMemGetInfo(&free_b, &total)) {
    std::fprintf(stderr, "hold-gpu: cudaMemGetInfo: %s\n", cudaGetErrorString(e));
    return 1;
  }
  std::vector<void*> held;
  size_t held_b = 0;
  while (free_b > want) {
    size_t n = free_b - want < (1ull << 30) ? free_b - want : (1ull << 30);
    void* p = nullptr;
    if (cudaError_t e = cudaMalloc(&p, n)) {
      std::fprintf(stderr, "hold-gpu: cudaMalloc of %zu bytes with %zu free: %s\n", n, free_b, cudaGetErrorString(e));
      return 1;
    }
    held.push_back(p);
    held_b += n;
    if (cudaError_t e = cudaMemGetInfo(&free_b, &total)) {
      std::fprintf(stderr, "hold-gpu: cudaMemGetInfo: %s\n", cudaGetErrorString(e));
      return 1;
    }
  }
  std::printf("free %.2f GiB of %.2f GiB, held %.2f GiB\n", free_b / double(1ull << 30), total / double(1ull << 30),
              held_b / double(1ull << 30));
  std::fflush(stdout);
  char c;
  while (read(0, &c, 1) > 0) {
  }
  return 0;
}
