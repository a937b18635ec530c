// The file engine: io_uring pipelines between files and any memory (see include/ferry/io/file.hpp).
#include <ferry/core/error.hpp>
#include <ferry/core/units.hpp>
#include <ferry/io/file.hpp>
#include <ferry/io/probe.hpp>
#include <ferry/mem/pinned_pool.hpp>

#include "core/logging.hpp"
#include "io/cufile.hpp"
#include "xfer/batch_state.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <liburing.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <deque>
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

struct job {
  std::shared_ptr<transfer_batch::state> b;
  std::size_t idx = 0;
  file_request r;
  device* dev = nullptr;  // null: host memory
  memory_region where;    // the memory, as classified at submit (its device picks the staging pool)
  std::shared_ptr<registration> hold;  // unified memory: pinned in place until the job is done
};

// One staging slot: a buffer of the transfer engine's staging pool, held for one request.
struct slot {
  pinned_pool::buffer held;
  std::byte* buf = nullptr;
  int index = 0;
  enum { free, io, copying } state = free;
  std::uint64_t off = 0, len = 0, got = 0;  // file range of the current I/O
  std::unique_ptr<event> done;              // device copy of this slot
  std::uint64_t deliver = 0;                // bytes it delivers when its copy completes
  bool direct = false;
  int retries = 0;
};

}  // namespace

struct file_engine::impl {
  transfer_engine& xfer;
  device_registry& devices;
  registration_cache& cache;
  settings cfg;
  ferry::stats st;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<job> queue;
  bool stop = false;
  std::vector<std::thread> threads;
  bool inject_partial, inject_eintr;
  std::once_flag cufile_once;
  std::unique_ptr<cufile::backend> cufile_;
  std::mutex told_mu;
  std::set<std::string> told;  // paths whose cuFile fallback was logged

  cufile::backend& cufile() {
    std::call_once(cufile_once, [&] { cufile_ = std::make_unique<cufile::backend>(cfg); });
    return *cufile_;
  }
  // cuFile for this job? (CUDA memory, backend not io_uring, and cuFile can serve the file)
  bool use_cufile(const job& j) {
    if (cfg.file_backend == file_backend_kind::io_uring || !j.dev || j.dev->info().backend != device_kind::cuda) return false;
    std::string why;
    if (cufile().usable(*j.r.f, why)) return true;
    if (cfg.file_backend == file_backend_kind::cufile)
      fail(errc::not_supported, j.r.write ? "file.write" : "file.read", j.r.f->path(), "FERRY_FILE_BACKEND=cufile: " + why);
    std::lock_guard l(told_mu);
    if (told.insert(j.r.f->path()).second) log::info("io", "{}: cuFile not used ({}); io_uring instead", j.r.f->path(), why);
    return false;
  }

  impl(transfer_engine& x, device_registry& d, registration_cache& c, const settings& s)
      : xfer(x), devices(d), cache(c), cfg(s) {
    inject_partial = s.io_inject.find("partial") != std::string::npos;
    inject_eintr = s.io_inject.find("eintr") != std::string::npos;
    for (int i = 0; i < s.io_threads; ++i) threads.emplace_back([this] { work(); });
  }
  ~impl() {
    {
      std::lock_guard l(mu);
      stop = true;
    }
    cv.notify_all();
    for (auto& t : threads) t.join();
  }

  // ---- a worker: one ring; for each request, up to FERRY_IO_DEPTH slots from the staging pool ----
  struct worker {
    impl& e;
    io_uring ring{};
    std::vector<slot> slots;  // the current request's
    std::uint64_t chunk = 0;  // bytes per I/O: FERRY_IO_CHUNK, at most a staging buffer
    std::map<device*, std::unique_ptr<stream>> streams;
    std::uint64_t ops = 0;

