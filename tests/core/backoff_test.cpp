// The poll loops' back-off: its stages by the time a wait has run.
#include "core/backoff.hpp"

#include <gtest/gtest.h>

#include <chrono>

namespace ferry {
namespace {

using namespace std::chrono_literals;
using clk = std::chrono::steady_clock;

std::chrono::nanoseconds timed(detail::backoff& b) {
  auto t0 = clk::now();
  b.pause();
  return clk::now() - t0;
}

TEST(Backoff, SpinsThenNapsThatDoubleUpToTheMostThenStartOverOnReset) {
  detail::backoff spin({.spin = 1h, .nap = 1s, .most = 1s});
  auto t0 = clk::now();
  for (int i = 0; i < 1000; ++i) spin.pause();
  EXPECT_LT(clk::now() - t0, 500ms) << "within the spin stage a pause returns at once";

  detail::backoff naps({.nap = 2ms, .most = 8ms});
  EXPECT_GE(timed(naps), 2ms);
  EXPECT_GE(timed(naps), 4ms);
  EXPECT_GE(timed(naps), 8ms);
  EXPECT_GE(timed(naps), 8ms) << "no longer than the most";
  EXPECT_LT(timed(naps), 500ms);
  naps.reset();
  auto first = timed(naps);
  EXPECT_GE(first, 2ms);
  EXPECT_LT(first, 8ms + 200ms) << "after a reset the naps start short again";

  detail::backoff quiet({.nap = 1ms, .most = 1ms, .long_after = 0ns, .long_nap = 12ms});
  EXPECT_GE(timed(quiet), 12ms) << "past long_after, the long nap";
}

}  // namespace
}  // namespace ferry
