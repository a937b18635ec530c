// Kernel-launch callbacks through CUPTI (see cupti.hpp).
#include "device/cuda/cupti.hpp"

#include "core/logging.hpp"

#include <cupti_callbacks.h>
#include <cupti_driver_cbid.h>
#include <cupti_runtime_cbid.h>
#include <dlfcn.h>
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

void CUPTIAPI on_callback(void*, CUpti_CallbackDomain, CUpti_CallbackId, const void* data) {
  thread_local bool inside = false;  // a launch made by a sink's own work is not reported again
  if (inside) return;
  struct flag {
    flag() { inside = true; }
    ~flag() { inside = false; }
  } f;
  auto* d = static_cast<const CUpti_CallbackData*>(data);
  bool enter = d->callbackSite == CUPTI_API_ENTER;
  std::shared_lock l(g_mu);
  for (auto& [ctx, sink] : g_sinks)
    if (ctx == d->context) sink->on_launch(enter);
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
        CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_ptsz_v10000, CUPTI_RUNTIME_TRACE_CBID___cudaLaunchKernel_v13000};
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
    log::debug("cuda", "kernel-launch callbacks on ({})", library);
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
