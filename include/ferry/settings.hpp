#pragma once
// Every tunable of ferry: the layers' settings gathered into one snapshot.
//
// A `settings` value is an immutable snapshot: it is loaded once (defaults <- FERRY_CONFIG file <-
// FERRY_* environment) and handed to the runtime that uses it; nothing re-reads the environment
// behind its back. Each layer owns its tunables (ferry/<layer>/settings.hpp, one row each in
// src/<layer>/settings.cpp) and its code takes its layer's struct, which a `settings` converts to.
// `ferry info --settings` prints the layers' tables in layer order and docs/settings.md is checked
// against it by a test.
#include <ferry/core/export.hpp>
#include <ferry/core/settings.hpp>
#include <ferry/device/settings.hpp>
#include <ferry/gpu/settings.hpp>
#include <ferry/io/settings.hpp>
#include <ferry/mem/settings.hpp>
#include <ferry/store/settings.hpp>
#include <ferry/vm/settings.hpp>
#include <ferry/xfer/settings.hpp>

#include <string_view>
#include <type_traits>
#include <vector>

namespace ferry {

// core's and mem's are virtual bases of the layers' structs that read them: one of each here.
// A defaulted move assignment may move a virtual base more than once: theirs must lose nothing that way.
static_assert(std::is_trivially_copyable_v<core_settings> && std::is_trivially_copyable_v<mem_settings>);
struct FERRY_API settings : virtual core_settings, virtual mem_settings, device_settings, xfer_settings, vm_settings,
                            io_settings, store_settings, gpu_settings {
  using lookup_fn = setting_lookup;
  using row = setting_value;

  // Defaults only.
  static settings defaults();
  // Defaults, then the file named by FERRY_CONFIG (if set), then the process environment.
  // Throws invalid_argument naming the variable, its value and where it came from.
  static settings from_env();
  // As from_env, with the environment given by `env` (tests use this).
  static settings load(const lookup_fn& env);
  // Applies one "FERRY_NAME" = "value" pair; throws like load(). `origin` names where it came from.
  void set(std::string_view name, std::string_view value, std::string_view origin = "override");

  // All tunables with this snapshot's values: the layers' tables in layer order (core first).
  std::vector<row> describe() const;
  // Names of all tunables, in the same order.
  static std::vector<std::string_view> names();
};

}  // namespace ferry
