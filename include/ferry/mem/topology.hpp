#pragma once
// Host topology (hwloc): sockets, cores, NUMA nodes and their memory. Used by `ferry info` now and
// by NUMA-aware pinned pools later.
#include <ferry/core/capability.hpp>
#include <ferry/core/export.hpp>

#include <cstdint>
#include <vector>

namespace ferry {

struct numa_node_info {
  int os_index = -1;
  std::uint64_t memory = 0;
  std::string cpus;  // cpuset list, "0-15"
};

struct host_topology {
  std::string hwloc_version;
  int packages = 0, cores = 0, pus = 0;
  std::vector<numa_node_info> numa_nodes;
  std::string error;  // set when hwloc failed
};

FERRY_API host_topology probe_host_topology();

}  // namespace ferry
