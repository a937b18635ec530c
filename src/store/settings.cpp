// store's settings table: a row per field of store_settings (ferry/store/settings.hpp).
#include <ferry/store/settings.hpp>

#include "core/settings_table.hpp"

#include <algorithm>
#include <thread>

namespace ferry {

namespace {

constexpr std::pair<std::string_view, rma_use> rma_uses[] = {{"auto", rma_use::automatic}, {"on", rma_use::on}, {"off", rma_use::off}};

// clang-format off
constexpr setting_row<store_settings> rows[] = {
  {"FERRY_SECRET_FILE", "File holding the shared secret for ferry:// servers started with --secret-file. Empty: none.",
   [](store_settings& s, std::string_view v) { s.secret_file = std::string(v); },
   [](const store_settings& s) { return s.secret_file; }},
  {"FERRY_NET_PIECE", "ferry:// reads and writes are split into wire requests of at most this size (each one credit); pieces of one request are served in parallel. At most 4MiB, the largest data message a server accepts.",
   [](store_settings& s, std::string_view v) { s.net_piece = parse_size_in(v, 4 * KiB, 4 * MiB); },
   [](const store_settings& s) { return format_size(s.net_piece); }},
  {"FERRY_NET_LANDING", "The landing region a ferry:// client lends a same-host server (shared memory, slots of FERRY_NET_PIECE, a quarter as much again in 64 KiB slots for small pieces, and an eighth in 260 KiB slots for the answers of small reads sent as one request): reads land there, then are copied on; also the most data of one client in flight that way. Small enough that a slot is still in the processor's last-level cache when it is copied on (a larger region streams through memory twice); slots the server left unanswered are never reused, and a region that lost half of them (of either size) is replaced.",
   [](store_settings& s, std::string_view v) { s.net_landing = parse_size_in(v, 4 * MiB, 1ull << 40); },
   [](const store_settings& s) { return format_size(s.net_landing); }},
  {"FERRY_NET_SPIN", "UCX progress threads keep polling this long after activity before they sleep (back-off): back-to-back requests pay no thread wake-up; 0 = sleep at once. Longer than a thread wake-up on a busy machine (tens of microseconds), or server and client can settle into waking each other for every request.",
   [](store_settings& s, std::string_view v) { s.net_spin = parse_duration_in(v, std::chrono::nanoseconds::zero(), std::chrono::seconds(1)); },
   [](const store_settings& s) { return format_duration(s.net_spin); }},
  {"FERRY_NET_RETRY_AFTER", "After a ferry:// client failed to reach its server (a connection or a reconnection that failed), its requests fail at once with that error for this long, then the next one tries again: a dead server costs one connection attempt per period, not one per request (each may take seconds). 0 = every request tries.",
   [](store_settings& s, std::string_view v) { s.net_retry_after = parse_duration_in(v, std::chrono::nanoseconds::zero(), std::chrono::hours(1)); },
   [](const store_settings& s) { return format_duration(s.net_retry_after); }},
  {"FERRY_NET_CONNECT_TIMEOUT", "How long one connection attempt of a ferry:// client waits for the server's answer to its handshake (within the request's own deadline). A server that died may leave the attempt without any error: past this it counts as unreachable (FERRY_NET_RETRY_AFTER) instead of holding the request to its deadline.",
   [](store_settings& s, std::string_view v) { s.net_connect_timeout = parse_duration_in(v, std::chrono::milliseconds(1), std::chrono::hours(1)); },
   [](const store_settings& s) { return format_duration(s.net_connect_timeout); }},
  {"FERRY_SERVE_LEND_FILES", "`ferry serve` lends a same-host client (one that reaches its Unix socket, with a live session's token) a read-only descriptor of a file it opens for reading beneath the root, on a local file system (a disk's or memory's; never a network or FUSE mount, which is read through the server; a file writable by group or others only to the server's own user or the file's owner), which the client then reads itself (FERRY_NET_FILES on the client). 0 = every same-host read goes through the server, whose credits and workers then bound how its file systems are read (docs/design/storage-service.md).",
   [](store_settings& s, std::string_view v) { s.serve_lend_files = parse_bool(v); },
   [](const store_settings& s) { return std::string(s.serve_lend_files ? "1" : "0"); }},
  {"FERRY_SERVE_WORKERS", "UCX workers (progress threads) of `ferry serve`; each authenticated client's lanes are spread over them, so several serve connections in parallel. On one host a worker copies each small read out of the file itself: several raise the rate of many small reads (a GPU cache's misses; best with FERRY_NET_LANES=8 on the clients), and one large read's pieces stay with one worker; small reads one at a time are somewhat slower with several (docs/design/storage-service.md).",
   [](store_settings& s, std::string_view v) { s.serve_workers = static_cast<int>(parse_int(v, 1, 64)); },
   [](const store_settings& s) { return std::to_string(s.serve_workers); }},
  {"FERRY_SERVE_MAX_CONNECTIONS", "Authenticated connections (lanes) `ferry serve` keeps at once; past it a new lane is refused, naming this setting.",
   [](store_settings& s, std::string_view v) { s.serve_max_connections = static_cast<int>(parse_int(v, 1, 1 << 20)); },
   [](const store_settings& s) { return std::to_string(s.serve_max_connections); }},
  {"FERRY_SERVE_MAX_UNAUTHENTICATED", "Connections at the door of `ferry serve` (its port, before the welcome) at once; past it one is closed to make room: one already welcomed, else one that has said nothing (at random), else the oldest. Each holds one descriptor and a 4 KiB buffer, so connections that never speak cannot lock out a client that does.",
   [](store_settings& s, std::string_view v) { s.serve_max_unauthenticated = static_cast<int>(parse_int(v, 1, 1 << 20)); },
   [](const store_settings& s) { return std::to_string(s.serve_max_unauthenticated); }},
  {"FERRY_SERVE_HANDSHAKE_TIMEOUT", "A connection to the door of `ferry serve` is closed this long after it was accepted, whatever it sent (hello, the secret when one is required, the welcome); so is a lane the server connected whose hello did not come within this time.",
   [](store_settings& s, std::string_view v) { s.serve_handshake_timeout = parse_duration_in(v, std::chrono::milliseconds(10), std::chrono::hours(1)); },
   [](const store_settings& s) { return format_duration(s.serve_handshake_timeout); }},
  {"FERRY_SERVE_IDLE_TIMEOUT", "A connection to `ferry serve` with no request in flight and none received for this long is closed (clients reconnect on their next request).",
   [](store_settings& s, std::string_view v) { s.serve_idle_timeout = parse_duration_in(v, std::chrono::milliseconds(10), std::chrono::hours(24 * 7)); },
   [](const store_settings& s) { return format_duration(s.serve_idle_timeout); }},
  {"FERRY_SERVE_AUTH_FAILURES", "Failed authentications `ferry serve` allows on one connection before closing it.",
   [](store_settings& s, std::string_view v) { s.serve_auth_failures = static_cast<int>(parse_int(v, 1, 1000)); },
   [](const store_settings& s) { return std::to_string(s.serve_auth_failures); }},
  {"FERRY_SERVE_AUTH_RATE", "Wrong answers to the secret's challenge `ferry serve` tells per second, all connections together (1..100000); more wait their turn, in arrival order, and their connections cannot guess again meanwhile. A right answer is welcomed at once: no address is refused and no client waits behind guessers.",
   [](store_settings& s, std::string_view v) { s.serve_auth_rate = static_cast<int>(parse_int(v, 1, 100000)); },
   [](const store_settings& s) { return std::to_string(s.serve_auth_rate); }},
  {"FERRY_NET_LANES", "Connections a ferry:// client opens to a server, each with its own UCX worker and progress thread; pieces are spread over them (one tcp connection is bound by one thread's copies). 0 = one per four cores, between 1 and 4: each lane's thread polls after activity, and on a machine of few cores more lanes than that take turns with the caller and the server.",
   [](store_settings& s, std::string_view v) { s.net_lanes = static_cast<int>(parse_int(v, 0, 64)); },
   [](const store_settings& s) { return std::to_string(s.net_lanes); }},
  {"FERRY_HTTP_PIECE", "http:// and https:// reads are split into range requests of at most this size, served in parallel over FERRY_HTTP_CONNECTIONS connections; a piece into GPU or sim memory is also at most one staging buffer (FERRY_STAGING_BYTES). An s3:// write larger than this goes up as a multipart upload in parts of this size (at least 5 MiB, and at most 10,000 parts).",
   [](store_settings& s, std::string_view v) { s.http_piece = parse_size_in(v, 64 * KiB, 1ull << 30); },
   [](const store_settings& s) { return format_size(s.http_piece); }},
  {"FERRY_HTTP_CONNECTIONS", "Range requests of http://, https:// and s3:// reads under way at once, each on a connection of its own (kept for the next), shared by FERRY_HTTP_THREADS.",
   [](store_settings& s, std::string_view v) { s.http_connections = static_cast<int>(parse_int(v, 1, 256)); },
   [](const store_settings& s) { return std::to_string(s.http_connections); }},
  {"FERRY_HTTP_THREADS", "Threads that run http://, https:// and s3:// requests (each a libcurl multi handle; a read's pieces are spread over them), made on the first open; 0 = one per hardware thread, 1..16. Each receives and copies its connections' bytes, so one is bound by one core; they are busy only while bytes arrive.",
   [](store_settings& s, std::string_view v) { s.http_threads = static_cast<int>(parse_int(v, 0, 64)); },
   [](const store_settings& s) { return std::to_string(s.http_threads); }},
  {"FERRY_HTTP_RETRIES", "Times a range request of an http:// or https:// read is tried again after a connection reset, a closed connection or a 5xx/429 answer, from the byte it reached, after a pause that doubles (0.1 s to 2 s); 0 = never. A request that moves no byte for FERRY_DEADLINE fails.",
   [](store_settings& s, std::string_view v) { s.http_retries = static_cast<int>(parse_int(v, 0, 100)); },
   [](const store_settings& s) { return std::to_string(s.http_retries); }},
  {"FERRY_HTTP_CA_FILE", "Certificates (PEM) that https:// servers are checked against instead of the system's; a server's certificate is always checked. Empty: the system's certificates.",
   [](store_settings& s, std::string_view v) { s.http_ca_file = std::string(v); },
   [](const store_settings& s) { return s.http_ca_file; }},
  {"FERRY_CURL_LIBRARY", "libcurl, loaded at run time (dlopen) when the process first opens an http://, https:// or s3:// URL; ferry does not link against it. The first open's value holds for the process.",
   [](store_settings& s, std::string_view v) { s.curl_library = nonempty(v); },
   [](const store_settings& s) { return s.curl_library; }},
  {"FERRY_NET_MAP", "Same-host shared memory: the client lends a landing region (FERRY_NET_LANDING bytes, a sealed memfd passed on the server's Unix socket) that the server maps and reads files straight into; off = data always moves by messages. Needs both sides on.",
   [](store_settings& s, std::string_view v) { s.net_map = parse_bool(v); },
   [](const store_settings& s) { return std::string(s.net_map ? "1" : "0"); }},
  {"FERRY_NET_FILES", "Same-host files: a ferry:// file opened for reading through the file API (Python, loaders, the GPU cache) is read from a read-only descriptor the server opens beneath its root and passes on its Unix socket, like a local file (io_uring, no server or network in between), when the server lends files (FERRY_SERVE_LEND_FILES); off = every read goes to the server.",
   [](store_settings& s, std::string_view v) { s.net_files = parse_bool(v); },
   [](const store_settings& s) { return std::string(s.net_files ? "1" : "0"); }},
  {"FERRY_NET_RMA", "Bulk data of ferry:// by RMA into the client's registered memory (the server puts reads and gets writes): auto (when the connection has a transport with real RMA: InfiniBand/RoCE verbs) | on (always; over tcp UCX emulates it, slowly) | off (active messages).",
   [](store_settings& s, std::string_view v) { s.net_rma = parse_enum(v, rma_uses); },
   [](const store_settings& s) { return std::string(to_string(s.net_rma)); }},
};
// clang-format on

}  // namespace

std::span<const setting_row<store_settings>> store_settings::table() { return rows; }

std::string_view to_string(rma_use v) noexcept { return enum_name(v, rma_uses); }

int default_http_threads() noexcept {
  // Each libcurl thread receives and copies its connections' bytes, so one is bound by one core: a
  // thread per core, 1..16 (docs/design/remote-sources.md). They wait in poll between bytes, so a
  // process that is not loading pays nothing for them.
  unsigned n = std::thread::hardware_concurrency();
  return static_cast<int>(std::clamp(n, 1u, 16u));
}

int default_net_lanes() noexcept {
  // Each lane's progress thread polls for FERRY_NET_SPIN after activity: on a machine of few cores,
  // more lanes than this take turns with the caller and the server's threads, and small reads slow
  // down (docs/design/storage-service.md, "Several lanes per client").
  unsigned n = std::thread::hardware_concurrency();
  return static_cast<int>(std::clamp(n / 4, 1u, 4u));
}

}  // namespace ferry
