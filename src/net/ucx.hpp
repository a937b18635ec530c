#pragma once
// UCX (UCP) transport: one worker owned by one progress thread. Every UCX call runs on that thread;
// other threads hand it work with post()/call(). The thread sleeps in epoll on the worker's event fd
// and an eventfd for posted work, so an idle transport burns no CPU.
//
// Active messages: id 1 carries a protocol frame (header only); id 2 carries bulk data: header
// {u64 request_id, u64 offset}, data = the bytes (UCX picks eager or rendezvous by size); id 3 is a
// reply frame with small data inline (header = the frame, data = the bytes, always eager): a small
// read is answered by one message, which is what keeps its latency near one AM round trip.
//
// Progress model: after any activity the thread keeps polling for `spin` (FERRY_NET_SPIN) before it
// arms the worker and sleeps in epoll — back-off polling. Back-to-back requests then never pay a
// thread wake-up (several microseconds, more than a whole AM round trip on shared memory), and an
// idle transport still sleeps.
//
// Who drives progress (the one rule): only the worker's holder calls UCX, and handlers run on it.
// The progress thread holds the worker unless a caller waiting for its own request drives it
// (drive(): the progress thread steps aside until the caller stops, at its spin time or when its
// request is done). Any other thread hands work in: run_or_post() runs it at once if the worker is
// free (else posts it, order kept), call() posts it and waits with a deadline, post() only posts.
#include <ferry/core/error.hpp>
#include <ferry/mem/registration.hpp>
#include <ferry/net/protocol.hpp>

#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <span>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/backoff.hpp"

namespace ferry::net {

using ferry::detail::cpu_relax;  // (core/backoff.hpp)

inline constexpr unsigned am_frame = 1;
inline constexpr unsigned am_data = 2;
inline constexpr unsigned am_reply = 3;

struct data_header {
  std::uint64_t request_id;
  std::uint64_t offset;
};

class ucx_worker;

// One UCP context, shared by the workers of a process side (a server's lanes, a client's lanes):
// connection requests accepted on one worker may then be served by another.
class ucx_context {
 public:
  // `net_device` (e.g. "lo"): the one network interface UCX may use for its lanes (UCX_NET_DEVICES,
  // unless the user set that); empty: all. Shared memory is not a network device and stays allowed.
  explicit ucx_context(const std::string& net_device = {});
  ~ucx_context();
  ucx_context(const ucx_context&) = delete;
  ucx_context& operator=(const ucx_context&) = delete;
  ucp_context_h handle() const { return ctx_; }
  // Whether this UCX build registers CUDA memory itself (then GPU buffers need no host staging).
  bool cuda_memory() const { return cuda_memory_; }

 private:
  ucp_context_h ctx_ = nullptr;
  bool cuda_memory_ = false;
};

// The network interface that holds `host` (local: a server's listen address) or that routes to it
// (a client's server; found with a UDP socket's connect, which sends nothing), by name: "lo" for a
// loopback address. Empty for a wildcard address (0.0.0.0, ::) or when it cannot be told.
std::string interface_for(const std::string& host, bool local);

// A peer's packed rkey unpacked for RMA on one endpoint. Released (on the worker's thread) when the
// last holder drops it, so work still using it keeps it alive.
struct remote_key {
  ucx_worker* w = nullptr;
  ucp_rkey_h rkey = nullptr;
  remote_key() = default;
  remote_key(const remote_key&) = delete;
  remote_key& operator=(const remote_key&) = delete;
  ~remote_key();
};

// Registers memory for the network (ucp_mem_map of existing memory + packed rkey), as a peer-memory
// client of a registration cache: registrations are cached, evicted lazily, and dropped when the memory
// goes (munmap hooks). Host memory, and CUDA memory when this UCX registers it. `classify` tells memory
// kinds apart (the runtime's cache); without it every pointer is taken for host memory.
class ucx_net_client final : public peer_memory_client {
 public:
  ucx_net_client(std::shared_ptr<ucx_context> ctx, registration_cache* classify) : ctx_(std::move(ctx)), classify_(classify) {}
  std::string_view name() const noexcept override { return "ucx-net"; }
  std::optional<memory_region> acquire(const void* p, std::uint64_t n) override;
  std::uint64_t pin(const memory_region& r, std::uintptr_t base, std::uint64_t size) override;
  void unpin(std::uint64_t cookie, std::uintptr_t base, std::uint64_t size) noexcept override;
  bool still_valid(const memory_region&) override { return true; }
  // The packed rkey of a registration's piece (its cookie).
  static std::span<const std::byte> rkey_of(std::uint64_t cookie);

