#include <ferry/runtime.hpp>

namespace ferry {

runtime::runtime() : runtime(settings::from_env()) {}

runtime::runtime(settings s) : devices_((set_log_level(s.log), std::move(s))) {}

const char* version() noexcept { return FERRY_VERSION; }

bool built_with_cuda() noexcept {
#ifdef FERRY_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace ferry
