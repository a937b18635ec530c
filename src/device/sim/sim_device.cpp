#include "device/sim/sim_device.hpp"

#include <ferry/core/checksum.hpp>

#include "core/backoff.hpp"
#include "core/executor.hpp"
#include "core/logging.hpp"

#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <fcntl.h>
#include <functional>
#include <thread>

namespace ferry::sim {
namespace {

class sim_device;

// Live sim devices, so a copy can resolve an address that lies in a peer's range.
std::mutex g_devices_mu;
std::vector<sim_device*> g_devices;

// ---- memory ------------------------------------------------------------------------------------

// A memfd plus a private read-write view of it: the "physical memory" the copy engines use.
struct backing {
  int fd = -1;
  std::byte* view = nullptr;
  std::uint64_t size = 0;

  backing(std::uint64_t bytes, const char* name) : size(bytes) {
    fd = ::memfd_create(name, MFD_CLOEXEC);
    if (fd < 0) fail_errno(errno, "sim.memfd_create", name);
    if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      int e = errno;
      ::close(fd);
      fail_errno(e, "sim.ftruncate", name, fmt::format("cannot size backing to {}", bytes));
    }
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      fail_errno(e, "sim.mmap", name, "cannot map backing");
    }
    view = static_cast<std::byte*>(p);
  }
  backing(const backing&) = delete;
  ~backing() {
    if (view) ::munmap(view, size);
    if (fd >= 0) ::close(fd);
  }
  // Gives the pages back to the kernel (contents become zero).
  void discard(std::uint64_t off, std::uint64_t len) noexcept {
    ::fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(off), static_cast<off_t>(len));
  }
};

// First-fit allocator over the arena, in granules; adjacent free blocks coalesce.
class arena_allocator {
 public:
  explicit arena_allocator(std::uint64_t capacity) { free_[0] = capacity; }
  std::optional<std::uint64_t> allocate(std::uint64_t bytes) {
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < bytes) continue;
      std::uint64_t off = it->first, len = it->second;
      free_.erase(it);
      if (len > bytes) free_[off + bytes] = len - bytes;
      return off;
    }
    return std::nullopt;
  }
  void release(std::uint64_t off, std::uint64_t bytes) {
    auto [it, ok] = free_.emplace(off, bytes);
    if (auto n = std::next(it); n != free_.end() && off + bytes == n->first) {
      it->second += n->second;
      free_.erase(n);
    }
    if (it != free_.begin()) {
      auto p = std::prev(it);
      if (p->first + p->second == off) {
        p->second += it->second;
        free_.erase(it);
      }
    }
  }

 private:
  std::map<std::uint64_t, std::uint64_t> free_;
};

// Physical chunk records. Device chunks live in the arena; host chunks have their own memfd.
class sim_device;

struct chunk_rec {
  location where;
  std::uint64_t size = 0;
  std::uint64_t arena_offset = 0;      // device chunks
  std::unique_ptr<backing> host;       // host chunks
  sim_device* home = nullptr;          // device chunks in a peer's memory: that peer (its arena)
  const backing* home_arena = nullptr;
  std::byte* view(const backing* arena) const {
    return host ? host->view : (home_arena ? home_arena : arena)->view + arena_offset;
  }
};

// ---- safe host access ----------------------------------------------------------------------------

// Copies between an engine view (always valid) and user memory that may be bad. Returns 0 or errno.
int host_transfer(std::byte* engine, void* user, std::size_t bytes, bool to_user) {
  while (bytes) {
    iovec local{engine, bytes}, remote{user, bytes};
    ssize_t n = to_user ? ::process_vm_writev(::getpid(), &local, 1, &remote, 1, 0)
                        : ::process_vm_readv(::getpid(), &local, 1, &remote, 1, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == ENOSYS || errno == EPERM) {  // no process_vm_*: trust the pointer
        to_user ? std::memcpy(user, engine, bytes) : std::memcpy(engine, user, bytes);
        return 0;
      }
      return errno;
    }
    if (n == 0) return EFAULT;
    engine += n;
    user = static_cast<std::byte*>(user) + n;
    bytes -= static_cast<std::size_t>(n);
  }
  return 0;
}

// ---- streams and events ---------------------------------------------------------------------

class sim_event;

