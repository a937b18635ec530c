// This thread's interrupt check (include/ferry/core/interrupt.hpp).
#include <ferry/core/interrupt.hpp>

namespace ferry {

namespace {
thread_local interrupt_scope* current = nullptr;
thread_local bool asking = false;  // a check that itself waits on an interruptible call asks no further
}  // namespace

interrupt_scope::interrupt_scope(std::function<bool()> check) : check_(std::move(check)), outer_(current) { current = this; }
interrupt_scope::~interrupt_scope() {
  if (current == this) current = outer_;  // scopes end in the reverse order of their making
}

bool interrupted() noexcept {
  if (!current || asking || !current->check_) return false;
  asking = true;
  struct reset {
    ~reset() { asking = false; }
  } r;
  try {
    return current->check_();
  } catch (...) {
    return true;  // a check that fails cannot say the caller wants to go on; and nothing may unwind through C
  }
}

bool interruptible() noexcept { return current != nullptr; }

}  // namespace ferry
