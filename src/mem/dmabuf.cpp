#include <ferry/core/error.hpp>
#include <ferry/mem/dmabuf.hpp>

#ifdef FERRY_HAVE_CUDA
#include "mem/cuda/driver.hpp"
#endif

#include <fmt/format.h>
#include <unistd.h>

namespace ferry {

dmabuf& dmabuf::operator=(dmabuf&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(o.fd_, -1);
    size_ = o.size_;
  }
  return *this;
}

dmabuf::~dmabuf() {
  if (fd_ >= 0) ::close(fd_);
}

dmabuf export_dmabuf([[maybe_unused]] const void* p, std::uint64_t bytes, [[maybe_unused]] const std::string& cuda_driver) {
  std::string res = describe_range(p, bytes);
  auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  if (!p || bytes == 0 || reinterpret_cast<std::uintptr_t>(p) % page || bytes % page)
    fail(errc::invalid_argument, "mem.export_dmabuf", res, fmt::format("range must be non-empty and {}-byte aligned", page));
#ifdef FERRY_HAVE_CUDA
  const cuda::driver_status& st = cuda::load(cuda_driver);
  if (!st.api) fail(errc::unavailable, "mem.export_dmabuf", res, st.reason);
  const cuda::driver_api& api = *st.api;
  unsigned type = 0;
  int ordinal = -1;
  CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
  void* data[] = {&type, &ordinal};
  if (api.cuPointerGetAttributes(2, attrs, data, reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS ||
      type != CU_MEMORYTYPE_DEVICE)
    fail(errc::bad_address, "mem.export_dmabuf", res, "not CUDA device memory");
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  cuda::check(api.cuDeviceGet(&dev, ordinal), "mem.export_dmabuf", res);
  int supported = 0;
  api.cuDeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev);
  if (!supported)
    fail(errc::not_supported, "mem.export_dmabuf", fmt::format("{} on cuda:{}", res, ordinal),
         "the driver reports no dma-buf support on this device/platform (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED=0)");
  cuda::check(api.cuDevicePrimaryCtxRetain(&ctx, dev), "mem.export_dmabuf", res);
  int fd = -1;
  CUresult r = CUDA_SUCCESS;
  {
    cuda::context_scope cs(api, ctx);
    r = api.cuMemGetHandleForAddressRange(&fd, reinterpret_cast<CUdeviceptr>(p), bytes, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
  }
  api.cuDevicePrimaryCtxRelease(dev);
  cuda::check(r, "mem.export_dmabuf", res);
  return dmabuf(fd, bytes);
#else
  fail(errc::unavailable, "mem.export_dmabuf", res, "this build of ferry has no CUDA support");
#endif
}

}  // namespace ferry
