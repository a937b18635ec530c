#include <ferry/xfer/staged_copies.hpp>

#include "core/logging.hpp"

#include <atomic>
#include <memory>
#include <optional>
#include <utility>

namespace ferry {

void staged_copies::start(std::span<const transfer_request> copies, deadline until, completion done) noexcept {
  {
    std::lock_guard l(mu_);
    running_++;
  }
  // Exactly once: a completion that ran inside submit, which then threw, is not told again.
  struct once {
    completion done;
    std::atomic<bool> told{false};
  };
  auto d = std::make_shared<once>();
  d->done = std::move(done);
  auto tell = [this, d](const error* e) {
    if (d->told.exchange(true)) return;
    try {
      if (d->done) d->done(e);
    } catch (const std::exception& x) {  // (a completion's own failure must not keep wait() waiting)
      log::error("xfer", "a staged copy's completion failed: {}", x.what());
    }
    ended();
  };
  try {
    engine_.submit(copies, {until}, [tell](std::span<const request_result> res) {
      std::optional<error> err;
      for (const request_result& x : res)
        if (!err && x.state != request_state::done)
          err = x.err ? *x.err : error(errc::internal, "xfer.staged_copy", "", "the copy did not finish");
      tell(err ? &*err : nullptr);
    });
  } catch (const error& e) {
    tell(&e);
  } catch (const std::exception& e) {
    const error x(errc::internal, "xfer.staged_copy", "", e.what());
    tell(&x);
  }
}

void staged_copies::ended() noexcept {
  std::lock_guard l(mu_);
  if (--running_ == 0) idle_.notify_all();
}

void staged_copies::wait() noexcept {
  std::unique_lock l(mu_);
  idle_.wait(l, [&] { return running_ == 0; });
}

std::uint64_t staged_copies::running() const noexcept {
  std::lock_guard l(mu_);
  return running_;
}

}  // namespace ferry
