#include <ferry/net/probe.hpp>

#include <fmt/format.h>
#include <ucp/api/ucp.h>
#include <uct/api/uct.h>

#include <set>

namespace ferry {

capability probe_ucx() {
  capability c;
  c.name = "ucx";
  c.add("version", ucp_get_version_string());

  // Transports: every (transport, device) pair each memory domain offers.
  std::set<std::string> tls;
  uct_component_h* comps = nullptr;
  unsigned ncomps = 0;
  if (uct_query_components(&comps, &ncomps) == UCS_OK) {
    for (unsigned i = 0; i < ncomps; ++i) {
      uct_component_attr_t attr{};
      attr.field_mask = UCT_COMPONENT_ATTR_FIELD_NAME | UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT;
      if (uct_component_query(comps[i], &attr) != UCS_OK) continue;
      std::vector<uct_md_resource_desc_t> mds(attr.md_resource_count);
      attr.field_mask = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES;
      attr.md_resources = mds.data();
      if (uct_component_query(comps[i], &attr) != UCS_OK) continue;
      for (auto& md_res : mds) {
        uct_md_config_t* cfg = nullptr;
        if (uct_md_config_read(comps[i], nullptr, nullptr, &cfg) != UCS_OK) continue;
        uct_md_h md = nullptr;
        ucs_status_t st = uct_md_open(comps[i], md_res.md_name, cfg, &md);
        uct_config_release(cfg);
        if (st != UCS_OK) continue;
        uct_tl_resource_desc_t* res = nullptr;
        unsigned n = 0;
        if (uct_md_query_tl_resources(md, &res, &n) == UCS_OK) {
          for (unsigned k = 0; k < n; ++k) tls.insert(fmt::format("{}/{}", res[k].tl_name, res[k].dev_name));
          uct_release_tl_resource_list(res);
        }
        uct_md_close(md);
      }
    }
    uct_release_component_list(comps);
  }
  std::string list;
  for (auto& t : tls) list += (list.empty() ? "" : " ") + t;
  c.add("transports", list.empty() ? "none" : list);

  // Memory types a UCP context accepts directly.
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_RMA | UCP_FEATURE_TAG;
  ucp_config_t* config = nullptr;
  ucp_context_h ctx = nullptr;
  if (ucp_config_read(nullptr, nullptr, &config) == UCS_OK) {
    ucs_status_t st = ucp_init(&params, config, &ctx);
    ucp_config_release(config);
    if (st == UCS_OK) {
      ucp_context_attr_t a{};
      a.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
      if (ucp_context_query(ctx, &a) == UCS_OK) {
        std::string mt;
        for (int t = 0; t < UCS_MEMORY_TYPE_LAST; ++t)
          if (a.memory_types & (1ull << t)) mt += (mt.empty() ? "" : " ") + std::string(ucs_memory_type_names[t]);
        c.add("memory_types", mt);
        c.add("gpu_direct", (a.memory_types & (1ull << UCS_MEMORY_TYPE_CUDA)) ? "yes (cuda memory registrable)"
                                                                              : "no (host staging for GPU buffers)");
      }
      ucp_cleanup(ctx);
      c.available = true;
    } else {
      c.reason = fmt::format("ucp_init failed: {}", ucs_status_string(st));
    }
  } else {
    c.reason = "ucp_config_read failed";
  }
  return c;
}

}  // namespace ferry
