// What one small copy costs, part by part, next to the driver's own cuMemcpyAsync + synchronize
// in the same process: the driver's copy waited for as ferry's streams wait, a ferry stream's copy,
// the engine's copy with regions given, and the engine's copy (single copies of 64 KiB .. 16 MiB
// are to run at >= 0.9x cudaMemcpyAsync + synchronize). Run with
// --benchmark_enable_random_interleaving=true and repetitions, so that a drift of the machine
// touches every row alike.
#include <ferry/runtime.hpp>

#ifdef FERRY_HAVE_CUDA
#include "mem/cuda/driver.hpp"
#endif

#include <benchmark/benchmark.h>

#include <atomic>
#include <cstdint>

namespace {

#ifdef FERRY_HAVE_CUDA
struct gpu {
  const ferry::cuda::driver_api* api = nullptr;
  ferry::runtime* rt = nullptr;
  CUdeviceptr a = 0, b = 0;
  void* host = nullptr;  // pinned (cuMemHostAlloc), the source of the h2d rows
  std::uint32_t* word = nullptr;  // pinned, written by the stream in BM_DriverCopyAndWriteValue
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
      drv.api->cuMemHostAlloc(&x.host, 16 << 20, CU_MEMHOSTALLOC_PORTABLE);
      void* w = nullptr;
      drv.api->cuMemHostAlloc(&w, 64, CU_MEMHOSTALLOC_PORTABLE);
      x.word = static_cast<std::uint32_t*>(w);
      *x.word = 0;
      drv.api->cuStreamCreate(&x.s, CU_STREAM_NON_BLOCKING);
      return x;
    }();
    return g;
  }
  // The second argument picks the source: 0 device memory (a copy within the GPU), 1 pinned host
  // memory (a copy over PCIe).
  CUdeviceptr src(const benchmark::State& st) const {
    return st.range(1) ? reinterpret_cast<CUdeviceptr>(host) : a;
  }
};

#define NEED_GPU(st)                      \
  gpu& g = gpu::get();                    \
  if (!g.api) {                           \
    st.SkipWithError("no CUDA device");   \
    return;                               \
  }

// Sizes x sources (0 = device, 1 = pinned host).
void sizes(benchmark::internal::Benchmark* b) {
  b->ArgsProduct({{64 << 10, 1 << 20}, {0, 1}})->UseRealTime();
}

void BM_DriverCopyAndSync(benchmark::State& st) {
  NEED_GPU(st);
  auto n = static_cast<std::size_t>(st.range(0));
  for (auto _ : st) {
    g.api->cuMemcpyAsync(g.b, g.src(st), n, g.s);
    g.api->cuStreamSynchronize(g.s);
  }
  st.SetBytesProcessed(static_cast<std::int64_t>(st.iterations() * n));
}
BENCHMARK(BM_DriverCopyAndSync)->Apply(sizes);

// How ferry's streams wait: the stream writes a sequence number into a pinned word after the copy,
// and the thread watches the word (no driver call per look).
void copy_and_wait(gpu& g, benchmark::State& st, std::uint32_t& seq) {
  const auto n = static_cast<std::size_t>(st.range(0));
  g.api->cuMemcpyAsync(g.b, g.src(st), n, g.s);
  g.api->cuStreamWriteValue32(g.s, reinterpret_cast<CUdeviceptr>(g.word), ++seq, CU_STREAM_WRITE_VALUE_DEFAULT);
  while (std::atomic_ref<std::uint32_t>(*g.word).load(std::memory_order_acquire) != seq) {
  }
}

void BM_DriverCopyAndWriteValue(benchmark::State& st) {
  NEED_GPU(st);
  auto n = static_cast<std::size_t>(st.range(0));
  std::uint32_t seq = *g.word;
  for (auto _ : st) copy_and_wait(g, st, seq);
  st.SetBytesProcessed(static_cast<std::int64_t>(st.iterations() * n));
}
BENCHMARK(BM_DriverCopyAndWriteValue)->Apply(sizes);

