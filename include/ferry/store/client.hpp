#pragma once
// The storage service's client: reads and writes of files a `ferry serve` exports
// (ferry/store/server.hpp), from and into any memory ferry knows (host, pinned, GPU, sim).
//
// Data path (docs/design/storage-service.md): every request is split by the client into pieces of at
// most `piece` bytes; each piece is one wire request with its own credit, spread over the client's
// lanes (connections, each with its own UCX worker and progress thread), so a large read is served by
// several server workers and file requests at once. Small reads (<= inline_max) are answered from the server's progress
// thread in one message (completion + data). Bulk data travels as UCX active messages (rendezvous) --
// on tcp the fastest primitive UCX offers -- except between processes of one host: there the client
// lends a landing region (a sealed memfd passed on the server's Unix socket) that the server maps and
// reads files straight into. GPU and sim memory: when this UCX build cannot register
// CUDA memory, pieces land in pinned host memory (the landing region, or the transfer engine's staging
// buffers) and the engine copies them on; with a CUDA-capable UCX they go to the GPU directly.
#include <ferry/core/error.hpp>
#include <ferry/core/export.hpp>
#include <ferry/net/protocol.hpp>
#include <ferry/store/settings.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace ferry {
class transfer_engine;
class registration_cache;
}  // namespace ferry

namespace ferry::store {

struct client_options {
  std::chrono::nanoseconds timeout = std::chrono::seconds(30);  // connection + handshake
  std::string secret;  // the shared secret, when the server requires one
  // For GPU/sim memory: how to tell memory kinds apart and move staged pieces on. Without them every
  // pointer is taken for host memory.
  registration_cache* cache = nullptr;
  transfer_engine* engine = nullptr;
  std::uint64_t piece = store_settings{}.net_piece;      // bytes per wire request (FERRY_NET_PIECE)
  std::uint64_t landing = store_settings{}.net_landing;  // the landing region lent to a same-host server (FERRY_NET_LANDING)
  std::chrono::nanoseconds spin = store_settings{}.net_spin;
  // After the server could not be reached, requests fail at once with that error this long
  // (FERRY_NET_RETRY_AFTER).
  std::chrono::nanoseconds retry_after = store_settings{}.net_retry_after;
  // One connection attempt's wait for the server's welcome (FERRY_NET_CONNECT_TIMEOUT).
  std::chrono::nanoseconds connect_timeout = store_settings{}.net_connect_timeout;
  // Connections (lanes) to the server, each with its own UCX worker and progress thread; pieces are
  // spread over them (FERRY_NET_LANES). One tcp connection is bound by one thread's copies. 0: one per
  // four cores, 1..4 (default_net_lanes()).
  int lanes = store_settings{}.net_lanes;
  // Lend a same-host server a shared-memory landing region (a sealed memfd): the server then reads
  // files straight into it and no data message is sent (FERRY_NET_MAP).
  bool map = store_settings{}.net_map;
  // Same host: ask the server for a read-only descriptor of a file opened for reading through the
  // file API (lent_file), which then reads it like a local file, where the server lends files
  // (FERRY_NET_FILES here, FERRY_SERVE_LEND_FILES there).
  bool files = store_settings{}.net_files;
  // RMA for bulk data (FERRY_NET_RMA): "auto" when a lane has a transport with real RMA (verbs), "on"
  // always (UCX emulates it over tcp: for tests), "off" never. The client registers its memory for
  // the network through a registration cache of its own (cached, invalidated with the memory).
  rma_use rma = store_settings{}.net_rma;
};

struct client_stats {
  std::uint64_t requests = 0, pieces = 0, bytes_read = 0, bytes_written = 0, staged_bytes = 0, reconnects = 0;
  std::uint64_t progress_wakeups = 0;
  bool gpu_direct = false;   // this UCX registers CUDA memory (no staging for GPU buffers)
  std::string transports;    // UCX lanes of the first connection ("tcp/lo", "sysv/memory(am),tcp/lo", ...)
  std::string data_path;     // "mapped region (shared memory)" or "active messages (rendezvous)"
  int lanes = 0;             // connections in use
  std::uint64_t direct_pieces = 0;     // pieces the server moved through the mapped region
  std::uint64_t quarantined = 0;       // landing slots and notify records never reused (a request was abandoned while the server might still write)
  std::uint64_t rma_pieces = 0;        // pieces the server moved by RMA into / out of registered memory
  bool rma = false;                    // RMA in use for bulk data (FERRY_NET_RMA and the transports)
  std::uint64_t lent_pieces = 0;       // pieces the server moved straight into / out of buffers from allocate()
  std::uint64_t noticed_reads = 0;     // reads into a landing slot their waiter saw done by the slot's notify record (no message taken)
  std::uint64_t copied_by_waiter = 0;  // landed pieces copied on by the thread waiting for them (the others where they settle -- small ones into host memory -- or by engine workers)
  // Staged pieces (landed in pinned staging or the landing region, then copied on to their
  // destination -- GPU/sim memory, or host memory read through the landing region -- by the transfer
  // engine): how many, and the summed time from landing to copied; where a slow GPU read's time goes
  // on this side.
  std::uint64_t staged_pieces = 0, copy_out_ns = 0;
  std::uint64_t landing_renewals = 0;  // landing regions replaced after half their slots (of either size) were quarantined
};

// How a client's data moved, in words: "mapped landing region", "RMA" or "messages".
FERRY_API std::string_view data_route(const client_stats& s);

class FERRY_API client {
 public:
  // Connects and completes the handshake before `timeout`; throws network_error naming the peer.
  // `secret`: the shared secret, when the server requires one (permission_denied otherwise).
  client(const std::string& host, std::uint16_t port, std::chrono::nanoseconds timeout = std::chrono::seconds(30),
         std::string secret = {});
  client(const std::string& host, std::uint16_t port, client_options o);
  ~client();
  client(const client&) = delete;
  client& operator=(const client&) = delete;

