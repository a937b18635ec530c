#pragma once
// Every tunable of ferry, in one place.
//
// A `settings` value is an immutable snapshot: it is loaded once (defaults <- FERRY_CONFIG file <-
// FERRY_* environment) and handed to the runtime that uses it; nothing re-reads the environment
// behind its back. Each tunable is one row of the table in src/core/settings.cpp with its
// environment variable, default, parser and documentation; `ferry info --settings` prints the
// table and docs/settings.md is checked against it by a test.
#include <ferry/core/export.hpp>
#include <ferry/core/log.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ferry {

// Which device backend a runtime prefers for its default device.
// automatic: the first CUDA GPU when a driver and a GPU are present, else sim:0.
enum class backend_choice { automatic, cuda, sim };
FERRY_API std::string_view to_string(backend_choice b) noexcept;

// Pageable host memory in the transfer engine: automatic bounces it through pinned staging the first
// time and registers (pins) a range copied again; the others always do one of the two.
enum class pageable_policy { automatic, always_register, always_bounce };
// The file engine's backend: automatic takes cuFile where handle registration and a probe read work.
enum class file_backend_kind { automatic, io_uring, cufile };
// O_DIRECT for file reads: automatic uses it unless the range is in the page cache.
enum class direct_io { automatic, always, never };
// RMA into the client's registered memory for ferry:// bulk data: automatic where a lane has a
// transport with real RMA (verbs).
enum class rma_use { automatic, on, off };
// Which device page a unified address space evicts first.
enum class page_replacement { lru, fifo };
FERRY_API std::string_view to_string(pageable_policy v) noexcept;
FERRY_API std::string_view to_string(file_backend_kind v) noexcept;
FERRY_API std::string_view to_string(direct_io v) noexcept;
FERRY_API std::string_view to_string(rma_use v) noexcept;
FERRY_API std::string_view to_string(page_replacement v) noexcept;

FERRY_API int default_xfer_threads() noexcept;  // half the hardware threads, 2..16
FERRY_API int default_io_threads() noexcept;    // three quarters of the hardware threads, 2..16
FERRY_API int default_http_threads() noexcept;  // half the hardware threads, 1..16

