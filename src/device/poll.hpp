#pragma once
// Waiting for device work by polling. A blocking CUDA call (cuStreamSynchronize, cuEventSynchronize)
// cannot honour a deadline and could hang forever on a wedged device, so every wait polls.
#include <ferry/device/device.hpp>

#include "core/backoff.hpp"

#include <chrono>

namespace ferry::detail {

// Calls ready() until it returns true (then true) or `until` passes (then false). Yields for the
// first 2 ms -- a sleep overshoots by its timer slack (the kernel's default is 50 us), a visible
// share of even a large PCIe copy and long enough to leave the copy engines idle between pipelined
// batches -- then sleeps with a back-off of at most 50 us.
template <typename F>
bool poll_until(deadline until, F&& ready) {
  using namespace std::chrono_literals;
  backoff wait({.yield = 2ms, .nap = 2us, .most = 50us});
  while (!ready()) {
    if (std::chrono::steady_clock::now() >= until) return false;
    wait.pause();
  }
  return true;
}

}  // namespace ferry::detail