 private:
  std::shared_ptr<ucx_context> ctx_;
  registration_cache* classify_;
};

// The most a connection's peer may leave untaken of what was sent to it (answers, frames) before the
// connection fails: well above what its credits let a client that takes its answers have in flight.
inline constexpr std::size_t max_held_bytes = 64u << 20;

// One endpoint (connection). Owned through shared_ptr; UCX calls on it run on the progress thread.
class connection : public std::enable_shared_from_this<connection> {
 public:
  connection(ucx_worker& w, std::string peer) : w_(w), peer_(std::move(peer)) {}
  const std::string& peer() const { return peer_; }
  bool alive() const { return alive_.load(); }
  std::string failure() const {
    std::lock_guard l(mu_);
    return failure_;
  }
  // Sends a frame (copied); completion is not awaited. Throws network_error if the connection is dead.
  void send_frame(const message& m);
  // Sends bulk data [p, p+n) as one AM; `done(status)` runs on the progress thread when the buffer
  // may be reused.
  void send_data(std::uint64_t rid, std::uint64_t off, const void* p, std::size_t n, std::function<void(ucs_status_t)> done);
  // Sends a reply frame with `n` bytes of data inline (copied; eager). For small replies only.
  void send_reply(const message& m, const void* data, std::size_t n);
  // The same with the reply already built in `buf`: [frame (frame_len bytes) | data].
  void send_reply(std::vector<std::byte> buf, std::size_t frame_len);
  // For a frame handler (the worker's holder) answering at once: room for at least `n` bytes of a
  // reply's inline data, reused from reply to reply (no allocation, no zeroing; a small read's
  // data is read straight into it), and the send of `m` with the first `n` bytes of that room.
  // Frames a holder sends are encoded into a reused buffer too: a 4 KiB read then allocates
  // nothing on its way through the server.
  std::byte* reply_space(std::size_t n);
  void send_reply_space(const message& m, std::size_t n);
  // The transports UCX chose for this endpoint's lanes ("tcp/lo", "posix/memory", ...), for stats.
  std::string transports();
  // Closes the endpoint (flush); idempotent.
  void close();
  // A peer's packed rkey unpacked for RMA on this endpoint (base stays null); null when UCX refuses
  // it. Progress thread only; released on the worker's thread when the last holder drops it.
  std::shared_ptr<remote_key> unpack_rkey(std::span<const std::byte> rkey);
  // RMA on the worker: put [local, local+n) to the peer's `remote` (or get it into local); `done`
  // runs on the worker's thread when the local buffer may be reused (put) or holds the data (get).
  void rma(bool get, void* local, std::size_t n, std::uint64_t remote, std::shared_ptr<remote_key> key,
           std::function<void(ucs_status_t)> done);
  // Sends a frame after everything put before it has reached the peer (ucp_worker_fence): the
  // completion of an RMA read may not overtake its data.
  void send_frame_fenced(const message& m);
  ucx_worker& worker() const { return w_; }

  ucp_ep_h ep = nullptr;  // progress thread only
  void* user = nullptr;   // owner's per-connection state (server session, client)
  void mark_failed(const std::string& why);
  // What runs (on the progress thread) when the connection fails. Set from any thread: the endpoint
  // is live from connect() on, and its failure may be reported while the owner sets this.
  void on_failure(std::function<void(const std::string&)> f);

