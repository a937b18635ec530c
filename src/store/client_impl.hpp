// The ferry:// client's state, in three parts a reader finds in three files:
//   connection (client_connection.cpp): lanes -- one UCX worker and connection each, with credits --
//     the handshake and authentication, reconnects, lending memory to a same-host server, the RMA
//     decision;
//   landing region and allocated buffers (landing.hpp): the shared memory a same-host server reads
//     into and writes from;
//   data path (client.cpp): requests split into pieces, replies matched by request id, landed
//     pieces copied on by the transfer engine, every wait bounded by the request's deadline.
// What it tracks -- lanes, pieces, a request's plan, submitted requests and their groups -- are types
// of their own (client_parts.hpp).
// The data path is chosen per piece from what the connection established once: the mapped landing
// region (same host), RMA into registered memory (transports with real RMA), or active messages.
#pragma once

#include <ferry/mem/pinned_pool.hpp>
#include <ferry/mem/registration.hpp>
#include <ferry/core/interrupt.hpp>
#include <ferry/store/client.hpp>
#include <ferry/xfer/engine.hpp>
#include <ferry/xfer/staged_copies.hpp>

#include "core/adaptive_mutex.hpp"
#include "core/logging.hpp"
#include "net/ucx.hpp"
#include "store/client_parts.hpp"
#include "store/landing.hpp"
#include "store/lost_connection.hpp"
#include "store/recycling_map.hpp"
#include "store/lending.hpp"

#include <fmt/format.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <vector>

namespace ferry::store {

using namespace ferry::net;
using clk = std::chrono::steady_clock;

// A server's refusal as an error naming the operation, peer and path, its errno kept.
[[noreturn]] void rethrow_reply(const error_reply& e, std::string_view op, const std::string& peer, const std::string& path);

struct client::impl {
  // What it tracks, each its own type (store/client_parts.hpp).
  using range_answer = client_parts::range_answer;
  using lane = client_parts::lane;
  using notice = client_parts::notice;
  using piece = client_parts::piece;
  using piece_list = client_parts::piece_list;
  using op = client_parts::op;
  using plan = client_parts::plan;
  using async_op = client_parts::async_op;
  using group = client_parts::group;
  // A small piece: kept on the caller's home lane (send), landed in a small slot (make_landing).
  static constexpr std::uint64_t small_piece = 64u << 10;
  // Reads sent as one request: at most 64, 256 KiB in all, so that hundreds of misses still go as
  // several requests, spread over the lanes (and the server's workers) instead of one. Their answer
  // (a count per read, then the data) lands in a group slot, page-rounded.
  static constexpr std::size_t together_most = 64;
  static constexpr std::uint64_t together_bytes = 256u << 10;
  static constexpr std::uint64_t group_answer = (together_bytes + 8 * together_most + 4095) & ~std::uint64_t{4095};
  client_options o;
  std::string host;
  std::uint16_t port;
  std::string peer;
  std::mutex mu;  // adaptive (the constructor): taken by every lane for every answer and by the threads that submit
  std::condition_variable cv;
  std::uint64_t next_id = 1;
  detail::recycling_map<std::uint64_t, std::shared_ptr<piece>> pend;  // by request id, until settled
  welcome hello_reply;
  bool connected_once = false;
  // The server could not be reached: requests until `down_until` fail at once with `down_err` (mu).
  std::optional<error> down_err;
  clk::time_point down_until{};
  // Counted under mu, where each request already is (an atomic add each would cost more than the
  // lock on some machines); staged bytes and reconnects by the threads that make them.
  std::uint64_t n_requests = 0, n_pieces = 0, n_read = 0, n_written = 0, n_direct = 0, n_rma = 0, n_lent = 0, n_noticed = 0;
  std::uint64_t n_quarantined = 0;  // landing slots and records given up while the server might still write them
  std::atomic<std::uint64_t> n_renewals{0};  // landing regions replaced
  std::atomic<std::uint64_t> n_staged{0}, n_reconnects{0};
  std::atomic<std::uint64_t> n_staged_pieces{0}, copy_out_ns{0}, n_copied_by_waiter{0};
  std::shared_ptr<ucx_context> ctx;  // the lanes' workers'
  // RMA: memory registered for the network through a registration cache of our own (lazily
  // deregistered, dropped when the memory goes); decided when lane 0 connects.
  std::unique_ptr<ucx_net_client> net_client;
  std::unique_ptr<registration_cache> net_cache;
  std::atomic<bool> use_rma{false};

