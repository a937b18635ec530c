#include "store/door.hpp"

#include "core/logging.hpp"
#include "store/auth.hpp"

#include <ferry/core/error.hpp>

#include <fmt/format.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <deque>
#include <mutex>
#include <unordered_map>

namespace ferry::store::detail {

namespace {

// What one connection may have sent and not yet been answered: a hello or an answer fits many
// times over. A frame that claims more closes the connection; nothing a stranger sends is held
// beyond this.
constexpr std::size_t door_buffer = 4096;

struct addr {
  sockaddr_storage ss{};
  socklen_t len = 0;
};

addr resolve(const std::string& host, std::uint16_t port, bool passive, std::string_view op) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0 || !res)
    fail(errc::invalid_argument, std::string(op), fmt::format("{}:{}", host, port), std::string("cannot resolve the host: ") + ::gai_strerror(rc));
  addr a;
  std::memcpy(&a.ss, res->ai_addr, res->ai_addrlen);
  a.len = res->ai_addrlen;
  ::freeaddrinfo(res);
  return a;
}

std::string host_of(const sockaddr_storage& ss) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET) ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&ss)->sin_addr, buf, sizeof buf);
  else if (ss.ss_family == AF_INET6) ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_addr, buf, sizeof buf);
  return buf;
}

std::string text_of(const sockaddr_storage& ss) {
  if (ss.ss_family == AF_INET) return fmt::format("{}:{}", host_of(ss), ntohs(reinterpret_cast<const sockaddr_in*>(&ss)->sin_port));
  if (ss.ss_family == AF_INET6) return fmt::format("[{}]:{}", host_of(ss), ntohs(reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_port));
  return "?";
}

int ms_until(door_clock::time_point until) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(until - door_clock::now()).count();
  return ms <= 0 ? 0 : static_cast<int>(std::min<long long>(ms, 1 << 30));
}

}  // namespace

// ---- server --------------------------------------------------------------------------------------

struct door::impl {
  enum class phase { hello, answer, judging, welcomed };
  struct conn {
    int fd = -1;
    std::uint64_t id = 0;
    std::string peer, host;  // "host:port", and the host alone
    door_clock::time_point since;
    bool spoke = false;
    phase at = phase::hello;
    int failures = 0;
    std::vector<std::uint16_t> ports;  // where its lanes listen
    std::vector<std::uint8_t> client_nonce, server_nonce;
    std::array<std::byte, door_buffer> buf;
    std::size_t have = 0;
  };
  struct wrong {
    int fd;
    std::uint64_t id;
    std::uint64_t rid;
  };

  door_limits lim;
  issue_fn issue;
  int listen_fd = -1, epoll_fd = -1, wake_fd = -1;
  std::unordered_map<int, std::unique_ptr<conn>> conns;  // door thread
  std::deque<wrong> untold;                               // door thread, arrival order
  double tokens = 0;
  door_clock::time_point refilled = door_clock::now();
  std::uint64_t next_id = 1, rng = 0x9e3779b97f4a7c15ull;
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> n_accepted{0}, n_displaced{0}, n_deadline{0}, n_failures{0}, n_welcomed{0}, n_waiting{0};
  std::thread thread;

  ~impl() {
    for (auto& [fd, c] : conns) ::close(fd);
    if (listen_fd >= 0) ::close(listen_fd);
    if (epoll_fd >= 0) ::close(epoll_fd);
    if (wake_fd >= 0) ::close(wake_fd);
  }

  void watch(int fd, std::uint32_t events, int op) {
    epoll_event ev{};
    ev.events = events;
    ev.data.fd = fd;
    ::epoll_ctl(epoll_fd, op, fd, &ev);
  }

  void close_conn(int fd) {
    auto it = conns.find(fd);
    if (it == conns.end()) return;
    ::epoll_ctl(epoll_fd, EPOLL_CTL_DEL, fd, nullptr);
    ::close(fd);
    conns.erase(it);
    n_waiting.store(conns.size());
  }

