// The host proxy of GPU-initiated access (see include/ferry/gpu/proxy.hpp).
#include <ferry/core/error.hpp>
#include <ferry/gpu/proxy.hpp>
#include <ferry/runtime.hpp>

#include "core/logging.hpp"

#include <fmt/format.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

namespace ferry::gpu {

proxy_options proxy_options::from(const settings& s) {
  proxy_options o;
  o.slots = s.gpu_ring_slots;
  o.deadline = s.deadline;
  return o;
}

struct proxy::impl {
  runtime& rt;
  device& dev;
  proxy_options o;
  // The ring's memory: slots (and, for host requesters, the tail) in a host chunk mapped for the
  // CPU and the device at one address; for kernels, the tail in a device chunk.
  va_range host_va, dev_va;
  physical_chunk host_chunk, dev_chunk;
  ring_view v;
  std::unique_ptr<stream> st;  // the answers to kernels: write-values after the data
  std::mutex st_mu;

  mutable std::mutex mu;
  std::vector<std::shared_ptr<file>> sources;  // mu
  std::deque<std::string> errs;                // mu
  proxy_stats s;                               // mu
  std::uint64_t in_flight = 0;                 // mu
  std::condition_variable idle;
  std::atomic<bool> stop{false};
  std::thread th;

  impl(runtime& r, device& d, proxy_options opt) : rt(r), dev(d), o(opt) {
    expects(o.slots >= 2 && (o.slots & (o.slots - 1)) == 0, "gpu.proxy", fmt::format("{} slots", o.slots),
            "a ring's slots must be a power of two, at least 2");
    const std::uint64_t g = dev.granularity();
    const std::uint64_t need = o.slots * sizeof(slot) + sizeof(std::uint64_t);
    const std::uint64_t bytes = (need + g - 1) / g * g;
    host_va = dev.reserve(bytes);
    host_chunk = dev.allocate(bytes, ferry::location::on_host());
    dev.map(host_va.base(), host_chunk);
    std::vector<access_desc> both{{ferry::location::on_device(dev.info().ordinal), access::read_write},
                                  {ferry::location::on_host(), access::read_write}};
    dev.set_access(host_va.base(), bytes, both);
    auto* slots = host_va.at<slot>(0);
    init(slots, o.slots);
    v.slots = slots;
    v.capacity = o.slots;
    st = dev.create_stream();
    if (o.by == requesters::host) {
      v.tail = host_va.at<std::uint64_t>(o.slots * sizeof(slot));
      *v.tail = 0;
    } else {
      dev_va = dev.reserve(g);
      dev_chunk = dev.allocate(g, ferry::location::on_device());
      dev.map(dev_va.base(), dev_chunk);
      std::vector<access_desc> gpu{{ferry::location::on_device(dev.info().ordinal), access::read_write}};
      dev.set_access(dev_va.base(), g, gpu);
      v.tail = dev_va.at<std::uint64_t>(0);
      static const std::uint64_t zero = 0;
      st->copy(v.tail, &zero, sizeof zero);
      st->synchronize(deadline_after(o.deadline));
    }
    th = std::thread([this] { serve(); });
  }

  ~impl() {
    stop = true;
    th.join();
    std::unique_lock l(mu);
    if (!idle.wait_for(l, o.deadline, [&] { return in_flight == 0; }))
      log::error("gpu", "{}: {} requests still under way when the proxy went", dev.id(), in_flight);
    l.unlock();
    try {
      st->synchronize(deadline_after(o.deadline));
    } catch (const std::exception& e) {
      log::error("gpu", "{}: the proxy's answers: {}", dev.id(), e.what());
    }
  }

  void answer_to(const request& r, std::uint64_t ticket, status sta) {
    std::uint32_t a = answer(ticket, sta);
    auto* word = reinterpret_cast<std::uint32_t*>(r.done);
    if (o.by == requesters::host) {
      std::atomic_ref<std::uint32_t>(*word).store(a, std::memory_order_release);
      return;
    }
    std::lock_guard l(st_mu);
    st->write_value(word, a);  // in the stream's order: after nothing but earlier answers (the data is in place)
  }

