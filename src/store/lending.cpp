#include "store/lending.hpp"

#include <ferry/core/error.hpp>

#include "core/backoff.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <utility>

namespace ferry::store::detail {

namespace {
constexpr std::size_t token_bytes = 16;
// What a client sends: the session's token, then the region's id; the descriptor rides along.
struct wire_message {
  std::uint8_t token[token_bytes];
  std::uint64_t id;
};
// Connections accepted but not yet answered: bounded, each for a short time (a client sends its
// message right after connecting; one that does not is closed).
constexpr std::size_t max_pending = 64;
constexpr std::chrono::seconds pending_time{2};

sockaddr_un abstract_address(const std::string& name, socklen_t& len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::memcpy(a.sun_path + 1, name.data(), std::min(name.size(), sizeof a.sun_path - 1));
  len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return a;
}
int ms_until(lending_clock::time_point until) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(until - lending_clock::now()).count();
  return ms <= 0 ? 0 : static_cast<int>(std::min<long long>(ms, 1 << 30));
}
}  // namespace

// ---- client ------------------------------------------------------------------------------------

shared_region::shared_region(std::size_t bytes, bool resident) : size_(bytes) {
  static std::atomic<std::uint64_t> next{1};
  id_ = next++;
  fd_ = ::memfd_create("ferry-lent", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd_ < 0) fail_errno(errno, "store.region", fmt::format("{} bytes", bytes), "memfd_create");
  if (::ftruncate(fd_, static_cast<off_t>(bytes)) != 0 ||
      ::fcntl(fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    int e = errno;
    ::close(fd_);
    fail_errno(e, "store.region", fmt::format("{} bytes", bytes), "sizing and sealing the shared region");
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | (resident ? MAP_POPULATE : 0), fd_, 0);
  if (p == MAP_FAILED) {
    int e = errno;
    ::close(fd_);
    fail_errno(e, "store.region", fmt::format("{} bytes", bytes), "mapping the shared region");
  }
  base_ = static_cast<std::byte*>(p);
}

shared_region::~shared_region() {
  if (base_) ::munmap(base_, size_);
  if (fd_ >= 0) ::close(fd_);
}

namespace {
struct closer {
  int fd;
  ~closer() {
    if (fd >= 0) ::close(fd);
  }
};

// A connection to the server's lending socket (-1, with the reason in `why`, when there is none).
int connect_lending(const std::string& socket_name, std::span<const std::uint8_t> token, lending_clock::time_point until,
                    std::string& why) {
  if (socket_name.empty() || token.size() != token_bytes) {
    why = "the server offers no lending socket";
    return -1;
  }
  // Non-blocking: a full backlog (another process flooding the socket) makes connect fail with
  // EAGAIN rather than wait; it is tried again until the deadline.
  int s = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (s < 0) {
    why = fmt::format("socket: {}", std::strerror(errno));
    return -1;
  }
  closer c{s};
  socklen_t len = 0;
  auto a = abstract_address(socket_name, len);
  ferry::detail::backoff busy({.nap = std::chrono::milliseconds(1), .most = std::chrono::milliseconds(1)});
  while (::connect(s, reinterpret_cast<sockaddr*>(&a), len) != 0) {
    if (errno == EAGAIN && lending_clock::now() < until) {  // its backlog is full: the server takes it soon
      busy.pause();
      continue;
    }
    why = errno == EAGAIN ? std::string("the server's lending socket stayed busy until the deadline")
                          : fmt::format("cannot reach the server's lending socket ({}): not on this host, or in another network namespace",
                                        std::strerror(errno));
    return -1;
  }
  c.fd = -1;
  return s;
}

// Control space for one descriptor, and `h` carrying `fd` in it (SCM_RIGHTS).
using one_fd_space = char[CMSG_SPACE(sizeof(int))];
void attach_fd(msghdr& h, one_fd_space& ctl, int fd) {
  h.msg_control = ctl;
  h.msg_controllen = sizeof ctl;
  cmsghdr* cm = CMSG_FIRSTHDR(&h);
  cm->cmsg_level = SOL_SOCKET;
  cm->cmsg_type = SCM_RIGHTS;
  cm->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(cm), &fd, sizeof fd);
}

// The descriptors a received message `h` brought (the caller's to close).
std::vector<int> received_fds(msghdr& h) {
  std::vector<int> got;
  for (cmsghdr* cm = CMSG_FIRSTHDR(&h); cm; cm = CMSG_NXTHDR(&h, cm))
    if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS)
      for (std::size_t k = 0; k < (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int); ++k) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(cm) + k * sizeof(int), sizeof fd);
        got.push_back(fd);
      }
  return got;
}

