// The file engine: io_uring pipelines between files and any memory (see include/ferry/io/file.hpp).
#include <ferry/core/error.hpp>
#include <ferry/core/units.hpp>
#include <ferry/io/file_engine.hpp>
#include <ferry/io/probe.hpp>
#include <ferry/mem/pinned_pool.hpp>
#include <ferry/mem/registration.hpp>

#include "core/logging.hpp"
#include "io/cufile.hpp"
#include "xfer/batch_state.hpp"
#include "xfer/stream_gates.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <fmt/format.h>
#include <liburing.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <list>
#include <map>
#include <set>
#include <thread>

#ifndef __NR_cachestat
#define __NR_cachestat 451
#endif

namespace ferry {
namespace {

std::uint64_t align_down(std::uint64_t v, std::uint64_t a) { return v / a * a; }
std::uint64_t align_up(std::uint64_t v, std::uint64_t a) { return (v + a - 1) / a * a; }

// Fraction of [off, off+len) of the file in the page cache (cachestat, Linux 6.5+); -1 if unknown.
double cached_fraction(int fd, std::uint64_t off, std::uint64_t len) {
  struct {
    std::uint64_t off, len;
  } range{off, len};
  struct {
    std::uint64_t cache, dirty, writeback, evicted, recently_evicted;
  } cs{};
  if (::syscall(__NR_cachestat, fd, &range, &cs, 0) != 0) return -1;
  std::uint64_t pages = (len + 4095) / 4096;
  return pages ? static_cast<double>(cs.cache) / static_cast<double>(pages) : 1.0;
}

// Whether a read of [off, off + len) goes around the page cache: FERRY_IO_DIRECT, and in automatic
// mode whether the range is cached (bypassing a warm page cache is slower than copying from it).
bool reads_direct(const settings& cfg, file& f, std::uint64_t off, std::uint64_t len) {
  if (cfg.io_direct == direct_io::never || f.direct_fd() < 0) return false;
  return cfg.io_direct == direct_io::always || cached_fraction(f.fd(), off, len) < 0.9;
}

// A request as a worker runs it: the file by pointer (its batch holds it; see file_engine::start).
struct job_request {
  file* f = nullptr;
  std::uint64_t offset = 0;
  void* mem = nullptr;
  std::uint64_t bytes = 0;
  bool write = false;
};

struct job {
  std::shared_ptr<transfer_batch::state> b;
  std::size_t idx = 0;
  job_request r;
  device* dev = nullptr;  // null: host memory
  memory_region where;    // the memory, as classified at submit (its device picks the staging pool)
  std::shared_ptr<registration> hold;  // unified memory: pinned in place until the job is done
  std::optional<std::uint64_t> size;   // a piece of a read: the file's size when the request was cut
};

// What file_engine::start builds per batch, kept by the submitting thread for its next one.
struct scratch {
  std::vector<job> jobs;
  std::vector<std::size_t> load;
  std::vector<std::uint32_t> to;
  std::vector<std::size_t> first, at, order;
};

// A request a worker is running: the file ranges still to issue, its progress, its first error.
struct running {
  job j;
  struct part {
    std::uint64_t pos, end;  // file range still to issue
    bool direct;
    bool nowait = false;     // buffered, only what the page cache has (see worker::start)
  };
  // A read: one; a write: buffered head, O_DIRECT middle, buffered tail (no allocation per request).
  std::array<part, 3> part_of{};
  std::size_t parts = 0;
  std::size_t next = 0;     // the part being issued
  std::uint64_t lo = 0, hi = 0;  // the asked range (a read's clipped to the size seen at the start)
  std::uint64_t size0 = 0;       // a read: the file's size at the start
  std::uint64_t chunk = 0;       // bytes per I/O
  pinned_pool* pool = nullptr;   // staging buffers, for requests that need them
  int busy = 0;                  // slots working for it
  std::uint64_t delivered = 0;
  std::uint64_t reported = 0;    // of `delivered`, what the batch was told as progress
  bool one_io = false;           // all in one I/O: no progress before its end
  bool mapped = false;           // a page-cache read into device memory: copied from the file's mapped pages
  std::optional<error> err;      // first failure: nothing more is issued, it ends when busy is 0
  bool issued() const { return next >= parts; }
  void add_part(std::uint64_t pos, std::uint64_t end, bool direct, bool nowait = false) { part_of[parts++] = {pos, end, direct, nowait}; }
  // Delivered bytes; a request of several I/Os tells its batch as they come (progress).
  void deliver(std::uint64_t n) {
    delivered += n;
    if (one_io) return;
    j.b->progress(j.idx, n);
    reported += n;
  }
};

// One I/O of a worker: a file range, the buffer it moves through, and where it is.
struct slot {
  running* r = nullptr;  // null: free
  pinned_pool::buffer held;  // a staging buffer, or none when the I/O goes to/from the request's memory
  std::byte* buf = nullptr;
  // A mapped read: the file's pages it copies from, pinned read-only for the destination's GPU.
  void* map = nullptr;
  std::uint64_t map_len = 0;
  memory_region window{};
  int pinned_for = -1;  // the GPU they are pinned for; -1: not pinned
  enum { free, staging, io, copying } state = free;
  std::uint64_t off = 0, len = 0, got = 0;  // file range of the I/O
  std::uint64_t deliver = 0;                // a read's bytes its device copy delivers
  bool direct = false;
  bool nowait = false;  // a buffered read that must not wait for the disk (RWF_NOWAIT)
  int retries = 0;
  int reg = -1;  // the registered descriptor its I/O in flight names, if any
};

// Runs f; an error it throws is returned instead.
template <class F>
std::optional<error> catching(F&& f) {
  try {
    f();
  } catch (const error& e) {
    return e;
  } catch (const std::exception& e) {
    return error(errc::internal, "io", "", e.what());
  }
  return std::nullopt;
}

constexpr std::uint64_t wake_tag = ~0ull;  // the completion of the worker's eventfd read

}  // namespace

struct file_engine::impl {
  transfer_engine& xfer;
  device_registry& devices;
  registration_cache& cache;
  settings cfg;
  ferry::stats st;
  // The counters every request touches, looked up once (a lookup takes the set's lock).
  counter &beside_others = st.get("requests.beside_others"), &reads_direct_n = st.get("reads.direct"),
          &reads_in_place = st.get("reads.in_place"), &reads_buffered = st.get("reads.buffered"),
          &reads_mapped = st.get("reads.mapped"),
          &bytes_read = st.get("bytes_read"), &bytes_written = st.get("bytes_written"),
          &reads_missed_cache = st.get("reads.missed_cache"), &files_registered = st.get("files.registered");
  struct worker;
  std::atomic<bool> stop{false};
  // Workers [0, live) run; the rest are made as the load asks for them (grow). A thread costs its
  // creator a copy of every loaded library's thread-local storage, under the loader's lock: in a
  // process that imported torch, a millisecond or more each, which a fresh process's first read
  // paid for every thread it would never use. The vector is sized once and never moves.
  std::vector<std::unique_ptr<worker>> workers;
  std::atomic<std::size_t> live{0};
  std::mutex grow_mu;  // making workers, and their threads
  std::vector<std::thread> threads;
  void grow(std::size_t want);
  bool inject_partial, inject_eintr;
  std::once_flag cufile_once;
  std::unique_ptr<cufile::backend> cufile_;
  std::mutex told_mu;
  std::set<std::string> told;  // paths whose cuFile fallback (or failed mapping) was logged
  // Pins of the file pages mapped reads copy from (null: mapped reads off, or no CUDA driver).
  std::unique_ptr<read_only_pins> mapped_pages;

  cufile::backend& cufile() {
    std::call_once(cufile_once, [&] { cufile_ = std::make_unique<cufile::backend>(cfg); });
    return *cufile_;
  }
  // cuFile for this job? (CUDA memory, backend not io_uring, and cuFile can serve the file)
  bool use_cufile(const job& j) { return use_cufile(*j.r.f, j.dev, j.r.write ? "file.write" : "file.read"); }
  bool use_cufile(file& f, const device* dev, const char* op) {
    if (cfg.file_backend == file_backend_kind::io_uring || !dev || dev->info().backend != device_kind::cuda) return false;
    std::string why;
    if (cufile().usable(f, why)) return true;
    if (cfg.file_backend == file_backend_kind::cufile) fail(errc::not_supported, op, f.path(), "FERRY_FILE_BACKEND=cufile: " + why);
    std::lock_guard l(told_mu);
    if (told.insert(f.path()).second) log::info("io", "{}: cuFile not used ({}); io_uring instead", f.path(), why);
    return false;
  }

  impl(transfer_engine& x, device_registry& d, registration_cache& c, const settings& s);
  ~impl();

