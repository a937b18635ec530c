#pragma once
// A caller's way to end this thread's blocking calls early (Ctrl-C in Python): while an
// interrupt_scope lives, the waits of calls made on this thread that can stop early (an http://
// open's HEAD, a ferry:// stat or listing) ask its check now and then, and end with errc::cancelled
// when it says yes. The check runs on this thread, within those waits, with none of ferry's locks
// held; a check that throws counts as a yes. Scopes nest and end in the reverse order of their making
// (on the stack).
#include <ferry/core/export.hpp>

#include <functional>

namespace ferry {

class FERRY_API interrupt_scope {
 public:
  explicit interrupt_scope(std::function<bool()> check);
  ~interrupt_scope();
  interrupt_scope(const interrupt_scope&) = delete;
  interrupt_scope& operator=(const interrupt_scope&) = delete;

 private:
  friend bool interrupted() noexcept;
  std::function<bool()> check_;
  interrupt_scope* outer_;
};

// This thread's check, asked now: false without a scope.
FERRY_API bool interrupted() noexcept;
// Whether this thread has a scope (a wait may then slice itself to ask it).
FERRY_API bool interruptible() noexcept;

}  // namespace ferry
