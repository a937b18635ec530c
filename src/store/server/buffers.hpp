#pragma once
// The server's buffers for file data on its way to or from clients (store/server/).
#include <ferry/net/protocol.hpp>

#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

namespace ferry::store::detail {

using net::max_data;
using net::write_mode;

// Buffers for file data on its way to or from a client by message or RMA: at most `count`, shared by
// all connections (they bound what the server holds). A request that finds none free waits in line
// without a thread: the buffer given back next goes to it.
class data_buffers {
 public:
  using then = std::function<void(std::byte*)>;
  data_buffers(std::size_t bytes, std::size_t count) : bytes_(bytes), count_(count) {}
  std::size_t bytes() const noexcept { return bytes_; }
  // Calls `t` with a buffer: now, or on the thread that gives one back.
  void take(then t) {
    std::byte* b = nullptr;
    {
      std::lock_guard l(mu_);
      if (!free_.empty()) {
        b = free_.back().release();
        free_.pop_back();
      } else if (made_ < count_) {
        ++made_;
      } else {
        waiting_.push_back(std::move(t));
        return;
      }
    }
    t(b ? b : new std::byte[bytes_]);
  }
  void give_back(std::byte* b) {
    then next;
    {
      std::lock_guard l(mu_);
      if (waiting_.empty()) {
        free_.emplace_back(b);
        return;
      }
      next = std::move(waiting_.front());
      waiting_.pop_front();
    }
    next(b);
  }
 private:
  std::size_t bytes_, count_, made_ = 0;
  std::mutex mu_;
  std::vector<std::unique_ptr<std::byte[]>> free_;
  std::deque<then> waiting_;
};

// Write data buffers (max_data bytes each), recycled: a fresh multi-MiB allocation per data message
// would pay its page faults every time.
class buffer_pool {
 public:
  std::shared_ptr<std::byte[]> get() {
    {
      std::lock_guard l(mu_);
      if (!free_.empty()) {
        auto b = std::move(free_.back());
        free_.pop_back();
        return wrap(b.release());
      }
    }
    return wrap(new std::byte[max_data]);
  }

 private:
  std::shared_ptr<std::byte[]> wrap(std::byte* p) {
    return std::shared_ptr<std::byte[]>(p, [this](std::byte* q) {
      std::lock_guard l(mu_);
      if (free_.size() < 64) free_.emplace_back(q);
      else delete[] q;
    });
  }
  std::mutex mu_;
  std::vector<std::unique_ptr<std::byte[]>> free_;
};

}  // namespace ferry::store::detail
