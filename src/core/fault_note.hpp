#pragma once
// What a thread is doing inside a library call that may fault on memory ferry manages (the CUDA
// driver copying into unified memory): set around the call, printed by the unified-memory fault
// handler when the fault ends the process, so that the message names the copy and not only the page.
// Plain thread-local words. libferry is often dlopen'ed (Python), so they are dynamic TLS: on a thread
// that has set them once (every thread a driver copy faults on) reading them in the signal handler
// touches no allocator; on another thread the first read may allocate, which the handler only does on
// its way to abort (bounded by its alarm).
#include <cstdint>

namespace ferry::fault_note {

struct note {
  const char* what = nullptr;  // null: no call under way
  std::uintptr_t dst = 0, src = 0;
  std::uint64_t bytes = 0;
};

inline thread_local note current;

// Sets the note for the scope of one call.
class scope {
 public:
  scope(const char* what, const void* dst, const void* src, std::uint64_t bytes) noexcept {
    current = {what, reinterpret_cast<std::uintptr_t>(dst), reinterpret_cast<std::uintptr_t>(src), bytes};
  }
  ~scope() { current.what = nullptr; }
  scope(const scope&) = delete;
  scope& operator=(const scope&) = delete;
};

}  // namespace ferry::fault_note
