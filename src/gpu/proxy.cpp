// The host proxy of GPU-initiated access (see include/ferry/gpu/proxy.hpp).
#include <ferry/core/error.hpp>
#include <ferry/gpu/proxy.hpp>
#include <ferry/io/file_engine.hpp>

#include "core/backoff.hpp"
#include "core/logging.hpp"
#include "gpu/region.hpp"

#include <fmt/format.h>

#include <pthread.h>

#include <algorithm>
#include <bit>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

namespace ferry::gpu {

proxy_options proxy_options::from(const gpu_settings& s) {
  proxy_options o;
  o.slots = s.gpu_ring_slots;
  o.rings = s.gpu_proxy_rings;
  o.batch = s.gpu_proxy_batch;
  o.deadline = s.deadline;
  return o;
}

struct proxy::impl {
  file_engine& files;
  device& dev;
  proxy_options o;
  // The rings' memory: slots (and, for host requesters, each ring's tail and credits) in host memory
  // mapped for the CPU and the device at one address; for kernels, the tails and credits in device
  // memory.
  region host, tail;
  ring_view v;

  mutable std::mutex mu;
  std::vector<std::shared_ptr<file>> sources;  // mu
  std::vector<region> words;                   // mu: the answer words handed out
  std::deque<std::string> errs;                // mu
  proxy_stats s;                               // mu
  std::uint64_t in_flight = 0;                 // mu
  std::uint64_t latency[64] = {};              // mu: requests by log2 of their latency in ns
  std::atomic<std::uint64_t> busy_ns{0};
  const std::chrono::steady_clock::time_point born = std::chrono::steady_clock::now();
  std::condition_variable idle;
  std::atomic<bool> stop{false};
  std::vector<std::thread> th;  // one per ring

  impl(file_engine& fe, device& d, proxy_options opt) : files(fe), dev(d), o(opt) {
    expects(o.slots >= 2 && o.slots <= (1u << 24) && (o.slots & (o.slots - 1)) == 0, "gpu.proxy",
            fmt::format("{} slots", o.slots), "a ring's slots must be a power of two from 2 to 2^24");
    expects(o.batch >= 1, "gpu.proxy", "batch=0", "a batch takes at least one request");
    expects(o.rings >= 1 && o.rings <= 256 && (o.rings & (o.rings - 1)) == 0, "gpu.proxy", fmt::format("{} rings", o.rings),
            "a power of two from 1 to 256 rings");
    const std::uint64_t words_at = std::uint64_t{o.slots} * o.rings * sizeof(slot), words_bytes = o.rings * sizeof(ring_words);
    host = region(dev, words_at + words_bytes, requesters::host);
    v.slots = host.va.at<slot>(0);
    v.capacity = o.slots;
    v.rings = o.rings;
    init(v.slots, o.slots, o.rings);
    std::vector<ring_words> w(o.rings);
    init(w.data(), o.slots, o.rings);
    if (o.by == requesters::host) {
      v.words = host.va.at<ring_words>(words_at);
      std::memcpy(static_cast<void*>(v.words), w.data(), words_bytes);
    } else {
      tail = region(dev, words_bytes, requesters::device);
      v.words = tail.va.at<ring_words>(0);
      auto st = dev.create_stream();
      st->copy(v.words, w.data(), words_bytes);
      st->synchronize(deadline_after(o.deadline));
    }
    spare.resize(o.rings);
    // Dedicated, not the executor's: each polls its ring's memory for as long as the proxy lives.
    for (std::uint32_t k = 0; k < o.rings; ++k)
      th.emplace_back([this, k] {
        ::pthread_setname_np(::pthread_self(), "ferry-gpu-proxy");  // for top, perf and debuggers (15 characters at most)
        serve(k);
      });
  }

  ~impl() {
    stop = true;
    for (auto& t : th) t.join();
    // Batches end by their deadline; a piece running then stops at its own: twice the deadline
    // (at least a second) covers both.
    std::unique_lock l(mu);
    if (!idle.wait_for(l, 2 * std::max<std::chrono::nanoseconds>(o.deadline, std::chrono::seconds(1)), [&] { return in_flight == 0; }))
      log::error("gpu", "{}: {} requests still under way when the proxy went", dev.id(), in_flight);
  }

  // Under mu: whether r's answer word is one this proxy handed out.
  bool answerable(const request& r) const {
    if (r.done % alignof(std::uint32_t)) return false;
    for (const region& w : words) {
      const auto base = reinterpret_cast<std::uint64_t>(w.va.base());
      if (r.done >= base && r.done - base <= w.bytes - sizeof(std::uint32_t)) return true;
    }
    return false;
  }

