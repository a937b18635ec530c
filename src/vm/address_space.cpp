// A unified address space on ferry's device interface: the page table's page_mover hooks (copies,
// remaps, batches), what a CPU fault and a launch do, and the public calls. Its memory is
// space_memory's, its shared range's mappings shared_range's, the fault path cpu_fault_service's.
// See include/ferry/vm/address_space.hpp.
#include <ferry/core/error.hpp>
#include <ferry/core/units.hpp>
#include <ferry/vm/address_space.hpp>

#include "core/logging.hpp"
#include "device/poll.hpp"
#include "vm/cpu_faults.hpp"
#include "vm/shared_range.hpp"
#include "vm/space_memory.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <utility>

namespace ferry::vm {

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

namespace {
std::vector<device*> checked(std::vector<device*> ds) {
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

space_options valid(const space_options& opt, const device& d) {
  expects(opt.batch > 0 && opt.fault_ahead > 0, "vm.space", d.id(), "batch and fault_ahead must be positive");
  return opt;
}
// The pages of a space of `bytes`: at least one.
std::uint64_t pages_for(std::uint64_t bytes, std::uint64_t page, const device& d) {
  const std::uint64_t n = (bytes + page - 1) / page;
  expects(n > 0, "vm.space", d.id(), "an address space needs at least one page");
  return n;
}

// Batches between start() and finish().
struct flight {
  std::vector<page_mover::step> steps;
  std::vector<char> mapped_new;  // per step: the shared range points at `to`
  std::vector<char> copied;      // per step: `to` memory was taken and a copy queued
  std::vector<std::unique_ptr<event>> done;  // one per stream the copies went to
};

// A prefetch left to the service thread (address_space::impl, "prefetches the program does not wait for").
struct deferred_prefetch {
  std::uint64_t first, end;
  location at;
};

// The page table's migration batches between start() and finish(): each step's memory taken and
// its copy queued, the mappings switched around the copies, and on a failure every page put back as
// it was. The caller has quiesced the attached streams first.
class batch_moves {
 public:
  batch_moves(space_memory& m, shared_range& r, space_clock& clock, std::uint64_t page_bytes, std::chrono::nanoseconds deadline,
              std::string dev_id)
      : mem(m), range(r), t(clock), page(page_bytes), limit(deadline), id(std::move(dev_id)) {}
  std::uint64_t start(const std::vector<page_mover::step>& steps) {
    flight f;
    f.steps = steps;
    f.mapped_new.assign(steps.size(), 0);
    f.copied.assign(steps.size(), 0);
    try {
      for (std::size_t i = 0; i < steps.size(); ++i)
        if (steps[i].copy) {
          mem.ensure_chunk(steps[i].to, steps[i].page);
          f.copied[i] = 1;
        }
      std::vector<std::uint64_t> un, dev_mapped;
      for (auto& s : steps)
        if (s.map && range.mapped(s.page)) un.push_back(s.page);
      range.unmap(un);
      // Device targets are mapped before their data lands: the CPU cannot reach device chunks and
      // attached streams are idle. Host targets are mapped after (a CPU access would see old bytes).
      for (std::size_t i = 0; i < steps.size(); ++i)
        if (steps[i].map && steps[i].to != host) {
          range.map(steps[i].page, steps[i].to, true);
          f.mapped_new[i] = 1;
          dev_mapped.push_back(steps[i].page);
        }
      range.grant_devices(dev_mapped);
      for (auto& m : mem.dm) {
        bool any = false;
        for (auto& s : steps) any = any || (s.copy && &mem.engine(s.from, s.to) == m.get());
        if (!any) continue;
        std::lock_guard l(m->st_mu);
        for (auto& s : steps)
          if (s.copy && &mem.engine(s.from, s.to) == m.get()) m->st->copy(mem.mirror(s.to, s.page), mem.mirror(s.from, s.page), page);
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

  void finish(std::uint64_t ticket) {
    flight f;
    {
      std::lock_guard l(flights_mu);
      auto it = flights.find(ticket);
      if (it == flights.end()) fail(errc::internal, "vm.migrate", id, fmt::format("no batch {}", ticket));
      f = std::move(it->second);
      flights.erase(it);
    }
    try {
      if (!f.done.empty()) {
        timed tm{t.copy_wait};
        auto until = deadline_after(limit);
        for (auto& e : f.done) e->wait(until);
      }
      std::vector<std::uint64_t> hm, hc;  // host targets: for the device only / for the CPU as well
      for (std::size_t i = 0; i < f.steps.size(); ++i) {
        auto& s = f.steps[i];
        if (!s.map || s.to != host) continue;
        range.map(s.page, host, s.writable);
        f.mapped_new[i] = 1;
        (s.cpu ? hc : hm).push_back(s.page);
      }
      range.grant_devices(hm);
      range.grant_cpu(hc);  // one set_access instead of two when the CPU is the reader
    } catch (...) {
      rollback(f);
      throw;
    }
  }

  private:
  // Puts a failed batch's pages back as they were: old mappings, no memory at `to`.
  void rollback(flight& f) noexcept {
    if (!f.done.empty()) {
      for (auto& m : mem.dm) {
        try {
          std::lock_guard l(m->st_mu);
          m->st->synchronize(deadline_after(limit));  // nothing may still write into memory given back
        } catch (const std::exception& e) {
          log::error("vm", "{}: copies of a failed migration batch: {}", m->st->owner().id(), e.what());
        }
      }
    }
    for (std::size_t i = 0; i < f.steps.size(); ++i) {
      auto& s = f.steps[i];
      try {
        if (f.mapped_new[i] && range.mapped(s.page)) range.unmap({s.page});
        if (s.map && !range.mapped(s.page) && s.was_at >= 0) {
          range.map(s.page, s.was_at, s.was_writable);
          range.grant_devices({s.page});
        }
      } catch (const std::exception& e) {
        log::error("vm", "{}: restoring the mapping of page {} after a failed migration failed: {}", id, s.page, e.what());
      }
      if (f.copied[i]) mem.drop(s.page, s.to);
    }
  }

  space_memory& mem;
  shared_range& range;
  space_clock& t;
  const std::uint64_t page;
  const std::chrono::nanoseconds limit;
  const std::string id;
  std::mutex flights_mu;
  std::map<std::uint64_t, flight> flights;
  std::uint64_t next_ticket = 0;
};
}  // namespace

struct address_space::impl final : page_mover, launch_observer, fault_target {
  // The space's devices; the first ("home") reserves the ranges and makes every chunk, the others'
  // memory included (device::allocate on a peer), so one range holds them all.
  std::vector<device*> devs;
  device& dev;
  space_options o;
  space_clock t;  // before mem, which adds to it
  const std::uint64_t page, npages;
  std::vector<std::uint64_t> cap;           // per page-table location: pages it may hold (0, the host: unused)
  space_memory mem;
  shared_range range;
  std::unique_ptr<page_table> table;
  std::mutex streams_mu;
  std::vector<stream*> streams;  // attached: migrations wait for their work
  std::mutex alloc_mu;
  std::map<std::uint64_t, std::uint64_t> used_ranges;  // first page -> pages
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
  std::unique_ptr<unified_client> client;
  // Made at the end of the constructor and reset first in the destructor: its thread calls serve_fault,
  // between_faults and work_waiting, which use the members above and below.
  std::unique_ptr<cpu_fault_service> faults;
  std::atomic<std::uint64_t> write_waits{0};  // CPU writes that waited for launched work (wait_for_launched_work)
  std::uint64_t watch_ns = 0;  // turning the launch callbacks on, in the constructor (the process's first space pays it)
  const std::chrono::steady_clock::time_point made = std::chrono::steady_clock::now();
  batch_moves moves{mem, range, t, page, o.deadline, dev.id()};

  impl(std::vector<device*> ds, std::uint64_t bytes, space_options opt)
      : devs(checked(std::move(ds))),
        dev(*devs[0]),
        o(valid(opt, *devs[0])),
        page(space_memory::page_for(devs, o.page_bytes)),
        npages(pages_for(bytes, page, dev)),
        mem(devs, page, npages, o.deadline, t),
        range(mem, t) {
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
    client = std::make_unique<unified_client>(*this);
    add_process_client(client.get());
    try {
      if (o.return_at_launch || o.return_quiet.count() > 0) {
        std::string why;
        bool all = true;
        const auto w0 = std::chrono::steady_clock::now();
        for (auto* d : devs) all = all && d->watch_launches(*this, why);
        watch_ns = static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - w0).count());
        watching = all;
        range.remember_writes(all);
        if (!all) {
          for (auto* d : devs) d->unwatch_launches(*this);
          log::info("vm", "{}: pages the CPU takes from the device stay on the host until a hint moves them: {}", dev.id(), why);
        }
      }
      // Nothing of the space is handed out yet: no fault can come before its service does. A fault
      // waits for the service thread's own deadline (o.deadline per batch) and then some.
      faults = std::make_unique<cpu_fault_service>(mem.shared.address(), mem.shared.size(), o.deadline * 2 + std::chrono::seconds(1),
                                                   *this, dev.id());
    } catch (...) {
      for (auto* d : devs) d->unwatch_launches(*this);
      remove_process_client(client.get());
      throw;
    }
  }
  ~impl() override {
    for (auto* d : devs) d->unwatch_launches(*this);  // waits for launches under way
    remove_process_client(client.get());  // holders are told; nothing calls it afterwards
    faults.reset();  // no fault is served from here on
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

  // Lets the CPU reach page p through the shared range if it is mapped to its host chunk (page
  // locked): read, or read+write when the mapping may be written. `cpu_write`: a CPU fault's, which
  // waits for the work launched since a launch took the page's write access (shared_range); a
  // transfer's pin does not (it runs under the registration cache's lock, and its copy goes on as
  // before a launch took the page).
  void grant_cpu(std::uint64_t p, bool cpu_write = true) {
    if (!range.cpu_lacks(p)) return;
    if (range.write_was_taken(p) && cpu_write) wait_for_launched_work();
    std::vector<std::uint64_t> one{p};
    range.grant_cpu(one);
  }
  // The work launched since a launch took a page's write access ends before the CPU writes it: the
  // attached streams' and, as far as the devices tell, any other stream's. Bounded: past the
  // deadline, or on a stream's error, the write goes on (as it did before launches took pages),
  // said once -- a CPU writing a page no kernel uses must not end the process for a long kernel.
  // Once a wait ran out, later writes go on at once until the next launch, as launches only look
  // after theirs ran out: a kernel that outlasts the deadline (or waits for the CPU) costs it once,
  // not once per page the CPU writes; those writes do not wait for the attached streams either (work
  // queued there since without a launch, a copy or a memset, is not waited for until the next launch).
  // Nothing is put on the program's streams to tell when that work ends (an event recorded on the
  // legacy stream would hold every blocking stream behind it).
  void wait_for_launched_work() noexcept {
    write_waits++;
    const std::uint64_t at = launches.load();  // a launch during the wait is waited for by the next write
    if (writes_ran_out_at.load() == at) return;
    try {
      timed tm{t.write_wait};
      const deadline until = deadline_after(o.deadline);  // one deadline for it all: the faulting thread waits two
      quiesce(until);
      if (!detail::poll_until(until, [&] { return launched_work_done(); }))
        fail(errc::timeout, "vm.fault", dev.id(), "launched work still runs");
    } catch (const std::exception& e) {
      writes_ran_out_at = at;
      if (!told_write_wait.exchange(true))
        log::warn("vm", "{}: a CPU write to a host page waited for the work launched since, which did not end ({}); the write "
                  "goes on beside it (said once)", dev.id(), e.what());
    }
  }
  std::atomic<bool> told_write_wait{false};
  std::atomic<bool> told_per_thread{false};
  std::atomic<std::uint64_t> writes_ran_out_at{~0ull};  // `launches` when a CPU write's wait last ran out
  // ---- page_mover ----
  void copy(std::uint64_t p, location from, location to) override {
    quiesce();
    mem.ensure_chunk(to, p);
    mem.copy_sync(from, to, mem.mirror(to, p), mem.mirror(from, p));
  }
  void populate(std::uint64_t p, location at) override {
    // A page allocated again may still be read by work queued before its free (torch frees a tensor
    // as soon as its last kernel is queued): its mapped copy is zeroed only after that work.
    if (range.mapped_at(p, at)) quiesce();
    mem.ensure_chunk(at, p);
    mem.zero_sync(at, mem.mirror(at, p));
  }
  void drop(std::uint64_t p, location at) noexcept override { mem.drop(p, at); }
  void map(std::uint64_t p, location at, bool writable) override {
    if (range.mapped(p)) {
      quiesce();
      range.unmap({p});  // the new copy exists; the old one is dropped after this
    }
    range.map(p, at, writable);
    range.grant_devices({p});
  }

  void unmap(std::uint64_t p) override {
    if (!range.mapped(p)) return;
    quiesce();  // work queued before the free may still use the page
    range.unmap({p});
  }

  std::uint64_t start(const std::vector<step>& steps) override {
    quiesce();
    return moves.start(steps);
  }
  void finish(std::uint64_t ticket) override { moves.finish(ticket); }

  // ---- return of taken pages ----
  // Launches on this thread that went ahead without the gate (a background return overran its deadline).
  static inline thread_local std::vector<const impl*> ungated;
  void before_launch() noexcept override {
    launches++;  // (a launch that goes ahead without the gate is one too)
    if (!gate.try_lock_shared_for(o.deadline)) {
      log::error("vm", "{}: a launch waited {} ms for a background return of pages; it goes ahead", dev.id(),
                 std::chrono::duration_cast<std::chrono::milliseconds>(o.deadline).count());
      ungated.push_back(this);
      range.take_cpu_writes(*table);
      return;
    }
    if (ahead_mu.try_lock_for(o.deadline)) ahead_mu.unlock();
    struct then_writes {  // after the return (or none): what stays on the host
      impl* s;
      ~then_writes() { s->range.take_cpu_writes(*s->table); }
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

  // ---- CPU faults (on the service thread) ----
  // Fault-ahead still to do: the pages after the last fault, [ahead_at, ahead_end), moved a batch at
  // a time while no other fault waits (the faulting thread already runs on).
  std::uint64_t ahead_at = 0, ahead_end = 0;
  // The window grows while the faults come in sequence (each one inside the last window): a
  // sequential reader or writer then faults once per window, the window doubling up to 8 times
  // fault_ahead; a fault elsewhere starts over.
  std::uint64_t ahead_window = 0, last_fault = ~0ull, ahead_epoch = 0;
  bool returning = false;  // the background return has more to do
  bool serve_fault(std::uintptr_t addr, bool write) noexcept override {
    const std::uint64_t pg = (addr - mem.shared.address()) / page;
    try {
      // Read before the fault is served: a launch while it is served stops the moves ahead too.
      const std::uint64_t launches_before = launches.load();
      const std::uint64_t waited_before = t.quiesce.load();
      timed tm{t.cpu_fault};
      table->fault_range(pg, pg + 1, host, write, o.batch, o.deadline, [&] { grant_cpu(pg); });
      tell_concurrent_use(addr, t.quiesce.load() - waited_before);
      cpu_faults++;
      const bool in_sequence = last_fault != ~0ull && pg > last_fault && pg <= ahead_end;
      ahead_window = in_sequence ? std::min(ahead_window * 2, o.fault_ahead * 8) : o.fault_ahead;
      last_fault = pg;
      ahead_epoch = launches_before;
      ahead_at = pg + 1;
      ahead_end = allocation_end(pg, ahead_window);
      cpu_heading = {ahead_at, ahead_end};
      cpu_heading_since = std::chrono::steady_clock::now();
      return true;
    } catch (const std::exception& e) {
      // The page's state too (its copies, where it is mapped, what the CPU may do there, its pins):
      // a failure here ends the process, and that is what tells its cause.
      try {
        const page_snapshot sn = table->snapshot(pg);
        log::error("vm", "{}: CPU fault at {:#x} (page {}, {}) failed: {} [page: valid {:#x}, mapped at {}, CPU access {}, pins {}]",
                   dev.id(), addr, pg, write ? "write" : "read", e.what(), sn.valid, sn.mapped,
                   static_cast<unsigned>(range.cpu_access(pg)), sn.pins);
      } catch (...) {
      }
      return false;
    }
  }
  // ---- prefetches the program does not wait for ----
  // A prefetch is a hint that CUDA runs in its stream's order without holding the caller. When the
  // attached streams' work does not end soon (prefetch_wait: a kernel that waits for the CPU to act
  // after the call, a long kernel), the call returns and the service thread moves the pages once
  // those streams are idle and no launch is under way; until then kernels reach the pages where they
  // are. Later prefetches join the waiting ones, so that the moves keep the order they were asked in.
  std::mutex deferred_mu;
  std::vector<deferred_prefetch> deferred;  // in the order asked
  std::atomic<bool> any_deferred{false};
  bool attached_streams_idle() {
    std::lock_guard l(streams_mu);
    for (auto* s : streams)
      if (!s->capturing() && !s->idle()) return false;
    return true;
  }
  void defer_prefetch(std::uint64_t first, std::uint64_t end, location at) {
    std::lock_guard l(deferred_mu);
    deferred.push_back({first, end, at});
    any_deferred = true;
    log::debug("vm", "{}: prefetch of pages {}..{}: the attached streams are busy; it is done when they are idle", dev.id(),
               first, end - 1);
  }
  // Pages freed meanwhile are not moved for an old hint.
  void drop_deferred(std::uint64_t first, std::uint64_t end) {
    std::lock_guard l(deferred_mu);
    std::erase_if(deferred, [&](const deferred_prefetch& d) { return d.first < end && first < d.end; });
    any_deferred = !deferred.empty();
  }
  void prefetch_deferred() noexcept {
    if (!any_deferred.load()) return;
    std::unique_lock g(gate, std::try_to_lock);  // (a launch under way holds it shared)
    if (!g) return;
    std::vector<deferred_prefetch> todo;
    try {
      if (!attached_streams_idle()) return;
      std::lock_guard l(deferred_mu);
      todo.swap(deferred);
      any_deferred = false;
    } catch (const std::exception& e) {
      log::debug("vm", "{}: a deferred prefetch waits: {}", dev.id(), e.what());
      return;
    }
    for (auto& d : todo) {
      try {
        table->prefetch_range(d.first, d.end, d.at, o.batch, o.deadline);
      } catch (const std::exception& e) {
        log::warn("vm", "{}: a deferred prefetch of pages {}..{} failed: {} (the pages stay where they are)", dev.id(), d.first,
                  d.end - 1, e.what());
      }
    }
  }

  void between_faults() noexcept override {
    prefetch_deferred();
    if (ahead_at >= ahead_end) {
      returning = return_in_background();
      return;
    }
    std::unique_lock l(ahead_mu);
    // A kernel launched since the fault, or one still running: no more moves to the host.
    if (launches.load() != ahead_epoch || !launched_work_done()) {
      ahead_at = ahead_end;
      return;
    }
    const std::uint64_t e = std::min(ahead_end, ahead_at + o.batch);
    try {
      table->move_ahead(ahead_at, e, host, o.batch);
    } catch (const std::exception& ex) {
      log::warn("vm", "{}: moving pages {}..{} ahead of a CPU fault failed: {}", dev.id(), ahead_at, e - 1, ex.what());
    }
    ahead_at = e;
  }
  bool work_waiting() noexcept override { return returning || ahead_at < ahead_end; }

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
    if (a < mem.shared.address() || bytes > mem.shared.size() || a - mem.shared.address() > mem.shared.size() - bytes)
      fail(errc::out_of_range, op, fmt::format("{}+{}", p, bytes), "not inside this address space");
    std::uint64_t first = (a - mem.shared.address()) / page;
    std::uint64_t last = (a - mem.shared.address() + std::max<std::uint64_t>(bytes, 1) - 1) / page;
    return {first, last + 1};
  }
};

std::optional<memory_region> unified_client::acquire(const void* p, std::uint64_t n) {
  auto a = reinterpret_cast<std::uintptr_t>(p);
  std::uintptr_t b = s_.mem.shared.address();
  std::uint64_t sz = s_.mem.shared.size();
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
  return s_.mem.shared.address() + k * s_.page - p;  // up to the first page mapped elsewhere
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
  return I.mem.shared.at(at * I.page);
}

void address_space::free(void* p) {
  auto& I = *impl_;
  auto [first, end] = I.pages_of(p, 1, "vm.free");
  std::uint64_t n;
  {
    std::lock_guard l(I.alloc_mu);
    auto it = I.used_ranges.find(first);
    if (it == I.used_ranges.end() || I.mem.shared.at(first * I.page) != p)
      fail(errc::invalid_argument, "vm.free", fmt::format("{}", p), "not an allocation of this address space");
    n = it->second;
    I.used_ranges.erase(it);
  }
  I.drop_deferred(first, first + n);
  // The bytes are dead: copies go without a write-back (device memory back to the pool), mappings
  // after the attached streams' earlier work; alloc makes the pages anew.
  for (std::uint64_t pg = first; pg < first + n; ++pg) I.table->discard(pg, deadline_after(I.o.deadline));
  I.mem.trim();
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
  if (a == advice::prefetch) {
    // (behind a prefetch that waits, in order)
    if (I.any_deferred.load() || !detail::poll_until(deadline_after(I.o.prefetch_wait), [&] { return I.attached_streams_idle(); }))
      return I.defer_prefetch(first, end, at);
    return I.table->prefetch_range(first, end, at, I.o.batch, I.o.deadline);
  }
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

void* address_space::base() const noexcept { return impl_->mem.shared.base(); }
std::uint64_t address_space::size() const noexcept { return impl_->mem.shared.size(); }
std::uint64_t address_space::page_bytes() const noexcept { return impl_->page; }
void address_space::attach_stream(stream& s) {
  if (std::find(impl_->devs.begin(), impl_->devs.end(), &s.owner()) == impl_->devs.end())
    fail(errc::invalid_argument, "vm.stream", s.owner().id(), "a stream of another device than the space's (" + impl_->device_list() + ")");
  // The per-thread default stream is every thread's own: the space, asking from its service thread,
  // knows of the program's threads' work there only through the launches it watches.
  if (s.is_view() && s.native_handle() == native_stream::per_thread() && !impl_->watching && !impl_->told_per_thread.exchange(true))
    log::warn("vm", "{}: the per-thread default stream is attached, but launches are not watched here; migrations do not wait "
              "for other threads' work on it (said once)", s.owner().id());
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
  // A cost of the process's start that shows in programs of under a second (docs/design/unified-memory.md, "Start-up").
  if (I.watching) r += fmt::format("  launch callbacks turned on in {:.3f} s when the space was made\n", sec(I.watch_ns));
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
  o.prefetch_wait = s.vm_prefetch_wait;
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
