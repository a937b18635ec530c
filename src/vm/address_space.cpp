// A unified address space on ferry's device interface: page_mover hooks (chunks, mirrors, remaps)
// and the CPU fault path (SIGSEGV handler -> service thread). See include/ferry/vm/address_space.hpp.
#include <ferry/core/error.hpp>
#include <ferry/vm/address_space.hpp>

#include "core/logging.hpp"

#include <fmt/format.h>
#include <linux/futex.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

namespace ferry::vm {

namespace {

constexpr location dev_loc = 1;  // the page table's slot for the (one) attached device

// A fault handed from the signal handler to the service thread; lives on the faulting thread's stack.
struct fault_record {
  std::uintptr_t addr;
  bool write;
  std::atomic<int> state;  // 0 waiting, 1 resolved, -1 failed
};

// Live spaces, for the handler: fixed slots, no allocation, no locks.
constexpr int max_spaces = 32;
struct space_slot {
  std::atomic<std::uintptr_t> base{0}, size{0};
  std::atomic<int> fd{-1};  // the space's fault pipe (write end)
  std::atomic<long> service_tid{0};
};
space_slot g_spaces[max_spaces];
struct sigaction g_old_segv{};
std::once_flag g_handler_once;

long futex(std::atomic<int>* a, int op, int val, const timespec* ts) {
  return ::syscall(SYS_futex, reinterpret_cast<int*>(a), op, val, ts, nullptr, 0);
}

void write_str(const char* s) {
  [[maybe_unused]] auto r = ::write(2, s, std::strlen(s));
}

// Async-signal-safe: table lookup, write(2) to a pipe, futex wait.
void on_segv(int sig, siginfo_t* si, void* uc) {
  auto a = reinterpret_cast<std::uintptr_t>(si->si_addr);
  for (auto& s : g_spaces) {
    std::uintptr_t b = s.base.load(std::memory_order_acquire), n = s.size.load(std::memory_order_acquire);
    int fd = s.fd.load(std::memory_order_acquire);
    if (fd < 0 || a < b || a - b >= n) continue;
    if (::syscall(SYS_gettid) == s.service_tid.load()) {  // it would wait for itself
      write_str("ferry: the unified-memory service thread touched a non-resident page (a bug); aborting\n");
      ::abort();
    }
    bool write = true;
#if defined(__x86_64__)
    write = (static_cast<ucontext_t*>(uc)->uc_mcontext.gregs[REG_ERR] & 2) != 0;
#endif
    fault_record r{a, write, {0}};
    fault_record* rp = &r;
    if (::write(fd, &rp, sizeof rp) != static_cast<ssize_t>(sizeof rp)) {
      write_str("ferry: unified-memory fault could not reach its service thread\n");
      ::abort();
    }
    while (r.state.load(std::memory_order_acquire) == 0) futex(&r.state, FUTEX_WAIT_PRIVATE, 0, nullptr);
    if (r.state.load() < 0) {
      write_str("ferry: unified-memory fault could not be resolved (see the log); aborting\n");
      ::abort();
    }
    return;  // the access is retried
  }
  // Not ours: whoever was there before.
  if (g_old_segv.sa_flags & SA_SIGINFO) {
    if (g_old_segv.sa_sigaction) return g_old_segv.sa_sigaction(sig, si, uc);
  } else if (g_old_segv.sa_handler != SIG_DFL && g_old_segv.sa_handler != SIG_IGN) {
    return g_old_segv.sa_handler(sig);
  }
  ::signal(SIGSEGV, SIG_DFL);  // re-faults and dumps as usual
}

void install_handler() {
  std::call_once(g_handler_once, [] {
    struct sigaction sa{};
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    if (::sigaction(SIGSEGV, &sa, &g_old_segv) != 0) fail_errno(errno, "vm.init", "SIGSEGV", "cannot install the fault handler");
  });
}

}  // namespace

// The space as a peer-memory client of a registration cache (see address_space.hpp).
class unified_client final : public peer_memory_client {
 public:
  unified_client(address_space::impl& s) : s_(s) {}
  std::string_view name() const noexcept override { return "unified"; }
  std::optional<memory_region> acquire(const void* p, std::uint64_t n) override;
  std::uint64_t pin(const memory_region& r, std::uintptr_t base, std::uint64_t size) override;
  void unpin(std::uint64_t cookie, std::uintptr_t base, std::uint64_t size) noexcept override;
  bool still_valid(const memory_region&) override { return true; }
  bool keep_cached() const noexcept override { return false; }
  bool host_mappings() const noexcept override { return false; }

