#include <ferry/device/registry.hpp>

#include "core/executor.hpp"
#include "core/logging.hpp"
#include "device/sim/sim_device.hpp"
#ifdef FERRY_HAVE_CUDA
#include "device/cuda/cuda_device.hpp"
#endif

#include <fmt/format.h>

#include <charconv>
#include <chrono>

namespace ferry {

device_registry::device_registry(device_settings s)
    : settings_(std::move(s)), workers_(std::make_unique<detail::executor>()) {
  sim_.resize(static_cast<std::size_t>(settings_.sim_devices));
}

// Streams and ranges held by callers must be gone before this; devices go in reverse order.
device_registry::~device_registry() = default;

void device_registry::abandon() noexcept {
  for (auto* v : {&cuda_, &sim_})
    for (auto& d : *v) (void)d.release();
  (void)workers_.release();  // its threads stayed behind too
}

backend_status device_registry::cuda_status() {
  backend_status b;
  b.name = "cuda";
#ifdef FERRY_HAVE_CUDA
  b.built = true;
  auto p = cuda::probe(settings_);
  b.available = p.available;
  b.reason = p.reason;
  b.driver_version = p.driver_version;
  b.device_count = p.device_count;
#else
  b.reason = "this build of ferry has no CUDA support (nvcc was not found when it was built)";
#endif
  return b;
}

backend_status device_registry::sim_status() const {
  backend_status b{"sim", true, settings_.sim_devices > 0, "", 0, settings_.sim_devices};
  if (!b.available) b.reason = "FERRY_SIM_DEVICES=0";
  return b;
}

device& device_registry::get(std::string_view name) {
  auto colon = name.find(':');
  std::string_view kind = name.substr(0, colon);
  int index = -1;
  if (colon != std::string_view::npos) {
    auto num = name.substr(colon + 1);
    auto [p, ec] = std::from_chars(num.data(), num.data() + num.size(), index);
    if (ec != std::errc() || p != num.data() + num.size() || num.empty()) index = -1;
  }
  if (index < 0 || (kind != "gpu" && kind != "cuda" && kind != "sim"))
    fail(errc::invalid_argument, "device.lookup", fmt::format("'{}'", name),
         "expected a device name like gpu:0, cuda:0 or sim:0");
  return lookup(kind == "sim" ? device_kind::sim : device_kind::cuda, index, name);
}

device& device_registry::get(device_kind kind, int index) { return lookup(kind, index, {}); }

// `name`: what the caller asked for, for errors (a user's "gpu:7"); empty: kind:index.
device& device_registry::lookup(device_kind kind, int index, std::string_view name) {
  auto res = [&] { return name.empty() ? fmt::format("{}:{}", to_string(kind), index) : std::string(name); };
  if (kind == device_kind::none || index < 0)
    fail(errc::invalid_argument, "device.lookup", res(), "host memory or a negative ordinal names no device");
  std::lock_guard l(mu_);
  if (kind == device_kind::sim) {
    if (static_cast<std::size_t>(index) >= sim_.size())
      fail(errc::out_of_range, "device.lookup", res(),
           fmt::format("there are {} sim devices (FERRY_SIM_DEVICES)", sim_.size()));
    auto& d = sim_[static_cast<std::size_t>(index)];
    if (!d) d = sim::create_device(index, settings_, *workers_);
    return *d;
  }
#ifdef FERRY_HAVE_CUDA
  if (static_cast<std::size_t>(index) < cuda_.size() && cuda_[static_cast<std::size_t>(index)]) return *cuda_[static_cast<std::size_t>(index)];
#endif
  backend_status st = cuda_status();
  if (!st.available) fail(errc::unavailable, "device.lookup", res(), "CUDA unavailable: " + st.reason);
  if (index >= st.device_count)
    fail(errc::out_of_range, "device.lookup", res(),
         fmt::format("this machine has {} CUDA device(s)", st.device_count));
#ifdef FERRY_HAVE_CUDA
  if (cuda_.empty()) cuda_.resize(static_cast<std::size_t>(st.device_count));
  auto& d = cuda_[static_cast<std::size_t>(index)];
  if (!d) {
    const auto t0 = std::chrono::steady_clock::now();
    d = cuda::create_device(index, settings_);
    log::debug("device", "{} opened in {} us", d->id(),
               std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count());
  }
  return *d;
#else
  fail(errc::internal, "device.lookup", res(), "unreachable");
#endif
}

device& device_registry::default_device() {
  switch (settings_.backend) {
    case backend_choice::cuda: return get("cuda:0");
    case backend_choice::sim: return get("sim:0");
    case backend_choice::automatic: break;
  }
  return cuda_status().available ? get("cuda:0") : get("sim:0");
}

std::vector<device*> device_registry::all() {
  std::vector<device*> out;
  backend_status st = cuda_status();
  if (st.available)
    for (int i = 0; i < st.device_count; ++i) out.push_back(&get(fmt::format("cuda:{}", i)));
  for (int i = 0; i < settings_.sim_devices; ++i) out.push_back(&get(fmt::format("sim:{}", i)));
  return out;
}

host_link_info device_registry::host_link(device& d) {
  host_link_info l;
#ifdef FERRY_HAVE_CUDA
  if (d.info().backend == device_kind::cuda) l = cuda::query_host_link(settings_, d.info().pci_bus_id);
#else
  (void)d;
#endif
  return l;
}

peer_info device_registry::peer(device& a, device& b) {
  peer_info p;
  if (&a == &b) return {true, "self", 0};
  if (a.info().backend != b.info().backend) return {false, "-", -1};
  if (a.info().backend == device_kind::sim) return {settings_.sim_peer, settings_.sim_peer ? "sim" : "-", 0};
#ifdef FERRY_HAVE_CUDA
  auto l = cuda::query_peer(settings_, a.info().ordinal, b.info().ordinal);
  p.access = l.access;
  p.link = l.link;
  p.performance_rank = l.performance_rank;
#endif
  return p;
}

}  // namespace ferry
