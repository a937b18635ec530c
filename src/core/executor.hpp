#pragma once
// The library's one set of worker threads (docs/design/executor.md). Every layer that runs work off
// its callers' threads -- the transfer engine's copies, the file engine's rings, the stream gates'
// watch, the sim device's copy engines -- hands that work to the executor of its device registry as
// tasks, instead of keeping threads of its own.
//
// A task runs on an idle worker, or on a worker made for it: the executor keeps no queue. Each
// client bounds the tasks it has out (task_slots below) and keeps its own queue of work, which its
// tasks drain; so a task always finds a worker, and a task that blocks (a copy waiting for its
// stream, a ring waiting for its I/O) never holds up another client's. The workers are as many as
// the clients' slots at most: a task's slot is given back a moment before its worker is idle, and
// a task started in that moment waits for the worker instead of making another. A worker, once made, stays
// until the executor ends: making a thread costs its maker the loader's lock (in a process that
// imported torch, a millisecond or more), which work that comes in bursts would pay each time.
//
// Threads that stay dedicated, and why (each where it is made): UCX progress (a lane's worker is
// progressed by one thread), the vm fault service (it must run while every executor worker is
// stopped at a fault), the GPU proxy rings (each polls its ring's memory as long as the kernel runs),
// the registration cache's applier, the server's janitor and door, the http lanes (libcurl's
// multi handle is driven by one thread), and the server's opens of files it lends (an open may never
// return on a hung mount: nothing may wait for it, as an executor's end waits for its tasks).
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

namespace ferry::detail {

class executor {
 public:
  using task = std::function<void()>;
  executor();
  // Ends the workers. Every client's tasks must have ended (task_slots::wait_none). (In a forked
  // child, whose workers stayed behind, it is let go of instead: device_registry::abandon.)
  ~executor();
  executor(const executor&) = delete;
  executor& operator=(const executor&) = delete;

  // Runs `t` on an idle worker, or on one made for it. Throws error(unavailable) when no worker is
  // idle and no thread can be made. A task that throws has its exception logged and dropped: tasks
  // report their failures through their clients' completions. (Clients start their tasks through
  // task_slots, which keeps the workers within the slots.)
  void run(task t) { run(std::move(t), false); }
  // The calling thread's worker number (0, 1, ...: dense, so clients may index per-worker state by
  // it), or -1 off the executor.
  static int worker_id() noexcept;
  // Workers made so far, and those of them waiting for a task.
  std::size_t workers() const;
  std::size_t idle() const;

 private:
  friend class task_slots;
  struct worker;
  void run(task t, bool in_slot);
  void serve(worker& w);
  mutable std::mutex mu_;
  std::condition_variable idle_cv_;           // a worker became idle (for a task in a slot waiting for one)
  std::vector<std::unique_ptr<worker>> all_;  // with mu_
  std::vector<worker*> idle_;                 // with mu_: the most recently idle last (its caches warm)
  std::size_t made_ = 0;                      // with mu_: workers made (all_ without the places left empty)
  std::size_t slots_ = 0;                     // with mu_: the clients' slots, all together
  bool stop_ = false;
  unsigned forks_ = 0;                        // forks before it was made (run() refuses in a later child)
};

// How many tasks of one client run at once, at most, and a wait for them all to end (the client's
// destructor). take() and give_back() are called under the client's own lock -- the one that guards
// its queue -- so that a task that found the queue empty and a caller that queues work cannot miss
// each other: either the caller sees the slot still taken (the task will look again), or the task
// sees the work.
class task_slots {
 public:
  task_slots(executor& x, unsigned most);
  ~task_slots();
  task_slots(const task_slots&) = delete;
  task_slots& operator=(const task_slots&) = delete;

  // A slot for one task more, if fewer than `most` are out (under the client's lock).
  bool take() noexcept;
  // The calling task is done with its slot and touches nothing of the client after it (under the
  // client's lock; the task returns next).
  void give_back() noexcept;
  // Runs `t` in a slot take() gave; if that fails, gives the slot back (taking `client_mu`, the
  // client's lock) and rethrows. Called without the client's lock. A task must give its slot back
  // itself and handle its failures: one that ends with an exception ends the process, with it.
  void start(std::mutex& client_mu, executor::task t);
  unsigned out() const noexcept;
  unsigned most() const noexcept { return most_; }
  // Until no task holds a slot and every task started has returned (so has let go of the client's
  // lock too). (Called from one of the client's own tasks, it would wait for itself: that ends the
  // process, with a message.)
  void wait_none() noexcept;

 private:
  executor& x_;
  const unsigned most_;
  mutable std::mutex mu_;
  std::condition_variable none_;
  unsigned out_ = 0;      // slots taken
  unsigned running_ = 0;  // tasks started and not yet returned
  void ended() noexcept;
};

}  // namespace ferry::detail