  // ---- a worker: one ring, FERRY_IO_DEPTH slots shared by the requests it runs at once ----------
  // A request goes to the worker with the least work (see file_engine::start), so requests that
  // come together run on different workers: buffered I/O that hits the page cache is a copy by the
  // kernel, and one ring's async workers take a burst of such copies one after another. A worker
  // takes requests from its queue while a slot is free; each issues I/O into free slots in
  // turn (one per round, so a large request does not starve a small one). Device copies of staged
  // data go to the transfer engine; its completions come back through an eventfd the ring reads, so
  // one wait sees file I/O, copies and new requests alike.
  struct worker {
    impl& e;
    io_uring ring{};
    int wake_fd = -1;
    std::uint64_t wake_buf = 0;
    std::atomic<bool> asleep{false};  // from its look at the queue to the end of its wait: new requests write wake_fd
    // Its own lock, so that submitting threads and workers meet only pairwise (a lock of all the
    // queues made every worker's round wait for every submission).
    std::mutex qmu;
    // With qmu: jobs from queue[qhead] on wait (a vector and an index, not a deque: a deque's node
    // per few jobs would be allocated by the submitting thread and freed by this one).
    std::vector<job> queue;
    std::size_t qhead = 0;
    std::atomic<std::size_t> queued{0};  // jobs waiting, for submitters choosing a worker without its lock
    std::condition_variable cv;       // with qmu: its queue got work, or stop (it waits here when it runs nothing)
    std::atomic<std::size_t> running_now{0};  // requests it runs (as of its last round)
    std::vector<slot> slots;
    std::list<running> runs;
    bool to_submit = false;
    std::uint64_t ops = 0;
    std::mutex copied_mu;
    std::vector<std::pair<std::size_t, std::optional<error>>> copied;  // device copies the engine finished
    // Registered descriptors (io_uring's fixed files): I/O on one takes no reference on the open
    // file per request. Without them, workers reading one file all write its reference count, one
    // cache line, twice per request. One slot per (file, O_DIRECT or not) this worker uses, the
    // least recently used replaced. A registered descriptor keeps its file open in the kernel after
    // ferry closed it (a deleted file keeps its space), so slots unused for a second are let go,
    // and all of them when the worker has had nothing to do for a second. A slot is never replaced
    // or let go while an I/O naming it is in flight: the kernel looks the slot up when it issues
    // the I/O, which for one handed to its async workers is later than the submission.
    struct reg {
      std::uint64_t key = 0;   // file id x 2 + O_DIRECT; 0: empty
      std::uint64_t used = 0;  // the round it was last used in
      int inflight = 0;        // I/Os in flight that name it
    };
    std::vector<reg> regs;  // empty: the kernel registers no sparse table (older than 5.19)
    std::size_t last_reg = 0;
    // Keys met once and not registered: a file is registered at its second request here, so that
    // requests each on another file (a server's small reads of many files) cost no registration.
    std::array<std::uint64_t, 8> met{};
    std::size_t met_next = 0;
    std::uint64_t round = 1, swept_round = 0;
    std::chrono::steady_clock::time_point swept = std::chrono::steady_clock::now();

    explicit worker(impl& en) : e(en), slots(static_cast<std::size_t>(en.cfg.io_depth)) {
      int r = io_uring_queue_init(static_cast<unsigned>(std::max(8, 4 * e.cfg.io_depth)), &ring, 0);
      if (r < 0) fail_errno(-r, "io.ring", "io_uring_queue_init", "io_uring unavailable");
      wake_fd = ::eventfd(0, EFD_CLOEXEC);
      if (wake_fd < 0) {
        int err = errno;
        io_uring_queue_exit(&ring);
        fail_errno(err, "io.ring", "eventfd");
      }
      arm_wake();
      if (io_uring_register_files_sparse(&ring, 32) == 0) regs.resize(32);
      // The kernel's workers for this ring's I/O that cannot complete at once: as many as the ring
      // holds, not its default of four per core. A file system that does not answer (a hung mount)
      // keeps a worker per stuck read; on a small machine the default let a few of those stall
      // every large read of the ring behind them. (Zero leaves the unbounded kind as it is.)
      unsigned most[2] = {static_cast<unsigned>(std::max(8, 4 * e.cfg.io_depth)), 0};
      io_uring_register_iowq_max_workers(&ring, most);
    }
    ~worker() {
      io_uring_queue_exit(&ring);
      ::close(wake_fd);
    }
    // Its queue got work (or stop): the condition variable when it runs nothing, else the ring.
    void wake() {
      cv.notify_one();
      if (asleep.exchange(false)) {
        std::uint64_t one = 1;
        [[maybe_unused]] auto n = ::write(wake_fd, &one, sizeof one);
      }
    }
    io_uring_sqe* sqe() {
      io_uring_sqe* q = io_uring_get_sqe(&ring);
      if (!q) {
        io_uring_submit(&ring);
        q = io_uring_get_sqe(&ring);
      }
      if (!q) fail(errc::internal, "io.submit", "io_uring", "no submission queue entry free");
      to_submit = true;
      return q;
    }
    void arm_wake() {
      io_uring_sqe* q = sqe();
      io_uring_prep_read(q, wake_fd, &wake_buf, sizeof wake_buf, 0);
      io_uring_sqe_set_data64(q, wake_tag);
    }
    std::size_t index(const slot& s) const { return static_cast<std::size_t>(&s - slots.data()); }
    slot* free_slot() {
      for (auto& s : slots)
        if (!s.r) return &s;
      return nullptr;
    }
    int slots_busy() const {
      int n = 0;
      for (auto& s : slots) n += s.r != nullptr;
      return n;
    }
    void release(slot& s) {
      s.r->busy--;
      s.r = nullptr;
      s.held.reset();
      s.buf = nullptr;
      s.state = slot::free;
      unmap(s);
    }
    void unmap(slot& s) {
      if (!s.map) return;
      if (s.pinned_for >= 0) e.mapped_pages->unpin(s.map, s.pinned_for);  // never kept (read_only_pins)
      s.pinned_for = -1;
      ::munmap(s.map, s.map_len);
      s.map = nullptr;
    }
    bool map_window(slot& s);
    // The registered slot of f's descriptor fd, registering it if need be; -1: use fd itself.
    int registered(const file& f, bool direct, int fd) {
      if (regs.empty() || fd < 0) return -1;
      const std::uint64_t key = f.id() * 2 + (direct ? 1 : 0);
      std::size_t pick = last_reg;
      if (regs[pick].key != key) {
        std::size_t lru = regs.size();  // the least recently used of those with nothing in flight
        for (pick = 0; pick < regs.size() && regs[pick].key != key; ++pick)
          if (!regs[pick].inflight && (lru == regs.size() || regs[pick].used < regs[lru].used)) lru = pick;
        if (pick == regs.size()) {
          if (std::find(met.begin(), met.end(), key) == met.end()) {
            met[met_next++ % met.size()] = key;
            return -1;
          }
          if (lru == regs.size()) return -1;  // every slot busy
          pick = lru;
          if (io_uring_register_files_update(&ring, static_cast<unsigned>(pick), &fd, 1) != 1) return -1;
          regs[pick].key = key;
          ++t.registered;
        }
      }
      regs[pick].used = round;
      ++regs[pick].inflight;
      last_reg = pick;
      return static_cast<int>(pick);
    }
    // Lets go of registered descriptors: those unused since the last sweep (at most one sweep a
    // second), or all of them; never one an I/O in flight (or prepared) names.
    void unregister(std::chrono::steady_clock::time_point now, bool all) {
      if (regs.empty() || (!all && now - swept < std::chrono::seconds(1))) return;
      for (std::size_t i = 0; i < regs.size(); ++i)
        if (regs[i].key && !regs[i].inflight && (all || regs[i].used <= swept_round)) {
          int none = -1;
          io_uring_register_files_update(&ring, static_cast<unsigned>(i), &none, 1);
          regs[i] = {};
        }
      swept = now;
      swept_round = round;
    }
    bool registering() const {
      for (const reg& g : regs)
        if (g.key) return true;
      return false;
    }
    void submit_io(slot& s) {
      running& r = *s.r;
      file& f = *r.j.r.f;
      int fd = s.direct ? f.direct_fd() : f.fd();
      io_uring_sqe* q = sqe();  // first: it may throw, and a registered slot is counted in flight from here
      const int fixed = registered(f, s.direct, fd);
      s.reg = fixed;
      auto* p = s.buf + s.got;
      auto n = static_cast<unsigned>(s.len - s.got);
      auto off = static_cast<__u64>(s.off + s.got);
      if (r.j.r.write) io_uring_prep_write(q, fixed >= 0 ? fixed : fd, p, n, off);
      else io_uring_prep_read(q, fixed >= 0 ? fixed : fd, p, n, off);
      if (fixed >= 0) q->flags |= IOSQE_FIXED_FILE;
      if (s.nowait) q->rw_flags = RWF_NOWAIT;
      // Buffered I/O that hits the page cache completes inline: the kernel copies during submit, on
      // this thread, one copy at a time. For a small copy that is cheaper than the hand-off to an
      // io-wq kernel thread and back; larger ones go to io-wq (IOSQE_ASYNC) so that the copies of
      // one request, and of the requests sharing this worker, run in parallel. Inline never blocks:
      // what would wait for the disk is punted to io-wq by the kernel.
      if (!s.direct && n > e.cfg.io_inline) q->flags |= IOSQE_ASYNC;
      io_uring_sqe_set_data64(q, static_cast<__u64>(index(s)));
      s.state = slot::io;
    }
    // A device copy through the transfer engine; its completion comes back through wake_fd.
    void copy(slot& s, void* dst, const void* src, std::uint64_t n, const memory_region* dst_region,
              const memory_region* src_region) {
      transfer_request q{dst, src, n, dst_region, src_region};
      std::size_t i = index(s);
      e.xfer.submit({&q, 1}, {s.r->j.b->until()}, [this, i](std::span<const request_result> res) {
        std::optional<error> err;
        if (res[0].state != request_state::done)
          err = res[0].err ? *res[0].err : error(errc::internal, "file.copy", "", "device copy did not finish");
        {
          std::lock_guard l(copied_mu);
          copied.emplace_back(i, std::move(err));
        }
        std::uint64_t one = 1;
        [[maybe_unused]] auto w = ::write(wake_fd, &one, sizeof one);
      });
    }
    // Applies test-only fault injection to a completion.
    int inject(int res) {
      ++ops;
      if (e.inject_eintr && ops % 5 == 0) return -EINTR;
      // A partial completion: fewer bytes than asked, on a 4 KiB boundary (as O_DIRECT would).
      if (e.inject_partial && ops % 3 == 0 && res > static_cast<int>(2 * 4096))
        return static_cast<int>(align_down(static_cast<std::uint64_t>(res) / 2, 4096));
      return res;
    }
    // Waits for a completion, at most until `until`; false on timeout.
    bool wait_one(io_uring_cqe** cqe, std::chrono::steady_clock::time_point until) {
      for (;;) {
        auto now = std::chrono::steady_clock::now();
        if (now >= until) return io_uring_peek_cqe(&ring, cqe) == 0;
        auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(until - now);
        __kernel_timespec ts{static_cast<long long>(left.count() / 1000000000), static_cast<long long>(left.count() % 1000000000)};
        int r = io_uring_wait_cqe_timeout(&ring, cqe, &ts);
        if (r == 0) return true;
        if (r == -ETIME) return false;
        if (r != -EINTR) fail_errno(-r, "io.wait", "io_uring_wait_cqe_timeout");
      }
    }

