#pragma once
// gpu's tunables: GPU request rings, their proxy and the GPU page cache (rows in
// src/gpu/settings.cpp; ferry/settings.hpp gathers every layer's).
#include <ferry/core/export.hpp>
#include <ferry/core/settings.hpp>

#include <cstdint>
#include <span>

namespace ferry {

// With core's (FERRY_DEADLINE: a request's wait).
struct FERRY_API gpu_settings : virtual core_settings {
  std::uint32_t gpu_ring_slots = 1024;  // request slots per GPU request ring (a power of two)
  std::uint32_t gpu_proxy_batch = 256;  // requests a GPU proxy takes from its ring and serves as one batch
  std::uint32_t gpu_proxy_rings = 2;    // request rings of a GPU proxy, each drained by a thread of its own
  std::uint64_t gpu_cache_bytes = 1ull << 30;  // a GPU page cache's frames
  std::uint32_t gpu_cache_page = 64 << 10;     // a GPU page cache's page (a power of two, 4 KiB to 2 MiB)
  std::uint64_t gpu_cache_landing = 64ull << 20;  // pinned host memory a GPU page cache's pages pass through

  static std::span<const setting_row<gpu_settings>> table();
};

}  // namespace ferry
