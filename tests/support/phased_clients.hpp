#pragma once
// Runs n storage clients at once, in phases: all connect together, then all work together, then all
// leave together.
//
// Why phases: in UCX 1.13 one worker may still hold an event for a connection's socket in its
// missed-event queue when that socket is closed; if another worker of the same process gets the
// same descriptor number for a new connection before the first one drains its queue, UCX aborts
// (async.c:643 `handler->async == async`; fixed in UCX 1.17, openucx/ucx#9942). Clients and server
// in one test process, each client starting and ending on its own schedule, hit that now and then.
// With the phases, sockets are only opened while none are closed and the other way round. (ferry
// itself never hands a connection between workers: see ucx_worker::listen.)
#include <ferry/core/error.hpp>
#include <ferry/store/client.hpp>

#include <gtest/gtest.h>

#include <barrier>
#include <memory>
#include <thread>
#include <vector>

namespace ferry::test {

// `make(i)` returns client i (a std::unique_ptr<store::client>); `work(client, i)` uses it. A ferry
// error in either is a test failure naming the client.
template <typename Make, typename Work>
void phased_clients(int n, Make make, Work work) {
  std::barrier connected(n), worked(n);
  std::vector<std::thread> ts;
  for (int i = 0; i < n; ++i)
    ts.emplace_back([&, i] {
      std::unique_ptr<store::client> c;
      try {
        c = make(i);
      } catch (const error& e) {
        ADD_FAILURE() << "client " << i << " connecting: " << e.what();
      }
      connected.arrive_and_wait();
      if (c) try {
          work(*c, i);
        } catch (const error& e) {
          ADD_FAILURE() << "client " << i << ": " << e.what();
        }
      worked.arrive_and_wait();
      c.reset();
    });
  for (auto& t : ts) t.join();
}

}  // namespace ferry::test