  void failed(const request& r, std::uint64_t ticket, status sta, const std::string& why) {
    {
      std::lock_guard l(mu);
      s.failed++;
      errs.push_back(fmt::format("request {} (source {}, offset {}, {} bytes): {}", ticket, r.source, r.offset, r.bytes, why));
      if (errs.size() > 64) errs.pop_front();
    }
    try {
      answer_to(r, ticket, sta);
    } catch (const std::exception& e) {
      log::error("gpu", "{}: answering request {} failed: {}", dev.id(), ticket, e.what());
    }
  }

  void serve_one(const request& r, std::uint64_t ticket) {
    std::shared_ptr<file> f;
    {
      std::lock_guard l(mu);
      s.requests++;
      if (r.source < sources.size()) f = sources[r.source];
    }
    if (!f) return failed(r, ticket, status::failed, fmt::format("no source {}", r.source));
    if (r.kind != op::read && r.kind != op::write)
      return failed(r, ticket, status::failed, fmt::format("unknown operation {}", static_cast<unsigned>(r.kind)));
    file_request fr{f, r.offset, reinterpret_cast<void*>(r.addr), r.bytes, r.kind == op::write};
    transfer_options to;
    to.until = deadline_after(o.deadline);
    {
      std::lock_guard l(mu);
      in_flight++;
    }
    try {
      rt.files().submit(std::span<const file_request>(&fr, 1), to, [this, r, ticket](std::span<const request_result> res) {
        const request_result& x = res[0];
        if (x.state == request_state::done && x.bytes_done == r.bytes) {
          {
            std::lock_guard l(mu);
            s.bytes += r.bytes;
          }
          try {
            answer_to(r, ticket, status::ok);
          } catch (const std::exception& e) {
            log::error("gpu", "{}: answering request {} failed: {}", dev.id(), ticket, e.what());
          }
        } else if (x.state == request_state::done) {
          failed(r, ticket, status::out_of_range, fmt::format("only {} bytes exist there", x.bytes_done));
        } else {
          failed(r, ticket, x.state == request_state::timed_out ? status::timed_out : status::failed,
                 x.err ? x.err->what() : std::string("failed"));
        }
        std::lock_guard l(mu);
        in_flight--;
        idle.notify_all();
      });
    } catch (const std::exception& e) {  // refused before it started (bad memory, closed source)
      {
        std::lock_guard l(mu);
        in_flight--;
        idle.notify_all();
      }
      failed(r, ticket, status::failed, e.what());
    }
  }

  // Takes requests while there are any; when there are none, yields for a while and then sleeps
  // in short naps (a request waits at most one nap).
  void serve() {
    std::uint64_t head = 0;
    auto last = std::chrono::steady_clock::now();
    request r;
    while (!stop.load(std::memory_order_relaxed)) {
      if (take(v, head, r)) {
        serve_one(r, head - 1);
        last = std::chrono::steady_clock::now();
        continue;
      }
      if (std::chrono::steady_clock::now() - last < std::chrono::milliseconds(1)) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
};

proxy::proxy(runtime& rt, device& dev, proxy_options o) : impl_(std::make_unique<impl>(rt, dev, o)) {}
proxy::~proxy() = default;

std::uint32_t proxy::add(std::shared_ptr<file> f) {
  expects(f != nullptr, "gpu.proxy", "source", "a null file");
  impl_->rt.files().prepare(*f, impl_->dev);
  std::lock_guard l(impl_->mu);
  impl_->sources.push_back(std::move(f));
  return static_cast<std::uint32_t>(impl_->sources.size() - 1);
}

ring_view proxy::view() const noexcept { return impl_->v; }

proxy_stats proxy::stats() const {
  std::lock_guard l(impl_->mu);
  return impl_->s;
}

std::vector<std::string> proxy::errors() const {
  std::lock_guard l(impl_->mu);
  return {impl_->errs.begin(), impl_->errs.end()};
}

}  // namespace ferry::gpu
