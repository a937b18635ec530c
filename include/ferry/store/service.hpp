#pragma once
// The storage service (`ferry serve`) and its client: files under an exported root, read over UCX
// into any memory. This increment: read-only service, handshake, read/stat/list, limits, per-request
// deadlines, peer failures reported as errors naming the peer and path.
#include <ferry/core/export.hpp>
#include <ferry/core/settings.hpp>
#include <ferry/net/protocol.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace ferry::store {

struct server_options {
  std::string root;
  std::string host = "127.0.0.1";
  std::uint16_t port = 0;  // 0: any free port (see server::port)
  std::uint32_t max_outstanding = 64;  // per connection (credits)
  std::uint64_t max_request = 1ull << 30;
  std::uint64_t chunk = 4ull << 20;    // bytes per data message
  int threads = 4;                     // file I/O threads
  // Shared secret: when set, clients must answer a challenge with HMAC-SHA256(secret, server nonce |
  // client nonce) before any request. Empty: no authentication.
  std::string secret;
};

struct server_stats {
  std::uint64_t connections = 0, requests = 0, bytes_sent = 0, errors = 0;
  std::uint64_t live_sessions = 0;  // connections not yet gone
};

class FERRY_API server {
 public:
  explicit server(server_options o);
  ~server();  // stops: refuses new work, closes connections
  server(const server&) = delete;
  server& operator=(const server&) = delete;
  std::uint16_t port() const noexcept;
  server_stats stats() const;
  struct impl;

 private:
  std::unique_ptr<impl> impl_;
};

// Reads a secret file (contents, without a trailing newline); throws naming the path when missing or empty.
FERRY_API std::string read_secret_file(const std::string& path);

class FERRY_API client {
 public:
  // Connects and completes the handshake before `timeout`; throws network_error naming the peer.
  // `secret`: the shared secret, when the server requires one (permission_denied otherwise).
  client(const std::string& host, std::uint16_t port, std::chrono::nanoseconds timeout = std::chrono::seconds(30),
         std::string secret = {});
  ~client();
  client(const client&) = delete;
  client& operator=(const client&) = delete;

  // Reads [offset, offset+length) of `path` into host memory; returns the bytes read (short at EOF).
  std::uint64_t read(const std::string& path, std::uint64_t offset, void* dst, std::uint64_t length,
                     std::chrono::nanoseconds timeout = std::chrono::seconds(30));
  net::stat_reply stat(const std::string& path, std::chrono::nanoseconds timeout = std::chrono::seconds(30));
  std::vector<net::list_entry> list(const std::string& path, std::chrono::nanoseconds timeout = std::chrono::seconds(30));
  const std::string& peer() const noexcept;
  struct impl;

 private:
  std::unique_ptr<impl> impl_;
};

}  // namespace ferry::store