  // The copies on of landed pieces the engine still runs: their completions use this client, which
  // waits for them. (GPU/sim memory whose data moves by messages is staged in the transfer engine's
  // pool near that memory.) With an engine only.
  std::optional<staged_copies> copies;

  // The landing region lent to the server (shared memory, mapped by a same-host server); null where
  // none could be made or FERRY_NET_MAP is off. Replaced by a fresh one when spent (renew_landing);
  // a piece holds the region its slot is in.
  std::shared_ptr<detail::landing_region> landing;  // landing_mu
  mutable std::mutex landing_mu;
  // Regions replaced while a slot or record of them was still held: the servers forget them once
  // none is (lend_mu).
  std::vector<std::shared_ptr<detail::landing_region>> retiring;
  std::shared_ptr<detail::landing_region> current_landing() const {
    std::lock_guard l(landing_mu);
    return landing;
  }
  // Buffers the caller allocated from this client (allocate); lend_mu orders lending them and the
  // landing region against (re)connects and against each other (taken before mu).
  detail::lent_buffers buffers;
  std::mutex lend_mu;
  // Whether every lane's server mapped the landing region: recomputed when a lane (re)connects, read
  // per request without a lock.
  std::atomic<bool> all_mapped{false};
  // Connection failures (and closes) counted, and the count when every lane was last seen alive:
  // while they are equal, requests skip the per-lane check.
  std::atomic<std::uint64_t> lane_events{1}, lanes_checked{0};
  std::atomic<std::uint64_t> connects{0};  // lanes' connections made so far (lane::conn_no)
  // `connects` + 1 when the server lends no files at all (or its lending socket is out of reach):
  // lent_file asks no more until a lane connects again (0: ask).
  std::atomic<std::uint64_t> no_lending_at{0};

  // ---- connection (client_connection.cpp) ----
  impl(const std::string& h, std::uint16_t p, client_options opt);
  ~impl();
  void shutdown();
  // Reconnects lanes that failed since the last look (free when none did).
  void ensure_connected(clk::time_point until);
  // The server's door (store/door.hpp): authenticates, names the ports the lanes in `down` listen on
  // (they listen from here until their connections came), and returns the door's welcome (the ticket).
  // A door that closes the connection before its answer (a flooded server displaces connections in
  // their handshake) is tried again a few times within the deadline.
  welcome knock(const std::vector<lane*>& down, clk::time_point until);
  // (Re)connects one lane with the door's `pass` before `until`: takes the server's connection that
  // arrived with the pass's ticket, says hello with it, then lends the landing region.
  void connect(lane& ln, const welcome& pass, clk::time_point until);
  // A connection that arrived on a lane's listener said hello with `ticket` (the lane's worker).
  void offered(lane& ln, connection& c, std::vector<std::uint8_t> ticket);
  // RMA for bulk data: on request, or (auto) when UCX put a transport with real RMA on the lanes.
  void decide_rma(connection& cn);
  // Runs on the lane's worker (its holder), like every handler: the connection's pieces fail.
  void conn_failed(connection* cn, const std::string& why);
  bool direct_available() const { return all_mapped.load(std::memory_order_relaxed); }
  std::size_t home_lane() const {
    thread_local const std::size_t h = std::hash<std::thread::id>{}(std::this_thread::get_id());
    return h % lanes.size();
  }
  std::uint64_t all_lanes() const { return lanes.size() >= 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << lanes.size()) - 1; }
  // Lends (or, with `give_back`, takes back) one region to one lane's server; true if it mapped it.
  // Lending is passing the region's descriptor on the server's lending socket, then naming it on the
  // lane; a server on another host (or network namespace) cannot be reached there.
  bool lend_to(lane& ln, const detail::shared_region& r, bool give_back, clk::time_point until);
  // Lends a fresh landing region in place of `spent` (unless another thread did already) to every
  // lane that is up, and has the servers forget the spent one; lanes that are down lend the fresh
  // one when they reconnect. Requests move data by messages until every lane maps it.
  void renew_landing(const std::shared_ptr<detail::landing_region>& spent, clk::time_point until);
  // A landing region of FERRY_NET_LANDING / FERRY_NET_PIECE slots (at least 2), a quarter as much again
  // in slots of the small-piece size (64 KiB, where a piece is larger) for small reads, as many of
  // them as notify records, an eighth in slots for the answers of small reads sent as one request
  // (where a piece is larger than one), and 256 notify records.
  std::shared_ptr<detail::landing_region> make_landing() const {
    const std::uint64_t small = o.piece > small_piece ? small_piece : 0;
    const int n_small = small ? static_cast<int>(std::clamp<std::uint64_t>(o.landing / 4 / small, 1, 256)) : 0;
    const std::uint64_t answers = o.piece > group_answer ? group_answer : 0;
    const int n_answers = answers ? static_cast<int>(std::clamp<std::uint64_t>(o.landing / 8 / answers, 1, 64)) : 0;
    return std::make_shared<detail::landing_region>(o.piece, static_cast<int>(std::max<std::uint64_t>(2, o.landing / o.piece)), 256,
                                                    small, n_small, answers, n_answers);
  }
  void* allocate(std::uint64_t bytes);
  void deallocate(void* p);
  // One request of one piece without data, waited for (handshake, lend, stat, list).
  // `ask_caller`: the wait asks the calling thread's interrupt check (core/interrupt.hpp); only for
  // calls made with none of the client's locks held (a handshake or lend holds lend_mu).
  message request(message m, clk::time_point until, bool needs_credit = true, lane* force = nullptr, bool ask_caller = false);
  // A request without data (stat, list), retried after a reconnect; a refusal is rethrown naming the path.
  message query(message m, std::string_view what, const std::string& path, std::chrono::nanoseconds timeout);

