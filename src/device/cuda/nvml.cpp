#include "device/cuda/nvml.hpp"

#include <dlfcn.h>
#include <fmt/format.h>

#include <fstream>
#include <mutex>

namespace ferry::cuda::nvml {
namespace {

// The stable C ABI of the NVML entry points used here (nvml.h is not part of the CUDA toolkit).
using nvml_return = int;
using nvml_device = struct nvml_device_st*;
struct bar1_memory {
  unsigned long long total, free, used;
};
constexpr int p2p_caps_index_nvlink = 2;  // NVML_P2P_CAPS_INDEX_NVLINK
constexpr int p2p_status_ok = 0;          // NVML_P2P_STATUS_OK

struct api {
  nvml_return (*init)() = nullptr;
  const char* (*error_string)(nvml_return) = nullptr;
  nvml_return (*by_bus_id)(const char*, nvml_device*) = nullptr;
  nvml_return (*bar1)(nvml_device, bar1_memory*) = nullptr;
  nvml_return (*gen_cur)(nvml_device, unsigned*) = nullptr;
  nvml_return (*width_cur)(nvml_device, unsigned*) = nullptr;
  nvml_return (*gen_max)(nvml_device, unsigned*) = nullptr;
  nvml_return (*width_max)(nvml_device, unsigned*) = nullptr;
  nvml_return (*p2p)(nvml_device, nvml_device, int, int*) = nullptr;
  std::string error;
};

const api& load(const std::string& library) {
  static api a;
  static std::once_flag once;
  std::call_once(once, [&] {
    void* h = ::dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = ::dlerror();
      a.error = fmt::format("cannot load {} ({})", library, e ? e : "?");
      return;
    }
    auto sym = [&](auto& fn, const char* name) { fn = reinterpret_cast<std::decay_t<decltype(fn)>>(::dlsym(h, name)); };
    sym(a.init, "nvmlInit_v2");
    sym(a.error_string, "nvmlErrorString");
    sym(a.by_bus_id, "nvmlDeviceGetHandleByPciBusId_v2");
    sym(a.bar1, "nvmlDeviceGetBAR1MemoryInfo");
    sym(a.gen_cur, "nvmlDeviceGetCurrPcieLinkGeneration");
    sym(a.width_cur, "nvmlDeviceGetCurrPcieLinkWidth");
    sym(a.gen_max, "nvmlDeviceGetMaxPcieLinkGeneration");
    sym(a.width_max, "nvmlDeviceGetMaxPcieLinkWidth");
    sym(a.p2p, "nvmlDeviceGetP2PStatus");
    if (!a.init || !a.by_bus_id) {
      a.error = library + " lacks nvmlInit_v2/nvmlDeviceGetHandleByPciBusId_v2";
      a.init = nullptr;
      return;
    }
    if (nvml_return r = a.init(); r != 0) {
      a.error = fmt::format("nvmlInit failed: {} ({})", a.error_string ? a.error_string(r) : "?", r);
      a.init = nullptr;
    }
  });
  return a;
}

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// sysfs fallback for the PCIe link ("32.0 GT/s PCIe" -> gen 5).
int gen_from_speed(const std::string& s) {
  double gts = std::atof(s.c_str());
  if (gts >= 63) return 6;
  if (gts >= 31) return 5;
  if (gts >= 15) return 4;
  if (gts >= 7.9) return 3;
  if (gts >= 4.9) return 2;
  return gts > 0 ? 1 : 0;
}

std::string read_line(const std::string& path) {
  std::ifstream f(path);
  std::string l;
  std::getline(f, l);
  return l;
}

void sysfs_fallback(host_link_info& f, const std::string& bus) {
  std::string dir = "/sys/bus/pci/devices/" + lower(bus);
  if (!f.pcie_gen_current) f.pcie_gen_current = gen_from_speed(read_line(dir + "/current_link_speed"));
  if (!f.pcie_gen_max) f.pcie_gen_max = gen_from_speed(read_line(dir + "/max_link_speed"));
  if (!f.pcie_width_current) f.pcie_width_current = std::atoi(read_line(dir + "/current_link_width").c_str());
  if (!f.pcie_width_max) f.pcie_width_max = std::atoi(read_line(dir + "/max_link_width").c_str());
  if (!f.bar1_total) {
    // Line i of `resource` is BAR i: "start end flags". NVIDIA's BAR1 is resource line 1.
    std::ifstream r(dir + "/resource");
    unsigned long long start = 0, end = 0, flags = 0;
    for (int i = 0; i <= 1 && (r >> std::hex >> start >> end >> flags); ++i)
      if (i == 1 && end > start) f.bar1_total = end - start + 1;
  }
}

}  // namespace

host_link_info query(const std::string& library, const std::string& bus) {
  host_link_info f;
  const api& a = load(library);
  nvml_device d = nullptr;
  if (!a.init) {
    f.error = a.error;
  } else if (nvml_return r = a.by_bus_id(bus.c_str(), &d); r != 0) {
    f.error = fmt::format("nvmlDeviceGetHandleByPciBusId({}) failed: {}", bus, a.error_string ? a.error_string(r) : "?");
  } else {
    unsigned v = 0;
    bar1_memory b{};
    if (a.bar1 && a.bar1(d, &b) == 0) f.bar1_total = b.total;
    if (a.gen_cur && a.gen_cur(d, &v) == 0) f.pcie_gen_current = static_cast<int>(v);
    if (a.width_cur && a.width_cur(d, &v) == 0) f.pcie_width_current = static_cast<int>(v);
    if (a.gen_max && a.gen_max(d, &v) == 0) f.pcie_gen_max = static_cast<int>(v);
    if (a.width_max && a.width_max(d, &v) == 0) f.pcie_width_max = static_cast<int>(v);
  }
  sysfs_fallback(f, bus);
  return f;
}

p2p_facts query_p2p(const std::string& library, const std::string& bus_a, const std::string& bus_b) {
  p2p_facts p;
  const api& a = load(library);
  nvml_device da = nullptr, db = nullptr;
  if (!a.init) {
    p.error = a.error;
    return p;
  }
  if (a.by_bus_id(bus_a.c_str(), &da) != 0 || a.by_bus_id(bus_b.c_str(), &db) != 0 || !a.p2p) {
    p.error = "NVML cannot find the devices";
    return p;
  }
  int status = -1;
  if (nvml_return r = a.p2p(da, db, p2p_caps_index_nvlink, &status); r != 0) {
    p.error = fmt::format("nvmlDeviceGetP2PStatus failed: {}", a.error_string ? a.error_string(r) : "?");
    return p;
  }
  p.known = true;
  p.nvlink = status == p2p_status_ok;
  return p;
}

}  // namespace ferry::cuda::nvml
