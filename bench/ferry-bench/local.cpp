// `ferry-bench local`: ferry's transfer engine next to the CUDA baseline measured in the same run,
// on the same kind of memory, for every local path and size. Ratios > 1 mean ferry is faster.
//
// Baselines (CUDA runtime, loaded at run time): cudaMemcpy from pinned memory (cudaMallocHost),
// cudaMemcpy from pageable memory, cudaMemcpy device-to-device, cudaMemcpyPeer (peer access
// enabled). ferry copies between buffers of the same kind; for pageable memory it uses separate
// buffers of its own (once ferry has registered a buffer, the baseline would see pinned memory).
// "ferry first" is the first copy of a never-seen pageable buffer (bounce path, no registration);
// the steady-state figure is after registration, as a loop over the same buffer (like the baseline).
#include "bench.hpp"
#include "cudart.hpp"
#include "endpoint.hpp"

#include <ferry/core/units.hpp>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <sys/mman.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <sstream>

namespace ferry::cli {
namespace {

using json = nlohmann::ordered_json;
using fn = std::function<void()>;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Best-of-`trials` bandwidth of `iters` back-to-back calls of f (each call moves `bytes`).
double measure(const fn& f, const fn& sync, std::uint64_t bytes, int iters, int trials) {
  double best = 0;
  for (int t = 0; t < trials; ++t) {
    sync();
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) f();
    sync();
    best = std::max(best, static_cast<double>(bytes) * iters / seconds_since(t0));
  }
  return best;
}

// The same for a baseline and ferry, their trials taken in turn (baseline, ferry, baseline, ...) so
// that a drift of the machine during the run (clocks, other load) touches both alike; best of each.
std::pair<double, double> measure_pair(const fn& base, const fn& ferry, const fn& sync, std::uint64_t bytes, int iters,
                                       int trials) {
  double b = 0, f = 0;
  for (int t = 0; t < trials; ++t) {
    b = std::max(b, measure(base, sync, bytes, iters, 1));
    f = std::max(f, measure(ferry, sync, bytes, iters, 1));
  }
  return {b, f};
}

struct host_buffer {
  void* p = nullptr;
  std::size_t n = 0;
  explicit host_buffer(std::size_t bytes) : n(bytes) {
    p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) fail_errno(errno, "bench", "host buffer", format_size(n));
    std::memset(p, 1, n);
  }
  ~host_buffer() { ::munmap(p, n); }
  std::byte* data() const { return static_cast<std::byte*>(p); }
};

std::vector<std::uint64_t> parse_sizes(const std::string& list) {
  std::vector<std::uint64_t> v;
  std::stringstream ss(list);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(parse_size(item, "--sizes"));
  expects(!v.empty(), "bench", "--sizes", "empty list");
  return v;
}

}  // namespace

