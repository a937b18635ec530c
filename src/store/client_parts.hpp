#pragma once
// What the ferry:// client (client_impl.hpp) tracks, each its own type: its lanes (a connection and
// its worker each), a request's wire pieces and their list, what a data request decided (its plan),
// and the requests of submit() with the groups of small reads sent as one.
#include <ferry/mem/pinned_pool.hpp>
#include <ferry/mem/registration.hpp>
#include <ferry/store/client.hpp>

#include "net/ucx.hpp"
#include "store/landing.hpp"

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace ferry::store::client_parts {

using namespace ferry::net;
using clk = std::chrono::steady_clock;

// Told each range of a read_many answer, (i, data, n): `data` valid only during the call.
using range_answer = std::function<void(std::size_t, const std::byte*, std::uint64_t)>;

struct async_op;
struct group;

// One connection to the server with its own UCX worker (progress thread) and credits.
struct lane {
  int index = 0;
  std::unique_ptr<ucx_worker> w;
  std::shared_ptr<connection> c;                // mu
  // While it is being connected: the connections its listener took (the server's, and any
  // stranger's), and those that said hello with a ticket (mu).
  std::vector<std::shared_ptr<connection>> arrived;
  std::vector<std::pair<std::shared_ptr<connection>, std::vector<std::uint8_t>>> offers;
  std::uint32_t credits = 1, inflight = 0;      // mu
  std::uint64_t conn_no = 0;                    // its connection's number (connects when it was made; mu)
  bool mapped = false;                          // the server mapped our landing region (mu)
  bool ready = false;                           // handshake done, `lending` and `token` set (mu)
  // From its welcome: where to pass regions it may map, and the session's token (written under
  // lend_mu, read by lenders, who hold it).
  std::string lending;
  std::vector<std::uint8_t> token;
};
// A submitted request's `ended` notice: told when its last piece is done. `left` counts its pieces
// not done plus one held while they are being sent, so that it is not told between two of them.
struct notice {
  std::atomic<int> left{1};
  std::function<void()> fn;
  void release() {
    if (left.fetch_sub(1, std::memory_order_acq_rel) == 1) fn();
  }
};
// One wire request.
struct piece {
  std::uint64_t rid = 0;
  lane* ln = nullptr;
  lane* prefer = nullptr;  // a direct piece: the lane its request's first piece went on (see send)
  connection* conn = nullptr;
  bool write = false, direct = false, rma = false, lent = false;
  std::shared_ptr<registration> net;  // network registration of the memory an RMA piece uses
  std::byte* rma_mem = nullptr;
  std::byte* land = nullptr;       // where read data lands (the destination, a staging buffer or a landing slot)
  std::vector<std::byte> owned;    // read_many by messages: the answer lands here, then goes to the caller's hook
  // read_many: the hook that takes each range's bytes (a group's: into its reads' memory), each
  // range's size, and the counts the answer gave, once the hook was told them (on the thread that
  // settled the piece, before it is done).
  range_answer answer;
  std::vector<std::uint64_t> range_len, counts;
  std::uint64_t len = 0;
  std::byte* final_dst = nullptr;  // staged reads: copied here by the transfer engine
  memory_region user;              // staged pieces: the caller's memory, as classified once at the start
  pinned_pool::buffer slot;
  int land_slot = -1;              // slot of the landing region, while the server may use it
  int rec = -1;                    // notify record of a small direct read, while the server may write it
  std::shared_ptr<detail::landing_region> region;  // the landing region of land_slot and rec
  const std::uint64_t* record = nullptr;  // that record (set before sending)
  clk::time_point until{};         // the request's deadline (its copy on has the same)
  clk::time_point landed{};        // staged reads: when the piece went to the engine
  std::uint64_t received = 0, expect = 0;
  // Data messages being received into `land` (mu): from the sink that gave UCX the address to the
  // receive's end. A piece is never settled while one is under way, failed or not -- its memory
  // (the caller's, or a staging buffer given back) would still be written after its completion.
  int receiving = 0;
  bool replied = false, settled = false, credit = false;
  std::optional<message> reply;
  std::optional<error> err;
  std::atomic<bool> done{false};
  std::shared_ptr<notice> ends;  // a submitted request's
  async_op* owner = nullptr;  // a submitted request's: moved on as the piece lands (mu; cleared as it ends)
  // Failed because its connection was closed to end another request (mu): a loss that is not its
  // own, so not its one retry.
  bool victim = false;
  std::uint64_t conn_no = 0;  // the number of the connection it was sent on (lane::conn_no)
  // The thread waiting for it, while it waits (wait_piece): a piece it settles itself, driving
  // its lane, it also copies on itself -- it would only wait for another thread to do it.
  std::atomic<std::thread::id> waiter{};
};
// The pieces of one request; most requests are one piece, kept without a vector.
struct piece_list {
  std::shared_ptr<piece> first;
  std::vector<std::shared_ptr<piece>> rest;
  void push_back(std::shared_ptr<piece> p) {
    if (!first) first = std::move(p);
    else rest.push_back(std::move(p));
  }
  bool empty() const { return !first; }
  template <typename F>
  void each(F&& f) const {
    if (first) f(first);
    for (auto& p : rest) f(p);
  }
};
struct op {
  std::string path;
  bool write = false;
  std::uint64_t offset = 0, length = 0;
  clk::time_point until;
  piece_list pieces;
};
// What a data request decided once -- the memory's kind, the route (lent buffer, landing region,
// RMA, staging, messages) -- and how far its pieces went out.
struct plan {
  std::string path;
  bool write = false;
  std::uint64_t offset = 0, length = 0, handle = 0;
  std::byte* mem = nullptr;
  const char* opname = "store.read";
  bool lent = false, staged = false, direct = false;
  memory_region user;
  std::shared_ptr<detail::landing_region> lr;
  std::shared_ptr<registration> net;
  std::vector<registration::piece> net_pieces;
  pinned_pool* pool = nullptr;
  std::uint64_t piece_len = 0, off = 0;
  lane* first_lane = nullptr;  // the lane the first piece went on
  bool sent_any = false;
  bool sent_all() const { return sent_any && off >= length; }
};
// A request of submit(), from its queueing to its completion; owned by `live` (mu).
struct async_op {
  std::uint64_t id = 0;
  client::request r;
  plan pl;
  op x;  // its pieces sent (their outcome is its result)
  std::shared_ptr<notice> ends;
  clk::time_point moved_at;
  std::optional<error> lost;     // sent again after its connection was lost with this
  // Connections made before it was queued: a loss of one of those is not its own -- the server went
  // before this request could tell, and a lane notices that only when its connection ends (its one
  // retry is for a connection made for it).
  std::uint64_t began_after = 0;
  std::optional<error> gave_up;  // ended by the lanes' look (deadline, cancel) with this
  bool planned = false, need_stat = false, ended = false;
  // Being planned and sent by pump (outside mu): a give_up meanwhile leaves the sending's hold
  // and the pieces sent after it to pump (`hold_to_pump`), so that the request cannot end -- and
  // its piece list be read -- while pieces are still being added.
  bool advancing = false, hold_to_pump = false;
  std::shared_ptr<group> grp;  // several small reads sent as one request: the reads it answers
  clk::time_point deadline() const {
    return r.idle.count() > 0 && moved_at + r.idle < r.until ? moved_at + r.idle : r.until;
  }
  bool over(clk::time_point now) const { return (r.cancelled && r.cancelled()) || now >= deadline(); }
};
// The reads one request answers. Each is ended once, by whichever takes it first: the answer's hook
// (its bytes copied into its memory; completed with the request) or the lanes' look (its deadline
// passed or it was cancelled while the others still wanted the answer).
struct group {
  static constexpr int open = 0, answered = 1, ended = 2, copying = 3;  // copying: the hook is filling it
  std::vector<std::shared_ptr<async_op>> members;
  std::unique_ptr<std::atomic<int>[]> state;
  std::vector<std::uint64_t> got;  // an answered read's bytes (written before its state says so)
  bool take(std::size_t i, int how) {
    int o = open;
    return state[i].compare_exchange_strong(o, how, std::memory_order_acq_rel);
  }
  int at(std::size_t i) const { return state[i].load(std::memory_order_acquire); }
  bool answer_in(std::size_t i) const { return at(i) == answered || at(i) == copying; }
};

}  // namespace ferry::store::client_parts
