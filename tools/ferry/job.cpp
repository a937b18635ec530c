// `ferry job`: the end-to-end main job. Generates a dataset, serves it with the storage service on
// loopback, reads every file through ferry:// into device memory (a GPU if present, else sim:0),
// verifies each file's checksum on the device, prints a throughput table per stage, stops the server.
#include "commands.hpp"
#include "scratch_dir.hpp"
#include "endpoint.hpp"

#include <ferry/core/checksum.hpp>
#include <ferry/core/units.hpp>
#include <ferry/store/service.hpp>

#include <fmt/format.h>
#include <stdlib.h>

#include <chrono>
#include <filesystem>

namespace ferry::cli {

int run_job(runtime& rt, const job_options& o) {
  using clk = std::chrono::steady_clock;
  auto secs = [](clk::time_point t0) { return std::chrono::duration<double>(clk::now() - t0).count(); };
  std::uint64_t size = parse_size(o.size, "--size");
  expects(size > 0 && o.files > 0, "job", "--size/--files", "must be positive");
  device& dev = o.device.empty() ? rt.devices().default_device() : rt.devices().get(o.device);
  scratch_dir scratch("", "ferry-job", "job");
  const std::filesystem::path& dir = scratch.path();
  fmt::print("ferry job: {} file(s) of {} -> ferry serve on loopback -> ferry:// -> {} ({}){}\n", o.files,
             format_size(size), dev.id(), dev.info().name,
             dev.info().backend == "sim" ? " — simulated device: timings are not performance figures" : "");

  // 1. Dataset.
  std::vector<std::byte> buf(size);
  auto t0 = clk::now();
  for (int i = 0; i < o.files; ++i) {
    fill_pattern(buf.data(), size, 1000 + static_cast<std::uint64_t>(i));
    auto f = file::open((dir / fmt::format("shard-{:04d}.bin", i)).string(), open_mode::create);
    rt.files().write(*f, 0, buf.data(), size, true);
  }
  double t_gen = secs(t0);

  // 2. Server on loopback.
  store::server_options so;
  so.root = dir.string();
  so.host = "127.0.0.1";
  store::server srv(so);
  store::client c("127.0.0.1", srv.port(), store::client_options_from(rt.config(), &rt.registrations(), &rt.engine()));
  fmt::print("  serving {} on 127.0.0.1:{} (UCX)\n", dir.string(), srv.port());

  // 3. Read each file over UCX straight into device memory (the client stages GPU/sim memory through
  // pinned buffers it lends, pipelined with the network), then verify the checksum on the device.
  endpoint dst(rt, dev.id(), size);
  double t_net = 0, t_verify = 0;
  std::uint64_t total = 0;
  int verified = 0;
  for (int i = 0; i < o.files; ++i) {
    std::string path = fmt::format("shard-{:04d}.bin", i);
    auto t1 = clk::now();
    std::uint64_t got = c.read(path, 0, dst.data(), size);
    t_net += secs(t1);
    if (got != size) fail(errc::io_error, "job", path, fmt::format("short read: {} of {} bytes", got, size));
    auto t2 = clk::now();
    bool ok = dst.checksum(size) == pattern_checksum(size, 1000 + static_cast<std::uint64_t>(i));
    t_verify += secs(t2);
    verified += ok;
    if (!ok) fail(errc::internal, "job", path, "checksum mismatch on the device");
    total += size;
  }
  auto st = srv.stats();
  auto cs = c.stats();
  fmt::print("  {:<40} {:>10} {:>9} {:>12}\n", "stage", "bytes", "seconds", "throughput");
  auto row = [&](const std::string& what, std::uint64_t b, double s) {
    fmt::print("  {:<40} {:>10} {:>9.3f} {:>12}\n", what, format_size(b), s, format_rate(static_cast<double>(b) / s));
  };
  row("generate + write files (io_uring)", total, t_gen);
  row(fmt::format("ferry:// -> {} (UCX {})", dev.id(), cs.transports), total, t_net);
  row(fmt::format("checksum on {}", dev.id()), total, t_verify);
  fmt::print("  {} of {} files verified on {} by checksum; {} staged through pinned host memory{}; server: {} requests, "
             "{} sent, {} errors\n",
             verified, o.files, dev.id(), format_size(cs.staged_bytes), cs.gpu_direct ? " (UCX registers CUDA memory)" : "",
             st.requests, format_size(st.bytes_sent), st.errors);
  return verified == o.files ? 0 : 1;
}

}  // namespace ferry::cli