struct op {
  std::function<void()> run;              // may throw ferry::error
  std::shared_ptr<sim_event> gate;        // wait-for-event marker when set
  const std::uint32_t* wait_addr = nullptr;  // wait_value marker when set: until *wait_addr >= wait_for
  std::uint32_t wait_for = 0;
};

struct stream_state {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<op> ops;
  bool scheduled = false;  // queued on or running in the engine pool
  std::uint64_t enqueued = 0, completed = 0;
  std::optional<error> err;
  std::string name;
};

// The device's copy engines: at most `engines` tasks on the executor at once, each taking ready
// streams' front ops until none is ready.
class engine_pool {
 public:
  engine_pool(detail::executor& x, int engines, double gbps) : gbps_(gbps), engines_(x, static_cast<unsigned>(engines)) {}
  ~engine_pool() {
    {
      std::lock_guard l(mu_);
      stop_ = true;  // a task polling parked streams (waits that will never be met) ends
    }
    engines_.wait_none();
  }
  void schedule(std::shared_ptr<stream_state> s) {
    {
      std::lock_guard l(mu_);
      ready_.push_back(std::move(s));
      if (!engines_.take()) return;  // every engine runs: one of them takes it
    }
    try {
      engines_.start(mu_, [this] { work(); });
    } catch (const std::exception& e) {
      // No engine task could start (no thread can be made). Another engine running takes the
      // stream; with none, its ops would wait forever (the caller holds the stream's lock, so they
      // cannot be failed from here): the sim is a test backend, and this ends the test loudly.
      if (engines_.out() == 0) {
        log::error("sim", "no copy engine can run ({}); ending", e.what());
        std::terminate();
      }
    }
  }
  // A stream whose front op waits for a value: looked at again when an engine is idle (every 20 us).
  void park(std::shared_ptr<stream_state> s) {
    std::lock_guard l(mu_);
    parked_.push_back(std::move(s));
  }
  // Sleeps as long as a throttled copy engine would take for `bytes` beyond the time already spent.
  void throttle(std::size_t bytes, std::chrono::steady_clock::time_point start) const {
    if (gbps_ <= 0) return;
    auto want = std::chrono::nanoseconds(static_cast<std::int64_t>(static_cast<double>(bytes) / gbps_));
    std::this_thread::sleep_until(start + want);
  }
  std::atomic<int> inflight{0};

 private:
  void work();
  double gbps_;
  std::mutex mu_;
  std::deque<std::shared_ptr<stream_state>> ready_;      // with mu_
  std::vector<std::shared_ptr<stream_state>> parked_;  // with mu_
  bool stop_ = false;                                    // with mu_
  detail::task_slots engines_;  // taken and given back with mu_
};

class sim_event final : public event, public std::enable_shared_from_this<sim_event> {
 public:
  explicit sim_event(std::string name) : name_(std::move(name)) {}
  void complete() {
    std::vector<std::function<void()>> cbs;
    {
      std::lock_guard l(mu_);
      done_ = true;
      cbs.swap(callbacks_);
    }
    for (auto& cb : cbs) cb();
  }
  // Runs cb now if complete, else when it completes. Returns true if it ran now.
  bool on_complete(std::function<void()> cb) {
    std::unique_lock l(mu_);
    if (done_) return true;
    callbacks_.push_back(std::move(cb));
    return false;
  }

 private:
  bool do_query() override {
    std::lock_guard l(mu_);
    return done_;
  }
  std::string do_describe() const override { return name_; }
  std::string name_;
  std::mutex mu_;
  bool done_ = false;
  std::vector<std::function<void()>> callbacks_;
};

// The public event handed out; shares ownership of the sim_event with the stream's gate ops.
class event_handle final : public event {
 public:
  explicit event_handle(std::shared_ptr<sim_event> e) : e_(std::move(e)) {}
  const std::shared_ptr<sim_event>& impl() const { return e_; }

 private:
  bool do_query() override { return e_->done(); }
  std::string do_describe() const override { return "event"; }
  std::shared_ptr<sim_event> e_;
};