  // One request with a completion: the asynchronous shape every non-blocking user takes (the
  // ferry:// adapter of the file API, and through it Python and the GPU cache). submit() never waits
  // for the network: a request the lanes have no credit (or landing slot, or staging buffer) for is
  // queued in the client and started by whichever thread gives one back -- a lane's progress thread,
  // mostly -- in the order submitted; work that must wait (reconnecting, the stat a versionless read
  // of several pieces needs, a landing region's renewal) is done by a lane's progress thread between
  // its polls. `done(bytes, err)` is called exactly once: with the bytes read (short at the end of
  // the file) or written, or with the error naming the peer, path and offset; on the thread that
  // ends the request (a lane's progress thread, a copy's engine worker, the caller's when it fails at
  // once). It must not block or call this client's synchronous functions (submit is fine); the last
  // reference to the client must not be dropped in it. Memory stays the request's until then.
  // Reads are sent again once after their connection was lost (server restarted), within their
  // deadline -- a loss on a connection made before the request was queued (a server gone before it,
  // noticed only then) does not count; a write is not (its open write went with the connection).
  // Small reads of one file into host memory queued together go as one request (net::read_many), cut
  // apart again for their completions; a server that refuses that for a path has its reads of it go
  // one by one.
  struct request {
    std::string path;
    std::uint64_t offset = 0;
    void* mem = nullptr;  // a read's destination, a write's source
    std::uint64_t length = 0;
    std::uint64_t write = 0;    // an open write's id (write_handle::id): a write into it; 0: a read
    std::uint64_t version = 0;  // a read's file version (stat().version); 0: any (several pieces: one stat first)
    // Deadline: fixed at `until`, or by progress -- with `idle` set, the request fails once nothing
    // moved for that long: none of its pieces, and none of the client's (a request waiting behind
    // others that move, in the client's queue or at the server, has not stalled). Looked at by the lanes'
    // progress threads every tenth of a second, as is `cancelled` (true: the request ends with a
    // `cancelled` error). A request given up under way closes its lane's connection first (its other
    // requests there are sent again), so nothing lands in its memory after `done`.
    std::chrono::steady_clock::time_point until = std::chrono::steady_clock::time_point::max();
    std::chrono::nanoseconds idle{0};
    // Neither is called once `done` has been.
    std::function<bool()> cancelled;  // must not block or call the client
    std::function<void()> moved;      // told as each of its pieces lands (optional; as `cancelled`)
    std::function<void(std::uint64_t bytes, const error* err)> done;
  };
  void submit(request r);
  // Requests together (a batch): small reads of one file among them may go as one request. Never
  // throws: each `done` is called once.
  void submit(std::span<request> rs) noexcept;
  // Runs `f` once on a lane's progress thread between its polls, where it may wait for this client
  // (a synchronous call): for a completion with work that waits (a file's last holder commits its
  // writes). False (nothing queued) once the client is going.
  bool defer(std::function<void()> f);
  // Whether the calling thread is one of this client's: a lane's progress thread, or an engine task
  // running a staged piece's completion -- where completions run. The client cannot be destroyed
  // there (it would wait for itself).
  bool own_thread() const noexcept;
  // Whether the calling thread may make a synchronous call of this client: any thread but its own
  // (above), and those in the work `defer` runs.
  bool may_wait() const noexcept;