  // Under mu.
  void note(const request& r, std::uint64_t ticket, const std::string& why) {
    s.failed++;
    errs.push_back(fmt::format("request {} of ring {} (source {}, offset {}, {} bytes): {}", ticket & ((1ull << ring_shift) - 1),
                               ring_of(ticket), r.source, r.offset, r.bytes, why));
    if (errs.size() > 64) errs.pop_front();
  }

  void failed(const request& r, std::uint64_t ticket, status sta, const std::string& why) {
    {
      std::lock_guard l(mu);
      note(r, ticket, why);
    }
    give(r, ticket, sta, o.rings);
  }

  // A batch handed to the file engine: its requests, to answer each, and when they were taken.
  // Used again once its completion has run, so that a ring's thread allocates nothing per batch
  // once it has as many as it keeps under way (the completion runs on an engine thread; memory
  // allocated by one thread and freed by another is what a busy proxy would otherwise pay for).
  struct batch_rec {
    std::uint32_t ring = 0;
    std::vector<std::pair<request, std::uint64_t>> taken;
    std::chrono::steady_clock::time_point taken_at;
  };
  std::vector<std::unique_ptr<batch_rec>> recs;  // mu: every record made
  std::vector<std::vector<batch_rec*>> spare;    // mu: per ring, records whose completion has run

  // What a ring's thread builds per batch, kept for the next one.
  struct scratch {
    std::vector<request> rs;
    std::vector<std::uint64_t> tickets;
    std::vector<file_request> frs;
    std::vector<char> fate;
  };

  // Serves the requests taken together as one file-engine batch: one submission and one
  // completion for all of them (the engine reads them concurrently); each gets its own answer.
  void serve_batch(std::uint32_t k, scratch& w, const std::vector<request>& rs, const std::vector<std::uint64_t>& tickets,
                   std::chrono::steady_clock::time_point taken_at) {
    w.frs.clear();
    // Each request's source, and whether it can be served at all, under one lock. The first
    // request served of each run of one source carries an owning reference (the file engine's batch
    // keeps it: a batch that outlives the proxy still has its files); the others point without
    // owning, so no reference count is touched per request.
    enum : char { serve, unanswerable, no_source, bad_op };
    w.fate.resize(rs.size());
    batch_rec* rec = nullptr;
    {
      std::lock_guard l(mu);
      const file* last = nullptr;
      for (std::size_t i = 0; i < rs.size(); ++i) {
        const request& r = rs[i];
        w.fate[i] = !answerable(r) ? unanswerable : r.source >= sources.size() ? no_source
                  : r.kind != op::read && r.kind != op::write ? bad_op : serve;
        if (w.fate[i] == unanswerable)
          note(r, tickets[i], fmt::format("answer word {:#x} is not one of the proxy's (answer_words): not served", r.done));
        if (w.fate[i] != serve) continue;
        file* f = sources[r.source].get();
        w.frs.push_back({f == last ? std::shared_ptr<file>(std::shared_ptr<file>{}, f) : sources[r.source], r.offset,
                         reinterpret_cast<void*>(r.addr), r.bytes, r.kind == op::write});
        last = f;
      }
      if (!w.frs.empty()) {
        if (spare[k].empty()) {
          recs.push_back(std::make_unique<batch_rec>());
          spare[k].push_back(recs.back().get());
          recs.back()->ring = k;
        }
        rec = spare[k].back();
        spare[k].pop_back();
        in_flight++;
      }
    }
    if (rec) {
      rec->taken.clear();
      rec->taken_at = taken_at;
    }
    for (std::size_t i = 0; i < rs.size(); ++i) {
      const request& r = rs[i];
      if (w.fate[i] == no_source) failed(r, tickets[i], status::failed, fmt::format("no source {}", r.source));
      if (w.fate[i] == bad_op) failed(r, tickets[i], status::failed, fmt::format("unknown operation {}", static_cast<unsigned>(r.kind)));
      if (w.fate[i] == serve) rec->taken.emplace_back(r, tickets[i]);
    }
    if (!rec) return;
    transfer_options to;
    to.until = deadline_after(o.deadline);
    // Captures two pointers: std::function keeps it without an allocation.
    auto finished = [this, rec](std::span<const request_result> res) {
      std::uint64_t ok_bytes = 0;
      for (std::size_t i = 0; i < res.size(); ++i) {
        const auto& [r, ticket] = rec->taken[i];
        const request_result& x = res[i];
        if (x.state == request_state::done && x.bytes_done == r.bytes) {
          give(r, ticket, status::ok, o.rings);
          ok_bytes += r.bytes;
        } else if (x.state == request_state::done) {
          failed(r, ticket, status::out_of_range, fmt::format("only {} bytes exist there", x.bytes_done));
        } else {
          failed(r, ticket, x.state == request_state::timed_out ? status::timed_out : status::failed,
                 x.err ? x.err->what() : std::string("failed"));
        }
      }
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - rec->taken_at).count();
      std::lock_guard l(mu);
      latency[std::bit_width(static_cast<std::uint64_t>(std::max<std::int64_t>(ns, 1))) - 1] += res.size();
      s.bytes += ok_bytes;
      spare[rec->ring].push_back(rec);
      in_flight--;
      idle.notify_all();
    };
    try {
      files.submit(w.frs, to, finished);
      w.frs.clear();  // the batch holds what it needs of the files
    } catch (const std::exception& e) {
      // Refused before anything started (bad memory, a closed source): the batch again one by one,
      // so that only the requests at fault fail.
      w.frs.clear();
      std::vector<std::pair<request, std::uint64_t>> again;
      again.swap(rec->taken);
      {
        std::lock_guard l(mu);
        spare[k].push_back(rec);
        in_flight--;
        idle.notify_all();
      }
      if (again.size() == 1) return failed(again[0].first, again[0].second, status::failed, e.what());
      for (const auto& [r, ticket] : again) serve_batch(k, w, {r}, {ticket}, taken_at);
    }
  }

