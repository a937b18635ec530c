// gpu's settings table: a row per field of gpu_settings (ferry/gpu/settings.hpp).
#include <ferry/gpu/settings.hpp>

#include "core/settings_table.hpp"

namespace ferry {

namespace {

// clang-format off
constexpr setting_row<gpu_settings> rows[] = {
  {"FERRY_GPU_RING_SLOTS", "Request slots of a GPU request ring (kernels' requests to ferry's host proxy): a power of two. A full ring makes requesters wait (up to their deadline) until the proxy has taken requests out.",
   [](gpu_settings& s, std::string_view v) {
     auto n = parse_int(v, 2, 1 << 20);
     if (n & (n - 1)) throw bad_setting{"not a power of two"};
     s.gpu_ring_slots = static_cast<std::uint32_t>(n);
   },
   [](const gpu_settings& s) { return std::to_string(s.gpu_ring_slots); }},
  {"FERRY_GPU_PROXY_BATCH", "The most requests a GPU proxy takes from its ring at once and hands to the file engine as one batch (one submission, one completion). Larger batches cost less per request; a request's answer waits for the whole batch.",
   [](gpu_settings& s, std::string_view v) { s.gpu_proxy_batch = static_cast<std::uint32_t>(parse_int(v, 1, 1 << 16)); },
   [](const gpu_settings& s) { return std::to_string(s.gpu_proxy_batch); }},
  {"FERRY_GPU_PROXY_RINGS", "Request rings of a GPU proxy, a power of two from 1 to 256, each with FERRY_GPU_RING_SLOTS slots and a host thread of its own that takes its requests and hands them to the file engine: more rings serve more requests at once, each thread polls its ring while requests come (and naps when none do).",
   [](gpu_settings& s, std::string_view v) {
     auto n = parse_int(v, 1, 256);
     if (n & (n - 1)) throw bad_setting{"not a power of two"};
     s.gpu_proxy_rings = static_cast<std::uint32_t>(n);
   },
   [](const gpu_settings& s) { return std::to_string(s.gpu_proxy_rings); }},
  {"FERRY_GPU_CACHE_BYTES", "Device memory a GPU page cache (gpu::cache) keeps pages of mapped files in, for kernels that read and write them element by element.",
   [](gpu_settings& s, std::string_view v) { s.gpu_cache_bytes = parse_size_in(v, 4 * KiB, 1ull << 40); },
   [](const gpu_settings& s) { return format_size(s.gpu_cache_bytes); }},
  {"FERRY_GPU_CACHE_LANDING", "Pinned host memory a GPU page cache's pages pass through between its proxy and device memory (one page per request under way; more lets more misses be served at once).",
   [](gpu_settings& s, std::string_view v) { s.gpu_cache_landing = parse_size_in(v, 4 * KiB, 1ull << 40); },
   [](const gpu_settings& s) { return format_size(s.gpu_cache_landing); }},
  {"FERRY_GPU_CACHE_PAGE", "A GPU page cache's page: what one miss reads from the source (and one write-back writes). Small pages waste less on scattered accesses; large ones need fewer requests for dense ones. A power of two from 4 KiB to 2 MiB.",
   [](gpu_settings& s, std::string_view v) { s.gpu_cache_page = static_cast<std::uint32_t>(parse_size_in(v, 4 * KiB, 2 * MiB, true)); },
   [](const gpu_settings& s) { return format_size(s.gpu_cache_page); }},
};
// clang-format on

}  // namespace

std::span<const setting_row<gpu_settings>> gpu_settings::table() { return rows; }

}  // namespace ferry
