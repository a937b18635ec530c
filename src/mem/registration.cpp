#include <ferry/core/error.hpp>
#include <ferry/mem/registration.hpp>

#include "core/logging.hpp"

#include <fmt/format.h>
#include <sys/eventfd.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <ucm/api/ucm.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <span>
#include <array>
#include <atomic>
#include <condition_variable>
#include <list>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <thread>

namespace ferry {

std::string_view to_string(device_kind k) noexcept {
  switch (k) {
    case device_kind::none: return "host";
    case device_kind::cuda: return "cuda";
    case device_kind::sim: return "sim";
  }
  return "?";
}

std::string_view to_string(memory_type t) noexcept {
  switch (t) {
    case memory_type::unknown: return "unknown";
    case memory_type::host_pageable: return "host_pageable";
    case memory_type::host_pinned: return "host_pinned";
    case memory_type::device: return "device";
    case memory_type::managed: return "managed";
    case memory_type::unified: return "unified";
  }
  return "?";
}

peer_memory_client::~peer_memory_client() = default;

struct registration::entry {
  std::uintptr_t base = 0;
  std::uint64_t size = 0;
  memory_region region;
  std::uint64_t cookie = 0;
  int refs = 0;                      // handles holding it (cache mutex)
  std::atomic<bool> valid{true};
  bool in_index = true;
  std::list<std::shared_ptr<entry>>::iterator lru;
  bool in_lru = false;
  std::vector<std::function<void()>> callbacks;  // cache mutex
};

namespace {

std::uintptr_t page_size() {
  static const std::uintptr_t p = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  return p;
}

// Every live cache, for the process-wide munmap hook. Hooks take it shared (glibc's rwlock prefers
// readers), so a hook fired inside a cache operation of another thread never waits for a writer.
std::shared_mutex g_caches_mu;
// Fixed slots: nothing is allocated while the lock is held exclusively, so an munmap hook (which
// takes it shared) can never fire on a thread that holds it.
constexpr std::size_t max_caches = 64;
registration_cache* g_caches[max_caches] = {};
// Clients every cache asks first (memory the whole process knows, e.g. unified memory spaces).
// Taken before g_caches_mu and a cache's own lock; held by a cache's constructor and destructor, so
// the caches listed stay alive while a client is added to or removed from them.
std::mutex g_process_mu;
std::vector<peer_memory_client*> g_process_clients;
thread_local int t_inside_cache = 0;  // >0 while this thread holds a cache lock

struct inside_guard {
  inside_guard() { ++t_inside_cache; }
  ~inside_guard() { --t_inside_cache; }
};

// Every hold of a cache's lock marks the thread as inside: anything done under it may allocate, and
// malloc may munmap (a new thread's first malloc maps a fresh arena and trims it), which runs the
// munmap hook on this thread -- it must then record the range, not take the lock again.
struct cache_lock {
  std::lock_guard<std::mutex> l;
  inside_guard g;
  explicit cache_lock(std::mutex& m) : l(m) {}
};

}  // namespace

struct registration_cache::impl {
  std::mutex mu;
  std::vector<peer_memory_client*> clients;
  std::map<std::uintptr_t, std::shared_ptr<registration::entry>> index;  // non-overlapping, by base
  std::list<std::shared_ptr<registration::entry>> lru;                   // unused, most recent first
  std::uint64_t bytes_pinned = 0;
  registration_stats st;
  // Ranges unmapped under a memory hook (or while this thread was inside the cache): recorded without
  // allocating or blocking, and applied by the cache's own thread soon after and in any case before
  // its next lookup, so a stale entry is never served. A hook runs inside the allocator -- free() trimming the heap (sbrk) or returning a large
  // chunk (munmap) -- which holds its own lock: anything that allocates there, the driver's
  // cuMemHostUnregister included, deadlocks that thread for good. A few distinct ranges are kept
  // apart (the heap's top and the mmap area lie far apart: one covering interval would drop every
  // registration in between); past that the two closest are merged (the least memory covered that
  // was not unmapped: an entry there is dropped and registered again when next asked for).
  struct pending_ranges {
    std::atomic_flag busy;  // held for a few instructions, by hooks and by take()
    std::atomic<bool> any{false};
    std::array<std::pair<std::uintptr_t, std::uintptr_t>, 128> r{};
    std::size_t n = 0;
    void lock() noexcept {
      while (busy.test_and_set(std::memory_order_acquire)) {
      }
    }
    void unlock() noexcept { busy.clear(std::memory_order_release); }
    // Records [lo, hi); true when nothing was recorded before (the first of a burst).
    bool add(std::uintptr_t lo, std::uintptr_t hi) noexcept {
      lock();
      std::size_t i = 0;
      while (i < n && (lo > r[i].second || hi < r[i].first)) ++i;  // the first it overlaps or touches
      if (i < n) {
        r[i].first = std::min(r[i].first, lo);
        r[i].second = std::max(r[i].second, hi);
      } else if (n < r.size()) {
        r[n++] = {lo, hi};
      } else {
        // Full: the new range joins the recorded one nearest to it.
        std::size_t best = 0;
        std::uintptr_t gap = ~std::uintptr_t{0};
        for (std::size_t k = 0; k < n; ++k) {
          const std::uintptr_t g = lo > r[k].second ? lo - r[k].second : r[k].first - hi;
          if (g < gap) gap = g, best = k;
        }
        r[best].first = std::min(r[best].first, lo);
        r[best].second = std::max(r[best].second, hi);
      }
      const bool was = any.exchange(true, std::memory_order_acq_rel);
      unlock();
      return !was;
    }
    // Moves the recorded ranges into `out`; how many.
    std::size_t take(std::array<std::pair<std::uintptr_t, std::uintptr_t>, 128>& out) noexcept {
      if (!any.exchange(false, std::memory_order_acq_rel)) return 0;
      lock();
      const std::size_t k = n;
      std::copy(r.begin(), r.begin() + static_cast<std::ptrdiff_t>(k), out.begin());
      n = 0;
      unlock();
      return k;
    }
  } pending;
  // Ranges recently classified, by base -> end: classifying asks every client (a CUDA driver call
  // with six attributes, msync, probes), microseconds that a 4 KiB remote read or a 64 KiB copy
  // cannot afford on every request. Pageable ranges are dropped with the memory (munmap hooks ->
  // invalidate); a CUDA allocation's entry is checked on every hit with its client's still_valid
  // (one attribute: the buffer id, which a free and a new allocation at the same address change).
  // Bounded.
  std::map<std::uintptr_t, std::pair<std::uintptr_t, memory_region>> seen;
  // A pageable range found mapped, joined with those seen next to it or over it: a buffer read into a
  // page at a time (a ferry:// source's small reads) then becomes one entry, not a probe per page.
  // (An unmap drops every entry it touches: a joined one whole.) mu held.
  void remember_pageable(std::uintptr_t a, std::uint64_t n, const memory_region& r) {
    std::uintptr_t lo = a, hi = a + n;
    auto next = seen.lower_bound(lo);
    if (next != seen.begin()) {
      auto before = std::prev(next);
      if (before->second.second.type == memory_type::host_pageable && before->second.first >= lo) {
        lo = before->first;
        hi = std::max(hi, before->second.first);
        next = seen.erase(before);
      }
    }
    while (next != seen.end() && next->first <= hi && next->second.second.type == memory_type::host_pageable) {
      hi = std::max(hi, next->second.first);
      next = seen.erase(next);
    }
    seen[lo] = {hi, r};
  }
  std::uint64_t generation = 0;  // bumped by every invalidation: a probe that raced one is not remembered
  // classify() calls asking clients outside the lock: a client withdrawn waits for them. Counted
  // up under mu, down without it (no second lock per classification); a withdrawal under way is
  // woken by the last one out.
  std::atomic<int> asking{0}, withdrawing{0};
  std::condition_variable asked;

