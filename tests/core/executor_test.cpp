// The executor: tasks on idle workers or on workers made for them, clients' task slots, and that
// blocking tasks of two clients cannot hold each other up.
#include "core/executor.hpp"

#include <ferry/core/error.hpp>

#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

namespace ferry {
namespace {

using namespace std::chrono_literals;

// Waits (bounded) for `ok`; the tests fail, not hang, when the executor loses a task.
template <typename F>
bool eventually(F ok, std::chrono::milliseconds most = 10s) {
  auto until = std::chrono::steady_clock::now() + most;
  while (!ok()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

TEST(Executor, TasksOneAfterAnotherReuseTheIdleWorker) {
  detail::executor x;
  std::atomic<int> ran{0};
  std::set<int> ids;
  std::mutex mu;
  for (int i = 0; i < 20; ++i) {
    int before = ran.load();
    x.run([&] {
      std::lock_guard l(mu);
      ids.insert(detail::executor::worker_id());
      ++ran;
    });
    ASSERT_TRUE(eventually([&] { return ran.load() == before + 1; }));
    // The worker puts itself back on the idle list just after its task: give it that moment.
    ASSERT_TRUE(eventually([&] { return x.idle() == 1; }));
  }
  EXPECT_EQ(x.workers(), 1u) << "a task that finds a worker idle makes none";
  EXPECT_EQ(ids, std::set<int>{0});
  EXPECT_EQ(detail::executor::worker_id(), -1) << "the test's thread is not a worker";
}

TEST(Executor, TasksAtOnceGetAWorkerEachWithDenseIds) {
  detail::executor x;
  constexpr int n = 6;
  std::atomic<int> in{0};
  std::atomic<bool> go{false};
  std::mutex mu;
  std::set<int> ids;
  for (int i = 0; i < n; ++i)
    x.run([&] {
      {
        std::lock_guard l(mu);
        ids.insert(detail::executor::worker_id());
      }
      ++in;
      while (!go) std::this_thread::sleep_for(100us);
      --in;
    });
  ASSERT_TRUE(eventually([&] { return in.load() == n; })) << "every task runs at once: none waits for another";
  go = true;
  ASSERT_TRUE(eventually([&] { return in.load() == 0; }));
  EXPECT_EQ(x.workers(), static_cast<std::size_t>(n));
  EXPECT_EQ(ids, (std::set<int>{0, 1, 2, 3, 4, 5}));
}

TEST(Executor, ATaskThatThrowsLeavesItsWorkerServing) {
  detail::executor x;
  x.run([] { throw std::runtime_error("a task's own failure"); });
  std::atomic<bool> ran{false};
  ASSERT_TRUE(eventually([&] { return x.idle() == 1; }));
  x.run([&] { ran = true; });
  ASSERT_TRUE(eventually([&] { return ran.load(); }));
  EXPECT_EQ(x.workers(), 1u);
}

// A client's slots bound its tasks; a task gives its slot back under the client's lock when its
// queue is empty, and a caller that queued work meanwhile sees either the slot taken or starts a task.
TEST(Executor, SlotsBoundAClientsTasksAndNoQueuedWorkIsLeftBehind) {
  detail::executor x;
  std::mutex mu;
  std::vector<int> queue;
  detail::task_slots slots(x, 3);
  std::atomic<int> done{0}, at_once{0}, most{0};
  auto drain = [&] {
    for (;;) {
      {
        std::lock_guard l(mu);
        if (queue.empty()) return slots.give_back();
        queue.pop_back();
      }
      int now = ++at_once;
      for (int m = most.load(); now > m && !most.compare_exchange_weak(m, now);) {
      }
      std::this_thread::sleep_for(50us);
      --at_once;
      ++done;
    }
  };
  constexpr int items = 2000;
  for (int i = 0; i < items; ++i) {
    bool start = false;
    {
      std::lock_guard l(mu);
      queue.push_back(i);
      start = slots.take();
    }
    if (start) slots.start(mu, drain);
  }
  ASSERT_TRUE(eventually([&] { return done.load() == items; })) << "every queued item ran";
  slots.wait_none();
  EXPECT_LE(most.load(), 3);
  EXPECT_LE(x.workers(), 3u) << "no more workers than slots, even as tasks end and start";
  EXPECT_EQ(slots.out(), 0u);
}

// Two clients whose tasks block on each other's (a ring's loop waiting for a copy the transfer
// engine runs): each has its own slots, and the executor holds no task back, so both run.
TEST(Executor, BlockingTasksOfTwoClientsDoNotDeadlock) {
  detail::executor x;
  std::mutex amu, bmu;
  detail::task_slots a(x, 4), b(x, 4);
  std::atomic<int> waiting_for_b{0}, b_ran{0};
  for (int i = 0; i < 4; ++i) {
    {
      std::lock_guard l(amu);
      ASSERT_TRUE(a.take());
    }
    a.start(amu, [&] {
      ++waiting_for_b;
      bool ok = eventually([&] { return b_ran.load() > 0; }, 5s);
      std::lock_guard l(amu);
      a.give_back();
      EXPECT_TRUE(ok) << "a blocked task held up another client's";
    });
  }
  ASSERT_TRUE(eventually([&] { return waiting_for_b.load() == 4; }));
  {
    std::lock_guard l(bmu);
    ASSERT_TRUE(b.take());
  }
  b.start(bmu, [&] {
    ++b_ran;
    std::lock_guard l(bmu);
    b.give_back();
  });
  a.wait_none();
  b.wait_none();
  EXPECT_EQ(b_ran.load(), 1);
}

// A forked child has none of the parent's workers: a task handed to one would never run, so the
// executor refuses it, saying why.
TEST(Executor, AForkedChildIsRefusedWithTheReason) {
  detail::executor x;
  std::atomic<bool> ran{false};
  x.run([&] { ran = true; });
  ASSERT_TRUE(eventually([&] { return ran.load() && x.idle() == 1; }));
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    int code = 3;
    try {
      x.run([] {});
      code = 1;  // accepted: it would never run
    } catch (const error& e) {
      code = e.code() == errc::invalid_argument && std::string(e.what()).find("forked") != std::string::npos ? 0 : 2;
    }
    ::_exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: the child's task was accepted; 2: another error";
  ran = false;
  x.run([&] { ran = true; });
  EXPECT_TRUE(eventually([&] { return ran.load(); })) << "the parent's executor still serves";
}

}  // namespace
}  // namespace ferry