struct FERRY_API settings {
  // core
  log_level log = log_level::warn;
  std::chrono::nanoseconds deadline = std::chrono::seconds(30);
  // device
  backend_choice backend = backend_choice::automatic;
  std::string cuda_driver = "libcuda.so.1";
  std::string nvml_library = "libnvidia-ml.so.1";
  int sim_devices = 2;
  std::uint64_t sim_capacity = 1ull << 30;
  std::uint64_t sim_granularity = 2ull << 20;
  int sim_copy_engines = 2;
  double sim_copy_gbps = 0;  // 0: as fast as memcpy
  bool sim_peer = true;
  // mem
  std::uint64_t pin_limit = 8ull << 30;
  std::uint64_t staging_bytes = 4ull << 20;
  int staging_buffers = 32;
  int stream_slots = 8;  // staging buffers of one stream-ordered file request (its pipeline depth)
  // xfer
  int xfer_threads = 0;  // 0: default_xfer_threads()
  std::uint64_t xfer_chunk = 16ull << 20;
  std::uint64_t xfer_split = 0;
  std::uint64_t xfer_batch_small = 4ull << 20;
  pageable_policy xfer_pageable = pageable_policy::automatic;
  bool xfer_peer = true;
  // io
  std::string cufile_library = "libcufile.so.0";
  std::string cupti_library = "libcupti.so.13";
  file_backend_kind file_backend = file_backend_kind::automatic;
  direct_io io_direct = direct_io::automatic;
  int io_threads = 0;  // 0: default_io_threads()
  int io_depth = 16;
  std::uint64_t io_chunk = 4ull << 20;
  std::uint64_t io_mapped = 0;  // page-cache reads into a GPU: DMA from the file's pages (0: staged)
  std::uint64_t io_inline = 1ull << 20;  // buffered I/O up to this size is copied during submit
  std::string io_inject;               // test-only fault injection: "partial", "eintr", "partial,eintr"
  // net / store
  std::string secret_file;             // shared secret for ferry:// servers that require one
  std::uint64_t net_piece = 4ull << 20;     // bytes per wire request of a ferry:// read or write
  std::uint64_t net_landing = 64ull << 20;  // the landing region a client lends a same-host server
  std::chrono::nanoseconds net_spin = std::chrono::microseconds(200);  // progress back-off before sleeping
  std::chrono::nanoseconds net_retry_after = std::chrono::seconds(1);  // a server that could not be reached: not tried again before
  std::chrono::nanoseconds net_connect_timeout = std::chrono::seconds(5);  // one connection attempt's wait for the server's welcome
  int serve_workers = 1;                // UCX workers (progress threads) of `ferry serve`
  int serve_max_connections = 1024;     // connections a server keeps at once
  int serve_max_unauthenticated = 1024;  // connections at the door (4 KiB and a descriptor each)
  std::chrono::nanoseconds serve_handshake_timeout = std::chrono::seconds(5);  // hello..welcome
  std::chrono::nanoseconds serve_idle_timeout = std::chrono::minutes(10);      // no request for this long: closed
  int serve_auth_failures = 3;          // failed authentications per connection before it is closed
  int serve_auth_rate = 20;  // secret proofs `ferry serve` checks per second, all connections together
  int net_lanes = 4;                    // connections (each its own worker) per ferry:// client
  // http://, https:// sources
  std::uint64_t http_piece = 8ull << 20;   // bytes per range request
  int http_connections = 16;               // pieces under way at once (each its connection)
  int http_threads = 0;                    // libcurl threads (0: default_http_threads())
  int http_retries = 5;                    // attempts after the first, for a piece that failed on the way
  std::string http_ca_file;                // certificates to trust for https (empty: the system's)
  bool net_map = true;                  // lend/map a shared-memory landing region when on the same host
  rma_use net_rma = rma_use::automatic;
  // vm
  std::uint64_t vm_capacity = 0;              // device bytes a unified address space may use (0: free minus reserve)
  std::uint64_t vm_reserve = 1ull << 30;      // left free on the device when vm_capacity is 0
  std::uint64_t vm_keep = 0;                 // a block pool's kept whole-page blocks, at most (0: a quarter of the device capacity)
  std::uint64_t vm_page = 32ull << 20;        // unified-memory page (0: the device granularity)
  page_replacement vm_policy = page_replacement::lru;
  int vm_batch = 16;                          // pages per batched migration
  int vm_fault_ahead = 8;                     // pages a CPU fault moves to host (the faulting one and the next)
  std::chrono::nanoseconds vm_thrash_lapse = std::chrono::seconds(1);  // evicted, prefetched back within: thrashing (0: off)
  std::chrono::nanoseconds vm_thrash_hold = std::chrono::seconds(1);   // a thrashing page stays on the host this long
  // gpu
  std::uint32_t gpu_ring_slots = 1024;  // request slots per GPU request ring (a power of two)
  std::uint32_t gpu_proxy_batch = 256;  // requests a GPU proxy takes from its ring and serves as one batch
  std::uint32_t gpu_proxy_rings = 2;    // request rings of a GPU proxy, each drained by a thread of its own
  std::uint64_t gpu_cache_bytes = 1ull << 30;  // a GPU page cache's frames
  std::uint32_t gpu_cache_page = 64 << 10;     // a GPU page cache's page (a power of two, 4 KiB to 2 MiB)
  std::uint64_t gpu_cache_landing = 64ull << 20;  // pinned host memory a GPU page cache's pages pass through
  // Pages the CPU took from a device go back: before kernel launches, and after this quiet time (0: only at launches).
  bool vm_return_at_launch = true;
  std::chrono::nanoseconds vm_return_quiet = std::chrono::milliseconds(200);
  std::chrono::nanoseconds vm_return_hold = std::chrono::seconds(1);  // a page the CPU takes back this soon stays (doubling)
  bool vm_report = false;                     // each unified address space prints where its time went when it ends

  // Looks a variable up by name ("FERRY_LOG"); std::nullopt when unset.
  using lookup_fn = std::function<std::optional<std::string>(std::string_view)>;

  // Defaults only.
  static settings defaults();
  // Defaults, then the file named by FERRY_CONFIG (if set), then the process environment.
  // Throws invalid_argument naming the variable, its value and where it came from.
  static settings from_env();
  // As from_env, with the environment given by `env` (tests use this).
  static settings load(const lookup_fn& env);
  // Applies one "FERRY_NAME" = "value" pair; throws like load(). `origin` names where it came from.
  void set(std::string_view name, std::string_view value, std::string_view origin = "override");

  struct row {
    std::string name;           // FERRY_...
    std::string value;          // current value, printed the way it is parsed
    std::string default_value;  // default, likewise
    std::string doc;
  };
  // All tunables with this snapshot's values, in table order.
  std::vector<row> describe() const;
  // Names of all tunables, in table order.
  static std::vector<std::string_view> names();
};

}  // namespace ferry