  void drop_locked(const std::shared_ptr<registration::entry>& e) {
    if (e->in_index) {
      index.erase(e->base);
      e->in_index = false;
    }
    if (e->in_lru) {
      lru.erase(e->lru);
      e->in_lru = false;
    }
    if (e->refs == 0) unpin_locked(*e);
  }
  void unpin_locked(registration::entry& e) {
    if (e.cookie == ~std::uint64_t{0}) return;  // already unpinned
    if (e.region.client) e.region.client->unpin(e.cookie, e.base, e.size);
    if (!e.region.client || !e.region.client->pin_is_free()) bytes_pinned -= e.size;
    e.cookie = ~std::uint64_t{0};
  }
  void evict_locked(std::uint64_t limit) {
    while (bytes_pinned > limit && !lru.empty()) {
      auto e = lru.back();
      drop_locked(e);
      st.evictions++;
    }
  }
  // Collects the callbacks of every entry overlapping [b, b+n) and drops the entries.
  // Records a hook's range for the next classify/acquire (no lock, no allocation); ranges merge.
  void defer(std::uintptr_t base, std::uint64_t size) noexcept {
    // The first range since the last take wakes the thread (the others find it woken already).
    // Decided under the ranges' flag: a take between a look and the add cannot lose the wake-up.
    if (pending.add(base, base + size) && ap) {
      // A raw system call: fine inside free() (no lock, no allocation, not a cancellation point).
      const std::uint64_t one = 1;
      [[maybe_unused]] auto w = ::syscall(SYS_write, ap->fd, &one, sizeof one);
    }
  }
  // What hooks recorded is also applied soon by a thread of the cache's own, not only at the next
  // lookup: until then the driver keeps the registration of memory the process freed, and refuses
  // new memory at that address (a cuMemAlloc or cuMemHostRegister of the user's that lands there
  // fails). Woken through an eventfd: a hook may write it, it neither allocates nor locks.
  // The thread's own state outlives the cache: a holder's on_invalidate callback, run by the thread,
  // may drop the last reference to the cache's owner, and the cache is then destroyed on that thread.
  struct applier_state {
    int fd = -1;
    pid_t pid = 0;  // the process that made the thread
    std::atomic<bool> stopping{false};
    ~applier_state() {
      if (fd >= 0) ::close(fd);
    }
  };
  std::shared_ptr<applier_state> ap;
  std::thread applier;
  // From memory hooks (`hooked`), entries of clients whose memory is remapped in place as it moves
  // (unified memory) are left alone: such an unmap is a page moving, not the memory going away.
  std::vector<std::function<void()>> invalidate_locked(std::uintptr_t b, std::uint64_t n, bool hooked = false) {
    std::vector<std::function<void()>> cbs;
    generation++;
    for (auto h = seen.begin(); h != seen.end();)
      h = h->first < b + n && h->second.first > b ? seen.erase(h) : std::next(h);
    auto it = index.upper_bound(b);
    if (it != index.begin()) --it;
    while (it != index.end() && it->first < b + n) {
      auto e = it->second;
      ++it;
      if (e->base + e->size <= b) continue;
      if (hooked && e->region.client && !e->region.client->host_mappings()) continue;
      e->valid = false;
      st.invalidations++;
      for (auto& cb : e->callbacks) cbs.push_back(std::move(cb));
      e->callbacks.clear();
      drop_locked(e);
      // The memory is going away: release the pages now even if a holder still has the handle
      // (PeerDirect's invalidate: holders learn it from valid() and their callback).
      unpin_locked(*e);
    }
    return cbs;
  }
};

namespace {

void on_vm_unmapped(ucm_event_type_t, ucm_event_t* ev, void*) {
  auto b = reinterpret_cast<std::uintptr_t>(ev->vm_unmapped.address);
  std::uint64_t n = ev->vm_unmapped.size;
  std::shared_lock l(g_caches_mu);
  for (registration_cache* c : g_caches)
    if (c) c->invalidate_soon(b, n);
}

// The process that installed the hooks (0: none did).
std::atomic<pid_t> g_hooks_pid{0};

// fork() copies the locks below as they are, held or not, and only the forking thread into the
// child: a lock a hook or a cache of another thread held at the fork is never let go there, and the
// child's first cache waited for it forever (or its munmaps spun on a copied cache's range flag). The
// child starts them anew, with no cache and no process client listed: every one alive at the fork is
// the parent's. Nothing is held across the fork in the parent: with the locks held there, forks of a
// process using CUDA hung (likely a fork handler of the driver waiting for a driver thread inside this
// hook, which waited for the lock; docs/design/transfer-engine.md).
void fork_child() {
  new (&g_process_mu) std::mutex;
  new (&g_caches_mu) std::shared_mutex;
  std::fill(std::begin(g_caches), std::end(g_caches), nullptr);
  new (&g_process_clients) std::vector<peer_memory_client*>;  // the parent's vector is left as it was
}

void install_hooks_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    ucs_status_t st = ucm_set_event_handler(UCM_EVENT_VM_UNMAPPED, 1000, on_vm_unmapped, nullptr);
    if (st != UCS_OK) {
      log::warn("mem", "cannot install memory hooks (libucm: {}); host registrations are checked only on eviction",
                static_cast<int>(st));
      return;
    }
    g_hooks_pid = ::getpid();
    if (const int e = ::pthread_atfork(nullptr, nullptr, fork_child); e != 0)
      log::warn("mem", "pthread_atfork: {}; a process forked from this one may wait forever for a lock a thread held "
                "at the fork", std::strerror(e));
  });
}

}  // namespace

