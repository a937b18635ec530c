// A program written for CUDA managed memory (the runtime API, its own stream and kernel), switched to
// ferry's unified memory by one include and one allocation call per buffer (label "gpu"; exit 77
// without a GPU). Everything else -- cudaMemAdvise, cudaMemPrefetchAsync, cudaFree,
// cudaStreamDestroy -- is written as the program had it.
#include <cuda_runtime.h>
#include <ferry/cuda_managed.hpp>  // the include added

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <vector>

namespace ferry::detail {
extern const unsigned char ferry_user_kernels[];
}

namespace {

unsigned value_at(std::uint64_t i, unsigned seed) {
  std::uint64_t z = (i + seed) * 0x9E3779B97F4A7C15ull;
  return static_cast<unsigned>(z ^ (z >> 29));
}

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call << ": " << ferry::managed::last_error()

}  // namespace

TEST(GpuManaged, AManagedMemoryProgramRunsWithOneIncludeAndOneCallChanged) {
  cudaStream_t s = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaLibrary_t lib = nullptr;
  CUDA_OK(cudaLibraryLoadData(&lib, ferry::detail::ferry_user_kernels, nullptr, nullptr, 0, nullptr, nullptr, 0));
  cudaKernel_t gather = nullptr;
  CUDA_OK(cudaLibraryGetKernel(&gather, lib, "user_gather"));

  const std::size_t src_bytes = 96ull << 20, out_bytes = 8ull << 20;
  unsigned* src = nullptr;
  unsigned* out = nullptr;
  CUDA_OK(ferry::managed::malloc_managed(&src, src_bytes));  // was cudaMallocManaged(&src, src_bytes)
  CUDA_OK(ferry::managed::malloc_managed(&out, out_bytes));
  for (std::size_t i = 0; i < src_bytes / 4; ++i) src[i] = value_at(i, 3);  // the CPU initializes
  cudaMemLocation gpu{cudaMemLocationTypeDevice, 0};
  CUDA_OK(cudaMemAdvise(src, src_bytes, cudaMemAdviseSetReadMostly, gpu));
  CUDA_OK(cudaMemAdvise(src, src_bytes, cudaMemAdviseSetAccessedBy, gpu));
  CUDA_OK(cudaMemPrefetchAsync(src, src_bytes, gpu, 0, s));
  unsigned long long words = src_bytes / 4, n = out_bytes / 4;
  unsigned seed = 11;
  void* args[] = {&src, &words, &out, &n, &seed};
  for (int k = 0; k < 3; ++k) CUDA_OK(cudaLaunchKernel(reinterpret_cast<const void*>(gather), dim3(264), dim3(256), args, 0, s));
  CUDA_OK(cudaStreamSynchronize(s));
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) bad += out[i] != value_at(value_at(i, seed) % words, 3) + static_cast<unsigned>(i);
  EXPECT_EQ(bad, 0u) << "words of the kernel's result the CPU found wrong";
  ASSERT_NE(ferry::managed::space(), nullptr);
  // The CPU's reads took `out` to the host; the next launch (the runtime API's, seen through CUPTI)
  // takes it back to the device before the kernel runs.
  auto* space = ferry::managed::space();
  ASSERT_TRUE(space->returns_pages()) << "no launch callbacks (CUPTI) here";
  const auto taken = space->pages().cpu_taken(), returned = space->stats().returns;
  EXPECT_GT(taken, 0u);
  CUDA_OK(cudaLaunchKernel(reinterpret_cast<const void*>(gather), dim3(264), dim3(256), args, 0, s));
  CUDA_OK(cudaStreamSynchronize(s));
  EXPECT_EQ(space->pages().cpu_taken(), 0u);
  EXPECT_EQ(space->stats().returns - returned, taken);
  bad = 0;
  for (std::size_t i = 0; i < n; ++i) bad += out[i] != value_at(value_at(i, seed) % words, 3) + static_cast<unsigned>(i);
  EXPECT_EQ(bad, 0u) << "after the return";

  // A CUDA pointer still goes to CUDA; ferry's come back to ferry.
  void* d = nullptr;
  CUDA_OK(cudaMalloc(&d, 1 << 20));
  EXPECT_EQ(cudaFree(d), cudaSuccess);
  EXPECT_EQ(cudaFree(src), cudaSuccess);
  EXPECT_EQ(cudaFree(out), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
  CUDA_OK(cudaLibraryUnload(lib));

  // Errors are CUDA's codes, with ferry's message kept.
  void* huge = nullptr;
  EXPECT_EQ(ferry::managed::malloc_managed(&huge, 1ull << 52), cudaErrorMemoryAllocation);
  EXPECT_THAT(ferry::managed::last_error(), ::testing::HasSubstr("vm.alloc"));
  int x = 0;
  EXPECT_NE(ferry::managed::free(&x), cudaSuccess) << "a host pointer is CUDA's to refuse";
  cudaGetLastError();
}

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("SKIPPED: no usable CUDA device (%s)\n", cudaGetErrorString(cudaGetLastError()));
    return 77;
  }
  return RUN_ALL_TESTS();
}