 private:
  address_space::impl& s_;
};

struct address_space::impl final : page_mover {
  device& dev;
  space_options o;
  std::uint64_t page = 0, npages = 0;
  va_range shared, host_mirror, dev_mirror;  // mirrors: every chunk, for copies
  std::vector<physical_chunk> hostc, devc;   // per page; guarded by the page's lock in page_table
  std::vector<char> shared_mapped;           // per page: a chunk is mapped in the shared range (page lock)
  physical_chunk zero;                       // a zeroed host chunk at the end of the host mirror
  std::unique_ptr<stream> st;
  std::mutex st_mu;
  std::unique_ptr<page_table> table;
  std::mutex streams_mu;
  std::vector<stream*> streams;  // attached: migrations wait for their work
  std::mutex alloc_mu;
  std::map<std::uint64_t, std::uint64_t> used_ranges;  // first page -> pages
  int pipe_rd = -1, pipe_wr = -1, slot = -1;
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> cpu_faults{0};
  std::thread service;
  std::unique_ptr<unified_client> client;

  impl(device& d, std::uint64_t bytes, space_options opt) : dev(d), o(opt) {
    page = dev.granularity();
    npages = (bytes + page - 1) / page;
    expects(npages > 0, "vm.space", dev.id(), "an address space needs at least one page");
    shared = dev.reserve(npages * page);
    host_mirror = dev.reserve((npages + 1) * page);
    dev_mirror = dev.reserve(npages * page);
    hostc.resize(npages);
    devc.resize(npages);
    shared_mapped.assign(npages, 0);
    st = dev.create_stream();
    zero = dev.allocate(page, ferry::location::on_host());
    map_mirror(host_mirror.at(npages * page), zero, true);
    std::memset(host_mirror.at(npages * page), 0, page);
    std::uint64_t cap = o.device_capacity ? o.device_capacity / page : dev.info().total_memory / page;
    expects(cap > 0, "vm.space", dev.id(), "device capacity below one page");
    table = std::make_unique<page_table>(npages, page, std::vector<std::uint64_t>{0, cap}, o.policy, *this);
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) fail_errno(errno, "vm.space", "fault pipe");
    pipe_rd = fds[0];
    pipe_wr = fds[1];
    install_handler();
    for (int i = 0; i < max_spaces && slot < 0; ++i) {
      int none = -1;
      if (g_spaces[i].fd.load() == -1 && g_spaces[i].fd.compare_exchange_strong(none, -2)) slot = i;
    }
    if (slot < 0) fail(errc::busy, "vm.space", dev.id(), fmt::format("more than {} address spaces at once", max_spaces));
    service = std::thread([this] { serve(); });
    g_spaces[slot].base.store(shared.address(), std::memory_order_release);
    g_spaces[slot].size.store(shared.size(), std::memory_order_release);
    g_spaces[slot].fd.store(pipe_wr, std::memory_order_release);
    if (o.cache) {
      client = std::make_unique<unified_client>(*this);
      o.cache->add_client(client.get(), true);
    }
  }
  ~impl() override {
    if (client) o.cache->remove_client(client.get());  // holders are told; nothing calls it afterwards
    g_spaces[slot].fd.store(-2);
    g_spaces[slot].base.store(0);
    g_spaces[slot].size.store(0);
    g_spaces[slot].service_tid.store(0);
    g_spaces[slot].fd.store(-1);
    stop = true;
    service.join();
    ::close(pipe_rd);
    ::close(pipe_wr);
    shared.reset();
    host_mirror.reset();
    dev_mirror.reset();
  }

  void map_mirror(void* va, const physical_chunk& c, bool host_chunk) {
    dev.map(va, c);
    std::vector<access_desc> g{{ferry::location::on_device(), access::read_write}};
    if (host_chunk) g.push_back({ferry::location::on_host(), access::read_write});
    dev.set_access(va, c.size(), g);
  }
  std::byte* mirror(location at, std::uint64_t p) { return at == host ? host_mirror.at(p * page) : dev_mirror.at(p * page); }
  physical_chunk& chunk(location at, std::uint64_t p) { return at == host ? hostc[p] : devc[p]; }
  void ensure_chunk(location at, std::uint64_t p) {
    auto& c = chunk(at, p);
    if (c) return;
    c = dev.allocate(page, at == host ? ferry::location::on_host() : ferry::location::on_device());
    try {
      map_mirror(mirror(at, p), c, at == host);
    } catch (...) {
      c.reset();
      throw;
    }
  }
  void copy_sync(std::byte* dst, const std::byte* src) {
    std::lock_guard l(st_mu);
    st->copy(dst, src, page);
    st->synchronize(deadline_after(o.deadline));
  }

