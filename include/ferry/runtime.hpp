#pragma once
// The runtime: one per process (or per independent user), owning the settings snapshot and
// everything built from it. Later layers (transfer engine, files, network) hang off it.
#include <ferry/core/export.hpp>
#include <ferry/core/settings.hpp>
#include <ferry/device/registry.hpp>

namespace ferry {

class FERRY_API runtime {
 public:
  // From FERRY_* environment (and FERRY_CONFIG). Applies FERRY_LOG to the process logger.
  runtime();
  explicit runtime(settings s);

  const settings& config() const noexcept { return devices_.config(); }
  device_registry& devices() noexcept { return devices_; }

 private:
  device_registry devices_;
};

// Version of the library ("0.1.0") and whether it was built with CUDA.
FERRY_API const char* version() noexcept;
FERRY_API bool built_with_cuda() noexcept;

}  // namespace ferry