    // Work items this round ended, told to their batches at its end (report).
    struct ended {
      std::shared_ptr<transfer_batch::state> b;
      std::size_t idx;
      std::uint64_t len;
      std::optional<error> err;
    };
    std::vector<ended> ends;
    std::vector<transfer_batch::state::item_end> together;
    std::list<running> spare;  // nodes of ended requests, reused
    std::vector<job> took;     // admit()'s, kept for its capacity
    std::vector<std::pair<std::uint64_t, int>> completed;  // a round's completions (tag, result)
    std::vector<std::pair<std::size_t, std::optional<error>>> copies;  // a round's finished device copies
    // Counted this round, added to the engine's counters at its end.
    struct {
      std::uint64_t beside = 0, direct = 0, in_place = 0, buffered = 0, mapped = 0, read = 0, written = 0, missed_cache = 0, registered = 0;
    } t;
    void done(job& j, std::uint64_t len, const error* x) { ends.push_back({std::move(j.b), j.idx, len, x ? std::optional<error>(*x) : std::nullopt}); }
    void report();

    void loop();
    bool admit();
    void start(job j);
    bool issue(running& r);
    void on_io(slot& s, int res);
    void on_copied(slot& s, const std::optional<error>& err);
    void abort(running& r, error x);
    void go_direct(slot& s);
    void plan_io(running& r);
    void end(running& r);
  };

};

file_engine::impl::impl(transfer_engine& x, device_registry& d, registration_cache& c, const settings& s)
    : xfer(x), devices(d), cache(c), cfg(s) {
  inject_partial = s.io_inject.find("partial") != std::string::npos;
  inject_eintr = s.io_inject.find("eintr") != std::string::npos;
  if (s.io_mapped) mapped_pages = read_only_pins::make(s.cuda_driver);
  const int n = s.io_threads > 0 ? s.io_threads : default_io_threads();
  workers.resize(static_cast<std::size_t>(n));
  // Two at first (one if that is all there may be): a first small read needs no more. The first
  // worker's failure (no io_uring) is the engine's.
  workers[0] = std::make_unique<worker>(*this);
  threads.emplace_back([w = workers[0].get()] {
    ::pthread_setname_np(::pthread_self(), "ferry-io");  // for top, perf and debuggers
    w->loop();
  });
  live = 1;
  st.get("workers.made").add(1);
  grow(2);
}

// Makes workers up to `want` (at most the configured number). A worker that cannot be made (no
// thread, no ring) leaves the engine with those it has.
void file_engine::impl::grow(std::size_t want) {
  want = std::min(want, workers.size());
  if (live.load(std::memory_order_acquire) >= want) return;
  std::lock_guard l(grow_mu);
  for (std::size_t k = live.load(); k < want && !stop; ++k) {
    try {
      workers[k] = std::make_unique<worker>(*this);
      threads.emplace_back([w = workers[k].get()] {
        ::pthread_setname_np(::pthread_self(), "ferry-io");
        w->loop();
      });
    } catch (const std::exception& e) {
      workers[k].reset();
      log::warn("io", "file engine: a worker more could not be made ({}); going on with {}", e.what(), k);
      return;
    }
    live.store(k + 1, std::memory_order_release);
    st.get("workers.made").add(1);
  }
}

file_engine::impl::~impl() {
  std::lock_guard g(grow_mu);
  stop = true;
  for (std::size_t k = 0; k < live.load(); ++k) {
    auto& w = workers[k];
    { std::lock_guard l(w->qmu); }  // a worker between its look at `stop` and its wait sees the wake
    w->wake();
  }
  for (auto& t : threads) t.join();
}

// Takes queued requests while a slot is free (waiting for one when it runs none); false: stop.
// Asleep from before it looks at the queue until the round's wait is over: a request queued after
// the look finds it set and wakes the ring (a wake that comes while it is still busy only makes
// the next wait return at once).
bool file_engine::impl::worker::admit() {
  took.clear();
  if (runs.empty()) {
    // Out of work: a short look for more before sleeping, so that batches that follow each other
    // closely (a GPU proxy's, a server's) find the worker awake instead of paying a wake-up each.
    constexpr auto spin = std::chrono::microseconds(30);
    const auto until = std::chrono::steady_clock::now() + spin;
    while (!queued.load(std::memory_order_relaxed) && !e.stop.load(std::memory_order_relaxed) && std::chrono::steady_clock::now() < until)
      std::this_thread::yield();
  }
  asleep = true;
  {
    std::unique_lock l(qmu);
    if (runs.empty()) {
      auto work = [&] { return e.stop.load() || qhead < queue.size(); };
      // Idle for a second: its registered descriptors go (it may sleep for long).
      if (registering() && !cv.wait_for(l, std::chrono::seconds(1), work)) {
        l.unlock();
        unregister(std::chrono::steady_clock::now(), true);
        l.lock();
      }
      cv.wait(l, work);
    }
    if (runs.empty() && qhead == queue.size()) return false;  // stopping, nothing left
    while (qhead < queue.size() && runs.size() + took.size() < slots.size()) took.push_back(std::move(queue[qhead++]));
    // Taken jobs leave moved-from entries behind: dropped when the queue empties, or once they
    // are half of it (a queue that never empties stays bounded).
    if (qhead == queue.size() || qhead * 2 >= queue.size()) {
      queue.erase(queue.begin(), queue.begin() + static_cast<std::ptrdiff_t>(qhead));
      qhead = 0;
    }
    queued = queue.size() - qhead;
    running_now = runs.size() + took.size();
  }
  for (auto& j : took) {
    // Counted: a request that starts beside others on this worker (not behind them).
    if (!runs.empty()) ++t.beside;
    start(std::move(j));
  }
  return true;
}

void file_engine::impl::worker::loop() {
  while (admit()) {
    // Issue I/O for every request in turn, one slot each per round.
    for (bool more = true; more;) {
      more = false;
      for (auto& r : runs)
        if (auto x = catching([&] { more = issue(r) || more; })) abort(r, *x);
    }
    if (to_submit) {
      int n = io_uring_submit(&ring);
      if (n < 0) fail_errno(-n, "io.submit", "io_uring_submit");
      to_submit = false;
    }
    // Wait for a completion, new work, or the nearest deadline (cancellation is noticed within 50 ms).
    auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(50);
    for (auto& r : runs) until = std::min(until, r.j.b->until());
    io_uring_cqe* first = nullptr;
    if (!runs.empty()) wait_one(&first, until);  // (it is handled with the others below)
    asleep = false;
    unsigned head;
    io_uring_cqe* cqe;
    completed.clear();
    io_uring_for_each_cqe(&ring, head, cqe) completed.emplace_back(io_uring_cqe_get_data64(cqe), cqe->res);
    io_uring_cq_advance(&ring, static_cast<unsigned>(completed.size()));
    for (auto [tag, res] : completed) {
      if (tag == wake_tag) {
        arm_wake();
        continue;
      }
      if (tag >= slots.size() || !slots[tag].r) continue;  // a cancellation's own completion
      slot& s = slots[tag];
      if (s.reg >= 0) --regs[static_cast<std::size_t>(s.reg)].inflight, s.reg = -1;
      running& r = *s.r;
      auto x = catching([&] { on_io(s, res); });
      if (s.r && s.state == slot::free) release(s);
      if (x) abort(r, *x);
    }
    copies.clear();
    {
      std::lock_guard l(copied_mu);
      copies.swap(copied);
    }
    for (auto& [i, err] : copies) {
      slot& s = slots[i];
      running& r = *s.r;
      auto x = catching([&] { on_copied(s, err); });
      if (s.r && s.state == slot::free) release(s);
      if (x) abort(r, *x);
    }
    // Deadlines and cancellation; then the requests that are over.
    auto now = std::chrono::steady_clock::now();
    unregister(now, false);
    ++round;
    for (auto& r : runs) {
      if (r.err) continue;
      const char* op = r.j.r.write ? "file.write" : "file.read";
      if (r.j.b->cancelled) abort(r, error(errc::cancelled, op, r.j.r.f->path(), "cancelled"));
      else if (now >= r.j.b->until() && !(r.issued() && !r.busy))
        abort(r, error(errc::timeout, op, r.j.r.f->path(), "deadline passed"));
    }
    for (auto it = runs.begin(); it != runs.end();) {
      if (!it->busy && (it->err || it->issued())) {
        end(*it);
        *it = running{};  // lets go of its file, memory and batch now
        spare.splice(spare.begin(), runs, it++);
      } else {
        ++it;
      }
    }
    running_now = runs.size();
    report();
  }
}

void file_engine::impl::worker::start(job j) {
  const char* op = j.r.write ? "file.write" : "file.read";
  if (j.b->cancelled) {
    error c(errc::cancelled, "io.request", fmt::format("request {} {}", j.idx, j.r.f->path()), "batch cancelled before it ran");
    return done(j, 0, &c);
  }
  // cuFile's calls block: a worker runs them one at a time, beside nothing else.
  if (auto x = catching([&] {
        if (!e.use_cufile(j)) return;
        auto& b = *j.b;
        std::uint64_t moved = 0;
        auto progress = [&](std::uint64_t n) {
          moved += n;
          b.progress(j.idx, n);
        };
        try {
          if (j.r.write) {
            e.cufile().write(*j.r.f, j.dev->info().ordinal, j.r.mem, j.r.offset, j.r.bytes, e.cfg.io_chunk, b.until(), progress);
          } else {
            std::uint64_t size0 = j.r.f->size();
            std::uint64_t n = j.r.offset >= size0 ? 0 : std::min(j.r.bytes, size0 - j.r.offset);
            std::uint64_t got =
                n ? e.cufile().read(*j.r.f, j.dev->info().ordinal, j.r.mem, j.r.offset, n, 64ull << 20, b.until(), progress) : 0;
            if (got < n)
              fail(errc::io_error, "file.read", fmt::format("{} offset {}", j.r.f->path(), j.r.offset + got),
                   "the file ended early (truncated while reading?)");
          }
        } catch (const error& probe) {
          // The probe: if cuFile's first transfer on a file fails, auto mode falls back for good.
          if (e.cfg.file_backend == file_backend_kind::cufile || moved > 0) throw;
          e.cufile().refuse(*j.r.f, probe.what());
          log::info("io", "{}: cuFile probe failed ({}); io_uring instead", j.r.f->path(), probe.what());
          return;
        }
        e.st.get("requests.cufile").add();
        {
          std::lock_guard l(b.mu);
          b.results[j.idx].path = transfer_path::direct;
        }
        b.finish(j.idx, 0, nullptr);
        b.item_done();
        j.b = nullptr;  // done
      })) {
    return done(j, 0, &*x);
  }
  if (!j.b) return;

  running r;
  r.j = std::move(j);
  file& f = *r.j.r.f;
  const std::string& path = f.path();
  auto x = catching([&] {
    r.lo = r.j.r.offset;
    r.hi = r.j.r.offset + r.j.r.bytes;
    if (!r.j.r.write) {
      // The pieces of one request share the size it was cut at, so that a file cut short under them
      // fails the request instead of leaving a hole in what reads as a short read.
      r.size0 = r.j.size ? *r.j.size : f.size();
      r.hi = std::min(r.hi, r.size0);
      if (r.lo >= r.hi) return;  // entirely past the end: a short (empty) read
      if (e.cfg.io_direct == direct_io::always && f.direct_fd() < 0)
        fail(errc::not_supported, op, path, "O_DIRECT refused here (FERRY_IO_DIRECT=always)");
      // A small read in automatic mode first asks the page cache only (RWF_NOWAIT: no waiting for
      // the disk); what it does not find there is then read with O_DIRECT (on_io). That costs
      // nothing when the page cache has the range, where asking cachestat first would cost a system
      // call per read. A larger read asks cachestat once and is planned accordingly.
      const bool nowait = e.cfg.io_direct == direct_io::automatic && f.direct_fd() >= 0 &&
                          r.hi - r.lo <= std::min(e.cfg.io_inline, e.cfg.io_chunk);
      const bool direct = !nowait && reads_direct(e.cfg, f, r.lo, r.hi - r.lo);
      // Buffered into host memory: the kernel copies from the page cache straight into the
      // destination (no staging, no second copy); exactly the asked range, nothing past it.
      const bool in_place = !r.j.dev && !direct;
      // Into a GPU from the page cache: its copy engine reads the file's pages themselves, pinned.
      // Not a small read that asks the page cache first, nor a range the page cache lacks (this
      // thread would read it from the disk as it maps it); not a sim device, whose copies are the
      // CPU's and would fault on pages a truncation took away.
      r.mapped = r.j.dev && r.j.dev->info().backend == device_kind::cuda && !direct && !nowait && e.mapped_pages &&
                 ((e.cfg.io_direct == direct_io::automatic && f.direct_fd() >= 0) || cached_fraction(f.fd(), r.lo, r.hi - r.lo) >= 0.9);
      const std::uint64_t a = direct ? f.dio_align() : in_place ? 1 : 4096;
      r.add_part(align_down(r.lo, a), align_up(r.hi, a), direct, nowait);
      ++(direct ? t.direct : in_place ? t.in_place : r.mapped ? t.mapped : t.buffered);
      log::debug("io", "read {} [{}, {}) {} into {}", path, r.lo, r.hi, direct ? "O_DIRECT" : "buffered",
                 r.j.dev ? r.j.dev->id() : "host");
    } else {
      if (!f.writable()) fail(errc::permission_denied, op, path, "opened read-only");
      // O_DIRECT for the aligned middle; an unaligned head and tail go through the page cache.
      const bool direct = e.cfg.io_direct != direct_io::never && f.direct_fd() >= 0;
      const std::uint64_t a = direct ? f.dio_align() : 1;
      std::uint64_t mid_lo = direct ? align_up(r.lo, a) : r.lo, mid_hi = direct ? align_down(r.hi, a) : r.hi;
      if (mid_lo >= mid_hi) mid_lo = mid_hi = r.hi;  // too small for O_DIRECT: all buffered
      if (r.lo < mid_lo) r.add_part(r.lo, mid_lo, false);
      if (mid_lo < mid_hi) r.add_part(mid_lo, mid_hi, direct);
      if (mid_hi < r.hi) r.add_part(std::max(mid_hi, r.lo), r.hi, false);
    }
    plan_io(r);
  });
  if (x) return done(r.j, 0, &*x);
  if (!r.parts) return done(r.j, 0, nullptr);
  // A node from the spare list: no allocation per request once the worker has run as many at once.
  if (spare.empty()) {
    runs.push_back(std::move(r));
  } else {
    runs.splice(runs.end(), spare, spare.begin());
    runs.back() = std::move(r);
  }
}

// Its parts planned: the staging pool it needs (device memory or an O_DIRECT part), the bytes per
// I/O, and whether it is one I/O.
void file_engine::impl::worker::plan_io(running& r) {
  bool staged = r.j.dev != nullptr && !r.mapped;
  for (std::size_t k = 0; k < r.parts; ++k) staged = staged || r.part_of[k].direct;
  r.pool = staged ? &e.xfer.staging_for(r.j.where) : nullptr;
  std::uint64_t most = r.mapped ? e.cfg.io_mapped
                       : r.pool ? std::min<std::uint64_t>(e.cfg.io_chunk, r.pool->buffer_bytes())
                                : e.cfg.io_chunk;
  r.chunk = std::max<std::uint64_t>(4096, align_down(most, 4096));
  r.one_io = r.parts == 1 && r.part_of[0].end - r.part_of[0].pos <= r.chunk;
}

// Issues the next I/O of `r` into a free slot; false when it has none to issue or no slot is free.
bool file_engine::impl::worker::issue(running& r) {
  if (r.err) return false;
  while (!r.issued() && r.part_of[r.next].pos >= r.part_of[r.next].end) ++r.next;
  if (r.issued() || r.busy >= static_cast<int>(slots.size())) return false;
  // Mapped pieces: two at a time per thread keep the copy engine busy (each is large); more would
  // only pin more of the page cache at once.
  if (r.mapped && std::count_if(slots.begin(), slots.end(), [](const slot& x) { return x.map != nullptr; }) >= 2) return false;
  slot* s = free_slot();
  if (!s) return false;
  auto& p = r.part_of[r.next];
  const bool write = r.j.r.write;
  // Staging: device memory (unless mapped), or an O_DIRECT range (aligned buffers). Buffered I/O on
  // host memory goes to/from the request's memory itself.
  const bool staged = (r.j.dev && !r.mapped) || p.direct;
  if (staged) {
    // One buffer waited for (until the deadline) when this worker has nothing else in flight; else
    // only one free now: a busy pool makes shallower pipelines, never a stall.
    s->held = slots_busy() == 0 ? r.pool->get(r.j.b->until()) : r.pool->try_get();
    if (!s->held) return false;
    s->buf = s->held.data();
  }
  s->r = &r;
  r.busy++;
  s->off = p.pos;
  s->len = std::min<std::uint64_t>(r.chunk, p.end - p.pos);
  s->got = 0;
  s->direct = p.direct;
  s->nowait = p.nowait;
  s->retries = 0;
  p.pos += s->len;
  auto* mem = static_cast<std::byte*>(r.j.r.mem);
  if (r.mapped && !map_window(*s)) {
    // Not mappable (or not pinnable) here: this request is staged from now on, this piece included.
    p.pos -= s->len;
    r.busy--;
    s->r = nullptr;
    r.mapped = false;
    plan_io(r);
    return issue(r);
  }
  try {
    if (r.mapped) {
      return true;  // its copy is under way
    } else if (!staged) {
      s->buf = mem + (s->off - r.lo);
      submit_io(*s);
    } else if (!write) {
      submit_io(*s);
    } else if (r.j.dev) {
      s->state = slot::staging;
      copy(*s, s->buf, mem + (s->off - r.lo), s->len, &s->held.region(), &r.j.where);
    } else {
      std::memcpy(s->buf, mem + (s->off - r.lo), s->len);
      submit_io(*s);
    }
  } catch (...) {
    release(*s);
    throw;
  }
  return true;
}

// Maps the file's pages of the slot's range, pins them read-only and starts their copy to the
// device; false (nothing started, nothing held) when the pages cannot be mapped or pinned here.
bool file_engine::impl::worker::map_window(slot& s) {
  running& r = *s.r;
  file& f = *r.j.r.f;
  const std::uint64_t lo = std::max(s.off, r.lo), hi = std::min(s.off + s.len, r.hi);
  const std::uint64_t page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  const std::uint64_t moff = align_down(lo, page), mlen = align_up(hi, page) - moff;
  // Populated now: the pages are cached (the plan asked), and pinning mapped pages is cheaper.
  void* m = ::mmap(nullptr, mlen, PROT_READ, MAP_SHARED | MAP_POPULATE, f.fd(), static_cast<off_t>(moff));
  if (m == MAP_FAILED) {
    std::lock_guard l(e.told_mu);
    if (e.told.insert(f.path() + " map").second)
      log::debug("io", "{}: cannot map ({}); its reads into device memory are staged", f.path(), std::strerror(errno));
    return false;
  }
  s.map = m;
  s.map_len = mlen;
  const std::byte* src = static_cast<const std::byte*>(m) + (lo - moff);
  if (auto x = catching([&] {
        s.window = e.mapped_pages->pin(m, mlen, r.j.dev->info().ordinal);
        s.pinned_for = r.j.dev->info().ordinal;
      })) {
    unmap(s);
    std::lock_guard l(e.told_mu);
    if (e.told.insert(f.path() + " map").second)
      log::debug("io", "{}: cannot pin its mapped pages ({}); its reads into device memory are staged", f.path(), x->what());
    return false;
  }
  s.got = hi - s.off;  // what the copy covers, checked against the file's size when it is done
  s.deliver = hi - lo;
  s.state = slot::copying;
  copy(s, static_cast<std::byte*>(r.j.r.mem) + (lo - r.lo), src, hi - lo, &r.j.where, &s.window);
  return true;
}

void file_engine::impl::worker::on_io(slot& s, int res) {
  running& r = *s.r;
  const std::string& path = r.j.r.f->path();
  const bool write = r.j.r.write;
  const char* op = write ? "file.write" : "file.read";
  res = inject(res);
  s.state = slot::free;  // its completion is consumed; a resubmission or a copy sets it again
  if (r.err) return;     // cancelled: nothing more for this request
  if (s.nowait && (res == -EAGAIN || res == -EOPNOTSUPP || res == -EINVAL)) {
    // The page cache lacks (the rest of) the range. The request's only I/O, nothing delivered: it
    // is read with O_DIRECT instead, planned afresh. Otherwise (part delivered, or another I/O of it
    // under way: planning afresh would read that part twice) this I/O goes on buffered. A file
    // system that refuses RWF_NOWAIT (-EOPNOTSUPP; -EINVAL on older kernels) is read buffered.
    if (res == -EAGAIN && s.got == 0 && r.delivered == 0 && r.busy == 1) return go_direct(s);
    s.nowait = false;
    return submit_io(s);
  }
  if (res == -EINTR || res == -EAGAIN) {
    if (++s.retries > 100) fail_errno(-res, op, fmt::format("{} offset {}", path, s.off + s.got), "retried 100 times");
    e.st.get("io.retries").add();
    return submit_io(s);
  }
  if (res < 0) fail_errno(-res, op, fmt::format("{} offset {}", path, s.off + s.got));
  if (write && res == 0) fail(errc::io_error, op, fmt::format("{} offset {}", path, s.off + s.got), "wrote nothing (disk full?)");
  s.got += static_cast<std::uint64_t>(res);
  if (s.got < s.len && (write || res > 0)) {  // partial completion: ask for the rest
    e.st.get("io.partial").add();
    return submit_io(s);
  }
  if (write) {
    r.deliver(s.len);
    return release(s);
  }
  // The slot holds [s.off, s.off + s.got). A file that ends before the size seen at the start was
  // truncated under us: an error, never garbage.
  std::uint64_t have_hi = s.off + s.got;
  if (have_hi < std::min(s.off + s.len, r.hi))
    fail(errc::io_error, op, fmt::format("{} offset {}", path, have_hi),
         fmt::format("the file ended at {} but was {} bytes when the read started (truncated while reading?)", have_hi, r.size0));
  std::uint64_t lo = std::max(s.off, r.lo), hi = std::min(have_hi, r.hi);
  if (lo >= hi) return release(s);
  auto* dst = static_cast<std::byte*>(r.j.r.mem) + (lo - r.lo);
  if (r.j.dev) {
    s.deliver = hi - lo;
    s.state = slot::copying;
    return copy(s, dst, s.buf + (lo - s.off), hi - lo, &r.j.where, &s.held.region());
  }
  if (s.held) std::memcpy(dst, s.buf + (lo - s.off), hi - lo);
  r.deliver(hi - lo);
  release(s);
}

// A small read the page cache did not have: its slot freed, the request planned again as one
// O_DIRECT read through a staging buffer (issue() takes it up in the next round).
void file_engine::impl::worker::go_direct(slot& s) {
  running& r = *s.r;
  file& f = *r.j.r.f;
  const std::uint64_t a = f.dio_align();
  r.parts = 0;
  r.next = 0;
  r.mapped = false;
  r.add_part(align_down(r.lo, a), align_up(r.hi, a), true);
  plan_io(r);
  ++t.missed_cache;
  ++t.direct;
  release(s);
}

void file_engine::impl::worker::on_copied(slot& s, const std::optional<error>& err) {
  running& r = *s.r;
  const bool to_file = s.state == slot::staging;
  s.state = slot::free;
  if (r.err) return;
  if (err) throw *err;
  if (to_file) return submit_io(s);
  if (s.map) {
    // The pages copied were the file's when the copy began; a file cut short meanwhile fails the
    // read as a staged read would (its bytes past the new end are no longer the file's).
    struct stat st {};
    const std::uint64_t end = s.off + s.got;
    if (::fstat(r.j.r.f->fd(), &st) == 0 && static_cast<std::uint64_t>(st.st_size) < end)
      fail(errc::io_error, "file.read", fmt::format("{} offset {}", r.j.r.f->path(), st.st_size),
           fmt::format("the file ended at {} but was {} bytes when the read started (truncated while reading?)", st.st_size, r.size0));
  }
  r.deliver(s.deliver);
  release(s);
}

// The request's first error: it issues nothing more; its I/O in the kernel is cancelled (a buffer
// is reused, or the request's memory given back, only once its I/O has come back).
void file_engine::impl::worker::abort(running& r, error x) {
  if (!r.err) r.err = std::move(x);
  for (auto& s : slots)
    if (s.r == &r && s.state == slot::io) {
      io_uring_sqe* q = sqe();
      io_uring_prep_cancel64(q, static_cast<__u64>(index(s)), 0);
      io_uring_sqe_set_data64(q, wake_tag - 1);
    }
}

void file_engine::impl::worker::end(running& r) {
  if (!r.err) (r.j.r.write ? t.written : t.read) += r.delivered;
  done(r.j, r.delivered - r.reported, r.err ? &*r.err : nullptr);
}

// Tells the batches what this round ended, one lock per batch (the requests of a batch that end
// together are reported together), and the counters what it counted.
void file_engine::impl::worker::report() {
  auto flush = [](counter& c, std::uint64_t& n) {
    if (n) c.add(n);
    n = 0;
  };
  flush(e.beside_others, t.beside);
  flush(e.reads_direct_n, t.direct);
  flush(e.reads_in_place, t.in_place);
  flush(e.reads_buffered, t.buffered);
  flush(e.reads_mapped, t.mapped);
  flush(e.bytes_read, t.read);
  flush(e.bytes_written, t.written);
  flush(e.reads_missed_cache, t.missed_cache);
  flush(e.files_registered, t.registered);
  for (std::size_t a = 0; a < ends.size();) {
    std::size_t z = a;
    together.clear();
    for (; z < ends.size() && ends[z].b == ends[a].b; ++z)
      together.push_back({ends[z].idx, ends[z].len, ends[z].err ? &*ends[z].err : nullptr});
    ends[a].b->end_items(together);
    a = z;
  }
  ends.clear();
}

// ---- public ---------------------------------------------------------------------------------

file_engine::file_engine(transfer_engine& x, device_registry& d, registration_cache& c, const settings& s)
    : impl_(std::make_unique<impl>(x, d, c, s)) {}
file_engine::~file_engine() = default;
ferry::stats& file_engine::counters() noexcept { return impl_->st; }
transfer_engine& file_engine::transfers() noexcept { return impl_->xfer; }
registration_cache& file_engine::registrations() noexcept { return impl_->cache; }

transfer_batch file_engine::submit(std::span<const file_request> reqs, transfer_options o) {
  auto b = make_batch_state(reqs.size(), o, impl_->cfg.deadline);
  if (o.on) start_on(b, reqs, *o.on);
  else start(b, reqs);
  return make_batch(std::move(b));
}

transfer_batch file_engine::read_async(std::shared_ptr<file> f, std::uint64_t offset, void* dst, std::uint64_t bytes,
                                       stream& s, transfer_options o) {
  o.on = &s;
  file_request q{std::move(f), offset, dst, bytes, false};
  return submit({&q, 1}, o);
}

transfer_batch file_engine::write_async(std::shared_ptr<file> f, std::uint64_t offset, const void* src, std::uint64_t bytes,
                                        stream& s, transfer_options o) {
  o.on = &s;
  file_request q{std::move(f), offset, const_cast<void*>(src), bytes, true};
  return submit({&q, 1}, o);
}

void file_engine::submit(std::span<const file_request> reqs, transfer_options o, completion done) {
  auto b = make_batch_state(reqs.size(), o, impl_->cfg.deadline);
  if (reqs.empty()) return done({});
  b->on_done = std::move(done);
  if (o.on) start_on(b, reqs, *o.on);
  else start(b, reqs);
}

namespace {
// A request as errors name it.
std::string describe(const file_request& r, std::size_t i) {
  return fmt::format("request {} {} offset {} bytes {}", i, r.f->path(), r.offset, r.bytes);
}

// Refuses a request that cannot run, naming it.
void check_request(const file_request& r, std::size_t i) {
  if (!r.f) fail(errc::invalid_argument, "file.submit", fmt::format("request {}", i), "no file");
  if (!r.mem) fail(errc::invalid_argument, "file.submit", describe(r, i), "null memory pointer");
  if (r.bytes == 0) fail(errc::invalid_argument, "file.submit", describe(r, i), "zero length");
  if (r.offset + r.bytes < r.offset) fail(errc::out_of_range, "file.submit", describe(r, i), "offset + length overflows");
  if (r.write && !r.f->writable()) fail(errc::permission_denied, "file.submit", describe(r, i), "file opened read-only");
}
}  // namespace

void file_engine::start(const std::shared_ptr<transfer_batch::state>& b, std::span<const file_request> reqs) {
  impl& I = *impl_;
  // The thread's scratch vectors, borrowed (a completion run from inside this call may submit
  // again on this thread, and then borrows empty ones): a thread that submits batch after batch (a
  // GPU proxy's) allocates nothing here per batch.
  thread_local scratch spare;
  scratch mine = std::move(spare);
  std::vector<job>& jobs = mine.jobs;
  jobs.clear();
  jobs.reserve(reqs.size());
  std::vector<std::size_t> remote;
  memory_region last_mem;
  // A read is cut at the file's size as of its submission (one look per file of the batch, not one
  // per request): a file cut short under it then fails the read instead of reading short.
  file* sized = nullptr;
  std::uint64_t size = 0;
  const std::shared_ptr<file>* run = nullptr;  // the first request of the current run on one file
  {
    // More workers when the work asks for them: a worker for every FERRY_IO_DEPTH requests waiting
    // or running, and for every four I/O chunks of this batch (the bytes a new worker's copies
    // must cover to be worth its making; a 64 MiB first load takes two, a 4 GiB one all).
    std::uint64_t bytes = 0;
    for (auto& r : reqs) bytes += r.bytes;
    std::size_t busy = reqs.size();
    const std::size_t nl = I.live.load(std::memory_order_acquire);
    for (std::size_t k = 0; k < nl; ++k) busy += I.workers[k]->queued.load() + I.workers[k]->running_now.load();
    const auto depth = static_cast<std::size_t>(std::max(1, I.cfg.io_depth));
    I.grow(std::max<std::size_t>((busy + depth - 1) / depth, static_cast<std::size_t>(bytes / (4 * I.cfg.io_chunk))));
  }
  const std::size_t nw = I.live.load(std::memory_order_acquire);
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    const file_request& r = reqs[i];
    b->sizes[i] = r.bytes;
    b->bytes_total += r.bytes;
    if (r.f && (!run || run->get() != r.f.get())) run = &r.f;
    try {
      check_request(r, i);
      if (r.f->source()) {  // a remote file: its source moves the data (and classifies the memory)
        b->segs_left[i] = 1;
        b->results[i].path = transfer_path::none;
        remote.push_back(i);
        continue;
      }
      // Requests of a batch often land in one allocation (a landing area, a buffer cut in pieces):
      // what the last one's memory was classified as answers for the next within it.
      if (!(last_mem.size && last_mem.type != memory_type::unknown && last_mem.contains(reinterpret_cast<std::uintptr_t>(r.mem), r.bytes)))
        last_mem = I.cache.classify(r.mem, r.bytes);
      const memory_region& m = last_mem;
      if (m.type == memory_type::unknown)
        fail(errc::bad_address, "file.submit", describe(r, i), "memory is not mapped memory ferry knows (freed or invalid?)");
      if ((m.type == memory_type::device || m.type == memory_type::managed || m.type == memory_type::unified) && m.size &&
          !m.contains(reinterpret_cast<std::uintptr_t>(r.mem), r.bytes))
        fail(errc::out_of_range, "file.submit", describe(r, i), fmt::format("memory extends past its allocation on {}", m.device_id()));
      job j;
      j.b = b;
      j.idx = i;
      // The batch holds each local file its requests name, by the first reference of each run of
      // requests on one file (one per file, not one per request: the workers use the file by
      // pointer and never touch a reference count the submitting thread also touches). Remote files
      // are not held: their sources keep what they use, and the batch may end on a source's own
      // thread, which must not be the one to destroy that source.
      if (b->keep.empty() || b->keep.back().get() != r.f.get()) b->keep.push_back(*run);
      j.r = {r.f.get(), r.offset, r.mem, r.bytes, r.write};
      j.dev = (m.type == memory_type::device || m.type == memory_type::managed || m.type == memory_type::unified)
                  ? &I.devices.get(m.device, m.ordinal)
                  : nullptr;
      j.where = m;
      // Unified memory stays where it is while the request uses it (its pages may move otherwise).
      if (m.type == memory_type::unified) j.hold = std::make_shared<registration>(I.cache.acquire(r.mem, r.bytes));
      b->results[i].path = transfer_path::staged;
      if (!r.write) {
        if (sized != r.f.get()) sized = r.f.get(), size = r.f->size();
        j.size = size;
      }
      // A read from the page cache is cut into pieces for several workers (at 4 KiB-aligned file
      // offsets): one ring's io-wq runs a request's buffered copies nearly one after another,
      // several rings run in parallel. O_DIRECT I/O is asynchronous on one ring already (no io-wq).
      // Each piece is a segment of the request. The unit: into host memory, where the kernel copies
      // straight into the destination and the copy is the whole cost, the inline size (a piece is
      // one copy, a few of them already worth spreading); into device memory, where each I/O takes a
      // staging buffer of its own, an I/O chunk.
      const std::uint64_t unit = !j.dev && I.cfg.io_inline >= 64 * 1024 ? std::min(I.cfg.io_inline, I.cfg.io_chunk) : I.cfg.io_chunk;
      std::size_t pieces = std::min<std::uint64_t>(nw, r.bytes / std::max<std::uint64_t>(unit, 4096));
      if (pieces >= 2 && (r.write || reads_direct(I.cfg, *r.f, r.offset, r.bytes))) pieces = 1;
      if (pieces < 2) {
        b->segs_left[i] = 1;
        jobs.push_back(std::move(j));
        continue;
      }
      std::uint64_t step = (r.bytes + pieces - 1) / pieces, end = r.offset + r.bytes;
      std::vector<std::uint64_t> cuts = {r.offset};
      for (std::size_t k = 1; k < pieces; ++k) {
        std::uint64_t c = align_up(r.offset + k * step, 4096);
        if (c > cuts.back() && c < end) cuts.push_back(c);
      }
      cuts.push_back(end);
      b->segs_left[i] = static_cast<int>(cuts.size() - 1);
      I.st.get("requests.pieces").add(cuts.size() - 1);  // a read: its size was taken above
      for (std::size_t k = 0; k + 1 < cuts.size(); ++k) {
        job p = j;
        p.r.offset = cuts[k];
        p.r.bytes = cuts[k + 1] - cuts[k];
        p.r.mem = static_cast<std::byte*>(r.mem) + (cuts[k] - r.offset);
        jobs.push_back(std::move(p));
      }
    } catch (const error& e) {
      b->fail_now(i, e);
    }
  }
  {
    std::lock_guard l(b->mu);
    b->items_inflight = static_cast<int>(jobs.size() + remote.size());
  }
  if (!jobs.empty()) {
    // Each to the worker with the least work (queued and running, as the workers last said), the
    // first of equals: requests that come together spread over the workers, one after another they
    // stay on the first few (awake, their rings' kernel threads warm). Then each worker's share
    // under its own lock, and a wake.
    std::vector<std::size_t>& load = mine.load;
    load.resize(nw);
    for (std::size_t k = 0; k < nw; ++k) load[k] = I.workers[k]->queued.load() + I.workers[k]->running_now.load();
    std::vector<std::uint32_t>& to = mine.to;
    to.resize(jobs.size());
    std::vector<std::size_t>& first = mine.first;  // worker k's jobs: order[first[k] .. first[k + 1])
    first.assign(nw + 1, 0);
    for (std::size_t i = 0; i < jobs.size(); ++i) {
      to[i] = static_cast<std::uint32_t>(std::min_element(load.begin(), load.end()) - load.begin());
      ++load[to[i]];
      ++first[to[i] + 1];
    }
    for (std::size_t k = 0; k < nw; ++k) first[k + 1] += first[k];
    std::vector<std::size_t>& order = mine.order;
    order.resize(jobs.size());
    {
      std::vector<std::size_t>& at = mine.at;
      at.assign(first.begin(), first.end() - 1);
      for (std::size_t i = 0; i < jobs.size(); ++i) order[at[to[i]]++] = i;
    }
    for (std::size_t k = 0; k < nw; ++k) {
      if (first[k] == first[k + 1]) continue;
      impl::worker& w = *I.workers[k];
      {
        std::lock_guard l(w.qmu);
        for (std::size_t x = first[k]; x < first[k + 1]; ++x) w.queue.push_back(std::move(jobs[order[x]]));
        w.queued = w.queue.size() - w.qhead;
      }
      w.wake();
    }
  }
  jobs.clear();
  spare = std::move(mine);
  for (std::size_t i : remote) {
    const file_request& r = reqs[i];
    // The completion may run before start() returns, on any thread; the batch state outlives it
    // (the handle's destructor waits for items in flight).
    auto done = [b, i](std::uint64_t n, const error* e) {
      b->finish(i, n, e);
      b->item_done();
    };
    try {
      r.f->source()->start(r.write, r.offset, r.mem, r.bytes, b->until(), done);
    } catch (const error& e) {
      done(0, &e);
    } catch (const std::exception& e) {
      error err(errc::internal, "file.submit", r.f->path(), e.what());
      done(0, &err);
    }
  }
  I.st.get("requests.remote").add(remote.size());
}