bool memory_hooks_inherited() noexcept {
  const pid_t p = g_hooks_pid.load();
  return p != 0 && p != ::getpid();
}

// ---- registration handle ----------------------------------------------------------------------

registration::registration(registration&& o) noexcept { *this = std::move(o); }
registration& registration::operator=(registration&& o) noexcept {
  if (this != &o) {
    if (cache_) cache_->release(*this);
    cache_ = std::exchange(o.cache_, nullptr);
    region_ = std::move(o.region_);
    entries_ = std::move(o.entries_);
  }
  return *this;
}
registration::~registration() {
  if (cache_) cache_->release(*this);
}
bool registration::valid() const noexcept {
  for (auto& e : entries_)
    if (!e->valid.load(std::memory_order_acquire)) return false;
  return cache_ != nullptr;
}
std::vector<std::pair<std::uintptr_t, std::uint64_t>> registration::pieces() const {
  std::vector<std::pair<std::uintptr_t, std::uint64_t>> out;
  std::uintptr_t lo = region_.base, hi = region_.base + region_.size;
  for (auto& e : entries_) {
    std::uintptr_t a = std::max(lo, e->base), b = std::min(hi, e->base + e->size);
    if (a < b) out.emplace_back(a, b - a);
  }
  return out;
}

std::vector<registration::piece> registration::registered_pieces() const {
  std::vector<piece> out;
  std::uintptr_t lo = region_.base, hi = region_.base + region_.size;
  for (auto& e : entries_) {
    std::uintptr_t a = std::max(lo, e->base), b = std::min(hi, e->base + e->size);
    if (a < b) out.push_back({a, b - a, e->cookie, e->base, e->size});
  }
  return out;
}

