#pragma once
// xfer's tunables: the transfer engine's workers, pieces and paths (rows in src/xfer/settings.cpp;
// ferry/settings.hpp gathers every layer's).
#include <ferry/core/export.hpp>
#include <ferry/core/settings.hpp>
#include <ferry/mem/settings.hpp>

#include <cstdint>
#include <span>
#include <string_view>

namespace ferry {

// Pageable host memory in the transfer engine: automatic bounces it through pinned staging the first
// time and registers (pins) a range copied again; the others always do one of the two.
enum class pageable_policy { automatic, always_register, always_bounce };
FERRY_API std::string_view to_string(pageable_policy v) noexcept;

FERRY_API int default_xfer_threads() noexcept;  // half the hardware threads, 2..16

// With core's (FERRY_DEADLINE) and mem's (the staging pool the engine bounces and stages through).
struct FERRY_API xfer_settings : virtual core_settings, virtual mem_settings {
  int xfer_threads = 0;  // 0: default_xfer_threads()
  std::uint64_t xfer_chunk = 16ull << 20;
  std::uint64_t xfer_split = 0;
  std::uint64_t xfer_batch_small = 4ull << 20;
  pageable_policy xfer_pageable = pageable_policy::automatic;
  bool xfer_peer = true;

  static std::span<const setting_row<xfer_settings>> table();
};

}  // namespace ferry
