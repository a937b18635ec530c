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
  X(cuDevicePrimaryCtxRelease) X(cuCtxSetCurrent) X(cuCtxGetCurrent) X(cuCtxSynchronize) X(cuMemGetInfo)                      \
  X(cuMemGetAllocationGranularity) X(cuMemCreate) X(cuMemRelease) X(cuMemAddressReserve) X(cuMemAddressFree) \
  X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess) X(cuMemAlloc) X(cuMemFree) X(cuMemsetD8Async)                 \
  X(cuMemcpyAsync) X(cuStreamCreate) X(cuStreamDestroy) X(cuStreamQuery) X(cuStreamWaitEvent)              \
  X(cuEventCreate) X(cuEventDestroy) X(cuEventRecord) X(cuEventQuery) X(cuModuleLoadData)                  \
  X(cuModuleUnload) X(cuModuleGetFunction) X(cuLaunchKernel) X(cuPointerGetAttributes) X(cuMemHostRegister)      \
  X(cuMemHostUnregister) X(cuCtxEnablePeerAccess) X(cuMemGetHandleForAddressRange)                                 \
  X(cuStreamGetDevice) X(cuStreamWriteValue32) X(cuStreamWaitValue32) X(cuEventSynchronize) X(cuStreamSynchronize) \
  X(cuCtxCreate) X(cuCtxDestroy) X(cuMemHostAlloc) X(cuMemFreeHost) X(cuStreamIsCapturing)                        \
  X(cuThreadExchangeStreamCaptureMode) X(cuStreamBeginCapture) X(cuStreamEndCapture) X(cuGraphInstantiateWithFlags) \
  X(cuGraphLaunch) X(cuGraphExecDestroy) X(cuGraphDestroy)

// Entry points whose newest ABI is declared in cuda.h under a _vN name that no macro maps the plain
// name to: cuGetProcAddress of the plain name at CUDA_VERSION gives the newest ABI, so the pointer
// must have its type. (Calling the plain declaration's type would pass too few arguments.)
#define FERRY_CUDA_DRIVER_FUNCTIONS_VERSIONED(X) X(cuStreamGetCtx, cuStreamGetCtx_v2) X(cuCtxGetDevice, cuCtxGetDevice_v2)
// Entry points a driver may lack (newer than ferry's minimum): null then, and ferry does without.
#define FERRY_CUDA_DRIVER_FUNCTIONS_OPTIONAL(X) X(cuMemcpyBatchAsync)

struct driver_api {
#define FERRY_CUDA_DECLARE(name) decltype(&::name) name = nullptr;
#define FERRY_CUDA_DECLARE_V(name, abi) decltype(&::abi) name = nullptr;
  FERRY_CUDA_DRIVER_FUNCTIONS(FERRY_CUDA_DECLARE)
  FERRY_CUDA_DRIVER_FUNCTIONS_VERSIONED(FERRY_CUDA_DECLARE_V)
  FERRY_CUDA_DRIVER_FUNCTIONS_OPTIONAL(FERRY_CUDA_DECLARE)
#undef FERRY_CUDA_DECLARE
#undef FERRY_CUDA_DECLARE_V
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

// Makes a context current on this thread for the scope's lifetime, then puts back the one that was
// current before (the caller's own, or none). ferry's calls run on its users' threads too: it must
// never leave them in a different context than the one they had.
//
// For the same scope the thread's stream-capture mode is relaxed: a user's CUDA graph capture in the
// default (global) mode, on any thread, would otherwise make ferry's calls that are "potentially
// unsafe" during a capture (VMM mapping, synchronous copies) fail and invalidate the user's capture.
class context_scope {
 public:
  context_scope(const driver_api& api, CUcontext ctx) noexcept : api_(&api) {
    if (api.cuCtxGetCurrent(&prev_) != CUDA_SUCCESS) prev_ = nullptr;
    if (prev_ != ctx) {
      status_ = api.cuCtxSetCurrent(ctx);
      switched_ = status_ == CUDA_SUCCESS;
    }
    mode_ = CU_STREAM_CAPTURE_MODE_RELAXED;
    relaxed_ = api.cuThreadExchangeStreamCaptureMode(&mode_) == CUDA_SUCCESS;
  }
  context_scope(context_scope&& o) noexcept
      : api_(o.api_), prev_(o.prev_), switched_(o.switched_), relaxed_(o.relaxed_), mode_(o.mode_), status_(o.status_) {
    o.switched_ = false;
    o.relaxed_ = false;
  }
  context_scope(const context_scope&) = delete;
  context_scope& operator=(const context_scope&) = delete;
  context_scope& operator=(context_scope&&) = delete;
  ~context_scope() {
    if (relaxed_) api_->cuThreadExchangeStreamCaptureMode(&mode_);
    if (switched_) api_->cuCtxSetCurrent(prev_);
  }
  CUresult status() const noexcept { return status_; }  // of making the context current

 private:
  const driver_api* api_;
  CUcontext prev_ = nullptr;
  bool switched_ = false;
  bool relaxed_ = false;
  CUstreamCaptureMode mode_ = CU_STREAM_CAPTURE_MODE_RELAXED;  // the thread's own, while relaxed
  CUresult status_ = CUDA_SUCCESS;
};

}  // namespace ferry::cuda
