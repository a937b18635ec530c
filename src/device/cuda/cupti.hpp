#pragma once
// Kernel-launch callbacks through CUPTI's callback API, loaded at run time: every launch call of the
// driver and runtime APIs in the process (the user's kernels, torch's, ferry's own) is reported on
// the launching thread, before the launch is queued and after the call returns. CUPTI allows one
// subscriber per process: with a profiler attached (Nsight Systems, torch.profiler) watch() fails and
// says so. Only cupti_callbacks.h's types are used; ferry never links against libcupti.
#include <cuda.h>

#include <string>

namespace ferry::cuda::cupti {

class launch_sink {
 public:
  virtual ~launch_sink() = default;
  // enter: before the launch is queued; !enter: after the call returned. On the launching thread.
  virtual void on_launch(bool enter) noexcept = 0;
};

// Routes launches made in `ctx` to `sink` (subscribing once per process, the first library name
// wins). False, with the reason in `why`, when CUPTI cannot be loaded or subscribed.
bool watch(const std::string& library, CUcontext ctx, launch_sink& sink, std::string& why);
void unwatch(launch_sink& sink) noexcept;

}  // namespace ferry::cuda::cupti