void registration::on_invalidate(std::function<void()> cb) {
  if (!cache_) return;
  auto shared = std::make_shared<std::function<void()>>(std::move(cb));
  auto once = std::make_shared<std::once_flag>();
  bool already = false;
  {
    cache_lock l(cache_->impl_->mu);
    for (auto& e : entries_) {
      if (!e->valid) already = true;
      else e->callbacks.push_back([shared, once] { std::call_once(*once, *shared); });
    }
  }
  if (already) std::call_once(*once, *shared);
}

// ---- cache ------------------------------------------------------------------------------------

registration_cache::registration_cache(std::vector<peer_memory_client*> clients, std::uint64_t pin_limit)
    : pin_limit_(pin_limit), impl_(std::make_unique<impl>()) {
  std::lock_guard pl(g_process_mu);
  impl_->clients = g_process_clients;
  for (auto* c : clients)
    if (c) impl_->clients.push_back(c);
  install_hooks_once();
  bool placed = false;
  {
    std::lock_guard l(g_caches_mu);
    for (auto& slot : g_caches)
      if (!slot) {
        slot = this;
        placed = true;
        break;
      }
  }
  if (!placed) fail(errc::busy, "mem.cache", "registration caches", fmt::format("more than {} alive at once", max_caches));
  // Started last: a constructor that throws leaves no thread behind.
  if (const int fd = ::eventfd(0, EFD_CLOEXEC); fd >= 0) {
    impl_->ap = std::make_shared<impl::applier_state>();
    impl_->ap->fd = fd;
    impl_->ap->pid = ::getpid();
    // Touches the cache only between a wake-up and the end of apply_pending(), and never once
    // `stopping` is set (the cache may be gone by then).
    // Dedicated, not the executor's: a hook inside free() can only write an eventfd (no lock, no
    // allocation), which a thread must sit on; and its state outlives the cache (above).
    impl_->applier = std::thread([this, st = impl_->ap] {
      for (;;) {
        std::uint64_t n = 0;
        if (::read(st->fd, &n, sizeof n) < 0) {
          if (errno == EINTR) continue;
          log::error("mem", "registration cache: reading its wake-up descriptor: {}", std::strerror(errno));
          return;  // lookups still apply what hooks record
        }
        if (st->stopping.load()) return;
        try {
          apply_pending();
        } catch (const std::exception& e) {
          log::error("mem", "applying unmapped ranges to the registration cache: {}", e.what());
        } catch (...) {
          log::error("mem", "applying unmapped ranges to the registration cache: an unknown exception");
        }
      }
    });
    const std::uint64_t one = 1;  // what hooks recorded before the thread was there
    [[maybe_unused]] auto w = ::syscall(SYS_write, impl_->ap->fd, &one, sizeof one);
  }
}

