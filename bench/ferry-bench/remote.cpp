// `ferry-bench remote`: ferry:// reads and writes against the raw UCX primitives, in one run, per
// transport (tcp, shared memory), on loopback:
//   baseline  ucx_perftest (two processes, its own bootstrap): ucp_am_bw, ucp_put_bw, ucp_get,
//             tag_bw at each block size (16 outstanding), and ucp_am_lat (8 B; 4 KiB three times, median) for the round trip
//   ferry     a `ferry serve` child process over a generated file (warm page cache), this process as
//             the client: reads and writes into host memory and GPU memory, block sizes x queue
//             depths, GB/s, IOPS, p50/p99 latency, and the ratio to the best baseline primitive at
//             the same block size; data verified by checksum after each sweep.
//   floor     (writes) QD 1 pwrite of each block size over the served directory's existing file and
//             into a new file there: what the file system alone costs an in-place and an atomic writer.
#include "bench.hpp"
#include "child.hpp"
#include "endpoint.hpp"
#include "scratch_dir.hpp"

#include <ferry/core/checksum.hpp>
#include <ferry/core/units.hpp>
#include <ferry/store/client.hpp>
#include <ferry/store/server.hpp>

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <netinet/in.h>
#include <nlohmann/json.hpp>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

extern char** environ;

namespace ferry::cli {
namespace {

using json = nlohmann::ordered_json;
using clk = std::chrono::steady_clock;

std::vector<std::uint64_t> parse_list(const std::string& s, const char* what) {
  std::vector<std::uint64_t> v;
  std::stringstream in(s);
  for (std::string x; std::getline(in, x, ',');)
    if (!x.empty()) v.push_back(parse_size(x, what));
  return v;
}

// A comma-separated choice among `allowed`; anything else is an error naming it.
std::set<std::string> parse_choices(const std::string& s, const std::vector<std::string>& allowed, const char* what) {
  std::set<std::string> v;
  std::stringstream in(s);
  for (std::string t; std::getline(in, t, ',');) {
    if (std::find(allowed.begin(), allowed.end(), t) == allowed.end())
      fail(errc::invalid_argument, "bench remote", t, fmt::format("unknown {} ({})", what, fmt::join(allowed, ", ")));
    v.insert(t);
  }
  return v;
}

std::uint16_t free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0)
    fail_errno(errno, "bench remote", "port", "cannot find a free loopback port");
  ::close(fd);
  return ntohs(a.sin_port);
}

struct perf_result {
  bool ok = false;
  double gbps = 0, p50_us = 0;
  std::string error;
};

// One ucx_perftest pair on loopback. Bandwidth in GB/s (perftest prints MB/s of 2^20 bytes); for
// latency tests p50_us is perftest's one-way latency (half the round trip).
perf_result perftest(const std::string& exe, const std::map<std::string, std::string>& env, const std::string& test,
                     std::uint64_t size, std::uint64_t iters, bool bw) {
  perf_result r;
  for (int attempt = 0; attempt < 2 && !r.ok; ++attempt) {
    std::string port = std::to_string(free_port());
    std::vector<std::string> common = {"-t", test, "-s", std::to_string(size), "-n", std::to_string(iters), "-w",
                                       std::to_string(std::max<std::uint64_t>(iters / 10, 5)), "-p", port};
    if (bw) common.insert(common.end(), {"-O", "16"});
    std::vector<std::string> srv = {exe, "-p", port};
    child server(srv, env);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    std::vector<std::string> cli = {exe, "127.0.0.1"};
    cli.insert(cli.end(), common.begin(), common.end());
    cli.insert(cli.end(), {"-f"});
    child client(cli, env);
    auto until = clk::now() + std::chrono::seconds(60);
    std::string out = client.read_all(until);
    int rc = client.wait(until);
    server.wait(clk::now() + std::chrono::seconds(2));
    // The final line: iterations, p50, avg, overall (usec), bw avg, bw overall (MB/s), rates.
    std::istringstream in(out);
    std::string last;
    for (std::string line; std::getline(in, line);) {
      std::istringstream ls(line);
      double v;
      if (ls >> v && line.find('|') == std::string::npos) last = line;
    }
    std::istringstream ls(last);
    double it = 0, p50 = 0, avg = 0, overall = 0, bwa = 0, bwo = 0;
    if (rc == 0 && (ls >> it >> p50 >> avg >> overall >> bwa >> bwo)) {
      r.ok = true;
      r.gbps = bwo * 1048576.0 / 1e9;
      r.p50_us = p50;
    } else {
      r.error = fmt::format("rc {}: {}", rc, printable(out.substr(out.size() > 300 ? out.size() - 300 : 0), 300));
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    }
  }
  return r;
}

