#include <ferry/mem/topology.hpp>

#include <hwloc.h>

#include <cstdlib>

namespace ferry {

host_topology probe_host_topology() {
  host_topology t;
  unsigned v = hwloc_get_api_version();
  t.hwloc_version = std::to_string(v >> 16) + "." + std::to_string((v >> 8) & 0xff) + "." + std::to_string(v & 0xff);
  hwloc_topology_t topo;
  if (hwloc_topology_init(&topo) != 0 || hwloc_topology_load(topo) != 0) {
    t.error = "hwloc could not load the topology";
    return t;
  }
  t.packages = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_PACKAGE);
  t.cores = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE);
  t.pus = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_PU);
  int n = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE);
  for (int i = 0; i < n; ++i) {
    hwloc_obj_t o = hwloc_get_obj_by_type(topo, HWLOC_OBJ_NUMANODE, static_cast<unsigned>(i));
    numa_node_info ni;
    ni.os_index = static_cast<int>(o->os_index);
    ni.memory = o->attr ? o->attr->numanode.local_memory : 0;
    char* s = nullptr;
    if (o->cpuset && hwloc_bitmap_list_asprintf(&s, o->cpuset) >= 0 && s) {
      ni.cpus = s;
      std::free(s);
    }
    t.numa_nodes.push_back(std::move(ni));
  }
  hwloc_topology_destroy(topo);
  return t;
}

}  // namespace ferry
