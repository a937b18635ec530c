// UCX workers of one process against each other: descriptors made and closed by one while the
// others move frames, and callbacks of one worker that send on another's connection (a client's
// lanes do: an answer on one lane sends the next request on another).
#include "net/ucx.hpp"

#include <ferry/core/error.hpp>

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
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
        // Another loopback address each time: a listen on the same address would take up the
        // listener kept from the last one, and make no descriptor.
        m.listen(listeners.load() % 2 ? "127.0.0.2" : "127.0.0.1", 0, [](std::shared_ptr<connection>) {});
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

// A stranger connects to a listening worker, stays silent until the worker has stopped listening,
// then sends what UCX reads as a connection request (a length and a status, then that many bytes).
// UCX 1.13 runs the request on the listener that accepted the connection: with that listener
// closed, the process died there (a SEGV on UCX's async thread). The listener now stays until the
// worker goes and refuses what comes after stop_listening; the worker goes on serving.
TEST(UcxWorkers, AStrangerThatSpeaksAfterTheListenerStoppedIsRefused) {
  ucx_worker w{"t-lane"};
  std::atomic<int> accepted{0};
  const std::uint16_t port = w.listen("127.0.0.1", 0, [&](std::shared_ptr<connection>) { accepted++; });
  for (int round = 0; round < 3; ++round) {
    int s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(s, 0);
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    to.sin_port = htons(port);
    ASSERT_EQ(::connect(s, reinterpret_cast<sockaddr*>(&to), sizeof to), 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // UCX's async thread accepts it
    w.stop_listening();
    unsigned char bytes[16 + 64];
    std::fill(std::begin(bytes), std::end(bytes), 0x5a);
    const std::uint64_t length = 64;
    std::memcpy(bytes, &length, sizeof length);
    bytes[8] = 0;
    EXPECT_EQ(::send(s, bytes, sizeof bytes, MSG_NOSIGNAL), static_cast<ssize_t>(sizeof bytes));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // UCX reads it and runs the request
    ::close(s);
    EXPECT_EQ(accepted.load(), 0) << "a connection was accepted while not listening";
    // Listening again on the same address takes up the same listener.
    EXPECT_EQ(w.listen("127.0.0.1", 0, [&](std::shared_ptr<connection>) { accepted++; }), port);
  }
  // Still serving: another worker's connection is accepted while it listens.
  ucx_worker other{"t-other"};
  auto c = other.connect("127.0.0.1", port, clk::now() + std::chrono::seconds(10));
  EXPECT_TRUE(c && c->alive());
  const auto until = clk::now() + std::chrono::seconds(10);
  while (accepted.load() == 0 && clk::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(accepted.load(), 1);
  w.stop_listening();
}
