// `ferry-bench vm`: ferry's unified address space next to CUDA managed memory (UVM), measured in
// the same run on the same GPU, plus ferry alone streaming over twice its device cap next to the
// pinned cudaMemcpy bandwidth of the same run. Every test moves the same bytes both ways and checks
// them (CPU sums of what was written, device checksums of what the kernels read).
//
// Tests (each `--rounds` times, the median round reported):
//  - prefetch to GPU / to host: data resident on the other side, one PREFETCH of all of it
//    (UVM: cudaMemPrefetchAsync + sync; ferry: advise(PREFETCH)).
//  - CPU touch-back: data resident on the GPU, the CPU reads one word per 4 KiB page (the faults
//    move the data back; that is what is timed).
//  - GPU stream over CPU-written data: the CPU writes it all, then a checksum kernel reads it all
//    (UVM: GPU page faults; ferry: a PREFETCH hint, then the kernel). No target; for orientation.
//  - ferry streaming at 2x cap: data = 2 x device cap, READ_MOSTLY, windows of a quarter of the cap
//    prefetched in turn and read by a kernel on an attached stream; the baseline is cudaMemcpy from
//    cudaMallocHost memory. Three rows: thrashing mitigation off (every page migrates, every pass);
//    the default policy's first pass (the same, but right after the CPU wrote the data: its host
//    chunks are still mapped for the CPU, and unmapping those costs ~60 us per 2 MiB) and its later passes
//    (pages evicted a pass ago stay on the host and are read in place, the rest stays resident:
//    FERRY_VM_THRASH_LAPSE). Then, for orientation, the same data read in place by the kernel
//    (PREFERRED_LOCATION host: nothing migrates, the GPU reads host chunks over PCIe).
// UVM memory is never more than the GPU has free (more can hang the GPU).
#include "bench.hpp"
#include "cudart.hpp"
#ifdef FERRY_HAVE_CUDA
#include "kernels.hpp"
#include "mem/cuda/driver.hpp"
#endif

#include <ferry/core/checksum.hpp>
#include <ferry/core/units.hpp>
#include <ferry/vm/address_space.hpp>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <thread>


