#pragma once
// The CUDA runtime, loaded at run time, only for the baselines that `ferry-bench` measures
// ferry against (cudaMemcpy, cudaMemcpyPeer). ferry itself never uses it.
#include <cstddef>
#include <string>

namespace ferry::cli {

struct cudart {
  // Loads libcudart (from the loader path or /usr/local/cuda/lib64); `ok()` false with `why` if absent.
  cudart();
  bool ok() const { return handle != nullptr; }
  std::string why;
  void* handle = nullptr;
  int (*malloc_)(void**, std::size_t) = nullptr;
  int (*free_)(void*) = nullptr;
  int (*malloc_host)(void**, std::size_t) = nullptr;
  int (*free_host)(void*) = nullptr;
  int (*memcpy_)(void*, const void*, std::size_t, int) = nullptr;
  int (*memcpy_peer)(void*, int, const void*, int, std::size_t) = nullptr;
  int (*set_device)(int) = nullptr;
  // Streams, for the multi-threaded pread + cudaMemcpyAsync pipeline of `ferry-bench file`.
  int (*stream_create)(void**) = nullptr;
  int (*stream_destroy)(void*) = nullptr;
  int (*stream_sync)(void*) = nullptr;
  int (*memcpy_async)(void*, const void*, std::size_t, int, void*) = nullptr;
  int (*enable_peer)(int, unsigned) = nullptr;
  int (*sync)() = nullptr;
  const char* (*error_string)(int) = nullptr;
  int (*runtime_version)(int*) = nullptr;
  // CUDA managed memory (UVM), the baseline of `ferry-bench vm`. The prefetch takes CUDA 13's
  // signature (cudaMemLocation by value); uvm_ok() says whether this runtime has it.
  struct mem_location {
    int type;  // cudaMemLocationTypeDevice = 1, cudaMemLocationTypeHost = 2
    int id;
  };
  // cudaMemcpyBatchAsync (CUDA 12.8+; the signature of CUDA 13), the baseline of the scattered-block
  // rows of `ferry-bench local`; null when this runtime lacks it.
  struct memcpy_attributes {
    int src_access_order;  // cudaMemcpySrcAccessOrderStream = 1
    mem_location src_hint, dst_hint;
    unsigned flags;
  };
  int (*memcpy_batch_async)(void* const*, const void* const*, const std::size_t*, std::size_t, memcpy_attributes*,
                            std::size_t*, std::size_t, void*) = nullptr;
  int (*malloc_managed)(void**, std::size_t, unsigned) = nullptr;
  int (*prefetch)(const void*, std::size_t, mem_location, unsigned, void*) = nullptr;
  bool uvm_ok() const;
  // Throws ferry::error naming the call when rc != 0.
  void check(int rc, const char* what) const;
  static constexpr int default_kind = 4;  // cudaMemcpyDefault (UVA decides the direction)
};

}  // namespace ferry::cli
