#include <ferry/core/error.hpp>
#include <ferry/core/settings.hpp>
#include <ferry/core/units.hpp>

#include "core/logging.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <fstream>

extern char** environ;

namespace ferry {

std::string_view to_string(backend_choice b) noexcept {
  switch (b) {
    case backend_choice::automatic: return "auto";
    case backend_choice::cuda: return "cuda";
    case backend_choice::sim: return "sim";
  }
  return "?";
}

namespace {

// A parse failure inside a row: the caller adds the variable name and origin.
struct bad_value {
  std::string why;
};

std::int64_t parse_int(std::string_view v, std::int64_t lo, std::int64_t hi) {
  std::int64_t n = 0;
  auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (ec != std::errc() || p != v.data() + v.size()) throw bad_value{"not an integer"};
  if (n < lo || n > hi) throw bad_value{fmt::format("out of range [{}, {}]", lo, hi)};
  return n;
}

double parse_double(std::string_view v, double lo, double hi) {
  std::string s(v);
  char* end = nullptr;
  double d = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size()) throw bad_value{"not a number"};
  if (!(d >= lo && d <= hi)) throw bad_value{fmt::format("out of range [{}, {}]", lo, hi)};
  return d;
}

std::uint64_t parse_size_in(std::string_view v, std::uint64_t lo, std::uint64_t hi, bool pow2 = false) {
  std::uint64_t n;
  try {
    n = parse_size(v);
  } catch (const error& e) {
    throw bad_value{e.detail()};
  }
  if (n < lo || n > hi) throw bad_value{fmt::format("out of range [{}, {}]", format_size(lo), format_size(hi))};
  if (pow2 && (n & (n - 1)) != 0) throw bad_value{"must be a power of two"};
  return n;
}

std::chrono::nanoseconds parse_duration_value(std::string_view v) {
  try {
    return parse_duration(v);
  } catch (const error& e) {
    throw bad_value{e.detail()};
  }
}

std::chrono::nanoseconds parse_duration_in(std::string_view v, std::chrono::nanoseconds lo, std::chrono::nanoseconds hi) {
  auto d = parse_duration_value(v);
  if (d < lo || d > hi) throw bad_value{fmt::format("out of range [{}, {}]", format_duration(lo), format_duration(hi))};
  return d;
}

template <typename E, std::size_t N>
E parse_enum(std::string_view v, const std::pair<std::string_view, E> (&choices)[N]) {
  for (auto& [name, e] : choices)
    if (v == name) return e;
  std::string list;
  for (auto& [name, e] : choices) list += (list.empty() ? "" : "|") + std::string(name);
  throw bad_value{fmt::format("expected one of {}", list)};
}

constexpr std::pair<std::string_view, log_level> log_levels[] = {
    {"trace", log_level::trace}, {"debug", log_level::debug}, {"info", log_level::info},
    {"warn", log_level::warn},   {"error", log_level::error}, {"off", log_level::off}};
constexpr std::pair<std::string_view, backend_choice> backends[] = {
    {"auto", backend_choice::automatic}, {"cuda", backend_choice::cuda}, {"sim", backend_choice::sim}};
constexpr std::pair<std::string_view, pageable_policy> pageable_policies[] = {
    {"auto", pageable_policy::automatic}, {"register", pageable_policy::always_register}, {"bounce", pageable_policy::always_bounce}};
constexpr std::pair<std::string_view, file_backend_kind> file_backends[] = {
    {"auto", file_backend_kind::automatic}, {"io_uring", file_backend_kind::io_uring}, {"cufile", file_backend_kind::cufile}};
constexpr std::pair<std::string_view, direct_io> direct_ios[] = {
    {"auto", direct_io::automatic}, {"always", direct_io::always}, {"never", direct_io::never}};
constexpr std::pair<std::string_view, rma_use> rma_uses[] = {{"auto", rma_use::automatic}, {"on", rma_use::on}, {"off", rma_use::off}};
constexpr std::pair<std::string_view, page_replacement> replacements[] = {{"lru", page_replacement::lru}, {"fifo", page_replacement::fifo}};

// The name a choice is written with (the first listed for it).
template <typename E, std::size_t N>
std::string_view enum_name(E v, const std::pair<std::string_view, E> (&choices)[N]) noexcept {
  for (auto& [name, e] : choices)
    if (e == v) return name;
  return "?";
}

bool parse_bool(std::string_view v) {
  if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
  if (v == "0" || v == "false" || v == "no" || v == "off") return false;
  throw bad_value{"expected 1|0|true|false|yes|no|on|off"};
}

std::string nonempty(std::string_view v) {
  if (v.empty()) throw bad_value{"must not be empty"};
  return std::string(v);
}

std::string show_double(double d) { return fmt::format("{}", d); }

// One tunable. `apply` parses text into the snapshot (throws bad_value); `show` prints it back in
// a form `apply` accepts, so describe() output can be pasted into a config file.
struct setting_def {
  std::string_view name;
  std::string_view doc;
  void (*apply)(settings&, std::string_view);
  std::string (*show)(const settings&);
};

// clang-format off
const setting_def table[] = {
  {"FERRY_LOG", "Log level: trace|debug|info|warn|error|off. Logs go to stderr.",
   [](settings& s, std::string_view v) { s.log = parse_enum(v, log_levels); },
   [](const settings& s) { return std::string(to_string(s.log)); }},
  {"FERRY_DEADLINE", "Default deadline of every wait (stream sync, transfer, request) when the caller gives none; a transfer batch without a fixed deadline fails only when no byte has moved for this long.",
   [](settings& s, std::string_view v) {
     s.deadline = parse_duration_value(v);
     if (s.deadline <= std::chrono::nanoseconds::zero()) throw bad_value{"must be positive"};
   },
   [](const settings& s) { return format_duration(s.deadline); }},
  {"FERRY_BACKEND", "Default device: auto (first CUDA GPU if a driver and GPU are present, else sim:0) | cuda | sim.",
   [](settings& s, std::string_view v) { s.backend = parse_enum(v, backends); },
   [](const settings& s) { return std::string(to_string(s.backend)); }},
  {"FERRY_CUDA_DRIVER", "CUDA driver library loaded at run time (dlopen); ferry never links against it.",
   [](settings& s, std::string_view v) { s.cuda_driver = nonempty(v); },
   [](const settings& s) { return s.cuda_driver; }},
  {"FERRY_NVML_LIBRARY", "NVML library loaded at run time for PCIe/BAR1/NVLink facts (optional).",
   [](settings& s, std::string_view v) { s.nvml_library = nonempty(v); },
   [](const settings& s) { return s.nvml_library; }},
  {"FERRY_SIM_DEVICES", "Number of simulated devices (sim:0 .. sim:N-1), 0..64.",
   [](settings& s, std::string_view v) { s.sim_devices = static_cast<int>(parse_int(v, 0, 64)); },
   [](const settings& s) { return std::to_string(s.sim_devices); }},
  {"FERRY_SIM_CAPACITY", "Memory capacity of each simulated device (allocations beyond it fail with out_of_memory).",
   [](settings& s, std::string_view v) { s.sim_capacity = parse_size_in(v, 64 * KiB, 1ull << 40); },
   [](const settings& s) { return format_size(s.sim_capacity); }},
  {"FERRY_SIM_GRANULARITY", "Physical chunk granularity of simulated devices (power of two, >= page size; CUDA uses 2MiB).",
   [](settings& s, std::string_view v) { s.sim_granularity = parse_size_in(v, 4 * KiB, 1 * GiB, true); },
   [](const settings& s) { return format_size(s.sim_granularity); }},
  {"FERRY_SIM_COPY_ENGINES", "Worker threads acting as copy engines of each simulated device, 1..64.",
   [](settings& s, std::string_view v) { s.sim_copy_engines = static_cast<int>(parse_int(v, 1, 64)); },
   [](const settings& s) { return std::to_string(s.sim_copy_engines); }},
  {"FERRY_SIM_COPY_GBPS", "Throttle of each simulated copy engine in GB/s (0 = unthrottled); models slow links in tests.",
   [](settings& s, std::string_view v) { s.sim_copy_gbps = parse_double(v, 0, 1e6); },
   [](const settings& s) { return show_double(s.sim_copy_gbps); }},
  {"FERRY_SIM_PEER", "Whether simulated devices have peer access to each other (0 tests the staged GPU<->GPU path).",
   [](settings& s, std::string_view v) { s.sim_peer = parse_bool(v); },
   [](const settings& s) { return std::string(s.sim_peer ? "1" : "0"); }},
  {"FERRY_PIN_LIMIT", "Bytes the registration cache keeps pinned for unused registrations before evicting (LRU).",
   [](settings& s, std::string_view v) { s.pin_limit = parse_size_in(v, 0, 1ull << 50); },
   [](const settings& s) { return format_size(s.pin_limit); }},
  {"FERRY_STAGING_BYTES", "Size of each pinned staging buffer. One pool per NUMA node serves every staged path: the transfer engine's bounce and GPU-to-GPU copies, the file engine's I/O slots and ferry:// staging.",
   [](settings& s, std::string_view v) { s.staging_bytes = parse_size_in(v, 64 * KiB, 1 * GiB); },
   [](const settings& s) { return format_size(s.staging_bytes); }},
  {"FERRY_STAGING_BUFFERS", "Most pinned staging buffers per NUMA node (the one staging pool, made in segments as they are needed), 1..1024, shared by the file engine's threads and the transfer engine's staged copies; when it is empty, a file engine thread with I/O in flight goes on with fewer, one with none waits for a buffer. The default holds 128 MiB at most: more bytes in flight made page-cache loads into a GPU slower, not faster (docs/design/file-engine.md).",
   [](settings& s, std::string_view v) { s.staging_buffers = static_cast<int>(parse_int(v, 1, 1024)); },
   [](const settings& s) { return std::to_string(s.staging_buffers); }},
  {"FERRY_XFER_THREADS", "Most transfer engine worker threads (each drives its own streams and bounce copies), 0..256; 0 = half the cores, 2..16. They are made as the work asks for them: one when an item is queued and none is idle.",
   [](settings& s, std::string_view v) { s.xfer_threads = static_cast<int>(parse_int(v, 0, 256)); },
   [](const settings& s) { return std::to_string(s.xfer_threads); }},
  {"FERRY_XFER_SPLIT", "Split copy-engine requests (direct, peer, registered) into pieces of this size on several streams; 0 = never (one stream already saturates a link direction).",
   [](settings& s, std::string_view v) { s.xfer_split = parse_size_in(v, 0, 1ull << 50); },
   [](const settings& s) { return format_size(s.xfer_split); }},
  {"FERRY_XFER_CHUNK", "Piece size of staged, bounce and host-to-host copies spread over the workers; also the least a work item of grouped small requests holds (a batch of many is grouped into two items per worker when those are larger).",
   [](settings& s, std::string_view v) { s.xfer_chunk = parse_size_in(v, 64 * KiB, 4 * GiB); },
   [](const settings& s) { return format_size(s.xfer_chunk); }},
  {"FERRY_XFER_BATCH_SMALL", "Requests up to this size, of one device and direction, are grouped into work items of FERRY_XFER_CHUNK or half the batch's share per worker, whichever is larger (one enqueue and one synchronization each).",
   [](settings& s, std::string_view v) { s.xfer_batch_small = parse_size_in(v, 0, 1 * GiB); },
   [](const settings& s) { return format_size(s.xfer_batch_small); }},
  {"FERRY_XFER_PAGEABLE", "Pageable host memory: auto (bounce the first time, register a range copied again) | register | bounce.",
   [](settings& s, std::string_view v) { s.xfer_pageable = parse_enum(v, pageable_policies); },
   [](const settings& s) { return std::string(to_string(s.xfer_pageable)); }},
  {"FERRY_XFER_PEER", "Use direct GPU<->GPU (peer) copies where the GPUs allow it; 0 stages them through host memory.",
   [](settings& s, std::string_view v) { s.xfer_peer = parse_bool(v); },
   [](const settings& s) { return std::string(s.xfer_peer ? "1" : "0"); }},
  {"FERRY_CUFILE_LIBRARY", "cuFile (GPUDirect Storage) library loaded at run time (optional).",
   [](settings& s, std::string_view v) { s.cufile_library = nonempty(v); },
   [](const settings& s) { return s.cufile_library; }},
  {"FERRY_CUPTI_LIBRARY", "CUPTI library loaded at run time (dlopen) for kernel-launch callbacks (unified memory returns pages to the device before launches); without it those features are off. Tried as given, then under /usr/local/cuda.",
   [](settings& s, std::string_view v) { s.cupti_library = nonempty(v); },
   [](const settings& s) { return s.cupti_library; }},
  {"FERRY_FILE_BACKEND", "File backend: auto (cuFile where the nvidia-fs driver is loaded and handle registration and a probe read work, else io_uring; a file system that refused registration once is not tried again) | io_uring | cufile.",
   [](settings& s, std::string_view v) { s.file_backend = parse_enum(v, file_backends); },
   [](const settings& s) { return std::string(to_string(s.file_backend)); }},
  {"FERRY_IO_DIRECT", "O_DIRECT for file reads: auto (unless the range is in the page cache; a small read asks the page cache first) | always | never.",
   [](settings& s, std::string_view v) { s.io_direct = parse_enum(v, direct_ios); },
   [](const settings& s) { return std::string(to_string(s.io_direct)); }},
  {"FERRY_IO_THREADS", "Most file engine threads, each with its own io_uring, 0..64; 0 = three quarters of the hardware threads, 2..16. They are started as the work asks for them: two at first, then one more for every FERRY_IO_DEPTH requests waiting or running and for every 32 MiB asked of them since the process began. A request goes to the thread with the least work, so requests that come together (a server's clients, the pieces of a ferry:// read) run in parallel.",
   [](settings& s, std::string_view v) { s.io_threads = static_cast<int>(parse_int(v, 0, 64)); },
   [](const settings& s) { return std::to_string(s.io_threads); }},
  {"FERRY_IO_DEPTH", "File reads/writes in flight per file engine thread (its queue depth), shared by the requests it runs at once: each issues into a free slot in turn; staged ones take a buffer of the staging pool per I/O, those free at the time, 1..256.",
   [](settings& s, std::string_view v) { s.io_depth = static_cast<int>(parse_int(v, 1, 256)); },
   [](const settings& s) { return std::to_string(s.io_depth); }},
  {"FERRY_IO_CHUNK", "Size of each file read/write, a multiple of 4 KiB (at most FERRY_STAGING_BYTES, the buffer it lands in).",
   [](settings& s, std::string_view v) {
     s.io_chunk = parse_size_in(v, 64 * KiB, 1 * GiB);
     if (s.io_chunk % (4 * KiB)) throw bad_value{"must be a multiple of 4KiB"};
   },
   [](const settings& s) { return format_size(s.io_chunk); }},
  {"FERRY_IO_MAPPED", "Reads into GPU memory of ranges the page cache holds: when set, the GPU's copy engine reads the file's pages where they are (mapped, pinned read-only for the copy, two pieces of this size at a time per file engine thread) instead of through the staging pool. A process's first loads then make no staging buffers (faster by about the making of the pool); large warm loads are slower than staged ones (docs/design/python.md). 0 (the default) = staged. A multiple of 4 KiB.",
   [](settings& s, std::string_view v) {
     s.io_mapped = v == "0" ? 0 : parse_size_in(v, 64 * KiB, 1 * GiB);
     if (s.io_mapped % (4 * KiB)) throw bad_value{"must be 0 or a multiple of 4KiB"};
   },
   [](const settings& s) { return s.io_mapped ? format_size(s.io_mapped) : std::string("0"); }},
  {"FERRY_STREAM_SLOTS", "Staging buffers (FERRY_STAGING_BYTES each) one stream-ordered file read or write uses at once: the file side fills one while the stream copies another, 1..64.",
   [](settings& s, std::string_view v) { s.stream_slots = static_cast<int>(parse_int(v, 1, 64)); },
   [](const settings& s) { return std::to_string(s.stream_slots); }},
  {"FERRY_IO_INLINE", "Buffered file reads/writes of at most this size are copied by the file engine thread as it submits them (when the pages are cached); larger ones go to the kernel's io_uring workers so their copies run in parallel. Also the smallest piece a page-cache read into host memory is cut into for several file engine threads (FERRY_IO_CHUNK when this is below 64KiB). 0 = never inline.",
   [](settings& s, std::string_view v) { s.io_inline = parse_size_in(v, 0, 1 * GiB); },
   [](const settings& s) { return format_size(s.io_inline); }},
  {"FERRY_IO_INJECT", "Test only: inject faults into file I/O completions: partial, eintr, or partial,eintr. Empty: off.",
   [](settings& s, std::string_view v) {
     if (!v.empty() && v != "partial" && v != "eintr" && v != "partial,eintr" && v != "eintr,partial")
       throw bad_value{"expected partial, eintr, partial,eintr or empty"};
     s.io_inject = std::string(v);
   },
   [](const settings& s) { return s.io_inject; }},
  {"FERRY_SECRET_FILE", "File holding the shared secret for ferry:// servers started with --secret-file. Empty: none.",
   [](settings& s, std::string_view v) { s.secret_file = std::string(v); },
   [](const settings& s) { return s.secret_file; }},
  {"FERRY_NET_PIECE", "ferry:// reads and writes are split into wire requests of at most this size (each one credit); pieces of one request are served in parallel. At most 4MiB, the largest data message a server accepts.",
   [](settings& s, std::string_view v) { s.net_piece = parse_size_in(v, 4 * KiB, 4 * MiB); },
   [](const settings& s) { return format_size(s.net_piece); }},
  {"FERRY_NET_LANDING", "The landing region a ferry:// client lends a same-host server (shared memory, slots of FERRY_NET_PIECE, and a quarter as much again in 64 KiB slots for small pieces): reads land there, then are copied on; also the most data of one client in flight that way. Small enough that a slot is still in the processor's last-level cache when it is copied on (a larger region streams through memory twice); slots the server left unanswered are never reused, and a region that lost half of them (of either size) is replaced.",
   [](settings& s, std::string_view v) { s.net_landing = parse_size_in(v, 4 * MiB, 1ull << 40); },
   [](const settings& s) { return format_size(s.net_landing); }},
  {"FERRY_NET_SPIN", "UCX progress threads keep polling this long after activity before they sleep (back-off): back-to-back requests pay no thread wake-up; 0 = sleep at once. Longer than a thread wake-up on a busy machine (tens of microseconds), or server and client can settle into waking each other for every request.",
   [](settings& s, std::string_view v) { s.net_spin = parse_duration_in(v, std::chrono::nanoseconds::zero(), std::chrono::seconds(1)); },
   [](const settings& s) { return format_duration(s.net_spin); }},
  {"FERRY_NET_RETRY_AFTER", "After a ferry:// client failed to reach its server (a connection or a reconnection that failed), its requests fail at once with that error for this long, then the next one tries again: a dead server costs one connection attempt per period, not one per request (each may take seconds). 0 = every request tries.",
   [](settings& s, std::string_view v) { s.net_retry_after = parse_duration_in(v, std::chrono::nanoseconds::zero(), std::chrono::hours(1)); },
   [](const settings& s) { return format_duration(s.net_retry_after); }},
  {"FERRY_NET_CONNECT_TIMEOUT", "How long one connection attempt of a ferry:// client waits for the server's answer to its handshake (within the request's own deadline). A server that died may leave the attempt without any error: past this it counts as unreachable (FERRY_NET_RETRY_AFTER) instead of holding the request to its deadline.",
   [](settings& s, std::string_view v) { s.net_connect_timeout = parse_duration_in(v, std::chrono::milliseconds(1), std::chrono::hours(1)); },
   [](const settings& s) { return format_duration(s.net_connect_timeout); }},
  {"FERRY_SERVE_WORKERS", "UCX workers (progress threads) of `ferry serve`: 1. More is refused: with this UCX (1.13) several workers abort the server when connections come and go under load, strangers' included (openucx/ucx#9942, #11455; docs/design/storage-service.md).",
   [](settings& s, std::string_view v) {
     const auto n = parse_int(v, 1, 64);
     if (n > 1)
       throw bad_value{"more than 1 is refused: several UCX workers abort the server when connections come and go under load "
                       "(UCX 1.13, openucx/ucx#9942; docs/design/storage-service.md)"};
     s.serve_workers = static_cast<int>(n);
   },
   [](const settings& s) { return std::to_string(s.serve_workers); }},
  {"FERRY_SERVE_MAX_CONNECTIONS", "Authenticated connections (lanes) `ferry serve` keeps at once; past it a new lane is refused, naming this setting.",
   [](settings& s, std::string_view v) { s.serve_max_connections = static_cast<int>(parse_int(v, 1, 1 << 20)); },
   [](const settings& s) { return std::to_string(s.serve_max_connections); }},
  {"FERRY_SERVE_MAX_UNAUTHENTICATED", "Connections at the door of `ferry serve` (its port, before the welcome) at once; past it one is closed to make room: one already welcomed, else one that has said nothing (at random), else the oldest. Each holds one descriptor and a 4 KiB buffer, so connections that never speak cannot lock out a client that does.",
   [](settings& s, std::string_view v) { s.serve_max_unauthenticated = static_cast<int>(parse_int(v, 1, 1 << 20)); },
   [](const settings& s) { return std::to_string(s.serve_max_unauthenticated); }},
  {"FERRY_SERVE_HANDSHAKE_TIMEOUT", "A connection to the door of `ferry serve` is closed this long after it was accepted, whatever it sent (hello, the secret when one is required, the welcome); so is a lane the server connected whose hello did not come within this time.",
   [](settings& s, std::string_view v) { s.serve_handshake_timeout = parse_duration_in(v, std::chrono::milliseconds(10), std::chrono::hours(1)); },
   [](const settings& s) { return format_duration(s.serve_handshake_timeout); }},
  {"FERRY_SERVE_IDLE_TIMEOUT", "A connection to `ferry serve` with no request in flight and none received for this long is closed (clients reconnect on their next request).",
   [](settings& s, std::string_view v) { s.serve_idle_timeout = parse_duration_in(v, std::chrono::milliseconds(10), std::chrono::hours(24 * 7)); },
   [](const settings& s) { return format_duration(s.serve_idle_timeout); }},
  {"FERRY_SERVE_AUTH_FAILURES", "Failed authentications `ferry serve` allows on one connection before closing it.",
   [](settings& s, std::string_view v) { s.serve_auth_failures = static_cast<int>(parse_int(v, 1, 1000)); },
   [](const settings& s) { return std::to_string(s.serve_auth_failures); }},
  {"FERRY_SERVE_AUTH_RATE", "Wrong answers to the secret's challenge `ferry serve` tells per second, all connections together (1..100000); more wait their turn, in arrival order, and their connections cannot guess again meanwhile. A right answer is welcomed at once: no address is refused and no client waits behind guessers.",
   [](settings& s, std::string_view v) { s.serve_auth_rate = static_cast<int>(parse_int(v, 1, 100000)); },
   [](const settings& s) { return std::to_string(s.serve_auth_rate); }},
  {"FERRY_NET_LANES", "Connections a ferry:// client opens to a server, each with its own UCX worker and progress thread; pieces are spread over them (one tcp connection is bound by one thread's copies).",
   [](settings& s, std::string_view v) { s.net_lanes = static_cast<int>(parse_int(v, 1, 64)); },
   [](const settings& s) { return std::to_string(s.net_lanes); }},
  {"FERRY_HTTP_PIECE", "http:// and https:// reads are split into range requests of at most this size, served in parallel over FERRY_HTTP_CONNECTIONS connections; a piece into GPU or sim memory is also at most one staging buffer (FERRY_STAGING_BYTES). An s3:// write larger than this goes up as a multipart upload in parts of this size (at least 5 MiB, and at most 10,000 parts).",
   [](settings& s, std::string_view v) { s.http_piece = parse_size_in(v, 64 * KiB, 1ull << 30); },
   [](const settings& s) { return format_size(s.http_piece); }},
  {"FERRY_HTTP_CONNECTIONS", "Range requests of http://, https:// and s3:// reads under way at once, each on a connection of its own (kept for the next), shared by FERRY_HTTP_THREADS.",
   [](settings& s, std::string_view v) { s.http_connections = static_cast<int>(parse_int(v, 1, 256)); },
   [](const settings& s) { return std::to_string(s.http_connections); }},
  {"FERRY_HTTP_THREADS", "Threads that run http://, https:// and s3:// requests (each a libcurl multi handle; a read's pieces are spread over them), made on the first open; 0 = half the hardware threads, 1..16. Each receives and copies its connections' bytes, so one is bound by one core.",
   [](settings& s, std::string_view v) { s.http_threads = static_cast<int>(parse_int(v, 0, 64)); },
   [](const settings& s) { return std::to_string(s.http_threads); }},
  {"FERRY_HTTP_RETRIES", "Times a range request of an http:// or https:// read is tried again after a connection reset, a closed connection or a 5xx/429 answer, from the byte it reached, after a pause that doubles (0.1 s to 2 s); 0 = never. A request that moves no byte for FERRY_DEADLINE fails.",
   [](settings& s, std::string_view v) { s.http_retries = static_cast<int>(parse_int(v, 0, 100)); },
   [](const settings& s) { return std::to_string(s.http_retries); }},
  {"FERRY_HTTP_CA_FILE", "Certificates (PEM) that https:// servers are checked against instead of the system's; a server's certificate is always checked. Empty: the system's certificates.",
   [](settings& s, std::string_view v) { s.http_ca_file = std::string(v); },
   [](const settings& s) { return s.http_ca_file; }},
  {"FERRY_NET_MAP", "Same-host shared memory: the client lends a landing region (FERRY_NET_LANDING bytes, a sealed memfd passed on the server's Unix socket) that the server maps and reads files straight into; off = data always moves by messages. Needs both sides on.",
   [](settings& s, std::string_view v) { s.net_map = parse_bool(v); },
   [](const settings& s) { return std::string(s.net_map ? "1" : "0"); }},
  {"FERRY_NET_RMA", "Bulk data of ferry:// by RMA into the client's registered memory (the server puts reads and gets writes): auto (when the connection has a transport with real RMA: InfiniBand/RoCE verbs) | on (always; over tcp UCX emulates it, slowly) | off (active messages).",
   [](settings& s, std::string_view v) { s.net_rma = parse_enum(v, rma_uses); },
   [](const settings& s) { return std::string(to_string(s.net_rma)); }},
  {"FERRY_VM_CAPACITY", "Device memory one unified address space may use for its pages; beyond it pages are evicted to host memory. 0 = what the device has free when the space is made, minus FERRY_VM_RESERVE.",
   [](settings& s, std::string_view v) { s.vm_capacity = parse_size_in(v, 0, 1ull << 50); },
   [](const settings& s) { return format_size(s.vm_capacity); }},
  {"FERRY_VM_RESERVE", "Device memory a unified address space leaves free when FERRY_VM_CAPACITY is 0 (for kernels, streams and other allocations); at most a quarter of the free memory.",
   [](settings& s, std::string_view v) { s.vm_reserve = parse_size_in(v, 0, 1ull << 50); },
   [](const settings& s) { return format_size(s.vm_reserve); }},
  {"FERRY_VM_KEEP", "Bytes of freed whole-page blocks a block pool keeps for reuse (torch's tensors on unified memory: the memory of freed tensors, kept for the next ones on the same stream); past it the blocks freed longest ago go back to the address space. 0 = a quarter of the space's device capacity.",
   [](settings& s, std::string_view v) { s.vm_keep = parse_size_in(v, 0, 1ull << 50); },
   [](const settings& s) { return format_size(s.vm_keep); }},
  {"FERRY_VM_PAGE", "Page size of a unified address space: the unit that migrates, rounded up to the device granularity (2 MiB with CUDA). One CUDA VMM call costs about the same for 2 MiB as for 32 MiB, so larger pages remap faster; 0 = the device granularity.",
   [](settings& s, std::string_view v) { s.vm_page = parse_size_in(v, 0, 1ull << 30); },
   [](const settings& s) { return format_size(s.vm_page); }},
  {"FERRY_VM_POLICY", "Which device page a unified address space evicts first: lru (least recently used) | fifo (first arrived).",
   [](settings& s, std::string_view v) { s.vm_policy = parse_enum(v, replacements); },
   [](const settings& s) { return std::string(to_string(s.vm_policy)); }},
  {"FERRY_VM_BATCH", "Most pages (of FERRY_VM_PAGE) one batched migration moves: their remaps are grouped and their copies queued together, and the next batch is remapped while one copies. A range moves in at least 8 batches when it has the pages (copies overlap remaps); a batch takes at most a quarter of the device capacity.",
   [](settings& s, std::string_view v) { s.vm_batch = static_cast<int>(parse_int(v, 1, 1024)); },
   [](const settings& s) { return std::to_string(s.vm_batch); }},
  {"FERRY_VM_FAULT_AHEAD", "Pages a CPU fault on device-resident memory moves to host: the faulting page, then -- after the faulting thread runs on -- the device-resident pages after it, inside its allocation (1 = the faulting page only), in batches; the CPU may use them without another fault. While faults come in sequence (each inside the last window) the window doubles, up to 8 times this.",
   [](settings& s, std::string_view v) { s.vm_fault_ahead = static_cast<int>(parse_int(v, 1, 1024)); },
   [](const settings& s) { return std::to_string(s.vm_fault_ahead); }},
  {"FERRY_VM_THRASH_LAPSE", "A unified-memory page evicted from the device and prefetched back within this time is thrashing (the device cannot hold the working set, e.g. a stream over more than FERRY_VM_CAPACITY): PREFETCH then leaves it on the host for FERRY_VM_THRASH_HOLD and the device reads it in place over PCIe, instead of evicting another page that is wanted back as soon. Pages whose PREFERRED_LOCATION is the device are always moved. 0 = off: every PREFETCH migrates.",
   [](settings& s, std::string_view v) { s.vm_thrash_lapse = parse_duration_in(v, std::chrono::nanoseconds::zero(), std::chrono::hours(1)); },
   [](const settings& s) { return format_duration(s.vm_thrash_lapse); }},
  {"FERRY_VM_THRASH_HOLD", "How long a thrashing unified-memory page (FERRY_VM_THRASH_LAPSE) stays on the host before PREFETCH migrates it again.",
   [](settings& s, std::string_view v) { s.vm_thrash_hold = parse_duration_in(v, std::chrono::nanoseconds::zero(), std::chrono::hours(1)); },
   [](const settings& s) { return format_duration(s.vm_thrash_hold); }},
  {"FERRY_GPU_RING_SLOTS", "Request slots of a GPU request ring (kernels' requests to ferry's host proxy): a power of two. A full ring makes requesters wait (up to their deadline) until the proxy has taken requests out.",
   [](settings& s, std::string_view v) {
     auto n = parse_int(v, 2, 1 << 20);
     if (n & (n - 1)) throw bad_value{"not a power of two"};
     s.gpu_ring_slots = static_cast<std::uint32_t>(n);
   },
   [](const settings& s) { return std::to_string(s.gpu_ring_slots); }},
  {"FERRY_GPU_PROXY_BATCH", "The most requests a GPU proxy takes from its ring at once and hands to the file engine as one batch (one submission, one completion). Larger batches cost less per request; a request's answer waits for the whole batch.",
   [](settings& s, std::string_view v) { s.gpu_proxy_batch = static_cast<std::uint32_t>(parse_int(v, 1, 1 << 16)); },
   [](const settings& s) { return std::to_string(s.gpu_proxy_batch); }},
  {"FERRY_GPU_PROXY_RINGS", "Request rings of a GPU proxy, a power of two from 1 to 256, each with FERRY_GPU_RING_SLOTS slots and a host thread of its own that takes its requests and hands them to the file engine: more rings serve more requests at once, each thread polls its ring while requests come (and naps when none do).",
   [](settings& s, std::string_view v) {
     auto n = parse_int(v, 1, 256);
     if (n & (n - 1)) throw bad_value{"not a power of two"};
     s.gpu_proxy_rings = static_cast<std::uint32_t>(n);
   },
   [](const settings& s) { return std::to_string(s.gpu_proxy_rings); }},
  {"FERRY_GPU_CACHE_BYTES", "Device memory a GPU page cache (gpu::cache) keeps pages of mapped files in, for kernels that read and write them element by element.",
   [](settings& s, std::string_view v) { s.gpu_cache_bytes = parse_size_in(v, 4 * KiB, 1ull << 40); },
   [](const settings& s) { return format_size(s.gpu_cache_bytes); }},
  {"FERRY_GPU_CACHE_LANDING", "Pinned host memory a GPU page cache's pages pass through between its proxy and device memory (one page per request under way; more lets more misses be served at once).",
   [](settings& s, std::string_view v) { s.gpu_cache_landing = parse_size_in(v, 4 * KiB, 1ull << 40); },
   [](const settings& s) { return format_size(s.gpu_cache_landing); }},
  {"FERRY_GPU_CACHE_PAGE", "A GPU page cache's page: what one miss reads from the source (and one write-back writes). Small pages waste less on scattered accesses; large ones need fewer requests for dense ones. A power of two from 4 KiB to 2 MiB.",
   [](settings& s, std::string_view v) { s.gpu_cache_page = static_cast<std::uint32_t>(parse_size_in(v, 4 * KiB, 2 * MiB, true)); },
   [](const settings& s) { return format_size(s.gpu_cache_page); }},
  {"FERRY_VM_RETURN_AT_LAUNCH", "Pages of a unified address space that CPU faults took from a device go back to it (their PREFERRED_LOCATION, else the device they came from) before the next kernel launch on that device, so that kernels read them from device memory (needs launch callbacks: CUPTI with CUDA). Only with room on the device (never by eviction), once the work of earlier launches, copies and memsets on any stream has finished (waited for up to FERRY_VM_RETURN_QUIET, else the pages wait for a later launch); pages the CPU keeps taking back stay on the host (FERRY_VM_RETURN_HOLD). 0 = off.",
   [](settings& s, std::string_view v) { s.vm_return_at_launch = parse_bool(v); },
   [](const settings& s) { return std::string(s.vm_return_at_launch ? "1" : "0"); }},
  {"FERRY_VM_RETURN_QUIET", "Pages the CPU took from a device (FERRY_VM_RETURN_AT_LAUNCH) also go back in the background once this long has passed since the CPU took them, the space's attached streams are idle and no launched work still runs on any stream (needs launch callbacks, like the return at launch); also how long a launch waits for earlier work before it returns pages. 0 = only at launches.",
   [](settings& s, std::string_view v) { s.vm_return_quiet = parse_duration_in(v, std::chrono::nanoseconds::zero(), std::chrono::hours(1)); },
   [](const settings& s) { return format_duration(s.vm_return_quiet); }},
  {"FERRY_VM_RETURN_HOLD", "A page the CPU takes again within this time of its return to the device is one the CPU keeps using: it stays on the host this long, twice as long each further time (at most 64 times). Also how long the background return leaves the pages moved ahead of the last CPU fault (the CPU is on its way to them).",
   [](settings& s, std::string_view v) { s.vm_return_hold = parse_duration_in(v, std::chrono::nanoseconds::zero(), std::chrono::hours(1)); },
   [](const settings& s) { return format_duration(s.vm_return_hold); }},
  {"FERRY_VM_REPORT", "1: each unified address space prints to stderr, when it ends (for a program on ferry's managed memory, at its exit), where its time went: CPU faults and the time serving them, migrations each way with their bytes, evictions, prefetches and returns, and the time in new chunks, remaps, waits for the program's streams and for copies, the largest named with what usually helps. 0 = off.",
   [](settings& s, std::string_view v) { s.vm_report = parse_bool(v); },
   [](const settings& s) { return std::string(s.vm_report ? "1" : "0"); }},
};
// clang-format on

const setting_def* find_def(std::string_view name) {
  for (auto& d : table)
    if (d.name == name) return &d;
  return nullptr;
}

std::string_view trim(std::string_view s) {
  auto issp = [](char c) { return c == ' ' || c == '\t' || c == '\r'; };
  while (!s.empty() && issp(s.front())) s.remove_prefix(1);
  while (!s.empty() && issp(s.back())) s.remove_suffix(1);
  return s;
}

// FERRY_CONFIG: "NAME = value" lines, '#' comments. Unknown names are errors (a typo must not be ignored).
void apply_file(settings& s, const std::string& path) {
  std::ifstream in(path);
  if (!in) fail_errno(errno, "settings.load", "FERRY_CONFIG=" + path, "cannot open config file");
  std::string line;
  for (int lineno = 1; std::getline(in, line); ++lineno) {
    std::string_view l = trim(line);
    if (l.empty() || l.front() == '#') continue;
    auto eq = l.find('=');
    std::string origin = fmt::format("{}:{}", path, lineno);
    if (eq == std::string_view::npos)
      fail(errc::invalid_argument, "settings.load", origin, fmt::format("expected NAME = value, got '{}'", l));
    std::string_view name = trim(l.substr(0, eq)), value = trim(l.substr(eq + 1));
    if (!find_def(name))
      fail(errc::invalid_argument, "settings.load", origin, fmt::format("unknown setting '{}'", name));
    s.set(name, value, origin);
  }
}

}  // namespace

