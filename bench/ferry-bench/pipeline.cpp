// `ferry-bench pipeline --path DIR`: "read chunk i of a file, then run the user's kernel on chunk
// i", over a page-cached file, written the ways a user can write it:
//   stream-ordered  read_async of chunk i on the user's stream, the kernel right after it on the same
//                   stream, no CPU wait until the end; on one stream, and on two (chunk i on stream i % 2,
//                   the usual way to let one chunk's copy overlap the previous chunk's kernel)
//   (a) serialized  blocking read of chunk i, kernel, synchronize the stream
//   (b) KvikIO-style synchronize the stream, blocking read of chunk i, kernel (what a stream API does
//                   that synchronizes and reads: KvikIO's without GDS)
// next to the ideal, max(total read time, total kernel time): the reads alone (the stream-ordered
// reads of every chunk with nothing else on the streams) and the kernels alone. The kernel is the
// user's (pipeline_kernels.cu, launched here on the benchmark's own streams, with the user's own
// context -- the primary one): it checks every word it is given against the file's (a known function
// of the word's index), then computes for a set time, chosen so that all kernels together take as long
// as the reads (--kernel-ratio): the case where overlap matters most.
#include "bench.hpp"
#include "kernels.hpp"
#include "mem/cuda/driver.hpp"

#include <ferry/core/units.hpp>

#include <fcntl.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>


namespace ferry::cli {
namespace {

using json = nlohmann::ordered_json;
using clk = std::chrono::steady_clock;
constexpr unsigned seed = 0x5eed;

// The user's side (bench_user: their primary context, the kernels, a stream) with their kernel, a
// second stream of theirs and a few chunk buffers they reuse round-robin. The kernel fills the GPU
// (every SM at full occupancy), as a real one would: kernels of two streams then take turns instead
// of sharing the GPU.
struct user_side : bench_user {
  CUfunction consume = nullptr;
  CUstream s1 = nullptr;
  std::vector<CUdeviceptr> bufs;
  CUdeviceptr bad = 0;