namespace ferry::cli {
namespace {

using json = nlohmann::ordered_json;
using clk = std::chrono::steady_clock;
constexpr std::uint64_t touch_stride = 4096;

double gbps(std::uint64_t bytes, double s) { return s > 0 ? static_cast<double>(bytes) / s / 1e9 : 0; }
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}
double timed(const std::function<void()>& f) {
  auto t0 = clk::now();
  f();
  return std::chrono::duration<double>(clk::now() - t0).count();
}

std::uint64_t word(std::uint64_t i, std::uint64_t seed) {
  std::uint64_t x = (i + seed) * 0x9E3779B97F4A7C15ull;
  return x ^ (x >> 29);
}
// Writes the data (8-byte words); returns the sum of the first word of every 4 KiB page.
std::uint64_t fill(std::byte* p, std::uint64_t n, std::uint64_t seed) {
  auto* w = reinterpret_cast<std::uint64_t*>(p);
  std::uint64_t firsts = 0;
  for (std::uint64_t i = 0; i < n / 8; ++i) {
    w[i] = word(i, seed);
    if (i % (touch_stride / 8) == 0) firsts += w[i];
  }
  return firsts;
}
// The same from `threads` threads, each writing one contiguous share (a program's parallel first
// touch: OpenMP's static schedule).
void fill_by(std::byte* p, std::uint64_t n, std::uint64_t seed, unsigned threads) {
  if (threads <= 1) return (void)fill(p, n, seed);
  const std::uint64_t words = n / 8, share = (words + threads - 1) / threads;
  std::vector<std::thread> ts;
  for (unsigned t = 0; t < threads; ++t)
    ts.emplace_back([=] {
      auto* w = reinterpret_cast<std::uint64_t*>(p);
      for (std::uint64_t i = t * share; i < std::min(words, (t + 1) * share); ++i) w[i] = word(i, seed);
    });
  for (auto& t : ts) t.join();
}
// The CPU touch: one read per 4 KiB page.
std::uint64_t touch(const std::byte* p, std::uint64_t n) {
  std::uint64_t s = 0;
  for (std::uint64_t i = 0; i < n; i += touch_stride) s += *reinterpret_cast<const volatile std::uint64_t*>(p + i);
  return s;
}

struct row {
  std::string test, baseline;
  std::vector<double> base, ferry;  // GB/s per round
  double target = 0;                // ferry / baseline must reach it (0: none)
};

// What the CUDA VMM calls cost, per 2 MiB, for device and host chunks, one call per chunk or one
// call per run of chunks, at two chunk sizes; and whether an unmap waits for unrelated copies in
// flight. These set what a remap-based migration can reach.
void vmm_costs(device& dev, json& out) {
  const std::uint64_t g = dev.granularity();
  const std::uint64_t total = 64ull << 20;
  constexpr int reps = 8;
  auto va = dev.reserve(total);
  fmt::print("VMM call costs (us per 2 MiB, {} reps of {}):\n", reps, format_size(total));
  fmt::print("  {:<8} {:>9} {:<10} {:>8} {:>11} {:>8}\n", "memory", "chunk", "calls", "map", "set_access", "unmap");
  json rows = json::array();
  for (auto kind : {memory_kind::device, memory_kind::host})
    for (std::uint64_t cs : {g, 16 * g})
      for (bool run : {false, true}) {
        std::vector<physical_chunk> cks;
        for (std::uint64_t o = 0; o < total; o += cs)
          cks.push_back(dev.allocate(cs, kind == memory_kind::host ? ferry::location::on_host() : ferry::location::on_device()));
        std::vector<access_desc> gr{{ferry::location::on_device(), access::read_write}};
        if (kind == memory_kind::host) gr.push_back({ferry::location::on_host(), access::read_write});
        double tm = 0, ta = 0, tu = 0;
        for (int r = 0; r < reps; ++r) {
          tm += timed([&] {
            for (std::size_t i = 0; i < cks.size(); ++i) dev.map(va.at(i * cs), cks[i]);
          });
          ta += timed([&] {
            if (run) dev.set_access(va.base(), total, gr);
            else
              for (std::size_t i = 0; i < cks.size(); ++i) dev.set_access(va.at(i * cs), cs, gr);
          });
          if (kind == memory_kind::host) touch(va.at(0), total);  // the CPU mapping is really there
          tu += timed([&] {
            if (run) dev.unmap(va.base(), total);
            else
              for (std::size_t i = 0; i < cks.size(); ++i) dev.unmap(va.at(i * cs), cs);
          });
        }
        double per = 1e6 / reps / (static_cast<double>(total) / (2 << 20));
        fmt::print("  {:<8} {:>9} {:<10} {:>8.1f} {:>11.1f} {:>8.1f}\n", kind == memory_kind::host ? "host" : "device",
                   format_size(cs), run ? "one/run" : "one/chunk", tm * per, ta * per, tu * per);
        rows.push_back({{"memory", kind == memory_kind::host ? "host" : "device"}, {"chunk", cs}, {"per_run", run},
                        {"map_us", tm * per}, {"access_us", ta * per}, {"unmap_us", tu * per}});
      }
  // Does an unmap wait for copies in flight on another stream?
  {
    std::uint64_t big = dev.info().backend == device_kind::cuda ? 512ull << 20 : 32ull << 20;
    auto hv = dev.reserve(big), dv = dev.reserve(big);
    std::vector<physical_chunk> hc, dc;
    for (std::uint64_t o = 0; o < big; o += 16 * g) {
      hc.push_back(dev.allocate(16 * g, ferry::location::on_host()));
      dev.map(hv.at(o), hc.back());
      dc.push_back(dev.allocate(16 * g, ferry::location::on_device()));
      dev.map(dv.at(o), dc.back());
    }
    dev.set_access(hv.base(), big, std::vector<access_desc>{{ferry::location::on_device(), access::read_write}});
    dev.set_access(dv.base(), big, std::vector<access_desc>{{ferry::location::on_device(), access::read_write}});
    auto c = dev.allocate(g, ferry::location::on_device());
    auto s = dev.create_stream();
    double copy_alone = timed([&] {
      s->copy(dv.base(), hv.base(), big);
      s->synchronize();
    });
    dev.map(va.base(), c);
    s->copy(dv.base(), hv.base(), big);
    double unmap_busy = timed([&] { dev.unmap(va.base(), g); });
    s->synchronize();
    fmt::print("  an unmap while a {} copy ({:.2f} ms alone) runs on another stream took {:.2f} ms: {}\n", format_size(big),
               copy_alone * 1e3, unmap_busy * 1e3, unmap_busy > copy_alone / 2 ? "it waits for the device" : "it does not wait");
    out["unmap_waits_for_copies"] = unmap_busy > copy_alone / 2;
    out["unmap_busy_ms"] = unmap_busy * 1e3;
    out["copy_alone_ms"] = copy_alone * 1e3;
  }
  out["vmm"] = rows;
}

// What a remap-based migration pipeline pays (32 MiB chunks): host chunks mapped for the device
// alone vs device + CPU, the first mapping of a chunk vs later ones, and each kind of call with the
// copy engines idle vs while copies run.
void vmm_probe(device& dev, json& out) {
  const std::uint64_t cs = 16 * dev.granularity();
  const bool cuda = dev.info().backend == device_kind::cuda;
  const std::size_t nc = cuda ? 16 : 2;
  const double units = static_cast<double>(cs) / (2 << 20);  // 2 MiB per chunk
  std::vector<access_desc> dev_only{{ferry::location::on_device(), access::read_write}};
  std::vector<access_desc> both{{ferry::location::on_device(), access::read_write}, {ferry::location::on_host(), access::read_write}};
  json rows = json::array();
  fmt::print("VMM probe ({} host chunks, us per 2 MiB):\n", format_size(cs));
  fmt::print("  {:<22} {:<7} {:>8} {:>11} {:>8}\n", "host chunk access", "round", "map", "set_access", "unmap");
  for (bool cpu : {false, true}) {
    auto va = dev.reserve(nc * cs);
    std::vector<physical_chunk> cks;
    for (std::size_t i = 0; i < nc; ++i) cks.push_back(dev.allocate(cs, ferry::location::on_host()));
    double fm = 0, fa = 0, fu = 0, rm = 0, ra = 0, ru = 0;
    constexpr int reps = 4;
    for (int r = 0; r < reps; ++r) {
      double tm = 0, ta = 0, tu = 0;
      for (std::size_t i = 0; i < nc; ++i) {
        tm += timed([&] { dev.map(va.at(i * cs), cks[i]); });
        ta += timed([&] { dev.set_access(va.at(i * cs), cs, cpu ? both : dev_only); });
      }
      if (cpu) touch(static_cast<const std::byte*>(va.base()), nc * cs);
      for (std::size_t i = 0; i < nc; ++i) tu += timed([&] { dev.unmap(va.at(i * cs), cs); });
      (r == 0 ? fm : rm) += tm;
      (r == 0 ? fa : ra) += ta;
      (r == 0 ? fu : ru) += tu;
    }
    double per1 = 1e6 / (nc * units), perr = per1 / (reps - 1);
    const char* what = cpu ? "device + CPU" : "device only";
    fmt::print("  {:<22} {:<7} {:>8.1f} {:>11.1f} {:>8.1f}\n", what, "first", fm * per1, fa * per1, fu * per1);
    fmt::print("  {:<22} {:<7} {:>8.1f} {:>11.1f} {:>8.1f}\n", what, "later", rm * perr, ra * perr, ru * perr);
    rows.push_back({{"access", what}, {"first", {fm * per1, fa * per1, fu * per1}}, {"later", {rm * perr, ra * perr, ru * perr}}});
  }
  out["probe_host_chunks"] = rows;
  // Each kind of VMM call on 8 chunks, with the copy engines idle and while copies run (queued by
  // this thread: VMM calls from another thread starve a copy's own driver calls). A migration
  // pipeline overlaps one batch's remaps with the next one's copies, so these costs are the ones it pays.
  {
    const std::uint64_t big = cuda ? 512ull << 20 : 4 * cs;
    const int copies = cuda ? 6 : 1;  // in flight long enough for every call below
    auto hv = dev.reserve(big), dv = dev.reserve(big), tv = dev.reserve(8 * cs);
    std::vector<physical_chunk> hc, dc, th, td;
    for (std::uint64_t o = 0; o < big; o += cs) {
      hc.push_back(dev.allocate(cs, ferry::location::on_host()));
      dev.map(hv.at(o), hc.back());
      dc.push_back(dev.allocate(cs, ferry::location::on_device()));
      dev.map(dv.at(o), dc.back());
    }
    for (int i = 0; i < 8; ++i) {
      th.push_back(dev.allocate(cs, ferry::location::on_host()));
      td.push_back(dev.allocate(cs, ferry::location::on_device()));
    }
    dev.set_access(hv.base(), big, dev_only);
    dev.set_access(dv.base(), big, dev_only);
    auto s = dev.create_stream();
    const char* names[] = {"map+access host (device)", "unmap host", "map+access host (+CPU)", "unmap host (+CPU)",
                           "map+access device", "unmap device", "unmap host, 1 call", "unmap device, 1 call"};
    auto map_all = [&](std::vector<physical_chunk>& c, const std::vector<access_desc>& g) {
      return timed([&] {
        for (int i = 0; i < 8; ++i) {
          dev.map(tv.at(i * cs), c[i]);
          dev.set_access(tv.at(i * cs), cs, g);
        }
      });
    };
    auto unmap_each = [&] {
      return timed([&] {
        for (int i = 0; i < 8; ++i) dev.unmap(tv.at(i * cs), cs);
      });
    };
    auto unmap_run = [&] { return timed([&] { dev.unmap(tv.base(), 8 * cs); }); };
    auto ops = [&](double* r) {
      r[0] = map_all(th, dev_only);
      r[1] = unmap_each();
      r[2] = map_all(th, both);
      r[3] = unmap_each();
      r[4] = map_all(td, dev_only);
      r[5] = unmap_each();
      map_all(th, dev_only);
      r[6] = unmap_run();
      map_all(td, dev_only);
      r[7] = unmap_run();
    };
    double warm[8];
    ops(warm);  // first mappings of these chunks out of the way
    json rows2 = json::array();
    fmt::print("  VMM calls, us per 2 MiB:      ");
    for (auto* nm : names) fmt::print(" | {}", nm);
    fmt::print("\n");
    // Modes: idle; H2D and D2H copies by the copy engines; the same by the SMs (copy_engine::sm).
    const char* modes[] = {"copy engines idle", "during H2D copies", "during D2H copies", "during H2D copies by SMs",
                           "during D2H copies by SMs"};
    for (int mode = 0; mode < 5; ++mode) {
      double r[8];
      bool h2d = mode == 1 || mode == 3;
      auto by = mode >= 3 ? copy_engine::sm : copy_engine::dma;
      for (int c = 0; c < (mode ? copies : 0); ++c) s->copy(h2d ? dv.base() : hv.base(), h2d ? hv.base() : dv.base(), big, by);
      ops(r);
      bool still = mode == 0 || !s->idle();
      s->synchronize();
      const char* m = modes[mode];
      json j = {{"while", m}, {"copies_outlasted_calls", still}};
      fmt::print("    {:<30}", fmt::format("{}{}", m, still ? "" : " (copies ended first)"));
      for (int i = 0; i < 8; ++i) {
        double us = r[i] * 1e6 / (8 * units);
        j[names[i]] = us;
        fmt::print(" | {:>{}.1f}", us, static_cast<int>(std::string_view(names[i]).size()));
      }
      fmt::print("\n");
      rows2.push_back(j);
    }
    out["probe_calls_during_copies"] = rows2;
    // What each engine copies alone, and whether remaps scale over threads.
    json bw;
    fmt::print("  {} copies alone, GB/s:", format_size(big));
    for (auto by : {copy_engine::dma, copy_engine::sm})
      for (bool h2d : {true, false}) {
        double sec = timed([&] {
          s->copy(h2d ? dv.base() : hv.base(), h2d ? hv.base() : dv.base(), big, by);
          s->synchronize();
        });
        std::string k = fmt::format("{} {}", h2d ? "H2D" : "D2H", by == copy_engine::sm ? "SMs" : "DMA");
        bw[k] = static_cast<double>(big) / sec / 1e9;
        fmt::print(" {} {:.1f}", k, static_cast<double>(big) / sec / 1e9);
      }
    fmt::print("\n");
    out["probe_copy_gbps"] = bw;
    json par;
    fmt::print("  map+access host (device) of 8 chunks, us per 2 MiB, by threads:");
    for (int nt : {1, 2, 4, 8}) {
      double sec = timed([&] {
        std::vector<std::thread> ts;
        for (int k = 0; k < nt; ++k)
          ts.emplace_back([&, k] {
            for (int i = k; i < 8; i += nt) {
              dev.map(tv.at(i * cs), th[i]);
              dev.set_access(tv.at(i * cs), cs, dev_only);
            }
          });
        for (auto& t : ts) t.join();
      });
      unmap_run();
      par[std::to_string(nt)] = sec * 1e6 / (8 * units);
      fmt::print(" {}: {:.1f}", nt, sec * 1e6 / (8 * units));
    }
    fmt::print("\n");
    out["probe_parallel_map_access"] = par;
    // The same for unmapping chunks the CPU may access (the cost a migration to the device pays
    // per page the CPU had mapped): does it scale over threads?
    json upar;
    fmt::print("  unmap host (+CPU) of 8 chunks, us per 2 MiB, by threads:");
    for (int nt : {1, 2, 4, 8}) {
      map_all(th, both);
      double sec = timed([&] {
        std::vector<std::thread> ts;
        for (int k = 0; k < nt; ++k)
          ts.emplace_back([&, k] {
            for (int i = k; i < 8; i += nt) dev.unmap(tv.at(i * cs), cs);
          });
        for (auto& t : ts) t.join();
      });
      upar[std::to_string(nt)] = sec * 1e6 / (8 * units);
      fmt::print(" {}: {:.1f}", nt, sec * 1e6 / (8 * units));
    }
    fmt::print("\n");
    out["probe_parallel_unmap_cpu"] = upar;
  }
}

// A program's CPU init of its data: word i = i ^ seed, at memory speed (what differs between the
// allocators is then their faults and migrations, not the init's arithmetic).
void init_words(void* p, std::uint64_t bytes, unsigned seed) {
  auto* w = static_cast<unsigned*>(p);
  for (std::uint64_t i = 0; i < bytes / 4; ++i) w[i] = static_cast<unsigned>(i) ^ seed;
}
// The CPU reading all of the data: a plain sum of 8-byte words.
std::uint64_t sum_words(const void* p, std::uint64_t bytes) {
  auto* w = static_cast<const std::uint64_t*>(p);
  std::uint64_t s = 0;
  for (std::uint64_t i = 0; i < bytes / 8; ++i) s += w[i];
  return s;
}

#ifdef FERRY_HAVE_CUDA
// The user's side of the gather test: the primary context (the runtime API's), the user's own stream
// and kernel (pipeline_kernels.cu), launched with cuLaunchKernel -- never through ferry.
struct user_gather : bench_user {
  CUfunction gather = nullptr;
  user_gather(const cuda::driver_api& a, int ordinal) : bench_user(a, ordinal, "bench vm"), gather(fn("bench_gather")) {}
  void run(const void* src, std::uint64_t src_bytes, void* out, std::uint64_t out_bytes, unsigned seed) {
    unsigned long long words = src_bytes / 4, n = out_bytes / 4;
    void* args[] = {const_cast<void**>(&src), &words, &out, &n, &seed};
    check(api.cuLaunchKernel(gather, blocks, 1, 1, 256, 1, 1, 0, s, args, nullptr), "cuLaunchKernel");
    check(api.cuStreamSynchronize(s), "cuStreamSynchronize");
  }
};
#endif

// Where one test's time went in the address space (deltas since `last`, which is advanced).
void print_phase(const char* what, vm::space_timings& last, const vm::space_timings& now) {
  auto ms = [](std::uint64_t a, std::uint64_t b) { return static_cast<double>(b - a) / 1e6; };
  fmt::print("  ferry time in {:<36}: unmap {:7.1f} ms, map {:6.1f}, set access {:7.1f}, copy waits {:7.1f}, chunk allocation {:7.1f}, quiesce {:6.1f}\n",
             what, ms(last.unmap, now.unmap), ms(last.map, now.map), ms(last.access, now.access), ms(last.copy_wait, now.copy_wait),
             ms(last.allocate, now.allocate), ms(last.quiesce, now.quiesce));
  last = now;
}

}  // namespace

