// The layers' settings tables gathered into one snapshot, in layer order (ferry/settings.hpp).
#include <ferry/settings.hpp>

#include "core/settings_table.hpp"

namespace ferry {

namespace {
const setting_tables<settings>& tables() {
  static const setting_tables<settings> t = [] {
    setting_tables<settings> all;
    all.add(core_settings::table());
    all.add(mem_settings::table());
    all.add(device_settings::table());
    all.add(xfer_settings::table());
    all.add(vm_settings::table());
    all.add(io_settings::table());
    all.add(store_settings::table());
    all.add(gpu_settings::table());
    return all;
  }();
  return t;
}
}  // namespace

settings settings::defaults() { return settings{}; }
settings settings::from_env() { return tables().from_env(); }
settings settings::load(const lookup_fn& env) { return tables().load(env); }

void settings::set(std::string_view name, std::string_view value, std::string_view origin) {
  tables().set(*this, name, value, origin);
}

std::vector<settings::row> settings::describe() const { return tables().describe(*this); }
std::vector<std::string_view> settings::names() { return tables().names(); }

}  // namespace ferry