  user_side(const cuda::driver_api& a, int ordinal, int nbufs, std::uint64_t chunk)
      : bench_user(a, ordinal, "bench pipeline"), consume(fn("bench_consume")) {
    check(api.cuStreamCreate(&s1, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    for (int i = 0; i < nbufs; ++i) {
      CUdeviceptr p = 0;
      check(api.cuMemAlloc(&p, chunk), "cuMemAlloc");
      bufs.push_back(p);
    }
    check(api.cuMemAlloc(&bad, 8), "cuMemAlloc");
  }
  ~user_side() {
    if (s1) api.cuStreamSynchronize(s1), api.cuStreamDestroy(s1);
    api.cuStreamSynchronize(s);  // the buffers go before the base class lets go of the stream
    for (auto p : bufs) api.cuMemFree(p);
    if (bad) api.cuMemFree(bad);
  }
  CUstream stream(int si) const { return si ? s1 : s; }
  void launch(int si, CUdeviceptr buf, std::uint64_t bytes, std::uint64_t first_word, std::uint64_t busy_ns) {
    CUdeviceptr src = buf;
    unsigned long long words = bytes / 4, first = first_word, busy = busy_ns;
    unsigned sd = seed;
    CUdeviceptr badp = bad;
    void* args[] = {&src, &words, &first, &sd, &busy, &badp};
    check(api.cuLaunchKernel(consume, blocks, 1, 1, 256, 1, 1, 0, stream(si), args, nullptr), "cuLaunchKernel");
  }
  void sync(int si) { check(api.cuStreamSynchronize(stream(si)), "cuStreamSynchronize"); }
  void sync_all() {
    sync(0);
    sync(1);
  }
  void reset_bad() {
    check(api.cuMemsetD8Async(bad, 0, 8, s), "cuMemsetD8Async");
    sync(0);
  }
  std::uint64_t bad_words() {
    sync_all();
    std::uint64_t v = 0;
    check(api.cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(&v), bad, 8, s), "cuMemcpyAsync");
    sync(0);
    return v;
  }
};

}  // namespace

// The file: words word_at(j, seed), written through ferry; then read once so the page cache holds it.
void write_word_file(runtime& rt, const std::string& p, std::uint64_t bytes, unsigned word_seed) {
  auto f = file::open(p, open_mode::create);
  const std::uint64_t piece = 64ull << 20;
  std::vector<unsigned> w(piece / 4);
  for (std::uint64_t off = 0; off < bytes; off += piece) {
    std::uint64_t n = std::min(piece, bytes - off);
    for (std::uint64_t i = 0; i < n / 4; ++i) w[i] = word_at(off / 4 + i, word_seed);
    rt.files().write(*f, off, w.data(), n);
  }
  read_buffered(p, bytes);
}

int run_bench_pipeline(runtime& rt, const bench_pipeline_options& o) {
  const std::uint64_t bytes = parse_size(o.size, "--size");
  const std::uint64_t chunk = parse_size(o.chunk, "--chunk");
  if (chunk == 0 || chunk % 4 || bytes % chunk)
    fail(errc::invalid_argument, "bench pipeline", "--chunk", fmt::format("{} must be a multiple of 4 bytes that divides --size {}", o.chunk, o.size));
  // Chunk i takes buffer i % buffers on stream i % 2: an even count keeps each buffer on one stream.
  if (o.buffers < 2 || o.buffers % 2 || o.rounds < 1 || o.kernel_ratio < 0)
    fail(errc::invalid_argument, "bench pipeline", "options", "--buffers even and >= 2, --rounds >= 1, --kernel-ratio >= 0");
  device& dev = o.device.empty() ? rt.devices().default_device() : rt.devices().get(o.device);
  if (dev.info().backend != device_kind::cuda)
    fail(errc::unavailable, "bench pipeline", dev.id(),
         "needs a CUDA GPU: it runs a user's kernel on each chunk (no kernels on a simulated device)");
  const cuda::driver_status& drv = cuda::load(rt.config().cuda_driver);
  if (!drv.api) fail(errc::unavailable, "bench pipeline", "CUDA driver", drv.reason);
  const std::size_t nchunks = bytes / chunk;

  std::string path = o.path;
  struct stat st{};
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) path += fmt::format("/ferry-bench-pipeline-{}.bin", bytes);
  auto say = [](const std::string& s) {
    fmt::print("{}\n", s);
    std::fflush(stdout);
  };
  say(fmt::format("ferry-bench pipeline: {} ({}) in {} chunks of {} -> {} ({}), {} buffers, {} round(s) per row", path,
                  format_size(bytes), nchunks, format_size(chunk), dev.id(), dev.info().name, o.buffers, o.rounds));
  auto t0 = clk::now();
  write_word_file(rt, path, bytes, seed);
  say(fmt::format("  wrote the file and read it once into the page cache in {:.1f} s", secs_since(t0)));
  auto f = file::open(path, open_mode::read);

  user_side u(*drv.api, dev.info().ordinal, o.buffers, chunk);
  std::unique_ptr<stream> views[2];
  for (int i = 0; i < 2; ++i) views[i] = dev.wrap_stream(native_stream{reinterpret_cast<std::uintptr_t>(u.stream(i))});
  auto buf_of = [&](std::size_t i) { return u.bufs[i % u.bufs.size()]; };
  auto ptr = [](CUdeviceptr p) { return reinterpret_cast<void*>(p); };

