#pragma once
// A few facts only NVML knows (BAR1 size, PCIe link, NVLink), loaded at run time from the library
// named by FERRY_NVML_LIBRARY. Optional: without NVML these fields read "unknown", or come from sysfs.
#include <string>

namespace ferry::cuda::nvml {

struct gpu_facts {
  bool known = false;
  unsigned long long bar1_total = 0;
  int pcie_gen_current = 0, pcie_width_current = 0, pcie_gen_max = 0, pcie_width_max = 0;
  int nvlinks_active = 0;
  std::string error;  // why facts are missing
};

// Facts for the GPU at a PCI bus id ("0000:18:00.0").
gpu_facts query(const std::string& library, const std::string& pci_bus_id);

struct p2p_facts {
  bool known = false;
  bool nvlink = false;  // NVML reports P2P over NVLink as OK
  std::string error;
};
p2p_facts query_p2p(const std::string& library, const std::string& bus_a, const std::string& bus_b);

}  // namespace ferry::cuda::nvml