std::uint64_t file_engine::read(file& f, std::uint64_t offset, void* dst, std::uint64_t bytes, transfer_options o) {
  // A non-owning shared_ptr: the caller's file outlives this synchronous call.
  file_request r{std::shared_ptr<file>(std::shared_ptr<file>{}, &f), offset, dst, bytes, false};
  transfer_batch b = submit({&r, 1}, o);
  b.wait();
  b.check();
  return b.results()[0].bytes_done;
}

void file_engine::write(file& f, std::uint64_t offset, const void* src, std::uint64_t bytes, bool fsync,
                        transfer_options o) {
  file_request r{std::shared_ptr<file>(std::shared_ptr<file>{}, &f), offset, const_cast<void*>(src), bytes, true};
  transfer_batch b = submit({&r, 1}, o);
  b.wait();
  b.check();
  if (fsync) f.sync();
}

// ---- stream order (transfer_options::on) --------------------------------------------------------

namespace {

// One request of a stream-ordered batch: a pipeline of chunks through a few staging buffers. Chunk
// k has the gate number seq0 + k. A read: the file side fills the chunk's buffer and releases k; the
// stream waits for k, copies the buffer into the destination and writes `started = k`, which frees
// the buffer for chunk k + slots. A write: the stream waits for k (the buffer is free), copies the
// source into it and writes `started = k`; the file side then writes it out and releases
// k + slots. Held by every callback that may still touch it, so its buffers stay until the stream
// passed its last copy and the file side its last I/O.
struct stream_op {
  std::shared_ptr<transfer_batch::state> b;
  std::size_t idx = 0;
  file_request r;
  file_engine* files = nullptr;
  stream_gates* gates = nullptr;
  stream_gates::gate* g = nullptr;
  std::uint32_t seq0 = 0;
  std::uint64_t chunk = 0;
  std::size_t n = 0;
  std::vector<pinned_pool::buffer> slots;
  std::shared_ptr<registration> hold;  // pageable memory pinned for the stream's copies, or unified memory kept in place
  std::mutex mu;
  std::optional<error> err;     // the first failure: later chunks are not read or written
  std::vector<bool> released;   // chunk k's number was released
  std::vector<bool> started_io; // a read: chunk k's read was started
  std::size_t settled = 0;      // chunks the batch has a result for