registration_cache::~registration_cache() {
  {
    std::lock_guard pl(g_process_mu);
    std::lock_guard l(g_caches_mu);
    for (auto& slot : g_caches)
      if (slot == this) slot = nullptr;
  }
  if (impl_->applier.joinable()) {
    impl_->ap->stopping = true;
    const std::uint64_t one = 1;
    [[maybe_unused]] auto w = ::syscall(SYS_write, impl_->ap->fd, &one, sizeof one);
    if (impl_->ap->pid != ::getpid()) {
      // A fork()ed child: the thread is the parent's (the child has none); its handle is let go
      // untouched (joining or detaching a thread that is not there is undefined).
      new std::thread(std::move(impl_->applier));
    } else if (impl_->applier.get_id() == std::this_thread::get_id()) {
      // Destroyed by a callback the thread ran: it stops by itself, without touching the cache again.
      impl_->applier.detach();
    } else {
      impl_->applier.join();
    }
  }
  cache_lock l(impl_->mu);
  while (!impl_->index.empty()) {
    auto e = impl_->index.begin()->second;  // a copy: drop_locked erases the map's own shared_ptr
    impl_->drop_locked(e);
  }
}

void registration_cache::add_client(peer_memory_client* c, bool first) {
  cache_lock l(impl_->mu);
  if (first) impl_->clients.insert(impl_->clients.begin(), c);
  else impl_->clients.push_back(c);
}

namespace {
void check_range(const void* p, std::uint64_t n, std::string_view op) {
  auto a = reinterpret_cast<std::uintptr_t>(p);
  if (!p) fail(errc::invalid_argument, std::string(op), describe_range(p, n), "null pointer");
  if (n == 0) fail(errc::invalid_argument, std::string(op), describe_range(p, n), "zero length");
  if (a + n < a) fail(errc::out_of_range, std::string(op), describe_range(p, n), "length overflows the address space");
}
}  // namespace

void registration_cache::apply_pending() {
  if (!impl_->pending.any.load(std::memory_order_acquire)) return;
  // Taken and applied under the cache's lock: an acquire cannot register memory newly mapped at an
  // unmapped range's address between the two (and lose that registration to the stale range).
  std::array<std::pair<std::uintptr_t, std::uintptr_t>, 128> got;
  std::vector<std::function<void()>> cbs;
  {
    cache_lock l(impl_->mu);
    const std::size_t k = impl_->pending.take(got);
    for (std::size_t i = 0; i < k; ++i) {
      if (got[i].first >= got[i].second) continue;
      auto more = impl_->invalidate_locked(got[i].first, got[i].second - got[i].first, true);
      cbs.insert(cbs.end(), std::make_move_iterator(more.begin()), std::make_move_iterator(more.end()));
    }
  }
  for (auto& cb : cbs) cb();
}

