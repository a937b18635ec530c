#pragma once
// The CUDA runtime, loaded at run time, only for the baselines that `ferry bench` measures
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
  int (*enable_peer)(int, unsigned) = nullptr;
  int (*sync)() = nullptr;
  const char* (*error_string)(int) = nullptr;
  // Throws ferry::error naming the call when rc != 0.
  void check(int rc, const char* what) const;
  static constexpr int default_kind = 4;  // cudaMemcpyDefault (UVA decides the direction)
};

}  // namespace ferry::cli