// Sends `h` on the non-blocking socket `s` by the deadline.
bool send_by(int s, const msghdr& h, std::size_t bytes, lending_clock::time_point until, std::string& why) {
  for (;;) {
    if (::sendmsg(s, &h, MSG_NOSIGNAL) == static_cast<ssize_t>(bytes)) return true;
    pollfd w{s, POLLOUT, 0};
    if (errno != EAGAIN || ::poll(&w, 1, ms_until(until)) != 1) {
      why = errno == EAGAIN ? std::string("the lending socket took no message before the deadline")
                            : fmt::format("sendmsg to the lending socket: {}", std::strerror(errno));
      return false;
    }
  }
}
}  // namespace

bool pass_region(const std::string& socket_name, std::span<const std::uint8_t> token, int fd, std::uint64_t id,
                 lending_clock::time_point until, std::string& why) {
  int s = connect_lending(socket_name, token, until, why);
  if (s < 0) return false;
  closer c{s};
  wire_message m{};
  std::memcpy(m.token, token.data(), token_bytes);
  m.id = id;
  iovec iov{&m, sizeof m};
  alignas(cmsghdr) one_fd_space ctl = {};
  msghdr h{};
  h.msg_iov = &iov;
  h.msg_iovlen = 1;
  attach_fd(h, ctl, fd);
  if (!send_by(s, h, sizeof m, until, why)) return false;
  pollfd p{s, POLLIN, 0};
  std::uint8_t answer = 0;
  int n = ::poll(&p, 1, ms_until(until));
  if (n != 1 || ::recv(s, &answer, 1, 0) != 1) {
    why = n == 0 ? "no answer from the lending socket before the deadline" : "the lending socket closed without an answer";
    return false;
  }
  if (answer != 1) why = "the server refused the region";
  return answer == 1;
}

int ask_file(const std::string& socket_name, std::span<const std::uint8_t> token, const std::string& path,
             lending_clock::time_point until, std::string& why, bool* none) {
  if (none) *none = false;
  if (path.empty() || path.size() > max_asked_path) {
    why = fmt::format("a path of {} bytes cannot be asked for", path.size());
    return -1;
  }
  int s = connect_lending(socket_name, token, until, why);
  if (s < 0) {
    if (none) *none = true;
    return -1;
  }
  closer c{s};
  wire_message m{};  // id 0: no region, a file
  std::memcpy(m.token, token.data(), token_bytes);
  iovec iov[2] = {{&m, sizeof m}, {const_cast<char*>(path.data()), path.size()}};
  msghdr h{};
  h.msg_iov = iov;
  h.msg_iovlen = 2;
  if (!send_by(s, h, sizeof m + path.size(), until, why)) return -1;
  pollfd p{s, POLLIN, 0};
  if (::poll(&p, 1, ms_until(until)) != 1) {
    why = "no answer from the lending socket before the deadline";
    return -1;
  }
  char answer[512];
  iovec riov{answer, sizeof answer};
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int) * 4)] = {};
  msghdr r{};
  r.msg_iov = &riov;
  r.msg_iovlen = 1;
  r.msg_control = ctl;
  r.msg_controllen = sizeof ctl;
  ssize_t n = ::recvmsg(s, &r, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  std::vector<int> got = n >= 0 ? received_fds(r) : std::vector<int>{};
  if (n >= 1 && answer[0] == 1 && got.size() == 1) return got[0];
  for (int fd : got) ::close(fd);
  if (none && n >= 1 && answer[0] == 2) *none = true;
  if (n < 1) why = "the lending socket closed without an answer";
  else if (answer[0] == 0 && n > 1) why = std::string(answer + 1, static_cast<std::size_t>(n - 1));
  else if (answer[0] == 2) why = "the server lends no files (FERRY_SERVE_LEND_FILES off)";
  else why = "the server's answer carried no descriptor";
  return -1;
}

// ---- server ------------------------------------------------------------------------------------

lending_socket::lending_socket(std::uint64_t instance, deposit_fn deposit, open_fn open)
    : deposit_(std::move(deposit)), open_(std::move(open)) {
  name_ = fmt::format("ferry-serve-{:016x}-{}", instance, ::getpid());
  listen_fd_ = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (listen_fd_ < 0) fail_errno(errno, "store.serve", "@" + name_, "lending socket");
  socklen_t len = 0;
  auto a = abstract_address(name_, len);
  if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), len) != 0 || ::listen(listen_fd_, 64) != 0) {
    int e = errno;
    ::close(listen_fd_);
    fail_errno(e, "store.serve", "@" + name_, "binding the lending socket");
  }
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) {
    int e = errno;
    ::close(listen_fd_);
    fail_errno(e, "store.serve", "@" + name_, "eventfd");
  }
}