  // The connection to displace for a new one: one already welcomed (it only has to close), else the
  // oldest that answered wrongly (it does not know the secret), else one that has said nothing yet,
  // picked at random (a client that just connected and is about to speak survives a flood of silent
  // connections with good odds, whatever their order), else the oldest.
  int victim() {
    int silent = -1, failed = -1, oldest = -1;
    std::size_t n_silent = 0;
    door_clock::time_point oldest_since = door_clock::time_point::max(), failed_since = oldest_since;
    for (auto& [fd, c] : conns) {
      if (c->at == phase::welcomed) return fd;
      if (c->failures > 0) {
        if (c->since < failed_since) failed_since = c->since, failed = fd;
      } else if (!c->spoke) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        if ((rng >> 33) % ++n_silent == 0) silent = fd;
      } else if (c->since < oldest_since) {
        oldest_since = c->since;
        oldest = fd;
      }
    }
    return failed >= 0 ? failed : silent >= 0 ? silent : oldest;
  }

  void accept_all() {
    for (;;) {
      sockaddr_storage ss{};
      socklen_t len = sizeof ss;
      int fd = ::accept4(listen_fd, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if ((errno == EMFILE || errno == ENFILE) && !conns.empty()) {
          // Out of descriptors: the connection waiting longest in its handshake makes room.
          n_displaced++;
          close_conn(victim());
          continue;
        }
        return;  // EAGAIN, or nothing to free: the rest wait in the backlog
      }
      n_accepted++;
      if (conns.size() >= static_cast<std::size_t>(lim.max_waiting)) {
        n_displaced++;
        close_conn(victim());
      }
      auto c = std::make_unique<conn>();
      c->fd = fd;
      c->id = next_id++;
      c->peer = text_of(ss);
      c->host = host_of(ss);
      c->since = door_clock::now();
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      conns.emplace(fd, std::move(c));
      n_waiting.store(conns.size());
      watch(fd, EPOLLIN | EPOLLRDHUP, EPOLL_CTL_ADD);
    }
  }

  // Sends a frame whole or closes the connection: an answer is small, and a client whose socket
  // cannot take it has not read the ones before.
  bool send(conn& c, const net::message& m) {
    auto bytes = net::encode(m);
    ssize_t n = ::send(c.fd, bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n != static_cast<ssize_t>(bytes.size())) {
      close_conn(c.fd);
      return false;
    }
    return true;
  }

  void refuse(conn& c, std::uint64_t rid, errc code, const std::string& why) {
    net::error_reply e{static_cast<std::int32_t>(code), why};
    if (send(c, {rid, 0, e})) close_conn(c.fd);
  }

  void welcome(conn& c, std::uint64_t rid) {
    net::welcome w;
    try {
      w = issue(c.host, c.peer, c.ports);
    } catch (const error& e) {
      refuse(c, rid, e.code(), e.what());
      return;
    }
    if (!send(c, {rid, 0, w})) return;
    n_welcomed++;
    // The client reads its welcome and closes; what it sends meanwhile is read and dropped (closing
    // with unread data would reset the connection and could lose the welcome on its way).
    c.at = phase::welcomed;
    ::shutdown(c.fd, SHUT_WR);
  }

  void on_message(conn& c, net::message m) {
    if (auto* h = std::get_if<net::hello>(&m.b)) {
      if (h->nonce.size() != net::nonce_size) return refuse(c, m.request_id, errc::protocol_error, "a hello at the door carries a nonce");
      if (h->ports.empty() || h->ports.size() != h->lanes)
        return refuse(c, m.request_id, errc::protocol_error, "a hello at the door names one port for each lane");
      c.ports = h->ports;
      if (lim.secret.empty()) return welcome(c, m.request_id);
      c.client_nonce = h->nonce;
      c.server_nonce = random_nonce();
      send(c, {m.request_id, 0, net::challenge{c.server_nonce, true}});
      c.at = phase::answer;
      return;
    }
    if (auto* a = std::get_if<net::auth>(&m.b)) {
      if (c.at != phase::answer) return refuse(c, m.request_id, errc::protocol_error, "an answer without a challenge");
      const bool ok = proof_matches(proof(lim.secret, c.server_nonce, c.client_nonce), a->mac);
      c.server_nonce.clear();  // one answer per challenge
      if (ok) return welcome(c, m.request_id);
      // Wrong: told in its turn, at the server-wide rate; the connection is not read meanwhile (its
      // deadline still runs), so it cannot guess again before it is told.
      // Logged for the first and then every 1000th: a storm of guesses must not fill the log.
      if (n_failures++ % 1000 == 0) log::warn("store", "client {} failed to authenticate ({} failures so far)", c.peer, n_failures.load());
      ++c.failures;
      c.at = phase::judging;
      untold.push_back({c.fd, c.id, m.request_id});
      watch(c.fd, EPOLLRDHUP, EPOLL_CTL_MOD);
      return;
    }
    refuse(c, m.request_id, errc::protocol_error, "only a hello and an answer to the challenge come before the welcome");
  }

  void readable(int fd) {
    auto it = conns.find(fd);
    if (it == conns.end()) return;
    conn& c = *it->second;
    if (c.at == phase::welcomed) {
      std::array<std::byte, 512> sink;
      ssize_t n = ::recv(fd, sink.data(), sink.size(), 0);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) close_conn(fd);
      return;
    }
    ssize_t n = ::recv(fd, c.buf.data() + c.have, c.buf.size() - c.have, 0);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return close_conn(fd);
    if (n < 0) return;
    c.spoke = true;
    c.have += static_cast<std::size_t>(n);
    while (c.have >= net::header_size && c.at != phase::judging && c.at != phase::welcomed) {  // one welcome per connection
      std::size_t total = 0;
      net::message m;
      try {
        auto fi = net::peek_header({c.buf.data(), net::header_size});
        total = net::header_size + fi.payload_len;
        if (total > c.buf.size())
          return refuse(c, fi.request_id, errc::protocol_error,
                        fmt::format("a frame of {} bytes before the welcome (at most {})", total, c.buf.size()));
        if (c.have < total) return;
        m = net::decode({c.buf.data(), total});
      } catch (const error& e) {
        return refuse(c, 0, errc::protocol_error, e.what());
      }
      std::memmove(c.buf.data(), c.buf.data() + total, c.have - total);
      c.have -= total;
      const int fd_before = c.fd;
      on_message(c, std::move(m));
      if (!conns.count(fd_before)) return;  // closed by its answer
    }
  }

  // Tells wrong answers they were wrong while the rate allows; one whose connection has gone loses
  // its turn without using one.
  void tell() {
    const auto now = door_clock::now();
    const double rate = std::max(1, lim.auth_rate);
    tokens = std::min(rate, tokens + rate * std::chrono::duration<double>(now - refilled).count());
    refilled = now;
    while (!untold.empty()) {
      auto w = untold.front();
      auto it = conns.find(w.fd);
      if (it == conns.end() || it->second->id != w.id) {
        untold.pop_front();
        continue;
      }
      if (tokens < 1) return;
      tokens -= 1;
      untold.pop_front();
      conn& c = *it->second;
      const std::string why = "authentication failed (wrong secret?)";
      if (c.failures >= lim.auth_failures) {
        refuse(c, w.rid, errc::permission_denied, why);
        continue;
      }
      if (!send(c, {w.rid, 0, net::error_reply{static_cast<std::int32_t>(errc::permission_denied), why}})) continue;
      c.at = phase::hello;  // a new hello gets a new challenge
      watch(c.fd, EPOLLIN | EPOLLRDHUP, EPOLL_CTL_MOD);
    }
  }

  void expire() {
    const auto now = door_clock::now();
    std::vector<int> late;
    for (auto& [fd, c] : conns)
      if (now - c->since > lim.deadline) late.push_back(fd);
    for (int fd : late) {
      n_deadline++;
      close_conn(fd);
    }
  }

  void loop() {
    std::array<epoll_event, 64> evs;
    while (!stop.load()) {
      // Wakes for the next token while wrong answers wait, else at least every 100 ms for the deadlines.
      int timeout = untold.empty() ? 100 : std::clamp(1000 / std::max(1, lim.auth_rate), 1, 100);
      int n = ::epoll_wait(epoll_fd, evs.data(), static_cast<int>(evs.size()), timeout);
      for (int i = 0; i < n; ++i) {
        int fd = evs[i].data.fd;
        if (fd == wake_fd) {
          std::uint64_t v;
          [[maybe_unused]] auto r = ::read(wake_fd, &v, sizeof v);
        } else if (fd == listen_fd) {
          accept_all();
        } else if (evs[i].events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) {
          if ((evs[i].events & (EPOLLIN | EPOLLRDHUP)) == EPOLLRDHUP || (evs[i].events & (EPOLLHUP | EPOLLERR)))
            close_conn(fd);  // gone (a judging connection is not read: its close is how it is seen)
          else
            readable(fd);
        }
      }
      tell();
      expire();
    }
  }
};

