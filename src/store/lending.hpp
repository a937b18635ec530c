// Memory a same-host client lends to the storage server, so that reads land in it and writes leave
// from it with no data message: the client makes a memfd, seals it against shrinking and growing,
// and passes the descriptor over the server's abstract Unix socket (SCM_RIGHTS) for one of its
// authenticated sessions; the server maps it and serves direct requests into it.
// The socket is abstract, so only processes in the server's network namespace on the same kernel
// reach it: that is "same host" here, and a client that cannot connect moves data by messages.
// Nothing a client passes is trusted: the server maps only a regular shared-memory file sealed
// against shrinking, no shorter than claimed (so its mapping can never fault past the end), and the
// descriptor alone is no capability: it must come with the token of a live session of the server.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <tuple>
#include <vector>

namespace ferry::store::detail {

using lending_clock = std::chrono::steady_clock;

// A client's region: a sealed memfd mapped shared here. Throws ferry::error (errno kept).
// `resident`: its pages are made (and mapped here) at once, not at their first write.
class shared_region {
 public:
  explicit shared_region(std::size_t bytes, bool resident = false);
  ~shared_region();
  shared_region(const shared_region&) = delete;
  shared_region& operator=(const shared_region&) = delete;
  std::byte* data() const { return base_; }
  std::size_t size() const { return size_; }
  int fd() const { return fd_; }
  std::uint64_t id() const { return id_; }  // unique in this process: names the region to the server

 private:
  int fd_ = -1;
  std::byte* base_ = nullptr;
  std::size_t size_ = 0;
  std::uint64_t id_ = 0;
};

// Passes descriptor `fd` (a shared_region's) as region `id` to the server at `socket_name` for the
// session that `token` names; true once the server holds it. False, with the reason in `why`, when
// the socket cannot be reached (another host or network namespace) or the server refused it. Waits no
// later than `until`.
bool pass_region(const std::string& socket_name, std::span<const std::uint8_t> token, int fd, std::uint64_t id,
                 lending_clock::time_point until, std::string& why);

// Asks the server at `socket_name`, for the session that `token` names, for a read-only descriptor
// of `path` (beneath its root). Returns it (the caller owns it), or -1 with the reason in `why`
// (another host, a server that lends no files, a path it refuses). Waits no later than `until`.
// `none`, when given, is set when the server lends no file at all (no socket here, or lending off)
// rather than refusing this one.
int ask_file(const std::string& socket_name, std::span<const std::uint8_t> token, const std::string& path,
             lending_clock::time_point until, std::string& why, bool* none = nullptr);
// The longest path ask_file sends.
constexpr std::size_t max_asked_path = 4096;

// The server's socket. Each connection carries one message and gets one answer, then is closed:
// {token, region id} with one descriptor, answered by one byte (1: taken, 0: refused); or {token,
// id 0, path} with none, answered by a byte 1 with the file's descriptor, or a byte 0 and the reason.
// Connections that do not send in time are closed, and beyond a few waiting at once the oldest is.
class lending_socket {
 public:
  // Takes a passed descriptor (the callee owns `fd` either way), with the process id of the client
  // that passed it (SO_PEERCRED; 0 if unknown); false refuses it.
  using deposit_fn = std::function<bool(std::span<const std::uint8_t> token, std::uint64_t id, int fd, std::int64_t pid)>;
  // The answer to a file asked for: the descriptor to pass (this closes it), or -1 and why not. Any
  // thread may call it, once; the connection stays open until then.
  using answer_fn = std::function<void(int fd, const std::string& why)>;
  // Opens `path` for reading for the session that `token` names and answers, now or later (an open
  // may wait on its file system: not on this socket's thread). `uid`: the asking process's user
  // (SO_PEERCRED; -1 if unknown). Null: no file is lent.
  using open_fn = std::function<void(std::span<const std::uint8_t> token, const std::string& path, std::int64_t uid, answer_fn answer)>;
  lending_socket(std::uint64_t instance, deposit_fn deposit, open_fn open = nullptr);
  ~lending_socket();
  lending_socket(const lending_socket&) = delete;
  lending_socket& operator=(const lending_socket&) = delete;
  const std::string& name() const { return name_; }  // without the leading NUL of the abstract name
  // Handles what arrives for up to `timeout`; returns early after wake().
  void serve(std::chrono::milliseconds timeout);
  void wake();

