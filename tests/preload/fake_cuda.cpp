// A stand-in for libcuda.so.1 in the preload library's CPU tests: cuGetProcAddress and the entry
// points the managed-memory wrappers stand in front of, each counting its calls, so a test can tell
// which calls reached "the driver" and which ferry served. Nothing here is a GPU.
#include <cuda.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

namespace {

std::mutex mu;
std::map<std::string, int>& counts() {
  static std::map<std::string, int> m;
  return m;
}
void count(const char* name) {
  std::lock_guard l(mu);
  ++counts()[name];
}

extern "C" {
CUresult fake_alloc_managed(CUdeviceptr* p, size_t n, unsigned) {
  count("cuMemAllocManaged");
  *p = reinterpret_cast<CUdeviceptr>(std::malloc(n));
  return CUDA_SUCCESS;
}
CUresult fake_free(CUdeviceptr) {
  count("cuMemFree");
  return CUDA_SUCCESS;
}
CUresult fake_prefetch_v2(CUdeviceptr, size_t, CUmemLocation, unsigned, CUstream) {
  count("cuMemPrefetchAsync");
  return CUDA_SUCCESS;
}
CUresult fake_prefetch_v2_ptsz(CUdeviceptr, size_t, CUmemLocation, unsigned, CUstream) {
  count("cuMemPrefetchAsync_ptsz");
  return CUDA_SUCCESS;
}
CUresult fake_advise_v1(CUdeviceptr, size_t, CUmem_advise, CUdevice) {
  count("cuMemAdvise_v1");
  return CUDA_SUCCESS;
}
CUresult fake_advise_v2(CUdeviceptr, size_t, CUmem_advise, CUmemLocation) {
  count("cuMemAdvise");
  return CUDA_SUCCESS;
}
CUresult fake_attach(CUstream, CUdeviceptr, size_t, unsigned) {
  count("cuStreamAttachMemAsync");
  return CUDA_SUCCESS;
}
CUresult fake_stream_destroy(CUstream) {
  count("cuStreamDestroy");
  return CUDA_SUCCESS;
}
// As the driver answers for memory it does not know.
CUresult fake_attribute(void*, CUpointer_attribute, CUdeviceptr) {
  count("cuPointerGetAttribute");
  return CUDA_ERROR_INVALID_VALUE;
}
CUresult fake_attributes(unsigned, CUpointer_attribute*, void**, CUdeviceptr) {
  count("cuPointerGetAttributes");
  return CUDA_ERROR_INVALID_VALUE;
}
CUresult fake_launch(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void**,
                     void**) {
  count("cuLaunchKernel");
  return CUDA_SUCCESS;
}
CUresult fake_ctx_get_device(CUdevice* d) {
  *d = 0;
  return CUDA_SUCCESS;
}
CUresult fake_ctx_synchronize() {
  count("cuCtxSynchronize");
  return CUDA_SUCCESS;
}
}

void* entry(const char* s, int version, cuuint64_t flags) {
  const bool pt = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
  const std::string n = s;
  if (n == "cuMemAllocManaged") return reinterpret_cast<void*>(&fake_alloc_managed);
  if (n == "cuMemFree") return reinterpret_cast<void*>(&fake_free);
  if (n == "cuMemPrefetchAsync") return pt ? reinterpret_cast<void*>(&fake_prefetch_v2_ptsz) : reinterpret_cast<void*>(&fake_prefetch_v2);
  if (n == "cuMemAdvise") return version >= 12020 ? reinterpret_cast<void*>(&fake_advise_v2) : reinterpret_cast<void*>(&fake_advise_v1);
  if (n == "cuStreamAttachMemAsync") return reinterpret_cast<void*>(&fake_attach);
  if (n == "cuStreamDestroy") return reinterpret_cast<void*>(&fake_stream_destroy);
  if (n == "cuPointerGetAttribute") return reinterpret_cast<void*>(&fake_attribute);
  if (n == "cuPointerGetAttributes") return reinterpret_cast<void*>(&fake_attributes);
  if (n == "cuLaunchKernel") return reinterpret_cast<void*>(&fake_launch);
  if (n == "cuCtxGetDevice") return reinterpret_cast<void*>(&fake_ctx_get_device);
  if (n == "cuCtxSynchronize") return reinterpret_cast<void*>(&fake_ctx_synchronize);
  return nullptr;
}

}  // namespace

extern "C" {

[[gnu::visibility("default")]] CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int version, cuuint64_t flags,
                                                            CUdriverProcAddressQueryResult* found) {
  *pfn = entry(symbol, version, flags);
  if (found) *found = *pfn ? CU_GET_PROC_ADDRESS_SUCCESS : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  return *pfn ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

// For the tests: calls that reached this "driver" by name, and what it would hand out itself.
[[gnu::visibility("default")]] int fake_cuda_calls(const char* name) {
  std::lock_guard l(mu);
  auto it = counts().find(name);
  return it == counts().end() ? 0 : it->second;
}
[[gnu::visibility("default")]] void* fake_cuda_entry(const char* name, int version, cuuint64_t flags) {
  return name && std::strcmp(name, "cuGetProcAddress_v2") == 0 ? reinterpret_cast<void*>(&cuGetProcAddress_v2)
                                                               : entry(name, version, flags);
}

}  // extern "C"
