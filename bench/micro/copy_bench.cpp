// What one small device copy costs, part by part, next to the driver's own cuMemcpyAsync +
// synchronize in the same process: the per-request overhead the streams issue asks to remove
// (single copies of 64 KiB .. 16 MiB at >= 0.9x cudaMemcpyAsync + synchronize).
#include <ferry/runtime.hpp>

#ifdef FERRY_HAVE_CUDA
#include "mem/cuda/driver.hpp"
#endif

#include <benchmark/benchmark.h>

namespace {

#ifdef FERRY_HAVE_CUDA
struct gpu {
  const ferry::cuda::driver_api* api = nullptr;
  ferry::runtime* rt = nullptr;
  CUdeviceptr a = 0, b = 0;
  CUstream s = nullptr;
  static gpu& get() {
    static gpu g = [] {
      gpu x;
      static ferry::runtime r;
      x.rt = &r;
      const auto& drv = ferry::cuda::load(r.config().cuda_driver);
      if (!drv.api || drv.device_count == 0) return x;
      x.api = drv.api;
      r.devices().get("cuda:0");
      CUdevice d = 0;
      CUcontext c = nullptr;
      drv.api->cuDeviceGet(&d, 0);
      drv.api->cuDevicePrimaryCtxRetain(&c, d);
      drv.api->cuCtxSetCurrent(c);
      drv.api->cuMemAlloc(&x.a, 16 << 20);
      drv.api->cuMemAlloc(&x.b, 16 << 20);
      drv.api->cuStreamCreate(&x.s, CU_STREAM_NON_BLOCKING);
      return x;
    }();
    return g;
  }
};

#define NEED_GPU(st)                      \
  gpu& g = gpu::get();                    \
  if (!g.api) {                           \
    st.SkipWithError("no CUDA device");   \
    return;                               \
  }

void BM_DriverCopyAndSync(benchmark::State& st) {
  NEED_GPU(st);
  auto n = static_cast<std::size_t>(st.range(0));
  for (auto _ : st) {
    g.api->cuMemcpyAsync(g.b, g.a, n, g.s);
    g.api->cuStreamSynchronize(g.s);
  }
  st.SetBytesProcessed(static_cast<std::int64_t>(st.iterations() * n));
}
BENCHMARK(BM_DriverCopyAndSync)->Arg(64 << 10)->Arg(1 << 20)->Arg(16 << 20)->UseRealTime();

void BM_FerryCopy(benchmark::State& st) {
  NEED_GPU(st);
  auto n = static_cast<std::size_t>(st.range(0));
  for (auto _ : st) g.rt->engine().copy(reinterpret_cast<void*>(g.b), reinterpret_cast<void*>(g.a), n);
  st.SetBytesProcessed(static_cast<std::int64_t>(st.iterations() * n));
}
BENCHMARK(BM_FerryCopy)->Arg(64 << 10)->Arg(1 << 20)->Arg(16 << 20)->UseRealTime();

// The same copy with both sides classified once beforehand (transfer_request's regions): the
// engine's own cost without the two classifications.
void BM_FerryCopyClassified(benchmark::State& st) {
  NEED_GPU(st);
  auto n = static_cast<std::size_t>(st.range(0));
  auto src = g.rt->registrations().classify(reinterpret_cast<void*>(g.a), n);
  auto dst = g.rt->registrations().classify(reinterpret_cast<void*>(g.b), n);
  ferry::transfer_request r{reinterpret_cast<void*>(g.b), reinterpret_cast<void*>(g.a), n, &dst, &src};
  for (auto _ : st) g.rt->engine().copy(r);
  st.SetBytesProcessed(static_cast<std::int64_t>(st.iterations() * n));
}
BENCHMARK(BM_FerryCopyClassified)->Arg(64 << 10)->Arg(1 << 20)->UseRealTime();

// The parts: classifying a device pointer, and a ferry stream's copy + synchronize.
void BM_ClassifyDevicePointer(benchmark::State& st) {
  NEED_GPU(st);
  for (auto _ : st) benchmark::DoNotOptimize(g.rt->registrations().classify(reinterpret_cast<void*>(g.a + 4096), 1 << 20));
}
BENCHMARK(BM_ClassifyDevicePointer);

void BM_StreamCopyAndSync(benchmark::State& st) {
  NEED_GPU(st);
  static auto s = g.rt->devices().get("cuda:0").create_stream();
  auto n = static_cast<std::size_t>(st.range(0));
  for (auto _ : st) {
    s->copy(reinterpret_cast<void*>(g.b), reinterpret_cast<void*>(g.a), n);
    s->synchronize();
  }
}
BENCHMARK(BM_StreamCopyAndSync)->Arg(64 << 10)->Arg(1 << 20)->UseRealTime();
#endif

}  // namespace
