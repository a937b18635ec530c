// mem's settings table: a row per field of mem_settings (ferry/mem/settings.hpp).
#include <ferry/mem/settings.hpp>

#include "core/settings_table.hpp"

namespace ferry {

namespace {

// clang-format off
constexpr setting_row<mem_settings> rows[] = {
  {"FERRY_PIN_LIMIT", "Bytes the registration cache keeps pinned for unused registrations before evicting (LRU).",
   [](mem_settings& s, std::string_view v) { s.pin_limit = parse_size_in(v, 0, 1ull << 50); },
   [](const mem_settings& s) { return format_size(s.pin_limit); }},
  {"FERRY_STAGING_BYTES", "Size of each pinned staging buffer. One pool per NUMA node serves every staged path: the transfer engine's bounce and GPU-to-GPU copies, the file engine's I/O slots and ferry:// staging.",
   [](mem_settings& s, std::string_view v) { s.staging_bytes = parse_size_in(v, 64 * KiB, 1 * GiB); },
   [](const mem_settings& s) { return format_size(s.staging_bytes); }},
  {"FERRY_STAGING_BUFFERS", "Most pinned staging buffers per NUMA node (the one staging pool, made in segments as they are needed), 1..1024, shared by the file engine's threads and the transfer engine's staged copies; when it is empty, a file engine thread with I/O in flight goes on with fewer, one with none waits for a buffer. The default holds 128 MiB at most: more bytes in flight made page-cache loads into a GPU slower, not faster (docs/design/file-engine.md).",
   [](mem_settings& s, std::string_view v) { s.staging_buffers = static_cast<int>(parse_int(v, 1, 1024)); },
   [](const mem_settings& s) { return std::to_string(s.staging_buffers); }},
};
// clang-format on

}  // namespace

std::span<const setting_row<mem_settings>> mem_settings::table() { return rows; }

}  // namespace ferry