    explicit worker(impl& en) : e(en) {
      int r = io_uring_queue_init(static_cast<unsigned>(std::max(8, 2 * e.cfg.io_depth)), &ring, 0);
      if (r < 0) fail_errno(-r, "io.ring", "io_uring_queue_init", "io_uring unavailable");
    }
    ~worker() {
      io_uring_queue_exit(&ring);
      streams.clear();
    }
    // Slots for one request. With `staged`, each holds a buffer of the transfer engine's staging
    // pool near the request's memory (the one staging pool of the process): one waited for (until
    // the deadline), more while the pool has them at once -- a busy pool makes a shallower
    // pipeline, never a stall. Without, they hold none: the reads land in place.
    void take_slots(const job& j, bool staged) {
      pinned_pool* pool = staged ? &e.xfer.staging_for(j.where) : nullptr;
      std::uint64_t most = pool ? std::min<std::uint64_t>(e.cfg.io_chunk, pool->buffer_bytes()) : e.cfg.io_chunk;
      chunk = std::max<std::uint64_t>(4096, align_down(most, 4096));
      slots.clear();
      for (int i = 0; i < e.cfg.io_depth; ++i) {
        slot s;
        if (pool) {
          s.held = i == 0 ? pool->get(j.b->until) : pool->try_get();
          if (!s.held) break;
          s.buf = s.held.data();
        }
        s.index = i;
        slots.push_back(std::move(s));
      }
    }
    void give_back_slots() { slots.clear(); }
    stream& stream_of(device* d) {
      auto& s = streams[d];
      if (!s) s = d->create_stream();
      return *s;
    }
    void submit_io(slot& s, int fd, bool write, std::string_view path) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring);
      if (!sqe) {
        io_uring_submit(&ring);
        sqe = io_uring_get_sqe(&ring);
      }
      if (!sqe) fail(errc::internal, "io.submit", std::string(path), "no submission queue entry free");
      auto* p = s.buf + s.got;
      auto n = static_cast<unsigned>(s.len - s.got);
      auto off = static_cast<__u64>(s.off + s.got);
      if (write) io_uring_prep_write(sqe, fd, p, n, off);
      else io_uring_prep_read(sqe, fd, p, n, off);
      // Buffered I/O that hits the page cache would otherwise complete inline, one copy at a time:
      // IOSQE_ASYNC hands it to io-wq workers so several copies run in parallel.
      if (!s.direct) sqe->flags |= IOSQE_ASYNC;
      io_uring_sqe_set_data64(sqe, static_cast<__u64>(s.index));
      s.state = slot::io;
      int r = io_uring_submit(&ring);
      if (r < 0) fail_errno(-r, "io.submit", std::string(path));
    }
    // Waits for one completion, at most until `until`; returns false on timeout.
    bool wait_one(io_uring_cqe** cqe, std::chrono::steady_clock::time_point until) {
      for (;;) {
        auto now = std::chrono::steady_clock::now();
        if (now >= until) return false;
        auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(until - now);
        __kernel_timespec ts{static_cast<long long>(left.count() / 1000000000), static_cast<long long>(left.count() % 1000000000)};
        int r = io_uring_wait_cqe_timeout(&ring, cqe, &ts);
        if (r == 0) return true;
        if (r == -ETIME) return false;
        if (r != -EINTR) fail_errno(-r, "io.wait", "io_uring_wait_cqe_timeout");
      }
    }
    // Applies test-only fault injection to a completion.
    int inject(int res, const slot& s) {
      ++ops;
      if (e.inject_eintr && ops % 5 == 0) return -EINTR;
      if (e.inject_partial && ops % 3 == 0 && res > static_cast<int>(2 * 4096)) {
        // A partial completion: fewer bytes than asked, on a 4 KiB boundary (as O_DIRECT would).
        (void)s;
        return static_cast<int>(align_down(static_cast<std::uint64_t>(res) / 2, 4096));
      }
      return res;
    }

    void run(job& j);
    void read(job& j);
    void write(job& j);
    // Waits (bounded) for every I/O still in the kernel: its buffer must not be reused before.
    void drain() {
      auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      for (auto& s : slots)
        if (s.state == slot::io) {
          io_uring_sqe* sqe = io_uring_get_sqe(&ring);
          if (sqe) io_uring_prep_cancel64(sqe, static_cast<__u64>(s.index), 0);
        }
      io_uring_submit(&ring);
      auto busy = [&] {
        for (auto& s : slots)
          if (s.state == slot::io) return true;
        return false;
      };
      while (busy()) {
        io_uring_cqe* cqe = nullptr;
        if (!wait_one(&cqe, until)) {
          log::error("io", "I/O still in flight 10 s after cancellation; abandoning this worker's ring");
          break;
        }
        auto idx = io_uring_cqe_get_data64(cqe);
        if (idx < slots.size()) slots[idx].state = slot::free;
        io_uring_cqe_seen(&ring, cqe);
      }
      for (auto& s : slots)
        if (s.state == slot::copying) {
          try {
            s.done->wait(until);
          } catch (...) {
          }
          s.state = slot::free;
        }
    }
  };

  void work() {
    std::unique_ptr<worker> w;
    for (;;) {
      job j;
      {
        std::unique_lock l(mu);
        cv.wait(l, [&] { return stop || !queue.empty(); });
        if (queue.empty()) return;
        j = std::move(queue.front());
        queue.pop_front();
      }
      try {
        if (!w) w = std::make_unique<worker>(*this);
        w->run(j);
      } catch (const error& e) {
        j.b->finish(j.idx, 0, &e);
      } catch (const std::exception& e) {
        error x(errc::internal, "io.run", j.r.f->path(), e.what());
        j.b->finish(j.idx, 0, &x);
      }
      j.b->item_done();
    }
  }
};