  // Waits for the work queued on attached streams: a kernel must not run on a page while its data
  // is copied away or its mapping changes (conservative: all of the stream's work, not per page).
  void quiesce() {
    std::lock_guard l(streams_mu);
    for (auto* s : streams) s->synchronize(deadline_after(o.deadline));
  }

  // ---- page_mover ----
  void copy(std::uint64_t p, location from, location to) override {
    quiesce();
    ensure_chunk(to, p);
    copy_sync(mirror(to, p), mirror(from, p));
  }
  void populate(std::uint64_t p, location at) override {
    ensure_chunk(at, p);
    copy_sync(mirror(at, p), host_mirror.at(npages * page));
  }
  void drop(std::uint64_t p, location at) noexcept override {
    auto& c = chunk(at, p);
    if (!c) return;
    try {
      dev.unmap(mirror(at, p), page);
    } catch (const std::exception& e) {
      log::error("vm", "{}: unmapping the mirror of page {} failed: {}", dev.id(), p, e.what());
    }
    c.reset();
  }
  void map(std::uint64_t p, location at, bool writable) override {
    void* va = shared.at(p * page);
    if (shared_mapped[p]) {
      quiesce();
      dev.unmap(va, page);  // the new copy exists; the old one is dropped after this
    }
    shared_mapped[p] = false;
    dev.map(va, chunk(at, p));
    shared_mapped[p] = true;
    std::vector<access_desc> g{{ferry::location::on_device(), access::read_write}};  // the GPU cannot fault: always rw
    if (at == host) g.push_back({ferry::location::on_host(), writable ? access::read_write : access::read});
    dev.set_access(va, page, g);
  }

  // ---- CPU faults ----
  void serve() {
    g_spaces[slot].service_tid.store(::syscall(SYS_gettid));
    while (!stop) {
      pollfd pf{pipe_rd, POLLIN, 0};
      int n = ::poll(&pf, 1, 50);
      if (n <= 0) continue;
      fault_record* r = nullptr;
      if (::read(pipe_rd, &r, sizeof r) != static_cast<ssize_t>(sizeof r) || !r) continue;
      int result = 1;
      std::uint64_t pg = (r->addr - shared.address()) / page;
      try {
        table->access(pg, host, r->write, deadline_after(o.deadline));
        cpu_faults++;
      } catch (const std::exception& e) {
        log::error("vm", "{}: CPU fault at {:#x} (page {}, {}) failed: {}", dev.id(), r->addr, pg, r->write ? "write" : "read", e.what());
        result = -1;
      }
      r->state.store(result, std::memory_order_release);
      futex(&r->state, FUTEX_WAKE_PRIVATE, 1, nullptr);
    }
  }

  std::pair<std::uint64_t, std::uint64_t> pages_of(const void* p, std::uint64_t bytes, const char* op) {
    auto a = reinterpret_cast<std::uintptr_t>(p);
    if (a < shared.address() || bytes > shared.size() || a - shared.address() > shared.size() - bytes)
      fail(errc::out_of_range, op, fmt::format("{}+{}", p, bytes), "not inside this address space");
    std::uint64_t first = (a - shared.address()) / page;
    std::uint64_t last = (a - shared.address() + std::max<std::uint64_t>(bytes, 1) - 1) / page;
    return {first, last + 1};
  }
};

std::optional<memory_region> unified_client::acquire(const void* p, std::uint64_t n) {
  auto a = reinterpret_cast<std::uintptr_t>(p);
  std::uintptr_t b = s_.shared.address();
  std::uint64_t sz = s_.shared.size();
  if (a < b || n > sz || a - b > sz - n) return std::nullopt;
  memory_region r;
  r.type = memory_type::unified;
  r.owner = s_.dev.id();
  r.ordinal = s_.dev.info().ordinal;
  r.base = b;
  r.size = sz;
  r.client = this;
  return r;
}

