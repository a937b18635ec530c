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
template <class P>
where stream_in(const void* params, bool per_thread) {
  CUstream s = reinterpret_cast<CUstream>(static_cast<const P*>(params)->stream);
  return {s ? s : per_thread ? CU_STREAM_PER_THREAD : CU_STREAM_LEGACY};
}
template <class P>
where driver_stream_in(const void* params, bool per_thread) {
  CUstream s = static_cast<const P*>(params)->hStream;
  return {s ? s : per_thread ? CU_STREAM_PER_THREAD : CU_STREAM_LEGACY};
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

where stream_of(CUpti_CallbackDomain dom, CUpti_CallbackId id, const void* p) {
  if (!p) return {nullptr, false};
  if (dom == CUPTI_CB_DOMAIN_DRIVER_API) switch (id) {
      case CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel: return driver_stream_in<launch_kernel_params>(p, false);
      case CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel_ptsz: return driver_stream_in<launch_kernel_params>(p, true);
      case CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel:
        return driver_stream_in<launch_kernel_params>(p, false);
      case CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel_ptsz:
        return driver_stream_in<launch_kernel_params>(p, true);
      case CUPTI_DRIVER_TRACE_CBID_cuLaunchGridAsync: return driver_stream_in<launch_grid_async_params>(p, false);
      case CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch: return driver_stream_in<graph_launch_params>(p, false);
      case CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch_ptsz: return driver_stream_in<graph_launch_params>(p, true);
      case CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx:
      case CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx_ptsz: {
        const CUlaunchConfig* c = static_cast<const launch_kernel_ex_params*>(p)->config;
        bool pt = id == CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx_ptsz;
        CUstream s = c ? c->hStream : nullptr;
        return {s ? s : pt ? CU_STREAM_PER_THREAD : CU_STREAM_LEGACY};
      }
      case CUPTI_DRIVER_TRACE_CBID_cuLaunch:
      case CUPTI_DRIVER_TRACE_CBID_cuLaunchGrid: return {CU_STREAM_LEGACY};
      default: return {nullptr, false};
    }
  switch (id) {
    case CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000: return stream_in<cudaLaunchKernel_v7000_params>(p, false);
    case CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_ptsz_v7000:
      return stream_in<cudaLaunchKernel_ptsz_v7000_params>(p, true);
    case CUPTI_RUNTIME_TRACE_CBID___cudaLaunchKernel_v13000: return stream_in<triple_chevron_params>(p, false);
    case CUPTI_RUNTIME_TRACE_CBID___cudaLaunchKernel_ptsz_v13000: return stream_in<triple_chevron_params>(p, true);
    case CUPTI_RUNTIME_TRACE_CBID_cudaLaunchCooperativeKernel_v9000:
      return stream_in<cudaLaunchCooperativeKernel_v9000_params>(p, false);
    case CUPTI_RUNTIME_TRACE_CBID_cudaLaunchCooperativeKernel_ptsz_v9000:
      return stream_in<cudaLaunchCooperativeKernel_ptsz_v9000_params>(p, true);
    case CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_v11060:
    case CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_ptsz_v11060: {
      const cudaLaunchConfig_t* c = static_cast<const cudaLaunchKernelExC_v11060_params*>(p)->config;
      bool pt = id == CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_ptsz_v11060;
      CUstream s = c ? reinterpret_cast<CUstream>(c->stream) : nullptr;
      return {s ? s : pt ? CU_STREAM_PER_THREAD : CU_STREAM_LEGACY};
    }
    case CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_v10000: return stream_in<cudaGraphLaunch_v10000_params>(p, false);
    case CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_ptsz_v10000:
      return stream_in<cudaGraphLaunch_ptsz_v10000_params>(p, true);
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyAsync_v3020: return stream_in<cudaMemcpyAsync_v3020_params>(p, false);
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyAsync_ptsz_v7000:
      return stream_in<cudaMemcpyAsync_ptsz_v7000_params>(p, true);
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy2DAsync_v3020: return stream_in<cudaMemcpy2DAsync_v3020_params>(p, false);
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy2DAsync_ptsz_v7000:
      return stream_in<cudaMemcpy2DAsync_ptsz_v7000_params>(p, true);
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemsetAsync_v3020: return stream_in<cudaMemsetAsync_v3020_params>(p, false);
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemsetAsync_ptsz_v7000:
      return stream_in<cudaMemsetAsync_ptsz_v7000_params>(p, true);
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemset2DAsync_v3020: return stream_in<cudaMemset2DAsync_v3020_params>(p, false);
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemset2DAsync_ptsz_v7000:
      return stream_in<cudaMemset2DAsync_ptsz_v7000_params>(p, true);
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy3DAsync_v3020: return stream_in<cudaMemcpy3DAsync_v3020_params>(p, false);
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy3DAsync_ptsz_v7000:
      return stream_in<cudaMemcpy3DAsync_ptsz_v7000_params>(p, true);
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemset3DAsync_v3020: return stream_in<cudaMemset3DAsync_v3020_params>(p, false);
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemset3DAsync_ptsz_v7000:
      return stream_in<cudaMemset3DAsync_ptsz_v7000_params>(p, true);
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyPeerAsync_v4000: return stream_in<cudaMemcpyPeerAsync_v4000_params>(p, false);
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyToSymbolAsync_v3020:
      return stream_in<cudaMemcpyToSymbolAsync_v3020_params>(p, false);
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyToSymbolAsync_ptsz_v7000:
      return stream_in<cudaMemcpyToSymbolAsync_ptsz_v7000_params>(p, true);
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyFromSymbolAsync_v3020:
      return stream_in<cudaMemcpyFromSymbolAsync_v3020_params>(p, false);
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyFromSymbolAsync_ptsz_v7000:
      return stream_in<cudaMemcpyFromSymbolAsync_ptsz_v7000_params>(p, true);
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy_v3020:
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemset_v3020:
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy2D_v3020:
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemset2D_v3020:
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy3D_v3020:
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemset3D_v3020:
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyPeer_v4000:
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyToSymbol_v3020:
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyFromSymbol_v3020: return {CU_STREAM_LEGACY};
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy_ptds_v7000:
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemset_ptds_v7000:
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy2D_ptds_v7000:
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemset2D_ptds_v7000:
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy3D_ptds_v7000:
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemset3D_ptds_v7000:
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyToSymbol_ptds_v7000:
    case CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyFromSymbol_ptds_v7000: return {CU_STREAM_PER_THREAD};
    default: return {nullptr, false};
  }
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
    const CUpti_CallbackId driver[] = {
        CUPTI_DRIVER_TRACE_CBID_cuLaunch, CUPTI_DRIVER_TRACE_CBID_cuLaunchGrid, CUPTI_DRIVER_TRACE_CBID_cuLaunchGridAsync,
        CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel, CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel_ptsz,
        CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx, CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx_ptsz,
        CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel, CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel_ptsz,
        CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernelMultiDevice, CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch,
        CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch_ptsz};
    const CUpti_CallbackId runtime[] = {
        CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000, CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_ptsz_v7000,
        CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_v11060, CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernelExC_ptsz_v11060,
        CUPTI_RUNTIME_TRACE_CBID_cudaLaunchCooperativeKernel_v9000, CUPTI_RUNTIME_TRACE_CBID_cudaLaunchCooperativeKernel_ptsz_v9000,
        CUPTI_RUNTIME_TRACE_CBID_cudaLaunchCooperativeKernelMultiDevice_v9000, CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_v10000,
        CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_ptsz_v10000, CUPTI_RUNTIME_TRACE_CBID___cudaLaunchKernel_v13000,
        CUPTI_RUNTIME_TRACE_CBID___cudaLaunchKernel_ptsz_v13000,
        // The user's copies and memsets: like a kernel, they may touch unified memory while it runs.
        CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy_v3020, CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy_ptds_v7000,
        CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyAsync_v3020, CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyAsync_ptsz_v7000,
        CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy2D_v3020, CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy2D_ptds_v7000,
        CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy2DAsync_v3020, CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy2DAsync_ptsz_v7000,
        CUPTI_RUNTIME_TRACE_CBID_cudaMemset_v3020, CUPTI_RUNTIME_TRACE_CBID_cudaMemset_ptds_v7000,
        CUPTI_RUNTIME_TRACE_CBID_cudaMemsetAsync_v3020, CUPTI_RUNTIME_TRACE_CBID_cudaMemsetAsync_ptsz_v7000,
        CUPTI_RUNTIME_TRACE_CBID_cudaMemset2D_v3020, CUPTI_RUNTIME_TRACE_CBID_cudaMemset2D_ptds_v7000,
        CUPTI_RUNTIME_TRACE_CBID_cudaMemset2DAsync_v3020, CUPTI_RUNTIME_TRACE_CBID_cudaMemset2DAsync_ptsz_v7000,
        CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy3D_v3020, CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy3D_ptds_v7000,
        CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy3DAsync_v3020, CUPTI_RUNTIME_TRACE_CBID_cudaMemcpy3DAsync_ptsz_v7000,
        CUPTI_RUNTIME_TRACE_CBID_cudaMemset3D_v3020, CUPTI_RUNTIME_TRACE_CBID_cudaMemset3D_ptds_v7000,
        CUPTI_RUNTIME_TRACE_CBID_cudaMemset3DAsync_v3020, CUPTI_RUNTIME_TRACE_CBID_cudaMemset3DAsync_ptsz_v7000,
        CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyPeer_v4000, CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyPeerAsync_v4000,
        CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyToSymbol_v3020, CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyToSymbol_ptds_v7000,
        CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyToSymbolAsync_v3020, CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyToSymbolAsync_ptsz_v7000,
        CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyFromSymbol_v3020, CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyFromSymbol_ptds_v7000,
        CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyFromSymbolAsync_v3020, CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyFromSymbolAsync_ptsz_v7000};
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
