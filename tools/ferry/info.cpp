// `ferry info`: what this machine offers ferry, as a table or JSON. Exit code 0 whenever the
// report could be made, including on machines with no GPU: missing features are reported, with why.
#include "commands.hpp"

#include <ferry/core/units.hpp>
#include <ferry/io/file_engine.hpp>
#include <ferry/io/probe.hpp>
#include <ferry/mem/topology.hpp>
#include <ferry/net/probe.hpp>
#include <ferry/vm/probe.hpp>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <iostream>

namespace ferry::cli {
namespace {

using json = nlohmann::ordered_json;

json to_json(const capability& c) {
  json j{{"available", c.available}};
  if (!c.reason.empty()) j["reason"] = c.reason;
  for (auto& [k, v] : c.facts) j[k] = v;
  return j;
}

std::string pcie(int gen, int width) { return gen ? fmt::format("Gen{} x{}", gen, width) : "unknown"; }

json collect(runtime& rt, const info_options& o) {
  json j;
  j["ferry"] = {{"version", version()}, {"cuda_built", built_with_cuda()}};
  backend_status cs = rt.devices().cuda_status();
  json cuda{{"built", cs.built}, {"available", cs.available}};
  if (cs.available)
    cuda["driver_version"] = fmt::format("{}.{}", cs.driver_version / 1000, cs.driver_version % 1000 / 10);
  else
    cuda["reason"] = cs.reason;
  j["cuda"] = cuda;

  json gpus = json::array();
  std::vector<device*> cuda_devs;
  if (cs.available) {
    for (int i = 0; i < cs.device_count; ++i) {
      json g;
      try {
        device& d = rt.devices().get(fmt::format("cuda:{}", i));
        cuda_devs.push_back(&d);
        const device_info& in = d.info();
        const host_link_info hl = rt.devices().host_link(d);
        memory_usage m = d.memory();
        g = {{"id", d.id()},
             {"name", in.name},
             {"uuid", in.uuid},
             {"pci_bus_id", in.pci_bus_id},
             {"memory_total", in.total_memory},
             {"memory_free", m.free},
             {"bar1_total", hl.bar1_total},
             {"pcie_current", pcie(hl.pcie_gen_current, hl.pcie_width_current)},
             {"pcie_max", pcie(hl.pcie_gen_max, hl.pcie_width_max)},
             {"numa_node", in.numa_node},
             {"compute_capability", fmt::format("{}.{}", in.cc_major, in.cc_minor)},
             {"copy_engines", in.copy_engines},
             {"vmm_granularity", in.granularity}};
      } catch (const error& e) {
        g = {{"id", fmt::format("cuda:{}", i)}, {"error", e.what()}};
      }
      gpus.push_back(g);
    }
  }
  j["gpus"] = gpus;

  json peers = json::array();
  for (device* a : cuda_devs)
    for (device* b : cuda_devs) {
      if (a == b) continue;
      try {
        peer_info p = rt.devices().peer(*a, *b);
        peers.push_back({{"from", a->id()}, {"to", b->id()}, {"access", p.access}, {"link", p.link},
                         {"performance_rank", p.performance_rank}});
      } catch (const error& e) {
        peers.push_back({{"from", a->id()}, {"to", b->id()}, {"error", e.what()}});
      }
    }
  j["peers"] = peers;

  host_topology t = probe_host_topology();
  json numa = json::array();
  for (auto& n : t.numa_nodes) numa.push_back({{"node", n.os_index}, {"memory", n.memory}, {"cpus", n.cpus}});
  j["host"] = {{"hwloc", t.hwloc_version}, {"packages", t.packages}, {"cores", t.cores}, {"pus", t.pus}, {"numa", numa}};
  if (!t.error.empty()) j["host"]["error"] = t.error;

  j["ucx"] = to_json(probe_ucx());
  j["io_uring"] = to_json(probe_io_uring());
  j["cufile"] = to_json(probe_cufile(rt.config(), cs.available, o.path));
  if (!o.path.empty()) {
    file_backend_choice fb = rt.files().backend_for(o.path);
    j["file_backend"] = {{"path", o.path}, {"backend", fb.backend}, {"direct", fb.direct}, {"align", fb.align},
                         {"reason", fb.reason}};
  }
  j["userfaultfd"] = to_json(probe_userfaultfd());
  backend_status ss = rt.devices().sim_status();
  j["sim"] = {{"devices", ss.device_count},
              {"capacity", rt.config().sim_capacity},
              {"granularity", rt.config().sim_granularity},
              {"copy_engines", rt.config().sim_copy_engines}};
  if (o.settings) {
    json s = json::array();
    for (auto& r : rt.config().describe())
      s.push_back({{"name", r.name}, {"value", r.value}, {"default", r.default_value}, {"doc", r.doc}});
    j["settings"] = s;
  }
  return j;
}

void print_capability(const char* title, const json& c) {
  fmt::print("{:<12} {}", title, c["available"].get<bool>() ? "available" : "unavailable");
  if (c.contains("reason")) fmt::print(" — {}", c["reason"].get<std::string>());
  fmt::print("\n");
  for (auto& [k, v] : c.items())
    if (k != "available" && k != "reason") fmt::print("{:<12}   {}: {}\n", "", k, v.get<std::string>());
}

void print_human(const json& j) {
  fmt::print("ferry {} (CUDA support {})\n\n", j["ferry"]["version"].get<std::string>(),
             j["ferry"]["cuda_built"].get<bool>() ? "built in" : "not built");
  const json& c = j["cuda"];
  if (c["available"].get<bool>())
    fmt::print("CUDA         driver {} loaded, {} GPU(s)\n", c["driver_version"].get<std::string>(), j["gpus"].size());
  else
    fmt::print("CUDA         unavailable — {}\n", c["reason"].get<std::string>());

  if (!j["gpus"].empty()) {
    fmt::print("\nGPUs\n  {:<7} {:<24} {:>22} {:>10} {:>10} {:>10} {:>5} {:>4} {:>4}  {}\n", "id", "name", "memory free/total",
               "BAR1", "PCIe now", "PCIe max", "NUMA", "CC", "CEs", "bus");
    for (auto& g : j["gpus"]) {
      if (g.contains("error")) {
        fmt::print("  {:<7} error: {}\n", g["id"].get<std::string>(), g["error"].get<std::string>());
        continue;
      }
      fmt::print("  {:<7} {:<24} {:>22} {:>10} {:>10} {:>10} {:>5} {:>4} {:>4}  {}\n", g["id"].get<std::string>(),
                 g["name"].get<std::string>(),
                 format_size(g["memory_free"].get<std::uint64_t>()) + " / " +
                     format_size(g["memory_total"].get<std::uint64_t>()),
                 g["bar1_total"].get<std::uint64_t>() ? format_size(g["bar1_total"].get<std::uint64_t>()) : "unknown",
                 g["pcie_current"].get<std::string>(), g["pcie_max"].get<std::string>(), g["numa_node"].get<int>(),
                 g["compute_capability"].get<std::string>(), g["copy_engines"].get<int>(),
                 g["pci_bus_id"].get<std::string>());
    }
  }
  if (!j["peers"].empty()) {
    fmt::print("\nGPU peers (from -> to: access, link)\n");
    for (auto& p : j["peers"]) {
      if (p.contains("error"))
        fmt::print("  {} -> {}: error: {}\n", p["from"].get<std::string>(), p["to"].get<std::string>(),
                   p["error"].get<std::string>());
      else
        fmt::print("  {} -> {}: {}, {}\n", p["from"].get<std::string>(), p["to"].get<std::string>(),
                   p["access"].get<bool>() ? "peer access" : "no peer access", p["link"].get<std::string>());
    }
  }
  const json& h = j["host"];
  fmt::print("\nHost         hwloc {}: {} package(s), {} cores, {} PUs\n", h["hwloc"].get<std::string>(),
             h["packages"].get<int>(), h["cores"].get<int>(), h["pus"].get<int>());
  for (auto& n : h["numa"])
    fmt::print("               NUMA node {}: {}, cpus {}\n", n["node"].get<int>(), format_size(n["memory"].get<std::uint64_t>()),
               n["cpus"].get<std::string>());
  fmt::print("\n");
  print_capability("UCX", j["ucx"]);
  print_capability("io_uring", j["io_uring"]);
  print_capability("cuFile", j["cufile"]);
  print_capability("userfaultfd", j["userfaultfd"]);
  if (j.contains("file_backend")) {
    const json& fb = j["file_backend"];
    fmt::print("files        {} -> {}: {}\n", fb["path"].get<std::string>(), fb["backend"].get<std::string>(),
               fb["reason"].get<std::string>());
  }
  const json& s = j["sim"];
  fmt::print("sim          {} device(s) of {}, granularity {}, {} copy engine(s) each (tests only; not for speed)\n",
             s["devices"].get<int>(), format_size(s["capacity"].get<std::uint64_t>()),
             format_size(s["granularity"].get<std::uint64_t>()), s["copy_engines"].get<int>());
  if (j.contains("settings")) {
    fmt::print("\nSettings (environment variables; FERRY_CONFIG names an optional file of NAME = value lines)\n");
    for (auto& r : j["settings"])
      fmt::print("  {:<24} = {:<16} (default {})\n      {}\n", r["name"].get<std::string>(), r["value"].get<std::string>(),
                 r["default"].get<std::string>(), r["doc"].get<std::string>());
  }
}

}  // namespace

int run_info(runtime& rt, const info_options& o) {
  json j = collect(rt, o);
  if (o.json) std::cout << j.dump(2) << "\n";
  else print_human(j);
  return 0;
}

}  // namespace ferry::cli