  std::uint64_t len(std::size_t k) const { return std::min(chunk, r.bytes - k * chunk); }
  std::uint64_t off(std::size_t k) const { return r.offset + k * chunk; }
  std::byte* slot(std::size_t k) const { return slots[k % slots.size()].data(); }
  std::uint32_t seq(std::size_t k) const { return seq0 + static_cast<std::uint32_t>(k); }
  std::string where(std::size_t k) const {
    return fmt::format("request {} {} offset {} (stream-ordered {}, chunk {} of {})", idx, r.f->path(), off(k),
                       r.write ? "write" : "read", k + 1, n);
  }
};
using op_ptr = std::shared_ptr<stream_op>;

// The batch learns the fate of chunk k; the request's item ends with its last chunk.
void settle(const op_ptr& op, std::size_t k, const error* e) {
  op->b->finish(op->idx, e ? 0 : op->len(k), e);
  bool last = false;
  {
    std::lock_guard l(op->mu);
    last = ++op->settled == op->n;
  }
  if (last) op->b->item_done();
}

// Releases chunk k's number once.
void release_chunk(const op_ptr& op, std::size_t k) {
  {
    std::lock_guard l(op->mu);
    if (op->released[k]) return;
    op->released[k] = true;
  }
  op->gates->release(*op->g, op->seq(k));
}

// The request failed: the stream is let past every chunk not yet released (what it then copies is
// not the file's; the result says so). Reads in flight release their own chunks when they end.
void fail_op(const op_ptr& op, const error& e) {
  std::vector<std::size_t> rest;
  {
    std::lock_guard l(op->mu);
    if (op->err) return;
    op->err = e;
    for (std::size_t k = 0; k < op->n; ++k)
      if (!op->released[k] && (op->r.write || !op->started_io[k])) {
        op->started_io[k] = true;  // a read never starts now
        rest.push_back(k);
      }
  }
  for (std::size_t k : rest) release_chunk(op, k);
}

error io_error(const stream_op& op, std::size_t k, const request_result& res) {
  if (res.err) return res.err->with_context(op.where(k));
  return error(errc::out_of_range, "file.read", op.where(k),
               fmt::format("the file ends within the range (read {} of {} bytes of the chunk)", res.bytes_done, op.len(k)));
}

// Starts the read of chunk k into its buffer, unless the request failed.
void read_chunk(const op_ptr& op, std::size_t k) {
  {
    std::lock_guard l(op->mu);
    if (op->err || op->started_io[k]) return;
    op->started_io[k] = true;
  }
  file_request q{op->r.f, op->off(k), op->slot(k), op->len(k), false};
  transfer_options o;
  o.until = op->b->until();
  op->files->submit({&q, 1}, o, [op, k](std::span<const request_result> res) {
    if (res[0].state != request_state::done || res[0].bytes_done != op->len(k)) {
      std::memset(op->slot(k), 0, op->len(k));  // never another file's bytes in the destination
      error e = io_error(*op, k, res[0]);
      release_chunk(op, k);
      fail_op(op, e);
      return;
    }
    release_chunk(op, k);
  });
}

void write_chunk(const op_ptr& op, std::size_t k) {
  file_request q{op->r.f, op->off(k), op->slot(k), op->len(k), true};
  transfer_options o;
  o.until = op->b->until();
  op->files->submit({&q, 1}, o, [op, k](std::span<const request_result> res) {
    if (res[0].state != request_state::done) {
      error e = io_error(*op, k, res[0]);
      settle(op, k, &e);
      return fail_op(op, e);
    }
    settle(op, k, nullptr);
    // Chunk k's buffer is free again: the chunk that uses it next may be copied into it.
    if (k + op->slots.size() < op->n) release_chunk(op, k + op->slots.size());
  });
}

// The stream reached chunk k's `started` (or the deadline came first).
void reached(const op_ptr& op, std::size_t k, bool yes) {
  if (!yes) {
    error e = op->b->cancelled
                  ? error(errc::cancelled, "file.stream_order", op->where(k),
                          "cancelled before the stream got there (its handle was destroyed or cancel() called; the stream is released)")
                  : error(errc::timeout, "file.stream_order", op->where(k),
                          "deadline passed before the stream got there (its earlier work had not finished; the stream is released)");
    settle(op, k, &e);
    return fail_op(op, e);
  }
  std::optional<error> failed;
  {
    std::lock_guard l(op->mu);
    failed = op->err;
  }
  if (!op->r.write) {  // chunk k is in the destination: its buffer takes chunk k + slots
    settle(op, k, failed ? &*failed : nullptr);
    if (k + op->slots.size() < op->n) read_chunk(op, k + op->slots.size());
    return;
  }
  if (failed) return settle(op, k, &*failed);
  write_chunk(op, k);  // the stream filled the buffer
}

}  // namespace

