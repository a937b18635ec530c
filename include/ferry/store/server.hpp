#pragma once
// The storage server (`ferry serve`): files under an exported root, read and written over UCX by
// store::client (ferry/store/client.hpp). Clients knock at its door (a TCP port of its own, where
// they authenticate); its workers then connect to the client's lanes. Small reads are answered from
// a worker's progress thread in one message; larger reads and all writes are requests of the file
// engine. Same-host clients lend memory the server reads files straight into.
// docs/design/storage-service.md has the decisions.
#include <ferry/core/export.hpp>
#include <ferry/net/protocol.hpp>
#include <ferry/store/settings.hpp>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace ferry {
class file_engine;
}  // namespace ferry

namespace ferry::store {

// Tunables take their defaults from the settings table (docs/settings.md); server_options_from()
// fills them from a settings snapshot.
struct server_options {
  std::string root;
  std::string host = "127.0.0.1";
  std::uint16_t port = 0;  // the door's TCP port; 0: any free port (see server::port)
  std::uint32_t max_outstanding = 64;  // per connection (credits)
  std::uint64_t max_request = 1ull << 30;
  std::uint64_t chunk = 4ull << 20;    // bytes per data message (larger client data messages are refused)
  int workers = store_settings{}.serve_workers;  // UCX workers (progress threads); clients spread their lanes over them
  bool map = store_settings{}.net_map;           // serve regions lent by same-host clients directly
  // Open files on a local file system for reading for same-host clients that ask on the lending
  // socket (needs `map`) and pass them the descriptor (FERRY_SERVE_LEND_FILES).
  bool files = store_settings{}.serve_lend_files;
  std::uint64_t inline_max = 16 << 10; // reads up to this size are answered inline, in one message
  std::uint64_t max_write_buffer = 1ull << 30;  // write data buffered at once, all connections together
  std::uint64_t max_write_hint = 1ull << 40;    // the largest size an open write is given up front (sparse)
  std::chrono::nanoseconds spin = store_settings{}.net_spin;  // progress back-off
  std::chrono::nanoseconds fd_cache_ttl = std::chrono::seconds(1);  // open files reused at most this long
  // Connection limits (FERRY_SERVE_*): every resource a client can hold is bounded, and clients
  // that never complete their handshake cannot lock out one that does.
  int max_connections = store_settings{}.serve_max_connections;
  int max_unauthenticated = store_settings{}.serve_max_unauthenticated;
  std::chrono::nanoseconds handshake_timeout = store_settings{}.serve_handshake_timeout;
  std::chrono::nanoseconds idle_timeout = store_settings{}.serve_idle_timeout;
  int auth_failures = store_settings{}.serve_auth_failures;  // per connection, then it is closed
  int auth_rate = store_settings{}.serve_auth_rate;            // proofs checked per second, server-wide
  // Shared secret: when set, clients must answer a challenge with HMAC-SHA256(secret, server nonce |
  // client nonce) before any request. Empty: no authentication.
  std::string secret;
  // Accept writes. Refused without a secret unless `insecure` says that anyone may write.
  bool writable = false;
  bool insecure = false;
};
// Server options from settings (threads, workers, map, spin, connection limits); root, address and
// secret are the caller's.
FERRY_API server_options server_options_from(const store_settings& s);

struct server_stats {
  std::uint64_t connections = 0, requests = 0, reads = 0, writes = 0, bytes_sent = 0, bytes_received = 0, errors = 0;
  std::uint64_t inline_replies = 0;  // small reads answered in one message
  std::uint64_t mapped_reads = 0;    // of those, read from the file's mapping (no system call)
  std::uint64_t live_sessions = 0;   // connections not yet gone
  std::uint64_t write_buffered = 0;  // write bytes held now (bounded by max_write_buffer)
  std::uint64_t direct_reads = 0, direct_writes = 0;  // served straight into/out of a client's mapped region
  std::uint64_t mapped_sessions = 0;  // connections whose lent region is mapped here
  std::uint64_t rma_puts = 0, rma_gets = 0;  // requests served by RMA into / out of registered client memory
  std::vector<std::uint64_t> worker_connections;  // connections (lanes) each worker took, the first worker first
  std::vector<std::uint64_t> worker_requests;     // requests each worker's progress thread handled, likewise
  std::uint64_t unauthenticated = 0;   // connections at the door, in their handshake now
  std::uint64_t refused = 0;           // lanes refused (the server at FERRY_SERVE_MAX_CONNECTIONS)
  std::uint64_t closed_handshake = 0;  // door connections closed at the handshake deadline or displaced by newer ones
  std::uint64_t closed_idle = 0;       // closed after the idle timeout
  std::uint64_t auth_failures = 0;     // failed authentications
  std::uint64_t open_writes = 0;       // writes opened and not yet committed or aborted
  std::uint64_t commits = 0;           // writes put in place
  std::uint64_t notify_records = 0;    // small direct reads answered with their notify record written
  std::uint64_t files_lent = 0;        // read-only descriptors passed to same-host clients (FERRY_SERVE_LEND_FILES)
};

class FERRY_API server {
 public:
  // File data moves through `io` (its threads, its staging pool), which must outlive the server.
  // Throws permission_denied for a writable server without a secret (unless insecure), and the root's errors.
  server(file_engine& io, server_options o);
  ~server();  // stops: refuses new work, closes connections; waits for the file requests in flight
  // Refuses new clients and requests, then waits up to `wait` for the file requests in flight.
  // Returns how many are still in the file system: nonzero only where it does not answer (a hung
  // mount), whose requests cannot be abandoned while the kernel may still write into their
  // buffers -- the destructor would wait for them, a process that must go can only exit.
  std::size_t stop(std::chrono::nanoseconds wait);
  server(const server&) = delete;
  server& operator=(const server&) = delete;
  std::uint16_t port() const noexcept;  // the door's TCP port, the one clients are given
  server_stats stats() const;
  struct impl;

 private:
  std::unique_ptr<impl> impl_;
};

}  // namespace ferry::store
