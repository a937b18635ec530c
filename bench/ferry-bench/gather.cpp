// `ferry-bench gather --path DIR`: a user's kernel gathers random elements of a dataset larger than
// the GPU cache given to it, read
//   ferry       through ferry's GPU page cache (gpu::cache, gpu::array): the kernel's misses go
//               to ferry's proxy, which reads the pages from the file; cold (a new cache) and warm
//               (the same indices again)
//   ferry://    the same, the file served by a `ferry serve` child process on this host (loopback)
//   unified     ferry unified memory, oversubscribed: the dataset in a unified address space whose
//               device cap is the ferry cache's size (the rest stays in host memory, read in place);
//               the CPU filled it, the kernel reads it by pointer (first launch and later ones)
//   zero-copy   from pinned host memory holding the whole dataset, read by the kernel over PCIe
//               (the data loaded beforehand, not timed)
//   staged      host-orchestrated: per step of --step accesses the CPU collects the pages they touch,
//               reads them from the file (pread, on as many threads as cores), copies them to the
//               GPU and launches the kernel on them
// all in the same run, on the same indices: uniform, and Zipf-like (exponent 0.99, ranks scattered
// over the dataset). Elements of 8 and 64 bytes. Every output is checked against the file's words.
// Reports elements/s, effective GB/s (elements x element size / s) and, for ferry, the proxy's
// requests/s (4 KiB pages by default) and hit rate, next to the file engine alone reading the same pages
// into pinned host memory (the proxy's ceiling from the page cache through ferry) and io_uring alone
// (as many threads as the file engine has, each its own ring, FERRY_IO_DEPTH reads under way each:
// what the same cores reach with nothing of ferry's between the pages and the memory), and the file
// engine alone from the ferry:// source (the network client's ceiling, without the proxy and the GPU).
#include "bench.hpp"
#include "child.hpp"
#include "kernels.hpp"
#include "thread_cpu.hpp"

#include <ferry/core/units.hpp>
#include <ferry/gpu/cache.hpp>
#include <ferry/vm/address_space.hpp>

#include <fcntl.h>
#include <fmt/format.h>
#include <liburing.h>
#include <nlohmann/json.hpp>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <thread>

namespace ferry::cli {
namespace {

using json = nlohmann::ordered_json;
using clk = std::chrono::steady_clock;
constexpr unsigned seed = 0x6a7;

// An element of W 4-byte words, as the kernels (pipeline_kernels.cu) see it.
template <unsigned W>
struct words {
  unsigned w[W];
};

// Element indices: uniform, or Zipf-like by the continuous inverse CDF (rank r has weight ~ 1/r^s),
// the ranks scattered over the dataset by an odd multiplier (a bijection for a power-of-two count).
std::vector<std::uint64_t> make_indices(std::uint64_t n, std::uint64_t elements, bool zipf) {
  std::vector<std::uint64_t> idx(n);
  std::uint64_t x = 0x243F6A8885A308D3ull;
  auto next = [&] {  // splitmix64
    x += 0x9E3779B97F4A7C15ull;
    std::uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  const double s = 0.99, top = std::pow(static_cast<double>(elements) + 1, 1 - s) - 1;
  for (auto& v : idx) {
    if (!zipf) {
      v = next() % elements;
      continue;
    }
    const double u = static_cast<double>(next() >> 11) * 0x1.0p-53;
    auto r = static_cast<std::uint64_t>(std::pow(1 + u * top, 1 / (1 - s))) - 1;
    v = (std::min(r, elements - 1) * 0x9E3779B97F4A7C15ull) % elements;
  }
  return idx;
}

}  // namespace

int run_bench_gather(runtime& rt, const bench_gather_options& o) {
  const std::uint64_t bytes = parse_size(o.size, "--size");
  const std::uint64_t cache_bytes = o.cache.empty() ? bytes / 4 : parse_size(o.cache, "--cache");
  const std::uint64_t page = parse_size(o.page, "--page");
  const std::uint64_t n = o.accesses, step = o.step;
  if (bytes == 0 || (bytes & (bytes - 1)) || page > bytes || n == 0 || step == 0 || o.rounds < 1)
    fail(errc::invalid_argument, "bench gather", "options", "--size a power of two >= --page; --accesses, --step, --rounds >= 1");
  device& dev = o.device.empty() ? rt.devices().default_device() : rt.devices().get(o.device);
  if (dev.info().backend != device_kind::cuda)
    fail(errc::unavailable, "bench gather", dev.id(), "needs a CUDA GPU: it runs a user's kernel (no kernels on a simulated device)");
  const cuda::driver_status& drv = cuda::load(rt.config().cuda_driver);
  if (!drv.api) fail(errc::unavailable, "bench gather", "CUDA driver", drv.reason);
  const auto& api = *drv.api;

  std::string path = o.path;
  struct stat st{};
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) path += fmt::format("/ferry-bench-gather-{}.bin", bytes);
  auto say = [](const std::string& s) {
    fmt::print("{}\n", s);
    std::fflush(stdout);
  };
  say(fmt::format("ferry-bench gather: {} ({}) -> {} ({}); ferry cache {} in {} pages; {} accesses per kernel; staged steps of {}; "
                  "median of {} round(s)",
                  path, format_size(bytes), dev.id(), dev.info().name, format_size(cache_bytes), format_size(page), n, step, o.rounds));
  say("  " + changed_settings(rt.config()));
  auto t0 = clk::now();
  write_word_file(rt, path, bytes, seed);
  say(fmt::format("  wrote the file and read it once into the page cache in {:.1f} s", secs_since(t0)));
  auto f = file::open(path, open_mode::read);

