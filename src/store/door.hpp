#pragma once
// The storage server's door: its well-known TCP port, a listener of ferry's own. Everything a
// stranger can send before it has authenticated arrives here and nowhere else: each connection
// gets a fixed buffer (a hello or an answer to the challenge fits; a frame that claims more closes
// it), is closed at the handshake deadline whatever it sends, and all of them together are bounded
// (one that has said nothing is displaced first). A right answer to the challenge is welcomed at
// once; a wrong one is told so in its turn, at a server-wide rate, and its connection cannot guess
// again before (nor more than a few times). An authenticated client gets a welcome with a ticket, and
// the server's workers connect to the ports its hello named (the client's lanes listen there, on the
// address it reached the door from), each connection's first frame a hello with the ticket. So the
// server is only ever a UCX connection-manager client: nothing a stranger sends is parsed by UCX in
// the server, and a client that dies while its lanes are made cannot take the server down.
#include <ferry/net/protocol.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace ferry::store::detail {

using door_clock = std::chrono::steady_clock;

struct door_limits {
  int max_waiting = 64;                          // connections in their handshake at once
  std::chrono::nanoseconds deadline{std::chrono::seconds(5)};  // from accept to the client's close
  int auth_rate = 20;                            // wrong answers told per second, all connections together
  int auth_failures = 3;                         // wrong answers on one connection, then it is closed
  std::string secret;                            // empty: no authentication
};

struct door_counts {
  std::uint64_t accepted = 0, displaced = 0, closed_deadline = 0, auth_failures = 0, welcomed = 0;
  std::uint64_t waiting = 0;  // connections in their handshake now
};

class door {
 public:
  // For a client that has authenticated: connects the server's workers to the ports its hello named
  // on `host` (the client's address, "host:port" in `peer`) and returns the welcome (ticket, instance).
  // Throws ferry::error to refuse (the client is told why). Runs on the door's thread.
  using issue_fn = std::function<net::welcome(const std::string& host, const std::string& peer,
                                              const std::vector<std::uint16_t>& ports)>;
  // Listens on host:port (port 0: any). Throws ferry::error (errno kept) when it cannot.
  door(const std::string& host, std::uint16_t port, door_limits limits, issue_fn issue);
  ~door();
  door(const door&) = delete;
  door& operator=(const door&) = delete;
  std::uint16_t port() const { return port_; }
  door_counts counts() const;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
  std::uint16_t port_ = 0;
};

// The client's side: connects to host:port, says hello (the ports its lanes listen on, at
// `local_address` below), answers the challenge with `secret` if the server sends one, and returns the
// server's welcome (its ticket). Throws network_error (unreachable, closed before its answer: a flooded server
// displaces connections in their handshake), permission_denied (a secret needed or refused),
// timeout at `until`, protocol_error for anything else. `listen_lanes` makes the lanes' listeners and
// gives their ports, once the door took the connection: a server that is gone costs the lanes nothing.
net::welcome knock(const std::string& host, std::uint16_t port, const std::string& secret,
                   const std::function<std::vector<std::uint16_t>()>& listen_lanes, door_clock::time_point until);
// Set on a thread: knock's waits look at the door every millisecond and run it in between (a lane's
// own thread reconnecting drives its worker there, or the server's connection to that lane would
// wait for it).
extern thread_local std::function<void()> knock_waiting;

// The local address (numeric) this host reaches `host` from (a UDP socket's connect: nothing is
// sent), where a client's lanes listen for the server. Throws network_error when there is none.
std::string local_address(const std::string& host, std::uint16_t port);

}  // namespace ferry::store::detail
