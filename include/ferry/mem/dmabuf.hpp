#pragma once
// dma-buf export of GPU memory: a file descriptor a third-party DMA driver (a NIC, an NVMe
// controller, an accelerator) can import to reach the GPU range directly (cuMemGetHandleForAddressRange).
#include <ferry/core/export.hpp>

#include <cstdint>
#include <string>
#include <utility>

namespace ferry {

class FERRY_API dmabuf {
 public:
  dmabuf() = default;
  dmabuf(int fd, std::uint64_t size) : fd_(fd), size_(size) {}
  dmabuf(dmabuf&& o) noexcept : fd_(std::exchange(o.fd_, -1)), size_(o.size_) {}
  dmabuf& operator=(dmabuf&& o) noexcept;
  ~dmabuf();
  int fd() const noexcept { return fd_; }
  std::uint64_t size() const noexcept { return size_; }

 private:
  int fd_ = -1;
  std::uint64_t size_ = 0;
};

// Exports [p, p+bytes) of CUDA device memory (page-aligned). Throws unavailable without CUDA,
// not_supported where the driver or platform cannot export dma-bufs, invalid_argument on misalignment.
FERRY_API dmabuf export_dmabuf(const void* p, std::uint64_t bytes, const std::string& cuda_driver = "libcuda.so.1");

}  // namespace ferry
