#pragma once
// The copy step of every staged road into memory its source cannot write itself (a device's, or
// ferry's unified memory): a file read, a `ferry://` answer or an HTTP body has landed in pinned
// host memory (a buffer of the engine's staging pool, a landing region, a mapped file window), and
// the transfer engine copies it on. A component that stages owns one: it starts its copies here and
// its end waits here for those still running, so that none runs after the component is gone.
#include <ferry/core/error.hpp>
#include <ferry/core/export.hpp>
#include <ferry/xfer/engine.hpp>

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <span>

namespace ferry {

class FERRY_API staged_copies {
 public:
  explicit staged_copies(transfer_engine& engine) noexcept : engine_(engine) {}
  ~staged_copies() { wait(); }
  staged_copies(const staged_copies&) = delete;
  staged_copies& operator=(const staged_copies&) = delete;

  // Called once when a copy (or every copy of one start) has ended: the first error, or null.
  using completion = std::function<void(const error*)>;
  // Starts the copies, one batch of the engine; `done` runs on the engine thread that ends the last
  // of them, or here when they could not start. Never throws.
  void start(std::span<const transfer_request> copies, deadline until, completion done) noexcept;
  void start(const transfer_request& copy, deadline until, completion done) noexcept { start({&copy, 1}, until, std::move(done)); }
  // Until every started copy's `done` has returned. Not from inside a `done`.
  void wait() noexcept;
  std::uint64_t running() const noexcept;
  transfer_engine& engine() const noexcept { return engine_; }

 private:
  void ended() noexcept;
  transfer_engine& engine_;
  mutable std::mutex mu_;
  std::condition_variable idle_;
  std::uint64_t running_ = 0;  // mu_
};

}  // namespace ferry
