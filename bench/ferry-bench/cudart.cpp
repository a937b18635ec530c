#include "cudart.hpp"

#include <ferry/core/error.hpp>

#include <dlfcn.h>
#include <fmt/format.h>

namespace ferry::cli {

cudart::cudart() {
  for (const char* lib : {"libcudart.so.13", "libcudart.so.12", "/usr/local/cuda/lib64/libcudart.so.13",
                          "/usr/local/cuda/lib64/libcudart.so.12", "libcudart.so"}) {
    handle = ::dlopen(lib, RTLD_NOW | RTLD_LOCAL);
    if (handle) break;
  }
  if (!handle) {
    why = "libcudart not found (baselines need the CUDA runtime)";
    return;
  }
  auto sym = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::decay_t<decltype(fn)>>(::dlsym(handle, name));
    if (!fn) why += std::string(why.empty() ? "" : ", ") + name;
  };
  sym(malloc_, "cudaMalloc");
  sym(free_, "cudaFree");
  sym(malloc_host, "cudaMallocHost");
  sym(free_host, "cudaFreeHost");
  sym(memcpy_, "cudaMemcpy");
  sym(memcpy_peer, "cudaMemcpyPeer");
  sym(set_device, "cudaSetDevice");
  sym(stream_create, "cudaStreamCreate");
  sym(stream_destroy, "cudaStreamDestroy");
  sym(stream_sync, "cudaStreamSynchronize");
  sym(memcpy_async, "cudaMemcpyAsync");
  sym(enable_peer, "cudaDeviceEnablePeerAccess");
  sym(sync, "cudaDeviceSynchronize");
  sym(error_string, "cudaGetErrorString");
  sym(runtime_version, "cudaRuntimeGetVersion");
  malloc_managed = reinterpret_cast<decltype(malloc_managed)>(::dlsym(handle, "cudaMallocManaged"));
  memcpy_batch_async = reinterpret_cast<decltype(memcpy_batch_async)>(::dlsym(handle, "cudaMemcpyBatchAsync"));
  prefetch = reinterpret_cast<decltype(prefetch)>(::dlsym(handle, "cudaMemPrefetchAsync"));
  if (!why.empty()) {
    why = "libcudart lacks " + why;
    ::dlclose(handle);
    handle = nullptr;
  }
}

bool cudart::uvm_ok() const {
  int v = 0;
  return ok() && malloc_managed && prefetch && runtime_version(&v) == 0 && v >= 13000;
}

void cudart::check(int rc, const char* what) const {
  if (rc != 0)
    throw error(errc::device_error, "cudart", what, "baseline call failed",
                fmt::format("{} (cudaError {})", error_string ? error_string(rc) : "?", rc));
}

}  // namespace ferry::cli