void file_engine::impl::worker::run(job& j) {
  if (j.b->cancelled) {
    error c(errc::cancelled, "io.request", fmt::format("request {} {}", j.idx, j.r.f->path()), "batch cancelled before it ran");
    j.b->finish(j.idx, 0, &c);
    return;
  }
  try {
    if (e.use_cufile(j)) {
      auto& b = *j.b;
      std::uint64_t moved = 0;
      auto progress = [&](std::uint64_t n) {
        moved += n;
        b.progress(j.idx, n);
      };
      try {
        if (j.r.write) {
          e.cufile().write(*j.r.f, j.dev->info().ordinal, j.r.mem, j.r.offset, j.r.bytes, e.cfg.io_chunk, b.until, progress);
        } else {
          std::uint64_t size0 = j.r.f->size();
          std::uint64_t n = j.r.offset >= size0 ? 0 : std::min(j.r.bytes, size0 - j.r.offset);
          std::uint64_t got =
              n ? e.cufile().read(*j.r.f, j.dev->info().ordinal, j.r.mem, j.r.offset, n, 64ull << 20, b.until, progress) : 0;
          if (got < n)
            fail(errc::io_error, "file.read", fmt::format("{} offset {}", j.r.f->path(), j.r.offset + got),
                 "the file ended early (truncated while reading?)");
        }
        e.st.get("requests.cufile").add();
        {
          std::lock_guard l(b.mu);
          b.results[j.idx].path = transfer_path::direct;
        }
        b.finish(j.idx, 0, nullptr);
        return;
      } catch (const error& x) {
        // The probe: if cuFile's first transfer on a file fails, auto mode falls back for good.
        if (e.cfg.file_backend == file_backend_kind::cufile || moved > 0) throw;
        e.cufile().refuse(*j.r.f, x.what());
        log::info("io", "{}: cuFile probe failed ({}); io_uring instead", j.r.f->path(), x.what());
      }
    }
    if (j.r.write) write(j);
    else read(j);
    give_back_slots();
  } catch (...) {
    drain();
    give_back_slots();
    throw;
  }
}