struct run_result {
  double gbps = 0, iops = 0, p50_us = 0, p99_us = 0;
  double start_p50_us = 0;  // time inside submit (the caller's send side), p50
  double waited = 0;        // the share of the run the caller spent waiting for a completion
  std::uint64_t requests = 0;
};

// Memory for one row of the table: the caller's own (an endpoint: host or a device) or, for "lent",
// host memory allocated from the client (client::allocate).
class lent_or_endpoint {
 public:
  lent_or_endpoint(runtime& rt, store::client& c, const std::string& spec, std::uint64_t bytes) : c_(c) {
    if (spec == "lent") lent_ = static_cast<std::byte*>(c.allocate(bytes));
    else ep_.emplace(rt, spec, bytes);
  }
  ~lent_or_endpoint() {
    if (lent_) c_.deallocate(lent_);
  }
  lent_or_endpoint(const lent_or_endpoint&) = delete;
  lent_or_endpoint& operator=(const lent_or_endpoint&) = delete;
  std::byte* data() const { return lent_ ? lent_ : ep_->data(); }
  void fill(std::uint64_t n, std::uint64_t seed) { lent_ ? fill_pattern(lent_, n, seed) : ep_->fill(n, seed); }
  std::uint64_t checksum(std::uint64_t n) { return lent_ ? checksum64(lent_, n) : ep_->checksum(n); }

 private:
  store::client& c_;
  std::byte* lent_ = nullptr;
  std::optional<endpoint> ep_;
};