  // One pass over the file, `nstreams` streams; returns seconds. kernels: -1 none, else busy ns each.
  auto stream_ordered = [&](int nstreams, bool reads, std::int64_t busy_ns) {
    std::vector<transfer_batch> batches;
    batches.reserve(nchunks);
    auto t = clk::now();
    for (std::size_t i = 0; i < nchunks; ++i) {
      int si = static_cast<int>(i % static_cast<std::size_t>(nstreams));
      if (reads) batches.push_back(rt.files().read_async(f, i * chunk, ptr(buf_of(i)), chunk, *views[si]));
      if (busy_ns >= 0) u.launch(si, buf_of(i), chunk, i * chunk / 4, static_cast<std::uint64_t>(busy_ns));
    }
    u.sync_all();
    double s = secs_since(t);
    for (auto& b : batches)
      if (!b.wait()) b.check();
    return s;
  };
  auto serialized = [&](bool kvikio, std::uint64_t busy_ns) {
    auto t = clk::now();
    for (std::size_t i = 0; i < nchunks; ++i) {
      if (kvikio) u.sync(0);
      std::uint64_t got = rt.files().read(*f, i * chunk, ptr(buf_of(i)), chunk);
      if (got != chunk) fail(errc::io_error, "bench pipeline", path, fmt::format("short read at {}", i * chunk));
      u.launch(0, buf_of(i), chunk, i * chunk / 4, busy_ns);
      if (!kvikio) u.sync(0);
    }
    u.sync_all();
    return secs_since(t);
  };
  // The median of `rounds` runs; `verified` false if any run's kernels saw a wrong word.
  auto median = [&](auto&& run, bool verify, bool& verified) {
    std::vector<double> v;
    for (int r = 0; r < o.rounds; ++r) {
      u.reset_bad();
      v.push_back(run());
      if (verify && u.bad_words() != 0) verified = false;
    }
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };

  json rows = json::array();
  bool all_ok = true;
  auto row = [&](const std::string& what, double s, const std::string& note) {
    rows.push_back({{"what", what}, {"seconds", s}, {"gbps", static_cast<double>(bytes) / s / 1e9}, {"note", note}});
    say(fmt::format("  {:<58} {:>8.1f} ms {:>7.2f} GB/s  {}", what, s * 1e3, static_cast<double>(bytes) / s / 1e9, note));
  };
  bool unused = true;
  stream_ordered(2, true, 0);  // warm-up: staging, gates, the module, the page cache
  // The reads alone.
  double read1 = median([&] { return stream_ordered(1, true, -1); }, false, unused);
  row("reads alone: read_async of every chunk, 1 stream", read1, "");
  double read2 = median([&] { return stream_ordered(2, true, -1); }, false, unused);
  row("reads alone: read_async of every chunk, 2 streams", read2, "");
  double blocking = median([&] {
    auto t = clk::now();
    for (std::size_t i = 0; i < nchunks; ++i)
      if (rt.files().read(*f, i * chunk, ptr(buf_of(i)), chunk) != chunk)
        fail(errc::io_error, "bench pipeline", path, fmt::format("short read at {}", i * chunk));
    return secs_since(t);
  }, false, unused);
  row("reads alone: blocking read of every chunk", blocking, "(not in the ideal: the pipelines' reads are read_async)");
  double read_total = std::min(read1, read2);
  // The kernels alone, their computing time chosen so that they take kernel_ratio x the reads.
  double k0 = median([&] { return stream_ordered(1, false, 0); }, false, unused);
  std::uint64_t busy = 0;
  double kernel_total = k0;
  if (o.kernel_ratio > 0) {
    double want = o.kernel_ratio * read_total;
    busy = static_cast<std::uint64_t>(std::max(0.0, (want - k0) / static_cast<double>(nchunks)) * 1e9);
    for (int pass = 0; pass < 2; ++pass) {  // one kernel may take longer than its busy time: correct once
      kernel_total = median([&] { return stream_ordered(1, false, static_cast<std::int64_t>(busy)); }, false, unused);
      if (kernel_total > 0 && std::abs(kernel_total - want) > 0.02 * want)
        busy = static_cast<std::uint64_t>(static_cast<double>(busy) * std::max(0.0, want - k0) / std::max(1e-9, kernel_total - k0));
    }
  }
  double k1 = kernel_total;
  double kernel2 = median([&] { return stream_ordered(2, false, static_cast<std::int64_t>(busy)); }, false, unused);
  row(fmt::format("kernels alone ({} us of computing each), 1 stream", busy / 1000), kernel_total, "");
  row(fmt::format("kernels alone ({} us of computing each), 2 streams", busy / 1000), kernel2, "");
  kernel_total = std::min(kernel_total, kernel2);
  double ideal = std::max(read_total, kernel_total);
  row("ideal: max(reads alone, kernels alone)", ideal, "");