 private:
  struct pending {
    int fd;
    lending_clock::time_point until;
  };
  void receive(pending& p);
  void answer_ask(int fd, std::span<const std::uint8_t> token, std::string path, std::int64_t uid);
  deposit_fn deposit_;
  open_fn open_;
  std::string name_;
  int listen_fd_ = -1, wake_fd_ = -1;
  std::vector<pending> pending_;
};

// What all clients together have lent a server, counted per lend (at least what is mapped, since
// lends of one file share its mapping): bounded, since each region takes address space and a
// mapping (the kernel's vm.max_map_count counts those for the whole process).
struct lent_totals {
  std::atomic<std::uint64_t> bytes{0}, regions{0};
};

// A lent file mapped in the server, shared by the lends of it from one client process, since a
// client lends each region on each of its lanes (one set of page tables, and each page faulted in
// once, not once per lane). Unmapped when the last lend of it goes.
struct lent_mapping {
  std::byte* base = nullptr;
  std::uint64_t len = 0;
  // Every page of the file existed when it was mapped (the client made it resident): making the
  // page-table entries ahead of use then allocates nothing (populate_lent).
  bool resident = false;
  std::uint64_t populated = 0;  // bytes from `base` whose entries are made (populate_lent's caller only)
  lent_mapping() = default;
  lent_mapping(const lent_mapping&) = delete;
  lent_mapping& operator=(const lent_mapping&) = delete;
  ~lent_mapping();
};

// A lend: [base, base + len) here is [addr, addr + len) in the client, counted in `totals`. Held by
// the session and by the jobs using it. `map` keeps the mapping alive; other lends of the file from
// the same client process may hold it too (lent_maps::map says when).
struct lent_region {
  std::shared_ptr<lent_mapping> map;
  std::byte* base = nullptr;
  std::uint64_t addr = 0, len = 0;
  lent_totals* totals = nullptr;
  lent_region() = default;
  lent_region(const lent_region&) = delete;
  lent_region& operator=(const lent_region&) = delete;
  ~lent_region();
};

// The server's mappings of lent files, by file.
class lent_maps {
 public:
  // Maps a descriptor client process `pid` passed, for [addr, addr + len) of that client, after
  // checking that it is a regular shared-memory file sealed against shrinking and at least `len`
  // bytes long. A file the same process lent already, mapped at least that long, shares that
  // mapping when the descriptor could map it writable itself (opened read-write, no write seal).
  // Null, with the reason in `why`, when it is not. `fresh` gets the mapping when one was made for
  // it (null otherwise). Does not take `fd`.
  std::shared_ptr<lent_region> map(int fd, std::int64_t pid, std::uint64_t addr, std::uint64_t len, std::string& why,
                                   std::shared_ptr<lent_mapping>& fresh);

 private:
  std::mutex mu_;
  // By (device, inode, client process): never shared between clients, whatever their descriptors.
  std::map<std::tuple<std::uint64_t, std::uint64_t, std::int64_t>, std::weak_ptr<lent_mapping>> live_;
};

// Makes the page-table entries of up to `bytes` more of a resident mapping, from where the last
// call stopped; false once it is all done (or cannot be: not resident, or a kernel without
// MADV_POPULATE_WRITE). Copies into the region then take no page fault per page, which costs more
// than making the entry here.
bool populate_lent(lent_mapping& m, std::uint64_t bytes);

}  // namespace ferry::store::detail
