#pragma once
// The cuda backend: ferry's device interface on the CUDA driver VMM API (cuMemCreate, cuMemMap,
// cuMemSetAccess, ...), streams and events, with the driver loaded at run time (driver.hpp).
#include <ferry/device/device.hpp>
#include <ferry/device/registry.hpp>
#include <ferry/device/settings.hpp>

#include <memory>
#include <string>

namespace ferry::cuda {

struct backend_probe {
  bool available = false;
  std::string reason;  // why not, when unavailable
  int driver_version = 0;
  int device_count = 0;
};
backend_probe probe(const device_settings& s);

std::unique_ptr<device> create_device(int ordinal, const device_settings& s);

struct peer_link {
  bool access = false;   // cuDeviceCanAccessPeer
  std::string link;      // "nvlink", "pcie", "-"
  int performance_rank = -1;
  bool native_atomics = false;
};
peer_link query_peer(const device_settings& s, int a, int b);
// NVML's facts of the device at that PCI bus id (device_registry::host_link).
host_link_info query_host_link(const device_settings& s, const std::string& pci_bus_id);

}  // namespace ferry::cuda