// `reqs` requests of `size` bytes with `qd` outstanding; request i uses buffer slot i % qd and file
// offset (i * size) mod (file - size), 4 KiB aligned.
// At queue depth 1 the synchronous calls are used unless `async` (submit, for comparison).
run_result measure(store::client& c, bool write, const std::string& path, std::byte* base, std::uint64_t size, int qd,
                   std::uint64_t reqs, std::uint64_t file_bytes, std::chrono::nanoseconds timeout, bool async = false) {
  std::vector<double> lat, in_start;
  lat.reserve(reqs);
  in_start.reserve(reqs);
  bool timing = false;
  clk::duration waited{};
  // Submitted requests, oldest first; their completions (on the client's threads) mark them done.
  struct slot {
    clk::time_point t0;
    std::uint64_t bytes = 0;
    std::optional<error> err;
    bool done = false;
  };
  struct ends {
    std::mutex mu;
    std::condition_variable cv;
  };
  auto e = std::make_shared<ends>();  // outlives this call if a request does (a deadline thrown past)
  std::deque<std::shared_ptr<slot>> q;
  const std::uint64_t span = file_bytes - size;
  // Writes go into one new version of the file (writes are atomic per file), committed at the end of
  // the timed run: a write counts once it is in place. The version starts as a copy of the file
  // (write_mode::keep, before the clock starts): the scattered writes leave no gap, which a commit
  // refuses.
  store::client::write_handle h;
  if (write) h = c.open_write(path, net::write_mode::keep, timeout);
  auto finish_one = [&](bool record) {
    auto s = q.front();
    q.pop_front();
    // Waited for as a caller of the file API waits for its batch. The request's own deadline ends it
    // (its completion says so); the bound only guards the wait.
    {
      std::unique_lock l(e->mu);
      if (!s->done) {
        const auto w0 = clk::now();
        if (!e->cv.wait_until(l, s->t0 + timeout + std::chrono::seconds(10), [&] { return s->done; }))
          fail(errc::timeout, "bench remote", path, "a request was not completed past its deadline");
        if (timing) waited += clk::now() - w0;
      }
    }
    if (s->err) throw *s->err;
    if (s->bytes != size) fail(errc::io_error, "bench remote", path, fmt::format("short transfer: {} of {} bytes", s->bytes, size));
    if (record) lat.push_back(std::chrono::duration<double, std::micro>(clk::now() - s->t0).count());
  };
  auto offset_of = [&](std::uint64_t i) { return span ? ((i * size) % span) & ~std::uint64_t{4095} : 0; };
  // Queue depth 1: one synchronous read() or write() after the other, as a caller that waits for
  // each request does (a small read is then sent and answered on the caller's thread).
  auto one = [&](std::uint64_t i, bool record) {
    auto t0 = clk::now();
    std::uint64_t n = size;
    if (write) c.write(h, offset_of(i), base, size, timeout);
    else n = c.read(path, offset_of(i), base, size, t0 + timeout);
    if (record) lat.push_back(std::chrono::duration<double, std::micro>(clk::now() - t0).count());
    if (n != size) fail(errc::io_error, "bench remote", path, fmt::format("short transfer: {} of {} bytes", n, size));
  };
  auto issue = [&](std::uint64_t i) {
    auto s = std::make_shared<slot>();
    s->t0 = clk::now();
    store::client::request r;
    r.path = path;
    r.offset = offset_of(i);
    r.mem = base + (i % static_cast<std::uint64_t>(qd)) * size;
    r.length = size;
    r.write = write ? h.id : 0;
    r.until = s->t0 + timeout;
    r.done = [s, e](std::uint64_t n, const error* err) {
      {
        std::lock_guard l(e->mu);
        s->bytes = n;
        if (err) s->err = *err;
        s->done = true;
      }
      e->cv.notify_all();
    };
    c.submit(std::move(r));
    // The time spent in submit on every 8th request only: a clock reading inside the measured
    // span costs 50-70 ns on some VMs, which the raw baseline's loop (rdtsc) does not pay.
    if (timing && (i & 7) == 0) in_start.push_back(std::chrono::duration<double, std::micro>(clk::now() - s->t0).count());
    q.push_back(std::move(s));
  };
  // Warm-up: a few rounds of the same pattern.
  std::uint64_t warm = std::min<std::uint64_t>(reqs, 2 * static_cast<std::uint64_t>(qd) + 8);
  for (std::uint64_t i = 0; i < warm; ++i) {
    if (qd == 1 && !async) {
      one(i, false);
      continue;
    }
    if (q.size() >= static_cast<std::size_t>(qd)) finish_one(false);
    issue(i);
  }
  while (!q.empty()) finish_one(false);
  timing = true;
  auto t0 = clk::now();
  for (std::uint64_t i = 0; i < reqs; ++i) {
    if (qd == 1 && !async) {
      one(i, true);
      continue;
    }
    if (q.size() >= static_cast<std::size_t>(qd)) finish_one(true);
    issue(i);
  }
  while (!q.empty()) finish_one(true);
  if (write) c.commit(h, std::nullopt, timeout);
  double secs = std::chrono::duration<double>(clk::now() - t0).count();
  std::sort(lat.begin(), lat.end());
  std::sort(in_start.begin(), in_start.end());
  run_result r;
  r.start_p50_us = in_start.empty() ? 0 : in_start[in_start.size() / 2];
  r.waited = std::chrono::duration<double>(waited).count() / secs;
  r.requests = reqs;
  r.gbps = static_cast<double>(reqs * size) / secs / 1e9;
  r.iops = static_cast<double>(reqs) / secs;
  r.p50_us = lat[lat.size() / 2];
  r.p99_us = lat[std::min(lat.size() - 1, lat.size() * 99 / 100)];
  return r;
}