std::uint64_t unified_client::pin(const memory_region&, std::uintptr_t base, std::uint64_t size) {
  auto [first, end] = s_.pages_of(reinterpret_cast<void*>(base), size, "vm.pin");
  log::debug("vm", "{}: pinning pages {}..{} for a transfer", s_.dev.id(), first, end - 1);
  std::uint64_t done = first;
  try {
    for (; done < end; ++done) s_.table->pin_in_place(done, deadline_after(s_.o.deadline));
  } catch (...) {
    for (std::uint64_t p = first; p < done; ++p) s_.table->unpin(p);
    throw;
  }
  return 0;
}

void unified_client::unpin(std::uint64_t, std::uintptr_t base, std::uint64_t size) noexcept {
  try {
    auto [first, end] = s_.pages_of(reinterpret_cast<void*>(base), size, "vm.unpin");
    log::debug("vm", "{}: unpinning pages {}..{}", s_.dev.id(), first, end - 1);
    for (std::uint64_t p = first; p < end; ++p) s_.table->unpin(p);
  } catch (const std::exception& e) {
    log::error("vm", "{}: unpin of {:#x}+{} failed: {}", s_.dev.id(), base, size, e.what());
  }
}

address_space::address_space(device& dev, std::uint64_t bytes, space_options o) : impl_(std::make_unique<impl>(dev, bytes, o)) {}
address_space::~address_space() = default;

void* address_space::alloc(std::uint64_t bytes) {
  auto& I = *impl_;
  std::uint64_t need = std::max<std::uint64_t>(1, (bytes + I.page - 1) / I.page);
  std::lock_guard l(I.alloc_mu);
  std::uint64_t at = 0;
  for (auto& [first, n] : I.used_ranges) {
    if (first - at >= need) break;
    at = first + n;
  }
  if (at + need > I.npages)
    fail(errc::out_of_memory, "vm.alloc", fmt::format("{} bytes", bytes), fmt::format("the address space has no {} free pages in a row", need));
  I.used_ranges[at] = need;
  return I.shared.at(at * I.page);
}

void address_space::free(void* p) {
  auto& I = *impl_;
  auto [first, end] = I.pages_of(p, 1, "vm.free");
  std::uint64_t n;
  {
    std::lock_guard l(I.alloc_mu);
    auto it = I.used_ranges.find(first);
    if (it == I.used_ranges.end() || I.shared.at(first * I.page) != p)
      fail(errc::invalid_argument, "vm.free", fmt::format("{}", p), "not an allocation of this address space");
    n = it->second;
    I.used_ranges.erase(it);
  }
  // Give the device memory back: drop device copies (kept on host until the page is reused).
  for (std::uint64_t pg = first; pg < first + n; ++pg) I.table->dontneed(pg, dev_loc, deadline_after(I.o.deadline));
}

void address_space::advise(void* p, std::uint64_t bytes, advice a, memory_kind where) {
  auto& I = *impl_;
  auto [first, end] = I.pages_of(p, bytes, "vm.advise");
  location at = where == memory_kind::host ? host : dev_loc;
  for (std::uint64_t pg = first; pg < end; ++pg) {
    auto until = deadline_after(I.o.deadline);
    switch (a) {
      case advice::prefetch: I.table->prefetch(pg, at, until); break;
      case advice::dontneed: I.table->dontneed(pg, dev_loc, until); break;
      case advice::read_mostly: I.table->set_read_mostly(pg, true); break;
      case advice::no_read_mostly: I.table->set_read_mostly(pg, false); break;
      case advice::preferred_location: I.table->set_preferred(pg, at); break;
    }
  }
}

void* address_space::base() const noexcept { return impl_->shared.base(); }
std::uint64_t address_space::size() const noexcept { return impl_->shared.size(); }
std::uint64_t address_space::page_bytes() const noexcept { return impl_->page; }
void address_space::attach_stream(stream& s) {
  if (&s.owner() != &impl_->dev) fail(errc::invalid_argument, "vm.stream", s.owner().id(), "a stream of another device than the space's " + impl_->dev.id());
  std::lock_guard l(impl_->streams_mu);
  if (std::find(impl_->streams.begin(), impl_->streams.end(), &s) == impl_->streams.end()) impl_->streams.push_back(&s);
}
void address_space::detach_stream(stream& s) {
  std::lock_guard l(impl_->streams_mu);
  std::erase(impl_->streams, &s);
}
page_table& address_space::pages() noexcept { return *impl_->table; }
vm_stats address_space::stats() const { return impl_->table->stats(); }
std::uint64_t address_space::cpu_faults() const noexcept { return impl_->cpu_faults.load(); }

}  // namespace ferry::vm