 private:
  friend class ucx_worker;  // counts held_bytes_ as it holds and lets go of this connection's sends
  ucx_worker& w_;
  std::string peer_;
  std::atomic<bool> alive_{true};
  // Bytes of this connection's sends UCX holds, not yet taken by the peer (the worker's holder only).
  // A peer that sends requests but takes no answers would make them grow without end: past
  // max_held_bytes the connection fails.
  std::size_t held_bytes_ = 0;
  mutable std::mutex mu_;
  std::string failure_;
  std::function<void(const std::string&)> on_failure_;  // mu_
};

class ucx_worker {
 public:
  using frame_handler = std::function<void(connection&, message)>;
  // AM data handler: returns where to put [off, off+len) of request rid, or nullptr to drop it.
  using data_sink = std::function<void*(connection&, std::uint64_t rid, std::uint64_t off, std::size_t len)>;
  using data_done = std::function<void(connection&, std::uint64_t rid, std::uint64_t off, std::size_t len, ucs_status_t)>;
  using reply_handler = std::function<void(connection&, message, const std::byte* data, std::size_t len)>;

  explicit ucx_worker(std::string name, std::chrono::nanoseconds spin = std::chrono::microseconds(200),
                      std::shared_ptr<ucx_context> ctx = nullptr);
  ~ucx_worker();
  ucx_worker(const ucx_worker&) = delete;
  ucx_worker& operator=(const ucx_worker&) = delete;

  void on_frame(frame_handler h) { frame_ = std::move(h); }
  void on_reply(reply_handler h) { reply_ = std::move(h); }
  void on_data(data_sink sink, data_done done) {
    sink_ = std::move(sink);
    data_done_ = std::move(done);
  }
  // Work of the worker's owner that may wait (reconnecting, a deadline's look): run by the progress
  // thread with the worker let go -- as any other thread would, so that what it waits for on this
  // worker is driven by the wait itself -- at least every tenth of a second, and soon after kick().
  // Set before the first connection; it must return soon when nothing is due.
  void on_idle(std::function<void()> f) {
    idle_ = std::move(f);
    has_idle_.store(true, std::memory_order_release);  // (the loop reads idle_ only after this)
  }
  void kick() {
    kicked_.store(true, std::memory_order_release);
    post([] {});  // wakes a sleeping progress thread
  }
  // Runs f on the progress thread (asynchronously).
  void post(std::function<void()> f);
  // Runs f at once when this thread may use the worker (it is the progress thread, or the worker is
  // free) and nothing posted is waiting (so order is kept); otherwise posts it. This is what keeps a
  // small request free of thread hand-offs.
  // `settles` says that f leaves nothing for progress to finish unless it reports a pending
  // operation (pending_op): then no progress call follows it here (one costs a system call when tcp
  // is in the context, a fifth of a shared-memory round trip).
  void run_or_post(std::function<void()> f, bool settles = false);
  // Sends [frame (hl bytes) | data] held in `buf` as one eager AM; holder of the worker only. The
  // buffer is kept (by the worker) only if UCX could not send it at once.
  void send_owned(connection& c, unsigned id, std::vector<std::byte>&& buf, std::size_t hl);
  // Sends a[0, hl) as the AM header and, as its data, b[0, n) (or, without b, the rest of a) as one
  // eager AM; holder only. Only if UCX could not send at once (it then still points into them) are
  // a and b moved into the worker until the send completes, leaving the caller's vectors empty.
  void send_held(connection& c, unsigned id, std::vector<std::byte>& a, std::size_t hl, std::vector<std::byte>* b, std::size_t n);
  // Encodes m into frame_scratch_ after enter() returned `how`; if m cannot be encoded, leaves
  // the worker before the error goes up.
  void encode_scratch(int how, const message& m);
  // Operations started on the worker that UCX has not completed yet (sends, RMA): +1 when one is
  // left pending, -1 from its completion callback. The worker's holder only.
  void pending_op(int delta) { pending_ += delta; }
  // Runs f on the progress thread and waits for it, at most until `until` (then timeout).
  template <typename F>
  auto call(F f, std::chrono::steady_clock::time_point until) -> decltype(f()) {
    using R = decltype(f());
    if (on_progress_thread()) {
      // The progress thread in its idle work (on_idle) has let the worker go: it takes it here, as
      // a posted job would run (waiting for its own loop would wait forever).
      if (owner_.load(std::memory_order_relaxed) == std::this_thread::get_id()) return f();
      std::lock_guard l(ucx_mu_);
      lock_owner();
      struct release {
        ucx_worker* w;
        ~release() { w->unlock_owner(); }
      } r{this};
      return f();
    }
    auto p = std::make_shared<std::promise<R>>();
    auto fut = p->get_future();
    post([p, f = std::move(f)]() mutable {
      try {
        if constexpr (std::is_void_v<R>) {
          f();
          p->set_value();
        } else {
          p->set_value(f());
        }
      } catch (...) {
        p->set_exception(std::current_exception());
      }
    });
    if (fut.wait_until(until) != std::future_status::ready)
      fail(errc::timeout, "net.call", name_, "the progress thread did not answer before the deadline");
    return fut.get();
  }
  bool on_progress_thread() const { return std::this_thread::get_id() == thread_.get_id(); }
  // Drives the worker from this thread until `done()` or `until` (the caller polls, like a UCX
  // benchmark loop): while a caller drives, the progress thread steps aside at once instead of
  // competing for the worker, so a small request is sent, answered and completed on one thread with
  // no hand-off. Returns done(). Callbacks run on the calling thread. It gives up at `until` or
  // about `for_at_most` after it began, whichever comes first.
  template <typename Done>
  bool drive(Done done, std::chrono::steady_clock::time_point until,
             std::chrono::nanoseconds for_at_most = std::chrono::nanoseconds::max()) {
    drivers_.fetch_add(1, std::memory_order_seq_cst);
    std::unique_lock l(ucx_mu_, std::defer_lock);
    bool ok;
    for (unsigned i = 0;; ++i) {
      if ((ok = done())) break;
      // The clock every 8th turn, from the 8th: reading it costs a third of a progress call on some
      // VMs, and a small request is often done within the first turns. `for_at_most` counts from
      // the first reading.
      if ((i & 7) == 7) {
        auto now = std::chrono::steady_clock::now();
        if (i == 7 && for_at_most < until - now) until = now + for_at_most;
        if (now >= until) break;
      }
      if (!l.owns_lock()) {
        if (!l.try_lock()) {
          cpu_relax();
          continue;
        }
        lock_owner();
      }
      progress_once();
    }
    if (l.owns_lock()) unlock_owner();
    drivers_.fetch_sub(1, std::memory_order_seq_cst);
    return ok;
  }