memory_region registration_cache::classify(const void* p, std::uint64_t n) {
  check_range(p, n, "mem.classify");
  apply_pending();
  auto a = reinterpret_cast<std::uintptr_t>(p);
  // The clients as they are now, taken under the same lock as the look-ups and asked outside it (an
  // ask may call the driver); a handful, so no allocation per classification.
  std::array<peer_memory_client*, 8> few{};
  std::vector<peer_memory_client*> many;
  std::span<peer_memory_client* const> clients;
  std::uint64_t gen;
  {
    cache_lock l(impl_->mu);
    impl_->st.classifications++;
    auto it = impl_->index.upper_bound(a);
    if (it != impl_->index.begin()) {
      auto& e = std::prev(it)->second;
      if (a >= e->base && a + n <= e->base + e->size && e->region.client && e->region.client->still_valid(e->region))
        return e->region;
    }
    auto h = impl_->seen.upper_bound(a);
    if (h != impl_->seen.begin()) {
      --h;
      if (a >= h->first && a + n <= h->second.first) {
        memory_region r = h->second.second;
        if (r.type == memory_type::host_pageable) {
          r.base = a;
          r.size = n;
          return r;
        }
        if (r.client && r.client->still_valid(r)) return r;
        impl_->seen.erase(h);  // freed, perhaps re-allocated: asked afresh below
      }
    }
    if (impl_->clients.size() <= few.size()) {
      std::copy(impl_->clients.begin(), impl_->clients.end(), few.begin());
      clients = {few.data(), impl_->clients.size()};
    } else {
      many = impl_->clients;
      clients = many;
    }
    gen = impl_->generation;
    impl_->asking++;
  }
  struct done_asking {
    impl& I;
    ~done_asking() {
      if (I.asking.fetch_sub(1) == 1 && I.withdrawing.load()) {
        cache_lock l(I.mu);  // the withdrawal is either before its check or asleep: never missed
        I.asked.notify_all();
      }
    }
  } asked{*impl_};
  for (auto* c : clients)
    if (auto r = c->acquire(p, n)) {
      // Remembered: pageable ranges as asked, CUDA allocations whole (their bounds are the driver's).
      bool whole = r->type == memory_type::device || r->type == memory_type::host_pinned || r->type == memory_type::managed;
      if ((r->type == memory_type::host_pageable || (whole && r->buffer_id != 0)) && r->contains(a, n)) {
        cache_lock l(impl_->mu);
        if (impl_->generation == gen && !impl_->pending.any.load(std::memory_order_acquire)) {
          if (impl_->seen.size() >= 256) impl_->seen.clear();
          if (whole) impl_->seen[r->base] = {r->base + r->size, *r};
          else impl_->remember_pageable(a, n, *r);
        }
      }
      return *r;
    }
  return memory_region{memory_type::unknown, device_kind::none, -1, a, n, 0, nullptr};
}

bool registration_cache::cached(const void* p, std::uint64_t n) {
  apply_pending();
  auto a = reinterpret_cast<std::uintptr_t>(p);
  cache_lock l(impl_->mu);
  std::uintptr_t cur = a;
  auto it = impl_->index.upper_bound(a);
  if (it != impl_->index.begin()) --it;
  for (; it != impl_->index.end() && cur < a + n; ++it) {
    if (it->first > cur) return false;
    if (it->first + it->second->size > cur) cur = it->first + it->second->size;
  }
  return cur >= a + n;
}