int run_bench_local(runtime& rt, const bench_options& o) {
  std::vector<std::uint64_t> sizes = parse_sizes(o.sizes);
  std::uint64_t budget = parse_size(o.budget, "--budget");
  transfer_engine& eng = rt.engine();
  json rows = json::array();
  std::string device_name = o.device.empty() ? rt.devices().default_device().id() : o.device;
  device& dev = rt.devices().get(device_name);
  bool cuda = dev.info().backend == device_kind::cuda;
  cudart cr;
  if (cuda && !cr.ok()) fail(errc::unavailable, "bench local", "cudart", cr.why);
  if (!o.json)
    fmt::print("ferry-bench local on {} ({}){}; {} engine workers\n", dev.id(), dev.info().name,
               cuda ? "" : " — simulated device: numbers are NOT performance figures", eng.workers());

  // Two device buffers of the largest size are held at once; sizes that do not fit in the device's
  // free memory (with room left for the driver and the engine) are skipped, not run out of memory.
  std::uint64_t free_bytes = dev.memory().free;
  std::uint64_t fits = free_bytes / 2 - free_bytes / 8;
  std::vector<std::uint64_t> skipped;
  std::erase_if(sizes, [&](std::uint64_t n) {
    if (n <= fits) return false;
    skipped.push_back(n);
    return true;
  });
  if (!skipped.empty() && !o.json) {
    std::string list;
    for (auto n : skipped) list += (list.empty() ? "" : ", ") + format_size(n);
    fmt::print("skipped sizes {}: two buffers of each do not fit in {}'s {} free\n", list, dev.id(), format_size(free_bytes));
  }
  if (sizes.empty()) fail(errc::out_of_memory, "bench local", dev.id(), fmt::format("no size in --sizes fits in {} free", format_size(free_bytes)));
  std::uint64_t max_size = *std::max_element(sizes.begin(), sizes.end());

  auto iters_for = [&](std::uint64_t n) { return static_cast<int>(std::clamp<std::uint64_t>(budget / n, 2, 2000)); };
  struct path_case {
    std::string name, baseline;
    std::byte *dst, *src;            // ferry
    std::byte *bdst, *bsrc;          // baseline
    std::function<void(std::uint64_t)> base;
    bool pageable;
  };
  std::vector<path_case> cases;

  // Buffers.
  std::unique_ptr<endpoint> d0a, d0b, d1;
  std::unique_ptr<host_buffer> pg_base, pg_ferry;
  void* pinned = nullptr;
  void *cd0 = nullptr, *cd0b = nullptr, *cd1 = nullptr;
  int ordinal = dev.info().ordinal;
  int peer = -1;
  if (cuda) {
    cr.check(cr.set_device(ordinal), "cudaSetDevice");
    cr.check(cr.malloc_(&cd0, max_size), "cudaMalloc");
    cr.check(cr.malloc_(&cd0b, max_size), "cudaMalloc");
    cr.check(cr.malloc_host(&pinned, max_size), "cudaMallocHost");
    std::memset(pinned, 1, max_size);
    if (o.peer.empty()) {
      backend_status st = rt.devices().cuda_status();
      if (st.device_count > 1) peer = ordinal == 0 ? 1 : 0;
    } else {
      peer = rt.devices().get(o.peer).info().ordinal;
    }
    if (peer >= 0) {
      cr.check(cr.set_device(peer), "cudaSetDevice(peer)");
      cr.check(cr.malloc_(&cd1, max_size), "cudaMalloc(peer)");
      cr.enable_peer(ordinal, 0);  // an error here means "already enabled" or no access: measured anyway
      cr.check(cr.set_device(ordinal), "cudaSetDevice");
      cr.enable_peer(peer, 0);
    }
  } else {
    d0a = std::make_unique<endpoint>(rt, device_name, max_size);
    d0b = std::make_unique<endpoint>(rt, device_name, max_size);
  }
  pg_base = std::make_unique<host_buffer>(max_size);
  pg_ferry = std::make_unique<host_buffer>(max_size);
  auto dptr = [&](void* c, std::unique_ptr<endpoint>& e) { return cuda ? static_cast<std::byte*>(c) : e->data(); };
  std::byte* D0 = dptr(cd0, d0a);
  std::byte* D0b = dptr(cd0b, d0b);
  std::byte* P = static_cast<std::byte*>(pinned);
  // Without CUDA the baseline is the device's own stream copy (no engine).
  std::unique_ptr<stream> raw = cuda ? nullptr : dev.create_stream();
  auto memcpy_base = [&](std::byte* d, std::byte* s) {
    return [&, d, s](std::uint64_t n) {
      if (cuda) {
        cr.check(cr.memcpy_(d, s, n, cudart::default_kind), "cudaMemcpy");
      } else {
        raw->copy(d, s, n);
        raw->synchronize();
      }
    };
  };
  if (cuda) {
    cases.push_back({"h2d pinned", "cudaMemcpy pinned", D0, P, D0, P, memcpy_base(D0, P), false});
    cases.push_back({"d2h pinned", "cudaMemcpy pinned", P, D0, P, D0, memcpy_base(P, D0), false});
  }
  cases.push_back({"h2d pageable", cuda ? "cudaMemcpy pageable" : "stream copy", D0, pg_ferry->data(), D0, pg_base->data(),
                   memcpy_base(D0, pg_base->data()), true});
  cases.push_back({"d2h pageable", cuda ? "cudaMemcpy pageable" : "stream copy", pg_ferry->data(), D0, pg_base->data(), D0,
                   memcpy_base(pg_base->data(), D0), true});
  if (cuda) cases.push_back({"d2d same gpu", "cudaMemcpy d2d", D0b, D0, D0b, D0, memcpy_base(D0b, D0), false});
  // One copy at a time, waited for: what a caller that needs the data next pays per copy. The
  // baseline is cudaMemcpyAsync + cudaStreamSynchronize on a stream of its own.
  void* bstream = nullptr;
  if (cuda) {
    cr.check(cr.stream_create(&bstream), "cudaStreamCreate");
    auto async_base = [&](std::byte* d, std::byte* s) {
      return [&, d, s](std::uint64_t n) {
        cr.check(cr.memcpy_async(d, s, n, cudart::default_kind, bstream), "cudaMemcpyAsync");
        cr.check(cr.stream_sync(bstream), "cudaStreamSynchronize");
      };
    };
    cases.push_back({"1 copy h2d", "cudaMemcpyAsync+sync", D0, P, D0, P, async_base(D0, P), false});
    cases.push_back({"1 copy d2h", "cudaMemcpyAsync+sync", P, D0, P, D0, async_base(P, D0), false});
    cases.push_back({"1 copy d2d", "cudaMemcpyAsync+sync", D0b, D0, D0b, D0, async_base(D0b, D0), false});
  }
  if (cuda && peer >= 0) {
    auto* D1 = static_cast<std::byte*>(cd1);
    cases.push_back({fmt::format("gpu{}->gpu{}", ordinal, peer), "cudaMemcpyPeer", D1, D0, D1, D0,
                     [&, D1, D0](std::uint64_t n) { cr.check(cr.memcpy_peer(D1, peer, D0, ordinal, n), "cudaMemcpyPeer"); },
                     false});
    // Waited for, as the other "1 copy" rows: the copy on a stream of the source device (peer
    // access on, so the copy engines move it over the link).
    cases.push_back({fmt::format("1 copy gpu{}->gpu{}", ordinal, peer), "cudaMemcpyAsync+sync", D1, D0, D1, D0,
                     [&, D1, D0](std::uint64_t n) {
                       cr.check(cr.memcpy_async(D1, D0, n, cudart::default_kind, bstream), "cudaMemcpyAsync");
                       cr.check(cr.stream_sync(bstream), "cudaStreamSynchronize");
                     },
                     false});
  }

  fn sync = [&] {
    if (cuda) cr.check(cr.sync(), "cudaDeviceSynchronize");
  };
  if (!o.json)
    fmt::print("{:<14} {:>9}  {:<20} {:>10} {:>10} {:>7}  {:<10}  {}\n", "path", "size", "baseline", "base GB/s",
               "ferry GB/s", "ratio", "ferry path", "ferry first copy GB/s (path)");
  for (auto& c : cases) {
    for (std::uint64_t n : sizes) {
      int iters = iters_for(n);
      // The first copy of a never-seen pageable range: bounce, no registration (offset into the
      // ferry buffer that no earlier size touched is not possible for every size; use the timing of
      // the very first call for this size on a range not yet registered).
      double first = 0;
      transfer_path path = transfer_path::none;
      {
        auto t0 = std::chrono::steady_clock::now();
        transfer_request r{c.dst, c.src, n};
        transfer_batch b = eng.submit({&r, 1});
        b.wait();
        b.check();
        first = static_cast<double>(n) / seconds_since(t0);
        path = b.results()[0].path;
      }
      // Steady state: warm up (registration happens here for pageable ranges), then measure.
      transfer_path steady = path;
      for (int w = 0; w < 2; ++w) {
        transfer_request r{c.dst, c.src, n};
        transfer_batch b = eng.submit({&r, 1});
        b.wait();
        b.check();
        steady = b.results()[0].path;
      }
      c.base(n);  // the baseline's first call, like ferry's above, is not measured
      auto [base, fer] = measure_pair([&] { c.base(n); }, [&] { eng.copy(c.dst, c.src, n); }, sync, n, iters, o.trials);
      double ratio = base > 0 ? fer / base : 0;
      rows.push_back({{"path", c.name}, {"bytes", n}, {"baseline", c.baseline}, {"baseline_gbps", base / 1e9},
                      {"ferry_gbps", fer / 1e9}, {"ratio", ratio}, {"ferry_path", to_string(steady)},
                      {"ferry_first_gbps", first / 1e9}, {"ferry_first_path", to_string(path)}, {"iters", iters}});
      if (!o.json)
        fmt::print("{:<14} {:>9}  {:<20} {:>10.2f} {:>10.2f} {:>6.2f}x  {:<10} {:>6.2f} ({})\n", c.name, format_size(n),
                   c.baseline, base / 1e9, fer / 1e9, ratio, to_string(steady), first / 1e9, to_string(path));
    }
  }

  // Scattered blocks (a KV cache's): `count` blocks between random slots of a pinned host pool and a
  // device pool, both directions, one batch; next to one cudaMemcpyAsync per block and to
  // cudaMemcpyBatchAsync, each on a stream of its own and synchronized once.
  if (cuda) {
    struct shape {
      std::uint64_t block;
      std::size_t count;
    };
    for (shape sh : {shape{64ull << 10, 4096}, shape{2ull << 20, 1024}}) {
      std::uint64_t pool = sh.block * sh.count;
      if (pool * 2 > dev.memory().free / 2) continue;
      void *hp = nullptr, *dp = nullptr;
      cr.check(cr.malloc_host(&hp, pool), "cudaMallocHost");
      cr.check(cr.malloc_(&dp, pool), "cudaMalloc");
      std::memset(hp, 3, pool);
      std::vector<std::size_t> slot(sh.count);
      for (std::size_t i = 0; i < sh.count; ++i) slot[i] = i;
      std::uint64_t x = 88172645463325252ull;  // xorshift: a fixed random permutation
      for (std::size_t i = sh.count - 1; i > 0; --i) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        std::swap(slot[i], slot[x % (i + 1)]);
      }
      for (bool h2d : {true, false}) {
        std::vector<void*> dsts(sh.count);
        std::vector<const void*> srcs(sh.count);
        std::vector<std::size_t> lens(sh.count, sh.block);
        std::vector<transfer_request> reqs(sh.count);
        for (std::size_t i = 0; i < sh.count; ++i) {
          auto* h = static_cast<std::byte*>(hp) + i * sh.block;
          auto* d = static_cast<std::byte*>(dp) + slot[i] * sh.block;
          dsts[i] = h2d ? static_cast<void*>(d) : h;
          srcs[i] = h2d ? static_cast<const void*>(h) : d;
          reqs[i] = {dsts[i], srcs[i], sh.block};
        }
        fn none = [] {};
        fn per_block_f = [&] {
          for (std::size_t i = 0; i < sh.count; ++i)
            cr.check(cr.memcpy_async(dsts[i], srcs[i], sh.block, cudart::default_kind, bstream), "cudaMemcpyAsync");
          cr.check(cr.stream_sync(bstream), "cudaStreamSynchronize");
        };
        cudart::memcpy_attributes a{1, {0, 0}, {0, 0}, 0};
        std::size_t idx = 0;
        fn batch_f = [&] {
          cr.check(cr.memcpy_batch_async(dsts.data(), srcs.data(), lens.data(), sh.count, &a, &idx, 1, bstream),
                   "cudaMemcpyBatchAsync");
          cr.check(cr.stream_sync(bstream), "cudaStreamSynchronize");
        };
        fn ferry_f = [&] {
          transfer_batch b = eng.submit(reqs);
          b.wait();
          b.check();
        };
        // Trials in turn, as measure_pair does; best of each.
        double per_block = 0, batch = 0, fer = 0;
        for (int t = 0; t < std::max(3, o.trials); ++t) {
          per_block = std::max(per_block, measure(per_block_f, none, pool, 3, 1));
          if (cr.memcpy_batch_async) batch = std::max(batch, measure(batch_f, none, pool, 3, 1));
          fer = std::max(fer, measure(ferry_f, none, pool, 3, 1));
        }
        double base = std::max(per_block, batch);
        std::string name = fmt::format("scattered {} {}x{}", h2d ? "h2d" : "d2h", sh.count, format_size(sh.block));
        std::string bname = batch > per_block ? "cudaMemcpyBatchAsync" : "cudaMemcpyAsync/block";
        rows.push_back({{"path", name}, {"bytes", pool}, {"baseline", bname}, {"baseline_gbps", base / 1e9},
                        {"per_block_gbps", per_block / 1e9}, {"batch_gbps", batch / 1e9}, {"ferry_gbps", fer / 1e9},
                        {"ratio", base > 0 ? fer / base : 0}});
        if (!o.json)
          fmt::print("{:<28} per block {:>7.2f}  batch {:>7.2f}  ferry {:>7.2f} GB/s  {:>5.2f}x the faster\n", name,
                     per_block / 1e9, batch / 1e9, fer / 1e9, base > 0 ? fer / base : 0);
      }
      cr.free_host(hp);
      cr.free_(dp);
    }
  }

  // The acceptance targets of issue 3, checked against this run's baselines.
  json targets = json::array();
  auto target = [&](const std::string& name, const std::string& path_prefix, std::uint64_t min_bytes, double want,
                    std::uint64_t max_bytes = UINT64_MAX) {
    double worst = 1e9;
    bool any = false;
    for (auto& r : rows)
      if (r["path"].get<std::string>().starts_with(path_prefix) && r["bytes"].get<std::uint64_t>() >= min_bytes &&
          r["bytes"].get<std::uint64_t>() <= max_bytes) {
        worst = std::min(worst, r["ratio"].get<double>());
        any = true;
      }
    if (!any) return;
    targets.push_back({{"target", name}, {"min_ratio", want}, {"worst_ratio", worst}, {"pass", worst >= want}});
    if (!o.json) fmt::print("target {:<48} worst {:.3f}x (want >= {:.2f}x): {}\n", name, worst, want, worst >= want ? "PASS" : "FAIL");
  };
  if (cuda) {
    if (!o.json) fmt::print("\n");
    target("pinned h2d >= 0.97x cudaMemcpy at >= 64 MiB", "h2d pinned", 64ull << 20, 0.97);
    target("pinned d2h >= 0.97x cudaMemcpy at >= 64 MiB", "d2h pinned", 64ull << 20, 0.97);
    target("pageable h2d >= 4x cudaMemcpy pageable at >= 256 MiB", "h2d pageable", 256ull << 20, 4.0);
    target("gpu->gpu >= 0.95x cudaMemcpyPeer at >= 256 MiB", "gpu", 256ull << 20, 0.95);
    target("gpu->gpu >= 0.9x cudaMemcpyPeer from 1 MiB", "gpu", 1ull << 20, 0.9);
    target("one copy >= 0.9x cudaMemcpyAsync+sync, 64 KiB..16 MiB", "1 copy", 64ull << 10, 0.9, 16ull << 20);
    target("scattered blocks >= 1.0x the faster CUDA way", "scattered", 0, 1.0);
  }
  json doc{{"device", dev.id()}, {"name", dev.info().name}, {"workers", eng.workers()}, {"rows", rows},
           {"targets", targets}, {"skipped_sizes", skipped}};
  if (o.json) std::cout << doc.dump(2) << "\n";
  if (!o.json_out.empty()) {
    std::ofstream f(o.json_out);
    f << doc.dump(2) << "\n";
    if (!f) fail_errno(errno, "bench local", o.json_out, "cannot write --json-out");
  }

  auto rs = rt.registrations().stats();
  if (!o.json)
    fmt::print("registration cache: {} hits, {} misses, {} evictions, {} invalidations, {} pinned\n", rs.hits, rs.misses,
               rs.evictions, rs.invalidations, format_size(rs.bytes_pinned));
  if (cuda) {
    cr.free_(cd0);
    cr.free_(cd0b);
    if (cd1) cr.free_(cd1);
    cr.free_host(pinned);
    cr.stream_destroy(bstream);
  }
  return 0;
}

}  // namespace ferry::cli
