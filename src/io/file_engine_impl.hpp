#pragma once
// The file engine's insides (src/io/): its requests as workers run them, the workers (one io_uring
// each, ring_worker.cpp), and what the submitting side (file_engine.cpp) and the stream-ordered
// pipeline (stream_order.cpp) share.
#include <ferry/core/error.hpp>
#include <ferry/core/units.hpp>
#include <ferry/io/file_engine.hpp>
#include <ferry/io/probe.hpp>
#include <ferry/mem/pinned_pool.hpp>
#include <ferry/mem/registration.hpp>
#include <ferry/xfer/staged_copies.hpp>

#include "core/executor.hpp"
#include "core/logging.hpp"
#include "io/cufile.hpp"
#include "xfer/batch_state.hpp"
#include "xfer/stream_gates.hpp"

#include <fcntl.h>
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
namespace io_detail {

inline std::uint64_t align_down(std::uint64_t v, std::uint64_t a) { return v / a * a; }
inline std::uint64_t align_up(std::uint64_t v, std::uint64_t a) { return (v + a - 1) / a * a; }

// Fraction of [off, off+len) of the file in the page cache (cachestat, Linux 6.5+); -1 if unknown.
// A range larger than 16 windows of 64 KiB is estimated from 16 such windows spread over it:
// cachestat walks the page cache a page at a time (tens of nanoseconds a page), and asked about
// every page of a 4 GiB checkpoint's reads it cost a load tens of milliseconds on the thread that
// submits them, and as much again on the workers.
inline double cached_fraction(int fd, std::uint64_t off, std::uint64_t len) {
  constexpr std::uint64_t window = 64 << 10;
  constexpr int windows = 16;
  static const std::uint64_t page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  std::uint64_t cached = 0, pages = 0;
  auto ask = [&](std::uint64_t o, std::uint64_t n) {
    struct {
      std::uint64_t off, len;
    } range{o, n};
    struct {
      std::uint64_t cache, dirty, writeback, evicted, recently_evicted;
    } cs{};
    if (::syscall(__NR_cachestat, fd, &range, &cs, 0) != 0) return false;
    cached += cs.cache;
    pages += (o + n - 1) / page - o / page + 1;  // every page the range touches, as cachestat counts them
    return true;
  };
  if (len == 0) return 1.0;
  if (len <= window * windows) {
    if (!ask(off, len)) return -1;
  } else {
    for (int k = 0; k < windows; ++k)
      if (!ask(off + (len - window) / (windows - 1) * k, window)) return -1;
  }
  return std::min(1.0, static_cast<double>(cached) / static_cast<double>(pages));
}

// Whether a read of [off, off + len) goes around the page cache: FERRY_IO_DIRECT, and in automatic
// mode whether the range is cached (bypassing a warm page cache is slower than copying from it).
inline bool reads_direct(const io_settings& cfg, file& f, std::uint64_t off, std::uint64_t len) {
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

// A request of a group (job::group): its place in the batch, the file range it asks for and where
// that goes.
struct member {
  std::size_t idx = 0;
  std::uint64_t offset = 0, bytes = 0;
  std::byte* mem = nullptr;
  memory_region where;
};

struct job {
  std::shared_ptr<transfer_batch::state> b;
  std::size_t idx = 0;
  job_request r;
  // Small reads of adjacent file ranges into one device's memory, read as one range (r) into one
  // staging buffer and copied on to each member's memory; null for a request of its own.
  std::shared_ptr<std::vector<member>> group;
  device* dev = nullptr;  // null: host memory
  memory_region where;    // the memory, as classified at submit (its device picks the staging pool)
  std::shared_ptr<registration> hold;  // unified memory: pinned in place until the job is done
  std::optional<std::uint64_t> size;   // a piece of a read: the file's size when the request was cut
};

// Where a submitting thread's search for the least loaded worker starts, as a fraction of the
// workers (of 2^32): the bits of the thread's number reversed. Threads are numbered as they first
// submit, in the whole process; any run of consecutive numbers (a server's progress threads taking
// their first requests together, say) starts evenly spread over the workers, others nearly so.
inline std::uint32_t first_look() {
  static std::atomic<std::uint32_t> threads{0};
  std::uint32_t n = threads.fetch_add(1, std::memory_order_relaxed), r = 0;
  for (int i = 0; i < 32; ++i, n >>= 1) r = (r << 1) | (n & 1);
  return r;
}

// What a job weighs in a worker's load: its bytes, and for the I/O it costs beside its copy (a
// system call and a completion, about as long as a 64 KiB copy) 64 KiB more, so that many small
// jobs weigh as they take. One measure for the jobs a worker has and those a batch adds to it.
inline std::uint64_t load_of(const job& j) { return j.r.bytes + (64u << 10); }

// What file_engine::start builds per batch, kept by the submitting thread for its next one.
struct scratch {
  // Where this thread's search for the least loaded worker starts (see file_engine::start).
  std::uint32_t home = first_look();
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

// A request as errors name it.
inline std::string describe(const file_request& r, std::size_t i) {
  return fmt::format("request {} {} offset {} bytes {}", i, r.f->path(), r.offset, r.bytes);
}

// Refuses a request that cannot run, naming it.
inline void check_request(const file_request& r, std::size_t i) {
  if (!r.f) fail(errc::invalid_argument, "file.submit", fmt::format("request {}", i), "no file");
  if (!r.mem) fail(errc::invalid_argument, "file.submit", describe(r, i), "null memory pointer");
  if (r.bytes == 0) fail(errc::invalid_argument, "file.submit", describe(r, i), "zero length");
  if (r.offset + r.bytes < r.offset) fail(errc::out_of_range, "file.submit", describe(r, i), "offset + length overflows");
  if (r.write && !r.f->writable()) fail(errc::permission_denied, "file.submit", describe(r, i), "file opened read-only");
}

}  // namespace io_detail

// (Only the io layer's own sources include this header.)
using namespace io_detail;

struct file_engine::impl {
  transfer_engine& xfer;
  device_registry& devices;
  registration_cache& cache;
  io_settings cfg;
  ferry::stats st;
  // The counters every request touches, looked up once (a lookup takes the set's lock).
  counter &beside_others = st.get("requests.beside_others"), &reads_direct_n = st.get("reads.direct"),
          &reads_in_place = st.get("reads.in_place"), &reads_buffered = st.get("reads.buffered"),
          &reads_mapped = st.get("reads.mapped"),
          &bytes_read = st.get("bytes_read"), &bytes_written = st.get("bytes_written"),
          &reads_missed_cache = st.get("reads.missed_cache"), &files_registered = st.get("files.registered");
  struct worker;
  std::atomic<bool> stop{false};
  // Workers [0, live) are made; the rest are made as the load asks for them (grow): a ring each, and
  // the task that runs its loop on the executor starts when the worker is given work (a thread is
  // made for it only when no executor worker is idle: a thread costs its creator a millisecond or
  // more in a process that imported torch). The vector is sized once and never moves.
  std::vector<std::unique_ptr<worker>> workers;
  std::atomic<std::size_t> live{0};
  std::atomic<std::uint64_t> asked{0};  // bytes of local files' requests so far (how many workers the work is worth)
  std::mutex grow_mu;  // making workers
  detail::task_slots loops;  // the workers' loops on the executor (one at most per worker, with its qmu)
  void grow(std::size_t want);
  // Hands jobs to worker k: its loop is woken, or started when it has none running.
  void hand_over(std::size_t k, std::span<job> js, std::span<const std::size_t> which);
  bool inject_partial, inject_eintr;
  std::once_flag cufile_once;
  std::unique_ptr<cufile::backend> cufile_;
  std::mutex told_mu;
  std::set<std::string> told;  // paths whose cuFile fallback (or failed mapping) was logged
  // Pins of the file pages mapped reads copy from (null: mapped reads off, or no CUDA driver).
  std::unique_ptr<read_only_pins> mapped_pages;

  cufile::backend& cufile() {
    std::call_once(cufile_once, [&] { cufile_ = std::make_unique<cufile::backend>(cfg, devices.config().cuda_driver); });
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

  impl(transfer_engine& x, device_registry& d, registration_cache& c, const io_settings& s);
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
    bool looping = false;             // with qmu: its loop is out on the executor (started, not yet ended)
    std::atomic<std::size_t> running_now{0};  // requests it runs (as of its last round)
    // The load_of its jobs waiting (written with qmu) and running (as of its last round, and without
    // those it is ending, before it tells their batches): what submitters choose the least loaded
    // worker by.
    std::atomic<std::uint64_t> queued_load{0}, running_load{0};
    std::vector<slot> slots;
    std::list<running> runs;
    bool to_submit = false;
    std::uint64_t ops = 0;
    staged_copies device_copies{e.xfer};  // (its end waits for them; the worker's loop has seen each end before)
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
      device_copies.wait();  // (their completions write wake_fd)
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
      copy(s, {&q, 1});
    }
    // Device copies of one slot (a group's members), one batch: one completion for them all.
    void copy(slot& s, std::span<const transfer_request> qs) {
      std::size_t i = index(s);
      device_copies.start(qs, s.r->j.b->until(), [this, i](const error* err) {
        {
          std::lock_guard l(copied_mu);
          copied.emplace_back(i, err ? std::optional<error>(*err) : std::nullopt);
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
    std::vector<transfer_request> group_copies;  // a group's device copies, as on_io makes them
    // Counted this round, added to the engine's counters at its end.
    struct {
      std::uint64_t beside = 0, direct = 0, in_place = 0, buffered = 0, mapped = 0, read = 0, written = 0, missed_cache = 0, registered = 0;
    } t;
    // A job ended: `len` bytes delivered (progress not yet told), or the error. A group's members
    // each get the bytes of theirs below `hi`, the end of what was read, or the error.
    void done(job& j, std::uint64_t len, const error* x, std::uint64_t hi = 0) {
      if (j.group) {
        for (const member& m : *j.group)
          ends.push_back({j.b, m.idx, x || hi <= m.offset ? 0 : std::min(m.bytes, hi - m.offset),
                          x ? std::optional<error>(*x) : std::nullopt});
        j.b.reset();
        return;
      }
      ends.push_back({std::move(j.b), j.idx, len, x ? std::optional<error>(*x) : std::nullopt});
    }
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

}  // namespace ferry
