#pragma once
// A few facts only NVML knows (BAR1 size, PCIe link, NVLink peers), loaded at run time from the library
// named by FERRY_NVML_LIBRARY. Optional: without NVML these fields read "unknown", or come from sysfs.
#include <ferry/device/registry.hpp>

#include <string>

namespace ferry::cuda::nvml {

// Facts for the GPU at a PCI bus id ("0000:18:00.0"); what NVML cannot say comes from sysfs.
host_link_info query(const std::string& library, const std::string& pci_bus_id);

struct p2p_facts {
  bool known = false;
  bool nvlink = false;  // NVML reports P2P over NVLink as OK
  std::string error;
};
p2p_facts query_p2p(const std::string& library, const std::string& bus_a, const std::string& bus_b);

}  // namespace ferry::cuda::nvml
