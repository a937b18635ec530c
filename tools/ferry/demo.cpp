// `ferry demo`: a short, verifiable tour of the device interface — reserve a VA range, map
// physical chunks, move random data host -> device -> host, verify with on-device checksums, and
// show that bad input gets a clear error. On the sim device the timings are not performance figures.
#include "commands.hpp"

#include <ferry/core/checksum.hpp>
#include <ferry/core/units.hpp>

#include <fmt/format.h>

#include <chrono>
#include <random>
#include <vector>

namespace ferry::cli {

int run_demo(runtime& rt, const demo_options& o) {
  device& d = o.device.empty() ? rt.devices().default_device() : rt.devices().get(o.device);
  const device_info& in = d.info();
  std::uint64_t g = d.granularity();
  std::uint64_t want = parse_size(o.size, "--size");
  std::uint64_t bytes = (want + g - 1) / g * g;
  if (bytes == 0) fail(errc::invalid_argument, "demo", "--size", "must be positive");
  bool sim = in.backend == device_kind::sim;

  fmt::print("device {}: {} ({} total, chunk granularity {}){}\n", d.id(), in.name, format_size(in.total_memory),
             format_size(g), sim ? " — simulated: timings below are not performance figures" : "");

  // 1. Address space and physical memory.
  va_range va = d.reserve(bytes);
  std::vector<physical_chunk> chunks;
  for (std::uint64_t off = 0; off < bytes; off += g) {
    chunks.push_back(d.allocate(g));
    d.map(va.at(off), chunks.back());
  }
  access_desc rw{location::on_device(), access::read_write};
  d.set_access(va.base(), bytes, {&rw, 1});
  fmt::print("  reserved {} at {:#x} and mapped {} chunk(s) of {}\n", format_size(bytes), va.address(), chunks.size(),
             format_size(g));

  // 2. Random data host -> device, checksummed on the device.
  std::vector<std::uint64_t> host(bytes / 8);
  std::mt19937_64 rng(std::random_device{}());
  for (auto& w : host) w = rng();
  std::uint64_t expect = checksum64(host.data(), bytes);
  auto s = d.create_stream();
  auto t0 = std::chrono::steady_clock::now();
  s->copy(va.base(), host.data(), bytes);
  s->synchronize();
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::uint64_t got = 0;
  s->checksum(va.base(), bytes, &got);
  s->synchronize();
  fmt::print("  host -> {}: {} in {:.2f} ms ({}); device checksum {:016x} {} host {:016x}\n", d.id(), format_size(bytes),
             secs * 1e3, format_rate(static_cast<double>(bytes) / secs), got, got == expect ? "==" : "!=", expect);
  if (got != expect) fail(errc::internal, "demo", d.id(), "checksum mismatch after host -> device copy");

  // 3. A pattern written on the device, copied back and checked on the host.
  s->fill_pattern(va.base(), bytes, 42);
  std::vector<std::uint64_t> back(bytes / 8);
  s->copy(back.data(), va.base(), bytes);
  s->synchronize();
  bool ok = checksum64(back.data(), bytes) == pattern_checksum(bytes, 42);
  fmt::print("  device pattern -> host: {}\n", ok ? "verified" : "MISMATCH");
  if (!ok) fail(errc::internal, "demo", d.id(), "pattern mismatch after device -> host copy");

  // 4. Bad input gets a clear error, and nothing breaks.
  fmt::print("  errors are reported, not crashes:\n");
  va_range unmapped = d.reserve(g);
  try {
    s->copy(unmapped.base(), host.data(), 4096);
    s->synchronize();
  } catch (const error& e) {
    fmt::print("    copy into an unmapped address -> {}\n", e.what());
  }
  if (sim) {
    std::vector<physical_chunk> hog;
    try {
      for (;;) hog.push_back(d.allocate(g));
    } catch (const error& e) {
      fmt::print("    allocating past capacity after {} more chunks -> {}\n", hog.size(), e.what());
    }
  }
  try {
    d.allocate(g + 1);
  } catch (const error& e) {
    fmt::print("    allocation of a size that is not a multiple of the granularity -> {}\n", e.what());
  }

  fmt::print("  counters:");
  for (auto& [k, v] : d.counters().snapshot()) fmt::print(" {}={}", k, v);
  fmt::print("\n");
  s.reset();
  d.unmap(va.base(), bytes);
  return 0;
}

}  // namespace ferry::cli