  // Listens on host:port (port 0: any); returns the port. New connections get `accepted`, on this
  // worker's thread: a connection is served by the worker whose listener took it (handing it to
  // another worker aborts UCX 1.13, async.c:643). One listener per worker: a listen on another address
  // replaces it (closing the old one while the worker lives, which stop_listening avoids: see there).
  std::uint16_t listen(const std::string& host, std::uint16_t port, std::function<void(std::shared_ptr<connection>)> accepted);
  // Stops listening: what connects from now on is refused, the connections taken stay; the listener
  // itself stays (a listen on the same address takes it up again) until the worker goes. Idempotent.
  void stop_listening();
  // Connects to host:port; the endpoint is usable once this returns. Also from work running on this
  // worker (post): then at once, without waiting for the worker.
  std::shared_ptr<connection> connect(const std::string& host, std::uint16_t port, std::chrono::steady_clock::time_point until);

  ucp_worker_h handle() const { return worker_; }
  const std::string& name() const { return name_; }
  const std::shared_ptr<ucx_context>& context() const { return ctx_; }
  bool cuda_memory() const { return ctx_->cuda_memory(); }
  std::uint64_t wakeups() const { return wakeups_.load(); }

 private:
  friend class connection;  // its sends take the worker with enter()/leave()
  static ucs_status_t am_frame_cb(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                  const ucp_am_recv_param_t* param);
  static ucs_status_t am_reply_cb(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                  const ucp_am_recv_param_t* param);
  static ucs_status_t am_data_cb(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                 const ucp_am_recv_param_t* param);
  static void conn_cb(ucp_conn_request_h req, void* arg);
  static void ep_error_cb(void* arg, ucp_ep_h ep, ucs_status_t status);
  void loop();
  // run_or_post's halves: enter() takes the worker for this thread if it may (non-zero: run now,
  // then leave() with what enter returned); 0: post instead.
  // entered_quiet: took the free worker without announcing itself (callers_ untouched).
  static constexpr int entered_holder = 1, entered_took = 2, entered_quiet = 3;
  int enter();
  void leave(int how, bool settles);
  static void owned_send_cb(void* request, ucs_status_t status, void* user);
  bool drain_posted();
  void progress_once();  // posted work, then UCX progress until idle (worker held)
  void step_aside(std::unique_lock<std::mutex>& l, std::chrono::nanoseconds grace);  // progress thread: let callers have the worker
  void reacquire(std::unique_lock<std::mutex>& l, std::chrono::nanoseconds grace);  // progress thread: take the worker back after callers
  void accept(ucp_conn_request_h req, std::string peer);
  // Refuses the connection requests not accepted yet and destroys the listener (holder, making
  // descriptors); false when there was none.
  bool close_listener();
  // UCX progress: every call goes through here (see making_descriptors in ucx.cpp).
  unsigned progress();
  void lock_owner() { owner_.store(std::this_thread::get_id(), std::memory_order_relaxed); }
  void unlock_owner() { owner_.store(std::thread::id(), std::memory_order_relaxed); }
  connection* find(ucp_ep_h ep) {
    auto it = conns_.find(ep);
    return it == conns_.end() ? nullptr : it->second.get();
  }
  std::shared_ptr<connection> adopt(ucp_ep_h ep, std::shared_ptr<connection> c);
  // Closes c's endpoint and forgets it (progress thread): closed and failed connections hold no
  // UCX endpoint and no entry here.
  void drop(connection& c);
  // After this worker closed endpoints or its listener (holder, making descriptors): handles
  // what UCX kept for it while it was busy, events of the closed descriptors included, before
  // another worker may make a descriptor (see ucx.cpp).
  void forget_closed();

