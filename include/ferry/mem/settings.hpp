#pragma once
// mem's tunables: the registration cache's pinned bytes and the one pinned staging pool every staged
// path draws from (rows in src/mem/settings.cpp; ferry/settings.hpp gathers every layer's).
#include <ferry/core/export.hpp>
#include <ferry/core/settings.hpp>

#include <cstdint>
#include <span>

namespace ferry {

// A virtual base of the structs of layers that read it: its members stay trivially copyable (see core_settings).
struct FERRY_API mem_settings {
  std::uint64_t pin_limit = 8ull << 30;
  std::uint64_t staging_bytes = 4ull << 20;
  int staging_buffers = 32;

  static std::span<const setting_row<mem_settings>> table();
};

}  // namespace ferry