std::string_view to_string(pageable_policy v) noexcept { return enum_name(v, pageable_policies); }
std::string_view to_string(file_backend_kind v) noexcept { return enum_name(v, file_backends); }
std::string_view to_string(direct_io v) noexcept { return enum_name(v, direct_ios); }
std::string_view to_string(rma_use v) noexcept { return enum_name(v, rma_uses); }
std::string_view to_string(page_replacement v) noexcept { return enum_name(v, replacements); }

void settings::set(std::string_view name, std::string_view value, std::string_view origin) {
  const setting_def* d = find_def(name);
  if (!d) fail(errc::not_found, "settings.set", std::string(name), fmt::format("unknown setting (from {})", origin));
  try {
    d->apply(*this, value);
  } catch (const bad_value& b) {
    fail(errc::invalid_argument, "settings.parse", fmt::format("{}='{}' (from {})", name, value, origin), b.why);
  }
}

settings settings::defaults() { return settings{}; }

settings settings::load(const lookup_fn& env) {
  settings s;
  if (auto cfg = env("FERRY_CONFIG"); cfg && !cfg->empty()) apply_file(s, *cfg);
  for (auto& d : table)
    if (auto v = env(d.name)) s.set(d.name, *v, "environment");
  return s;
}

settings settings::from_env() {
  settings s = load([](std::string_view n) -> std::optional<std::string> {
    if (const char* v = std::getenv(std::string(n).c_str())) return std::string(v);
    return std::nullopt;
  });
  // A misspelt FERRY_* variable would otherwise be silently ignored.
  for (char** e = environ; e && *e; ++e) {
    std::string_view kv(*e);
    if (!kv.starts_with("FERRY_")) continue;
    auto name = kv.substr(0, kv.find('='));
    if (name != "FERRY_CONFIG" && !find_def(name))
      log::warn("settings", "ignoring unknown environment variable {} (see `ferry info --settings`)", name);
  }
  return s;
}

std::vector<settings::row> settings::describe() const {
  static const settings def;
  std::vector<row> rows;
  rows.reserve(std::size(table));
  for (auto& d : table) rows.push_back({std::string(d.name), d.show(*this), d.show(def), std::string(d.doc)});
  return rows;
}

std::vector<std::string_view> settings::names() {
  std::vector<std::string_view> n;
  for (auto& d : table) n.push_back(d.name);
  return n;
}

}  // namespace ferry
