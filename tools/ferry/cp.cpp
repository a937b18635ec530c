// `ferry cp SRC DST`: copy between any two endpoints -- memory (host, pinned, gpu:N, sim:N), local
// files (file:PATH) and remote files (ferry://host:port/path, http:// and https:// to read) -- through
// the transfer and file engines (remote files through the file API), with a progress bar on long copies, verified by checksums
// (computed where the data lies for memory, by reading the data back for files and ferry://).
#include "commands.hpp"
#include "endpoint.hpp"

#include <ferry/core/checksum.hpp>
#include <ferry/core/units.hpp>
#include <ferry/store/server.hpp>

#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include <chrono>
#include <thread>

namespace ferry::cli {

namespace {
// A copy whose source ended short of what it held when the copy began: the file shrank under it.
[[noreturn]] void source_shrank(const std::string& src, std::uint64_t at, std::uint64_t held) {
  fail(errc::io_error, "cp", fmt::format("{} offset {}", src, at),
       fmt::format("the file ended at {} of the {} bytes it held when the copy began (it shrank during the copy)", at, held));
}

bool is_file(const std::string& s) { return s.starts_with("file:"); }
// A URI the file API opens (ferry://, http://, https://): `file:` marks a local path.
bool is_remote(const std::string& s) { return !s.starts_with("file:") && s.find("://") != std::string::npos; }
bool is_memory(const std::string& s) { return !is_file(s) && !is_remote(s); }

// Streams a file through host memory to checksum it.
std::uint64_t file_checksum(runtime& rt, file& f, std::uint64_t bytes) {
  std::vector<std::byte> buf(64ull << 20);
  checksum64_stream cs;
  for (std::uint64_t off = 0; off < bytes; off += buf.size()) {
    std::uint64_t n = std::min<std::uint64_t>(buf.size(), bytes - off);
    std::uint64_t got = rt.files().read(f, off, buf.data(), n);
    cs.update(buf.data(), got);
    if (got < n) break;
  }
  return cs.value();
}

// Shows progress of a batch until it finishes; returns seconds taken.
double follow(transfer_batch& b, bool show, std::chrono::steady_clock::time_point t0) {
  while (!b.poll()) {
    if (show) {
      double done = static_cast<double>(b.bytes_done()), total = static_cast<double>(b.bytes_total());
      double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      int bar = static_cast<int>(30 * done / total);
      fmt::print(stderr, "\r[{:<30}] {:3.0f}% {} / {} {}   ", std::string(static_cast<std::size_t>(bar), '#'),
                 100 * done / total, format_size(static_cast<std::uint64_t>(done)),
                 format_size(static_cast<std::uint64_t>(total)), secs > 0 ? format_rate(done / secs) : "");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(show ? 100 : 1));
  }
  b.wait();
  if (show) fmt::print(stderr, "\r{:80}\r", "");
  b.check();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// How the file engine moved a file's data, for the summary line.
std::string engine_path(const file& f, const transfer_batch& b) {
  if (f.source() || f.lent()) return fmt::format("file engine ({})", f.describe());
  return b.results()[0].path == transfer_path::direct ? "file engine (cuFile)" : "file engine (io_uring)";
}

}  // namespace

// ferry://host:port/path -> a memory endpoint, through the file API as every other user of ferry://
// reads it: one file engine request, which the file's source (the shared store client) splits into
// pieces served in parallel; GPU and sim memory are staged through pinned buffers it lends (unless
// UCX registers CUDA memory itself). Verified by reading the range again into host memory.
int cp_from_remote(runtime& rt, const cp_options& o) {
  auto f = file::open(o.src, open_mode::read);
  std::uint64_t size = f->size();
  std::uint64_t bytes = o.size.empty() ? size : std::min<std::uint64_t>(parse_size(o.size, "--size"), size);
  expects(bytes > 0, "cp", o.src, "nothing to copy (empty file)");
  endpoint dst(rt, o.dst, bytes);
  auto t0 = std::chrono::steady_clock::now();
  std::uint64_t moved = rt.files().read(*f, 0, dst.data(), bytes);
  if (moved < bytes) source_shrank(o.src, moved, bytes);  // never a copy of less reported as success
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  bool ok = !o.verify || dst.checksum(moved) == file_checksum(rt, *f, moved);
  fmt::print("{} -> {}: {} in {:.3f} s ({}), path {} -> {}, checksum {}\n", o.src, o.dst, format_size(moved), secs,
             format_rate(static_cast<double>(moved) / secs), f->describe(), o.dst,
             !o.verify ? "not checked" : ok ? "verified" : "MISMATCH");
  if (!ok) fail(errc::internal, "cp", o.src + " -> " + o.dst, "destination checksum does not match what the server holds");
  return 0;
}

// Any source -> ferry://host:port/path on a writable server (or an http://, https:// or s3:// URL,
// put whole), through the file API as Python writes them: one file engine write request of the
// whole range, which the file's source splits into pieces (ferry://) or sends as one PUT; syncing the
// file replaces the server's file as a whole, and a failed write leaves it as it was. A memory source is filled with a pattern; a file or ferry://
// source is first read whole into the --via endpoint (host by default), so the data must fit there.
// Verified by the file's size and by reading the written range back.
int cp_to_remote(runtime& rt, const cp_options& o) {
  // Before reading anything, a read-only ferry:// server is refused: opening for read_write asks the
  // server (and names a directory) without opening a write.
  if (o.dst.starts_with("ferry://")) file::open(o.dst, open_mode::read_write);
  std::shared_ptr<file> fin;
  if (is_file(o.src)) fin = file::open(o.src.substr(5), open_mode::read);
  else if (is_remote(o.src)) fin = file::open(o.src, open_mode::read);
  const std::uint64_t size = fin ? fin->size() : 0;
  std::uint64_t bytes = o.size.empty() ? (fin ? size : 64ull << 20) : parse_size(o.size, "--size");
  if (fin) bytes = std::min(bytes, size);
  expects(bytes > 0, "cp", o.src, fin ? "nothing to copy (empty file)" : "nothing to copy");
  std::string via = o.via.empty() ? "host" : o.via;
  endpoint src(rt, fin ? via : o.src, bytes);
  auto t0 = std::chrono::steady_clock::now();
  if (fin) {
    std::uint64_t want = bytes;
    bytes = rt.files().read(*fin, 0, src.data(), bytes);
    if (bytes < want) source_shrank(o.src, bytes, want);
  } else {
    src.fill(bytes, 0xF0E1);
  }
  std::string route;
  {
    auto fout = file::open(o.dst, open_mode::create);
    rt.files().write(*fout, 0, src.data(), bytes, true);
    route = fout->describe();
  }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::string why;
  if (o.verify) {
    auto back = file::open(o.dst, open_mode::read);
    std::uint64_t held = back->size();
    if (held != bytes) why = fmt::format("the server's file holds {} bytes, not the {} written", held, bytes);
    else if (src.checksum(bytes) != file_checksum(rt, *back, bytes)) why = "what the server holds does not match the source";
  }
  std::string from = !fin ? o.src : fin->source() || fin->lent() ? fin->describe() + " -> " + via : "file -> " + via;
  fmt::print("{} -> {}: {} in {:.3f} s ({}), path {} -> {}, checksum {}\n", o.src, o.dst, format_size(bytes), secs,
             format_rate(static_cast<double>(bytes) / secs), from, route,
             !o.verify ? "not checked" : why.empty() ? "verified" : "MISMATCH");
  if (!why.empty()) fail(errc::internal, "cp", o.src + " -> " + o.dst, why);
  return 0;
}

int run_cp(runtime& rt, const cp_options& o) {
  if (o.src == o.dst) fail(errc::invalid_argument, "cp", o.src, "source and destination are the same");
  if (!o.via.empty() && (is_memory(o.src) || is_memory(o.dst)))
    fail(errc::invalid_argument, "cp", "--via " + o.via,
         "only for copies between files and ferry:// (a memory endpoint already holds the data)");
  if (is_remote(o.dst)) return cp_to_remote(rt, o);
  if (is_remote(o.src) && is_memory(o.dst)) return cp_from_remote(rt, o);
  // ferry:// -> file: the remote file is a file of the file engine (ferry:// scheme), copied like
  // file -> file below.
  std::shared_ptr<file> fin, fout;
  if (is_file(o.src)) fin = file::open(o.src.substr(5), open_mode::read);
  if (is_remote(o.src)) fin = file::open(o.src, open_mode::read);
  std::uint64_t bytes = o.size.empty() ? (fin ? fin->size() : 64ull << 20) : parse_size(o.size, "--size");
  if (fin && o.size.empty() && bytes == 0) fail(errc::invalid_argument, "cp", o.src, "the file is empty");
  expects(bytes > 0, "cp", "--size", "must be positive");
  // A destination file this copy creates is removed again if the copy fails (a file that was there
  // before has been truncated by then: it is not put back).
  struct remove_unless_done {
    std::string path;
    bool armed = false;
    ~remove_unless_done() {
      if (armed) ::unlink(path.c_str());
    }
  } created;
  if (is_file(o.dst)) {
    created.path = o.dst.substr(5);
    struct ::stat st{};
    created.armed = ::stat(created.path.c_str(), &st) != 0 && errno == ENOENT;
    fout = file::open(created.path, open_mode::create);
  }
  bool show_default = ::isatty(STDERR_FILENO) && bytes >= (256ull << 20);
  bool show = o.progress || show_default;
  const std::uint64_t seed = 0xF0E1;
  std::string path_used;
  double secs = 0;
  std::uint64_t got_sum = 0, want_sum = 0, moved = bytes;

  if (fin && fout) {
    // file or ferry:// -> file through host memory or a device (--via), 256 MiB at a time.
    std::string via = o.via.empty() ? "host" : o.via;
    std::uint64_t piece = std::min<std::uint64_t>(bytes, 256ull << 20);
    endpoint mid(rt, via, piece);
    auto t0 = std::chrono::steady_clock::now();
    moved = 0;
    for (std::uint64_t off = 0; off < bytes; off += piece) {
      std::uint64_t n = std::min(piece, bytes - off);
      std::uint64_t got = rt.files().read(*fin, off, mid.data(), n);
      if (got < n && o.size.empty()) source_shrank(o.src, off + got, bytes);
      if (got) rt.files().write(*fout, off, mid.data(), got);
      moved += got;
      if (got < n) break;
    }
    fout->sync();
    secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    path_used = fmt::format("{} -> {} -> file", fin->describe(), via);
    if (o.verify) {
      want_sum = file_checksum(rt, *fin, moved);
      got_sum = file_checksum(rt, *fout, moved);
    }
  } else if (fin) {
    device* dd = endpoint::device_of(rt, o.dst);
    (void)dd;
    endpoint dst(rt, o.dst, bytes);
    file_request r{fin, 0, dst.data(), bytes, false};
    auto t0 = std::chrono::steady_clock::now();
    transfer_batch b = rt.files().submit({&r, 1});
    secs = follow(b, show, t0);
    moved = b.results()[0].bytes_done;
    if (moved < bytes && o.size.empty()) source_shrank(o.src, moved, bytes);
    path_used = engine_path(*fin, b);
    if (o.verify) {
      got_sum = dst.checksum(moved);
      want_sum = file_checksum(rt, *fin, moved);
    }
  } else if (fout) {
    endpoint src(rt, o.src, bytes);
    src.fill(bytes, seed);
    file_request r{fout, 0, src.data(), bytes, true};
    auto t0 = std::chrono::steady_clock::now();
    transfer_batch b = rt.files().submit({&r, 1});
    secs = follow(b, show, t0);
    fout->sync();
    secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    path_used = engine_path(*fout, b);
    if (o.verify) {
      want_sum = pattern_checksum(bytes, seed);
      got_sum = file_checksum(rt, *fout, bytes);
    }
  } else {
    device* sd = endpoint::device_of(rt, o.src);
    device* dd = endpoint::device_of(rt, o.dst);
    // Each side is made reachable by the other's copy engine where the pair has peer access.
    bool peers = sd && dd && sd != dd && rt.devices().peer(*sd, *dd).access;
    device* to_dst[] = {peers ? dd : nullptr};
    device* to_src[] = {peers ? sd : nullptr};
    endpoint src(rt, o.src, bytes, to_dst);
    endpoint dst(rt, o.dst, bytes, to_src);
    src.fill(bytes, seed);
    transfer_request r{dst.data(), src.data(), bytes};
    auto t0 = std::chrono::steady_clock::now();
    transfer_batch b = rt.engine().submit({&r, 1});
    secs = follow(b, show, t0);
    path_used = std::string(to_string(b.results()[0].path));
    if (o.verify) {
      got_sum = dst.checksum(bytes);
      want_sum = pattern_checksum(bytes, seed);
    }
  }
  bool ok = !o.verify || got_sum == want_sum;
  fmt::print("{} -> {}: {} in {:.3f} s ({}), path {}, checksum {}\n", o.src, o.dst, format_size(moved), secs,
             format_rate(static_cast<double>(moved) / secs), path_used,
             !o.verify ? "not checked" : ok ? "verified" : "MISMATCH");
  if (!ok) fail(errc::internal, "cp", o.src + " -> " + o.dst, "destination checksum does not match the source");
  created.armed = false;
  return 0;
}

}  // namespace ferry::cli