registration registration_cache::acquire(const void* p, std::uint64_t n) {
  check_range(p, n, "mem.register");
  apply_pending();
  auto a = reinterpret_cast<std::uintptr_t>(p);
  registration h;
  std::vector<std::function<void()>> stale_cbs;
  {
    cache_lock l(impl_->mu);
    auto& I = *impl_;
    // 1. Walk what is cached over [a, a+n), dropping entries whose memory changed under us.
    std::vector<std::shared_ptr<registration::entry>> cover;
    std::vector<std::pair<std::uintptr_t, std::uintptr_t>> gaps;
    std::uintptr_t cur = a;
    auto it = I.index.upper_bound(a);
    if (it != I.index.begin()) --it;
    while (it != I.index.end() && it->first < a + n) {
      auto e = it->second;
      ++it;
      if (e->base + e->size <= cur) continue;
      if (e->region.client && !e->region.client->still_valid(e->region)) {
        // Freed and re-allocated at the same address (CUDA buffer id changed): never serve it.
        I.st.stale_detected++;
        auto cbs = I.invalidate_locked(e->base, e->size);
        stale_cbs.insert(stale_cbs.end(), cbs.begin(), cbs.end());
        it = I.index.upper_bound(cur);  // index changed
        if (it != I.index.begin()) --it;
        continue;
      }
      if (e->base > cur) gaps.emplace_back(cur, e->base);
      cover.push_back(e);
      cur = std::max(cur, e->base + e->size);
    }
    if (cur < a + n) gaps.emplace_back(cur, a + n);
    if (gaps.empty()) I.st.hits++;
    else I.st.misses++;

    // 2. Register the gaps through the client that owns the memory.
    for (auto [g0, g1] : gaps) {
      memory_region r;
      bool found = false;
      for (auto* c : I.clients)
        if (auto rr = c->acquire(reinterpret_cast<const void*>(g0), g1 - g0)) {
          r = *rr;
          found = true;
          break;
        }
      if (!found || r.type == memory_type::unknown)
        fail(errc::bad_address, "mem.register", describe_range(p, n),
             fmt::format("{:#x} is not memory that any of ferry's memory clients knows (unmapped or freed?)", g0));
      // Expand to whole pages (host) or to the allocation (free pins), without overlapping neighbours.
      std::uintptr_t lo = g0, hi = g1;
      if (r.client->pin_is_free() && r.size) {
        lo = std::max<std::uintptr_t>(r.base, 0);
        hi = r.base + r.size;
      } else {
        lo = g0 & ~(page_size() - 1);
        hi = (g1 + page_size() - 1) & ~(page_size() - 1);
      }
      auto next = I.index.lower_bound(g0);
      if (next != I.index.end()) hi = std::min<std::uintptr_t>(hi, next->first);
      if (next != I.index.begin()) {
        auto prev = std::prev(next);
        lo = std::max<std::uintptr_t>(lo, prev->first + prev->second->size);
      }
      lo = std::min(lo, g0);
      hi = std::max(hi, g1);
      auto e = std::make_shared<registration::entry>();
      e->base = lo;
      e->size = hi - lo;
      e->region = r;
      e->cookie = r.client->pin(r, lo, hi - lo);
      if (!r.client->pin_is_free()) I.bytes_pinned += e->size;
      I.index[lo] = e;
      cover.push_back(e);
    }
    // 3. Hold them.
    for (auto& e : cover) {
      if (e->in_lru) {
        I.lru.erase(e->lru);
        e->in_lru = false;
      }
      e->refs++;
    }
    std::sort(cover.begin(), cover.end(), [](auto& x, auto& y) { return x->base < y->base; });
    h.cache_ = this;
    h.region_ = cover.front()->region;
    h.region_.base = a;
    h.region_.size = n;
    h.entries_ = std::move(cover);
    I.evict_locked(pin_limit_);
  }
  for (auto& cb : stale_cbs) cb();
  return h;
}

void registration_cache::release(registration& r) noexcept {
  cache_lock l(impl_->mu);
  for (auto& e : r.entries_) {
    if (--e->refs > 0) continue;
    if (!e->valid || !e->in_index) {
      impl_->unpin_locked(*e);
      continue;
    }
    if (e->region.client && !e->region.client->keep_cached()) {  // pinned only while held
      impl_->drop_locked(e);
      continue;
    }
    impl_->lru.push_front(e);
    e->lru = impl_->lru.begin();
    e->in_lru = true;
  }
  r.entries_.clear();
  r.cache_ = nullptr;
  impl_->evict_locked(pin_limit_);
}

