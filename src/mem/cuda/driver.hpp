#pragma once
// The CUDA driver API, loaded at run time. It lives in `mem` because pointer classification and host
// memory registration need it; `device` (the cuda backend) uses it from here. ferry never links against libcuda.so.1: it dlopens
// the library named by FERRY_CUDA_DRIVER and resolves every entry point with cuGetProcAddress
// at the ABI version of the cuda.h it was built with. Without a driver, load() reports why and
// everything CUDA says "unavailable". Only cuda.h's types and declarations are used (for decltype).
#include <cuda.h>

#include <source_location>
#include <string>
#include <string_view>

namespace ferry::cuda {

// Every driver entry point ferry uses. Add one here and it is resolved at load.
#define FERRY_CUDA_DRIVER_FUNCTIONS(X)                                                                     \
  X(cuInit) X(cuDriverGetVersion) X(cuGetErrorName) X(cuGetErrorString) X(cuDeviceGetCount) X(cuDeviceGet) \
  X(cuDeviceGetName) X(cuDeviceGetUuid) X(cuDeviceTotalMem) X(cuDeviceGetAttribute) X(cuDeviceGetPCIBusId) \
  X(cuDeviceCanAccessPeer) X(cuDeviceGetP2PAttribute) X(cuDevicePrimaryCtxRetain)                          \
  X(cuDevicePrimaryCtxRelease) X(cuCtxSetCurrent) X(cuCtxSynchronize) X(cuMemGetInfo)                      \
  X(cuMemGetAllocationGranularity) X(cuMemCreate) X(cuMemRelease) X(cuMemAddressReserve) X(cuMemAddressFree) \
  X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess) X(cuMemAlloc) X(cuMemFree) X(cuMemsetD8Async)                 \
  X(cuMemcpyAsync) X(cuStreamCreate) X(cuStreamDestroy) X(cuStreamQuery) X(cuStreamWaitEvent)              \
  X(cuEventCreate) X(cuEventDestroy) X(cuEventRecord) X(cuEventQuery) X(cuModuleLoadData)                  \
  X(cuModuleUnload) X(cuModuleGetFunction) X(cuLaunchKernel) X(cuPointerGetAttributes) X(cuMemHostRegister)      \
  X(cuMemHostUnregister) X(cuCtxEnablePeerAccess) X(cuMemGetHandleForAddressRange)

struct driver_api {
#define FERRY_CUDA_DECLARE(name) decltype(&::name) name = nullptr;
  FERRY_CUDA_DRIVER_FUNCTIONS(FERRY_CUDA_DECLARE)
#undef FERRY_CUDA_DECLARE
};

struct driver_status {
  const driver_api* api = nullptr;  // null when unavailable
  std::string library;              // what was loaded
  std::string reason;               // why unavailable ("no NVIDIA driver: ...")
  int version = 0;                  // cuDriverGetVersion, e.g. 13000
  int device_count = 0;
};

// Loads the driver once per process (the first caller's library name wins) and runs cuInit.
const driver_status& load(const std::string& library);

// "CUDA_ERROR_OUT_OF_MEMORY: out of memory (CUresult 2)".
std::string describe(CUresult r);

// Throws ferry::error when r is not CUDA_SUCCESS; the code follows the CUresult
// (out of memory -> out_of_memory, invalid value -> invalid_argument, ...), the cause is describe(r).
void check(CUresult r, std::string_view op, std::string_view resource,
           std::source_location where = std::source_location::current());

}  // namespace ferry::cuda
