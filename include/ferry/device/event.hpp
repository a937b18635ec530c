#pragma once
// Deadlines of the accelerator interface's waits, and completion markers recorded on a stream
// (ferry/device/stream.hpp).
#include <ferry/core/export.hpp>

#include <chrono>
#include <string>

namespace ferry {

using deadline = std::chrono::steady_clock::time_point;
inline deadline deadline_after(std::chrono::nanoseconds d) { return std::chrono::steady_clock::now() + d; }

// Completion marker recorded on a stream.
class FERRY_API event {
 public:
  virtual ~event();
  // True once all work before the record point completed (successfully or not).
  bool done() { return do_query(); }
  // Waits until done or the deadline passes (then throws timeout naming the stream).
  void wait(deadline until);

 protected:
  event() = default;

 private:
  virtual bool do_query() = 0;
  virtual std::string do_describe() const = 0;
};

}  // namespace ferry
