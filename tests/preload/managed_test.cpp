// libferry_preload.so's managed memory (tools/preload/managed.cpp, driver_hook.cpp), as an unmodified
// program's CUDA runtime meets it: the program dlopens "the driver" (here a stand-in,
// fake_cuda.cpp, that counts the calls reaching it), finds cuGetProcAddress with dlsym and gets
// every entry point from it. ferry serves its managed memory on the sim device (no GPU here); what
// is not ferry's must reach the driver untouched. Run with the library in LD_PRELOAD (ctest sets it).
#include "support/data.hpp"

#include <gtest/gtest.h>

#include <cuda.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

namespace test = ferry::test;

using get_proc = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);

struct fake_driver {
  void* handle = nullptr;
  get_proc get = nullptr;
  int (*calls)(const char*) = nullptr;
  void* (*own)(const char*, int, cuuint64_t) = nullptr;

  fake_driver() {
    handle = ::dlopen(FERRY_FAKE_CUDA, RTLD_NOW | RTLD_LOCAL);
    if (!handle) throw std::runtime_error(std::string("cannot load the fake driver: ") + ::dlerror());
    get = reinterpret_cast<get_proc>(::dlsym(handle, "cuGetProcAddress_v2"));
    calls = reinterpret_cast<int (*)(const char*)>(::dlsym(handle, "fake_cuda_calls"));
    own = reinterpret_cast<void* (*)(const char*, int, cuuint64_t)>(::dlsym(handle, "fake_cuda_entry"));
  }
  template <typename Fn>
  Fn entry(const char* name, int version = 13000, cuuint64_t flags = CU_GET_PROC_ADDRESS_DEFAULT) {
    void* fn = nullptr;
    CUdriverProcAddressQueryResult found{};
    if (get(name, &fn, version, flags, &found) != CUDA_SUCCESS) return nullptr;
    return reinterpret_cast<Fn>(fn);
  }
};

fake_driver& driver() {
  static fake_driver d;
  return d;
}

TEST(PreloadManaged, TheProgramsGetterIsWrappedAndHandsOutFerrysEntryPointsOnly) {
  auto& d = driver();
  ASSERT_NE(d.get, nullptr);
  EXPECT_NE(reinterpret_cast<void*>(d.get), d.own("cuGetProcAddress_v2", 0, 0)) << "dlsym gave the driver's own getter";
  // Served: a wrapper, not the driver's function; per ABI version and per default-stream flavour.
  void* alloc = d.entry<void*>("cuMemAllocManaged");
  EXPECT_NE(alloc, nullptr);
  EXPECT_NE(alloc, d.own("cuMemAllocManaged", 13000, 0));
  EXPECT_NE(d.entry<void*>("cuMemAdvise", 13000), d.entry<void*>("cuMemAdvise", 11000));
  EXPECT_NE(d.entry<void*>("cuMemPrefetchAsync"),
            d.entry<void*>("cuMemPrefetchAsync", 13000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM));
  // Not served: the driver's own function, untouched.
  EXPECT_EQ(d.entry<void*>("cuCtxSynchronize"), d.own("cuCtxSynchronize", 13000, 0));
  EXPECT_EQ(d.entry<void*>("cuCtxGetDevice", 2000), d.own("cuCtxGetDevice", 2000, 0));
}

