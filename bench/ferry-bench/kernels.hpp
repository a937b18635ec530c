#pragma once
// The host side of the benchmarks' kernels (pipeline_kernels.cu, embedded as a fatbin): the module
// image, the user's side that launches them, and the word function the kernels use, to write their
// inputs and check their results. CUDA builds only.
#include <ferry/gpu/cache.hpp>
#include <ferry/runtime.hpp>

#include "mem/cuda/driver.hpp"

#include <algorithm>

#include <cstdint>
#include <string>

namespace ferry::detail {
extern const unsigned char ferry_bench_kernels[];
}

namespace ferry::cli {
// Word i of the data for `seed`; pipeline_kernels.cu computes the same.
inline unsigned word_at(std::uint64_t i, unsigned seed) {
  std::uint64_t z = (i + seed) * 0x9E3779B97F4A7C15ull;
  return static_cast<unsigned>(z ^ (z >> 29));
}

// The user's side of a benchmark: the device's primary context (the one the runtime API, torch and
// CuPy use), the benchmark kernels' module and a stream of the user's own; kernels are launched with
// cuLaunchKernel, never through ferry.
struct bench_user {
  const cuda::driver_api& api;
  const char* what;  // names the benchmark in errors
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  CUmodule mod = nullptr;
  CUstream s = nullptr;
  unsigned blocks = 0;  // blocks of 256 threads that fill every SM

  bench_user(const cuda::driver_api& a, int ordinal, const char* who) : api(a), what(who) {
    check(api.cuDeviceGet(&dev, ordinal), "cuDeviceGet");
    check(api.cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    check(api.cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
    check(api.cuModuleLoadData(&mod, ferry::detail::ferry_bench_kernels), "cuModuleLoadData");
    check(api.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    int sms = 0, threads = 0;
    check(api.cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev), "cuDeviceGetAttribute");
    check(api.cuDeviceGetAttribute(&threads, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, dev), "cuDeviceGetAttribute");
    blocks = static_cast<unsigned>(sms * std::max(1, threads / 256));
  }
  ~bench_user() {
    if (s) api.cuStreamSynchronize(s), api.cuStreamDestroy(s);
    if (mod) api.cuModuleUnload(mod);
    api.cuDevicePrimaryCtxRelease(dev);
  }
  bench_user(const bench_user&) = delete;
  bench_user& operator=(const bench_user&) = delete;
  void check(CUresult r, const char* call) const { cuda::check(r, what, call); }
  CUfunction fn(const char* name) const {
    CUfunction f = nullptr;
    check(api.cuModuleGetFunction(&f, mod, name), "cuModuleGetFunction");
    return f;
  }
  void launch(CUfunction f, void** args, unsigned grid = 0) {
    check(api.cuLaunchKernel(f, grid ? grid : blocks, 1, 1, 256, 1, 1, 0, s, args, nullptr), "cuLaunchKernel");
  }
  void sync() { check(api.cuStreamSynchronize(s), "cuStreamSynchronize"); }
  CUdeviceptr alloc(std::uint64_t bytes) {
    CUdeviceptr p = 0;
    check(api.cuMemAlloc(&p, bytes), "cuMemAlloc");
    return p;
  }
  // Copies on the user's stream. to_host waits for it. to_device is ordered before what follows on
  // the stream and does not wait: pageable `src` may be reused at once (the driver took a copy),
  // pinned `src` only once the stream is past it.
  void to_host(void* dst, CUdeviceptr src, std::uint64_t bytes) {
    check(api.cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(dst), src, bytes, s), "cuMemcpyAsync");
    sync();
  }
  void to_device(CUdeviceptr dst, const void* src, std::uint64_t bytes) {
    check(api.cuMemcpyAsync(dst, reinterpret_cast<CUdeviceptr>(src), bytes, s), "cuMemcpyAsync");
  }
};

// Why accesses through the cache failed, as the cache says it (cache::check's exception).
inline std::string cache_failure(gpu::cache& c) {
  try {
    c.check();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "?";
}

// Writes a file of `bytes` (a multiple of 4) holding word_at(j, seed) at word j, through ferry, then
// reads it once so that the page cache holds it.
void write_word_file(runtime& rt, const std::string& path, std::uint64_t bytes, unsigned seed);
}  // namespace ferry::cli