void engine_pool::work() {
  using namespace std::chrono_literals;
  detail::backoff wait({.nap = 20us, .most = 20us});
  for (;;) {
    std::shared_ptr<stream_state> s;
    {
      std::unique_lock l(mu_);
      while (ready_.empty()) {
        if (parked_.empty() || stop_) {
          engines_.give_back();  // nothing to do: the engine's task ends (a schedule starts another)
          return;
        }
        // Only streams waiting for a value: looked at again after a short sleep.
        l.unlock();
        wait.pause();
        l.lock();
        for (auto& p : parked_) ready_.push_back(std::move(p));
        parked_.clear();
      }
      s = std::move(ready_.front());
      ready_.pop_front();
    }
    op o;
    {
      std::lock_guard l(s->mu);
      if (s->ops.empty()) {
        s->scheduled = false;
        continue;
      }
      const op& front = s->ops.front();
      if (front.wait_addr || front.gate) {
        if (const std::uint32_t* a = front.wait_addr) {
          // A value wait: the stream stays parked until the word reaches the value (looked at
          // again when an engine is idle, so that a parked stream costs no engine its time).
          auto v = std::atomic_ref<std::uint32_t>(*const_cast<std::uint32_t*>(a)).load(std::memory_order_acquire);
          if (static_cast<std::int32_t>(v - front.wait_for) < 0) {
            park(s);
            continue;
          }
        } else {
          // An event wait: the stream is parked until the event completes; its callback puts it back.
          auto gate = front.gate;
          if (!gate->on_complete([this, s] { schedule(s); })) continue;
        }
        s->ops.pop_front();
        s->completed++;
        s->cv.notify_all();
        if (s->ops.empty()) s->scheduled = false;
        else schedule(s);
        continue;
      }
      o = std::move(s->ops.front());
      s->ops.pop_front();
    }
    try {
      o.run();
    } catch (const error& e) {
      std::lock_guard l(s->mu);
      if (!s->err) s->err = e;
    } catch (const std::exception& e) {
      std::lock_guard l(s->mu);
      if (!s->err) s->err = error(errc::internal, "sim.stream", s->name, e.what());
    }
    std::lock_guard l(s->mu);
    s->completed++;
    s->cv.notify_all();
    if (s->ops.empty()) s->scheduled = false;
    else schedule(s);
  }
}

// ---- device ------------------------------------------------------------------------------------

// A resolved piece of a copy: engine-view pointer, or user (host) memory when `host` is set.
struct segment {
  std::byte* ptr;
  std::size_t len;
  bool host;
};

class sim_stream;

class sim_device final : public device {
 public:
  sim_device(int ordinal, const device_settings& s, detail::executor& x)
      : device(make_info(ordinal, s), s.deadline),
        peer_access_(s.sim_peer),
        capacity_(s.sim_capacity),
        granularity_(s.sim_granularity),
        alloc_(s.sim_capacity),
        pool_(x, s.sim_copy_engines, s.sim_copy_gbps) {
    std::lock_guard l(g_devices_mu);
    g_devices.push_back(this);
  }
  ~sim_device() override {
    std::lock_guard l(g_devices_mu);
    std::erase(g_devices, this);
  }
  // The sim's kernels are its device-side stream ops (fill_pattern, checksum): their launches are seen.
  void kernel_launching() noexcept { launching(); }
  void kernel_launched() noexcept { launched(); }

  // Resolves [p, p+bytes) for an engine of device `engine_ordinal` into segments, or throws.
  // Addresses in no sim range are host memory.
  std::vector<segment> resolve(const void* p, std::size_t bytes, bool write, int engine_ordinal,
                               std::string_view op, std::string_view side);
  engine_pool& pool() { return pool_; }
  // The device's live streams by handle, for wrap_stream (a user's stream in tests), and its default one.
  class stream_registry {
   public:
    void add(const std::shared_ptr<stream_state>& s) {
      std::lock_guard l(mu_);
      live_[reinterpret_cast<std::uintptr_t>(s.get())] = s;
    }
    void remove(stream_state* s) {
      std::lock_guard l(mu_);
      live_.erase(reinterpret_cast<std::uintptr_t>(s));
    }
    std::shared_ptr<stream_state> find(std::uintptr_t h) {
      std::lock_guard l(mu_);
      auto it = live_.find(h);
      return it == live_.end() ? nullptr : it->second.lock();
    }
    std::shared_ptr<stream_state> default_stream(const std::string& name) {
      std::lock_guard l(mu_);
      if (!default_) {
        default_ = std::make_shared<stream_state>();
        default_->name = name;
      }
      return default_;
    }

