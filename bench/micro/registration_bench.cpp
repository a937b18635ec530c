// Cost of a registration-cache hit (acquire + release of an already registered range): the
// operation every transfer pays per buffer, so it must stay far below a microsecond.
#include <ferry/device/mapped_memory.hpp>
#include <ferry/runtime.hpp>

#ifdef FERRY_HAVE_CUDA
#include "mem/cuda/driver.hpp"
#endif

#include <benchmark/benchmark.h>

#include <vector>

namespace {

ferry::runtime& rt() {
  static ferry::runtime r;
  return r;
}

// Host memory registered once (cuMemHostRegister with a driver, mlock without), then hit.
void BM_RegistrationHitHost(benchmark::State& st) {
  static std::vector<char> buf(64 << 20, 1);
  auto& cache = rt().registrations();
  { auto warm = cache.acquire(buf.data(), buf.size()); }
  for (auto _ : st) {
    auto r = cache.acquire(buf.data() + 4096, 1 << 20);
    benchmark::DoNotOptimize(r);
  }
  st.counters["hits"] = static_cast<double>(cache.stats().hits);
}
BENCHMARK(BM_RegistrationHitHost);

// Sim device memory: the hit re-validates the range's serial.
void BM_RegistrationHitSimDevice(benchmark::State& st) {
  static ferry::mapped_memory m = ferry::allocate_mapped(rt().devices().get("sim:0"), 4 << 20);
  auto& cache = rt().registrations();
  { auto warm = cache.acquire(m.data(), m.size()); }
  for (auto _ : st) {
    auto r = cache.acquire(m.data() + 4096, 1 << 20);
    benchmark::DoNotOptimize(r);
  }
}
BENCHMARK(BM_RegistrationHitSimDevice);

#ifdef FERRY_HAVE_CUDA
// cudaMalloc-style device memory: every hit checks the CUDA buffer id (stale-after-free guard).
void BM_RegistrationHitCudaDevice(benchmark::State& st) {
  const auto& drv = ferry::cuda::load(rt().config().cuda_driver);
  if (!drv.api || drv.device_count == 0) {
    st.SkipWithError("no CUDA device");
    return;
  }
  rt().devices().get("cuda:0");  // retains the primary context
  CUdevice d = 0;
  CUcontext c = nullptr;
  drv.api->cuDeviceGet(&d, 0);
  drv.api->cuDevicePrimaryCtxRetain(&c, d);
  drv.api->cuCtxSetCurrent(c);
  static CUdeviceptr p = 0;
  if (!p) drv.api->cuMemAlloc(&p, 64 << 20);
  auto& cache = rt().registrations();
  { auto warm = cache.acquire(reinterpret_cast<void*>(p), 64 << 20); }
  for (auto _ : st) {
    auto r = cache.acquire(reinterpret_cast<void*>(p + 4096), 1 << 20);
    benchmark::DoNotOptimize(r);
  }
}
BENCHMARK(BM_RegistrationHitCudaDevice);
#endif

}  // namespace

BENCHMARK_MAIN();