TEST(PreloadManaged, ManagedMemoryIsFerrysAndEverythingElseReachesTheDriver) {
  auto& d = driver();
  auto alloc = d.entry<CUresult (*)(CUdeviceptr*, size_t, unsigned)>("cuMemAllocManaged");
  auto free = d.entry<CUresult (*)(CUdeviceptr)>("cuMemFree");
  auto attribute = d.entry<CUresult (*)(void*, CUpointer_attribute, CUdeviceptr)>("cuPointerGetAttribute");
  auto attributes = d.entry<CUresult (*)(unsigned, CUpointer_attribute*, void**, CUdeviceptr)>("cuPointerGetAttributes");
  auto prefetch = d.entry<CUresult (*)(CUdeviceptr, size_t, CUmemLocation, unsigned, CUstream)>("cuMemPrefetchAsync");
  auto advise = d.entry<CUresult (*)(CUdeviceptr, size_t, CUmem_advise, CUmemLocation)>("cuMemAdvise");
  auto attach = d.entry<CUresult (*)(CUstream, CUdeviceptr, size_t, unsigned)>("cuStreamAttachMemAsync");
  auto launch = d.entry<CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                                     void**, void**)>("cuLaunchKernel");
  ASSERT_TRUE(alloc && free && attribute && attributes && prefetch && advise && attach && launch);

  const std::size_t n = (6u << 20) + 12345;
  CUdeviceptr p = 0;
  ASSERT_EQ(alloc(&p, n, CU_MEM_ATTACH_GLOBAL), CUDA_SUCCESS);
  ASSERT_NE(p, 0u);
  EXPECT_EQ(d.calls("cuMemAllocManaged"), 0) << "the allocation reached the driver";
  EXPECT_EQ(alloc(&p, 0, CU_MEM_ATTACH_GLOBAL), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(alloc(&p, 1, 77), CUDA_ERROR_INVALID_VALUE);

  // The pointer says it is managed, as UVM's do, although the driver does not know it.
  bool managed = false;
  EXPECT_EQ(attribute(&managed, CU_POINTER_ATTRIBUTE_IS_MANAGED, p + 100), CUDA_SUCCESS);
  EXPECT_TRUE(managed);
  CUpointer_attribute as[] = {CU_POINTER_ATTRIBUTE_IS_MANAGED, CU_POINTER_ATTRIBUTE_DEVICE_POINTER, CU_POINTER_ATTRIBUTE_MEMORY_TYPE};
  bool m2 = false;
  CUdeviceptr dp = 0;
  unsigned type = 0;
  void* data[] = {&m2, &dp, &type};
  EXPECT_EQ(attributes(3, as, data, p), CUDA_SUCCESS);
  EXPECT_TRUE(m2);
  EXPECT_EQ(dp, p);
  EXPECT_EQ(type, static_cast<unsigned>(CU_MEMORYTYPE_DEVICE));
  // Another pointer: the driver's answer.
  bool other = true;
  EXPECT_EQ(attribute(&other, CU_POINTER_ATTRIBUTE_IS_MANAGED, 0x1000), CUDA_ERROR_INVALID_VALUE);

  // The CPU writes and reads it; a pread (which the kernel refuses for memory on the device) and a
  // pwrite move a file's bytes in and out of it through the preload library's routing.
  auto* bytes = reinterpret_cast<unsigned char*>(p);
  std::memset(bytes, 0x5a, n);
  EXPECT_EQ(bytes[n - 1], 0x5a);
  const auto data_in = test::random_bytes(n, 3);
  char tmpl[] = "/tmp/ferry-preload-managed-XXXXXX";
  const int fd = ::mkstemp(tmpl);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::pwrite(fd, data_in.data(), n, 0), static_cast<ssize_t>(n));
  CUmemLocation on_device{CU_MEM_LOCATION_TYPE_DEVICE, 0};
  EXPECT_EQ(prefetch(p, n, on_device, 0, nullptr), CUDA_SUCCESS);
  EXPECT_EQ(::pread(fd, bytes + 1, n - 1, 1), static_cast<ssize_t>(n - 1)) << std::strerror(errno);
  EXPECT_EQ(std::memcmp(bytes + 1, data_in.data() + 1, n - 1), 0);
  EXPECT_EQ(bytes[0], 0x5a);
  ::unlink(tmpl);
  ::close(fd);

  // Hints, attach and launches are served (or seen) for ferry's memory; the driver gets the rest.
  CUmemLocation host{CU_MEM_LOCATION_TYPE_HOST, 0};
  EXPECT_EQ(advise(p, n, CU_MEM_ADVISE_SET_READ_MOSTLY, on_device), CUDA_SUCCESS);
  EXPECT_EQ(advise(p, n, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, host), CUDA_SUCCESS);
  EXPECT_EQ(prefetch(p, n, host, 0, nullptr), CUDA_SUCCESS);
  EXPECT_EQ(attach(nullptr, p, 0, CU_MEM_ATTACH_SINGLE), CUDA_SUCCESS);
  EXPECT_EQ(d.calls("cuMemPrefetchAsync") + d.calls("cuMemAdvise") + d.calls("cuStreamAttachMemAsync"), 0);
  EXPECT_EQ(advise(0x1000, 4096, CU_MEM_ADVISE_SET_READ_MOSTLY, on_device), CUDA_SUCCESS);
  EXPECT_EQ(d.calls("cuMemAdvise"), 1);
  EXPECT_EQ(launch(nullptr, 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr, nullptr), CUDA_SUCCESS);
  EXPECT_EQ(d.calls("cuLaunchKernel"), 1);

  // Free: ferry's goes back to its space (after the context's work, as cuMemFree waits for it),
  // another pointer to the driver.
  EXPECT_EQ(free(p), CUDA_SUCCESS);
  EXPECT_EQ(d.calls("cuMemFree"), 0);
  EXPECT_GE(d.calls("cuCtxSynchronize"), 1);
  EXPECT_EQ(free(0x1000), CUDA_SUCCESS);
  EXPECT_EQ(d.calls("cuMemFree"), 1);
}

