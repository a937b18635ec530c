// Launch callbacks through CUPTI (see cupti.hpp).
#include "device/cuda/cupti.hpp"

#include "core/logging.hpp"

#include <cupti_callbacks.h>
#include <cupti_driver_cbid.h>
#include <cupti_runtime_cbid.h>
#include <dlfcn.h>
#include <generated_cuda_runtime_api_meta.h>
#include <fmt/format.h>

#include <algorithm>
#include <mutex>
#include <shared_mutex>
#include <utility>
#include <vector>

namespace ferry::cuda::cupti {

namespace {

struct api {
  decltype(&::cuptiSubscribe) subscribe = nullptr;
  decltype(&::cuptiEnableCallback) enable = nullptr;
  decltype(&::cuptiGetResultString) result_string = nullptr;
};

std::shared_mutex g_mu;  // g_sinks: shared in callbacks, exclusive to change
std::vector<std::pair<CUcontext, launch_sink*>> g_sinks;

// The stream a reported call queues its work on. The default stream a call means by 0 is the
// per-thread one for the _ptsz / _ptds entry points, else the legacy one.
struct where {
  CUstream stream = nullptr;
  bool known = true;
};
where by_default(CUstream s, bool per_thread) { return {s ? s : per_thread ? CU_STREAM_PER_THREAD : CU_STREAM_LEGACY}; }
where legacy() { return {CU_STREAM_LEGACY}; }
where per_thread() { return {CU_STREAM_PER_THREAD}; }
where unknown() { return {nullptr, false}; }  // several streams (multi-device launches)
// A parameter struct's stream: `hStream` in the driver's, `stream` in the runtime's.
template <class P>
CUstream stream_field(const P& q) {
  if constexpr (requires { q.hStream; }) return q.hStream;
  else return reinterpret_cast<CUstream>(q.stream);
}
template <class P>
where in(const void* p, bool per_thread) {
  return by_default(stream_field(*static_cast<const P*>(p)), per_thread);
}
// Launches with a configuration struct (cuLaunchKernelEx, cudaLaunchKernelExC): its stream.
template <class P>
where in_config(const void* p, bool per_thread) {
  auto* c = static_cast<const P*>(p)->config;
  return by_default(c ? stream_field(*c) : nullptr, per_thread);
}
// The driver calls' parameters, laid out as their declarations in cuda.h (as CUPTI passes them; its
// generated_cuda_meta.h needs cuda.h's internal API versions): the leading ones, up to the stream.
struct launch_kernel_params {  // cuLaunchKernel, cuLaunchCooperativeKernel and their _ptsz
  CUfunction f;
  unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes;
  CUstream hStream;
};
struct launch_grid_async_params {
  CUfunction f;
  int width, height;
  CUstream hStream;
};
struct graph_launch_params {  // cuGraphLaunch and its _ptsz
  CUgraphExec graph;
  CUstream hStream;
};
struct launch_kernel_ex_params {  // cuLaunchKernelEx and its _ptsz
  const CUlaunchConfig* config;
};
// __cudaLaunchKernel (the <<<>>> launch since CUDA 13) has no parameter struct in the generated
// header; its declaration (crt/device_functions.h) lays its parameters out as cudaLaunchKernel's.
struct triple_chevron_params {
  const void* kernel;
  dim3 gridDim;
  dim3 blockDim;
  void** args;
  size_t sharedMem;
  cudaStream_t stream;
};

// Every reported call, once: X(callback id, where its work goes, from its parameters `p`). The
// callbacks are enabled from these lists and stream_of() answers from them: the two cannot differ.
#define FERRY_CUPTI_DRIVER_CALLS(X)                                             \
  X(cuLaunch, legacy())                                                         \
  X(cuLaunchGrid, legacy())                                                     \
  X(cuLaunchGridAsync, in<launch_grid_async_params>(p, false))                  \
  X(cuLaunchKernel, in<launch_kernel_params>(p, false))                         \
  X(cuLaunchKernel_ptsz, in<launch_kernel_params>(p, true))                     \
  X(cuLaunchKernelEx, in_config<launch_kernel_ex_params>(p, false))             \
  X(cuLaunchKernelEx_ptsz, in_config<launch_kernel_ex_params>(p, true))         \
  X(cuLaunchCooperativeKernel, in<launch_kernel_params>(p, false))              \
  X(cuLaunchCooperativeKernel_ptsz, in<launch_kernel_params>(p, true))          \
  X(cuLaunchCooperativeKernelMultiDevice, unknown())                            \
  X(cuGraphLaunch, in<graph_launch_params>(p, false))                           \
  X(cuGraphLaunch_ptsz, in<graph_launch_params>(p, true))
// Kernels, graphs, and the user's copies and memsets: like a kernel, they may touch unified memory
// while they run.
#define FERRY_CUPTI_RUNTIME_CALLS(X)                                                                     \
  X(cudaLaunchKernel_v7000, in<cudaLaunchKernel_v7000_params>(p, false))                                 \
  X(cudaLaunchKernel_ptsz_v7000, in<cudaLaunchKernel_ptsz_v7000_params>(p, true))                        \
  X(cudaLaunchKernelExC_v11060, in_config<cudaLaunchKernelExC_v11060_params>(p, false))                  \
  X(cudaLaunchKernelExC_ptsz_v11060, in_config<cudaLaunchKernelExC_ptsz_v11060_params>(p, true))         \
  X(cudaLaunchCooperativeKernel_v9000, in<cudaLaunchCooperativeKernel_v9000_params>(p, false))           \
  X(cudaLaunchCooperativeKernel_ptsz_v9000, in<cudaLaunchCooperativeKernel_ptsz_v9000_params>(p, true))  \
  X(cudaLaunchCooperativeKernelMultiDevice_v9000, unknown())                                             \
  X(cudaGraphLaunch_v10000, in<cudaGraphLaunch_v10000_params>(p, false))                                 \
  X(cudaGraphLaunch_ptsz_v10000, in<cudaGraphLaunch_ptsz_v10000_params>(p, true))                        \
  X(__cudaLaunchKernel_v13000, in<triple_chevron_params>(p, false))                                      \
  X(__cudaLaunchKernel_ptsz_v13000, in<triple_chevron_params>(p, true))                                  \
  X(cudaMemcpy_v3020, legacy())                                                                          \
  X(cudaMemcpy_ptds_v7000, per_thread())                                                                 \
  X(cudaMemcpyAsync_v3020, in<cudaMemcpyAsync_v3020_params>(p, false))                                   \
  X(cudaMemcpyAsync_ptsz_v7000, in<cudaMemcpyAsync_ptsz_v7000_params>(p, true))                          \
  X(cudaMemcpy2D_v3020, legacy())                                                                        \
  X(cudaMemcpy2D_ptds_v7000, per_thread())                                                               \
  X(cudaMemcpy2DAsync_v3020, in<cudaMemcpy2DAsync_v3020_params>(p, false))                               \
  X(cudaMemcpy2DAsync_ptsz_v7000, in<cudaMemcpy2DAsync_ptsz_v7000_params>(p, true))                      \
  X(cudaMemset_v3020, legacy())                                                                          \
  X(cudaMemset_ptds_v7000, per_thread())                                                                 \
  X(cudaMemsetAsync_v3020, in<cudaMemsetAsync_v3020_params>(p, false))                                   \
  X(cudaMemsetAsync_ptsz_v7000, in<cudaMemsetAsync_ptsz_v7000_params>(p, true))                          \
  X(cudaMemset2D_v3020, legacy())                                                                        \
  X(cudaMemset2D_ptds_v7000, per_thread())                                                               \
  X(cudaMemset2DAsync_v3020, in<cudaMemset2DAsync_v3020_params>(p, false))                               \
  X(cudaMemset2DAsync_ptsz_v7000, in<cudaMemset2DAsync_ptsz_v7000_params>(p, true))                      \
  X(cudaMemcpy3D_v3020, legacy())                                                                        \
  X(cudaMemcpy3D_ptds_v7000, per_thread())                                                               \
  X(cudaMemcpy3DAsync_v3020, in<cudaMemcpy3DAsync_v3020_params>(p, false))                               \
  X(cudaMemcpy3DAsync_ptsz_v7000, in<cudaMemcpy3DAsync_ptsz_v7000_params>(p, true))                      \
  X(cudaMemset3D_v3020, legacy())                                                                        \
  X(cudaMemset3D_ptds_v7000, per_thread())                                                               \
  X(cudaMemset3DAsync_v3020, in<cudaMemset3DAsync_v3020_params>(p, false))                               \
  X(cudaMemset3DAsync_ptsz_v7000, in<cudaMemset3DAsync_ptsz_v7000_params>(p, true))                      \
  X(cudaMemcpyPeer_v4000, legacy())                                                                      \
  X(cudaMemcpyPeerAsync_v4000, in<cudaMemcpyPeerAsync_v4000_params>(p, false))                           \
  X(cudaMemcpyToSymbol_v3020, legacy())                                                                  \
  X(cudaMemcpyToSymbol_ptds_v7000, per_thread())                                                         \
  X(cudaMemcpyToSymbolAsync_v3020, in<cudaMemcpyToSymbolAsync_v3020_params>(p, false))                   \
  X(cudaMemcpyToSymbolAsync_ptsz_v7000, in<cudaMemcpyToSymbolAsync_ptsz_v7000_params>(p, true))          \
  X(cudaMemcpyFromSymbol_v3020, legacy())                                                                \
  X(cudaMemcpyFromSymbol_ptds_v7000, per_thread())                                                       \
  X(cudaMemcpyFromSymbolAsync_v3020, in<cudaMemcpyFromSymbolAsync_v3020_params>(p, false))               \
  X(cudaMemcpyFromSymbolAsync_ptsz_v7000, in<cudaMemcpyFromSymbolAsync_ptsz_v7000_params>(p, true))

where stream_of(CUpti_CallbackDomain dom, CUpti_CallbackId id, const void* p) {
  if (!p) return unknown();
#define FERRY_DRIVER_CASE(name, how) \
  case CUPTI_DRIVER_TRACE_CBID_##name: return how;
#define FERRY_RUNTIME_CASE(name, how) \
  case CUPTI_RUNTIME_TRACE_CBID_##name: return how;
  if (dom == CUPTI_CB_DOMAIN_DRIVER_API) switch (id) {
      FERRY_CUPTI_DRIVER_CALLS(FERRY_DRIVER_CASE)
      default: return unknown();
    }
  switch (id) {
    FERRY_CUPTI_RUNTIME_CALLS(FERRY_RUNTIME_CASE)
    default: return unknown();
  }
#undef FERRY_DRIVER_CASE
#undef FERRY_RUNTIME_CASE
}

void CUPTIAPI on_callback(void*, CUpti_CallbackDomain dom, CUpti_CallbackId id, const void* data) {
  thread_local bool inside = false;  // a launch made by a sink's own work is not reported again
  if (inside) return;
  struct flag {
    flag() { inside = true; }
    ~flag() { inside = false; }
  } f;
  auto* d = static_cast<const CUpti_CallbackData*>(data);
  bool enter = d->callbackSite == CUPTI_API_ENTER;
  // Both cudaError_t and CUresult: 0 is success.
  bool ok = enter || !d->functionReturnValue || *static_cast<const int*>(d->functionReturnValue) == 0;
  where w = stream_of(dom, id, d->functionParams);
  std::shared_lock l(g_mu);
  // Decided once, at the entry, and carried to the exit in the call's correlation word (a stream's
  // capture can begin or end on another thread meanwhile: the exit must match the entry).
  std::uint64_t* word = d->correlationData;
  bool report = false;
  if (enter || !word) {
    for (auto& [ctx, sink] : g_sinks)
      if (ctx == d->context && sink->reported(w.stream, w.known)) {
        report = true;
        break;
      }
    if (word) *word = report ? 1 : 0;
  } else {
    report = *word == 1;
  }
  if (!report) return;
  for (auto& [ctx, sink] : g_sinks)
    if (ctx == d->context) sink->on_launch(enter, w.stream, w.known, ok);
}

// Loads and subscribes once; the reason stays when it failed.
struct subscription {
  bool ok = false;
  std::string why;
};
const subscription& subscribe(const std::string& library) {
  static subscription s = [&] {
    subscription r;
    void* h = ::dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
    std::string tried = library;
    if (!h && library.find('/') == std::string::npos)
      for (const char* dir : {"/usr/local/cuda/lib64/", "/usr/local/cuda/extras/CUPTI/lib64/"}) {
        std::string p = dir + library;
        tried += ", " + p;
        if ((h = ::dlopen(p.c_str(), RTLD_NOW | RTLD_LOCAL))) break;
      }
    if (!h) {
      const char* e = ::dlerror();
      r.why = fmt::format("CUPTI not loaded (tried {}): {} (FERRY_CUPTI_LIBRARY)", tried, e ? e : "unknown");
      return r;
    }
    api a;
    a.subscribe = reinterpret_cast<decltype(a.subscribe)>(::dlsym(h, "cuptiSubscribe"));
    a.enable = reinterpret_cast<decltype(a.enable)>(::dlsym(h, "cuptiEnableCallback"));
    a.result_string = reinterpret_cast<decltype(a.result_string)>(::dlsym(h, "cuptiGetResultString"));
    if (!a.subscribe || !a.enable) {
      r.why = fmt::format("{} lacks cuptiSubscribe / cuptiEnableCallback", library);
      return r;
    }
    auto describe = [&](CUptiResult res) {
      const char* text = nullptr;
      if (a.result_string) a.result_string(res, &text);
      return fmt::format("{} (CUptiResult {})", text ? text : "unknown", static_cast<int>(res));
    };
    CUpti_SubscriberHandle sub{};
    if (CUptiResult res = a.subscribe(&sub, reinterpret_cast<CUpti_CallbackFunc>(on_callback), nullptr); res != CUPTI_SUCCESS) {
      r.why = fmt::format("cuptiSubscribe: {} (another CUPTI client, e.g. a profiler, may hold it)", describe(res));
      return r;
    }
#define FERRY_DRIVER_ID(name, how) CUPTI_DRIVER_TRACE_CBID_##name,
#define FERRY_RUNTIME_ID(name, how) CUPTI_RUNTIME_TRACE_CBID_##name,
    const CUpti_CallbackId driver[] = {FERRY_CUPTI_DRIVER_CALLS(FERRY_DRIVER_ID)};
    const CUpti_CallbackId runtime[] = {FERRY_CUPTI_RUNTIME_CALLS(FERRY_RUNTIME_ID)};
#undef FERRY_DRIVER_ID
#undef FERRY_RUNTIME_ID
    for (auto id : driver)
      if (CUptiResult res = a.enable(1, sub, CUPTI_CB_DOMAIN_DRIVER_API, id); res != CUPTI_SUCCESS) {
        r.why = fmt::format("cuptiEnableCallback (driver API, id {}): {}", static_cast<int>(id), describe(res));
        return r;
      }
    for (auto id : runtime)
      if (CUptiResult res = a.enable(1, sub, CUPTI_CB_DOMAIN_RUNTIME_API, id); res != CUPTI_SUCCESS) {
        r.why = fmt::format("cuptiEnableCallback (runtime API, id {}): {}", static_cast<int>(id), describe(res));
        return r;
      }
    log::debug("cuda", "launch callbacks on ({})", library);
    r.ok = true;
    return r;  // the subscription stays for the process's life (the library is never closed)
  }();
  return s;
}

}  // namespace

bool watch(const std::string& library, CUcontext ctx, launch_sink& sink, std::string& why) {
  const subscription& s = subscribe(library);
  if (!s.ok) {
    why = s.why;
    return false;
  }
  std::unique_lock l(g_mu);
  for (auto& [c, k] : g_sinks)
    if (k == &sink) return true;
  g_sinks.emplace_back(ctx, &sink);
  return true;
}

void unwatch(launch_sink& sink) noexcept {
  std::unique_lock l(g_mu);
  std::erase_if(g_sinks, [&](auto& e) { return e.second == &sink; });
}

}  // namespace ferry::cuda::cupti