   private:
    std::mutex mu_;
    std::map<std::uintptr_t, std::weak_ptr<stream_state>> live_;
    std::shared_ptr<stream_state> default_;
  };
  stream_registry& streams() { return live_streams_; }
  std::uint64_t stream_serial() { return ++streams_; }

  // This device's memory, taken and given back by chunks that live in it: its own and those a peer
  // allocated here (device::allocate with this device's ordinal). arena_mu_ is a leaf lock.
  std::uint64_t arena_take(std::uint64_t bytes, const std::string& who) {
    arena();
    std::lock_guard l(arena_mu_);
    auto off = bytes <= capacity_ - used_ ? alloc_.allocate(bytes) : std::nullopt;
    if (!off)
      fail(errc::out_of_memory, "device.allocate", fmt::format("{} bytes={}", who, bytes),
           fmt::format("device memory of {} exhausted: {} of {} in use (FERRY_SIM_CAPACITY)", id(), used_, capacity_));
    used_ += bytes;
    return *off;
  }
  void arena_give(std::uint64_t off, std::uint64_t bytes) noexcept {
    arena_->discard(off, bytes);
    std::lock_guard l(arena_mu_);
    alloc_.release(off, bytes);
    used_ -= bytes;
  }
  const backing& arena_ref() { return arena(); }

 private:
  static device_info make_info(int ordinal, const device_settings& s) {
    device_info i;
    i.backend = device_kind::sim;
    i.ordinal = ordinal;
    i.name = "ferry sim device";
    i.uuid = fmt::format("sim-{:04d}", ordinal);
    i.total_memory = s.sim_capacity;
    i.granularity = s.sim_granularity;
    i.copy_engines = s.sim_copy_engines;
    return i;
  }
  backing& arena() {
    std::call_once(arena_once_, [&] { arena_ = std::make_unique<backing>(capacity_, "ferry-sim-arena"); });
    return *arena_;
  }

  memory_usage do_memory() override {
    std::lock_guard l(arena_mu_);
    return {capacity_ - used_, capacity_};
  }
  std::uint64_t do_granularity(location) override { return granularity_; }

  std::uint64_t do_allocate(std::uint64_t bytes, location where) override {
    auto rec = std::make_unique<chunk_rec>();
    rec->where = where;
    rec->size = bytes;
    if (where.kind == memory_kind::device && where.id >= 0 && where.id != info_.ordinal) {
      // A peer's memory, mapped in this device's ranges: it lives in the peer's arena.
      if (!peer_access_)
        fail(errc::not_supported, "device.allocate", fmt::format("{} bytes={} location=sim:{}", id(), bytes, where.id),
             "peer access between sim devices is off (FERRY_SIM_PEER=0)");
      sim_device* peer = nullptr;
      {
        std::lock_guard l(g_devices_mu);
        for (sim_device* d : g_devices)
          if (d->info().ordinal == where.id) peer = d;
      }
      if (!peer)
        fail(errc::invalid_argument, "device.allocate", fmt::format("{} bytes={}", id(), bytes),
             fmt::format("no sim device {} is open (open it first, e.g. from the registry; FERRY_SIM_DEVICES)", where.id));
      rec->arena_offset = peer->arena_take(bytes, id());
      rec->home = peer;
      rec->home_arena = &peer->arena_ref();
    } else if (where.kind == memory_kind::device) {
      {
        std::lock_guard l(mem_mu_);
        collect_garbage_locked();
      }
      rec->arena_offset = arena_take(bytes, id());
    } else {
      rec->host = std::make_unique<backing>(bytes, "ferry-sim-host-chunk");
    }
    std::lock_guard l(mem_mu_);
    std::uint64_t h = ++next_handle_;
    chunks_[h] = std::move(rec);
    return h;
  }

