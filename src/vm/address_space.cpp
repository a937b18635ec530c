// A unified address space on ferry's device interface: page_mover hooks (chunks, mirrors, remaps)
// and the CPU fault path (SIGSEGV handler -> service thread). See include/ferry/vm/address_space.hpp.
#include <ferry/core/error.hpp>
#include <ferry/core/units.hpp>
#include <ferry/vm/address_space.hpp>

#include "core/fault_note.hpp"
#include "core/logging.hpp"
#include "device/poll.hpp"

#include <fmt/format.h>
#include <linux/futex.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <execinfo.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <pthread.h>
#include <sys/mman.h>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <utility>

namespace ferry::vm {

namespace {

// The page table's location of the space's device k (0-based) is k + 1; 0 is host memory.
constexpr location loc_of(std::size_t k) { return static_cast<location>(k + 1); }

// A fault handed from the signal handler to the service thread; lives on the faulting thread's stack.
struct fault_record {
  std::uintptr_t addr;
  bool write;
  std::atomic<int> state;  // 0 waiting, 1 resolved, -1 failed
};

// What goes down the pipe, by value: the service thread checks who sent it and where before it
// touches the record (a process forked from the owner inherits the pipe).
struct fault_message {
  std::uint64_t magic;
  long pid;
  std::uintptr_t addr;
  fault_record* record;
};
constexpr std::uint64_t fault_magic = 0x66657272792d7666ull;  // "ferry-vf"
static_assert(sizeof(fault_message) <= PIPE_BUF, "one atomic write");

// Live spaces, for the handler: fixed slots, no allocation, no locks.
constexpr int max_spaces = 32;
struct space_slot {
  std::atomic<std::uintptr_t> base{0}, size{0};
  std::atomic<int> fd{-1};  // the space's fault pipe (write end)
  std::atomic<long> service_tid{0};
  std::atomic<long> pid{0};             // the process that made the space (its service thread's)
  std::atomic<long long> wait_ns{0};    // how long a fault may wait for its service thread
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

// "0x" and the hex digits of v into buf (async-signal-safe).
const char* hex(std::uintptr_t v, char (&buf)[20]) {
  char* p = buf + sizeof buf - 1;
  *p = 0;
  do *--p = "0123456789abcdef"[v & 15];
  while (v >>= 4);
  *--p = 'x';
  *--p = '0';
  return p;
}

// Where the faulting access came from, on the way to abort(): which code touched a page it could
// not get (the process's, a library's, or ferry's own). Not async-signal-safe, unlike the rest of
// the handler: backtrace() is primed in install_handler so that here it loads nothing, but
// backtrace_symbols_fd() takes the dynamic loader's lock, which another thread may hold (a dlopen);
// the alarm ends the process then, as the abort would have.
void print_faulting_stack() {
  ::alarm(5);
  void* frames[48];
  int n = ::backtrace(frames, 48);
  char name[17] = {0};
  ::prctl(PR_GET_NAME, name);
  write_str("ferry: the faulting thread (");
  write_str(name);
  write_str(")'s stack:\n");
  ::backtrace_symbols_fd(frames, n, 2);
  if (const auto& c = fault_note::current; c.what) {  // the library call it was in, as ferry made it
    char h[20];
    write_str("ferry: the faulting thread was in ");
    write_str(c.what);
    write_str(": dst ");
    write_str(hex(c.dst, h));
    write_str(", src ");
    write_str(hex(c.src, h));
    write_str(", bytes ");
    write_str(hex(c.bytes, h));
    write_str("\n");
  }
}

// Async-signal-safe: table lookup, write(2) to a pipe, futex wait (and, on the way to abort(), the
// stack print above).
void on_segv(int sig, siginfo_t* si, void* uc) {
  auto a = reinterpret_cast<std::uintptr_t>(si->si_addr);
  for (auto& s : g_spaces) {
    std::uintptr_t b = s.base.load(std::memory_order_acquire), n = s.size.load(std::memory_order_acquire);
    int fd = s.fd.load(std::memory_order_acquire);
    if (fd < 0 || a < b || a - b >= n) continue;
    char h[20];
    long me = ::syscall(SYS_getpid);
    if (me != s.pid.load()) {
      // A process forked from the space's owner: the pages and their service thread stay with the
      // parent. The access ends here, the way a stray access does (SIGSEGV), and says why.
      write_str("ferry: unified memory at ");
      write_str(hex(a, h));
      write_str(" belongs to the process that made it, not to this one forked from it; SIGSEGV\n");
      ::signal(SIGSEGV, SIG_DFL);
      return;  // re-faults with the default action
    }
    if (::syscall(SYS_gettid) == s.service_tid.load()) {  // it would wait for itself
      write_str("ferry: the unified-memory service thread touched a non-resident page (a bug); aborting\n");
      ::abort();
    }
    bool write = true;
#if defined(__x86_64__)
    write = (static_cast<ucontext_t*>(uc)->uc_mcontext.gregs[REG_ERR] & 2) != 0;
#endif
    fault_record r{a, write, {0}};
    fault_message m{fault_magic, me, a, &r};
    if (::write(fd, &m, sizeof m) != static_cast<ssize_t>(sizeof m)) {
      write_str("ferry: unified-memory fault could not reach its service thread\n");
      ::abort();
    }
    // Waits in slices up to the space's deadline: a service thread that cannot serve the fault
    // ends the process with a message instead of leaving this thread waiting forever.
    long long left = s.wait_ns.load();
    while (r.state.load(std::memory_order_acquire) == 0) {
      if (left <= 0) {
        write_str("ferry: a unified-memory fault at ");
        write_str(hex(a, h));
        write_str(" was not served within the space's deadline (its service thread is stuck); aborting\n");
        print_faulting_stack();
        ::abort();
      }
      timespec ts{0, 100'000'000};
      futex(&r.state, FUTEX_WAIT_PRIVATE, 0, &ts);
      left -= 100'000'000;
    }
    if (r.state.load() < 0) {
      write_str("ferry: unified-memory fault could not be resolved (see the log); aborting\n");
      print_faulting_stack();
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

// In a child of fork(): every live space's pages become inaccessible, so that the child's first
// access faults (and ends, see on_segv) instead of reading or writing the parent's shared pages.
void after_fork_in_child() {
  for (auto& s : g_spaces) {
    std::uintptr_t b = s.base.load(), n = s.size.load();
    if (n && s.fd.load() >= 0) ::mprotect(reinterpret_cast<void*>(b), n, PROT_NONE);
  }
}

void install_handler() {
  std::call_once(g_handler_once, [] {
    void* prime[1];
    ::backtrace(prime, 1);  // loads the unwinder now, not inside the signal handler
    ::pthread_atfork(nullptr, nullptr, after_fork_in_child);
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
  std::uint64_t one_place(std::uintptr_t p, std::uint64_t n) override;
  bool still_valid(const memory_region&) override { return true; }
  bool keep_cached() const noexcept override { return false; }
  bool host_mappings() const noexcept override { return false; }

 private:
  address_space::impl& s_;
};

struct address_space::impl final : page_mover, launch_observer {
  // The space's devices; the first ("home") reserves the ranges and makes every chunk, the others'
  // memory included (device::allocate on a peer), so one range holds them all.
  std::vector<device*> devs;
  device& dev;
  space_options o;
  std::uint64_t page = 0, npages = 0;
  std::vector<std::uint64_t> cap;           // per page-table location: pages it may hold (0, the host: unused)
  // The pages' addresses: `shared`, inside a reservation with `pad` bytes more at each end (the device
  // granularity, what CUDA's own allocations are rounded to). Those two pads are always mapped (to
  // host chunks of their own, every device and the CPU may read and write them), so that a small out-of-bounds access before the first allocation or after the last one
  // touches memory, as it does next to a cudaMalloc or managed allocation, instead of killing the
  // process; what is written there is never read back as anyone's data.
  struct view {
    std::uintptr_t base_ = 0;
    std::uint64_t size_ = 0;
    void* base() const noexcept { return reinterpret_cast<void*>(base_); }
    std::uintptr_t address() const noexcept { return base_; }
    std::uint64_t size() const noexcept { return size_; }
    template <typename T = std::byte>
    T* at(std::uint64_t offset) const noexcept { return reinterpret_cast<T*>(base_ + offset); }
  };
  va_range padded;
  std::uint64_t pad = 0;
  view shared;
  va_range host_mirror;                     // host mirror: per page
  // Per device k: its pool of slots (device chunks, mapped in pool[k] at their index) and which slot
  // each page uses there (-1: none; the page's lock). A page may have copies on several devices
  // (READ_MOSTLY).
  struct devmem {
    va_range pool;
    std::vector<std::int64_t> slot_of;
    std::vector<physical_chunk> slots;      // slot_mu
    std::vector<std::uint32_t> idle, holes; // slot_mu: made and unused / never made or trimmed
    std::uint32_t made = 0;                 // slot_mu: slots below this index exist or are holes
    std::unique_ptr<stream> st;             // this device's copy engines: copies to (or from) it
    std::mutex st_mu;
  };
  std::vector<std::unique_ptr<devmem>> dm;
  std::vector<physical_chunk> hostc;        // per page, kept once made; guarded by the page's lock
  std::vector<char> shared_mapped;          // per page: a chunk is mapped in the shared range (page lock)
  std::vector<location> shared_at;          // per page: which (page lock)
  std::vector<char> host_w;                 // per page: its host mapping may be written (page lock)
  // Per page: what the CPU may do through the shared range (0, 1 read, 3 read+write). Host chunks are
  // mapped for the device alone at first: granting the CPU is expensive (it fills the CPU's page
  // tables for the whole chunk), so it is paid only when the CPU touches the page (a fault) or a
  // transfer pins it.
  std::unique_ptr<std::atomic<std::uint8_t>[]> cpu;
  // A page on the host stays where it is through a launch when it is not returned (held, no room,
  // earlier work still running, or no return at launch), and the kernel reaches it in place over the
  // bus. A CPU write then must not run beside the launched work: a GPU atomic there is not atomic
  // with the CPU's, and a CPU store could land in the middle of what a kernel reads. So a launch
  // takes the CPU's write access to such pages (read stays), and the CPU's next write faults and
  // waits for the work launched since (wait_for_launched_work), as a CPU fault on a device page waits.
  // `cpu_writable`: pages the CPU was let write since the last launch (writable_mu); `write_taken`:
  // per page, its write access was taken by a launch (page lock).
  std::mutex writable_mu;
  std::vector<std::uint64_t> cpu_writable;
  std::vector<char> write_taken;
  std::mutex slot_mu;
  physical_chunk zero;                      // a zeroed host chunk at the end of the host mirror
  physical_chunk pad_before, pad_after;     // mapped on each side of `shared`
  std::unique_ptr<page_table> table;
  std::mutex streams_mu;
  std::vector<stream*> streams;  // attached: migrations wait for their work
  std::mutex alloc_mu;
  std::map<std::uint64_t, std::uint64_t> used_ranges;  // first page -> pages
  int pipe_rd = -1, pipe_wr = -1, slot = -1;
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> cpu_faults{0};
  // Return of taken pages: launches hold `gate` shared from before to after their call; a background
  // return holds it exclusive, so no kernel is launched while it switches mappings.
  std::atomic<bool> watching{false};  // read by the service thread, which starts before it is settled
  std::shared_timed_mutex gate;
  // Fault-ahead stops at a launch: the CPU is done for now, and pages moved ahead after it would
  // leave the device just when a kernel wants them. A launch waits for the batch under way (ahead_mu).
  std::atomic<std::uint64_t> launches{0};
  std::timed_mutex ahead_mu;
  // The pages after the last CPU fault, up to its fault-ahead window's end: the CPU is on its way to
  // them, so the background return leaves them for up to return_hold after that fault (returned
  // before the CPU got there, each would fault back and look like a page the CPU keeps using).
  // Service thread only.
  std::pair<std::uint64_t, std::uint64_t> cpu_heading{0, 0};
  std::chrono::steady_clock::time_point cpu_heading_since{};
  // Launches return pages one at a time: a launch that met a page another launch is moving would
  // skip it and go ahead while that page's mapping is being switched.
  std::timed_mutex return_mu;
  // A launch's wait for earlier work ran out: later launches only look, until that work is seen done.
  std::atomic<bool> launches_only_look{false};
  std::thread service;
  std::unique_ptr<unified_client> client;
  struct {
    std::atomic<std::uint64_t> quiesce{0}, allocate{0}, unmap{0}, map{0}, access{0}, copy_wait{0}, cpu_fault{0}, write_wait{0};
  } t;
  std::atomic<std::uint64_t> write_waits{0};  // CPU writes that waited for launched work (wait_for_launched_work)
  const std::chrono::steady_clock::time_point made = std::chrono::steady_clock::now();
  // Batches between start() and finish().
  struct flight {
    std::vector<step> steps;
    std::vector<char> mapped_new;  // per step: the shared range points at `to`
    std::vector<char> copied;      // per step: `to` memory was taken and a copy queued
    std::vector<std::unique_ptr<event>> done;  // one per stream the copies went to
  };
  std::mutex flights_mu;
  std::map<std::uint64_t, flight> flights;
  std::uint64_t next_ticket = 0;

  static std::vector<device*> checked(std::vector<device*> ds) {
    expects(!ds.empty() && ds[0], "vm.space", "devices", "an address space needs a device");
    expects(ds.size() < static_cast<std::size_t>(max_locations), "vm.space", ds[0]->id(),
            fmt::format("at most {} devices per address space", max_locations - 1));
    for (std::size_t i = 0; i < ds.size(); ++i) {
      expects(ds[i] != nullptr, "vm.space", ds[0]->id(), "a null device");
      if (ds[i]->info().backend != ds[0]->info().backend)
        fail(errc::invalid_argument, "vm.space", ds[i]->id(), "the devices of a space must share a backend with " + ds[0]->id());
      for (std::size_t j = 0; j < i; ++j)
        if (ds[j] == ds[i]) fail(errc::invalid_argument, "vm.space", ds[i]->id(), "the device is given twice");
    }
    return ds;
  }

  impl(std::vector<device*> ds, std::uint64_t bytes, space_options opt) : devs(checked(std::move(ds))), dev(*devs[0]), o(opt) {
    std::uint64_t gran = dev.granularity();
    for (auto* d : devs)
      if (d->granularity() != gran)
        fail(errc::invalid_argument, "vm.space", d->id(), fmt::format("granularity {} differs from {}'s {}", d->granularity(), dev.id(), gran));
    // Every device reaches every other's memory (a kernel on one reads pages living on another; a
    // device's engine copies between them): refused here, clearly, when the hardware cannot.
    for (auto* a : devs)
      for (auto* b : devs)
        if (a != b) a->enable_peer_access(*b);
    page = std::max(gran, (o.page_bytes + gran - 1) / gran * gran);
    npages = (bytes + page - 1) / page;
    expects(npages > 0, "vm.space", dev.id(), "an address space needs at least one page");
    expects(o.batch > 0 && o.fault_ahead > 0, "vm.space", dev.id(), "batch and fault_ahead must be positive");
    pad = gran;
    padded = dev.reserve(npages * page + 2 * pad);
    shared = {padded.address() + pad, npages * page};
    host_mirror = dev.reserve((npages + 1) * page);
    for (std::size_t k = 0; k < devs.size(); ++k) {
      auto m = std::make_unique<devmem>();
      m->pool = dev.reserve(npages * page);
      m->slot_of.assign(npages, -1);
      m->slots.resize(npages);
      m->st = devs[k]->create_stream();
      dm.push_back(std::move(m));
    }
    hostc.resize(npages);
    shared_mapped.assign(npages, 0);
    shared_at.assign(npages, -1);
    host_w.assign(npages, 0);
    write_taken.assign(npages, 0);
    cpu.reset(new std::atomic<std::uint8_t>[npages]);
    for (std::uint64_t i = 0; i < npages; ++i) cpu[i] = 0;
    zero = dev.allocate(page, ferry::location::on_host());
    map_mirror(host_mirror.at(npages * page), zero, true);
    pad_before = dev.allocate(pad, ferry::location::on_host());
    pad_after = dev.allocate(pad, ferry::location::on_host());
    map_mirror(padded.at(0), pad_before, true);
    map_mirror(padded.at(pad + npages * page), pad_after, true);
    std::memset(host_mirror.at(npages * page), 0, page);
    cap.push_back(0);
    for (auto* d : devs) {
      std::uint64_t bytes_cap = o.device_capacity;
      if (bytes_cap == 0) {
        auto m = d->memory();
        std::uint64_t free = m.free ? m.free : d->info().total_memory;
        // A small device (the sim's, a test cap) keeps at most a quarter back.
        bytes_cap = free - std::min(o.reserve, free / 4);
      }
      expects(bytes_cap / page > 0, "vm.space", d->id(),
              fmt::format("device capacity {} bytes is below one page of {} (device free memory minus the reserve?)", bytes_cap, page));
      cap.push_back(bytes_cap / page);
    }
    table = std::make_unique<page_table>(npages, page, cap, o.policy, *this, thrash_policy{o.thrash_lapse, o.thrash_hold},
                                         o.return_hold);
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
    // Dedicated, not the executor's: it must run while any other thread, an executor worker too, is stopped at a fault.
    service = std::thread([this] { serve(); });
    g_spaces[slot].pid.store(::getpid());
    // A fault waits for the service thread's own deadline (o.deadline per batch) and then some.
    g_spaces[slot].wait_ns.store(std::chrono::duration_cast<std::chrono::nanoseconds>(o.deadline).count() * 2 + 1'000'000'000);
    g_spaces[slot].base.store(shared.address(), std::memory_order_release);
    g_spaces[slot].size.store(shared.size(), std::memory_order_release);
    g_spaces[slot].fd.store(pipe_wr, std::memory_order_release);
    client = std::make_unique<unified_client>(*this);
    add_process_client(client.get());
    if (o.return_at_launch || o.return_quiet.count() > 0) {
      std::string why;
      bool all = true;
      for (auto* d : devs) all = all && d->watch_launches(*this, why);
      watching = all;
      if (!all) {
        for (auto* d : devs) d->unwatch_launches(*this);
        log::info("vm", "{}: pages the CPU takes from the device stay on the host until a hint moves them: {}", dev.id(), why);
      }
    }
  }
  ~impl() override {
    for (auto* d : devs) d->unwatch_launches(*this);  // waits for launches under way
    remove_process_client(client.get());  // holders are told; nothing calls it afterwards
    g_spaces[slot].fd.store(-2);
    g_spaces[slot].base.store(0);
    g_spaces[slot].size.store(0);
    g_spaces[slot].service_tid.store(0);
    g_spaces[slot].fd.store(-1);
    stop = true;
    service.join();
    ::close(pipe_rd);
    ::close(pipe_wr);
    for (auto& m : dm) {
      try {
        m->st->synchronize(deadline_after(o.deadline));
      } catch (const std::exception& e) {
        log::error("vm", "{}: unified address space destroyed with failed copies: {}", m->st->owner().id(), e.what());
      }
    }
    padded.reset();
    host_mirror.reset();
    for (auto& m : dm) m->pool.reset();
  }

  using clk = std::chrono::steady_clock;
  struct timed {
    std::atomic<std::uint64_t>& into;
    clk::time_point t0 = clk::now();
    ~timed() { into += std::chrono::duration_cast<std::chrono::nanoseconds>(clk::now() - t0).count(); }
  };

  // Every device may read and write every chunk (mirrors, shared range): the CPU host chunks only.
  std::vector<access_desc> device_grants() const {
    std::vector<access_desc> g;
    for (auto* d : devs) g.push_back({ferry::location::on_device(d->info().ordinal), access::read_write});
    return g;
  }
  void map_mirror(void* va, const physical_chunk& c, bool host_chunk) {
    dev.map(va, c);
    auto g = device_grants();
    if (host_chunk) g.push_back({ferry::location::on_host(), access::read_write});
    dev.set_access(va, c.size(), g);
  }
  devmem& on(location at) { return *dm[static_cast<std::size_t>(at - 1)]; }
  std::byte* mirror(location at, std::uint64_t p) {
    return at == host ? host_mirror.at(p * page) : on(at).pool.at(static_cast<std::uint64_t>(on(at).slot_of[p]) * page);
  }
  physical_chunk& chunk(location at, std::uint64_t p) { return at == host ? hostc[p] : on(at).slots[on(at).slot_of[p]]; }
  void ensure_chunk(location at, std::uint64_t p) {
    if (at == host) {
      if (hostc[p]) return;
      timed tm{t.allocate};
      auto c = dev.allocate(page, ferry::location::on_host());
      map_mirror(host_mirror.at(p * page), c, true);
      hostc[p] = std::move(c);
      return;
    }
    devmem& m = on(at);
    if (m.slot_of[p] >= 0) return;
    std::lock_guard l(slot_mu);
    std::uint32_t i;
    if (!m.idle.empty()) {
      i = m.idle.back();
      m.idle.pop_back();
    } else {
      if (!m.holes.empty()) {
        i = m.holes.back();
      } else {
        if (m.made >= npages) fail(errc::internal, "vm.space", devs[at - 1]->id(), "more device slots than pages");
        i = m.made;
      }
      timed tm{t.allocate};
      // The home device makes the chunk, in the memory of the device it is for.
      auto c = dev.allocate(page, ferry::location::on_device(devs[at - 1]->info().ordinal));
      map_mirror(m.pool.at(static_cast<std::uint64_t>(i) * page), c, false);
      m.slots[i] = std::move(c);
      if (!m.holes.empty()) m.holes.pop_back();
      else ++m.made;
    }
    m.slot_of[p] = i;
  }
  // Gives device memory no page uses back to the devices.
  void trim() {
    std::lock_guard l(slot_mu);
    for (auto& m : dm) {
      for (auto i : m->idle) {
        try {
          dev.unmap(m->pool.at(static_cast<std::uint64_t>(i) * page), page);
        } catch (const std::exception& e) {
          log::error("vm", "{}: unmapping a device slot ({}) failed: {}", dev.id(), i, e.what());
          continue;
        }
        m->slots[i].reset();
        m->holes.push_back(i);
      }
      m->idle.clear();
    }
  }
  // The copy engines that move a page from -> to: the target device's, or the source device's when
  // the target is host memory (each device's engines reach its own memory at full speed; a peer's
  // over NVLink / PCIe peer-to-peer).
  devmem& engine(location from, location to) { return on(to != host ? to : from != host ? from : loc_of(0)); }
  void copy_sync(location from, location to, std::byte* dst, const std::byte* src) {
    devmem& m = engine(from, to);
    std::lock_guard l(m.st_mu);
    m.st->copy(dst, src, page);
    timed tm{t.copy_wait};
    m.st->synchronize(deadline_after(o.deadline));
  }

  // Waits for the work queued on attached streams: a kernel must not run on a page while its data
  // is copied away or its mapping changes (conservative: all of the stream's work, not per page).
  // A stream capturing a CUDA graph runs nothing of what it records, and must not be waited for
  // (that would end the user's capture with an error): it is passed over.
  void quiesce() {
    timed tm{t.quiesce};
    quiesce(deadline_after(o.deadline));
  }
  void quiesce(deadline until) {
    std::lock_guard l(streams_mu);
    for (auto* s : streams)
      if (!s->capturing()) s->synchronize(until);
  }
  // No work the devices were seen to launch (kernels, graphs, the runtime API's copies and memsets,
  // on any stream, attached or not) is still running: the moves the space makes on its own (returns,
  // fault-ahead) switch no mapping under it.
  bool launched_work_done() const noexcept {
    for (auto* d : devs)
      if (!d->launched_work_done()) return false;
    return true;
  }
  // The same, and when it is so, launches wait for earlier work again (launches_only_look ends).
  bool launched_work_finished() noexcept {
    if (!launched_work_done()) return false;
    launches_only_look = false;
    return true;
  }

  // The devices only: a GPU cannot fault, so always rw; the CPU is granted on its first touch.
  std::vector<access_desc> grants() const { return device_grants(); }
  // Lets the CPU reach page p through the shared range if it is mapped to its host chunk (page
  // locked): read, or read+write when the mapping may be written. `cpu_write`: a CPU fault's, which
  // waits for the work launched since a launch took the page's write access (see cpu_writable); a
  // transfer's pin does not (it runs under the registration cache's lock, and its copy goes on as
  // before a launch took the page).
  void grant_cpu(std::uint64_t p, bool cpu_write = true) {
    if (!shared_mapped[p] || shared_at[p] != host) return;
    if (cpu[p].load() == (host_w[p] ? 3 : 1)) return;
    if (write_taken[p] && host_w[p]) {
      write_taken[p] = 0;
      if (cpu_write) wait_for_launched_work();
    }
    std::vector<std::uint64_t> one{p};
    grant_shared_cpu(one);
  }
  // grant_cpu for pages mapped to their host chunks, one set_access per run of equal access.
  void grant_shared_cpu(std::vector<std::uint64_t>& pages) {
    timed tm{t.access};
    for (bool w : {false, true}) {
      std::vector<std::uint64_t> these;
      for (auto p : pages)
        if (static_cast<bool>(host_w[p]) == w) these.push_back(p);
      auto g = device_grants();
      g.push_back({ferry::location::on_host(), w ? access::read_write : access::read});
      runs(these, [&](std::uint64_t first, std::uint64_t n) {
        dev.set_access(shared.at(first * page), n * page, g);
        for (std::uint64_t p = first; p < first + n; ++p) cpu[p] = w ? 3 : 1;
      });
      if (w && !these.empty() && watching.load()) {  // (emptied by launches: only while they are watched)
        std::lock_guard l(writable_mu);
        cpu_writable.insert(cpu_writable.end(), these.begin(), these.end());
      }
    }
  }
  // The work launched since a launch took a page's write access ends before the CPU writes it: the
  // attached streams' and, as far as the devices tell, any other stream's. Bounded: past the
  // deadline, or on a stream's error, the write goes on (as it did before launches took pages),
  // said once -- a CPU writing a page no kernel uses must not end the process for a long kernel.
  void wait_for_launched_work() noexcept {
    write_waits++;
    try {
      timed tm{t.write_wait};
      const deadline until = deadline_after(o.deadline);  // one deadline for it all: the faulting thread waits two
      quiesce(until);
      if (!detail::poll_until(until, [&] { return launched_work_done(); }))
        fail(errc::timeout, "vm.fault", dev.id(), "launched work still runs");
    } catch (const std::exception& e) {
      if (!told_write_wait.exchange(true))
        log::warn("vm", "{}: a CPU write to a host page waited for the work launched since, which did not end ({}); the write "
                  "goes on beside it (said once)", dev.id(), e.what());
    }
  }
  std::atomic<bool> told_write_wait{false};
  // At a launch: the CPU keeps reading the host pages it may write (cpu_writable) but writes them
  // only after the launched work (grant_cpu). Each page under its lock, so that no fault switches it
  // meanwhile.
  void take_cpu_writes() noexcept {
    std::vector<std::uint64_t> pages;
    {
      std::lock_guard l(writable_mu);
      pages.swap(cpu_writable);
    }
    if (pages.empty()) return;
    std::sort(pages.begin(), pages.end());
    pages.erase(std::unique(pages.begin(), pages.end()), pages.end());
    std::vector<access_desc> g;
    try {
      g = device_grants();
      g.push_back({ferry::location::on_host(), access::read});
    } catch (const std::exception& e) {
      log::warn("vm", "{}: taking the CPU's write access for a launch failed: {}", dev.id(), e.what());
      return;
    }
    for (auto p : pages) {
      try {
        table->locked(p, [&] {
          if (!shared_mapped[p] || shared_at[p] != host || cpu[p].load() != 3) return;
          timed tm{t.access};
          dev.set_access(shared.at(p * page), page, g);
          cpu[p] = 1;
          write_taken[p] = 1;
        });
      } catch (const std::exception& e) {
        // The page stays writable: a CPU write may then run beside the kernel, as before this step.
        log::warn("vm", "{}: taking the CPU's write access to page {} for a launch failed: {}", dev.id(), p, e.what());
      }
    }
  }
  // Calls f(first page, count) for each run of consecutive pages in `pages` (sorted here).
  template <typename F>
  static void runs(std::vector<std::uint64_t>& pages, F&& f) {
    std::sort(pages.begin(), pages.end());
    for (std::size_t i = 0; i < pages.size();) {
      std::size_t j = i + 1;
      while (j < pages.size() && pages[j] == pages[j - 1] + 1) ++j;
      f(pages[i], static_cast<std::uint64_t>(j - i));
      i = j;
    }
  }
  void unmap_shared(std::vector<std::uint64_t> pages) {
    timed tm{t.unmap};
    runs(pages, [&](std::uint64_t first, std::uint64_t n) {
      dev.unmap(shared.at(first * page), n * page);
      for (std::uint64_t p = first; p < first + n; ++p) {
        shared_mapped[p] = 0;
        shared_at[p] = -1;
        cpu[p] = 0;
        write_taken[p] = 0;
      }
    });
  }
  void map_shared(std::uint64_t p, location at, bool writable) {
    timed tm{t.map};
    dev.map(shared.at(p * page), chunk(at, p));
    shared_mapped[p] = 1;
    shared_at[p] = at;
    host_w[p] = at == host && writable;
    cpu[p] = 0;
    write_taken[p] = 0;
  }
  void grant_shared(std::vector<std::uint64_t> pages) {
    timed tm{t.access};
    auto g = grants();
    runs(pages, [&](std::uint64_t first, std::uint64_t n) { dev.set_access(shared.at(first * page), n * page, g); });
  }

  // ---- page_mover ----
  void copy(std::uint64_t p, location from, location to) override {
    quiesce();
    ensure_chunk(to, p);
    copy_sync(from, to, mirror(to, p), mirror(from, p));
  }
  void populate(std::uint64_t p, location at) override {
    // A page allocated again may still be read by work queued before its free (torch frees a tensor
    // as soon as its last kernel is queued): its mapped copy is zeroed only after that work.
    if (shared_mapped[p] && shared_at[p] == at) quiesce();
    ensure_chunk(at, p);
    copy_sync(host, at, mirror(at, p), host_mirror.at(npages * page));
  }
  void drop(std::uint64_t p, location at) noexcept override {
    if (at == host) return;  // host chunks stay with their page
    devmem& m = on(at);
    if (m.slot_of[p] < 0) return;
    std::lock_guard l(slot_mu);
    m.idle.push_back(static_cast<std::uint32_t>(m.slot_of[p]));
    m.slot_of[p] = -1;
  }
  void map(std::uint64_t p, location at, bool writable) override {
    if (shared_mapped[p]) {
      quiesce();
      unmap_shared({p});  // the new copy exists; the old one is dropped after this
    }
    map_shared(p, at, writable);
    grant_shared({p});
  }

  void unmap(std::uint64_t p) override {
    if (!shared_mapped[p]) return;
    quiesce();  // work queued before the free may still use the page
    unmap_shared({p});
  }

  std::uint64_t start(const std::vector<step>& steps) override {
    quiesce();
    flight f;
    f.steps = steps;
    f.mapped_new.assign(steps.size(), 0);
    f.copied.assign(steps.size(), 0);
    try {
      for (std::size_t i = 0; i < steps.size(); ++i)
        if (steps[i].copy) {
          ensure_chunk(steps[i].to, steps[i].page);
          f.copied[i] = 1;
        }
      std::vector<std::uint64_t> un, dev_mapped;
      for (auto& s : steps)
        if (s.map && shared_mapped[s.page]) un.push_back(s.page);
      unmap_shared(un);
      // Device targets are mapped before their data lands: the CPU cannot reach device chunks and
      // attached streams are idle. Host targets are mapped after (a CPU access would see old bytes).
      for (std::size_t i = 0; i < steps.size(); ++i)
        if (steps[i].map && steps[i].to != host) {
          map_shared(steps[i].page, steps[i].to, true);
          f.mapped_new[i] = 1;
          dev_mapped.push_back(steps[i].page);
        }
      grant_shared(dev_mapped);
      for (auto& m : dm) {
        bool any = false;
        for (auto& s : steps) any = any || (s.copy && &engine(s.from, s.to) == m.get());
        if (!any) continue;
        std::lock_guard l(m->st_mu);
        for (auto& s : steps)
          if (s.copy && &engine(s.from, s.to) == m.get()) m->st->copy(mirror(s.to, s.page), mirror(s.from, s.page), page);
        f.done.push_back(m->st->record());
      }
    } catch (...) {
      rollback(f);
      throw;
    }
    std::lock_guard l(flights_mu);
    flights.emplace(++next_ticket, std::move(f));
    return next_ticket;
  }

  void finish(std::uint64_t ticket) override {
    flight f;
    {
      std::lock_guard l(flights_mu);
      auto it = flights.find(ticket);
      if (it == flights.end()) fail(errc::internal, "vm.migrate", dev.id(), fmt::format("no batch {}", ticket));
      f = std::move(it->second);
      flights.erase(it);
    }
    try {
      if (!f.done.empty()) {
        timed tm{t.copy_wait};
        auto until = deadline_after(o.deadline);
        for (auto& e : f.done) e->wait(until);
      }
      std::vector<std::uint64_t> hm, hc;  // host targets: for the device only / for the CPU as well
      for (std::size_t i = 0; i < f.steps.size(); ++i) {
        auto& s = f.steps[i];
        if (!s.map || s.to != host) continue;
        map_shared(s.page, host, s.writable);
        f.mapped_new[i] = 1;
        (s.cpu ? hc : hm).push_back(s.page);
      }
      grant_shared(hm);
      grant_shared_cpu(hc);  // one set_access instead of two when the CPU is the reader
    } catch (...) {
      rollback(f);
      throw;
    }
  }

  // Puts a failed batch's pages back as they were: old mappings, no memory at `to`.
  void rollback(flight& f) noexcept {
    if (!f.done.empty()) {
      for (auto& m : dm) {
        try {
          std::lock_guard l(m->st_mu);
          m->st->synchronize(deadline_after(o.deadline));  // nothing may still write into memory given back
        } catch (const std::exception& e) {
          log::error("vm", "{}: copies of a failed migration batch: {}", m->st->owner().id(), e.what());
        }
      }
    }
    for (std::size_t i = 0; i < f.steps.size(); ++i) {
      auto& s = f.steps[i];
      try {
        if (f.mapped_new[i] && shared_mapped[s.page]) unmap_shared({s.page});
        if (s.map && !shared_mapped[s.page] && s.was_at >= 0) {
          map_shared(s.page, s.was_at, s.was_writable);
          grant_shared({s.page});
        }
      } catch (const std::exception& e) {
        log::error("vm", "{}: restoring the mapping of page {} after a failed migration failed: {}", dev.id(), s.page, e.what());
      }
      if (f.copied[i]) drop(s.page, s.to);
    }
  }

  // ---- return of taken pages ----
  // Launches on this thread that went ahead without the gate (a background return overran its deadline).
  static inline thread_local std::vector<const impl*> ungated;
  void before_launch() noexcept override {
    if (!gate.try_lock_shared_for(o.deadline)) {
      log::error("vm", "{}: a launch waited {} ms for a background return of pages; it goes ahead", dev.id(),
                 std::chrono::duration_cast<std::chrono::milliseconds>(o.deadline).count());
      ungated.push_back(this);
      take_cpu_writes();
      return;
    }
    launches++;
    if (ahead_mu.try_lock_for(o.deadline)) ahead_mu.unlock();
    struct then_writes {  // after the return (or none): what stays on the host
      impl* s;
      ~then_writes() { s->take_cpu_writes(); }
    } tw{this};
    if (!o.return_at_launch) return;
    std::unique_lock r(return_mu, std::defer_lock);
    if (!r.try_lock_for(o.deadline)) {
      log::error("vm", "{}: a launch waited {} ms for another launch's return of pages; it goes ahead", dev.id(),
                 std::chrono::duration_cast<std::chrono::milliseconds>(o.deadline).count());
      return;
    }
    if (table->cpu_taken() == 0) return;
    // Work launched before this one (on any stream) may be using the pages: when there are pages
    // to move, it is waited for up to the quiet time (a launch right after a copy); past that the
    // pages wait for a later launch or the background return, and the kernel reads them where
    // they are. After such a wait ran out, launches only look until the work is seen finished: a
    // long-running kernel must not cost every launch the quiet time.
    auto earlier_work_done = [&] {
      if (launches_only_look.load()) return launched_work_finished();
      if (detail::poll_until(deadline_after(o.return_quiet), [&] { return launched_work_done(); })) return true;
      launches_only_look = true;
      log::debug("vm", "{}: work launched earlier still runs: the pages the CPU took stay for now", dev.id());
      return false;
    };
    try {
      table->return_taken(std::chrono::nanoseconds::zero(), npages, o.batch, earlier_work_done);
    } catch (const std::exception& e) {
      // The kernel still runs correctly: the pages stay on the host, mapped for the device.
      log::warn("vm", "{}: returning pages to the device before a launch failed: {}", dev.id(), e.what());
    }
  }
  void after_launch() noexcept override {
    if (auto it = std::find(ungated.begin(), ungated.end(), this); it != ungated.end()) {
      ungated.erase(it);
      return;
    }
    gate.unlock_shared();
  }
  // One background step (service thread): a batch of pages quiet for return_quiet, when no launch
  // is under way, the attached streams are idle and no launched work still runs. True when more
  // may be waiting.
  // Nothing it calls may end the service thread: a stream's query fails too (the driver shut down at
  // the process's exit while pages were still taken), and the pages then stay where they are.
  bool return_in_background() noexcept {
    if (!watching || o.return_quiet.count() <= 0 || table->cpu_taken() == 0) return false;
    std::unique_lock g(gate, std::try_to_lock);
    if (!g) return false;
    try {
      {
        std::lock_guard l(streams_mu);
        for (auto* s : streams)
          if (!s->capturing() && !s->idle()) return false;
      }
      auto keep = std::chrono::steady_clock::now() - cpu_heading_since < o.return_hold ? cpu_heading
                                                                                         : std::pair<std::uint64_t, std::uint64_t>{0, 0};
      return table->return_taken(o.return_quiet, o.batch, o.batch, [&] { return launched_work_finished(); }, keep) > 0;
    } catch (const std::exception& e) {
      if (!told_return_failed.exchange(true))
        log::warn("vm", "{}: returning quiet pages to the device failed: {} (said once; the pages stay where they are)", dev.id(), e.what());
      else
        log::debug("vm", "{}: returning quiet pages to the device failed: {}", dev.id(), e.what());
      return false;
    }
  }
  std::atomic<bool> told_return_failed{false};

  // ---- CPU faults ----
  void serve() {
    g_spaces[slot].service_tid.store(::syscall(SYS_gettid));
    bool more = false;
    // Fault-ahead still to do: the pages after the last fault, moved a batch at a time while no
    // other fault waits (the faulting thread already runs on).
    std::uint64_t ahead = 0, ahead_end = 0;
    // The window grows while the faults come in sequence (each one inside the last window): a
    // sequential reader or writer then faults once per window, the window doubling up to 8 times
    // fault_ahead; a fault elsewhere starts over.
    std::uint64_t window = o.fault_ahead, last = ~0ull, epoch = 0;
    while (!stop) {
      pollfd pf{pipe_rd, POLLIN, 0};
      int n = ::poll(&pf, 1, more || ahead < ahead_end ? 0 : 50);
      if (n <= 0) {
        if (ahead < ahead_end) {
          std::unique_lock l(ahead_mu);
          // A kernel launched since the fault, or one still running: no more moves to the host.
          if (launches.load() != epoch || !launched_work_done()) {
            ahead = ahead_end;
            continue;
          }
          std::uint64_t e = std::min(ahead_end, ahead + o.batch);
          try {
            table->move_ahead(ahead, e, host, o.batch);
          } catch (const std::exception& ex) {
            log::warn("vm", "{}: moving pages {}..{} ahead of a CPU fault failed: {}", dev.id(), ahead, e - 1, ex.what());
          }
          ahead = e;
          continue;
        }
        more = return_in_background();
        continue;
      }
      fault_message m{};
      if (::read(pipe_rd, &m, sizeof m) != static_cast<ssize_t>(sizeof m)) continue;
      // Only a fault of this process, in this space, is served: anything else is not touched.
      if (m.magic != fault_magic || m.pid != ::getpid() || !m.record || m.addr < shared.address() ||
          m.addr - shared.address() >= shared.size()) {
        log::error("vm", "{}: ignoring a malformed fault message (pid {}, address {:#x})", dev.id(), m.pid, m.addr);
        continue;
      }
      fault_record* r = m.record;
      int result = 1;
      std::uint64_t pg = (r->addr - shared.address()) / page;
      try {
        // Read before the fault is served: a launch while it is served stops the moves ahead too.
        const std::uint64_t launches_before = launches.load();
        const std::uint64_t waited_before = t.quiesce.load();
        timed tm{t.cpu_fault};
        table->fault_range(pg, pg + 1, host, r->write, o.batch, o.deadline, [&] { grant_cpu(pg); });
        tell_concurrent_use(r->addr, t.quiesce.load() - waited_before);
        cpu_faults++;
        bool in_sequence = last != ~0ull && pg > last && pg <= ahead_end;
        window = in_sequence ? std::min(window * 2, o.fault_ahead * 8) : o.fault_ahead;
        last = pg;
        epoch = launches_before;
        ahead = pg + 1;
        ahead_end = allocation_end(pg, window);
        cpu_heading = {ahead, ahead_end};
        cpu_heading_since = std::chrono::steady_clock::now();
      } catch (const std::exception& e) {
        // The page's state too (its copies, where it is mapped, what the CPU may do there, its pins):
        // a failure here ends the process, and that is what tells its cause.
        const page_snapshot sn = table->snapshot(pg);
        log::error("vm", "{}: CPU fault at {:#x} (page {}, {}) failed: {} [page: valid {:#x}, mapped at {}, CPU access {}, pins {}]",
                   dev.id(), r->addr, pg, r->write ? "write" : "read", e.what(), sn.valid, sn.mapped,
                   static_cast<unsigned>(cpu[pg].load()), sn.pins);
        result = -1;
      }
      r->state.store(result, std::memory_order_release);
      futex(&r->state, FUTEX_WAKE_PRIVATE, 1, nullptr);
    }
  }

  // A CPU fault that waited long for the program's streams touched memory while its kernels ran.
  // Said once per space: such a program may share memory between the CPU and a running kernel
  // (flags, system-scope atomics), which a space without GPU faults serves only by waiting -- and
  // not at all while the page stays on the host (no atomicity with the CPU over PCIe).
  void tell_concurrent_use(std::uintptr_t addr, std::uint64_t waited_ns) {
    if (waited_ns < 10'000'000 || told_concurrent.exchange(true)) return;
    log::warn("vm",
              "{}: the CPU touched unified memory at {:#x} while the program's work on its streams ran, and waited {:.1f} ms "
              "for it (pages move only between kernels); a program whose CPU and GPU use the same memory at the same time "
              "(flags, system-scope atomics) is not served by this space: it may wait until the deadline or get wrong "
              "results (said once)",
              dev.id(), addr, static_cast<double>(waited_ns) / 1e6);
  }
  std::atomic<bool> told_concurrent{false};

  // The end of the fault-ahead window of page p: at most `ahead` pages, inside p's allocation.
  std::uint64_t allocation_end(std::uint64_t p, std::uint64_t ahead) {
    std::lock_guard l(alloc_mu);
    auto it = used_ranges.upper_bound(p);
    if (it == used_ranges.begin()) return p + 1;
    --it;
    if (p >= it->first + it->second) return p + 1;
    return std::min(it->first + it->second, p + ahead);
  }

  std::string device_list() const {
    std::string r;
    for (auto* d : devs) r += (r.empty() ? "" : ", ") + d->id();
    return r;
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
  r.device = s_.dev.info().backend;
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
    for (; done < end; ++done) {
      s_.table->pin_in_place(done, deadline_after(s_.o.deadline));
      // A transfer may reach host pages through the CPU (pread, memcpy).
      s_.table->locked(done, [&] { s_.grant_cpu(done, false); });
    }
  } catch (...) {
    for (std::uint64_t p = first; p < done; ++p) s_.table->unpin(p);
    throw;
  }
  return 0;
}

std::uint64_t unified_client::one_place(std::uintptr_t p, std::uint64_t n) {
  auto [first, end] = s_.pages_of(reinterpret_cast<void*>(p), n, "vm.one_place");
  const location at = s_.table->snapshot(first).mapped;
  std::uint64_t k = first + 1;
  while (k < end && s_.table->snapshot(k).mapped == at) ++k;
  if (k == end) return n;
  return s_.shared.address() + k * s_.page - p;  // up to the first page mapped elsewhere
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

address_space::address_space(device& dev, std::uint64_t bytes, space_options o)
    : impl_(std::make_unique<impl>(std::vector<device*>{&dev}, bytes, o)) {}
address_space::address_space(std::span<device* const> devs, std::uint64_t bytes, space_options o)
    : impl_(std::make_unique<impl>(std::vector<device*>(devs.begin(), devs.end()), bytes, o)) {}
address_space::~address_space() {
  if (impl_ && impl_->o.report) {
    try {
      std::fputs(report().c_str(), stderr);
    } catch (const std::exception& e) {
      log::warn("vm", "no report of the unified address space: {}", e.what());
    }
  }
}

void* address_space::alloc(std::uint64_t bytes) {
  auto& I = *impl_;
  std::uint64_t need = std::max<std::uint64_t>(1, (bytes + I.page - 1) / I.page);
  std::unique_lock l(I.alloc_mu);
  std::uint64_t at = 0;
  for (auto& [first, n] : I.used_ranges) {
    if (first - at >= need) break;
    at = first + n;
  }
  if (at + need > I.npages)
    fail(errc::out_of_memory, "vm.alloc", fmt::format("{} bytes", bytes), fmt::format("the address space has no {} free pages in a row", need));
  I.used_ranges[at] = need;
  l.unlock();  // the range is taken: other allocations go on while this one's pages are made
  // Every page mapped and zeroed before the pointer is handed out: a kernel may touch it first.
  try {
    for (std::uint64_t pg = at; pg < at + need; ++pg) I.table->populate_fresh(pg, loc_of(0), deadline_after(I.o.deadline));
  } catch (const error& e) {
    l.lock();
    I.used_ranges.erase(at);
    throw e.with_context(fmt::format("alloc of {} bytes", bytes));
  }
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
  // The bytes are dead: copies go without a write-back (device memory back to the pool), mappings
  // after the attached streams' earlier work; alloc makes the pages anew.
  for (std::uint64_t pg = first; pg < first + n; ++pg) I.table->discard(pg, deadline_after(I.o.deadline));
  I.trim();
}

void address_space::advise(void* p, std::uint64_t bytes, advice a, memory_kind where) {
  advise(p, bytes, a, ferry::location{where, -1});
}

void address_space::advise(void* p, std::uint64_t bytes, advice a, ferry::location where) {
  auto& I = *impl_;
  auto [first, end] = I.pages_of(p, bytes, "vm.advise");
  // The page table's location: host 0, device k of the space k + 1 (id -1: the first device).
  location at = host;
  if (where.kind == memory_kind::device) {
    at = -1;
    for (std::size_t k = 0; k < I.devs.size(); ++k)
      if (where.id == -1 ? k == 0 : I.devs[k]->info().ordinal == where.id) at = loc_of(k);
    if (at < 0)
      fail(errc::invalid_argument, "vm.advise", fmt::format("{}:{}", to_string(I.dev.info().backend), where.id),
           fmt::format("not a device of this address space ({})", I.device_list()));
  }
  if (a == advice::prefetch) return I.table->prefetch_range(first, end, at, I.o.batch, I.o.deadline);
  for (std::uint64_t pg = first; pg < end; ++pg) {
    auto until = deadline_after(I.o.deadline);
    switch (a) {
      case advice::prefetch: I.table->prefetch(pg, at, until); break;
      case advice::dontneed:
        // A device's copy; without a device named (id -1) every device's.
        if (where.kind == memory_kind::device && where.id != -1) {
          I.table->dontneed(pg, at, until);
        } else {
          for (std::size_t k = 0; k < I.devs.size(); ++k) I.table->dontneed(pg, loc_of(k), until);
        }
        break;
      case advice::read_mostly: I.table->set_read_mostly(pg, true); break;
      case advice::no_read_mostly: I.table->set_read_mostly(pg, false); break;
      case advice::preferred_location: I.table->set_preferred(pg, at); break;
      case advice::no_preferred_location: I.table->set_preferred(pg, -1); break;
    }
  }
}

void* address_space::base() const noexcept { return impl_->shared.base(); }
std::uint64_t address_space::size() const noexcept { return impl_->shared.size(); }
std::uint64_t address_space::page_bytes() const noexcept { return impl_->page; }
void address_space::attach_stream(stream& s) {
  if (std::find(impl_->devs.begin(), impl_->devs.end(), &s.owner()) == impl_->devs.end())
    fail(errc::invalid_argument, "vm.stream", s.owner().id(), "a stream of another device than the space's (" + impl_->device_list() + ")");
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
bool address_space::returns_pages() const noexcept { return impl_->watching; }
space_timings address_space::timings() const noexcept {
  auto& t = impl_->t;
  return {t.quiesce.load(), t.allocate.load(), t.unmap.load(), t.map.load(), t.access.load(), t.copy_wait.load(),
          t.cpu_fault.load(), t.write_wait.load()};
}

std::string address_space::report() const {
  auto& I = *impl_;
  const vm_stats st = stats();
  const space_timings t = timings();
  auto sec = [](std::uint64_t ns) { return static_cast<double>(ns) / 1e9; };
  const double alive = std::chrono::duration<double>(std::chrono::steady_clock::now() - I.made).count();
  std::string r = fmt::format("ferry unified memory on {}: {} in pages of {}, up to {} on the device; {:.3f} s since it was made\n",
                              I.device_list(), format_size(size()), format_size(I.page), format_size(device_capacity()), alive);
  r += fmt::format("  CPU faults {} (serving them {:.3f} s, their migrations included), pages moved ahead of them {}\n", cpu_faults(), sec(t.cpu_fault),
                   st.fault_ahead);
  r += fmt::format("  migrations: to a device {} ({}), to the host {} ({}), between devices {} ({})\n", st.migrations_h2d,
                   format_size(st.bytes_h2d), st.migrations_d2h, format_size(st.bytes_d2h), st.migrations_d2d, format_size(st.bytes_d2d));
  r += fmt::format("  evictions {} ({} written back, {} dropped clean), prefetches {}, returned to a device {}, held on the host "
                   "{} (thrashing) and {} (taken back by the CPU)\n",
                   st.evictions, st.writebacks, st.clean_drops, st.prefetches, st.returns, st.thrash_holds, st.return_holds);
  const std::uint64_t remap = t.unmap + t.map + t.access;
  r += fmt::format("  time: new chunks {:.3f} s, remapping {:.3f} s, waiting for the program's streams {:.3f} s, waiting for "
                   "copies {:.3f} s\n", sec(t.allocate), sec(remap), sec(t.quiesce), sec(t.copy_wait));
  r += fmt::format("  CPU writes to host pages after a launch {} (waiting for the work launched since {:.3f} s)\n", I.write_waits.load(),
                   sec(t.write_wait));
  // The largest part, and what usually makes it smaller.
  const std::pair<std::uint64_t, const char*> parts[] = {
      {t.cpu_fault - std::min(t.cpu_fault, t.write_wait), "serving CPU faults: the CPU touches pages a device holds; a prefetch to the host "
                    "(cudaMemPrefetchAsync to cudaCpuDeviceId) before the CPU reads them moves them in batches"},
      {t.allocate, "making memory for pages used the first time somewhere; larger pages (FERRY_VM_PAGE) mean fewer"},
      {remap, "remapping pages as they move; larger pages (FERRY_VM_PAGE) mean fewer remaps"},
      {t.quiesce, "waiting for the program's work on its streams before pages move; prefetches before the kernels "
                  "that need the pages move them while nothing runs"},
      {t.write_wait, "CPU writes waiting for kernels: the CPU writes a page kept on the host (which kernels reach over "
                     "the link) only after the kernels launched since it last wrote it, so CPU threads that write such "
                     "pages while kernels run take turns with those kernels"},
      {t.copy_wait, st.evictions > st.migrations_h2d / 2 ? "copying pages, many of them evicted and brought back: the "
                                                            "working set is larger than the device capacity (FERRY_VM_CAPACITY)"
                                                          : "copying pages over the link; prefetches move them in larger batches"},
  };
  const auto* top = &parts[0];
  for (const auto& p : parts)
    if (p.first > top->first) top = &p;
  if (top->first > 0) r += fmt::format("  most of it: {:.3f} s {}\n", sec(top->first), top->second);
  return r;
}
std::uint64_t address_space::device_capacity() const noexcept { return impl_->cap[loc_of(0)] * impl_->page; }
std::uint64_t address_space::device_capacity(const device& d) const {
  for (std::size_t k = 0; k < impl_->devs.size(); ++k)
    if (impl_->devs[k] == &d) return impl_->cap[loc_of(k)] * impl_->page;
  fail(errc::invalid_argument, "vm.space", d.id(), "not a device of this address space (" + impl_->device_list() + ")");
}
std::vector<device*> address_space::devices() const { return impl_->devs; }
std::uint64_t address_space::resident(const device& d) const {
  for (std::size_t k = 0; k < impl_->devs.size(); ++k)
    if (impl_->devs[k] == &d) return impl_->table->resident(loc_of(k));
  fail(errc::invalid_argument, "vm.space", d.id(), "not a device of this address space (" + impl_->device_list() + ")");
}

space_options space_options::from(const vm_settings& s) {
  space_options o;
  o.device_capacity = s.vm_capacity;
  o.reserve = s.vm_reserve;
  o.page_bytes = s.vm_page;
  o.policy = s.vm_policy;
  o.deadline = s.deadline;
  o.batch = static_cast<std::uint64_t>(s.vm_batch);
  o.fault_ahead = static_cast<std::uint64_t>(s.vm_fault_ahead);
  o.thrash_lapse = s.vm_thrash_lapse;
  o.thrash_hold = s.vm_thrash_hold;
  o.return_at_launch = s.vm_return_at_launch;
  o.return_quiet = s.vm_return_quiet;
  o.return_hold = s.vm_return_hold;
  o.report = s.vm_report;
  return o;
}

std::uint64_t whole_memory_size(device& dev) {
  const auto host_bytes = static_cast<std::uint64_t>(::sysconf(_SC_PHYS_PAGES)) * static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  const std::uint64_t g = dev.granularity();
  return (dev.memory().total + host_bytes + g - 1) / g * g;
}

}  // namespace ferry::vm
