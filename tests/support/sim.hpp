#pragma once
// Settings for a runtime on the simulated device: `capacity` bytes of device memory in chunks of
// `granularity` (small chunks keep the tests quick; ferry's policies do not depend on the size).
#include <ferry/settings.hpp>

#include <cstdint>

namespace ferry::test {

inline settings sim_settings(std::uint64_t capacity, std::uint64_t granularity = 64 << 10) {
  settings c = settings::defaults();
  c.backend = backend_choice::sim;
  c.sim_capacity = capacity;
  c.sim_granularity = granularity;
  return c;
}

}  // namespace ferry::test