  void do_free(std::uint64_t handle, std::uint64_t, location) noexcept override {
    std::lock_guard l(mem_mu_);
    auto it = chunks_.find(handle);
    if (it == chunks_.end()) return;
    // Copies already enqueued may still read this memory through the engine view: the memory is
    // only reused once no copy is in flight (freeing memory under a running DMA is a caller bug,
    // but it must not crash the process).
    graveyard_.push_back(std::move(it->second));
    chunks_.erase(it);
    collect_garbage_locked();
  }
  void collect_garbage_locked() noexcept {
    if (graveyard_.empty() || pool_.inflight.load() != 0) return;
    for (auto& r : graveyard_) {
      if (!r->host) (r->home ? r->home : this)->arena_give(r->arena_offset, r->size);
    }
    graveyard_.clear();
  }

  std::uintptr_t do_reserve(std::uint64_t bytes, std::uint64_t alignment) override {
    // Over-reserve to align, then trim; PROT_NONE so stray CPU accesses fault.
    std::uint64_t span = bytes + alignment;
    void* p = ::mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) fail_errno(errno, "device.reserve", fmt::format("{} bytes={}", id(), bytes));
    auto a = reinterpret_cast<std::uintptr_t>(p);
    auto base = (a + alignment - 1) / alignment * alignment;
    if (base > a) ::munmap(p, base - a);
    if (auto end = a + span; end > base + bytes) ::munmap(reinterpret_cast<void*>(base + bytes), end - base - bytes);
    return base;
  }
  void do_release(std::uintptr_t base, std::uint64_t bytes) noexcept override {
    ::munmap(reinterpret_cast<void*>(base), bytes);
  }

  void do_map(std::uintptr_t va, std::uint64_t bytes, std::uint64_t handle, location) override {
    std::lock_guard l(mem_mu_);
    auto& rec = chunks_.at(handle);
    int fd = rec->host ? rec->host->fd : rec->home_arena ? rec->home_arena->fd : arena().fd;
    off_t off = rec->host ? 0 : static_cast<off_t>(rec->arena_offset);
    void* p = ::mmap(reinterpret_cast<void*>(va), bytes, PROT_NONE, MAP_SHARED | MAP_FIXED, fd, off);
    if (p == MAP_FAILED) fail_errno(errno, "device.map", fmt::format("{} va={}", id(), describe_range(va, bytes)));
  }
  void do_unmap(std::uintptr_t va, std::uint64_t bytes) noexcept override {
    // Put the reservation placeholder back.
    ::mmap(reinterpret_cast<void*>(va), bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1,
           0);
  }
  void do_set_access(std::uintptr_t va, std::uint64_t bytes, const mapping& m,
                     std::span<const access_desc> grants) override {
    for (auto& g : grants)
      if (g.who.kind == memory_kind::device && g.who.id >= 0 && g.who.id != info_.ordinal && !peer_access_ &&
          g.flags != access::none)
        fail(errc::not_supported, "device.set_access", fmt::format("{} va={}", id(), describe_range(va, bytes)),
             fmt::format("sim:{} has no peer access to {} (FERRY_SIM_PEER=0)", g.who.id, id()));
    for (auto& g : grants) {
      if (g.who.kind != memory_kind::host || m.where.kind != memory_kind::host) continue;
      int prot = g.flags == access::read_write ? PROT_READ | PROT_WRITE : g.flags == access::read ? PROT_READ : PROT_NONE;
      if (::mprotect(reinterpret_cast<void*>(va), bytes, prot) != 0)
        fail_errno(errno, "device.set_access", fmt::format("{} va={}", id(), describe_range(va, bytes)));
    }
  }
  std::unique_ptr<stream> do_create_stream() override;
  std::unique_ptr<stream> do_wrap_stream(native_stream n) override;
  void do_enable_peer_access(device& peer) override {
    if (!peer_access_)
      fail(errc::not_supported, "device.enable_peer_access", id() + " -> " + peer.id(),
           "peer access between sim devices is off (FERRY_SIM_PEER=0)");
  }
  bool do_watch_launches(std::string&) override { return true; }

  bool peer_access_;
  std::uint64_t capacity_, granularity_;
  std::once_flag arena_once_;
  std::unique_ptr<backing> arena_;
  std::mutex mem_mu_;
  std::mutex arena_mu_;    // alloc_, used_: taken inside mem_mu_ (or a peer's), never the other way
  arena_allocator alloc_;
  std::uint64_t used_ = 0;
  std::uint64_t next_handle_ = 0;
  std::map<std::uint64_t, std::unique_ptr<chunk_rec>> chunks_;
  std::vector<std::unique_ptr<chunk_rec>> graveyard_;
  std::atomic<std::uint64_t> streams_{0};
  stream_registry live_streams_;
  engine_pool pool_;  // last: its tasks end before the memory they use goes away
};