  json targets = json::array();
  // A pipeline's own ideal: max(its reads alone, its kernels alone), both in its arrangement of streams
  // (kernels that take turns on two streams take longer than on one); the overall ideal is the best of both.
  auto variant = [&](const std::string& what, double own_ideal, auto&& run) {
    bool ok = true;
    double s = median(run, true, ok);
    all_ok = all_ok && ok;
    row(what, s, fmt::format("{:.2f}x its own ideal, {:.2f}x the overall ideal, {}", s / own_ideal, s / ideal,
                             ok ? "every word verified by the kernels" : "KERNELS SAW WRONG WORDS"));
    return s;
  };
  double ideal1 = std::max(read1, k1), ideal2 = std::max(read2, kernel2);
  double so1 = variant("stream-ordered: read_async + kernel, 1 stream", ideal1,
                       [&] { return stream_ordered(1, true, static_cast<std::int64_t>(busy)); });
  double so2 = variant("stream-ordered: read_async + kernel, 2 streams", ideal2,
                       [&] { return stream_ordered(2, true, static_cast<std::int64_t>(busy)); });
  double ser = variant("(a) read, kernel, synchronize", ideal1, [&] { return serialized(false, busy); });
  double kv = variant("(b) synchronize, read, kernel (KvikIO-style)", ideal1, [&] { return serialized(true, busy); });

  auto target = [&](const std::string& name, double got, double want) {
    targets.push_back({{"target", name}, {"ratio", got}, {"want_at_most", want}, {"pass", got <= want}});
    say(fmt::format("target {:<70} {:.2f}x (want <= {:.2f}x): {}", name, got, want, got <= want ? "PASS" : "FAIL"));
  };
  say("");
  target("stream-ordered pipeline, 2 streams: wall / max(its reads, its kernels)", so2 / ideal2, 1.1);
  say(fmt::format("       2 streams against the overall ideal (kernels timed on one stream): {:.2f}x", so2 / ideal));
  say(fmt::format("       1 stream: {:.2f}x its own ideal (one stream runs each chunk's copies after the previous kernel: they add up)",
                  so1 / ideal1));
  say(fmt::format("       (a) serialized {:.2f}x, (b) KvikIO-style {:.2f}x the overall ideal; stream-ordered (2 streams) is {:.2f}x faster than (b)",
                  ser / ideal, kv / ideal, kv / so2));
  std::string counters;
  for (auto& [k, v] : rt.files().counters().snapshot())
    if (k.starts_with("reads.") || k.starts_with("requests")) counters += fmt::format(" {}={}", k, v);
  say("  file engine:" + counters);
  if (!all_ok) say("VERIFICATION FAILED: a kernel saw words that are not the file's");
  if (!o.json_out.empty()) {
    json out{{"file", path},   {"bytes", bytes},   {"chunk", chunk},         {"buffers", o.buffers}, {"device", dev.id()},
             {"name", dev.info().name}, {"busy_ns", busy}, {"ideal_seconds", ideal}, {"rows", rows},
             {"targets", targets},       {"all_verified", all_ok}};
    std::ofstream(o.json_out) << out.dump(2) << "\n";
  }
  f.reset();
  if (!o.keep) ::unlink(path.c_str());
  return all_ok ? 0 : 1;
}

}  // namespace ferry::cli
