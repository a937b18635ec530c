// `ferry cp SRC DST --size N`: copy between local endpoints through the transfer engine, with a
// progress bar on long copies, verified by checksums computed where the data lies.
#include "commands.hpp"
#include "endpoint.hpp"

#include <ferry/core/checksum.hpp>
#include <ferry/core/units.hpp>

#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <thread>

namespace ferry::cli {

int run_cp(runtime& rt, const cp_options& o) {
  std::uint64_t bytes = parse_size(o.size, "--size");
  expects(bytes > 0, "cp", "--size", "must be positive");
  device* sd = endpoint::device_of(rt, o.src);
  device* dd = endpoint::device_of(rt, o.dst);
  // Each side is made reachable by the other's copy engine where the pair has peer access.
  bool peers = sd && dd && sd != dd && rt.devices().peer(*sd, *dd).access;
  device* to_dst[] = {peers ? dd : nullptr};
  device* to_src[] = {peers ? sd : nullptr};
  endpoint src(rt, o.src, bytes, to_dst);
  endpoint dst(rt, o.dst, bytes, to_src);
  const std::uint64_t seed = 0xF0E1;
  src.fill(bytes, seed);

  transfer_request r{dst.data(), src.data(), bytes};
  auto t0 = std::chrono::steady_clock::now();
  transfer_batch b = rt.engine().submit({&r, 1});
  bool show = o.progress || (::isatty(STDERR_FILENO) && bytes >= (256ull << 20));
  while (!b.poll()) {
    if (show) {
      double done = static_cast<double>(b.bytes_done()), total = static_cast<double>(b.bytes_total());
      double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      int bar = static_cast<int>(30 * done / total);
      fmt::print(stderr, "\r[{:<30}] {:3.0f}% {} / {} {}   ", std::string(static_cast<std::size_t>(bar), '#'),
                 100 * done / total, format_size(static_cast<std::uint64_t>(done)), format_size(bytes),
                 secs > 0 ? format_rate(done / secs) : "");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(show ? 100 : 1));
  }
  b.wait();
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (show) fmt::print(stderr, "\r{:80}\r", "");
  b.check();
  auto res = b.results()[0];
  std::uint64_t got = dst.checksum(bytes), want = pattern_checksum(bytes, seed);
  fmt::print("{} -> {}: {} in {:.3f} s ({}), path {}, checksum {}\n", o.src, o.dst, format_size(bytes), secs,
             format_rate(static_cast<double>(bytes) / secs), to_string(res.path), got == want ? "verified" : "MISMATCH");
  if (got != want) fail(errc::internal, "cp", o.src + " -> " + o.dst, "destination checksum does not match the source");
  return 0;
}

}  // namespace ferry::cli
