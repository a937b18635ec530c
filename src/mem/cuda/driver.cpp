#include "mem/cuda/driver.hpp"

#include <ferry/core/error.hpp>

#include "core/logging.hpp"

#include <dlfcn.h>
#include <fmt/format.h>

#include <mutex>

namespace ferry::cuda {
namespace {

driver_api g_api;
driver_status g_status;
std::once_flag g_once;

using get_proc_v2 = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
using get_proc_v1 = CUresult (*)(const char*, void**, int, cuuint64_t);

void load_once(const std::string& library) {
  g_status.library = library;
  void* h = ::dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = ::dlerror();
    g_status.reason = fmt::format("no NVIDIA driver: cannot load {} ({})", library, e ? e : "unknown error");
    return;
  }
  auto gp2 = reinterpret_cast<get_proc_v2>(::dlsym(h, "cuGetProcAddress_v2"));
  auto gp1 = reinterpret_cast<get_proc_v1>(::dlsym(h, "cuGetProcAddress"));
  if (!gp2 && !gp1) {
    g_status.reason = fmt::format("{} has no cuGetProcAddress: the driver is too old (CUDA 11.3+ needed)", library);
    return;
  }
  // Ask for each entry point at the ABI of the cuda.h we compiled against, capped at what the
  // driver supports: an older driver still gives us the functions it has.
  int drv = 0;
  auto get_version = reinterpret_cast<CUresult (*)(int*)>(::dlsym(h, "cuDriverGetVersion"));
  if (get_version) get_version(&drv);
  int want = drv > 0 && drv < CUDA_VERSION ? drv : CUDA_VERSION;
  std::string missing;
  auto resolve = [&](const char* name, void** fn, bool required = true) {
    CUresult r = gp2 ? gp2(name, fn, want, CU_GET_PROC_ADDRESS_DEFAULT, nullptr)
                     : gp1(name, fn, want, CU_GET_PROC_ADDRESS_DEFAULT);
    if (r != CUDA_SUCCESS || !*fn) {
      *fn = nullptr;
      if (required) missing += (missing.empty() ? "" : ", ") + std::string(name);
    }
  };
#define FERRY_CUDA_RESOLVE(name) resolve(#name, reinterpret_cast<void**>(&g_api.name));
  FERRY_CUDA_DRIVER_FUNCTIONS(FERRY_CUDA_RESOLVE)
#undef FERRY_CUDA_RESOLVE
#define FERRY_CUDA_RESOLVE_V(name, abi) resolve(#name, reinterpret_cast<void**>(&g_api.name));
  FERRY_CUDA_DRIVER_FUNCTIONS_VERSIONED(FERRY_CUDA_RESOLVE_V)
#undef FERRY_CUDA_RESOLVE_V
#define FERRY_CUDA_RESOLVE_OPTIONAL(name) resolve(#name, reinterpret_cast<void**>(&g_api.name), false);
  FERRY_CUDA_DRIVER_FUNCTIONS_OPTIONAL(FERRY_CUDA_RESOLVE_OPTIONAL)
#undef FERRY_CUDA_RESOLVE_OPTIONAL
  if (!missing.empty()) {
    g_status.reason = fmt::format("driver {} (CUDA {}.{}) lacks: {}", library, drv / 1000, drv % 1000 / 10, missing);
    return;
  }
  g_status.version = drv;
  if (CUresult r = g_api.cuInit(0); r != CUDA_SUCCESS) {
    g_status.reason = fmt::format("cuInit failed: {}", describe(r));
    return;
  }
  int n = 0;
  if (CUresult r = g_api.cuDeviceGetCount(&n); r != CUDA_SUCCESS) {
    g_status.reason = fmt::format("cuDeviceGetCount failed: {}", describe(r));
    return;
  }
  g_status.device_count = n;
  g_status.api = &g_api;
  log::debug("cuda", "loaded {} (CUDA {}.{}), {} device(s)", library, drv / 1000, drv % 1000 / 10, n);
}

}  // namespace

const driver_status& load(const std::string& library) {
  std::call_once(g_once, [&] { load_once(library); });
  return g_status;
}

std::string describe(CUresult r) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (g_api.cuGetErrorName) g_api.cuGetErrorName(r, &name);
  if (g_api.cuGetErrorString) g_api.cuGetErrorString(r, &text);
  return fmt::format("{}: {} (CUresult {})", name ? name : "CUDA_ERROR_?", text ? text : "unknown",
                     static_cast<int>(r));
}

void check(CUresult r, std::string_view op, std::string_view resource, std::source_location where) {
  if (r == CUDA_SUCCESS) [[likely]]
    return;
  errc code = errc::device_error;
  switch (r) {
    case CUDA_ERROR_OUT_OF_MEMORY: code = errc::out_of_memory; break;
    case CUDA_ERROR_INVALID_VALUE: case CUDA_ERROR_INVALID_HANDLE: code = errc::invalid_argument; break;
    case CUDA_ERROR_INVALID_DEVICE: code = errc::out_of_range; break;
    case CUDA_ERROR_NOT_SUPPORTED: code = errc::not_supported; break;
    case CUDA_ERROR_ILLEGAL_ADDRESS: case CUDA_ERROR_ILLEGAL_STATE: code = errc::bad_address; break;
    case CUDA_ERROR_NO_DEVICE: case CUDA_ERROR_NOT_INITIALIZED: case CUDA_ERROR_DEINITIALIZED:
      code = errc::unavailable; break;
    case CUDA_ERROR_NOT_READY: code = errc::busy; break;
    default: break;
  }
  error_info i{code, std::string(op), std::string(resource), "CUDA call failed", describe(r), 0, static_cast<long>(r),
               where};
  throw error(std::move(i));
}

}  // namespace ferry::cuda