lending_socket::~lending_socket() {
  for (auto& p : pending_) ::close(p.fd);
  ::close(listen_fd_);
  ::close(wake_fd_);
}

void lending_socket::wake() {
  std::uint64_t one = 1;
  [[maybe_unused]] auto r = ::write(wake_fd_, &one, sizeof one);
}

void lending_socket::serve(std::chrono::milliseconds timeout) {
  std::vector<pollfd> fds{{wake_fd_, POLLIN, 0}, {listen_fd_, POLLIN, 0}};
  for (auto& p : pending_) fds.push_back({p.fd, POLLIN, 0});
  auto until = lending_clock::now() + timeout;
  for (auto& p : pending_) until = std::min(until, p.until);
  if (::poll(fds.data(), fds.size(), ms_until(until)) < 0) return;
  if (fds[0].revents) {
    std::uint64_t v;
    [[maybe_unused]] auto r = ::read(wake_fd_, &v, sizeof v);
  }
  // Messages on connections already accepted (same order as `fds` from index 2).
  for (std::size_t i = 0; i < pending_.size(); ++i)
    if (fds[2 + i].revents) receive(pending_[i]);
  auto now = lending_clock::now();
  std::erase_if(pending_, [&](pending& p) {
    if (p.fd >= 0 && p.until > now) return false;
    if (p.fd >= 0) ::close(p.fd);
    return true;
  });
  if (fds[1].revents & POLLIN) {
    for (;;) {
      int c = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (c < 0) break;
      if (pending_.size() >= max_pending) {  // the oldest gives way: silent connections cannot shut clients out
        ::close(pending_.front().fd);
        pending_.erase(pending_.begin());
      }
      pending_.push_back({c, now + pending_time});
      receive(pending_.back());  // usually there already
      if (pending_.back().fd < 0) pending_.pop_back();
    }
  }
}

// One message -- a region with one descriptor, or a file asked for -- handled, answered, and the
// connection closed (fd = -1). Not there yet: left pending.
void lending_socket::receive(pending& p) {
  wire_message m{};
  char path[max_asked_path + 1];
  iovec iov[2] = {{&m, sizeof m}, {path, sizeof path}};
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int) * 4)] = {};
  msghdr h{};
  h.msg_iov = iov;
  h.msg_iovlen = 2;
  h.msg_control = ctl;
  h.msg_controllen = sizeof ctl;
  ssize_t n = ::recvmsg(p.fd, &h, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
  // Every descriptor that came along is ours to close, whatever else is wrong with the message.
  std::vector<int> got = received_fds(h);
  const bool whole = n >= static_cast<ssize_t>(sizeof m) && !(h.msg_flags & (MSG_TRUNC | MSG_CTRUNC));
  if (whole && got.empty() && m.id == 0 && n > static_cast<ssize_t>(sizeof m) && n <= static_cast<ssize_t>(sizeof m + max_asked_path)) {
    ucred peer{};
    socklen_t len = sizeof peer;
    const std::int64_t uid = ::getsockopt(p.fd, SOL_SOCKET, SO_PEERCRED, &peer, &len) == 0 ? std::int64_t{peer.uid} : -1;
    answer_ask(std::exchange(p.fd, -1), std::span<const std::uint8_t>(m.token, token_bytes),
               std::string(path, static_cast<std::size_t>(n) - sizeof m), uid);
    return;
  }
  bool ok = false;
  if (whole && n == static_cast<ssize_t>(sizeof m) && got.size() == 1 && m.id != 0) {
    ucred peer{};
    socklen_t len = sizeof peer;
    std::int64_t pid = ::getsockopt(p.fd, SOL_SOCKET, SO_PEERCRED, &peer, &len) == 0 ? peer.pid : 0;
    ok = deposit_(std::span<const std::uint8_t>(m.token, token_bytes), m.id, got[0], pid);
    got.clear();  // deposit_ owns it now
  }
  for (int fd : got) ::close(fd);
  std::uint8_t answer = ok ? 1 : 0;
  [[maybe_unused]] auto r = ::send(p.fd, &answer, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
  ::close(p.fd);
  p.fd = -1;
}

// A file asked for: its descriptor with a byte 1, or a byte 0 and why not, sent on connection `s`
// (owned here, closed once answered) by whichever thread answers. The socket is fresh and the answer
// small: a send that would block (it cannot here) just fails, and the client's wait ends at its
// deadline.
void lending_socket::answer_ask(int s, std::span<const std::uint8_t> token, std::string path, std::int64_t uid) {
  std::shared_ptr<closer> conn(new closer{s});
  // Code 1 with the descriptor, 0 and why not, 2: this server lends no file.
  auto send_answer = [conn](char code, int fd, const std::string& why) {
    std::string reply(1, code);
    reply += why.substr(0, 500);
    iovec iov{reply.data(), reply.size()};
    alignas(cmsghdr) one_fd_space ctl = {};
    msghdr h{};
    h.msg_iov = &iov;
    h.msg_iovlen = 1;
    if (fd >= 0) attach_fd(h, ctl, fd);
    [[maybe_unused]] auto r = ::sendmsg(conn->fd, &h, MSG_DONTWAIT | MSG_NOSIGNAL);
  };
  if (!open_) return send_answer(2, -1, "");
  answer_fn answer = [send_answer](int fd, const std::string& why) {
    closer c{fd};
    send_answer(fd >= 0 ? 1 : 0, fd, fd >= 0 ? std::string() : why);
  };
  try {
    open_(token, path, uid, answer);
  } catch (const std::exception& e) {
    answer(-1, e.what());
  }
}

lent_mapping::~lent_mapping() {
  if (base) ::munmap(base, len);
}

lent_region::~lent_region() {
  if (totals) totals->bytes -= len, totals->regions -= 1;
}

std::shared_ptr<lent_region> lent_maps::map(int fd, std::int64_t pid, std::uint64_t addr, std::uint64_t len, std::string& why,
                                            std::shared_ptr<lent_mapping>& fresh) {
  fresh = nullptr;
  struct ::stat st{};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    why = "the descriptor is not a regular file";
    return nullptr;
  }
  // Plain shared memory only: a hugetlbfs file (sealable too) could fault with SIGBUS here when the
  // huge page pool runs dry.
  struct ::statfs fs{};
  if (::fstatfs(fd, &fs) != 0 || fs.f_type != TMPFS_MAGIC) {
    why = "the region is not plain shared memory (a memfd)";
    return nullptr;
  }
  int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0 || !(seals & F_SEAL_SHRINK)) {
    why = "the region is not sealed against shrinking (a memfd with F_SEAL_SHRINK)";
    return nullptr;
  }
  if (len == 0 || static_cast<std::uint64_t>(st.st_size) < len) {
    why = fmt::format("the region is {} bytes, not the {} claimed", st.st_size, len);
    return nullptr;
  }
  // What the kernel checks before a writable shared mapping of this descriptor: a mapping made for
  // another descriptor of the file is shared only with one that passes them too.
  int write_seals = F_SEAL_WRITE;