void file_engine::start_on(const std::shared_ptr<transfer_batch::state>& b, std::span<const file_request> reqs, stream& s) {
  impl& I = *impl_;
  stream_gates& gates = I.xfer.gates();
  device& dev = s.owner();
  memory_region near{memory_type::device, dev.info().backend, dev.info().ordinal, 0, 0, 0, nullptr};
  pinned_pool& pool = I.xfer.staging_for(near);
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    b->sizes[i] = reqs[i].bytes;
    b->bytes_total += reqs[i].bytes;
  }
  {
    std::lock_guard l(b->mu);
    b->items_inflight = 1;  // held until every request is on the stream: none completes the batch early
  }
  // Each request takes its buffers and goes onto the stream before the next takes any: a request
  // that waits for buffers waits for those of requests already on the stream (which the stream
  // frees as it passes them), never for those of a request still waiting to be enqueued.
  int items = 0;
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    const file_request& r = reqs[i];
    op_ptr op;
    try {
      check_request(r, i);
      memory_region m = I.cache.classify(r.mem, r.bytes);
      if (m.type == memory_type::unknown)
        fail(errc::bad_address, "file.submit", describe(r, i), "memory is not mapped memory ferry knows (freed or invalid?)");
      op = std::make_shared<stream_op>();
      op->b = b;
      op->idx = i;
      op->r = r;
      op->files = this;
      op->gates = &gates;
      op->chunk = pool.buffer_bytes();
      op->n = static_cast<std::size_t>((r.bytes + op->chunk - 1) / op->chunk);
      op->released.assign(op->n, false);
      op->started_io.assign(op->n, false);
      // The stream's copy engine reads / writes `mem` directly: pageable memory is pinned for it,
      // unified memory stays where it is.
      if ((m.type == memory_type::host_pageable && dev.info().backend == device_kind::cuda) || m.type == memory_type::unified)
        op->hold = std::make_shared<registration>(I.cache.acquire(r.mem, r.bytes));
      // One buffer at least (waiting for it is the back-pressure of a busy pool), the rest of the
      // pipeline's depth as far as the pool has them now.
      std::size_t nslots = std::min<std::size_t>(op->n, static_cast<std::size_t>(I.cfg.stream_slots));
      op->slots.push_back(pool.get(b->until()));
      while (op->slots.size() < nslots) {
        auto more = pool.try_get();
        if (!more) break;
        op->slots.push_back(std::move(more));
      }
      b->segs_left[i] = static_cast<int>(op->n);
      b->results[i].path = transfer_path::staged;
    } catch (const error& e) {
      b->fail_now(i, e);
      continue;
    }
    {
      std::lock_guard l(b->mu);
      ++b->items_inflight;
    }
    ++items;
    std::size_t enqueued = 0;  // chunks whose ops are all on the stream
    std::optional<error> refused;
    {
      auto o = gates.lock(s);
      op->g = &o.the_gate();
      for (std::size_t k = 0; k < op->n; ++k) {
        std::uint32_t q = o.take();
        if (k == 0) op->seq0 = q;
        if (refused) continue;  // numbers still taken for every chunk: released below
        try {
          auto* user = static_cast<std::byte*>(op->r.mem) + k * op->chunk;
          s.wait_value(o.finished(), q);
          if (op->r.write) s.copy(op->slot(k), user, op->len(k));
          else s.copy(user, op->slot(k), op->len(k));
          s.write_value(o.started(), q);
          ++enqueued;
        } catch (const error& e) {
          refused = e.with_context(op->where(k));
        }
      }
    }
    if (refused) {
      for (auto& sl : op->slots) std::memset(sl.data(), 0, sl.size());
      {
        std::lock_guard l(op->mu);
        op->err = refused;
      }
      for (std::size_t k = 0; k < op->n; ++k) {
        release_chunk(op, k);
        if (k >= enqueued) settle(op, k, &*refused);
      }
      if (enqueued) gates.watch(*op->g, op->seq(enqueued - 1), deadline::max(), {}, [op](bool) {});
    } else {
      // The buffers go back to the pool once the stream passed its last copy (no deadline: the
      // stream may still copy into or out of them until then).
      gates.watch(*op->g, op->seq(op->n - 1), deadline::max(), {}, [op](bool) {});
    }
    // The first chunks start before any chunk is watched: a read started when the stream passed
    // chunk k (chunk k + slots) must come after every chunk before it was started, so that a
    // failure of one lets the stream past the chunks after it only.
    if (!refused)
      for (std::size_t k = 0; k < std::min(enqueued, op->slots.size()); ++k) {
        if (op->r.write) release_chunk(op, k);  // every buffer is free
        else read_chunk(op, k);
      }
    for (std::size_t k = 0; k < enqueued; ++k)
      gates.watch(*op->g, op->seq(k), b->until(), [b] { return b->cancelled.load(); }, [op, k](bool yes) { reached(op, k, yes); });
  }
  I.st.get("requests.stream_ordered").add(static_cast<std::uint64_t>(items));
  b->item_done();  // the hold taken above
}

