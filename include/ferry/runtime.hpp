#pragma once
// The runtime: one per process (or per independent user), owning the settings snapshot and
// everything built from it: devices, the registration cache with its memory clients, and the
// transfer engine. Parts are created on first use, so a CPU-only tool never loads the CUDA driver.
// While it lives, file::open accepts ferry://host:port/path (see ferry/store/files.hpp); close such
// files before the runtime goes. A runtime belongs to the process that made it: its threads do not
// come along into a forked child, where registrations(), engine() and files() throw (make a runtime
// there) and its end leaves its parts as they are (ending them would wait for those threads).
#include <ferry/core/export.hpp>
#include <ferry/device/registry.hpp>
#include <ferry/io/file_engine.hpp>
#include <ferry/mem/registration.hpp>
#include <ferry/settings.hpp>
#include <ferry/store/http.hpp>
#include <ferry/xfer/engine.hpp>

#include <memory>
#include <mutex>

namespace ferry {

class FERRY_API runtime {
 public:
  // From FERRY_* environment (and FERRY_CONFIG). Applies FERRY_LOG to the process logger.
  runtime();
  explicit runtime(settings s);
  ~runtime();

  const settings& config() const noexcept { return config_; }
  device_registry& devices() noexcept { return devices_; }
  // Pointer classification and DMA registrations: clients for CUDA memory (when a driver is
  // present), sim devices and host memory, in that order.
  registration_cache& registrations();
  transfer_engine& engine();
  file_engine& files();

 private:
  void check_process(const char* part) const;  // throws in a process forked from the one that made it
  long pid_;
  settings config_;
  device_registry devices_;
  std::once_flag mem_once_, engine_once_, files_once_;
  std::vector<std::unique_ptr<peer_memory_client>> clients_;
  std::unique_ptr<registration_cache> cache_;
  std::unique_ptr<transfer_engine> engine_;
  std::unique_ptr<file_engine> files_;
  scheme_registration ferry_files_;  // file::open("ferry://...") while this runtime lives
  store::http_registration http_files_;  // and "http://...", "https://..."
};

// Version of the library ("0.1.0") and whether it was built with CUDA.
FERRY_API const char* version() noexcept;
FERRY_API bool built_with_cuda() noexcept;

}  // namespace ferry
