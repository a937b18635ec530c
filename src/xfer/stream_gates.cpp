#include "xfer/stream_gates.hpp"

#include <ferry/core/error.hpp>

#include <fmt/format.h>

#include "core/backoff.hpp"
#include "core/logging.hpp"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

namespace ferry {

stream_gates::~stream_gates() {
  {
    std::lock_guard l(mu_);
    stop_ = true;
  }
  watch_.wait_none();
}

std::string stream_gates::describe(stream& s) {
  return fmt::format("{} stream {:#x}", s.owner().id(), s.native_handle().handle);
}

stream_gates::order stream_gates::lock(stream& s) {
  std::unique_lock l(mu_);
  auto key = std::make_pair(&s.owner(), s.native_handle().handle);
  if (auto it = gates_.find(key); it != gates_.end()) return order(std::move(l), it->second);
  if (!words_) {
    words_.reset(static_cast<std::byte*>(std::aligned_alloc(4096, gate_bytes * gate_count)));
    if (!words_) fail(errc::out_of_memory, "xfer.stream_order", "gates", "no memory for the stream gates");
    std::memset(words_.get(), 0, gate_bytes * gate_count);
    pin_.emplace(cache_.acquire(words_.get(), gate_bytes * gate_count));  // the devices poll them
  }
  gate g;
  if (gates_.size() < gate_count) {
    auto* w = words_.get() + gates_.size() * gate_bytes;
    g.started = reinterpret_cast<std::uint32_t*>(w);
    g.finished = reinterpret_cast<std::uint32_t*>(w + sizeof(std::uint32_t));
  } else {
    auto idle = std::find_if(gates_.begin(), gates_.end(), [&](auto& kv) {
      const gate& x = kv.second;
      return x.released == x.next &&
             std::none_of(watching_.begin(), watching_.end(), [&](const watcher& w) { return w.g == &kv.second; });
    });
    if (idle == gates_.end())
      fail(errc::busy, "xfer.stream_order", describe(s),
           fmt::format("{} streams already have stream-ordered work in flight", gate_count));
    g = idle->second;
    gates_.erase(idle);
  }
  return order(std::move(l), gates_.emplace(key, g).first->second);
}

void stream_gates::release(gate& g, std::uint32_t seq) {
  std::lock_guard l(mu_);
  g.ended.insert(seq);
  while (g.ended.count(g.released + 1)) g.ended.erase(++g.released);
  std::atomic_ref<std::uint32_t>(*g.finished).store(g.released, std::memory_order_release);
}

void stream_gates::watch(gate& g, std::uint32_t seq, deadline until, std::function<bool()> cancelled,
                         std::function<void(bool)> then) {
  {
    std::lock_guard l(mu_);
    watching_.push_back({&g, seq, until, std::move(cancelled), std::move(then)});
    if (!watch_.take()) return;  // the watching task runs, and sees it
  }
  try {
    watch_.start(mu_, [this] { run(); });
  } catch (const std::exception& e) {
    // Nothing can watch: what is watched ends unreached (its batch fails; its number is released).
    log::warn("xfer", "stream-ordered work cannot be watched ({}); it fails", e.what());
    std::vector<watcher> gone;
    {
      std::lock_guard l(mu_);
      gone.swap(watching_);
    }
    for (auto& w : gone) w.then(false);
  }
}

// Polls the `started` words of what is watched: the stream's own work decides when, so there is
// nothing to block on. A short sleep between looks, well below the time of a copy (the executor's
// workers sleep with a fine timer slack). Ends when nothing is left to watch.
void stream_gates::run() {
  using namespace std::chrono_literals;
  detail::backoff wait({.nap = 10us, .most = 10us});
  std::unique_lock l(mu_);
  for (;;) {
    if (stop_ || watching_.empty()) {
      watch_.give_back();
      return;
    }
    auto now = std::chrono::steady_clock::now();
    std::vector<std::pair<std::function<void(bool)>, bool>> fire;
    for (auto it = watching_.begin(); it != watching_.end();) {
      auto v = std::atomic_ref<std::uint32_t>(*it->g->started).load(std::memory_order_acquire);
      bool reached = static_cast<std::int32_t>(v - it->seq) >= 0;
      if (!reached && now < it->until && !(it->cancelled && it->cancelled())) {
        ++it;
        continue;
      }
      fire.emplace_back(std::move(it->then), reached);
      it = watching_.erase(it);
    }
    if (fire.empty()) {
      l.unlock();
      wait.pause();
      l.lock();
      continue;
    }
    l.unlock();
    for (auto& [f, reached] : fire) f(reached);
    l.lock();
  }
}

}  // namespace ferry
