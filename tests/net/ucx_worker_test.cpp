// UCX workers of one process against each other: descriptors made and closed by one while the
// others move frames, and callbacks of one worker that send on another's connection (a client's
// lanes do: an answer on one lane sends the next request on another).
#include "net/ucx.hpp"

#include <ferry/core/error.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

using namespace ferry;
using namespace ferry::net;
using clk = std::chrono::steady_clock;

// Two workers pass one frame back and forth through an echoing third, each sending on the other's
// connection from inside its own frame callback, while a fourth worker makes and closes a listener
// again and again. A worker making descriptors waits for the others to leave their progress calls;
// a callback that sends on another worker is inside one already, and must not wait for the maker
// in turn: both would stand still until the maker's bound (10 s) ran out.
TEST(UcxWorkers, CallbacksSendingOnOtherWorkersGoOnWhileDescriptorsAreMade) {
  // What the workers' callbacks and sends use is made before them, so that it outlives them: data
  // sent in the last hops may still be arriving while the test ends.
  constexpr int hops_wanted = 2000;
  const std::vector<std::byte> payload(256 << 10, std::byte{7});
  std::vector<std::byte> sink(1 << 20);  // the echo's data lands here, overwritten each time
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<int> hops{0};
  ucx_worker echo{"t-echo"}, a{"t-a"}, b{"t-b"};
  std::vector<std::shared_ptr<connection>> taken;  // the echo's ends, kept for the test's length
  echo.on_frame([](connection& c, message m) { c.send_frame(m); });
  echo.on_data([&](connection&, std::uint64_t, std::uint64_t, std::size_t len) -> void* { return len <= sink.size() ? sink.data() : nullptr; },
               [](connection&, std::uint64_t, std::uint64_t, std::size_t, ucs_status_t) {});
  const std::uint16_t port = echo.listen("127.0.0.1", 0, [&](std::shared_ptr<connection> c) {
    std::lock_guard l(mu);
    taken.push_back(std::move(c));
  });
  const auto until = clk::now() + std::chrono::seconds(10);
  std::shared_ptr<connection> ca = a.connect("127.0.0.1", port, until);
  std::shared_ptr<connection> cb = b.connect("127.0.0.1", port, until);

  auto pass_on = [&](const std::shared_ptr<connection>& next) {
    return [&, next](connection&, message m) {
      const int h = ++hops;
      if (h < hops_wanted) {
        // Inside this worker's progress call, on the other worker: data large enough that UCX
        // does not finish sending it at once (the sender then drives that worker), and the frame.
        next->send_data(1, 0, payload.data(), payload.size(), [](ucs_status_t) {});
        next->send_frame(m);
      } else {
        std::lock_guard l(mu);
        cv.notify_all();
      }
    };
  };
  a.on_frame(pass_on(cb));  // an echo that comes back on a goes out on b, and back again
  b.on_frame(pass_on(ca));

  std::atomic<bool> stop{false};
  std::atomic<long long> slowest_ns{0};
  std::atomic<int> listeners{0};
  std::string maker_error;  // (under mu)
  std::thread maker([&] {
    ucx_worker m{"t-maker"};
    while (!stop.load()) {
      const auto t0 = clk::now();
      try {
        m.listen("127.0.0.1", 0, [](std::shared_ptr<connection>) {});
        m.stop_listening();
      } catch (const error& e) {  // the maker's worker stood still past its call's deadline
        std::lock_guard l(mu);
        maker_error = e.what();
        break;
      }
      const long long took = std::chrono::duration_cast<std::chrono::nanoseconds>(clk::now() - t0).count();
      slowest_ns.store(std::max(slowest_ns.load(), took));
      ++listeners;
    }
  });

  ca->send_frame({1, 0, stat_req{"x"}});
  {
    std::unique_lock l(mu);
    cv.wait_for(l, std::chrono::seconds(60), [&] { return hops.load() >= hops_wanted; });
  }
  stop = true;
  maker.join();
  EXPECT_GE(hops.load(), hops_wanted) << "the frame stopped moving";
  EXPECT_EQ(maker_error, "");
  EXPECT_GT(listeners.load(), 0);
  // Making a listener takes milliseconds; a stand-off ends only at the maker's 10 s bound.
  EXPECT_LT(slowest_ns.load(), std::chrono::nanoseconds(std::chrono::seconds(5)).count())
      << "a listener took that long to make and close (" << listeners.load() << " made)";
  std::printf("%d hops while %d listeners were made and closed; the slowest %.1f ms\n", hops.load(), listeners.load(),
              static_cast<double>(slowest_ns.load()) / 1e6);
}
