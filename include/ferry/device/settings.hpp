#pragma once
// device's tunables: which backend is the default, the libraries the cuda backend loads and the sim
// devices' model (rows in src/device/settings.cpp; ferry/settings.hpp gathers every layer's).
#include <ferry/core/export.hpp>
#include <ferry/core/settings.hpp>

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace ferry {

// Which device backend a runtime prefers for its default device.
// automatic: the first CUDA GPU when a driver and a GPU are present, else sim:0.
enum class backend_choice { automatic, cuda, sim };
FERRY_API std::string_view to_string(backend_choice b) noexcept;

// With core's (FERRY_DEADLINE: a device's default wait).
struct FERRY_API device_settings : virtual core_settings {
  backend_choice backend = backend_choice::automatic;
  std::string cuda_driver = "libcuda.so.1";
  std::string nvml_library = "libnvidia-ml.so.1";
  std::string cupti_library = "libcupti.so.13";
  int sim_devices = 2;
  std::uint64_t sim_capacity = 1ull << 30;
  std::uint64_t sim_granularity = 2ull << 20;
  int sim_copy_engines = 2;
  double sim_copy_gbps = 0;  // 0: as fast as memcpy
  bool sim_peer = true;

  static std::span<const setting_row<device_settings>> table();
};

}  // namespace ferry