std::vector<segment> sim_device::resolve(const void* p, std::size_t bytes, bool write, int engine_ordinal,
                                         std::string_view op, std::string_view side) {
  check_access(p, bytes, write, engine_ordinal, op, side);
  auto a = reinterpret_cast<std::uintptr_t>(p);
  std::vector<segment> out;
  std::lock_guard l(map_mu());
  for (std::uintptr_t cur = a; cur < a + bytes;) {
    std::uintptr_t base = 0;
    const mapping* m = find_mapping(cur, &base);
    if (!m)  // unmapped since the check
      fail(errc::bad_address, std::string(op), fmt::format("{} {}={}", id(), side, describe_range(p, bytes)),
           fmt::format("{:#x} is not mapped on {}", cur, id()));
    std::size_t len = std::min<std::uintptr_t>(a + bytes, base + m->size) - cur;
    std::lock_guard ml(mem_mu_);
    out.push_back({chunks_.at(m->chunk)->view(arena_.get()) + (cur - base), len, false});
    cur += len;
  }
  return out;
}

// Resolves an address for `engine`: its own ranges first, then peers', else host memory.
std::vector<segment> resolve_any(sim_device& engine, const void* p, std::size_t bytes, bool write, std::string_view op,
                                 std::string_view side) {
  if (engine.owns(p, 1))
    return engine.resolve(p, bytes, write, engine.info().ordinal, op, side);
  std::lock_guard l(g_devices_mu);
  for (sim_device* d : g_devices)
    if (d != &engine && d->owns(p, 1)) return d->resolve(p, bytes, write, engine.info().ordinal, op, side);
  return {{static_cast<std::byte*>(const_cast<void*>(p)), bytes, true}};
}

class sim_stream final : public stream {
 public:
  explicit sim_stream(sim_device& d) : stream(d), dev_(d), state_(std::make_shared<stream_state>()) {
    state_->name = fmt::format("{} stream#{}", d.id(), d.stream_serial());
    d.streams().add(state_);
  }
  sim_stream(sim_device& d, std::shared_ptr<stream_state> st) : stream(d, true), dev_(d), state_(std::move(st)) {}
  ~sim_stream() override {
    if (is_view()) return;
    dev_.streams().remove(state_.get());
    try {
      do_synchronize(deadline_after(dev_.default_timeout()));
    } catch (const error& e) {
      log::warn("sim", "{} destroyed with failed or unfinished work: {}", state_->name, e.what());
    }
  }

 private:
  void enqueue(op o) {
    std::lock_guard l(state_->mu);
    state_->ops.push_back(std::move(o));
    state_->enqueued++;
    if (!state_->scheduled) {
      state_->scheduled = true;
      dev_.pool().schedule(state_);
    }
  }
  // Wraps work so the device knows a copy engine may be touching memory.
  template <typename F>
  void enqueue_io(F f) {
    auto* pool = &dev_.pool();
    pool->inflight++;
    enqueue({[pool, f = std::move(f)] {
               struct done {
                 engine_pool* p;
                 ~done() { p->inflight--; }
               } d{pool};
               f();
             },
             nullptr});
  }

