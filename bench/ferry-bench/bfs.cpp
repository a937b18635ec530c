// `ferry-bench bfs --path DIR`: a user's breadth-first search over a generated power-law graph whose
// CSR file is 4x the GPU cache given to it. Level by level (top-down, one warp per frontier vertex),
// the graph read
//   ferry       through ferry's GPU page cache (gpu::cache, two gpu::arrays over the file: offsets and
//               neighbour lists); cold (a new cache) and warm (the same search again, the cache as the
//               first left it)
//   zero-copy   from pinned host memory holding the whole CSR, read by the kernel over PCIe (loaded
//               beforehand, not timed)
//   staged      host-orchestrated: per level the CPU copies the frontier back, reads the offset pages
//               it needs from the file, collects the neighbour-list pages the frontier spans, reads
//               them (pread, as many threads as cores) into pinned memory as large as ferry's cache,
//               copies them to the GPU and launches on them (more pages than fit: the frontier in parts)
// all in the same run from the same root (the vertex of highest degree). Every search's distances are
// checked against a CPU search. Reports seconds, edges traversed per second and the ratios the issue
// asks for (ferry / zero-copy, ferry / staged).
//
// The graph: V vertices (a power of two), V x degree directed edges whose ends are drawn Zipf-like
// (exponent 0.5 for sources, 0.8 for targets; ranks scattered over the vertices), so both degree
// distributions have power-law tails. File: V + 1 offsets (8 bytes each), then, at the next page, the
// neighbour lists (4-byte vertex numbers).
#include "bench.hpp"
#include "kernels.hpp"

#include <ferry/core/units.hpp>
#include <ferry/gpu/cache.hpp>

#include <fcntl.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <fstream>
#include <thread>

