#pragma once
// Launch callbacks through CUPTI's callback API, loaded at run time: every kernel launch of the
// driver and runtime APIs in the process (the user's kernels, torch's, ferry's own), graph launches,
// and the runtime API's copies and memsets (ferry never calls the runtime API: those are the
// user's), reported on the calling thread before the work is queued and after the call returns,
// with the stream the work goes to. CUPTI allows one subscriber per process: with a profiler
// attached (Nsight Systems, torch.profiler) watch() fails and says so. Only cupti_callbacks.h's and
// the generated parameter headers' types are used; ferry never links against libcupti.
#include <cuda.h>

#include <string>

namespace ferry::cuda::cupti {

class launch_sink {
 public:
  virtual ~launch_sink() = default;
  // Whether a call putting work on `stream` is reported (not while the stream captures a graph:
  // nothing runs then). Asked at the call's entry, the exit following that answer; one sink of the
  // call's context saying yes reports it to all of them.
  virtual bool reported(CUstream stream, bool known) noexcept = 0;
  // enter: before the work is queued; !enter: after the call returned (ok: it succeeded). On the
  // calling thread. `stream` is where the work goes (CU_STREAM_LEGACY / CU_STREAM_PER_THREAD for the
  // default streams); known is false for calls that name none (multi-device launches).
  virtual void on_launch(bool enter, CUstream stream, bool known, bool ok) noexcept = 0;
};

// Routes launches made in `ctx` to `sink` (subscribing once per process, the first library name
// wins). False, with the reason in `why`, when CUPTI cannot be loaded or subscribed.
bool watch(const std::string& library, CUcontext ctx, launch_sink& sink, std::string& why);
void unwatch(launch_sink& sink) noexcept;

}  // namespace ferry::cuda::cupti
