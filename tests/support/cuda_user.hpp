#pragma once
// A user's own CUDA program in the GPU tests: the device's primary context (the one the runtime API
// uses), a module of the test's kernels and a stream of its own -- nothing of ferry's device layer.
#include "mem/cuda/driver.hpp"

namespace ferry::test {

struct cuda_user {
  const cuda::driver_api& api;
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  CUmodule mod = nullptr;
  CUstream s = nullptr;

  cuda_user(const cuda::driver_api& a, const void* fatbin) : api(a) {
    check(api.cuDeviceGet(&dev, 0), "cuDeviceGet");
    check(api.cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    check(api.cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
    check(api.cuModuleLoadData(&mod, fatbin), "cuModuleLoadData");
    check(api.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  }
  ~cuda_user() {
    api.cuStreamDestroy(s);
    api.cuModuleUnload(mod);
    api.cuDevicePrimaryCtxRelease(dev);
  }
  cuda_user(const cuda_user&) = delete;
  cuda_user& operator=(const cuda_user&) = delete;
  void check(CUresult r, const char* call) const { cuda::check(r, "test", call); }
  CUfunction fn(const char* name) const {
    CUfunction f = nullptr;
    check(api.cuModuleGetFunction(&f, mod, name), "cuModuleGetFunction");
    return f;
  }
};

}  // namespace ferry::test
