// xfer's settings table: a row per field of xfer_settings (ferry/xfer/settings.hpp).
#include <ferry/xfer/settings.hpp>

#include "core/settings_table.hpp"

#include <algorithm>
#include <thread>

namespace ferry {

namespace {

constexpr std::pair<std::string_view, pageable_policy> pageable_policies[] = {
    {"auto", pageable_policy::automatic}, {"register", pageable_policy::always_register}, {"bounce", pageable_policy::always_bounce}};

// clang-format off
constexpr setting_row<xfer_settings> rows[] = {
  {"FERRY_XFER_THREADS", "Most transfer engine tasks at once on the library's executor (each runs queued copies on its worker's own streams, bounce copies too), 0..256; 0 = half the cores, 2..16. One starts when an item is queued and a slot is free, and ends when the queue is empty.",
   [](xfer_settings& s, std::string_view v) { s.xfer_threads = static_cast<int>(parse_int(v, 0, 256)); },
   [](const xfer_settings& s) { return std::to_string(s.xfer_threads); }},
  {"FERRY_XFER_SPLIT", "Split copy-engine requests (direct, peer, registered) into pieces of this size on several streams; 0 = never (one stream already saturates a link direction).",
   [](xfer_settings& s, std::string_view v) { s.xfer_split = parse_size_in(v, 0, 1ull << 50); },
   [](const xfer_settings& s) { return format_size(s.xfer_split); }},
  {"FERRY_XFER_CHUNK", "Piece size of staged, bounce and host-to-host copies spread over the workers; also the least a work item of grouped small requests holds (a batch of many is grouped into two items per worker when those are larger).",
   [](xfer_settings& s, std::string_view v) { s.xfer_chunk = parse_size_in(v, 64 * KiB, 4 * GiB); },
   [](const xfer_settings& s) { return format_size(s.xfer_chunk); }},
  {"FERRY_XFER_BATCH_SMALL", "Requests up to this size, of one device and direction, are grouped into work items of FERRY_XFER_CHUNK or half the batch's share per worker, whichever is larger (one enqueue and one synchronization each).",
   [](xfer_settings& s, std::string_view v) { s.xfer_batch_small = parse_size_in(v, 0, 1 * GiB); },
   [](const xfer_settings& s) { return format_size(s.xfer_batch_small); }},
  {"FERRY_XFER_PAGEABLE", "Pageable host memory: auto (bounce the first time, register a range copied again) | register | bounce.",
   [](xfer_settings& s, std::string_view v) { s.xfer_pageable = parse_enum(v, pageable_policies); },
   [](const xfer_settings& s) { return std::string(to_string(s.xfer_pageable)); }},
  {"FERRY_XFER_PEER", "Use direct GPU<->GPU (peer) copies where the GPUs allow it; 0 stages them through host memory.",
   [](xfer_settings& s, std::string_view v) { s.xfer_peer = parse_bool(v); },
   [](const xfer_settings& s) { return std::string(s.xfer_peer ? "1" : "0"); }},
};
// clang-format on

}  // namespace

std::span<const setting_row<xfer_settings>> xfer_settings::table() { return rows; }

std::string_view to_string(pageable_policy v) noexcept { return enum_name(v, pageable_policies); }

int default_xfer_threads() noexcept {
  // Staged copies are bound by CPU memcpy: half the cores, between 2 and 16.
  unsigned n = std::thread::hardware_concurrency();
  return static_cast<int>(std::clamp(n / 2, 2u, 16u));
}

}  // namespace ferry