// The file system's own cost of a write, the floor under ferry's write rows: QD 1 `pwrite`s of each
// block size from this process, over the existing file's cached pages (what an in-place writer
// does) and into a new unnamed file beside it, sized first as the server sizes a new version (what
// an atomic replacement must do: new pages, not the old ones).
json file_write_baseline(const std::filesystem::path& dir, const std::vector<std::uint64_t>& sizes, std::uint64_t budget,
                         std::uint64_t file_bytes) {
  json rows = json::array();
  fmt::print("file system, QD 1 pwrite from this process (the floor under the write rows):\n");
  for (auto s : sizes) {
    std::vector<std::byte> src(s);
    fill_pattern(src.data(), s, 0xF5);
    const std::uint64_t reqs = std::clamp<std::uint64_t>(budget / s, 3, 20000), span = file_bytes - s;
    auto pass = [&](int fd) {
      auto t0 = clk::now();
      for (std::uint64_t i = 0; i < reqs; ++i) {
        auto off = static_cast<off_t>(span ? ((i * s) % span) & ~std::uint64_t{4095} : 0);
        if (::pwrite(fd, src.data(), s, off) != static_cast<ssize_t>(s)) fail_errno(errno, "bench remote", dir.string(), "pwrite");
      }
      return static_cast<double>(reqs * s) / std::chrono::duration<double>(clk::now() - t0).count() / 1e9;
    };
    int fd = ::open((dir / "w.bin").c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) fail_errno(errno, "bench remote", (dir / "w.bin").string(), "open");
    double over = pass(fd);
    ::close(fd);
    fd = ::open(dir.c_str(), O_TMPFILE | O_WRONLY | O_CLOEXEC, 0644);
    if (fd < 0) fail_errno(errno, "bench remote", dir.string(), "O_TMPFILE");
    if (::ftruncate(fd, static_cast<off_t>(file_bytes)) != 0) fail_errno(errno, "bench remote", dir.string(), "ftruncate");
    double fresh = pass(fd);
    ::close(fd);
    fmt::print("  {:>10}: over the existing file {:.2f} GB/s, into a new file {:.2f} GB/s ({:.2f}x)\n", format_size(s), over, fresh,
               fresh / over);
    rows.push_back({{"block", s}, {"over_existing_gbps", over}, {"new_file_gbps", fresh}});
  }
  return rows;
}

}  // namespace