door::door(const std::string& host, std::uint16_t port, door_limits limits, issue_fn issue) : impl_(std::make_unique<impl>()) {
  auto& d = *impl_;
  d.lim = std::move(limits);
  d.issue = std::move(issue);
  const std::string where = fmt::format("{}:{}", host, port);
  addr a = resolve(host, port, true, "store.serve");
  d.listen_fd = ::socket(a.ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (d.listen_fd < 0) fail_errno(errno, "store.serve", where, "socket");
  int one = 1;
  // A restarted server gets its port back while the old connections sit in TIME_WAIT.
  ::setsockopt(d.listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(d.listen_fd, reinterpret_cast<const sockaddr*>(&a.ss), a.len) != 0) fail_errno(errno, "store.serve", where, "cannot listen");
  if (::listen(d.listen_fd, 1024) != 0) fail_errno(errno, "store.serve", where, "listen");
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  ::getsockname(d.listen_fd, reinterpret_cast<sockaddr*>(&bound), &len);
  port_ = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                      : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  d.epoll_fd = ::epoll_create1(EPOLL_CLOEXEC);
  d.wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (d.epoll_fd < 0 || d.wake_fd < 0) fail_errno(errno, "store.serve", where, "epoll/eventfd");
  d.watch(d.listen_fd, EPOLLIN, EPOLL_CTL_ADD);
  d.watch(d.wake_fd, EPOLLIN, EPOLL_CTL_ADD);
  // Dedicated, not the executor's: strangers' connections are taken here, apart from any work they could stall.
  d.thread = std::thread([&d] { d.loop(); });
}

door::~door() {
  impl_->stop = true;
  std::uint64_t one = 1;
  [[maybe_unused]] auto r = ::write(impl_->wake_fd, &one, sizeof one);
  impl_->thread.join();
}

door_counts door::counts() const {
  auto& d = *impl_;
  return {d.n_accepted.load(), d.n_displaced.load(), d.n_deadline.load(), d.n_failures.load(), d.n_welcomed.load(),
          d.n_waiting.load()};
}

// ---- client --------------------------------------------------------------------------------------

namespace {

struct socket_fd {
  int fd = -1;
  ~socket_fd() {
    if (fd >= 0) ::close(fd);
  }
};

[[noreturn]] void unreachable(const std::string& where, int e, const std::string& what) {
  throw error(error_info{errc::network_error, "store.connect", where, "cannot connect to the storage server", what, e, 0});
}

void wait_for(int fd, short events, door_clock::time_point until, const std::string& where) {
  for (;;) {
    pollfd p{fd, events, 0};
    int n = ::poll(&p, 1, knock_waiting ? std::min(ms_until(until), 1) : ms_until(until));
    if (n > 0) return;
    if (n == 0 && knock_waiting && door_clock::now() < until) {
      knock_waiting();
      continue;
    }
    if (n == 0) fail(errc::timeout, "store.connect", where, "no answer from the server's door before the deadline");
    if (errno != EINTR) unreachable(where, errno, "poll");
  }
}

void send_all(int fd, const std::vector<std::byte>& b, door_clock::time_point until, const std::string& where) {
  std::size_t off = 0;
  while (off < b.size()) {
    ssize_t n = ::send(fd, b.data() + off, b.size() - off, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      off += static_cast<std::size_t>(n);
    } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      wait_for(fd, POLLOUT, until, where);
    } else {
      unreachable(where, errno, "the server closed the connection during the handshake");
    }
  }
}

void recv_all(int fd, std::byte* p, std::size_t len, door_clock::time_point until, const std::string& where) {
  std::size_t off = 0;
  while (off < len) {
    ssize_t n = ::recv(fd, p + off, len - off, MSG_DONTWAIT);
    if (n > 0) {
      off += static_cast<std::size_t>(n);
    } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      wait_for(fd, POLLIN, until, where);
    } else {
      // A server flooded by connections in their handshake displaces some: the caller may try again.
      unreachable(where, n == 0 ? 0 : errno, "the server closed the connection during the handshake");
    }
  }
}