int run_bench_vm(runtime& rt, const bench_vm_options& o) {
  device& dev = o.device.empty() ? rt.devices().default_device() : rt.devices().get(o.device);
  bool cuda = dev.info().backend == device_kind::cuda;
  expects(o.rounds >= 1, "bench vm", "--rounds", "at least 1");
  const std::uint64_t gran = dev.granularity();
  const std::uint64_t page = std::max(gran, (rt.config().vm_page + gran - 1) / gran * gran);  // the space's page
  std::uint64_t n = parse_size(o.size, "--size");
  n = (n + page - 1) / page * page;
  std::uint64_t cap = o.cap.empty() ? n / 2 : parse_size(o.cap, "--cap");
  cap = std::max(page, cap / page * page);
  cudart cr;
  bool uvm = cuda && cr.uvm_ok();
  int ordinal = dev.info().ordinal;
  auto mem = dev.memory();
  fmt::print("ferry-bench vm on {} ({}), {} per test, {} rounds (median){}\n", dev.id(), dev.info().name, format_size(n),
             o.rounds, cuda ? "" : " — simulated device: numbers are NOT performance figures");
  if (cuda && !uvm) fmt::print("UVM baseline unavailable: {}\n", cr.ok() ? "the CUDA runtime is older than 13.0" : cr.why);
  // UVM's prefetched data and ferry's device copy never coexist; the streaming test holds `cap`.
  if (uvm && mem.free && n + (1ull << 30) > mem.free)
    fail(errc::invalid_argument, "bench vm", "--size",
         fmt::format("{} does not fit the {} the device has free (with 1 GiB to spare); managed memory beyond it can hang the GPU",
                     format_size(n), format_size(mem.free)));
  json out;
  vmm_costs(dev, out);
  vmm_probe(dev, out);
  auto st = dev.create_stream();
  std::vector<row> rows;
  row pre_gpu{"prefetch to GPU", "UVM cudaMemPrefetchAsync", {}, {}, 1.05};
  row pre_host{"prefetch to host", "UVM cudaMemPrefetchAsync", {}, {}, 3.0};
  row touch_back{"CPU touch-back (1 read / 4 KiB)", "UVM CPU faults", {}, {}, 3.0};
  row gpu_stream{"GPU kernel over CPU-written data", "UVM GPU faults", {}, {}, 0};
  // What a prefetch to host leaves for the CPU to do (ferry grants the CPU its mapping on first touch).
  row host_touch{"CPU read after prefetch to host (1 read / 4 KiB)", "UVM", {}, {}, 0};
  std::uint64_t bad = 0;
  auto check_sum = [&](const char* what, std::uint64_t got, std::uint64_t want) {
    if (got != want) {
      ++bad;
      fmt::print("DATA MISMATCH in {}: {:#x} != {:#x}\n", what, got, want);
    }
  };

  // ---- UVM ----
  if (uvm) {
    cr.check(cr.set_device(ordinal), "cudaSetDevice");
    void* u = nullptr;
    cr.check(cr.malloc_managed(&u, n, 1 /* cudaMemAttachGlobal */), "cudaMallocManaged");
    auto* b = static_cast<std::byte*>(u);
    auto prefetch = [&](bool to_gpu) {
      cr.check(cr.prefetch(u, n, {to_gpu ? 1 : 2, to_gpu ? ordinal : 0}, 0, nullptr), "cudaMemPrefetchAsync");
      cr.check(cr.sync(), "cudaDeviceSynchronize");
    };
    std::uint64_t firsts = fill(b, n, 1);
    std::uint64_t sum = checksum64(b, n);
    for (int r = 0; r < o.rounds; ++r) {
      pre_gpu.base.push_back(gbps(n, timed([&] { prefetch(true); })));
      pre_host.base.push_back(gbps(n, timed([&] { prefetch(false); })));
    }
    for (int r = 0; r < o.rounds; ++r) {
      prefetch(true);
      prefetch(false);
      std::uint64_t got = 0;
      host_touch.base.push_back(gbps(n, timed([&] { got = touch(b, n); })));
      check_sum("UVM touch after prefetch to host", got, firsts);
    }
    for (int r = 0; r < o.rounds; ++r) {
      prefetch(true);
      std::uint64_t got = 0;
      touch_back.base.push_back(gbps(n, timed([&] { got = touch(b, n); })));
      check_sum("UVM touch-back", got, firsts);
    }
    for (int r = 0; r < o.rounds; ++r) {
      fill(b, n, 1);  // CPU-written again: resident on the host
      std::uint64_t got = 0;
      gpu_stream.base.push_back(gbps(n, timed([&] {
        st->checksum(b, n, &got);
        st->synchronize();
      })));
      check_sum("UVM GPU stream", got, sum);
    }
    cr.check(cr.free_(u), "cudaFree(managed)");
  }

  // ---- ferry ----
  vm::space_timings timings{};
  vm::vm_stats vstats{};
  {
    auto so = vm::space_options::from(rt.config());
    so.device_capacity = std::max(so.device_capacity, n);
    vm::address_space as(dev, n, so);
    as.attach_stream(*st);
    auto* b = static_cast<std::byte*>(as.alloc(n));
    std::uint64_t firsts = fill(b, n, 1);  // first touch: pages made on the host
    std::uint64_t sum = checksum64(b, n);
    auto advise = [&](memory_kind where) { as.advise(b, n, vm::advice::prefetch, where); };
    vm::space_timings last = as.timings();
    auto phase = [&](const char* what) { print_phase(what, last, as.timings()); };
    for (int r = 0; r < o.rounds; ++r) {
      pre_gpu.ferry.push_back(gbps(n, timed([&] { advise(memory_kind::device); })));
      pre_host.ferry.push_back(gbps(n, timed([&] { advise(memory_kind::host); })));
    }
    phase("prefetch to GPU + to host");
    for (int r = 0; r < o.rounds; ++r) {
      advise(memory_kind::device);
      advise(memory_kind::host);
      std::uint64_t got = 0;
      host_touch.ferry.push_back(gbps(n, timed([&] { got = touch(b, n); })));
      check_sum("ferry touch after prefetch to host", got, firsts);
    }
    phase("prefetch both ways + CPU read");
    for (int r = 0; r < o.rounds; ++r) {
      advise(memory_kind::device);
      std::uint64_t got = 0;
      touch_back.ferry.push_back(gbps(n, timed([&] { got = touch(b, n); })));
      check_sum("ferry touch-back", got, firsts);
    }
    phase("prefetch to GPU + touch-back");
    for (int r = 0; r < o.rounds; ++r) {
      fill(b, n, 1);
      std::uint64_t got = 0;
      gpu_stream.ferry.push_back(gbps(n, timed([&] {
        advise(memory_kind::device);
        st->checksum(b, n, &got);
        st->synchronize();
      })));
      check_sum("ferry GPU stream", got, sum);
    }
    phase("CPU fill + prefetch to GPU + kernel");
    timings = as.timings();
    vstats = as.stats();
    as.detach_stream(*st);
  }
  rows = {pre_gpu, pre_host, host_touch, touch_back, gpu_stream};

  // ---- first touch of fresh memory, no hints: by the CPU (it writes everything), and by a kernel
  // (it writes everything, then the CPU reads it all). Allocation included: ferry maps and zeroes
  // every page in alloc, UVM on each first touch. ----
  // The CPU's first touch by 1, 8 and 32 threads.
  const unsigned touchers[] = {1, 8, 32};
  std::vector<row> cpu_first;
  for (unsigned t : touchers)
    cpu_first.push_back({fmt::format("alloc + CPU first touch (writes), {} thread{}", t, t > 1 ? "s" : ""), "UVM cudaMallocManaged", {}, {}, 1.0});
  row gpu_first{"alloc + kernel first touch + CPU reads all", "UVM cudaMallocManaged", {}, {}, 1.0};
  const std::uint64_t gpu_first_sum = pattern_checksum(n, 5);
  if (uvm) {
    for (int r = 0; r < o.rounds; ++r) {
      void* f = nullptr;
      for (std::size_t k = 0; k < cpu_first.size(); ++k) {
        cpu_first[k].base.push_back(gbps(n, timed([&] {
          cr.check(cr.malloc_managed(&f, n, 1), "cudaMallocManaged");
          fill_by(static_cast<std::byte*>(f), n, 2, touchers[k]);
        })));
        cr.check(cr.free_(f), "cudaFree(managed)");
      }
      std::uint64_t got = 0;
      gpu_first.base.push_back(gbps(n, timed([&] {
        cr.check(cr.malloc_managed(&f, n, 1), "cudaMallocManaged");
        st->fill_pattern(f, n, 5);
        st->synchronize();
        got = checksum64(f, n);
      })));
      check_sum("UVM kernel first touch", got, gpu_first_sum);
      cr.check(cr.free_(f), "cudaFree(managed)");
    }
  }
  for (int r = 0; r < o.rounds; ++r) {
    auto so = vm::space_options::from(rt.config());
    for (std::size_t k = 0; k <= cpu_first.size(); ++k) {
      const bool by_gpu = k == cpu_first.size();
      vm::address_space as(dev, n, so);
      as.attach_stream(*st);
      std::uint64_t got = 0;
      double t = timed([&] {
        auto* f = static_cast<std::byte*>(as.alloc(n));
        if (!by_gpu) return fill_by(f, n, 2, touchers[k]);
        st->fill_pattern(f, n, 5);
        st->synchronize();
        got = checksum64(f, n);
      });
      (by_gpu ? gpu_first : cpu_first[k]).ferry.push_back(gbps(n, t));
      if (by_gpu) check_sum("ferry kernel first touch", got, gpu_first_sum);
      as.detach_stream(*st);
    }
  }
  rows.insert(rows.end(), cpu_first.begin(), cpu_first.end());
  rows.push_back(gpu_first);

  // ---- the CPU fills, then PREFETCH to the GPU (returns off: the PREFETCH moves every page); the
  // CPU reads all of host-resident data it has touched before, next to the same read of malloc
  // memory. ----
  row fill_prefetch{"prefetch to GPU after a CPU fill", "UVM cudaMemPrefetchAsync", {}, {}, 1.05};
  row cpu_read{"CPU reads all of touched host-resident data", "malloc memory", {}, {}, 0.9};
  if (uvm) {
    void* u = nullptr;
    cr.check(cr.malloc_managed(&u, n, 1), "cudaMallocManaged");
    for (int r = 0; r < o.rounds; ++r) {
      init_words(u, n, 9 + static_cast<unsigned>(r));
      fill_prefetch.base.push_back(gbps(n, timed([&] {
        cr.check(cr.prefetch(u, n, {1, ordinal}, 0, nullptr), "cudaMemPrefetchAsync");
        cr.check(cr.sync(), "cudaDeviceSynchronize");
      })));
    }
    cr.check(cr.free_(u), "cudaFree(managed)");
  }
  {
    std::vector<std::uint64_t> m(n / 8);
    init_words(m.data(), n, 3);
    const std::uint64_t want = sum_words(m.data(), n);
    for (int r = 0; r < o.rounds; ++r) {
      std::uint64_t got = 0;
      cpu_read.base.push_back(gbps(n, timed([&] { got = sum_words(m.data(), n); })));
      check_sum("malloc read", got, want);
    }
  }
  {
    auto so = vm::space_options::from(rt.config());
    so.return_at_launch = false;
    so.return_quiet = {};
    vm::address_space as(dev, n, so);
    as.attach_stream(*st);
    auto* b = as.alloc(n);
    for (int r = 0; r < o.rounds; ++r) {
      init_words(b, n, 9 + static_cast<unsigned>(r));
      fill_prefetch.ferry.push_back(gbps(n, timed([&] { as.advise(b, n, vm::advice::prefetch, memory_kind::device); })));
    }
    init_words(b, n, 3);
    const std::uint64_t want = sum_words(b, n);  // the first touch: the CPU has its mappings now
    for (int r = 0; r < o.rounds; ++r) {
      std::uint64_t got = 0;
      cpu_read.ferry.push_back(gbps(n, timed([&] { got = sum_words(b, n); })));
      check_sum("ferry host-resident read", got, want);
    }
    as.detach_stream(*st);
  }
  rows.push_back(fill_prefetch);
  rows.push_back(cpu_read);

#ifdef FERRY_HAVE_CUDA
  // ---- a program written for managed memory, no hints: the CPU initializes its data, then the
  // user's random-gather kernel runs on the user's stream (cuLaunchKernel). End to end (init + the
  // first kernel) against UVM; later runs of the kernel against the same program on cudaMalloc
  // memory (an explicit copy in). ferry with its default policy: the CPU's faults take the pages to
  // the host, the launch takes them back (launch callbacks). ----
  if (cuda) {
    const cuda::driver_status& drv = cuda::load(rt.config().cuda_driver);
    user_gather ug(*drv.api, ordinal);
    const std::uint64_t out_bytes = std::min<std::uint64_t>(256ull << 20, n / 4);
    const unsigned gseed = 17, iseed = 5;
    std::uint64_t want = 0;
    for (std::uint64_t i = 0; i < out_bytes / 4; ++i)
      want += static_cast<unsigned>((static_cast<unsigned>(word_at(i, gseed) % (n / 4)) ^ iseed) + static_cast<unsigned>(i));
    auto out_sum = [&](const void* res) {
      auto* w = static_cast<const unsigned*>(res);
      std::uint64_t s = 0;
      for (std::uint64_t i = 0; i < out_bytes / 4; ++i) s += w[i];
      return s;
    };
    row e2e{"CPU init + first random gather, no hints", "UVM cudaMallocManaged", {}, {}, 1.0};
    row later{"random gather, later runs, no hints", "cudaMalloc", {}, {}, 1.0 / 1.1};
    row later_uvm{"random gather, later runs, no hints", "UVM cudaMallocManaged", {}, {}, 0};
    if (uvm) {
      for (int r = 0; r < o.rounds; ++r) {
        void *src = nullptr, *res = nullptr;
        cr.check(cr.malloc_managed(&src, n, 1), "cudaMallocManaged");
        cr.check(cr.malloc_managed(&res, out_bytes, 1), "cudaMallocManaged");
        e2e.base.push_back(gbps(n, timed([&] {
          init_words(src, n, iseed);
          ug.run(src, n, res, out_bytes, gseed);
        })));
        later_uvm.base.push_back(gbps(out_bytes, timed([&] { ug.run(src, n, res, out_bytes, gseed); })));
        check_sum("UVM gather", out_sum(res), want);
        cr.check(cr.free_(src), "cudaFree(managed)");
        cr.check(cr.free_(res), "cudaFree(managed)");
      }
    }
    if (cr.ok()) {
      void *src = nullptr, *res = nullptr;
      cr.check(cr.set_device(ordinal), "cudaSetDevice");
      cr.check(cr.malloc_(&src, n), "cudaMalloc");
      cr.check(cr.malloc_(&res, out_bytes), "cudaMalloc");
      {
        std::vector<std::uint64_t> h(n / 8);
        init_words(h.data(), n, iseed);
        cr.check(cr.memcpy_(src, h.data(), n, cudart::default_kind), "cudaMemcpy");
      }
      for (int r = 0; r < o.rounds; ++r) later.base.push_back(gbps(out_bytes, timed([&] { ug.run(src, n, res, out_bytes, gseed); })));
      std::vector<unsigned> back(out_bytes / 4);
      cr.check(cr.memcpy_(back.data(), res, out_bytes, cudart::default_kind), "cudaMemcpy");
      check_sum("cudaMalloc gather", out_sum(back.data()), want);
      cr.check(cr.free_(src), "cudaFree");
      cr.check(cr.free_(res), "cudaFree");
    }
    {
      auto so = vm::space_options::from(rt.config());
      vm::address_space as(dev, n + out_bytes, so);
      auto view = dev.wrap_stream(native_stream{reinterpret_cast<std::uintptr_t>(ug.s)});
      as.attach_stream(*view);
      if (!as.returns_pages()) fmt::print("ferry: no launch callbacks here: pages the CPU wrote stay on the host\n");
      vm::vm_stats before = as.stats();
      for (int r = 0; r < o.rounds; ++r) {
        void* src = as.alloc(n);
        void* res = as.alloc(out_bytes);
        e2e.ferry.push_back(gbps(n, timed([&] {
          init_words(src, n, iseed);
          ug.run(src, n, res, out_bytes, gseed);
        })));
        double t = timed([&] { ug.run(src, n, res, out_bytes, gseed); });
        later_uvm.ferry.push_back(gbps(out_bytes, t));
        later.ferry.push_back(gbps(out_bytes, t));
        check_sum("ferry gather", out_sum(res), want);
        as.free(src);
        as.free(res);
      }
      vm::vm_stats after = as.stats();
      fmt::print("ferry gather: {} pages returned to the device before launches, {} held on the host, {} CPU faults\n",
                 after.returns - before.returns, after.return_holds - before.return_holds, as.cpu_faults());
      as.detach_stream(*view);
    }
    rows.push_back(e2e);
    rows.push_back(later);
    rows.push_back(later_uvm);
  }
#endif

  // ---- two devices: pages moved GPU to GPU (a space over both) vs UVM's prefetch between them ----
  device* peer = nullptr;
  try {
    peer = &rt.devices().get(dev.info().backend, dev.info().ordinal + 1);
    if (!rt.devices().peer(dev, *peer).access) peer = nullptr;
  } catch (const error&) {
    peer = nullptr;
  }
  if (peer && peer->memory().free && n + (uvm ? 1ull << 30 : 0) > peer->memory().free) peer = nullptr;  // too small to hold the test
  if (!peer) fmt::print("two-device test skipped: no second {} device with peer access and room\n", to_string(dev.info().backend));
  if (peer) {
    row d2d{fmt::format("prefetch {} -> {} and back", dev.id(), peer->id()), "UVM cudaMemPrefetchAsync", {}, {}, 0};
    const int po = peer->info().ordinal;
    if (uvm) {
      void* u = nullptr;
      cr.check(cr.set_device(ordinal), "cudaSetDevice");
      cr.check(cr.malloc_managed(&u, n, 1), "cudaMallocManaged");
      fill(static_cast<std::byte*>(u), n, 3);
      auto to = [&](int dev_ordinal) {
        cr.check(cr.prefetch(u, n, {1, dev_ordinal}, 0, nullptr), "cudaMemPrefetchAsync");
        cr.check(cr.sync(), "cudaDeviceSynchronize");
      };
      to(ordinal);
      for (int r = 0; r < o.rounds; ++r) d2d.base.push_back(gbps(2 * n, timed([&] { to(po), to(ordinal); })));
      cr.check(cr.free_(u), "cudaFree(managed)");
    }
    auto so = vm::space_options::from(rt.config());
    so.device_capacity = std::max(so.device_capacity, n);
    device* both[] = {&dev, peer};
    vm::address_space as(both, n, so);
    auto pst = peer->create_stream();
    as.attach_stream(*st);
    as.attach_stream(*pst);
    auto* b = static_cast<std::byte*>(as.alloc(n));
    fill(b, n, 3);
    const std::uint64_t sum = checksum64(b, n);
    as.advise(b, n, vm::advice::prefetch, location::on_device(ordinal));
    for (int r = 0; r < o.rounds; ++r)
      d2d.ferry.push_back(gbps(2 * n, timed([&] {
        as.advise(b, n, vm::advice::prefetch, location::on_device(po));
        as.advise(b, n, vm::advice::prefetch, location::on_device(ordinal));
      })));
    std::uint64_t got = 0;
    as.advise(b, n, vm::advice::prefetch, location::on_device(po));
    st->checksum(b, n, &got);  // the first device reads the pages on the second
    st->synchronize();
    check_sum("ferry two-device prefetch", got, sum);
    fmt::print("two devices: {} pages moved device to device ({} through the host)\n", as.stats().migrations_d2d,
               as.stats().migrations_d2h);
    as.detach_stream(*st);
    as.detach_stream(*pst);
    rows.push_back(d2d);
  }

  // ---- ferry streaming at 2x its cap vs pinned cudaMemcpy ----
  // The same stream (windows of a quarter of the cap prefetched in turn, each read by a kernel on an
  // attached stream) in two spaces: one where every PREFETCH migrates (thrashing mitigation off:
  // what the remaps cost), one with the default policy, whose first pass migrates everything and
  // whose later passes find the pages of the first half evicted a moment ago (thrashing): it leaves
  // them on the host for the kernel to read in place and keeps the second half resident.
  row migrate_all{"ferry streaming at 2x cap, every page migrates", "cudaMemcpy H2D from cudaMallocHost", {}, {}, 0};
  row first_pass{"ferry streaming at 2x cap, default, pass 1 (cold)", "cudaMemcpy H2D from cudaMallocHost", {}, {}, 0};
  row over{"ferry streaming at 2x cap, default, passes 2..", "cudaMemcpy H2D from cudaMallocHost", {}, {}, 0.8};
  row in_place{"ferry, same data read in place (host, over PCIe)", "cudaMemcpy H2D from cudaMallocHost", {}, {}, 0};
  std::uint64_t data = 2 * cap;
  vm::vm_stats ostats{}, astats{};
  for (bool mitigate : {false, true}) {
    auto so = vm::space_options::from(rt.config());
    so.device_capacity = cap;
    if (!mitigate) so.thrash_lapse = {};
    vm::address_space as(dev, data, so);
    as.attach_stream(*st);
    auto* b = static_cast<std::byte*>(as.alloc(data));
    fill(b, data, 7);
    // A quarter of the cap per PREFETCH: each call pipelines its pages (copies of one batch under
    // the remaps of the next), so a longer window spends less of its time filling and draining.
    std::uint64_t window = std::clamp<std::uint64_t>(cap / 4 / page * page, page, 1ull << 30);
    std::uint64_t windows = (data + window - 1) / window;
    std::vector<std::uint64_t> want(windows), got(windows);
    for (std::uint64_t w = 0; w < windows; ++w) want[w] = checksum64(b + w * window, std::min(window, data - w * window));
    const std::uint64_t sum_all = checksum64(b, data);
    as.advise(b, data, vm::advice::read_mostly);
    vm::space_timings last = as.timings();
    for (int r = 0; r < o.rounds + (mitigate ? 1 : 0); ++r) {
      double v = gbps(data, timed([&] {
        for (std::uint64_t w = 0; w < windows; ++w) {
          std::uint64_t len = std::min(window, data - w * window);
          as.advise(b + w * window, len, vm::advice::prefetch, memory_kind::device);
          st->checksum(b + w * window, len, &got[w]);
        }
        st->synchronize();
      }));
      (!mitigate ? migrate_all : r == 0 ? first_pass : over).ferry.push_back(v);
      for (std::uint64_t w = 0; w < windows; ++w) check_sum("ferry streaming window", got[w], want[w]);
    }
    if (!mitigate) {
      print_phase("streaming at 2x cap, all migrate", last, as.timings());
      astats = as.stats();
      as.detach_stream(*st);
      continue;
    }
    print_phase("streaming at 2x cap, default", last, as.timings());
    ostats = as.stats();
    // For orientation, no target: the same data read in place -- PREFERRED_LOCATION host, the
    // kernel reads the host chunks over PCIe and nothing migrates (a one-pass stream needs no copy).
    as.advise(b, data, vm::advice::no_read_mostly);
    as.advise(b, data, vm::advice::prefetch, memory_kind::host);
    as.advise(b, data, vm::advice::preferred_location, memory_kind::host);
    for (int r = 0; r < o.rounds; ++r) {
      std::uint64_t all = 0;
      in_place.ferry.push_back(gbps(data, timed([&] {
        st->checksum(b, data, &all);
        st->synchronize();
      })));
      check_sum("ferry in-place stream", all, sum_all);
    }
    as.detach_stream(*st);
  }
  if (cuda && cr.ok()) {
    std::uint64_t bn = std::min<std::uint64_t>(data, 1ull << 30);
    void *h = nullptr, *d = nullptr;
    cr.check(cr.set_device(ordinal), "cudaSetDevice");
    cr.check(cr.malloc_host(&h, bn), "cudaMallocHost");
    cr.check(cr.malloc_(&d, bn), "cudaMalloc");
    std::memset(h, 1, bn);
    for (int r = 0; r < o.rounds; ++r)
      over.base.push_back(gbps(bn, timed([&] { cr.check(cr.memcpy_(d, h, bn, cudart::default_kind), "cudaMemcpy"); })));
    cr.check(cr.free_(d), "cudaFree");
    cr.check(cr.free_host(h), "cudaFreeHost");
  }
  migrate_all.base = first_pass.base = in_place.base = over.base;
  for (auto* r : {&migrate_all, &first_pass, &over, &in_place}) rows.push_back(*r);

  // ---- report ----
  out["device"] = dev.id();
  out["name"] = dev.info().name;
  out["bytes"] = n;
  out["cap"] = cap;
  out["rounds"] = o.rounds;
  out["page"] = vm::space_options::from(rt.config()).page_bytes;
  fmt::print("ferry settings: FERRY_VM_PAGE={} FERRY_VM_BATCH={} FERRY_VM_FAULT_AHEAD={}\n{}\n", format_size(rt.config().vm_page),
             rt.config().vm_batch, rt.config().vm_fault_ahead, changed_settings(rt.config()));
  fmt::print("{:<52} {:>10} {:>10} {:>7} {:>7}  {}\n", "test", "base GB/s", "ferry GB/s", "ratio", "target", "baseline");
  json jr = json::array();
  bool met = true;
  for (auto& r : rows) {
    double bm = median(r.base), fm = median(r.ferry);
    double ratio = bm > 0 ? fm / bm : 0;
    bool ok = r.target == 0 || bm == 0 || ratio >= r.target;
    if (r.target > 0 && bm > 0) met = met && ok;
    fmt::print("{:<52} {:>10} {:>10.2f} {:>7} {:>7}  {}\n", r.test, bm > 0 ? fmt::format("{:.2f}", bm) : "-", fm,
               bm > 0 ? fmt::format("{:.2f}", ratio) : "-", r.target > 0 ? fmt::format(">= {:.2f}", r.target) : "-",
               bm > 0 ? r.baseline + (r.target > 0 ? (ok ? "  [met]" : "  [NOT met]") : "") : "unavailable");
    jr.push_back({{"test", r.test}, {"baseline", r.baseline}, {"base_gbps", r.base}, {"ferry_gbps", r.ferry},
                  {"base_median", bm}, {"ferry_median", fm}, {"ratio", ratio}, {"target", r.target}});
  }
  out["rows"] = jr;
  auto ms = [](std::uint64_t ns) { return static_cast<double>(ns) / 1e6; };
  fmt::print("ferry (4 tests): {} batches, migrations h2d {} d2h {}, {} CPU-fault pages moved ahead, time in: unmap {:.1f} ms, map {:.1f} ms, "
             "set access {:.1f} ms, copy waits {:.1f} ms, chunk allocation {:.1f} ms, stream quiesce {:.1f} ms\n",
             vstats.batches, vstats.migrations_h2d, vstats.migrations_d2h, vstats.fault_ahead, ms(timings.unmap), ms(timings.map),
             ms(timings.access), ms(timings.copy_wait), ms(timings.allocate), ms(timings.quiesce));
  fmt::print("ferry streaming, every page migrates: cap {}, data {}, evictions {} (clean drops {}, write-backs {}), migrations h2d {}\n",
             format_size(cap), format_size(data), astats.evictions, astats.clean_drops, astats.writebacks, astats.migrations_h2d);
  fmt::print("ferry streaming, default ({} + {} passes): evictions {} (clean drops {}, write-backs {}), migrations h2d {}, "
             "thrashing pages held on the host {}, prefetches that left a held page in place {}\n",
             1, o.rounds, ostats.evictions, ostats.clean_drops, ostats.writebacks, ostats.migrations_h2d, ostats.thrash_holds,
             ostats.held_prefetches);
  fmt::print("data checks: {}\n", bad == 0 ? "all equal" : fmt::format("{} MISMATCHES", bad));
  out["timings_ms"] = {{"unmap", ms(timings.unmap)}, {"map", ms(timings.map)}, {"access", ms(timings.access)},
                       {"copy_wait", ms(timings.copy_wait)}, {"allocate", ms(timings.allocate)}, {"quiesce", ms(timings.quiesce)}};
  out["data_mismatches"] = bad;
  out["targets_met"] = met;
  if (!o.json_out.empty()) std::ofstream(o.json_out) << out.dump(2) << "\n";
  return bad == 0 ? 0 : 1;
}

}  // namespace ferry::cli
