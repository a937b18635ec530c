#include "core/executor.hpp"

#include <ferry/core/error.hpp>

#include "core/logging.hpp"

#include <pthread.h>
#include <sys/prctl.h>

#include <atomic>
#include <exception>
#include <semaphore>
#include <thread>

namespace ferry::detail {

namespace {
thread_local int t_worker = -1;
thread_local const task_slots* t_slots = nullptr;  // the client whose task the calling worker runs
// Forks so far, counted in the child: an executor made before the last fork has no workers in this
// process (they stayed behind), and a task handed to one of them would never run.
std::atomic<unsigned> g_forks{0};
unsigned forks_now() {
  static const bool once = [] { return ::pthread_atfork(nullptr, nullptr, [] { g_forks.fetch_add(1); }) == 0; }();
  (void)once;
  return g_forks.load(std::memory_order_relaxed);
}
}  // namespace

struct executor::worker {
  int id = 0;
  task next;                      // handed over by run(), before `go` is released
  std::binary_semaphore go{0};
  std::thread thread;
};

executor::executor() : forks_(forks_now()) {}

int executor::worker_id() noexcept { return t_worker; }

std::size_t executor::workers() const {
  std::lock_guard l(mu_);
  return all_.size();
}

std::size_t executor::idle() const {
  std::lock_guard l(mu_);
  return idle_.size();
}

void executor::run(task t, bool in_slot) {
  if (forks_now() != forks_)
    throw error(errc::invalid_argument, "executor", "worker threads",
                "this process was forked from the one that made them, and they did not come along; make a runtime in this process");
  {
    std::unique_lock l(mu_);
    // As many workers as slots already, none idle: some worker's task gave its slot back and is
    // about to be idle (every slot's task has a worker), so this task waits for it.
    if (in_slot) idle_cv_.wait(l, [&] { return !idle_.empty() || made_ < slots_; });
    if (!idle_.empty()) {
      worker* w = idle_.back();
      idle_.pop_back();
      w->next = std::move(t);
      l.unlock();
      w->go.release();
      return;
    }
  }
  // None idle: a worker made for it, outside the lock (a thread's making may wait for the loader's
  // lock a millisecond or more; others' tasks meanwhile find the idle workers there are).
  auto w = std::make_unique<worker>();
  w->next = std::move(t);
  {
    std::lock_guard l(mu_);
    w->id = static_cast<int>(all_.size());
    all_.push_back(nullptr);  // its place, so that ids stay dense whatever else is made meanwhile
    ++made_;
  }
  try {
    w->go.release();
    w->thread = std::thread([this, p = w.get()] { serve(*p); });
  } catch (const std::exception& e) {
    std::lock_guard l(mu_);
    --made_;  // its place stays empty (ids are never given twice); the destructor skips it
    idle_cv_.notify_all();
    throw error(errc::unavailable, "executor", "worker thread", fmt::format("no thread could be made ({}) and no worker is idle", e.what()));
  }
  std::lock_guard l(mu_);
  all_[static_cast<std::size_t>(w->id)] = std::move(w);
}

void executor::serve(worker& w) {
  ::pthread_setname_np(::pthread_self(), "ferry-worker");  // for top, perf and debuggers
  // Precise sleeps: tasks that poll (a copy's completion, a stream's gate) sleep for microseconds,
  // and the default timer slack is as long as a small copy.
  ::prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
  t_worker = w.id;
  for (;;) {
    w.go.acquire();
    if (!w.next) return;  // the executor ends
    try {
      w.next();
    } catch (const std::exception& e) {
      log::error("executor", "a task ended with an exception, dropped: {}", e.what());
    } catch (...) {
      log::error("executor", "a task ended with an exception, dropped");
    }
    w.next = nullptr;  // its captures go before the worker is idle
    std::lock_guard l(mu_);
    if (stop_) return;
    idle_.push_back(&w);
    idle_cv_.notify_one();
  }
}

executor::~executor() {
  std::vector<std::unique_ptr<worker>> all;
  {
    std::lock_guard l(mu_);
    stop_ = true;
    for (worker* w : idle_) w->go.release();  // with no task: it returns
    idle_.clear();
    all.swap(all_);
  }
  // A worker still in its task ends with it (its client waited for its tasks before letting the
  // executor go, so that is only the moment between give_back and the task's return).
  for (auto& w : all)
    if (w && w->thread.joinable()) w->thread.join();
}

task_slots::task_slots(executor& x, unsigned most) : x_(x), most_(most ? most : 1) {
  std::lock_guard l(x_.mu_);
  x_.slots_ += most_;
  x_.idle_cv_.notify_all();
}

task_slots::~task_slots() {
  wait_none();
  std::lock_guard l(x_.mu_);
  x_.slots_ -= most_;
}

bool task_slots::take() noexcept {
  std::lock_guard l(mu_);
  if (out_ >= most_) return false;
  ++out_;
  return true;
}

void task_slots::give_back() noexcept {
  std::lock_guard l(mu_);
  if (--out_ == 0 && running_ == 0) none_.notify_all();  // under the lock: a waiter may destroy this once it sees none
}

// The task's end, after it returned (and so let go of its client's lock, under which it gave its slot back).
void task_slots::ended() noexcept {
  std::lock_guard l(mu_);
  if (--running_ == 0 && out_ == 0) none_.notify_all();
}

void task_slots::start(std::mutex& client_mu, executor::task t) {
  {
    std::lock_guard l(mu_);
    ++running_;
  }
  try {
    x_.run(
        [this, t = std::move(t)] {
          t_slots = this;
          try {
            t();
          } catch (const std::exception& e) {
            // A client's task handles its own failures and gives its slot back; one that escapes left
            // its client's state half done (a queue no task drains, a ring no loop runs): loud, as a
            // thread of its own ending with an exception would be, rather than a hang.
            log::error("executor", "a task escaped with an exception, which its client cannot recover from: {}", e.what());
            std::terminate();
          }
          t_slots = nullptr;
          ended();
        },
        true);
  } catch (...) {
    {
      std::lock_guard l(client_mu);
      give_back();
    }
    ended();
    throw;
  }
}

unsigned task_slots::out() const noexcept {
  std::lock_guard l(mu_);
  return out_;
}

void task_slots::wait_none() noexcept {
  if (t_slots == this) {
    // The client is being ended from one of its own tasks (a completion that let go of its owner):
    // the wait would be for this very task.
    log::error("executor", "a client of the executor is being destroyed from one of its own tasks, which would wait for itself");
    std::terminate();
  }
  std::unique_lock l(mu_);
  none_.wait(l, [&] { return out_ == 0 && running_ == 0; });
}

}  // namespace ferry::detail