// Small allocations share pages (a page each would hold a page of memory for every small one, 32 MiB
// by default), each as UVM's reads before it is written: zero, also when its block was used before.
TEST(PreloadManaged, SmallAllocationsSharePagesAndEachStartsZeroed) {
  auto& d = driver();
  auto alloc = d.entry<CUresult (*)(CUdeviceptr*, size_t, unsigned)>("cuMemAllocManaged");
  auto free = d.entry<CUresult (*)(CUdeviceptr)>("cuMemFree");
  ASSERT_TRUE(alloc && free);
  constexpr int count = 64;
  constexpr std::size_t n = 3000;
  std::vector<CUdeviceptr> ps(count);
  for (auto& p : ps) {
    ASSERT_EQ(alloc(&p, n, CU_MEM_ATTACH_GLOBAL), CUDA_SUCCESS);
    EXPECT_EQ(p % 256, 0u) << "not aligned as cudaMallocManaged's";
  }
  const auto [lo, hi] = std::minmax_element(ps.begin(), ps.end());
  EXPECT_LT(*hi - *lo, CUdeviceptr{1} << 20) << "64 allocations of 3000 bytes spread over pages of their own";
  for (int i = 0; i < count; ++i) {
    auto* b = reinterpret_cast<unsigned char*>(ps[i]);
    for (int j = 0; j < count; ++j) {
      if (j == i) continue;
      EXPECT_TRUE(ps[j] + n <= ps[i] || ps[i] + n <= ps[j]) << "allocations " << i << " and " << j << " overlap";
    }
    EXPECT_EQ(*std::max_element(b, b + n), 0) << "allocation " << i << " did not start zeroed";
    std::memset(b, 0xa5, n);
  }
  // Freed and made again: the blocks are used again, written all over before, and read as zeros.
  for (auto p : ps) EXPECT_EQ(free(p), CUDA_SUCCESS);
  std::vector<CUdeviceptr> again(count);
  for (auto& p : again) ASSERT_EQ(alloc(&p, n, CU_MEM_ATTACH_GLOBAL), CUDA_SUCCESS);
  std::sort(ps.begin(), ps.end());
  int reused = 0;
  for (auto p : again) {
    reused += std::binary_search(ps.begin(), ps.end(), p);
    auto* b = reinterpret_cast<unsigned char*>(p);
    EXPECT_EQ(*std::max_element(b, b + n), 0) << "a block used before was handed out unzeroed";
  }
  EXPECT_GT(reused, 0) << "no block was used again (nothing tested the zeroing)";
  for (auto p : again) EXPECT_EQ(free(p), CUDA_SUCCESS);
  CUdeviceptr inside = 0;
  ASSERT_EQ(alloc(&inside, n, CU_MEM_ATTACH_GLOBAL), CUDA_SUCCESS);
  EXPECT_EQ(free(inside + 256), CUDA_ERROR_INVALID_VALUE) << "a pointer inside an allocation was freed";
  EXPECT_EQ(free(inside), CUDA_SUCCESS);
}

}  // namespace