  void do_copy(void* dst, const void* src, std::size_t bytes) override {
    auto d = resolve_any(dev_, dst, bytes, true, "stream.copy", "dst");
    auto s = resolve_any(dev_, src, bytes, false, "stream.copy", "src");
    std::string name = state_->name;
    enqueue_io([pool = &dev_.pool(), d = std::move(d), s = std::move(s), bytes, dst, src, name] {
      auto start = std::chrono::steady_clock::now();
      std::size_t di = 0, si = 0, doff = 0, soff = 0;
      std::vector<std::byte> bounce;
      while (di < d.size() && si < s.size()) {
        std::size_t n = std::min(d[di].len - doff, s[si].len - soff);
        std::byte* dp = d[di].ptr + doff;
        std::byte* sp = s[si].ptr + soff;
        int err = 0;
        if (!d[di].host && !s[si].host) std::memcpy(dp, sp, n);
        else if (d[di].host && !s[si].host) err = host_transfer(sp, dp, n, true);
        else if (!d[di].host && s[si].host) err = host_transfer(dp, sp, n, false);
        else {
          bounce.resize(n);
          err = host_transfer(bounce.data(), sp, n, false);
          if (err) {
            fail_errno(err, "stream.copy", fmt::format("{} src={}", name, describe_range(src, bytes)),
                       "source host memory is not readable");
          }
          err = host_transfer(bounce.data(), dp, n, true);
        }
        if (err) {
          // Tell which side was bad: probe the source with a one-byte read.
          std::byte probe;
          bool src_bad = s[si].host && host_transfer(&probe, sp, 1, false) != 0;
          fail_errno(err, "stream.copy",
                     fmt::format("{} {}={}", name, src_bad ? "src" : "dst",
                                 src_bad ? describe_range(src, bytes) : describe_range(dst, bytes)),
                     src_bad ? "source host memory is not readable" : "destination host memory is not writable");
        }
        doff += n;
        soff += n;
        if (doff == d[di].len) { ++di; doff = 0; }
        if (soff == s[si].len) { ++si; soff = 0; }
      }
      pool->throttle(bytes, start);
    });
  }

  // Device-side ops work on device-accessible memory (own ranges or host memory), like a kernel.
  struct launch_scope {
    sim_device& d;
    explicit launch_scope(sim_device& dev) : d(dev) { d.kernel_launching(); }
    ~launch_scope() { d.kernel_launched(); }
  };
  void do_fill_pattern(void* dst, std::size_t bytes, std::uint64_t seed) override {
    launch_scope launch(dev_);
    auto d = resolve_any(dev_, dst, bytes, true, "stream.fill_pattern", "dst");
    std::string name = state_->name;
    enqueue_io([d = std::move(d), seed, name, dst, bytes] {
      std::size_t done = 0;
      std::vector<std::byte> tmp;
      for (auto& seg : d) {
        // The pattern is defined per 8-byte word of the whole buffer: segments start on word
        // boundaries because mappings are granularity-aligned and dst is 8-byte aligned.
        std::byte* out = seg.ptr;
        if (seg.host) {
          tmp.resize(seg.len);
          out = tmp.data();
        }
        ferry::fill_pattern(out, seg.len, seed + done / 8);
        if (seg.host)
          if (int e = host_transfer(tmp.data(), seg.ptr, seg.len, true))
            fail_errno(e, "stream.fill_pattern", fmt::format("{} dst={}", name, describe_range(dst, bytes)));
        done += seg.len;
      }
    });
  }

  void do_checksum(const void* src, std::size_t bytes, std::uint64_t* result) override {
    launch_scope launch(dev_);
    auto s = resolve_any(dev_, src, bytes, false, "stream.checksum", "src");
    std::string name = state_->name;
    enqueue_io([s = std::move(s), result, bytes, name, src] {
      // checksum64 is a sum over words, so per-segment sums combine after re-basing the word index:
      // recompute with the global index by feeding each segment through a word loop.
      std::uint64_t sum = bytes * golden64;
      std::size_t word = 0;
      std::vector<std::byte> tmp;
      std::uint64_t carry = 0;
      std::size_t carry_len = 0;
      auto add_bytes = [&](const std::byte* p, std::size_t n) {
        while (n) {
          std::size_t take = std::min(n, 8 - carry_len);
          std::memcpy(reinterpret_cast<std::byte*>(&carry) + carry_len, p, take);
          carry_len += take;
          p += take;
          n -= take;
          if (carry_len == 8) {
            sum += splitmix64(carry ^ (word * golden64));
            ++word;
            carry = 0;
            carry_len = 0;
          }
        }
      };
      for (auto& seg : s) {
        const std::byte* in = seg.ptr;
        if (seg.host) {
          tmp.resize(seg.len);
          if (int e = host_transfer(tmp.data(), seg.ptr, seg.len, false))
            fail_errno(e, "stream.checksum", fmt::format("{} src={}", name, describe_range(src, bytes)));
          in = tmp.data();
        }
        add_bytes(in, seg.len);
      }
      if (carry_len) sum += splitmix64(carry ^ (word * golden64));
      *result = sum;
    });
  }