int run_bench_remote(runtime& rt, const bench_remote_options& o) {
  auto sizes = parse_list(o.sizes, "--sizes");
  auto qds = parse_list(o.qds, "--qd");
  std::uint64_t file_bytes = parse_size(o.file_size, "--file-size");
  std::uint64_t budget = parse_size(o.budget, "--budget");
  std::uint64_t region = 0;
  for (auto s : sizes)
    for (auto q : qds) region = std::max(region, s * q <= (1ull << 30) ? s * q : 0);
  expects(!sizes.empty() && !qds.empty() && region > 0, "bench remote", "--sizes/--qd", "need sizes and queue depths");
  expects(file_bytes >= sizes.back() * 2, "bench remote", "--file-size", "must hold at least two of the largest block");

  // Device: a GPU when there is one (or --device), else none (host only; sim is not a speed figure).
  std::string dev_id = o.device;
  if (dev_id.empty()) {
    for (auto* d : rt.devices().all())
      if (d->id().starts_with("cuda")) {
        dev_id = d->id();
        break;
      }
  }
  std::vector<std::pair<std::string, std::string>> dsts = {{"host", "host"}};
  if (!dev_id.empty()) dsts.push_back({"gpu", dev_id});
  else fmt::print("no GPU: measuring host memory only (give --device sim:0 to exercise staging, not for speed)\n");

  // The served file: a pattern (verifiable), written once, read once to warm the page cache.
  scratch_dir scratch(o.dir, "ferry-bench-remote", "bench remote");
  const std::filesystem::path& dir = scratch.path();
  const std::uint64_t seed = 0xBE7C4, wseed = 0x5EED2;
  {
    std::vector<std::byte> buf(file_bytes);
    fill_pattern(buf.data(), buf.size(), seed);
    std::ofstream f(dir / "data.bin", std::ios::binary);
    f.write(reinterpret_cast<const char*>(buf.data()), static_cast<std::streamsize>(buf.size()));
    std::ofstream g(dir / "w.bin", std::ios::binary);
    g.write(reinterpret_cast<const char*>(buf.data()), static_cast<std::streamsize>(buf.size()));
  }
  std::string exe = std::filesystem::read_symlink("/proc/self/exe").string();
  fmt::print("{}\n", changed_settings(rt.config()));

  json out;
  out["date_unix"] = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  out["file_bytes"] = file_bytes;
  out["device"] = dev_id;
  json summary = json::array();
  bool all_verified = true;

  std::vector<std::string> transports;
  {
    std::stringstream in(o.transports);
    for (std::string t; std::getline(in, t, ',');) transports.push_back(t);
  }
  const auto do_op = parse_choices(o.ops, {"read", "write"}, "operation");
  const auto do_mem = parse_choices(o.memory, {"host", "lent", "gpu"}, "memory");
  if (do_op.count("write")) out["file_write_baseline"] = file_write_baseline(dir, sizes, budget, file_bytes);
  for (auto& tl : transports) {
    // perftest: the pure transport; ferry also needs tcp for its connection manager (client/server
    // setup through a listener), after which UCX puts the lanes on the fastest transport.
    std::map<std::string, std::string> penv, fenv;
    if (tl == "tcp") {
      penv = fenv = {{"UCX_TLS", "tcp"}, {"UCX_NET_DEVICES", "lo"}};
    } else if (tl == "shm") {
      penv = {{"UCX_TLS", "sm"}};
      fenv = {{"UCX_TLS", "sm,tcp"}, {"UCX_NET_DEVICES", "lo"}, {"UCX_MM_ERROR_HANDLING", "y"}};
    } else {
      fail(errc::invalid_argument, "bench remote", tl, "unknown transport (tcp, shm)");
    }
    json jt;
    fmt::print("\n=== transport {} (perftest: {}; ferry: {}) ===\n", tl, penv.at("UCX_TLS"), fenv.at("UCX_TLS"));

    // 1. Raw UCX baseline.
    std::map<std::uint64_t, double> best;
    std::map<std::uint64_t, std::string> best_name;
    json jb = json::array();
    bool have_perftest = std::system(fmt::format("command -v {} >/dev/null 2>&1", o.perftest).c_str()) == 0;
    double rtt8 = 0, rtt4k = 0;
    if (!have_perftest) {
      fmt::print("baseline: {} not found — no raw baseline, ratios omitted\n", o.perftest);
    } else {
      fmt::print("{:>10} {:>10} {:>10} {:>10} {:>10} {:>10}  (raw UCX, GB/s, 16 outstanding)\n", "block", "am", "put", "get", "tag", "best");
      for (auto s : sizes) {
        std::uint64_t iters = std::clamp<std::uint64_t>(budget / s, 20, 100000);
        json row{{"block", s}};
        fmt::print("{:>10}", format_size(s));
        for (auto [name, test] : {std::pair{"am", "ucp_am_bw"}, {"put", "ucp_put_bw"}, {"get", "ucp_get"}, {"tag", "tag_bw"}}) {
          auto r = perftest(o.perftest, penv, test, s, iters, true);
          row[name] = r.ok ? json(r.gbps) : json(r.error);
          fmt::print(" {:>10}", r.ok ? fmt::format("{:.2f}", r.gbps) : "fail");
          if (r.ok && r.gbps > best[s]) {
            best[s] = r.gbps;
            best_name[s] = name;
          }
        }
        row["best"] = best[s];
        row["best_primitive"] = best_name[s];
        fmt::print(" {:>10}\n", fmt::format("{:.2f} {}", best[s], best_name[s]));
        jb.push_back(row);
      }
      auto l8 = perftest(o.perftest, penv, "ucp_am_lat", 8, 20000, false);
      rtt8 = l8.ok ? 2 * l8.p50_us : 0;
      // The 4 KiB round trip (the latency target's baseline) three times, each in fresh processes:
      // from run to run it moves by up to 1.8x on a shared VM (where the scheduler puts the two
      // processes), more than any single change measured against it. The median of the three is
      // the baseline; all three are printed.
      std::vector<double> runs;
      for (int i = 0; i < 3; ++i) {
        auto l4 = perftest(o.perftest, penv, "ucp_am_lat", 4096, 20000, false);
        if (l4.ok) runs.push_back(2 * l4.p50_us);
      }
      auto sorted = runs;
      std::sort(sorted.begin(), sorted.end());
      rtt4k = sorted.empty() ? 0 : sorted[sorted.size() / 2];
      std::string each;
      for (double r : runs) each += fmt::format("{}{:.2f}", each.empty() ? "" : ", ", r);
      fmt::print("raw AM round trip (p50, 2x perftest's one-way latency): 8 B {:.2f} us, 4 KiB {:.2f} us (median of {}: {})\n", rtt8,
                 rtt4k, runs.size(), each);
      jt["am_rtt_us"] = {{"8B", rtt8}, {"4KiB", rtt4k}, {"4KiB_runs", runs}};
      if (fenv.at("UCX_TLS") != penv.at("UCX_TLS")) {
        // For reference: the same AM round trip with ferry's UCX transport list (tcp in the context
        // is polled on every progress call even when the lanes are shared memory).
        auto lf = perftest(o.perftest, fenv, "ucp_am_lat", 4096, 20000, false);
        double r = lf.ok ? 2 * lf.p50_us : 0;
        fmt::print("raw AM round trip with UCX_TLS={} (reference, not the target): 4 KiB {:.2f} us\n", fenv.at("UCX_TLS"), r);
        jt["am_rtt_us_ferry_tls"] = {{"4KiB", r}};
      }
    }
    jt["baseline"] = jb;

    // 2. ferry serve (this program's hidden `serve`, the same code as `ferry serve`, in a child
    // process) + this process as the client.
    for (auto& [k, v] : fenv) ::setenv(k.c_str(), v.c_str(), 1);
    child server({exe, "serve", "--root", dir.string(), "--listen", "127.0.0.1:0", "--writable", "--insecure"}, fenv);
    std::string line = server.read_line_with("127.0.0.1:", clk::now() + std::chrono::seconds(20));
    auto at = line.rfind("127.0.0.1:");
    if (at == std::string::npos) fail(errc::internal, "bench remote", "ferry serve", "did not start: " + line);
    auto port = static_cast<std::uint16_t>(std::stoi(line.substr(at + 10)));
    store::client c("127.0.0.1", port, store::client_options_from(rt.config(), &rt.registrations(), &rt.engine()));
    auto cst = c.stats();
    fmt::print("ferry: server pid {} port {}, {} connections, UCX lanes [{}], data: {}, GPU memory {}\n", server.pid, port,
               cst.lanes, cst.transports, cst.data_path,
               cst.gpu_direct ? "registered by UCX directly" : "staged through pinned host memory");
    jt["ferry_lanes"] = cst.transports;
    jt["ferry_connections"] = cst.lanes;
    jt["data_path"] = cst.data_path;
    jt["gpu_direct"] = cst.gpu_direct;
    json jf = json::array();
    fmt::print("{:>5} {:>6} {:>10} {:>4} {:>9} {:>10} {:>9} {:>9} {:>8}\n", "mem", "op", "block", "qd", "GB/s", "IOPS", "p50 us",
               "p99 us", "vs best");
    std::map<std::string, double> best_ratio_1m;  // per mem/op: min over sizes >= 1 MiB of (best over qd) / baseline
    // Per memory: 4 KiB QD1 read() p50; submit and its completion at QD1 p50, of which in submit.
    std::map<std::string, std::tuple<std::vector<double>, double, double>> lat4k;
    // Host memory the client allocated (client::allocate): where the server maps it (shared memory)
    // requests on it move no data message and make no copy in the client -- measured beside the
    // caller's own host memory, which always takes a copy.
    auto mems = dsts;
    if (cst.data_path.find("mapped") != std::string::npos) mems.insert(mems.begin() + 1, {"lent", "lent"});
    else if (do_mem.count("lent")) fmt::print("lent (client-allocated) memory: not measured, the server cannot map it over {}\n", tl);
    std::erase_if(mems, [&](const auto& m) { return !do_mem.count(m.first); });
    for (auto& [mem, spec] : mems) {
      lent_or_endpoint buf(rt, c, spec, region);
      auto before = c.stats();
      for (bool write : {false, true}) {
        std::string op = write ? "write" : "read";
        if (!do_op.count(op)) continue;
        std::map<std::uint64_t, double> best_ferry;
        for (auto s : sizes)
          for (auto q : qds) {
            if (s * q > region) continue;
            std::uint64_t reqs = std::clamp<std::uint64_t>(budget / s, 3 * q, 20000);
            auto r = measure(c, write, write ? "w.bin" : "data.bin", buf.data(), s, static_cast<int>(q), reqs, file_bytes,
                             rt.config().deadline);
            double ratio = best.count(s) && best[s] > 0 ? r.gbps / best[s] : 0;
            best_ferry[s] = std::max(best_ferry[s], r.gbps);
            if (!write && mem != "gpu" && s == 4096 && q == 1) {
              // The latency target's number, like its baseline, is the median of three runs (the
              // row above and two more): a single run moves with where the scheduler puts the threads.
              std::vector<double> runs{r.p50_us};
              for (int i = 0; i < 2; ++i)
                runs.push_back(measure(c, write, "data.bin", buf.data(), s, 1, reqs, file_bytes, rt.config().deadline).p50_us);
              auto a = measure(c, write, "data.bin", buf.data(), s, 1, reqs, file_bytes, rt.config().deadline, true);
              lat4k[mem] = {runs, a.p50_us, a.start_p50_us};
            }
            fmt::print("{:>5} {:>6} {:>10} {:>4} {:>9.2f} {:>10.0f} {:>9.1f} {:>9.1f} {:>8}\n", mem, op, format_size(s), q, r.gbps,
                       r.iops, r.p50_us, r.p99_us, ratio > 0 ? fmt::format("{:.3f}", ratio) : "-");
            // Where a submitting caller's time goes: in submit, and waiting for the oldest request.
            if (q > 1)
              fmt::print("{:>5} {:>6} {:>10} {:>4}   (in submit p50 {:.2f} us; the caller waited {:.0f}% of the run)\n", "", "", "", "",
                         r.start_p50_us, 100 * r.waited);
            std::fflush(stdout);
            jf.push_back({{"mem", mem}, {"op", op}, {"block", s}, {"qd", q}, {"gbps", r.gbps}, {"iops", r.iops},
                          {"p50_us", r.p50_us}, {"p99_us", r.p99_us}, {"requests", r.requests}, {"ratio_to_best", ratio}});
          }
        double worst = 0;
        bool any = false;
        for (auto& [s, g] : best_ferry)
          if (s >= (1ull << 20) && best.count(s) && best[s] > 0) {
            double rr = g / best[s];
            worst = any ? std::min(worst, rr) : rr;
            any = true;
          }
        if (any) best_ratio_1m[mem + " " + op] = worst;
      }
      // Verify: the first min(file, region) bytes read into this memory match the file's pattern,
      // and a pattern written from it reads back intact.
      std::uint64_t v = std::min(region, file_bytes);
      c.read("data.bin", 0, buf.data(), v);
      bool ok_read = buf.checksum(v) == pattern_checksum(v, seed);
      buf.fill(v, wseed);
      c.put("w.bin", buf.data(), v);
      std::vector<std::byte> back(v);
      c.read("w.bin", 0, back.data(), v);
      bool ok_write = checksum64(back.data(), v) == pattern_checksum(v, wseed);
      all_verified = all_verified && ok_read && ok_write;
      fmt::print("  {}: read {} checksum {}, write {} checksum {}\n", mem, format_size(v), ok_read ? "verified" : "MISMATCH",
                 format_size(v), ok_write ? "verified" : "MISMATCH");
      jt["verified_" + mem] = ok_read && ok_write;
      // Pieces landed in host memory and copied on by the transfer engine (GPU memory, and host
      // memory above the inline size through the landing region): where their time went.
      auto after = c.stats();
      if (auto n = after.staged_pieces - before.staged_pieces)
        fmt::print("  {}: {} pieces staged; each took {:.1f} us from landing to copied on (mean)\n", mem, n,
                   static_cast<double>(after.copy_out_ns - before.copy_out_ns) / 1e3 / static_cast<double>(n));
    }
    auto fst = c.stats();
    fmt::print("client: {} requests in {} pieces ({} through the mapped region), {} staged, {} progress wake-ups, {} landing slots quarantined\n",
               fst.requests, fst.pieces, fst.direct_pieces, format_size(fst.staged_bytes), fst.progress_wakeups, fst.quarantined);

    for (auto& [k, r] : best_ratio_1m) {
      fmt::print("SUMMARY {} {}: worst over blocks >= 1 MiB of (best over QD) / best raw primitive = {:.3f}\n", tl, k, r);
      summary.push_back({{"transport", tl}, {"what", k + " >= 1 MiB vs best raw"}, {"ratio", r}});
    }
    for (auto& [mem, l] : lat4k) {
      auto [runs, async_p50, start] = l;
      auto sorted = runs;
      std::sort(sorted.begin(), sorted.end());
      double p50 = sorted[sorted.size() / 2];
      if (rtt4k <= 0 || p50 <= 0) continue;
      std::string into = mem == "lent" ? " into client-allocated memory" : " into host memory";
      std::string each;
      for (double x : runs) each += fmt::format("{}{:.2f}", each.empty() ? "" : ", ", x);
      fmt::print("SUMMARY {} 4 KiB read QD1{} p50 {:.2f} us (median of {}: {}) = {:.2f}x raw AM RTT 4 KiB ({:.2f} us), {:.2f}x RTT 8 B ({:.2f} us)\n",
                 tl, into, p50, runs.size(), each, p50 / rtt4k, rtt4k, rtt8 > 0 ? p50 / rtt8 : 0, rtt8);
      // The asynchronous calls at the same depth, and where their time goes: the caller's send side
      // (submit) vs the rest (network, server, reply).
      fmt::print("  (read() above; submit + its completion at QD1: p50 {:.2f} us = {:.2f}x, of which in submit {:.2f} us)\n", async_p50,
                 async_p50 / rtt4k, start);
      summary.push_back({{"transport", tl}, {"what", "4KiB read QD1" + into + " p50 / raw AM RTT 4KiB"}, {"ratio", p50 / rtt4k},
                         {"p50_us", p50}, {"p50_runs_us", runs}, {"rtt_4k_us", rtt4k}, {"rtt_8b_us", rtt8}});
    }
    jt["ferry"] = jf;
    out[tl] = jt;
    ::kill(server.pid, SIGTERM);
    server.wait(clk::now() + std::chrono::seconds(10));
    for (auto& [k, v] : fenv) ::unsetenv(k.c_str());
  }
  out["summary"] = summary;
  out["verified"] = all_verified;
  if (!o.json_out.empty()) std::ofstream(o.json_out) << out.dump(2) << "\n";
  fmt::print("\ndata {}\n", all_verified ? "verified by checksum in every memory and direction" : "MISMATCH");
  return all_verified ? 0 : 1;
}

}  // namespace ferry::cli
