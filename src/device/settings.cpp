// device's settings table: a row per field of device_settings (ferry/device/settings.hpp).
#include <ferry/device/settings.hpp>

#include "core/settings_table.hpp"

namespace ferry {

namespace {

constexpr std::pair<std::string_view, backend_choice> backends[] = {
    {"auto", backend_choice::automatic}, {"cuda", backend_choice::cuda}, {"sim", backend_choice::sim}};

// clang-format off
constexpr setting_row<device_settings> rows[] = {
  {"FERRY_BACKEND", "Default device: auto (first CUDA GPU if a driver and GPU are present, else sim:0) | cuda | sim.",
   [](device_settings& s, std::string_view v) { s.backend = parse_enum(v, backends); },
   [](const device_settings& s) { return std::string(to_string(s.backend)); }},
  {"FERRY_CUDA_DRIVER", "CUDA driver library loaded at run time (dlopen); ferry never links against it.",
   [](device_settings& s, std::string_view v) { s.cuda_driver = nonempty(v); },
   [](const device_settings& s) { return s.cuda_driver; }},
  {"FERRY_NVML_LIBRARY", "NVML library loaded at run time for PCIe/BAR1/NVLink facts (optional).",
   [](device_settings& s, std::string_view v) { s.nvml_library = nonempty(v); },
   [](const device_settings& s) { return s.nvml_library; }},
  {"FERRY_SIM_DEVICES", "Number of simulated devices (sim:0 .. sim:N-1), 0..64.",
   [](device_settings& s, std::string_view v) { s.sim_devices = static_cast<int>(parse_int(v, 0, 64)); },
   [](const device_settings& s) { return std::to_string(s.sim_devices); }},
  {"FERRY_SIM_CAPACITY", "Memory capacity of each simulated device (allocations beyond it fail with out_of_memory).",
   [](device_settings& s, std::string_view v) { s.sim_capacity = parse_size_in(v, 64 * KiB, 1ull << 40); },
   [](const device_settings& s) { return format_size(s.sim_capacity); }},
  {"FERRY_SIM_GRANULARITY", "Physical chunk granularity of simulated devices (power of two, >= page size; CUDA uses 2MiB).",
   [](device_settings& s, std::string_view v) { s.sim_granularity = parse_size_in(v, 4 * KiB, 1 * GiB, true); },
   [](const device_settings& s) { return format_size(s.sim_granularity); }},
  {"FERRY_SIM_COPY_ENGINES", "Copy engines of each simulated device (tasks on the library's executor at once), 1..64.",
   [](device_settings& s, std::string_view v) { s.sim_copy_engines = static_cast<int>(parse_int(v, 1, 64)); },
   [](const device_settings& s) { return std::to_string(s.sim_copy_engines); }},
  {"FERRY_SIM_COPY_GBPS", "Throttle of each simulated copy engine in GB/s (0 = unthrottled); models slow links in tests.",
   [](device_settings& s, std::string_view v) { s.sim_copy_gbps = parse_double(v, 0, 1e6); },
   [](const device_settings& s) { return show_double(s.sim_copy_gbps); }},
  {"FERRY_SIM_PEER", "Whether simulated devices have peer access to each other (0 tests the staged GPU<->GPU path).",
   [](device_settings& s, std::string_view v) { s.sim_peer = parse_bool(v); },
   [](const device_settings& s) { return std::string(s.sim_peer ? "1" : "0"); }},
  {"FERRY_CUPTI_LIBRARY", "CUPTI library loaded at run time (dlopen) for kernel-launch callbacks (unified memory returns pages to the device before launches); without it those features are off. Tried as given, then under /usr/local/cuda.",
   [](device_settings& s, std::string_view v) { s.cupti_library = nonempty(v); },
   [](const device_settings& s) { return s.cupti_library; }},
};
// clang-format on

}  // namespace

std::span<const setting_row<device_settings>> device_settings::table() { return rows; }

std::string_view to_string(backend_choice b) noexcept {
  switch (b) {
    case backend_choice::automatic: return "auto";
    case backend_choice::cuda: return "cuda";
    case backend_choice::sim: return "sim";
  }
  return "?";
}

}  // namespace ferry