namespace ferry::cli {
namespace {

using json = nlohmann::ordered_json;
using clk = std::chrono::steady_clock;
struct graph {
  std::uint64_t vertices = 0, edges = 0, cols_at = 0, bytes = 0;
  std::vector<std::uint64_t> offs;
  std::vector<unsigned> cols;
};

// Vertex of Zipf-like rank drawn from u in [0, 1), scattered by an odd multiplier (a bijection for a
// power-of-two count).
unsigned zipf_vertex(double u, double s, std::uint64_t n) {
  const double top = std::pow(static_cast<double>(n) + 1, 1 - s) - 1;
  auto r = static_cast<std::uint64_t>(std::pow(1 + u * top, 1 / (1 - s))) - 1;
  return static_cast<unsigned>((std::min(r, n - 1) * 0x9E3779B97F4A7C15ull) & (n - 1));
}

graph generate(std::uint64_t vertices, std::uint64_t degree, std::uint64_t page) {
  graph g;
  g.vertices = vertices;
  g.edges = vertices * degree;
  std::vector<unsigned> src(g.edges), dst(g.edges);
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> ts;
  for (unsigned t = 0; t < threads; ++t)
    ts.emplace_back([&, t] {
      std::uint64_t x = 0x243F6A8885A308D3ull + t * 0x9E3779B97F4A7C15ull;
      auto next = [&] {  // splitmix64
        x += 0x9E3779B97F4A7C15ull;
        std::uint64_t z = x;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return static_cast<double>((z ^ (z >> 31)) >> 11) * 0x1.0p-53;
      };
      for (std::uint64_t e = g.edges * t / threads; e < g.edges * (t + 1) / threads; ++e) {
        src[e] = zipf_vertex(next(), 0.5, vertices);
        dst[e] = zipf_vertex(next(), 0.8, vertices);
      }
    });
  for (auto& t : ts) t.join();
  g.offs.assign(vertices + 1, 0);
  for (unsigned s : src) g.offs[s + 1]++;
  for (std::uint64_t v = 0; v < vertices; ++v) g.offs[v + 1] += g.offs[v];
  g.cols.resize(g.edges);
  std::vector<std::uint64_t> at(g.offs.begin(), g.offs.end() - 1);
  for (std::uint64_t e = 0; e < g.edges; ++e) g.cols[at[src[e]]++] = dst[e];
  g.cols_at = ((vertices + 1) * 8 + page - 1) / page * page;
  g.bytes = g.cols_at + g.edges * 4;
  return g;
}

std::vector<unsigned> cpu_bfs(const graph& g, unsigned root) {
  std::vector<unsigned> dist(g.vertices, ~0u);
  std::vector<unsigned> q{root};
  dist[root] = 0;
  for (std::size_t h = 0; h < q.size(); ++h) {
    const unsigned v = q[h];
    for (std::uint64_t k = g.offs[v]; k < g.offs[v + 1]; ++k)
      if (dist[g.cols[k]] == ~0u) dist[g.cols[k]] = dist[v] + 1, q.push_back(g.cols[k]);
  }
  return dist;
}

}  // namespace

int run_bench_bfs(runtime& rt, const bench_bfs_options& o) {
  const std::uint64_t vertices = o.vertices, degree = o.degree, page = parse_size(o.page, "--page");
  if (vertices < 1024 || (vertices & (vertices - 1)) || vertices > (1ull << 31) || degree < 1 || o.rounds < 1 || page < 4096 ||
      (page & (page - 1)))
    fail(errc::invalid_argument, "bench bfs", "options", "--vertices a power of two from 1024 to 2^31; --degree, --rounds >= 1; --page a power of two >= 4 KiB");
  device& dev = o.device.empty() ? rt.devices().default_device() : rt.devices().get(o.device);
  if (dev.info().backend != device_kind::cuda)
    fail(errc::unavailable, "bench bfs", dev.id(), "needs a CUDA GPU: it runs a user's kernel (no kernels on a simulated device)");
  const cuda::driver_status& drv = cuda::load(rt.config().cuda_driver);
  if (!drv.api) fail(errc::unavailable, "bench bfs", "CUDA driver", drv.reason);
  const auto& api = *drv.api;
  auto say = [](const std::string& s) {
    fmt::print("{}\n", s);
    std::fflush(stdout);
  };

  auto t0 = clk::now();
  graph g = generate(vertices, degree, page);
  const std::uint64_t cache_bytes = o.cache.empty() ? (g.bytes / 4 + page - 1) / page * page : parse_size(o.cache, "--cache");
  std::string path = o.path;
  struct stat st{};
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) path += fmt::format("/ferry-bench-bfs-{}-{}.csr", vertices, degree);
  {
    int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) fail_errno(errno, "bench bfs", path, "open");
    auto put = [&](const void* p, std::uint64_t n, std::uint64_t at) {
      for (std::uint64_t d = 0; d < n;) {
        ssize_t w = ::pwrite(fd, static_cast<const char*>(p) + d, std::min<std::uint64_t>(n - d, 1 << 30), static_cast<off_t>(at + d));
        if (w <= 0) fail_errno(errno, "bench bfs", path, "pwrite");
        d += static_cast<std::uint64_t>(w);
      }
    };
    put(g.offs.data(), g.offs.size() * 8, 0);
    put(g.cols.data(), g.edges * 4, g.cols_at);
    ::close(fd);
  }
  unsigned root = 0;
  for (std::uint64_t v = 0; v < vertices; ++v)
    if (g.offs[v + 1] - g.offs[v] > g.offs[root + 1] - g.offs[root]) root = static_cast<unsigned>(v);
  auto t_cpu = clk::now();
  const std::vector<unsigned> want = cpu_bfs(g, root);
  const double cpu_secs = secs_since(t_cpu);
  std::uint64_t reached = 0, levels = 0, traversed = 0;
  for (std::uint64_t v = 0; v < vertices; ++v)
    if (want[v] != ~0u) reached++, levels = std::max<std::uint64_t>(levels, want[v] + 1), traversed += g.offs[v + 1] - g.offs[v];
  say(fmt::format("ferry-bench bfs: {} vertices, {} edges (degree {}), CSR {} ({}) -> {} ({}); ferry cache {} in {} pages; median of {} round(s)",
                  vertices, g.edges, degree, path, format_size(g.bytes), dev.id(), dev.info().name, format_size(cache_bytes), format_size(page),
                  o.rounds));
  say("  " + changed_settings(rt.config()));
  say(fmt::format("  generated and written in {:.1f} s; root {} (out-degree {}); the search reaches {} vertices in {} levels over {} edges "
                  "(CPU, one thread: {:.2f} s)",
                  secs_since(t0), root, g.offs[root + 1] - g.offs[root], reached, levels, traversed, cpu_secs));

  bench_user u(api, dev.info().ordinal, "bench bfs");
  void* host = nullptr;  // the zero-copy baseline's CSR
  u.check(api.cuMemHostAlloc(&host, g.bytes, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc");
  std::memcpy(host, g.offs.data(), g.offs.size() * 8);
  std::memcpy(static_cast<char*>(host) + g.cols_at, g.cols.data(), g.edges * 4);
  g.cols.clear();
  g.cols.shrink_to_fit();  // the CPU's copy: the staged baseline reads the file, like ferry
  const auto host_dev = reinterpret_cast<CUdeviceptr>(host);
  CUdeviceptr dist = u.alloc(vertices * 4), fa = u.alloc(vertices * 4), fb = u.alloc(vertices * 4), nnext = u.alloc(4), failed = u.alloc(4);
  // The staged baseline's device memory too, before the host allocations below: a cuMemAlloc after
  // large host mappings came and went has failed with CUDA_ERROR_ALREADY_MAPPED on the H100 machine
  // (driver 580), the address the driver picked being mapped on the CPU side by then.
  const std::uint64_t file_pages = (g.bytes + page - 1) / page, cap = cache_bytes / page;
  CUdeviceptr slots = u.alloc(cap * page), slot_of = u.alloc(file_pages * 4), begin_dev = u.alloc(vertices * 8), end_dev = u.alloc(vertices * 8);
  std::vector<unsigned> got(vertices);
  bool all_ok = true;
  auto verify = [&](const std::string& what) {
    u.to_host(got.data(), dist, vertices * 4);
    std::uint64_t bad = 0;
    for (std::uint64_t v = 0; v < vertices; ++v) bad += got[v] != want[v];
    if (bad) {
      all_ok = false;
      say(fmt::format("  VERIFICATION FAILED: {}: {} of {} distances differ from the CPU's", what, bad, vertices));
    }
  };
  // One search: `level(frontier, nf, next, level)` enqueues the level's work on the user's stream;
  // the frontier size comes back after each level (every method needs it to go on).
  auto search = [&](auto&& level_fn) {
    u.check(api.cuMemsetD8Async(dist, 0xFF, vertices * 4, u.s), "cuMemsetD8Async");
    const unsigned zero = 0;
    u.to_device(dist + root * 4ull, &zero, 4);
    u.to_device(fa, &root, 4);
    u.check(api.cuMemsetD8Async(failed, 0, 4, u.s), "cuMemsetD8Async");
    CUdeviceptr cur = fa, nxt = fb;
    unsigned nf = 1, lv = 0;
    auto t = clk::now();
    while (nf) {
      u.check(api.cuMemsetD8Async(nnext, 0, 4, u.s), "cuMemsetD8Async");
      level_fn(cur, nf, nxt, lv);
      u.to_host(&nf, nnext, 4);
      std::swap(cur, nxt);
      ++lv;
    }
    return secs_since(t);
  };
  json rows = json::array();
  auto row = [&](const std::string& method, double secs, json extra = json::object()) {
    const double teps = static_cast<double>(traversed) / secs;
    json r{{"method", method}, {"seconds", secs}, {"edges_per_s", teps}};
    r.update(extra);
    say(fmt::format("  {:<10} {:>10.1f} ms  {:>12.0f} edges/s{}", method, secs * 1e3, teps, extra.empty() ? "" : "  " + extra.dump()));
    rows.push_back(r);
    return secs;
  };

  // ferry: a new cache per round; cold = its first search, warm = the same search again.
  auto f = file::open(path, open_mode::read);
  CUfunction kc = u.fn("bench_bfs_cache");
  std::vector<double> cold, warm;
  json note;
  for (int round = 0; round < o.rounds; ++round) {
    gpu::cache_options co = gpu::cache_options::from(rt.config());
    co.bytes = cache_bytes;
    co.page_bytes = static_cast<std::uint32_t>(page);
    gpu::cache c(rt.files(), dev, co);
    auto offs = c.map<unsigned long long>(f, 0, vertices + 1);
    auto cols = c.map<unsigned>(f, g.cols_at / 4, g.edges);
    for (int pass = 0; pass < 2; ++pass) {
      auto before = c.stats();
      double secs = search([&](CUdeviceptr cur, unsigned nf, CUdeviceptr nxt, unsigned lv) {
        void* args[] = {&offs, &cols, &cur, &nf, &lv, &dist, &nxt, &nnext, &failed};
        u.launch(kc, args);
      });
      auto after = c.stats();
      unsigned nfailed = 0;
      u.to_host(&nfailed, failed, 4);
      if (nfailed) {
        all_ok = false;
        say(fmt::format("  FAILED: {} accesses through ferry failed: {}", nfailed, cache_failure(c)));
      }
      verify(pass ? "ferry warm" : "ferry cold");
      (pass ? warm : cold).push_back(secs);
      const double miss = static_cast<double>(after.counted.misses - before.counted.misses);
      const double hit = static_cast<double>(after.counted.hits - before.counted.hits);
      if (round == 0) note[pass ? "warm" : "cold"] = {{"misses", miss}, {"hit_rate", hit / std::max(1.0, hit + miss)},
                                                       {"proxy_requests_per_s", miss / secs}};
    }
  }
  std::sort(cold.begin(), cold.end());
  std::sort(warm.begin(), warm.end());
  const double s_cold = row("ferry cold", cold[cold.size() / 2], note["cold"]);
  const double s_warm = row("ferry warm", warm[warm.size() / 2], note["warm"]);

  // zero-copy from pinned host memory.
  CUfunction kh = u.fn("bench_bfs_host");
  std::vector<double> zc;
  const CUdeviceptr cols_dev = host_dev + g.cols_at;
  for (int round = 0; round < o.rounds; ++round) {
    zc.push_back(search([&](CUdeviceptr cur, unsigned nf, CUdeviceptr nxt, unsigned lv) {
      CUdeviceptr offs_p = host_dev, cols_p = cols_dev;
      void* args[] = {&offs_p, &cols_p, &cur, &nf, &lv, &dist, &nxt, &nnext};
      u.launch(kh, args);
    }));
    verify("zero-copy");
  }
  std::sort(zc.begin(), zc.end());
  const double s_zc = row("zero-copy", zc[zc.size() / 2]);

  // host-orchestrated, with pinned staging as large as ferry's cache.
  CUfunction ks = u.fn("bench_bfs_staged");
  const unsigned shift = static_cast<unsigned>(__builtin_ctzll(page));
  void* staging = nullptr;
  u.check(api.cuMemHostAlloc(&staging, cap * page, 0), "cuMemHostAlloc");
  std::vector<unsigned> slot_of_host(file_pages, ~0u), frontier(vertices);
  std::vector<std::uint64_t> offs_buf(g.cols_at / 8), group_pages, offs_pages, begin(vertices), end(vertices);
  std::vector<std::uint64_t> stamp(file_pages, 0);
  std::uint64_t stamp_now = 0, parts = 0;
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  // pread of the listed pages, on `threads` threads; into `to(j)` for the j-th page.
  auto read_pages = [&](const std::vector<std::uint64_t>& pages, auto&& to) {
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < threads; ++t)
      ts.emplace_back([&, t] {
        for (std::size_t j = t; j < pages.size(); j += threads) {
          const std::uint64_t at = pages[j] * page, n = std::min(page, g.bytes - at);
          if (::pread(fd, to(j), n, static_cast<off_t>(at)) != static_cast<ssize_t>(n)) std::abort();  // our own whole file
        }
      });
    for (auto& t : ts) t.join();
  };
  std::vector<double> stg;
  for (int round = 0; round < o.rounds; ++round) {
    stg.push_back(search([&](CUdeviceptr cur, unsigned nf, CUdeviceptr nxt, unsigned lv) {
      u.to_host(frontier.data(), cur, nf * 4ull);
      // The offsets the frontier needs, read from the file.
      offs_pages.clear();
      ++stamp_now;
      for (unsigned i = 0; i < nf; ++i)
        for (std::uint64_t b : {frontier[i] * 8ull, frontier[i] * 8ull + 15})
          if (stamp[b / page] != stamp_now) stamp[b / page] = stamp_now, offs_pages.push_back(b / page);
      read_pages(offs_pages, [&](std::size_t j) { return reinterpret_cast<char*>(offs_buf.data()) + offs_pages[j] * page; });
      // The frontier in parts whose neighbour-list pages fit the staging.
      unsigned first = 0;
      while (first < nf) {
        ++stamp_now;
        group_pages.clear();
        unsigned last = first;
        for (; last < nf; ++last) {
          const std::uint64_t b = offs_buf[frontier[last]], e = offs_buf[frontier[last] + 1];
          // Its list's pages [p0, p1) (none for a vertex without edges).
          const std::uint64_t p0 = (g.cols_at + b * 4) >> shift, p1 = e > b ? ((g.cols_at + e * 4 - 1) >> shift) + 1 : p0;
          std::uint64_t fresh = 0;
          for (std::uint64_t p = p0; p < p1; ++p) fresh += stamp[p] != stamp_now;
          if (group_pages.size() + fresh > cap) {
            if (last == first) fail(errc::out_of_range, "bench bfs", "staged", "one neighbour list spans more pages than the staging holds");
            break;
          }
          for (std::uint64_t p = p0; p < p1; ++p)
            if (stamp[p] != stamp_now) stamp[p] = stamp_now, group_pages.push_back(p);
          begin[last - first] = b;
          end[last - first] = e;
        }
        read_pages(group_pages, [&](std::size_t j) { return static_cast<char*>(staging) + j * page; });
        for (std::size_t j = 0; j < group_pages.size(); ++j) slot_of_host[group_pages[j]] = static_cast<unsigned>(j);
        u.to_device(slots, staging, group_pages.size() * page);
        u.to_device(slot_of, slot_of_host.data(), file_pages * 4);
        u.to_device(begin_dev, begin.data(), (last - first) * 8ull);
        u.to_device(end_dev, end.data(), (last - first) * 8ull);
        unsigned n = last - first;
        void* args[] = {&slots, &slot_of, const_cast<unsigned*>(&shift), const_cast<std::uint64_t*>(&g.cols_at), &begin_dev, &end_dev,
                        &n, &lv, &dist, &nxt, &nnext};
        u.launch(ks, args);
        u.sync();  // the staging, the slot map and the lists are reused by the next part
        for (auto p : group_pages) slot_of_host[p] = ~0u;
        ++parts;
        first = last;
      }
    }));
    verify("staged");
  }
  ::close(fd);
  std::sort(stg.begin(), stg.end());
  const double s_stg = row("staged", stg[stg.size() / 2], {{"kernel_launches_per_search", static_cast<double>(parts) / o.rounds}});
  say(fmt::format("  ferry warm / zero-copy {:.2f}x, / staged {:.2f}x; ferry cold / zero-copy {:.2f}x, / staged {:.2f}x (speed: time ratio inverted)",
                  s_zc / s_warm, s_stg / s_warm, s_zc / s_cold, s_stg / s_cold));
  for (CUdeviceptr p : {dist, fa, fb, nnext, failed, slots, slot_of, begin_dev, end_dev}) api.cuMemFree(p);
  api.cuMemFreeHost(staging);
  api.cuMemFreeHost(host);
  if (!all_ok) say("VERIFICATION FAILED");
  if (!o.json_out.empty()) {
    json out_j{{"file", path}, {"bytes", g.bytes}, {"vertices", vertices}, {"edges", g.edges}, {"root", root}, {"reached", reached},
               {"levels", levels}, {"traversed_edges", traversed}, {"cache_bytes", cache_bytes}, {"page", page}, {"device", dev.id()},
               {"name", dev.info().name}, {"rows", rows}, {"all_verified", all_ok},
               {"ferry_warm_vs_zero_copy", s_zc / s_warm}, {"ferry_warm_vs_staged", s_stg / s_warm}};
    std::ofstream(o.json_out) << out_j.dump(2) << "\n";
  }
  f.reset();
  if (!o.keep) ::unlink(path.c_str());
  return all_ok ? 0 : 1;
}

}  // namespace ferry::cli