  // Ring k's thread: takes the requests there are (at most a batch), serves them together; when
  // there are none, yields for a while, then sleeps in short naps, and after a longer quiet in longer
  // ones (a request waits at most one nap; only the first after a quiet meets a long one).
  void serve(std::uint32_t k) {
    const ring_view mine = v.ring(k);
    const std::uint64_t ring_bits = std::uint64_t{k} << ring_shift;
    std::uint64_t head = 0;
    using namespace std::chrono_literals;
    ferry::detail::backoff quiet({.yield = 1ms, .nap = 50us, .most = 50us, .long_after = 100ms, .long_nap = 1ms});
    scratch w;
    std::vector<request>& rs = w.rs;
    std::vector<std::uint64_t>& tickets = w.tickets;
    request r;
    while (!stop.load(std::memory_order_relaxed)) {
      rs.clear();
      tickets.clear();
      while (rs.size() < o.batch && take(mine, head, r)) {
        rs.push_back(r);
        tickets.push_back(ring_bits | (head - 1));
      }
      if (!rs.empty()) {
        const auto t0 = std::chrono::steady_clock::now();
        {
          std::lock_guard l(mu);
          s.requests += rs.size();
          s.batches++;
        }
        serve_batch(k, w, rs, tickets, t0);
        busy_ns += static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
        quiet.reset();
        continue;
      }
      quiet.pause();
    }
  }
};

proxy::proxy(file_engine& files, device& dev, proxy_options o) : impl_(std::make_unique<impl>(files, dev, o)) {}
proxy::~proxy() = default;

std::uint32_t proxy::add(std::shared_ptr<file> f) {
  expects(f != nullptr, "gpu.proxy", "source", "a null file");
  impl_->files.prepare(*f, impl_->dev);
  std::lock_guard l(impl_->mu);
  impl_->sources.push_back(std::move(f));
  return static_cast<std::uint32_t>(impl_->sources.size() - 1);
}

ring_view proxy::view() const noexcept { return impl_->v; }

std::span<std::uint32_t> proxy::answer_words(std::size_t n) {
  expects(n >= 1, "gpu.proxy", "answer_words(0)", "at least one word");
  region w(impl_->dev, n * sizeof(std::uint32_t), requesters::host);
  auto* p = w.va.at<std::uint32_t>(0);
  std::memset(p, 0, w.bytes);
  std::lock_guard l(impl_->mu);
  impl_->words.push_back(std::move(w));
  return {p, n};
}

proxy_stats proxy::stats() const {
  std::lock_guard l(impl_->mu);
  proxy_stats r = impl_->s;
  std::uint64_t total = 0;
  for (auto n : impl_->latency) total += n;
  // The upper end of the bucket holding the given share of the requests.
  auto at = [&](double share) -> std::uint64_t {
    std::uint64_t seen = 0;
    for (int b = 0; b < 64; ++b) {
      seen += impl_->latency[b];
      if (total && static_cast<double>(seen) >= share * static_cast<double>(total)) return b >= 63 ? ~0ull : (2ull << b);
    }
    return 0;
  };
  r.latency_p50_ns = at(0.5);
  r.latency_p99_ns = at(0.99);
  r.busy_ns = impl_->busy_ns.load();
  r.threads = impl_->o.rings;
  r.alive_ns = static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - impl_->born).count());
  return r;
}

std::vector<std::string> proxy::errors() const {
  std::lock_guard l(impl_->mu);
  return {impl_->errs.begin(), impl_->errs.end()};
}

}  // namespace ferry::gpu