  bench_user u(api, dev.info().ordinal, "bench gather");
  // The zero-copy baseline's copy of the dataset, in pinned host memory mapped for the GPU.
  void* host = nullptr;
  u.check(api.cuMemHostAlloc(&host, bytes, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc");
  {
    int fd = ::open(path.c_str(), O_RDONLY);
    for (std::uint64_t at = 0; at < bytes;) {
      ssize_t got = ::pread(fd, static_cast<char*>(host) + at, std::min<std::uint64_t>(bytes - at, 1 << 30), static_cast<off_t>(at));
      if (got <= 0) fail_errno(errno, "bench gather", path, "pread");
      at += static_cast<std::uint64_t>(got);
    }
    ::close(fd);
  }
  CUdeviceptr host_dev = reinterpret_cast<CUdeviceptr>(host);  // one address for both (unified addressing)
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  const unsigned page_shift = static_cast<unsigned>(__builtin_ctzll(page));

  // Staging for the host-orchestrated baseline: one step's pages at most.
  const std::uint64_t step_pages = std::min(step, bytes / page);
  void* staging = nullptr;
  u.check(api.cuMemHostAlloc(&staging, step_pages * page, 0), "cuMemHostAlloc");
  CUdeviceptr slots = u.alloc(step_pages * page), slot_of = u.alloc(step * 4);
  CUdeviceptr idx_dev = u.alloc(n * 8), out_dev = u.alloc(n * 4), failed_dev = u.alloc(4);
  std::vector<unsigned> out(n);
  int fd = ::open(path.c_str(), O_RDONLY);

  // The same file from a `ferry serve` child process (this program's hidden `serve`, the same code)
  // on loopback. A server that does not start is reported and its rows are missing.
  std::optional<child> server;
  std::shared_ptr<file> remote;
  {
    const std::filesystem::path fp(path);
    const std::string exe = std::filesystem::read_symlink("/proc/self/exe").string();
    try {
      server.emplace(std::vector<std::string>{exe, "serve", "--root", fp.parent_path().string(), "--listen", "127.0.0.1:0", "--insecure"},
                     std::map<std::string, std::string>{});
      const std::string line = server->read_line_with("127.0.0.1:", clk::now() + std::chrono::seconds(20));
      const auto at = line.rfind("127.0.0.1:");
      if (at == std::string::npos) fail(errc::internal, "bench gather", "ferry serve", "did not start: " + line);
      const std::string url = "ferry://127.0.0.1:" + std::to_string(std::stoi(line.substr(at + 10))) + "/" + fp.filename().string();
      remote = file::open(url, open_mode::read);
      say(fmt::format("  ferry:// source: {} (server pid {})", url, server->pid));
    } catch (const std::exception& e) {
      say(fmt::format("  FAILED: no ferry:// source: {}", e.what()));
      remote.reset();
    }
  }
  // ferry unified memory over the whole dataset, its device cap the cache's size; the CPU fills it.
  std::optional<vm::address_space> space;
  std::unique_ptr<stream> user_stream;
  void* unified = nullptr;
  {
    auto so = vm::space_options::from(rt.config());
    so.device_capacity = cache_bytes;
    space.emplace(dev, bytes, so);
    user_stream = dev.wrap_stream(native_stream{reinterpret_cast<std::uintptr_t>(u.s)});
    space->attach_stream(*user_stream);
    unified = space->alloc(bytes);
    std::memcpy(unified, host, bytes);
    if (!space->returns_pages()) say("  unified: no launch callbacks here: every page stays in host memory");
  }

  json rows = json::array();
  bool all_ok = true;
  bool remote_failed = !remote;
  for (unsigned nwords : {2u, 16u}) {
    const std::uint64_t esize = nwords * 4ull, elements = bytes / esize;
    for (bool zipf : {false, true}) {
      const std::string dist = zipf ? "zipf" : "uniform";
      auto idx = make_indices(n, elements, zipf);
      u.to_device(idx_dev, idx.data(), n * 8);
      auto verify = [&](const char* what) {
        u.to_host(out.data(), out_dev, n * 4);
        std::uint64_t bad = 0;
        for (std::uint64_t i = 0; i < n; ++i) {
          unsigned s = 0;
          for (unsigned k = 0; k < nwords; ++k) s += word_at(idx[i] * nwords + k, seed);
          bad += out[i] != s;
        }
        if (bad) {
          all_ok = false;
          say(fmt::format("  VERIFICATION FAILED: {} {}-byte {}: {} of {} elements are not the file's", what, esize, dist, bad, n));
        }
      };
      auto row = [&](const std::string& method, double secs, json extra = json::object()) {
        const double eps = static_cast<double>(n) / secs;
        json r{{"method", method}, {"element_bytes", esize}, {"distribution", dist}, {"seconds", secs},
               {"elements_per_s", eps}, {"effective_gbps", eps * static_cast<double>(esize) / 1e9}};
        r.update(extra);
        say(fmt::format("  {:>2} B {:<7} {:<11} {:>10.3f} ms  {:>12.0f} elements/s  {:>7.3f} GB/s{}", esize, dist, method, secs * 1e3, eps,
                        eps * static_cast<double>(esize) / 1e9, extra.empty() ? "" : "  " + extra.dump()));
        rows.push_back(r);
        return eps;
      };
      const std::string w = std::to_string(nwords);

      // ferry: a new cache per round; cold = its first kernel, warm = the same indices again.
      CUfunction kc = u.fn(("bench_cache_gather_" + w).c_str());
      // Cold and warm rows of the gather through a new cache over `src`; the proxy's cold rate.
      auto through_cache = [&](const std::shared_ptr<file>& src, const std::string& label, double& proxy_rate) {
        std::vector<double> cold, warm, reqs;
        json proxy_note;
        double hit_warm = 0;
        for (int round = 0; round < o.rounds; ++round) {
          gpu::cache_options co = gpu::cache_options::from(rt.config());
          co.bytes = cache_bytes;
          co.page_bytes = static_cast<std::uint32_t>(page);
          gpu::cache c(rt.files(), dev, co);
          auto a = c.map_bytes(src, 0, bytes);
          gpu::array<words<2>> a2(c.view(), a);
          gpu::array<words<16>> a16(c.view(), a);
          void* arg = nwords == 2 ? static_cast<void*>(&a2) : static_cast<void*>(&a16);
          unsigned long long nn = n;
          void* args[] = {arg, &idx_dev, &nn, &out_dev, &failed_dev};
          for (int pass = 0; pass < 2; ++pass) {
            u.check(api.cuMemsetD8Async(failed_dev, 0, 4, u.s), "cuMemsetD8Async");
            auto before = c.stats();
            // CPU per thread name over the cold pass, the server child's too for a ferry:// source:
            // which stage is busy (cpu_cores in the row).
            const pid_t served = label == "ferry://" && server ? server->pid : 0;
            const thread_times cpu0 = thread_times::of(), srv0 = served ? thread_times::of(served) : thread_times{};
            auto t = clk::now();
            u.launch(kc, args);
            u.sync();
            double secs = secs_since(t);
            json cores;
            if (!pass) {
              for (const auto& [name, k] : thread_times::of().cores_since(cpu0, secs)) cores[name] = std::round(k * 100) / 100;
              if (served)
                for (const auto& [name, k] : thread_times::of(served).cores_since(srv0, secs)) cores["serve:" + name] = std::round(k * 100) / 100;
            }
            auto after = c.stats();
            unsigned failed = 0;
            u.to_host(&failed, failed_dev, 4);
            if (failed) {
              all_ok = false;
              say(fmt::format("  FAILED: {} accesses through {} failed: {}", failed, label, cache_failure(c)));
            }
            verify((label + (pass ? " warm" : " cold")).c_str());
            const double miss = static_cast<double>(after.counted.misses - before.counted.misses);
            const double hit = static_cast<double>(after.counted.hits - before.counted.hits);
            (pass ? warm : cold).push_back(secs);
            if (!pass) {
              reqs.push_back(miss / secs);
              const auto& q = after.requests;
              const auto& q0 = before.requests;
              const double reqs_n = std::max(1.0, static_cast<double>((after.counted.misses + after.counted.writebacks) -
                                                                      (before.counted.misses + before.counted.writebacks)));
              proxy_note = {{"requester_submit_us", static_cast<double>(after.counted.submit_ns - before.counted.submit_ns) / reqs_n / 1e3},
                            {"requester_answer_us", static_cast<double>(after.counted.answer_ns - before.counted.answer_ns) / reqs_n / 1e3},
                            {"requester_copy_us", static_cast<double>(after.counted.copy_ns - before.counted.copy_ns) / reqs_n / 1e3},
                            {"requests_per_batch", static_cast<double>(q.requests - q0.requests) / std::max<double>(1, static_cast<double>(q.batches - q0.batches))},
                            {"latency_p50_us", static_cast<double>(q.latency_p50_ns) / 1e3},
                            {"latency_p99_us", static_cast<double>(q.latency_p99_ns) / 1e3},
                            {"proxy_busy", static_cast<double>(q.busy_ns - q0.busy_ns) / (secs * 1e9 * std::max(1u, q.threads))},
                            {"proxy_threads", q.threads},
                            {"cpu_cores", cores}};
            } else {
              hit_warm = hit / std::max(1.0, hit + miss);
            }
          }
        }
        std::sort(cold.begin(), cold.end());
        std::sort(warm.begin(), warm.end());
        std::sort(reqs.begin(), reqs.end());
        proxy_rate = reqs[reqs.size() / 2];
        json cold_extra = proxy_note;
        cold_extra["proxy_requests_per_s"] = proxy_rate;
        row(label + " cold", cold[cold.size() / 2], cold_extra);
        return row(label + " warm", warm[warm.size() / 2], {{"hit_rate", hit_warm}});
      };
      double proxy_rate = 0;
      const double e_ferry = through_cache(f, "ferry", proxy_rate);

      // The file engine alone on the same pages (each distinct page the accesses touch, once), into
      // pinned host memory, in batches of the proxy's size with as many requests under way as the
      // ring has credits: what the proxy's misses could reach from this machine's page cache.
      std::vector<std::uint64_t> distinct;
      distinct.reserve(n);
      for (auto i : idx) distinct.push_back((i * esize) >> page_shift);
      std::sort(distinct.begin(), distinct.end());
      distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
      const std::uint64_t batch = std::max<std::uint32_t>(1, rt.config().gpu_proxy_batch), most = rt.config().gpu_ring_slots;
      double engine_rate = 0;
      // Reads/s of the file engine alone from `src` (the local file, or the ferry:// source: the
      // network client's ceiling, without the proxy and the GPU).
      auto engine_alone = [&](const std::shared_ptr<file>& src, const char* what) {
        std::vector<double> eng;
        for (int round = 0; round < o.rounds; ++round) {
          std::atomic<std::uint64_t> under_way{0}, failed_reads{0};
          auto t = clk::now();
          for (std::uint64_t at = 0; at < distinct.size(); at += batch) {
            const std::uint64_t k = std::min<std::uint64_t>(batch, distinct.size() - at);
            while (under_way.load() + k > most) std::this_thread::yield();
            std::vector<file_request> rs;
            for (std::uint64_t j = 0; j < k; ++j)
              rs.push_back({src, distinct[at + j] * page, static_cast<char*>(staging) + ((at + j) % step_pages) * page, page, false});
            under_way += k;
            rt.files().submit(rs, {}, [&under_way, &failed_reads, k](std::span<const request_result> res) {
              for (auto& x : res) failed_reads += x.state != request_state::done;
              under_way -= k;
            });
          }
          while (under_way.load()) std::this_thread::yield();
          eng.push_back(secs_since(t));
          if (failed_reads) {
            all_ok = false;
            say(fmt::format("  FAILED: {} reads of the file engine alone from {} failed", failed_reads.load(), what));
          }
        }
        std::sort(eng.begin(), eng.end());
        return std::pair(static_cast<double>(distinct.size()) / eng[eng.size() / 2], eng[eng.size() / 2]);
      };
      {
        const auto [rate, eng_s] = engine_alone(f, "the file");
        engine_rate = rate;
        say(fmt::format("  {:>2} B {:<7} file engine alone: {:.0f} reads/s of {} pages ({} distinct); ferry's proxy (cold) {:.2f}x that",
                        esize, dist, rate, format_size(page), distinct.size(), proxy_rate / rate));
        rows.push_back(json{{"method", "file engine alone"}, {"element_bytes", esize}, {"distribution", dist},
                            {"pages", distinct.size()}, {"seconds", eng_s}, {"reads_per_s", rate},
                            {"proxy_vs_engine", proxy_rate / rate}});

        // io_uring alone: the same pages, threads as many as the file engine's, each its own ring.
        const int raw_threads = rt.config().io_threads > 0 ? rt.config().io_threads : default_io_threads();
        const unsigned depth = static_cast<unsigned>(std::max(1, rt.config().io_depth));
        std::vector<double> raw;
        for (int round = 0; round < o.rounds; ++round) {
          std::atomic<std::uint64_t> failed_reads{0};
          std::vector<std::thread> ts;
          auto t = clk::now();
          for (int th = 0; th < raw_threads; ++th)
            ts.emplace_back([&, th] {
              io_uring ring{};
              const int rfd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
              if (rfd < 0 || io_uring_queue_init(2 * depth, &ring, 0) < 0) {
                failed_reads += 1;
                if (rfd >= 0) ::close(rfd);
                return;
              }
              const std::uint64_t lo = distinct.size() * static_cast<std::uint64_t>(th) / static_cast<std::uint64_t>(raw_threads);
              const std::uint64_t hi = distinct.size() * static_cast<std::uint64_t>(th + 1) / static_cast<std::uint64_t>(raw_threads);
              std::uint64_t next = lo, under = 0;
              while (next < hi || under) {
                while (next < hi && under < depth) {
                  io_uring_sqe* q = io_uring_get_sqe(&ring);
                  io_uring_prep_read(q, rfd, static_cast<char*>(staging) + (next % step_pages) * page, static_cast<unsigned>(page),
                                     distinct[next] * page);
                  ++next, ++under;
                }
                if (io_uring_submit_and_wait(&ring, 1) < 0) {
                  failed_reads += 1;
                  break;
                }
                io_uring_cqe* c;
                unsigned head, seen = 0;
                io_uring_for_each_cqe(&ring, head, c) {
                  failed_reads += c->res != static_cast<int>(page);
                  ++seen;
                }
                io_uring_cq_advance(&ring, seen);
                under -= seen;
              }
              io_uring_queue_exit(&ring);
              ::close(rfd);
            });
          for (auto& x : ts) x.join();
          raw.push_back(secs_since(t));
          if (failed_reads) {
            all_ok = false;
            say(fmt::format("  FAILED: {} reads of io_uring alone failed", failed_reads.load()));
          }
        }
        std::sort(raw.begin(), raw.end());
        const double raw_rate = static_cast<double>(distinct.size()) / raw[raw.size() / 2];
        say(fmt::format("  {:>2} B {:<7} io_uring alone ({} threads, {} each under way): {:.0f} reads/s; ferry's proxy (cold) {:.2f}x that",
                        esize, dist, raw_threads, depth, raw_rate, proxy_rate / raw_rate));
        rows.push_back(json{{"method", "io_uring alone"}, {"element_bytes", esize}, {"distribution", dist}, {"threads", raw_threads},
                            {"depth", depth}, {"pages", distinct.size()}, {"seconds", raw[raw.size() / 2]},
                            {"reads_per_s", raw_rate}, {"proxy_vs_io_uring", proxy_rate / raw_rate}});
      }

      // zero-copy from pinned host memory.
      CUfunction kh = u.fn(("bench_host_gather_" + w).c_str());
      std::vector<double> zc;
      for (int round = 0; round < o.rounds; ++round) {
        unsigned long long nn = n;
        void* args[] = {&host_dev, &idx_dev, &nn, &out_dev};
        auto t = clk::now();
        u.launch(kh, args);
        u.sync();
        zc.push_back(secs_since(t));
      }
      verify("zero-copy");
      std::sort(zc.begin(), zc.end());
      const double e_zc = row("zero-copy", zc[zc.size() / 2]);

      // host-orchestrated: per step, the CPU finds the pages, reads them, copies them, launches.
      CUfunction ks = u.fn(("bench_staged_gather_" + w).c_str());
      std::vector<double> stg;
      std::vector<std::uint64_t> pages;
      std::vector<unsigned> slot(step);
      for (int round = 0; round < o.rounds; ++round) {
        auto t = clk::now();
        for (std::uint64_t first = 0; first < n; first += step) {
          const std::uint64_t k = std::min(step, n - first);
          pages.clear();
          for (std::uint64_t i = 0; i < k; ++i) pages.push_back((idx[first + i] * esize) >> page_shift);
          std::sort(pages.begin(), pages.end());
          pages.erase(std::unique(pages.begin(), pages.end()), pages.end());
          for (std::uint64_t i = 0; i < k; ++i)
            slot[i] = static_cast<unsigned>(std::lower_bound(pages.begin(), pages.end(), (idx[first + i] * esize) >> page_shift) - pages.begin());
          std::vector<std::thread> ts;
          for (unsigned tix = 0; tix < threads; ++tix)
            ts.emplace_back([&, tix] {
              for (std::size_t j = tix; j < pages.size(); j += threads)
                if (::pread(fd, static_cast<char*>(staging) + j * page, page, static_cast<off_t>(pages[j] * page)) != static_cast<ssize_t>(page))
                  std::abort();  // the file is ours and whole: a short read is a broken machine
            });
          for (auto& x : ts) x.join();
          u.check(api.cuMemcpyAsync(slots, reinterpret_cast<CUdeviceptr>(staging), pages.size() * page, u.s), "cuMemcpyAsync");
          u.check(api.cuMemcpyAsync(slot_of, reinterpret_cast<CUdeviceptr>(slot.data()), k * 4, u.s), "cuMemcpyAsync");
          CUdeviceptr idx_at = idx_dev + first * 8, out_at = out_dev + first * 4;
          unsigned long long kk = k;
          unsigned shift = page_shift;
          void* args[] = {&slots, &slot_of, &idx_at, &kk, &shift, &out_at};
          u.launch(ks, args);
          u.sync();  // the staging buffer and slot map are reused by the next step
        }
        stg.push_back(secs_since(t));
      }
      verify("staged");
      std::sort(stg.begin(), stg.end());
      const double e_stg = row("staged", stg[stg.size() / 2]);

      // ferry unified memory, oversubscribed: the first launch after the CPU filled it, then later ones.
      std::vector<double> um;
      double um_first = 0;
      for (int round = 0; round <= o.rounds; ++round) {
        unsigned long long nn = n;
        CUdeviceptr p = reinterpret_cast<CUdeviceptr>(unified);
        void* args[] = {&p, &idx_dev, &nn, &out_dev};
        auto t = clk::now();
        u.launch(kh, args);
        u.sync();
        (round ? um.push_back(secs_since(t)) : void(um_first = secs_since(t)));
      }
      verify("unified");
      std::sort(um.begin(), um.end());
      const vm::vm_stats vs = space->stats();
      const double e_um = row("unified", um[um.size() / 2], {{"first_launch_s", um_first}, {"device_cap", cache_bytes},
                                                             {"pages_returned_to_device", vs.returns}, {"pages_held_on_host", vs.return_holds}});

      // The same gather from the ferry:// source.
      double e_remote = 0, remote_rate = 0;
      if (remote) {
        try {
          e_remote = through_cache(remote, "ferry://", remote_rate);
        } catch (const std::exception& e) {
          all_ok = false;
          remote_failed = true;
          say(fmt::format("  FAILED: the ferry:// gather: {}", e.what()));
        }
      }
      // The file engine alone from the ferry:// source, after its gather (as the file's comes after the
      // file's gather): the network client's ceiling, without the proxy and the GPU.
      if (remote) {
        try {
          const auto [remote_engine, remote_s] = engine_alone(remote, "the ferry:// source");
          say(fmt::format("  {:>2} B {:<7} file engine alone from the ferry:// source: {:.0f} reads/s ({:.2f}x the file's)", esize, dist,
                          remote_engine, remote_engine / engine_rate));
          rows.push_back(json{{"method", "file engine alone, ferry://"}, {"element_bytes", esize}, {"distribution", dist},
                              {"pages", distinct.size()}, {"seconds", remote_s}, {"reads_per_s", remote_engine}});
        } catch (const std::exception& e) {
          all_ok = false;
          say(fmt::format("  FAILED: the file engine alone from the ferry:// source: {}", e.what()));
        }
      }
      say(fmt::format("  {:>2} B {:<7} ferry warm / zero-copy {:.2f}x, / staged {:.2f}x, / unified {:.2f}x; ferry:// warm / zero-copy {:.2f}x, "
                      "/ staged {:.2f}x, its proxy {:.0f} requests/s",
                      esize, dist, e_ferry / e_zc, e_ferry / e_stg, e_ferry / e_um, e_remote / e_zc, e_remote / e_stg, remote_rate));
    }
  }
  std::string counters;
  for (auto& [k, v] : rt.files().counters().snapshot())
    if (k.starts_with("reads.") || k.starts_with("requests")) counters += fmt::format(" {}={}", k, v);
  say("  file engine:" + counters);
  // How the ferry:// source's data moved (transports, landing region, copies on): where its time may go.
  if (remote) say("  ferry:// source: " + remote->describe());
  if (remote_failed) all_ok = false;
  remote.reset();
  server.reset();  // SIGKILL: the server's state does not matter any more
  space->free(unified);
  space->detach_stream(*user_stream);
  space.reset();
  user_stream.reset();
  ::close(fd);
  api.cuMemFree(slots);
  api.cuMemFree(slot_of);
  api.cuMemFree(idx_dev);
  api.cuMemFree(out_dev);
  api.cuMemFree(failed_dev);
  api.cuMemFreeHost(staging);
  api.cuMemFreeHost(host);
  if (!all_ok) say("VERIFICATION FAILED");
  if (!o.json_out.empty()) {
    json out_j{{"file", path}, {"bytes", bytes}, {"cache_bytes", cache_bytes}, {"page", page}, {"accesses", n}, {"step", step},
               {"device", dev.id()}, {"name", dev.info().name}, {"rows", rows}, {"all_verified", all_ok}};
    std::ofstream(o.json_out) << out_j.dump(2) << "\n";
  }
  f.reset();
  if (!o.keep) ::unlink(path.c_str());
  return all_ok ? 0 : 1;
}

}  // namespace ferry::cli