// The driver's copy waited for as ferry's streams wait, then both sides asked again, as the engine
// asks them for each copy: by the driver alone (the buffer id, what the registration cache checks a
// remembered device pointer with), and through the registration cache. Against
// BM_DriverCopyAndWriteValue, what asking costs right after a copy.
void BM_DriverCopyThenBufferIds(benchmark::State& st) {
  NEED_GPU(st);
  auto n = static_cast<std::size_t>(st.range(0));
  std::uint32_t seq = *g.word;
  CUpointer_attribute a = CU_POINTER_ATTRIBUTE_BUFFER_ID;
  for (auto _ : st) {
    copy_and_wait(g, st, seq);
    for (CUdeviceptr p : {g.b, g.src(st)}) {
      unsigned long long id = 0;
      void* d = &id;
      g.api->cuPointerGetAttributes(1, &a, &d, p);
      benchmark::DoNotOptimize(id);
    }
  }
  st.SetBytesProcessed(static_cast<std::int64_t>(st.iterations() * n));
}
BENCHMARK(BM_DriverCopyThenBufferIds)->Apply(sizes);

void BM_DriverCopyThenClassify(benchmark::State& st) {
  NEED_GPU(st);
  auto n = static_cast<std::size_t>(st.range(0));
  std::uint32_t seq = *g.word;
  for (auto _ : st) {
    copy_and_wait(g, st, seq);
    benchmark::DoNotOptimize(g.rt->registrations().classify(reinterpret_cast<void*>(g.b), n));
    benchmark::DoNotOptimize(g.rt->registrations().classify(reinterpret_cast<void*>(g.src(st)), n));
  }
  st.SetBytesProcessed(static_cast<std::int64_t>(st.iterations() * n));
}
BENCHMARK(BM_DriverCopyThenClassify)->Apply(sizes);

void BM_StreamCopyAndSync(benchmark::State& st) {
  NEED_GPU(st);
  static auto s = g.rt->devices().get("cuda:0").create_stream();
  auto n = static_cast<std::size_t>(st.range(0));
  for (auto _ : st) {
    s->copy(reinterpret_cast<void*>(g.b), reinterpret_cast<void*>(g.src(st)), n);
    s->synchronize();
  }
  st.SetBytesProcessed(static_cast<std::int64_t>(st.iterations() * n));
}
BENCHMARK(BM_StreamCopyAndSync)->Apply(sizes);

// The engine's copy with both sides classified once beforehand (transfer_request's regions): the
// engine's own cost without the two classifications.
void BM_FerryCopyClassified(benchmark::State& st) {
  NEED_GPU(st);
  auto n = static_cast<std::size_t>(st.range(0));
  auto* from = reinterpret_cast<void*>(g.src(st));
  auto src = g.rt->registrations().classify(from, n);
  auto dst = g.rt->registrations().classify(reinterpret_cast<void*>(g.b), n);
  ferry::transfer_request r{reinterpret_cast<void*>(g.b), from, n, &dst, &src};
  for (auto _ : st) g.rt->engine().copy(r);
  st.SetBytesProcessed(static_cast<std::int64_t>(st.iterations() * n));
}
BENCHMARK(BM_FerryCopyClassified)->Apply(sizes);

void BM_FerryCopy(benchmark::State& st) {
  NEED_GPU(st);
  auto n = static_cast<std::size_t>(st.range(0));
  for (auto _ : st) g.rt->engine().copy(reinterpret_cast<void*>(g.b), reinterpret_cast<void*>(g.src(st)), n);
  st.SetBytesProcessed(static_cast<std::int64_t>(st.iterations() * n));
}
BENCHMARK(BM_FerryCopy)->Apply(sizes);

void BM_ClassifyDevicePointer(benchmark::State& st) {
  NEED_GPU(st);
  for (auto _ : st) benchmark::DoNotOptimize(g.rt->registrations().classify(reinterpret_cast<void*>(g.a + 4096), 1 << 20));
}
BENCHMARK(BM_ClassifyDevicePointer);

void BM_ClassifyPinnedHost(benchmark::State& st) {
  NEED_GPU(st);
  for (auto _ : st)
    benchmark::DoNotOptimize(g.rt->registrations().classify(static_cast<std::byte*>(g.host) + 4096, 1 << 20));
}
BENCHMARK(BM_ClassifyPinnedHost);
#endif

}  // namespace