  // Checks the request and decides its route; `connect`: reconnects lanes that are down first.
  void plan_request(plan& pl, clk::time_point until, bool connect);
  // pl's next piece, with its message, from pl.off; `wait` false: null where it would wait for a
  // landing slot or a staging buffer. The caller sends it and moves pl.off on by its length.
  std::shared_ptr<piece> next_piece(plan& pl, message& m, clk::time_point until, bool wait);
  // A write piece's data after its frame, on the same connection (not for the landing region or RMA).
  void send_write_data(const std::shared_ptr<piece>& p);
  // A group's one piece: the ranges' answer lands in `slot` of `lr` (taken by the caller), or with
  // none (-1) in memory of its own (it comes by messages).
  std::shared_ptr<piece> reads_piece(net::read_many& m, range_answer answer, clk::time_point until,
                                     std::shared_ptr<detail::landing_region> lr, int slot);

  // ---- submitted requests (client_async.cpp) ----
  std::map<std::uint64_t, std::shared_ptr<async_op>> live;  // mu
  std::deque<std::shared_ptr<async_op>> waiting;  // pieces still to send, in order (mu)
  std::atomic<std::uint64_t> next_async{1};        // submitted requests' ids
  std::atomic<unsigned> next_pump{0};              // the lane that pumps the next batch submitted
  std::set<std::string> one_by_one;                // paths whose server refused ranges in one request (mu)
  std::atomic<bool> refused_ranges{false};         // one_by_one holds a path
  std::mutex ended_mu;
  std::vector<std::uint64_t> ended_ids;            // requests whose notice came (ended_mu)
  std::atomic<bool> async_work{false};             // ended_ids or waiting may hold something
  std::atomic<bool> pumping{false}, pump_again{false}, ticking{false}, renew_wanted{false}, stat_wanted{false}, stopping{false};
  std::vector<std::function<void()>> afterwards;   // work for the lanes' idle look (mu)
  std::condition_variable live_cv;                 // `live` emptied (mu)
  std::mutex connect_mu;                           // one reconnect at a time
  // Connections closed to end a submitted request, until their closing lands (mu): no piece is sent
  // on them meanwhile, and the other pieces they fail are sent again as not their own loss.
  std::map<const connection*, std::shared_ptr<connection>> closing;
  // When a piece last landed (mu): a request waiting behind others (in the queue for credits, slots
  // and buffers, or at the server) has not stalled while they move; its deadline by progress follows this.
  clk::time_point moved_at{};
  static thread_local bool in_tick;                // this thread runs a lane's idle look
  // This thread (an engine task) runs a staged piece's completion: for what that may end (a
  // request's completion, the caller's last reference to the client), it is the client's own thread.
  static thread_local bool in_copy_end;
  void submit(std::span<client::request> rs) noexcept;
  // A submitted request's notice: its id goes to ended_ids, for drain.
  std::shared_ptr<notice> notice_for(std::uint64_t id);
  // A's notice, made when first needed (mu held): a small read sent as one of a group never needs
  // one of its own.
  notice& ends_of(async_op& a) {
    if (!a.ends) a.ends = notice_for(a.id);
    return *a.ends;
  }
  // Starts what the queue holds while credits, slots and buffers allow, in order; never waits.
  void pump();
  // Runs the completions of requests that ended, then pumps; outside mu, on whatever thread ended them.
  void drain();
  void drain_if_any() {
    if (async_work.load(std::memory_order_acquire)) drain();
  }
  // Leaves group `a` (queued, not sent) its first `keep` reads; the others it still has open go right
  // after it in the queue as a group of their own. False (nothing changed) when memory ran out.
  bool split_group(const std::shared_ptr<async_op>& a, std::size_t keep);
  // Sends what it can of `a`; true once every piece is out.
  bool advance(const std::shared_ptr<async_op>& a, bool& all_down);
  // Small reads at the front of the queue (same file and version) joined into one request.
  std::shared_ptr<async_op> gather(std::size_t& taken);
  // A group queued and not sent yet (nothing of it under way): gather may take its reads in.
  static bool unsent_group(const async_op& x) {
    return x.grp && x.x.pieces.empty() && !x.advancing && !x.ended && !x.gave_up;
  }
  // Whether `x` alone may be a range of a request of several (a small read into host memory);
  // `known`: the last memory classified, asked again only for memory outside it.
  bool groupable(const async_op& x, memory_region& known) const;
  // Reads of one file as one request (next_async and notice_for only: no lock needed).
  std::shared_ptr<async_op> make_group(std::span<const std::shared_ptr<async_op>> members);
  // A lane's idle look: deadlines and cancels, stats, a spent landing region, reconnects.
  void tick();
  // Ends `a` with `e` (under mu): its pieces under way fail once their connections are closed
  // (returned, to close outside mu).
  void give_up(async_op& a, const error& e, std::vector<std::shared_ptr<connection>>& close);
  // Fails `a`'s pieces still under way with `e` and names their connections to close (mu).
  void abandon_pieces(async_op& a, const error& e, std::vector<std::shared_ptr<connection>>& close);
  // Closes what give_up and abandon_pieces named (outside mu).
  void close_for(const std::vector<std::shared_ptr<connection>>& close);
  void conclude(const std::shared_ptr<async_op>& a);
  // The lane whose thread runs waiting work: a lane that is down (its thread has nothing else to do), else lane 0.
  void kick();
  // The lane worker whose progress thread this is (null: none of this client's).
  ucx_worker* own_worker() const {
    for (auto& ln : lanes)
      if (ln->w->on_progress_thread()) return ln->w.get();
    return nullptr;
  }
  bool own_thread() const { return in_copy_end || own_worker() != nullptr; }

