#pragma once
// Finds devices by name and says which backends work here.
//
// Names: "gpu:N" and "cuda:N" (the same CUDA device), "sim:N". The CUDA driver is loaded the
// first time a CUDA device or the CUDA status is asked for, so CPU-only work never pays for it.
// Default device (FERRY_BACKEND): auto = gpu:0 when a driver and a GPU are present, else sim:0.
#include <ferry/core/export.hpp>
#include <ferry/device/device.hpp>
#include <ferry/device/settings.hpp>

#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace ferry {
namespace detail {
class executor;
}

struct backend_status {
  std::string name;       // "cuda", "sim"
  bool built = false;     // compiled into this build
  bool available = false;
  std::string reason;     // why not available
  int driver_version = 0; // cuda: e.g. 13000
  int device_count = 0;
};

struct peer_info {
  bool access = false;  // a can read/write b's memory directly
  std::string link;     // "nvlink", "pcie", "sim", "-", "unknown"
  int performance_rank = -1;
};

// A device's link to the host as NVML sees it (0 where unknown: no NVML, a sim device). Asked on request
// only: loading and starting NVML costs a process tens of milliseconds, which opening a device does not pay.
struct host_link_info {
  std::uint64_t bar1_total = 0;  // the BAR1 aperture (host-visible device memory)
  int pcie_gen_current = 0, pcie_width_current = 0, pcie_gen_max = 0, pcie_width_max = 0;
  std::string error;             // why unknown, when NVML could not say
};

class FERRY_API device_registry {
 public:
  explicit device_registry(device_settings s);
  ~device_registry();
  device_registry(const device_registry&) = delete;
  device_registry& operator=(const device_registry&) = delete;

  // The device of that name, created on first use. Throws invalid_argument for a malformed name,
  // out_of_range for an index past the last device, unavailable (with the reason) when the
  // backend is missing.
  device& get(std::string_view name);
  // The device that memory of this kind and ordinal belongs to (memory_region::device, ordinal).
  device& get(device_kind kind, int ordinal);
  device& default_device();
  // All CUDA devices (loading the driver), then all sim devices.
  std::vector<device*> all();
  backend_status cuda_status();
  backend_status sim_status() const;
  peer_info peer(device& a, device& b);
  host_link_info host_link(device& d);
  const device_settings& config() const noexcept { return settings_; }
  // The library's worker threads (internal: src/core/executor.hpp), shared by the devices and the
  // engines made on this registry.
  detail::executor& workers() noexcept { return *workers_; }
  // Lets go of every device without ending it: in a process forked from the one that opened them,
  // whose threads and driver state stayed behind (the runtime's end there).
  void abandon() noexcept;

 private:
  device& lookup(device_kind kind, int index, std::string_view name);
  device_settings settings_;
  std::unique_ptr<detail::executor> workers_;  // before the devices: it outlives them (sim copy engines run on it)
  std::mutex mu_;
  std::vector<std::unique_ptr<device>> cuda_;
  std::vector<std::unique_ptr<device>> sim_;
};

}  // namespace ferry
