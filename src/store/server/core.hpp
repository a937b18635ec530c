#pragma once
// What the parts of the storage server (store/server/) share: its options, files and counters, the
// session of each connection, the file requests in flight, and the replies every part sends.
#include <ferry/core/stats.hpp>
#include <ferry/io/file_engine.hpp>
#include <ferry/store/root.hpp>
#include <ferry/store/server.hpp>

#include "core/logging.hpp"
#include "net/ucx.hpp"
#include "store/lending.hpp"
#include "store/server/buffers.hpp"
#include "store/server/open_files.hpp"
#include "store/server/write_txn.hpp"

#include <time.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace ferry::store::detail {

using namespace ferry::net;

// steady_clock's time from the kernel's tick-granular clock (no TSC read, a few ns): for checks
// per request that only need to notice a deadline within `coarse_slack` (the tick is 1-10 ms).
inline clk::time_point coarse_now() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return clk::time_point(std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec));
}
inline constexpr std::chrono::milliseconds coarse_slack{20};
// Regions one connection may have mapped here at once (its landing region and the buffers it
// allocated); more are refused (their requests then move data by messages).
inline constexpr std::size_t max_lent = 64;
// RMA that makes no progress for this long closes its connection (the janitor; see read_path::rma).
inline constexpr std::chrono::seconds rma_timeout{30};

// The error as the client will show it: the code travels as the errno (the client names it once),
// so the message leaves it out.
inline error_reply to_reply(const error& e) {
  return error_reply{e.sys_errno() ? e.sys_errno() : errno_from_errc(e.code()), printable(format_error(e.info(), false), 1000)};
}

// What each worker's progress thread counts itself (requests, and what it serves at once: most
// small reads), summed -- with the shared counters above, the file completions' -- when stats are read:
// no atomic add per request, and no cache line shared between workers.
struct alignas(64) worker_counts {
  owned_counter requests, reads, writes, bytes_sent, inline_replies, mapped_reads, direct_reads, notify_records;
};

struct write_state {
  std::shared_ptr<write_txn> txn;
  std::shared_ptr<open_file> f;
  std::string path;
  std::uint64_t offset = 0, length = 0, announced = 0, written = 0;
  bool failed = false;
};
struct session : std::enable_shared_from_this<session> {
  std::atomic<int> outstanding{0};
  worker_counts* counts = nullptr;  // its worker's
  std::atomic<bool> welcomed{false};  // the handshake is complete (read by the janitor too)
  std::vector<std::uint8_t> ticket;   // the door's, which the client's hello must present
  std::string rma_transports;         // the lane's transports when they have remote memory access (verbs), else empty
  // Connection limits (the janitor reads these under sess_mu; `last` is written per request).
  std::weak_ptr<connection> conn;
  std::string peer_addr;              // the peer's address without its port
  clk::time_point since;              // accepted
  std::atomic<std::int64_t> last{0};  // coarse time of the last request, ns
  bool closing = false;               // a close was asked for (sess_mu)
  // RMA operations in flight, and the coarse time (ns) one last started or finished: the janitor
  // closes a connection whose RMA makes no progress (rma_timeout).
  std::atomic<int> rma_running{0};
  std::atomic<std::int64_t> rma_progress{0};
  unsigned lanes = 1;  // the client's, from its hello
  // The file its last small read used, until the file cache would reopen it (its worker's thread only).
  std::string last_path;
  std::shared_ptr<open_file> last_file;
  clk::time_point last_until{};
  std::map<std::uint64_t, std::shared_ptr<write_state>> writes;  // its worker's thread only
  // The client's lent regions (its landing region, buffers it allocated), mapped here; the newest
  // last (its worker's thread; jobs hold copies).
  std::vector<std::shared_ptr<lent_region>> lent;
  std::atomic<bool> mapped{false};       // for stats (read under sess_mu from any thread)
  // Lending: the token that ties descriptors passed on the lending socket to this session, and the
  // descriptors passed and not yet named by a `lend` (sess_mu; at most max_lent).
  std::vector<std::uint8_t> token;
  struct passed_region {
    std::uint64_t id;
    int fd;
    std::int64_t pid;  // of the process that passed it
  };
  std::vector<passed_region> passed;
  ~session() {
    for (auto& x : passed) ::close(x.fd);
  }
  // The lent region that holds [addr, addr + n), or null. Newest first: a region lent again at
  // an address that was given back is the live one.
  const std::shared_ptr<lent_region>* lent_at(std::uint64_t addr, std::uint64_t n) const {
    for (auto it = lent.rbegin(); it != lent.rend(); ++it) {
      auto& m = **it;
      if (addr >= m.addr && n <= m.len && addr - m.addr <= m.len - n) return &*it;
    }
    return nullptr;
  }
};
// A request's credit, given back just before its answer goes out: the client may send its next
// request the moment the answer arrives, and must not find the credit still taken (it would be
// refused as one too many). Given back once; the job gives it back if nothing did.
struct credit {
  std::atomic<int>* n = nullptr;
  explicit credit(std::atomic<int>& c) : n(&c) { c++; }
  credit(credit&& o) noexcept : n(std::exchange(o.n, nullptr)) {}
  credit(const credit&) = delete;
  ~credit() { give_back(); }
  void give_back() {
    if (n) n->fetch_sub(1);
    n = nullptr;
  }
};
// The server's shared state and the helpers its parts use.
struct server_core {
  server_core(file_engine& engine, server_options opt) : o(std::move(opt)), io(engine), root(o.root), files(root, o.fd_cache_ttl) {}
  server_options o;
  file_engine& io;
  root_dir root;
  fd_cache files;
  std::atomic<std::uint64_t> connections{0}, bytes_sent{0}, bytes_received{0}, errors{0}, write_buffered{0}, direct_reads{0},
      direct_writes{0}, rma_puts{0}, rma_gets{0}, refused{0}, closed_handshake{0}, closed_idle{0}, commits{0};
  std::unique_ptr<worker_counts[]> counts;  // one per worker
  std::uint64_t instance = 0;  // random per start: a client's lanes check they reached one server
  std::mutex mu;
  // Set (under `mu`, for the janitor's wait) by stop() before it waits for io_in_flight: no file
  // request starts after it (one whose frame was still being handled is answered "stopping"), so that
  // wait is for all of them. (Each side writes its own, then reads the other's: one sees the other.)
  std::atomic<bool> stopping{false};
  // File requests whose completion has not run yet: the server does not go before they have.
  std::atomic<int> io_in_flight{0};
  std::condition_variable io_cv;  // with `mu`
  data_buffers buffers{o.chunk, 32};