void file_engine::impl::worker::read(job& j) {
  file& f = *j.r.f;
  const std::string& path = f.path();
  auto& b = *j.b;
  const std::uint64_t want_lo = j.r.offset, want_hi = j.r.offset + j.r.bytes;
  const std::uint64_t size0 = f.size();
  const std::uint64_t eff_hi = std::min(want_hi, size0);
  if (want_lo >= eff_hi) {  // entirely past the end: a short (empty) read
    b.finish(j.idx, 0, nullptr);
    return;
  }
  bool direct = false;
  if (e.cfg.io_direct == direct_io::always) {
    if (f.direct_fd() < 0) fail(errc::not_supported, "file.read", path, "O_DIRECT refused here (FERRY_IO_DIRECT=always)");
    direct = true;
  } else if (e.cfg.io_direct == direct_io::automatic && f.direct_fd() >= 0) {
    // Bypassing a warm page cache is slower than copying from it.
    double c = cached_fraction(f.fd(), want_lo, eff_hi - want_lo);
    direct = c < 0.9;
  }
  // Buffered into host memory: the kernel copies from the page cache straight into the destination
  // (no staging slot, no second copy); exactly the asked range, so nothing past it is written.
  const bool in_place = !j.dev && !direct;
  take_slots(j, !in_place);
  const std::uint64_t a = direct ? f.dio_align() : in_place ? 1 : 4096;
  const int fd = direct ? f.direct_fd() : f.fd();
  e.st.get(direct ? "reads.direct" : in_place ? "reads.in_place" : "reads.buffered").add();
  log::debug("io", "read {} [{}, {}) {} into {}", path, want_lo, eff_hi, direct ? "O_DIRECT" : "buffered",
             j.dev ? j.dev->id() : "host");
  std::uint64_t pos = align_down(want_lo, a);
  const std::uint64_t end = align_up(eff_hi, a);
  auto* dst = static_cast<std::byte*>(j.r.mem);
  std::uint64_t delivered = 0;

  auto complete_copies = [&](bool block) {
    for (auto& s : slots)
      if (s.state == slot::copying && (block ? (s.done->wait(b.until), true) : s.done->done())) {
        s.state = slot::free;
        s.done.reset();
        b.progress(j.idx, s.deliver);
        delivered += s.deliver;
      }
  };
  auto in_flight = [&] {
    for (auto& s : slots)
      if (s.state != slot::free) return true;
    return false;
  };
  for (;;) {
    if (b.cancelled) fail(errc::cancelled, "file.read", path, "cancelled");
    if (std::chrono::steady_clock::now() >= b.until)
      fail(errc::timeout, "file.read", fmt::format("{} offset {}", path, pos), "deadline passed");
    for (auto& s : slots) {
      if (pos >= end) break;
      if (s.state != slot::free) continue;
      s.off = pos;
      s.len = std::min<std::uint64_t>(chunk, end - pos);
      s.got = 0;
      s.direct = direct;
      s.retries = 0;
      if (in_place) s.buf = dst + (pos - want_lo);
      submit_io(s, fd, false, path);
      pos += s.len;
    }
    complete_copies(false);
    if (pos >= end && !in_flight()) break;
    bool any_io = false;
    for (auto& s : slots) any_io = any_io || s.state == slot::io;
    if (!any_io) {  // only device copies outstanding
      std::this_thread::yield();
      continue;
    }
    io_uring_cqe* cqe = nullptr;
    auto step = std::min(b.until, std::chrono::steady_clock::now() + std::chrono::microseconds(200));
    if (!wait_one(&cqe, step)) continue;
    slot& s = slots[io_uring_cqe_get_data64(cqe)];
    int res = inject(cqe->res, s);
    io_uring_cqe_seen(&ring, cqe);
    s.state = slot::free;  // its completion is consumed; resubmission or a copy set it again
    if (res == -EINTR || res == -EAGAIN) {
      if (++s.retries > 100) fail_errno(-res, "file.read", fmt::format("{} offset {}", path, s.off + s.got), "retried 100 times");
      e.st.get("io.retries").add();
      submit_io(s, fd, false, path);
      continue;
    }
    if (res < 0) fail_errno(-res, "file.read", fmt::format("{} offset {}", path, s.off + s.got));
    s.got += static_cast<std::uint64_t>(res);
    bool eof = res == 0;
    if (s.got < s.len && !eof) {  // partial completion: ask for the rest
      e.st.get("io.partial").add();
      submit_io(s, fd, false, path);
      continue;
    }
    // The slot holds [s.off, s.off + s.got). A file that ends before the size seen at the start
    // was truncated under us: an error, never garbage.
    std::uint64_t have_hi = s.off + s.got;
    if (have_hi < std::min(s.off + s.len, eff_hi))
      fail(errc::io_error, "file.read", fmt::format("{} offset {}", path, have_hi),
           fmt::format("the file ended at {} but was {} bytes when the read started (truncated while reading?)", have_hi,
                       size0));
    std::uint64_t lo = std::max(s.off, want_lo), hi = std::min(have_hi, eff_hi);
    if (lo >= hi) {
      s.state = slot::free;
      continue;
    }
    std::byte* src = s.buf + (lo - s.off);
    if (!j.dev) {
      if (!in_place) std::memcpy(dst + (lo - want_lo), src, hi - lo);
      s.state = slot::free;
      b.progress(j.idx, hi - lo);
      delivered += hi - lo;
    } else {
      stream& st = stream_of(j.dev);
      st.copy(dst + (lo - want_lo), src, hi - lo);
      s.done = st.record();
      s.deliver = hi - lo;
      s.state = slot::copying;
    }
  }
  complete_copies(true);
  e.st.get("bytes_read").add(delivered);
  b.finish(j.idx, 0, nullptr);
}

