#pragma once
// Stream order for work that runs on ferry's threads (docs/design/stream-ordering.md). Internal to
// ferry: the transfer engine orders its batches with it, the file engine its reads and writes.
//
// Each stream that carries stream-ordered work has a gate: two 32-bit words in pinned host memory
// and a sequence of numbers handed out in the stream's order. The stream tells ferry it reached a
// point by `write_value(started, n)`; ferry lets the stream pass a point by releasing n, which the
// stream waits for with `wait_value(finished, n)`. Numbers are released to the stream in order: a
// number released early becomes visible when all before it were released, so the stream never
// passes work ferry has not finished. Numbers only grow (compared as (int32_t)(a - b) >= 0), so a
// gate is never reset and an idle one can serve another stream.
#include <ferry/device/device.hpp>
#include <ferry/mem/registration.hpp>

#include "core/executor.hpp"

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <vector>

namespace ferry {

class stream_gates {
 public:
  stream_gates(registration_cache& cache, detail::executor& x) : cache_(cache), x_(x) {}
  ~stream_gates();
  stream_gates(const stream_gates&) = delete;
  stream_gates& operator=(const stream_gates&) = delete;

  struct gate {
    std::uint32_t* started = nullptr;   // written by the stream
    std::uint32_t* finished = nullptr;  // written by ferry; the stream waits on it
    std::uint32_t next = 0;             // last number handed out
    std::uint32_t released = 0;         // what `finished` says
    std::set<std::uint32_t> ended;      // released before a number ahead of them
  };

  // The gate of stream s, locked: numbers taken while it is held are in the order of the ops the
  // holder enqueues on s meanwhile. Throws busy when every gate has work in flight.
  class order {
   public:
    std::uint32_t take() { return ++g_.next; }
    std::uint32_t* started() const { return g_.started; }
    const std::uint32_t* finished() const { return g_.finished; }
    gate& the_gate() const { return g_; }
    void unlock() { l_.unlock(); }  // the gate stays valid while numbers of it are unreleased

   private:
    friend class stream_gates;
    order(std::unique_lock<std::mutex> l, gate& g) : l_(std::move(l)), g_(g) {}
    std::unique_lock<std::mutex> l_;
    gate& g_;
  };
  order lock(stream& s);

  // Number `seq` of gate g is done: the stream may pass it once those before it are too.
  void release(gate& g, std::uint32_t seq);
  // Calls then(true) on the watching task (on the executor) once the stream wrote started >= seq;
  // then(false) once `until` passed or `cancelled()` says so first, or at once when no task could be
  // started to watch. `then` must not block.
  void watch(gate& g, std::uint32_t seq, deadline until, std::function<bool()> cancelled, std::function<void(bool)> then);

  static std::string describe(stream& s);

 private:
  struct watcher {
    gate* g;
    std::uint32_t seq;
    deadline until;
    std::function<bool()> cancelled;
    std::function<void(bool)> then;
  };
  void run();

  static constexpr std::size_t gate_bytes = 64, gate_count = 256;  // a cache line each; 16 KiB locked
  registration_cache& cache_;
  detail::executor& x_;
  std::mutex mu_;
  std::unique_ptr<std::byte, void (*)(std::byte*)> words_{nullptr, [](std::byte* p) { std::free(p); }};
  std::optional<registration> pin_;  // after words_: unpinned before they are freed
  std::map<std::pair<device*, std::uintptr_t>, gate> gates_;
  std::vector<watcher> watching_;
  detail::task_slots watch_{x_, 1};  // the one task that watches, while anything is watched (with mu_)
  bool stop_ = false;
};

}  // namespace ferry