void registration_cache::invalidate_soon(std::uintptr_t base, std::uint64_t size) noexcept {
  // Only recorded: a memory hook runs inside the allocator (see pending_ranges), or on a thread that
  // another cache user waits for (a unified-memory remap while an acquire holds the lock and waits
  // for that page). The cache's own thread applies it, or its next classify, cached or acquire.
  impl_->defer(base, size);
}

void registration_cache::invalidate(std::uintptr_t base, std::uint64_t size) {
  if (t_inside_cache) {  // re-entered from inside the cache: no lock, no allocation
    impl_->defer(base, size);
    return;
  }
  std::vector<std::function<void()>> cbs;
  {
    cache_lock l(impl_->mu);
    cbs = impl_->invalidate_locked(base, size);
  }
  for (auto& cb : cbs) cb();
}

void registration_cache::trim() {
  cache_lock l(impl_->mu);
  impl_->evict_locked(0);
}

std::vector<std::function<void()>> registration_cache::withdraw(peer_memory_client* c) {
  std::vector<std::function<void()>> cbs;
  inside_guard g;
  std::unique_lock l(impl_->mu);
  std::erase(impl_->clients, c);
  impl_->generation++;
  impl_->withdrawing++;
  impl_->asked.wait(l, [&] { return impl_->asking.load() == 0; });  // no classify still holds it
  impl_->withdrawing--;
  // Entries it made: dropped, so nothing calls the client afterwards; their holders' callbacks
  // are the caller's to run, after every lock is let go.
  std::vector<std::pair<std::uintptr_t, std::uint64_t>> ranges;
  for (auto& [b, e] : impl_->index)
    if (e->region.client == c) ranges.emplace_back(e->base, e->size);
  for (auto [b, n] : ranges) {
    auto more = impl_->invalidate_locked(b, n);
    cbs.insert(cbs.end(), std::make_move_iterator(more.begin()), std::make_move_iterator(more.end()));
  }
  return cbs;
}

void registration_cache::remove_client(peer_memory_client* c) {
  for (auto& cb : withdraw(c)) cb();
}

namespace {
// The live caches, copied without allocating (g_caches_mu is the hooks' lock). Call with
// g_process_mu held: none of them can be destroyed meanwhile.
std::size_t live_caches(std::array<registration_cache*, max_caches>& out) {
  std::shared_lock l(g_caches_mu);
  std::size_t k = 0;
  for (registration_cache* c : g_caches)
    if (c) out[k++] = c;
  return k;
}
}  // namespace

void add_process_client(peer_memory_client* c) {
  expects(c != nullptr, "mem.cache", "process client", "a null client");
  std::lock_guard pl(g_process_mu);
  g_process_clients.insert(g_process_clients.begin(), c);
  std::array<registration_cache*, max_caches> caches;
  const std::size_t k = live_caches(caches);
  for (std::size_t i = 0; i < k; ++i) caches[i]->add_client(c, true);
}

void remove_process_client(peer_memory_client* c) noexcept {
  // Callbacks run once g_process_mu is let go: one may end a cache's owner (a cache's destructor
  // takes g_process_mu).
  std::vector<std::function<void()>> cbs;
  {
    std::lock_guard pl(g_process_mu);
    std::erase(g_process_clients, c);
    std::array<registration_cache*, max_caches> caches;
    const std::size_t k = live_caches(caches);
    for (std::size_t i = 0; i < k; ++i) {
      try {
        auto more = caches[i]->withdraw(c);
        cbs.insert(cbs.end(), std::make_move_iterator(more.begin()), std::make_move_iterator(more.end()));
      } catch (const std::exception& e) {
        log::error("mem", "withdrawing the {} memory client from a registration cache: {}", c->name(), e.what());
      }
    }
  }
  for (auto& cb : cbs) {
    try {
      cb();
    } catch (const std::exception& e) {
      log::error("mem", "a registration's invalidation callback: {}", e.what());
    }
  }
}

registration_stats registration_cache::stats() const {
  cache_lock l(impl_->mu);
  registration_stats s = impl_->st;
  s.bytes_pinned = impl_->bytes_pinned;
  s.entries = impl_->index.size();
  return s;
}

}  // namespace ferry