  // Writes are atomic per file. open_write() starts a new version of `path` on the server, invisible
  // under its name (`keep`: a copy of its current content, for updates in place; `replace`: empty);
  // writes fill it from any memory; commit() puts it in place in one step -- a reader sees the old
  // file or the new one, never a mix -- and returns its size once the server confirmed it. A client
  // that dies, a lost connection, or abort() leaves the file as it was. Two writers of one path each
  // write their own version; the last commit wins whole.
  struct write_handle {
    std::uint64_t id = 0;
    std::string path;
  };
  // `size_hint`: the size the new version will have, when known (pieces then fill it in any order
  // without extending it).
  write_handle open_write(const std::string& path, net::write_mode mode = net::write_mode::replace,
                          std::chrono::nanoseconds timeout = std::chrono::seconds(30), std::uint64_t size_hint = 0);
  void write(const write_handle& h, std::uint64_t offset, const void* src, std::uint64_t length,
             std::chrono::nanoseconds timeout = std::chrono::seconds(30));
  // `size`: the file's size is set to it first (a replacement then has exactly the bytes written,
  // whatever was there before); the server refuses a commit of more bytes than arrived.
  std::uint64_t commit(const write_handle& h, std::optional<std::uint64_t> size = std::nullopt,
                       std::chrono::nanoseconds timeout = std::chrono::seconds(30));
  void abort(const write_handle& h, std::chrono::nanoseconds timeout = std::chrono::seconds(5)) noexcept;
  // Replaces `path` with [src, src + length): open_write, the data, commit(length). After a lost
  // connection it starts again once, from the beginning.
  void put(const std::string& path, const void* src, std::uint64_t length,
           std::chrono::nanoseconds timeout = std::chrono::seconds(30));

  // Host memory that this client's server can reach directly, for buffers used again and again (as
  // memory registered for RDMA is): shared memory lent to a same-host server, which then reads files
  // straight into it and writes files straight from it -- no data message and no copy in this
  // process, at any size (a 4 KiB read costs one small request and one small completion). Where the
  // server cannot map it (another host or network namespace, FERRY_NET_MAP=0) it is ordinary host memory and
  // requests on it take the usual path (client_stats::lent_pieces counts those that went straight).
  // Its pages are resident from the start (made here, as pinned memory's are, so that the first reads
  // into it do not pay for them). Valid until deallocate() or until the client is destroyed. Like
  // any destination, a buffer must not be reused before its requests finish; after a request timed
  // out, the server may still write into the buffer until its read ends.
  void* allocate(std::uint64_t bytes);
  void deallocate(void* buffer);  // throws invalid_argument for a pointer allocate() did not return

  // Synchronous helpers. Reads are retried once after a reconnect (server restarted). A read of more
  // than one piece comes from one version of the file, and one that ends short of what the file held
  // when it began (the file shrank under it) is an io_error naming the offset, never a short success.
  // A small read (one piece) into host memory or an allocated buffer is the quickest request there
  // is: the calling thread sends it and takes its answer itself, with nothing registered for other
  // threads in between (a submitted request cannot: its caller may do anything meanwhile).
  std::uint64_t read(const std::string& path, std::uint64_t offset, void* dst, std::uint64_t length,
                     std::chrono::nanoseconds timeout = std::chrono::seconds(30));
  std::uint64_t read(const std::string& path, std::uint64_t offset, void* dst, std::uint64_t length,
                     std::chrono::steady_clock::time_point until);
  net::stat_reply stat(const std::string& path, std::chrono::nanoseconds timeout = std::chrono::seconds(30));
  std::vector<net::list_entry> list(const std::string& path, std::chrono::nanoseconds timeout = std::chrono::seconds(30));
  // A server on this host lends the file itself: a read-only descriptor of `path` (the caller owns
  // it), of version `version` when not 0 (stat().version), which this process then reads like a
  // local file. -1 when the server is on another host, lends no files (FERRY_SERVE_LEND_FILES off
  // there, FERRY_NET_FILES off here) or refuses the path (one on a network or FUSE mount among
  // them), or the file was replaced meanwhile: the
  // caller reads the file through the server then. Waits at most `timeout` or one connection
  // attempt's wait (FERRY_NET_CONNECT_TIMEOUT), whichever is shorter; never throws.
  int lent_file(const std::string& path, std::uint64_t version, std::chrono::nanoseconds timeout = std::chrono::seconds(30));
  bool writable() const noexcept;  // what the server said at the handshake
  const std::string& peer() const noexcept;
  client_stats stats() const;
  struct impl;

 private:
  std::unique_ptr<impl> impl_;
};

// Client options from settings (piece, landing region, spin, lanes, secret file) plus the runtime's cache and engine.
FERRY_API client_options client_options_from(const store_settings& s, registration_cache* cache, transfer_engine* engine);

}  // namespace ferry::store