#ifdef F_SEAL_FUTURE_WRITE
  write_seals |= F_SEAL_FUTURE_WRITE;
#endif
  const int mode = ::fcntl(fd, F_GETFL);
  const bool may_share = mode >= 0 && (mode & O_ACCMODE) == O_RDWR && !(seals & write_seals);
  std::shared_ptr<lent_mapping> m;
  {
    // A live mapping keeps its file, so its (device, inode) names no other file meanwhile.
    std::lock_guard l(mu_);
    std::erase_if(live_, [](const auto& x) { return x.second.expired(); });
    auto key = std::make_tuple(static_cast<std::uint64_t>(st.st_dev), static_cast<std::uint64_t>(st.st_ino), pid);
    if (auto it = live_.find(key); it != live_.end() && may_share && pid > 0) {
      m = it->second.lock();
      if (m && m->len < len) m = nullptr;  // mapped shorter: a new, longer mapping replaces it here
    }
    if (!m) {
      void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (p == MAP_FAILED) {
        why = fmt::format("mmap: {}", std::strerror(errno));
        return nullptr;
      }
      m = std::make_shared<lent_mapping>();
      m->base = static_cast<std::byte*>(p);
      m->len = len;
      // Every page of the file exists (the client made it resident): populating allocates nothing.
      m->resident = static_cast<std::uint64_t>(st.st_blocks) * 512 >= static_cast<std::uint64_t>(st.st_size);
      live_[key] = m;
      fresh = m;
    }
  }
  auto r = std::make_shared<lent_region>();
  r->map = m;
  r->base = m->base;
  r->addr = addr;
  r->len = len;
  return r;
}

bool populate_lent(lent_mapping& m, std::uint64_t bytes) {
#ifdef MADV_POPULATE_WRITE
  std::uint64_t at = m.populated;
  if (!m.resident || at >= m.len) return false;
  std::uint64_t n = std::min(bytes, m.len - at);
  // A client that punched holes into its region since it was mapped gets them filled, as its own
  // reads into them would: the region's size bounds it.
  if (::madvise(m.base + at, n, MADV_POPULATE_WRITE) != 0) {
    m.populated = m.len;  // an older kernel, or the region changed under it: pages fault in as used
    return false;
  }
  m.populated = at + n;
  return at + n < m.len;
#else
  (void)m;
  (void)bytes;
  return false;
#endif
}

}  // namespace ferry::store::detail
