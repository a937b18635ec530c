#pragma once
// The host side of GPU-initiated access: a proxy that drains request rings (ring.hpp), each on a thread
// of its own, and serves each request from its source -- a local file or a ferry:// file -- through the
// file engine, straight into (or from) the requester's memory, then answers in the ticket's answer
// word (host memory the requester polls, stored after the data is in place). Sources
// fail as statuses in the kernel (the message stays here: errors()); every request has a deadline.
// docs/design/gpu-access.md.
#include <ferry/core/export.hpp>
#include <ferry/device/device.hpp>
#include <ferry/gpu/ring.hpp>
#include <ferry/gpu/settings.hpp>
#include <ferry/io/file_engine.hpp>

#include <chrono>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace ferry::gpu {

// Who fills the ring: kernels on the proxy's device (`tail` and the credits in device memory) or
// host threads (in host memory: CPU requesters, and the tests).
enum class requesters { device, host };

struct FERRY_API proxy_options {
  std::uint32_t slots = gpu_settings{}.gpu_ring_slots;  // per ring, a power of two
  std::uint32_t rings = gpu_settings{}.gpu_proxy_rings;  // each with its own proxy thread
  std::uint32_t batch = gpu_settings{}.gpu_proxy_batch;  // requests taken and served together, at most
  requesters by = requesters::device;
  std::chrono::nanoseconds deadline = core_settings{}.deadline;  // per request
  static proxy_options from(const gpu_settings& s);
};

struct proxy_stats {
  std::uint64_t requests = 0;  // taken from the ring
  std::uint64_t bytes = 0;     // moved by requests that succeeded
  std::uint64_t failed = 0;    // answered with an error status
  std::uint64_t batches = 0;   // requests / batches: how many the proxy took at a time
  // From when the proxy took a request to when its answer was on its way (the requester's own wait
  // adds the ring and the answer's trip): percentiles over every request so far, each within a
  // factor of two (log2 buckets), in nanoseconds.
  std::uint64_t latency_p50_ns = 0, latency_p99_ns = 0;
  // The proxy threads' time taking requests and handing them on (summed over its threads), and the
  // proxy's time alive: busy_ns / (threads x alive_ns) is the share of their time they worked.
  std::uint64_t busy_ns = 0, alive_ns = 0;
  std::uint32_t threads = 0;
};

class FERRY_API proxy {
 public:
  // Starts serving at once. The device is where the requesters' kernels run (or, for host
  // requesters, the device whose host memory holds the ring); `files` serves the requests. Both
  // must outlive the proxy.
  proxy(file_engine& files, device& dev, proxy_options o = {});
  // Stops taking requests and waits (up to the deadline) for those under way; requests still in
  // the ring get no answer (their waits end at their own deadlines).
  ~proxy();
  proxy(const proxy&) = delete;
  proxy& operator=(const proxy&) = delete;

  // A source requests name by the returned index; it stays open while the proxy lives. Add sources
  // before launching the kernels that use them: settling how a source is served may wait for the
  // device's running kernels (file_engine::prepare).
  std::uint32_t add(std::shared_ptr<file> f);
  // What requesters pass around (to a kernel by value): the rings' slots, tails and credits.
  ring_view view() const noexcept;
  // `n` answer words for requesters (request::done), zeroed: host memory mapped for the device and
  // the CPU at one address, stored into by the proxy with plain CPU stores. The proxy answers only
  // into words it handed out: a request naming any other address is not served and gets no answer
  // (its requester's wait ends at its deadline; errors() says why). They live as long as the proxy.
  std::span<std::uint32_t> answer_words(std::size_t n);
  proxy_stats stats() const;
  // Why failed requests failed (the requester sees only a status), the latest 64, oldest first.
  std::vector<std::string> errors() const;

  struct impl;

 private:
  std::unique_ptr<impl> impl_;
};

}  // namespace ferry::gpu
