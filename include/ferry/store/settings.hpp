#pragma once
// store's tunables: the ferry:// client and server (FERRY_NET_*, FERRY_SERVE_*, the secret) and the http://,
// https:// and s3:// sources (rows in src/store/settings.cpp; ferry/settings.hpp gathers every layer's).
#include <ferry/core/export.hpp>
#include <ferry/core/settings.hpp>

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace ferry {

// RMA into the client's registered memory for ferry:// bulk data: automatic where a lane has a
// transport with real RMA (verbs).
enum class rma_use { automatic, on, off };
FERRY_API std::string_view to_string(rma_use v) noexcept;

FERRY_API int default_http_threads() noexcept;  // one per hardware thread, 1..16
FERRY_API int default_net_lanes() noexcept;  // a ferry:// client's lanes: one per four cores, 1..4

// With core's (FERRY_DEADLINE: a request's wait).
struct FERRY_API store_settings : virtual core_settings {
  std::string secret_file;             // shared secret for ferry:// servers that require one
  std::uint64_t net_piece = 4ull << 20;     // bytes per wire request of a ferry:// read or write
  std::uint64_t net_landing = 64ull << 20;  // the landing region a client lends a same-host server
  std::chrono::nanoseconds net_spin = std::chrono::microseconds(200);  // progress back-off before sleeping
  std::chrono::nanoseconds net_retry_after = std::chrono::seconds(1);  // a server that could not be reached: not tried again before
  std::chrono::nanoseconds net_connect_timeout = std::chrono::seconds(5);  // one connection attempt's wait for the server's welcome
  int serve_workers = 1;                // UCX workers (progress threads) of `ferry serve`
  bool serve_lend_files = true;         // `ferry serve` lends same-host clients the files they open for reading
  int serve_max_connections = 1024;     // connections a server keeps at once
  int serve_max_unauthenticated = 1024;  // connections at the door (4 KiB and a descriptor each)
  std::chrono::nanoseconds serve_handshake_timeout = std::chrono::seconds(5);  // hello..welcome
  std::chrono::nanoseconds serve_idle_timeout = std::chrono::minutes(10);      // no request for this long: closed
  int serve_auth_failures = 3;          // failed authentications per connection before it is closed
  int serve_auth_rate = 20;  // secret proofs `ferry serve` checks per second, all connections together
  int net_lanes = 0;                    // connections (each its own worker) per ferry:// client; 0: default_net_lanes()
  // http://, https:// sources
  std::uint64_t http_piece = 8ull << 20;   // bytes per range request
  int http_connections = 32;               // pieces under way at once (each its connection)
  int http_threads = 0;                    // libcurl threads (0: default_http_threads())
  int http_retries = 5;                    // attempts after the first, for a piece that failed on the way
  std::string http_ca_file;                // certificates to trust for https (empty: the system's)
  std::string curl_library = "libcurl.so.4";  // loaded on the first URL a process opens
  bool net_map = true;                  // lend/map a shared-memory landing region when on the same host
  bool net_files = true;                // same host: ask the server to lend files opened for reading (a descriptor)
  rma_use net_rma = rma_use::automatic;

  static std::span<const setting_row<store_settings>> table();
};

}  // namespace ferry
