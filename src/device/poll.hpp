#pragma once
// Waiting for device work by polling. A blocking CUDA call (cuStreamSynchronize, cuEventSynchronize)
// cannot honour a deadline and could hang forever on a wedged device, so every wait polls.
#include <ferry/device/device.hpp>

#include <algorithm>
#include <chrono>
#include <thread>

namespace ferry::detail {

// Calls ready() until it returns true (then true) or `until` passes (then false). Yields for the
// first 2 ms -- a sleep overshoots by its timer slack (the kernel's default is 50 us), a visible
// share of even a large PCIe copy and long enough to leave the copy engines idle between pipelined
// batches -- then sleeps with a back-off of at most 50 us.
template <typename F>
bool poll_until(deadline until, F&& ready) {
  auto start = std::chrono::steady_clock::now();
  auto sleep = std::chrono::microseconds(2);
  while (!ready()) {
    auto now = std::chrono::steady_clock::now();
    if (now >= until) return false;
    if (now - start < std::chrono::milliseconds(2)) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(sleep);
    sleep = std::min(sleep * 2, std::chrono::microseconds(50));
  }
  return true;
}

}  // namespace ferry::detail
