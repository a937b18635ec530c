#pragma once
// Completions of asynchronous requests (store::client::submit, file engine batches), counted: each
// must come once; wait() returns once every one came (or at the deadline). The counts live as long
// as the completions handed out, so one that comes after the test gave up touches nothing freed.
#include <ferry/core/error.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace ferry::test {

class tally {
  struct counts {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<int> told;
    std::vector<std::uint64_t> bytes;
    std::vector<std::string> errors;  // empty: none
  };
  std::shared_ptr<counts> c_;

 public:
  explicit tally(std::size_t n) : c_(std::make_shared<counts>()), told(c_->told), bytes(c_->bytes), errors(c_->errors) {
    told.resize(n);
    bytes.resize(n);
    errors.resize(n);
  }
  tally(const tally&) = delete;
  tally& operator=(const tally&) = delete;
  // Read them once wait() returned true, or under lock().
  std::vector<int>& told;
  std::vector<std::uint64_t>& bytes;
  std::vector<std::string>& errors;
  std::unique_lock<std::mutex> lock() { return std::unique_lock(c_->mu); }
  std::function<void(std::uint64_t, const error*)> done(std::size_t i) {
    return [c = c_, i](std::uint64_t b, const error* e) {
      std::lock_guard l(c->mu);
      c->told[i]++;
      c->bytes[i] = b;
      if (e) c->errors[i] = e->what();
      c->cv.notify_all();
    };
  }
  // Waits for completion `i` alone (requests kept in flight: wait for the oldest, submit the next).
  bool wait_one(std::size_t i, std::chrono::seconds t) {
    std::unique_lock l(c_->mu);
    return c_->cv.wait_for(l, t, [&] { return told[i] > 0; });
  }
  bool wait(std::chrono::seconds t) {
    std::unique_lock l(c_->mu);
    return c_->cv.wait_for(l, t, [&] { return std::all_of(told.begin(), told.end(), [](int x) { return x > 0; }); });
  }
};

}  // namespace ferry::test