  bool stopping_now() const { return stopping.load(); }
  // A request of the file engine; `then` gets its result on the thread that finished it (it must
  // not block). Counted, so that the server does not go while a completion may still come.
  void file_io(std::shared_ptr<ferry::file> f, bool write, std::uint64_t offset, void* mem, std::uint64_t n,
               std::function<void(const request_result&)> then) {
    io_in_flight++;
    auto settle = [this, then = std::move(then)](const request_result& r) {
      try {
        then(r);
      } catch (const std::exception& e) {
        log::debug("store", "file request completion: {}", e.what());  // a connection that went, say
      }
      if (--io_in_flight == 0) {
        std::lock_guard l(mu);
        io_cv.notify_all();
      }
    };
    if (stopping.load()) {
      request_result r;
      r.state = request_state::cancelled;
      r.err = error(errc::cancelled, "store.serve", o.root, "the server is stopping");
      return settle(r);
    }
    file_request r{std::move(f), offset, mem, n, write};
    io.submit({&r, 1}, {}, [settle = std::move(settle)](std::span<const request_result> res) { settle(res[0]); });
  }
  static const error& error_of(const request_result& r) {
    static const error none(errc::internal, "store.io", "", "file request did not finish");
    return r.err ? *r.err : none;
  }
  // The connection's session, or null once it went. No lock and no map lookup (this runs per
  // request): the connection points at its session, and callers are the connection's worker's
  // holder -- frame and data callbacks -- the same serialized context that clears the pointer
  // when the session goes.
  std::shared_ptr<session> session_of(connection& c) {
    auto* s = static_cast<session*>(c.user);
    return s ? s->shared_from_this() : nullptr;
  }
  void answer(connection& c, credit& cr, const message& m) {
    cr.give_back();
    c.send_frame(m);
  }
  void answer_error(connection& c, credit& cr, std::uint64_t rid, const error& e) {
    cr.give_back();
    reply_error(c, rid, e);
  }
  void reply_error(connection& c, std::uint64_t rid, const error& e) {
    errors++;
    try {
      c.send_frame({rid, 0, to_reply(e)});
    } catch (...) {
    }
  }
};

}  // namespace ferry::store::detail