net::message read_frame(int fd, door_clock::time_point until, const std::string& where) {
  std::vector<std::byte> b(net::header_size);
  recv_all(fd, b.data(), b.size(), until, where);
  auto fi = net::peek_header(b);
  if (fi.payload_len > net::max_message) fail(errc::protocol_error, "store.connect", where, "an answer larger than any the server sends");
  b.resize(net::header_size + fi.payload_len);
  recv_all(fd, b.data() + net::header_size, fi.payload_len, until, where);
  return net::decode(b);
}

}  // namespace

std::string local_address(const std::string& host, std::uint16_t port) {
  const std::string where = fmt::format("{}:{}", host, port);
  addr a = resolve(host, port, false, "store.connect");
  socket_fd s;
  s.fd = ::socket(a.ss.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (s.fd < 0 || ::connect(s.fd, reinterpret_cast<const sockaddr*>(&a.ss), a.len) != 0)
    unreachable(where, errno, "no local address routes to the server");
  sockaddr_storage me{};
  socklen_t len = sizeof me;
  ::getsockname(s.fd, reinterpret_cast<sockaddr*>(&me), &len);
  return host_of(me);
}

net::welcome knock(const std::string& host, std::uint16_t port, const std::string& secret,
                   const std::function<std::vector<std::uint16_t>()>& listen_lanes, door_clock::time_point until) {
  const std::string where = fmt::format("{}:{}", host, port);
  addr a = resolve(host, port, false, "store.connect");
  socket_fd s;
  s.fd = ::socket(a.ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (s.fd < 0) unreachable(where, errno, "socket");
  int one = 1;
  ::setsockopt(s.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (::connect(s.fd, reinterpret_cast<const sockaddr*>(&a.ss), a.len) != 0) {
    if (errno != EINPROGRESS) unreachable(where, errno, std::strerror(errno));
    wait_for(s.fd, POLLOUT, until, where);
    int err = 0;
    socklen_t len = sizeof err;
    ::getsockopt(s.fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) unreachable(where, err, std::strerror(err));
  }
  const std::vector<std::uint16_t> lane_ports = listen_lanes();
  auto nonce = random_nonce();
  net::hello h{1, 1, 64, nonce, static_cast<std::uint16_t>(lane_ports.size()), {}, lane_ports};
  send_all(s.fd, net::encode({1, 0, h}), until, where);
  net::message r = read_frame(s.fd, until, where);
  if (auto* ch = std::get_if<net::challenge>(&r.b)) {
    if (secret.empty()) fail(errc::permission_denied, "store.connect", where, "the server requires a shared secret (FERRY_SECRET_FILE)");
    send_all(s.fd, net::encode({2, 0, net::auth{proof(secret, ch->nonce, nonce)}}), until, where);
    r = read_frame(s.fd, until, where);
    if (auto* e = std::get_if<net::error_reply>(&r.b))
      fail(errc::permission_denied, "store.connect", where, "authentication refused: " + e->message);
  }
  if (auto* e = std::get_if<net::error_reply>(&r.b)) fail(errc::network_error, "store.connect", where, "refused: " + e->message);
  auto* w = std::get_if<net::welcome>(&r.b);
  if (!w || w->ticket.size() != net::ticket_size)
    fail(errc::protocol_error, "store.connect", where, "unexpected answer to the handshake (not a ferry server of this version?)");
  return std::move(*w);
}

thread_local std::function<void()> knock_waiting;

}  // namespace ferry::store::detail
