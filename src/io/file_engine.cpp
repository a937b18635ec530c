// The file engine: io_uring pipelines between files and any memory (see include/ferry/io/file_engine.hpp);
// requests are checked, cut into pieces and handed to the workers here (ring_worker.cpp runs them).
#include "io/file_engine_impl.hpp"

namespace ferry {

// ---- public ---------------------------------------------------------------------------------

file_engine::file_engine(transfer_engine& x, device_registry& d, registration_cache& c, const io_settings& s)
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
// Whether read `j` joins the job before it as a member of its group: both small reads into the
// memory of one device (not unified memory, which stays pinned per request), the file range of `j`
// right after that job's, and the whole a single I/O into one staging buffer (with room for the
// alignment of its ends). A checkpoint's small tensors lie side by side in its file; read as one
// range they cost one I/O and one batch of device copies instead of one of each per tensor. (Not
// under FERRY_FILE_BACKEND=cufile, where each request must go through cuFile.) A group fails as a
// whole: an I/O or device copy that fails fails every member.
bool joins(const io_settings& cfg, const job& prev, const job& j) {
  const std::uint64_t small = std::min(cfg.io_chunk, cfg.staging_bytes) / 4;
  const std::uint64_t most = std::min(cfg.io_chunk, cfg.staging_bytes) - 2 * 8192;
  return cfg.file_backend != file_backend_kind::cufile && !j.r.write && !prev.r.write && j.dev && j.dev == prev.dev &&
         j.where.type == memory_type::device &&
         prev.where.type == memory_type::device && j.r.f == prev.r.f && prev.r.offset + prev.r.bytes == j.r.offset &&
         j.r.bytes <= small && (prev.group || prev.r.bytes <= small) && prev.r.bytes + j.r.bytes <= most;
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
  std::uint64_t grouped = 0;  // requests read as part of the job before them
  memory_region last_mem;
  // A read is cut at the file's size as of its submission (one look per file of the batch, not one
  // per request): a file cut short under it then fails the read instead of reading short.
  file* sized = nullptr;
  std::uint64_t size = 0;
  const std::shared_ptr<file>* run = nullptr;  // the first request of the current run on one file
  const file* named = nullptr;                 // the remote file the last request's name is of
  // More workers when the work asks for them: a worker for every FERRY_IO_DEPTH requests waiting
  // or running, and for every 32 MiB asked of the engine so far (what a new worker's copies must
  // cover to be worth its making, a thread costing a millisecond or more in a process that imported
  // torch; a 64 MiB first load takes two, a 4 GiB one all, and so does a program reading 4 GiB in
  // 16 MiB calls, one batch after another). Remote files' requests are their sources' work, not
  // the workers'.
  std::uint64_t batch_bytes = 0;
  {
    std::size_t busy = 0;
    for (auto& r : reqs)
      if (r.f && !r.f->source()) batch_bytes += r.bytes, ++busy;
    const std::size_t nl = I.live.load(std::memory_order_acquire);
    for (std::size_t k = 0; k < nl; ++k) busy += I.workers[k]->queued.load() + I.workers[k]->running_now.load();
    const auto depth = static_cast<std::size_t>(std::max(1, I.cfg.io_depth));
    const std::uint64_t asked = I.asked.fetch_add(batch_bytes, std::memory_order_relaxed) + batch_bytes;
    I.grow(std::max<std::size_t>((busy + depth - 1) / depth, static_cast<std::size_t>(asked / (32 * MiB))));
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
        // Once per run of requests on one file: the process check (a system call) and the name a
        // timeout gives (the offset is put in words only then).
        if (r.f.get() != named) {
          r.f->source()->check_process("file.submit", describe(r, i));
          b->names.push_back(uri_for_messages(r.f->path()));
          named = r.f.get();
        }
        if (b->labels.empty()) b->labels.resize(reqs.size());
        b->labels[i] = {static_cast<std::uint32_t>(b->names.size()), r.offset};
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
      // staging buffer of its own, an I/O chunk -- or less, down to the inline size, when the batch
      // is too small to give every worker a chunk (a program's single 16 MiB read then runs on all
      // of them, not on four).
      const std::uint64_t least = I.cfg.io_inline >= 64 * 1024 ? std::min(I.cfg.io_inline, I.cfg.io_chunk) : I.cfg.io_chunk;
      const std::uint64_t unit =
          !j.dev ? least : std::clamp<std::uint64_t>(batch_bytes / std::max<std::size_t>(nw, 1), least, I.cfg.io_chunk);
      std::size_t pieces = std::min<std::uint64_t>(nw, r.bytes / std::max<std::uint64_t>(unit, 4096));
      if (pieces >= 2 && (r.write || reads_direct(I.cfg, *r.f, r.offset, r.bytes))) pieces = 1;
      if (pieces < 2) {
        b->segs_left[i] = 1;
        if (!jobs.empty() && joins(I.cfg, jobs.back(), j)) {
          job& g = jobs.back();
          if (!g.group)
            g.group = std::make_shared<std::vector<member>>(
                std::vector<member>{{g.idx, g.r.offset, g.r.bytes, static_cast<std::byte*>(g.r.mem), g.where}});
          g.group->push_back({j.idx, j.r.offset, j.r.bytes, static_cast<std::byte*>(j.r.mem), j.where});
          g.r.bytes += j.r.bytes;
          ++grouped;
          continue;
        }
        jobs.push_back(std::move(j));
        continue;
      }
      // The pieces equal, in whole pages from the request's first page (the last piece the rest). Into
      // device memory a piece larger than a staging buffer is several I/Os: there each piece is a
      // whole number of buffers instead (a piece of a buffer and a bit would make the second I/O small).
      const std::uint64_t end = r.offset + r.bytes, first = align_down(r.offset, 4096);
      std::uint64_t step = align_up((end - first + pieces - 1) / pieces, 4096);
      if (j.dev && step > I.cfg.io_chunk) {
        const std::uint64_t u = align_up(I.cfg.io_chunk, 4096), units = (end - first + u - 1) / u;
        step = (units + pieces - 1) / pieces * u;
      }
      std::vector<std::uint64_t> cuts = {r.offset};
      for (std::size_t k = 1; k < pieces; ++k) {
        std::uint64_t c = first + k * step;
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
    std::size_t items = remote.size();
    for (const job& j : jobs) items += j.group ? j.group->size() : 1;
    b->items_inflight = static_cast<int>(items);
    // The remote requests' completions point at the batch without owning it (a pointer and an
    // index: std::function keeps that without an allocation per request); the batch holds itself
    // until its last item is done.
    if (!remote.empty()) b->on_quiet = [keep = b, then = std::move(b->on_quiet)] {
      if (then) then();
    };
  }
  if (!jobs.empty()) {
    // Each to the worker with the least work (the load_of what it has queued and running, as the
    // workers last said), the first of equals from the submitting thread's own first worker, the
    // largest jobs placed first: the batch ends when its last worker does, so the bytes are spread,
    // not the requests (a checkpoint's requests run from a few KiB to hundreds of MiB). Requests that
    // come together spread over the workers, one thread's one after another stay on its first few
    // (awake, their rings' kernel threads warm). Each worker runs its share in the batch's order; it
    // is handed over under the worker's own lock, with a wake.
    std::vector<std::size_t>& load = mine.load;
    load.resize(nw);
    for (std::size_t k = 0; k < nw; ++k)
      load[k] = I.workers[k]->queued_load.load(std::memory_order_relaxed) + I.workers[k]->running_load.load(std::memory_order_relaxed);
    std::vector<std::size_t>& order = mine.order;
    order.resize(jobs.size());
    for (std::size_t i = 0; i < jobs.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) { return jobs[x].r.bytes > jobs[y].r.bytes; });
    std::vector<std::uint32_t>& to = mine.to;
    to.resize(jobs.size());
    std::vector<std::size_t>& first = mine.first;  // worker k's jobs: order[first[k] .. first[k + 1])
    first.assign(nw + 1, 0);
    // Equal loads (an idle engine) are broken from this thread's own first worker: threads that
    // submit at the same moment (a server's progress threads, each with a piece of one client
    // read) cannot see each other's jobs in the loads yet, and from the first worker they would
    // all pile onto the same few. One thread's batches still start on the same worker.
    const std::size_t home = static_cast<std::size_t>((std::uint64_t{mine.home} * nw) >> 32);
    for (std::size_t i : order) {
      std::size_t best = home;
      for (std::size_t d = 1; d < nw; ++d) {
        const std::size_t k = home + d < nw ? home + d : home + d - nw;
        if (load[k] < load[best]) best = k;
      }
      to[i] = static_cast<std::uint32_t>(best);
      load[to[i]] += load_of(jobs[i]);
      ++first[to[i] + 1];
    }
    for (std::size_t k = 0; k < nw; ++k) first[k + 1] += first[k];
    {
      std::vector<std::size_t>& at = mine.at;
      at.assign(first.begin(), first.end() - 1);
      for (std::size_t i = 0; i < jobs.size(); ++i) order[at[to[i]]++] = i;
    }
    for (std::size_t k = 0; k < nw; ++k)
      if (first[k] != first[k + 1])
        I.hand_over(k, jobs, std::span<const std::size_t>(order).subspan(first[k], first[k + 1] - first[k]));
  }
  jobs.clear();
  spare = std::move(mine);
  if (!remote.empty()) {
    // The batch's own deadline and cancel flag, shared (a fixed deadline never moves: idle 0).
    const source_deadline until(std::shared_ptr<std::atomic<source_deadline::clock::rep>>(b, &b->until_ticks), b->idle,
                                std::shared_ptr<const std::atomic<bool>>(b, &b->cancelled));
    // Each run of requests of one source goes to it at once (it may serve them together). A
    // completion may run before start_many returns, on any thread; the batch state outlives it (the
    // handle's destructor waits for items in flight).
    std::vector<file_source::request> run_of;
    for (std::size_t k = 0; k < remote.size();) {
      file_source* src = reqs[remote[k]].f->source().get();
      run_of.clear();
      for (; k < remote.size() && reqs[remote[k]].f->source().get() == src; ++k) {
        const std::size_t i = remote[k];
        const file_request& r = reqs[i];
        run_of.push_back({r.write, r.offset, r.mem, r.bytes, [s = b.get(), i](std::uint64_t n, const error* e) {
                            s->finish(i, n, e);
                            s->item_done();
                          }});
      }
      src->start_many(run_of, until);  // never throws: every request completes, failed or not
    }
  }
  I.st.get("requests.remote").add(remote.size());
  if (grouped) I.st.get("requests.grouped").add(grouped);
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