  native_stream do_native_handle() const noexcept override { return {reinterpret_cast<std::uintptr_t>(state_.get())}; }
  // Stream memory operations on host memory (a sim device's own memory has no CPU address to poll).
  void check_word(const void* addr, const char* op) {
    if (dev_.owns(addr, 4))
      fail(errc::not_supported, op, fmt::format("{} at {}", state_->name, describe_range(addr, 4)),
           "the sim backend's stream memory operations take host memory only");
  }
  void do_write_value(std::uint32_t* addr, std::uint32_t value) override {
    check_word(addr, "stream.write_value");
    enqueue({[addr, value] { std::atomic_ref<std::uint32_t>(*addr).store(value, std::memory_order_release); }, nullptr});
  }
  void do_wait_value(const std::uint32_t* addr, std::uint32_t value) override {
    check_word(addr, "stream.wait_value");
    enqueue({nullptr, nullptr, addr, value});
  }

  std::unique_ptr<event> do_record() override {
    auto e = std::make_shared<sim_event>(state_->name);
    enqueue({[e] { e->complete(); }, nullptr});
    return std::make_unique<event_handle>(e);
  }
  void do_wait(event& e) override {
    auto* h = dynamic_cast<event_handle*>(&e);
    if (!h) fail(errc::invalid_argument, "stream.wait", state_->name, "event belongs to another backend");
    enqueue({nullptr, h->impl()});
  }
  bool do_idle() override {
    std::lock_guard l(state_->mu);
    return state_->completed == state_->enqueued;
  }
  void do_synchronize(deadline until) override {
    std::unique_lock l(state_->mu);
    if (!state_->cv.wait_until(l, until, [&] { return state_->completed == state_->enqueued; }))
      fail(errc::timeout, "stream.synchronize", state_->name,
           fmt::format("deadline expired with {} of {} operations unfinished", state_->enqueued - state_->completed,
                       state_->enqueued));
    if (state_->err) {
      error e = std::move(*state_->err);
      state_->err.reset();
      throw e;
    }
  }

  sim_device& dev_;
  std::shared_ptr<stream_state> state_;
};

std::unique_ptr<stream> sim_device::do_create_stream() { return std::make_unique<sim_stream>(*this); }
std::unique_ptr<stream> sim_device::do_wrap_stream(native_stream n) {
  if (n.handle == 0 || n == native_stream::legacy() || n == native_stream::per_thread())
    return std::make_unique<sim_stream>(*this, live_streams_.default_stream(fmt::format("{} default stream", id())));
  auto st = live_streams_.find(n.handle);
  if (!st) fail(errc::invalid_argument, "stream.wrap", fmt::format("{} stream {:#x}", id(), n.handle), "not a live stream of this device");
  return std::make_unique<sim_stream>(*this, std::move(st));
}

// Peer-memory client for sim device ranges: no pinning needed; a range's serial is its buffer id.
class sim_client final : public peer_memory_client {
 public:
  std::string_view name() const noexcept override { return "sim"; }
  std::optional<memory_region> acquire(const void* p, std::uint64_t) override {
    std::lock_guard l(g_devices_mu);
    for (sim_device* d : g_devices)
      if (auto r = d->range_containing(p))
        return memory_region{memory_type::device, device_kind::sim, d->info().ordinal, r->base, r->size, r->serial, this};
    return std::nullopt;
  }
  std::uint64_t pin(const memory_region&, std::uintptr_t, std::uint64_t) override { return 0; }
  void unpin(std::uint64_t, std::uintptr_t, std::uint64_t) noexcept override {}
  bool pin_is_free() const noexcept override { return true; }
  bool still_valid(const memory_region& r) override {
    std::lock_guard l(g_devices_mu);
    for (sim_device* d : g_devices)
      if (auto rr = d->range_containing(reinterpret_cast<const void*>(r.base)))
        return rr->serial == r.buffer_id && rr->base == r.base;
    return false;
  }
};

}  // namespace

std::unique_ptr<peer_memory_client> make_client() { return std::make_unique<sim_client>(); }

std::unique_ptr<device> create_device(int ordinal, const device_settings& s, detail::executor& workers) {
  return std::make_unique<sim_device>(ordinal, s, workers);
}

}  // namespace ferry::sim
