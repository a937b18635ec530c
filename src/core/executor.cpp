#include "core/executor.hpp"

#include <ferry/core/error.hpp>

#include "core/logging.hpp"

#include <pthread.h>
#include <sys/prctl.h>

#include <semaphore>
#include <thread>

namespace ferry::detail {

namespace {
thread_local int t_worker = -1;
}

struct executor::worker {
  int id = 0;
  task next;                      // handed over by run(), before `go` is released
  std::binary_semaphore go{0};
  std::thread thread;
};

executor::executor() = default;

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
  if (--out_ == 0) none_.notify_all();  // under the lock: a waiter may destroy this once it sees none
}

void task_slots::start(std::mutex& client_mu, executor::task t) {
  try {
    x_.run(std::move(t), true);
  } catch (...) {
    std::lock_guard l(client_mu);
    give_back();
    throw;
  }
}

unsigned task_slots::out() const noexcept {
  std::lock_guard l(mu_);
  return out_;
}

void task_slots::wait_none() noexcept {
  std::unique_lock l(mu_);
  none_.wait(l, [&] { return out_ == 0; });
}

}  // namespace ferry::detail
