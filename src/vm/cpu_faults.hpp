#pragma once
// The CPU's faults on a unified address space's pages (vm layer, its own sources only): one SIGSEGV
// handler per process hands an access inside a served range to that range's service thread through a
// pipe and waits for the answer; the thread asks the space to make the access possible. The handler
// is async-signal-safe (a table of ranges, write(2), a futex); what a fault does is the space's.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>

namespace ferry::vm {

// What a space does on its service thread.
class fault_target {
 public:
  // Makes the CPU's access at `addr` (inside the range) possible; false when it cannot (said in the
  // log by the space: the faulting thread then ends the process).
  virtual bool serve_fault(std::uintptr_t addr, bool write) noexcept = 0;
  // While no fault waits: one step of the space's own work (pages moved ahead of the CPU, pages
  // returned to a device).
  virtual void between_faults() noexcept = 0;
  // Whether a step is due at once; otherwise the thread waits a while for a fault before the next.
  virtual bool work_waiting() noexcept = 0;

 protected:
  ~fault_target() = default;
};

class cpu_fault_service {
 public:
  // Serves the CPU's faults in [base, base + size) with `target` on a thread of its own until it is
  // destroyed. A faulting thread waits `wait` for its answer before it ends the process with a
  // message. `name` names the space in the log. Throws busy when too many ranges are served at once.
  cpu_fault_service(std::uintptr_t base, std::uint64_t size, std::chrono::nanoseconds wait, fault_target& target, std::string name);
  // The range is no longer served (a fault there is the process's own again) and the thread ends.
  ~cpu_fault_service();
  cpu_fault_service(const cpu_fault_service&) = delete;
  cpu_fault_service& operator=(const cpu_fault_service&) = delete;

 private:
  void serve();
  std::uintptr_t base_;
  std::uint64_t size_;
  fault_target& target_;
  std::string name_;
  int pipe_rd_ = -1, pipe_wr_ = -1, slot_ = -1;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace ferry::vm