  // ---- data path (client.cpp): caller threads ----
  // A synchronous read's or write's request, sent, for finish. `handle`: for a read, the file
  // version it must come from (0: any); for a write, its open write.
  op start(const std::string& path, std::uint64_t offset, std::byte* mem, std::uint64_t length, bool write,
           clk::time_point until, std::uint64_t handle);
  // A piece is done: its request's notice, if any, counts it.
  static void ended(piece& p) {
    if (p.ends) p.ends->release();
  }
  std::uint64_t finish(op& x);
  // A synchronous write into an open write: start, then finish.
  std::uint64_t write_now(const write_handle& h, std::uint64_t offset, const void* src, std::uint64_t length, clk::time_point until);
  // Does [p, p+n) need host staging (GPU or sim memory UCX cannot reach)? `r` gets what it is: the
  // one classification of the caller's memory for the whole request.
  bool needs_staging(const void* p, std::uint64_t n, const char* what, memory_region& r);
  // What a piece's buffer is (a landing slot, a staging buffer), as registered: null when unknown.
  const memory_region* buffer_region(const piece& p);
  // Copies on this thread between the caller's memory (`user`, as classified when the request
  // started) and a buffer of this client (host memory: a landing slot or staging buffer; `buf` its
  // registered region, null when unknown), `to_user` saying which way: a memcpy into or out of host
  // memory (all the engine would do there), else the transfer engine, told what both sides are.
  void copy_bytes(std::byte* dst, const std::byte* src, std::uint64_t n, bool to_user, const memory_region& user,
                  const memory_region* buf, clk::time_point until);
  // Registers a piece and sends its frame on `force` or the least loaded lane with a credit.
  // `until` bounds the wait for a credit.
  // `whole`: a request of this one piece, counted under the same lock.
  // `wait` false: null (nothing sent, `p` untouched) where no lane has a credit; `all_down` then says
  // whether every lane is down.
  std::shared_ptr<piece> send(message m, std::shared_ptr<piece> p, bool needs_credit, clk::time_point until, lane* force = nullptr,
                              op* whole = nullptr, bool wait = true, bool* all_down = nullptr);
  // Waits for one piece until `until`; on timeout closes its connection so that nothing lands later.
  // `what` names the request in errors; it is built only when one is raised (formatting a string
  // per request would cost more than a shared-memory round trip). `ask_caller`: the caller's check
  // (interrupted(), looked at every tenth of a second) may give up -- as at the deadline, but a
  // `cancelled` error.
  template <typename What>
  void wait_piece(const std::shared_ptr<piece>& pp, clk::time_point until, const What& what, bool ask_caller = false) {
    piece& p = *pp;
    p.waiter.store(std::this_thread::get_id(), std::memory_order_release);
    // Drive the worker from this thread for a while: a small request then completes without any
    // thread hand-off (the progress thread takes over if this one gives up and sleeps). A read the
    // server answered at once into a landing slot also wrote the slot's notify record: seen, the
    // read is done without taking its completion message off the queue.
    const std::uint64_t* record = p.record;
    auto finished = [&] {
      if (p.done.load(std::memory_order_acquire)) return true;
      if (!record || std::atomic_ref<const std::uint64_t>(record[0]).load(std::memory_order_acquire) != p.rid) return false;
      std::shared_ptr<piece> due;
      {
        std::lock_guard l(mu);
        if (!p.settled) {
          take_notice(p, std::atomic_ref<const std::uint64_t>(record[1]).load(std::memory_order_relaxed));
          n_noticed++;
          due = maybe_settle(pp);
        }
      }
      if (due) copy_out(std::move(due));
      return p.done.load(std::memory_order_acquire);
    };
    if (p.ln->w->drive(finished, until, o.spin)) return;
    // On the lane's own thread (its idle look waits for a request) no other thread drives it.
    if (p.ln->w->on_progress_thread() && p.ln->w->drive(finished, until)) return;
    std::unique_lock l(mu);
    bool gave_up = false;
    ask_caller = ask_caller && interruptible();
    if (!ask_caller) {
      if (cv.wait_until(l, until, [&] { return p.done.load(); })) return;
    } else {
      for (;;) {  // in slices: the caller's check is a question, not a notification
        if (cv.wait_until(l, std::min(until, clk::now() + std::chrono::milliseconds(100)), [&] { return p.done.load(); })) return;
        if (clk::now() >= until) break;
        l.unlock();  // the caller's check (a Python signal handler) runs without the client's lock
        gave_up = interrupted();
        l.lock();
        if (p.done.load()) return;  // answered while the check ran
        if (gave_up) break;
      }
    }
    auto cn = p.ln->c;
    l.unlock();
    log::warn("store", "{}: {} {}; closing the connection", peer, what(), gave_up ? "cancelled" : "timed out");
    // An RMA piece's memory may still be written by the server: revoke its network key.
    if (p.rma && net_cache) net_cache->invalidate(reinterpret_cast<std::uintptr_t>(p.rma_mem), p.len);
    if (cn) cn->close();
    // The close fails the piece once it has run and the receives under way on it have ended. On the
    // lane's own thread nothing else runs the close: this thread drives the worker until then.
    const auto settle_by = clk::now() + std::chrono::seconds(5);
    if (p.ln->w->on_progress_thread()) (void)p.ln->w->drive([&] { return p.done.load(std::memory_order_acquire); }, settle_by);
    l.lock();
    cv.wait_until(l, settle_by, [&] { return p.done.load(); });
    if (gave_up) fail(errc::cancelled, "store.request", peer, fmt::format("{}: cancelled", what()));
    fail(errc::timeout, "store.request", peer, fmt::format("{}: no answer before the deadline", what()));
  }
  // A settled piece's bytes, or the error it ended with (naming the peer and path).
  std::uint64_t outcome(const piece& p, const char* opname, const std::string& path);