void file_engine::impl::worker::write(job& j) {
  file& f = *j.r.f;
  const std::string& path = f.path();
  auto& b = *j.b;
  if (!f.writable()) fail(errc::permission_denied, "file.write", path, "opened read-only");
  take_slots(j, true);
  const std::uint64_t lo = j.r.offset, hi = j.r.offset + j.r.bytes;
  const bool direct = e.cfg.io_direct != direct_io::never && f.direct_fd() >= 0;
  const std::uint64_t a = direct ? f.dio_align() : 1;
  // O_DIRECT for the aligned middle; an unaligned head and tail go through the page cache.
  std::uint64_t mid_lo = direct ? align_up(lo, a) : lo, mid_hi = direct ? align_down(hi, a) : hi;
  if (mid_lo >= mid_hi) mid_lo = mid_hi = lo;  // too small for O_DIRECT: all buffered
  auto* src = static_cast<const std::byte*>(j.r.mem);
  auto stage = [&](slot& s, std::uint64_t off, std::uint64_t n) {
    if (j.dev) {
      stream& st = stream_of(j.dev);
      st.copy(s.buf, src + (off - lo), n);
      st.synchronize(b.until);
    } else {
      std::memcpy(s.buf, src + (off - lo), n);
    }
  };
  auto write_range = [&](std::uint64_t from, std::uint64_t to, bool dio) {
    int fd = dio ? f.direct_fd() : f.fd();
    std::uint64_t pos = from;
    auto busy = [&] {
      for (auto& s : slots)
        if (s.state == slot::io) return true;
      return false;
    };
    while (pos < to || busy()) {
      if (b.cancelled) fail(errc::cancelled, "file.write", path, "cancelled");
      if (std::chrono::steady_clock::now() >= b.until) fail(errc::timeout, "file.write", path, "deadline passed");
      for (auto& s : slots) {
        if (pos >= to) break;
        if (s.state != slot::free) continue;
        s.off = pos;
        s.len = std::min<std::uint64_t>(chunk, to - pos);
        s.got = 0;
        s.direct = dio;
        s.retries = 0;
        stage(s, s.off, s.len);
        submit_io(s, fd, true, path);
        pos += s.len;
      }
      io_uring_cqe* cqe = nullptr;
      if (!wait_one(&cqe, b.until)) continue;
      slot& s = slots[io_uring_cqe_get_data64(cqe)];
      int res = inject(cqe->res, s);
      io_uring_cqe_seen(&ring, cqe);
      s.state = slot::free;  // its completion is consumed
      if (res == -EINTR || res == -EAGAIN) {
        if (++s.retries > 100) fail_errno(-res, "file.write", path, "retried 100 times");
        submit_io(s, fd, true, path);
        continue;
      }
      if (res < 0) fail_errno(-res, "file.write", fmt::format("{} offset {}", path, s.off + s.got));
      if (res == 0) fail(errc::io_error, "file.write", fmt::format("{} offset {}", path, s.off + s.got), "wrote nothing (disk full?)");
      s.got += static_cast<std::uint64_t>(res);
      if (s.got < s.len) {
        submit_io(s, fd, true, path);
        continue;
      }
      s.state = slot::free;
      b.progress(j.idx, s.len);
    }
  };
  if (lo < mid_lo) write_range(lo, mid_lo, false);
  if (mid_lo < mid_hi) write_range(mid_lo, mid_hi, true);
  if (mid_hi < hi && mid_hi >= lo) write_range(std::max(mid_hi, lo), hi, false);
  e.st.get("bytes_written").add(j.r.bytes);
  b.finish(j.idx, 0, nullptr);
}

// ---- public ---------------------------------------------------------------------------------