void file_engine::prepare(file& f, const device& dev) { impl_->use_cufile(f, &dev, "file.prepare"); }

file_backend_choice file_engine::backend_for(const std::string& path) {
  file_backend_choice c;
  c.backend = "io_uring";
  capability uring = probe_io_uring();
  if (!uring.available) {
    c.reason = "io_uring unavailable: " + uring.reason;
    return c;
  }
  // O_DIRECT on a scratch file in the directory (or on the file itself).
  std::string probe = path;
  struct stat st{};
  bool dir = ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
  if (dir) {
    probe = path + "/.ferry-odirect-probe-XXXXXX";
    int t = ::mkstemp(probe.data());
    if (t >= 0) ::close(t);
  }
  int fd = ::open(probe.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  c.direct = fd >= 0;
  if (fd >= 0) {
    struct statx sx{};
    if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN))
      c.align = std::max<std::uint32_t>({sx.stx_dio_offset_align, sx.stx_dio_mem_align, 512u});
    ::close(fd);
  }
  if (dir) ::unlink(probe.c_str());
  bool cuda = impl_->devices.cuda_status().available;
  capability cf = probe_cufile(impl_->cfg, cuda, path);
  std::string direct = c.direct ? fmt::format("O_DIRECT with {}-byte alignment", c.align ? c.align : 4096)
                                : "no O_DIRECT here (buffered reads only)";
  if (impl_->cfg.file_backend == file_backend_kind::io_uring) {
    c.reason = "FERRY_FILE_BACKEND=io_uring; " + direct;
  } else if (impl_->cfg.file_backend == file_backend_kind::automatic && !cufile::nvidia_fs_loaded()) {
    c.reason = fmt::format("io_uring, {}; cuFile not tried: the nvidia-fs driver is not loaded (FERRY_FILE_BACKEND=cufile "
                           "uses its compatibility mode anyway; probe: {})", direct, cf.available ? "handle registration works here" : cf.reason);
  } else if (cf.available) {
    c.backend = "cufile";
    c.reason = fmt::format("cuFile (driver open, handle registration works here) for GPU memory; io_uring, {}, for the rest", direct);
  } else {
    c.reason = fmt::format("io_uring, {}; cuFile not used: {}", direct, cf.reason);
  }
  return c;
}

}  // namespace ferry