  // ---- data path (client.cpp): replies, on whichever thread holds the lane's worker ----
  // Applies `f` to the pending piece `rid` (none: nothing) under mu, settles it if that made it
  // ready, and hands its copy on once mu is released.
  template <typename F>
  void update(std::uint64_t rid, F&& f) {
    std::shared_ptr<piece> due;
    {
      std::lock_guard l(mu);
      auto it = pend.find(rid);
      if (it == pend.end()) return;
      const auto& pp = it->second;  // maybe_settle moves it out of the map last
      f(*pp);
      due = maybe_settle(pp);
    }
    if (due) copy_out(std::move(due));
    drain_if_any();
  }
  void on_frame(message m);
  void on_inline(message m, const std::byte* d, std::size_t n);
  // A piece's answer (a frame): what it says about the data, kept for finish.
  void take_reply(piece& p, message&& m);
  // A read's notify record, seen: as its completion (the message that follows finds it settled).
  void take_notice(piece& p, std::uint64_t bytes);
  // A piece's answer with its data inline: copied to where the piece lands.
  void take_inline(piece& p, message&& m, const std::byte* d, std::size_t n);
  // A piece is finished when its reply came and all its data arrived, or when it failed. Called with mu held.
  static bool ready(const piece& p) {
    if (p.receiving) return false;
    return p.err || (p.replied && (!p.reply || !std::holds_alternative<complete>(p.reply->b) || p.write || p.received >= p.expect));
  }
  // Settles a piece that is ready. Returns it when its data must still be copied on from where it
  // landed: the caller hands it to copy_out once mu is released.
  [[nodiscard]] std::shared_ptr<piece> maybe_settle(const std::shared_ptr<piece>& pp);
  // A landed piece's data on to the caller's memory, by the transfer engine; the piece is done, and
  // its slot free, when the copy is. Settled by the thread that waits for it (driving its lane), the
  // copy runs right here (engine.copy runs one copy on its caller's thread; into host memory, a
  // memcpy): that thread would only wait for another to do it. Settled elsewhere (a progress
  // thread), it goes to an engine worker as a batch with a completion, so that the progress thread
  // goes on -- unless it is a small piece for host memory, a memcpy shorter than that hand-off.
  // Without an engine every destination is host memory: a memcpy here.
  void copy_out(std::shared_ptr<piece> pp);
  // A read_many answer with the caller's hook: its counts checked, each range handed to the hook, then the
  // piece is done (its slot given back). Outside mu, on the thread that settled it.
  void answer_ranges(const std::shared_ptr<piece>& pp);
  // A finished piece gives back whatever buffer it borrowed (staging buffer, landing slot). mu held.
  void release_buffers(piece& p);
  // Gives a piece's landing slot and notify record back, or keeps them out of use when the server
  // may still write into them (a request it never answered). mu held.
  void release_land(piece& p, bool server_may_write);

  // Runs an idempotent request; after a lost connection (server restarted) it reconnects once and retries.
  template <typename F>
  auto retrying(F f, clk::time_point until) -> decltype(f()) {
    std::optional<error> lost;
    for (int attempt = 0;; ++attempt) {
      try {
        return f();
      } catch (const error& e) {
        bool retry = e.code() == errc::network_error && attempt == 0 && clk::now() < until;
        if (!retry) {
          if (lost && e.op() == "store.connect") throw detail::lost_and_unreachable(*lost, e);
          throw;
        }
        lost = e;
        log::info("store", "{}: {}; reconnecting", peer, e.what());
      }
    }
  }
  // Declared last, so destroyed first: their progress threads (and the callbacks they run -- a close
  // shutdown asked for fails its pieces under mu, in `closing`) stop while the rest of the client is
  // whole. A member declared after this would go while they still run.
  std::vector<std::unique_ptr<lane>> lanes;
};
}  // namespace ferry::store