file_engine::file_engine(transfer_engine& x, device_registry& d, registration_cache& c, const settings& s)
    : impl_(std::make_unique<impl>(x, d, c, s)) {}
file_engine::~file_engine() = default;
ferry::stats& file_engine::counters() noexcept { return impl_->st; }

transfer_batch file_engine::submit(std::span<const file_request> reqs, transfer_options o) {
  impl& I = *impl_;
  auto b = make_batch_state(reqs.size(), o.until.value_or(deadline_after(I.cfg.deadline)));
  std::vector<job> jobs;
  std::vector<std::size_t> remote;
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    const file_request& r = reqs[i];
    b->sizes[i] = r.bytes;
    b->bytes_total += r.bytes;
    try {
      if (!r.f) fail(errc::invalid_argument, "file.submit", fmt::format("request {}", i), "no file");
      std::string res = fmt::format("request {} {} offset {} bytes {}", i, r.f->path(), r.offset, r.bytes);
      if (!r.mem) fail(errc::invalid_argument, "file.submit", res, "null memory pointer");
      if (r.bytes == 0) fail(errc::invalid_argument, "file.submit", res, "zero length");
      if (r.offset + r.bytes < r.offset) fail(errc::out_of_range, "file.submit", res, "offset + length overflows");
      if (r.write && !r.f->writable()) fail(errc::permission_denied, "file.submit", res, "file opened read-only");
      if (r.f->source()) {  // a remote file: its source moves the data (and classifies the memory)
        b->segs_left[i] = 1;
        b->results[i].path = transfer_path::none;
        remote.push_back(i);
        continue;
      }
      memory_region m = I.cache.classify(r.mem, r.bytes);
      if (m.type == memory_type::unknown)
        fail(errc::bad_address, "file.submit", res, "memory is not mapped memory ferry knows (freed or invalid?)");
      if ((m.type == memory_type::device || m.type == memory_type::managed || m.type == memory_type::unified) && m.size &&
          !m.contains(reinterpret_cast<std::uintptr_t>(r.mem), r.bytes))
        fail(errc::out_of_range, "file.submit", res, fmt::format("memory extends past its allocation on {}", m.device_id()));
      job j;
      j.b = b;
      j.idx = i;
      j.r = r;
      j.dev = (m.type == memory_type::device || m.type == memory_type::managed || m.type == memory_type::unified)
                  ? &I.devices.get(m.device, m.ordinal)
                  : nullptr;
      j.where = m;
      // Unified memory stays where it is while the request uses it (its pages may move otherwise).
      if (m.type == memory_type::unified) j.hold = std::make_shared<registration>(I.cache.acquire(r.mem, r.bytes));
      b->segs_left[i] = 1;
      b->results[i].path = transfer_path::staged;
      jobs.push_back(std::move(j));
    } catch (const error& e) {
      b->fail_now(i, e);
    }
  }
  {
    std::lock_guard l(b->mu);
    b->items_inflight = static_cast<int>(jobs.size() + remote.size());
  }
  {
    std::lock_guard l(I.mu);
    for (auto& j : jobs) I.queue.push_back(std::move(j));
  }
  I.cv.notify_all();
  for (std::size_t i : remote) {
    const file_request& r = reqs[i];
    // The completion may run before start() returns, on any thread; the batch state outlives it
    // (the handle's destructor waits for items in flight).
    auto done = [b, i](std::uint64_t n, const error* e) {
      b->finish(i, n, e);
      b->item_done();
    };
    try {
      r.f->source()->start(r.write, r.offset, r.mem, r.bytes, b->until, done);
    } catch (const error& e) {
      done(0, &e);
    } catch (const std::exception& e) {
      error err(errc::internal, "file.submit", r.f->path(), e.what());
      done(0, &err);
    }
  }
  I.st.get("requests.remote").add(remote.size());
  return make_batch(std::move(b));
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
  } else if (cf.available) {
    c.backend = "cufile";
    c.reason = fmt::format("cuFile (driver open, handle registration works here) for GPU memory; io_uring, {}, for the rest", direct);
  } else {
    c.reason = fmt::format("io_uring, {}; cuFile not used: {}", direct, cf.reason);
  }
  return c;
}

}  // namespace ferry