  std::string name_;
  std::shared_ptr<ucx_context> ctx_;
  ucp_worker_h worker_ = nullptr;
  ucp_listener_h listener_ = nullptr;
  int efd_ = -1, wake_ = -1, epoll_ = -1;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::deque<std::function<void()>> posted_;
  std::atomic<std::size_t> nposted_{0};
  std::mutex ucx_mu_;  // held by whichever thread is inside UCX (serialized worker)
  std::atomic<std::thread::id> owner_{};  // that thread
  std::int64_t pending_ = 0;              // the worker's holder only (see pending_op)
  struct held_send {
    std::vector<std::byte> a, b;
    std::weak_ptr<connection> c;  // whose sends (their bytes count against it: connection::held_bytes_)
  };
  std::unordered_map<void*, held_send> held_;  // buffers of sends UCX has not finished (holder only)
  std::vector<std::byte> frame_scratch_, reply_scratch_;  // holder only: see connection::reply_space
  std::atomic<int> drivers_{0};           // callers driving the worker (drive): the progress thread steps aside and naps
  std::atomic<int> callers_{0};           // callers taking it briefly (run_or_post): the progress thread lets them in
  std::atomic<bool> sleeping_{false};     // the progress thread is (about to be) in epoll: post() must wake it
  std::chrono::nanoseconds spin_;
  std::atomic<std::uint64_t> wakeups_{0};
  frame_handler frame_;
  reply_handler reply_;
  data_sink sink_;
  data_done data_done_;
  std::function<void(std::shared_ptr<connection>)> accepted_;
  std::vector<ucp_conn_request_h> conn_requests_;  // taken by the listener, accepted by posted work (holder only)
  struct alignas(64) own_line {
    std::atomic<bool> v{false};
  };
  own_line inside_;  // inside a progress call (a cache line of its own: written at every call)
  std::function<void()> idle_;
  std::atomic<bool> has_idle_{false}, kicked_{false};
  std::unordered_map<ucp_ep_h, std::shared_ptr<connection>> conns_;  // progress thread
  std::thread thread_;
};

}  // namespace ferry::net
