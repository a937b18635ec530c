// The memory behind a unified address space. See space_memory.hpp.
#include "vm/space_memory.hpp"

#include <ferry/core/error.hpp>

#include "core/logging.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

namespace ferry::vm {

std::uint64_t space_memory::page_for(const std::vector<device*>& devs, std::uint64_t wish) {
  const std::uint64_t gran = devs[0]->granularity();
  for (auto* d : devs)
    if (d->granularity() != gran)
      fail(errc::invalid_argument, "vm.space", d->id(), fmt::format("granularity {} differs from {}'s {}", d->granularity(), devs[0]->id(), gran));
  return std::max(gran, (wish + gran - 1) / gran * gran);
}

space_memory::space_memory(const std::vector<device*>& ds, std::uint64_t pg, std::uint64_t n, std::chrono::nanoseconds deadline,
                           space_clock& clock)
    : devs(ds), dev(*ds[0]), page(pg), npages(n), deadline_(deadline), t_(clock) {
  // Every device reaches every other's memory (a kernel on one reads pages living on another; a
  // device's engine copies between them): refused here, clearly, when the hardware cannot.
  for (auto* a : devs)
    for (auto* b : devs)
      if (a != b) a->enable_peer_access(*b);
  pad = dev.granularity();
  padded = dev.reserve(npages * page + 2 * pad);
  shared = {padded.address() + pad, npages * page};
  host_mirror = dev.reserve(npages * page + pad);
  for (std::size_t k = 0; k < devs.size(); ++k) {
    auto m = std::make_unique<devmem>();
    m->pool = dev.reserve(npages * page);
    m->slot_of.assign(npages, -1);
    m->slots.resize(npages);
    m->st = devs[k]->create_stream();
    dm.push_back(std::move(m));
  }
  hostc.resize(npages);
  zero_ = dev.allocate(pad, ferry::location::on_host());
  map_mirror(host_mirror.at(npages * page), zero_, true);
  std::memset(host_mirror.at(npages * page), 0, pad);
  pad_before_ = dev.allocate(pad, ferry::location::on_host());
  pad_after_ = dev.allocate(pad, ferry::location::on_host());
  map_mirror(padded.at(0), pad_before_, true);
  map_mirror(padded.at(pad + npages * page), pad_after_, true);
}

space_memory::~space_memory() {
  for (auto& m : dm) {
    try {
      m->st->synchronize(deadline_after(deadline_));
    } catch (const std::exception& e) {
      log::error("vm", "{}: unified address space destroyed with failed copies: {}", m->st->owner().id(), e.what());
    }
  }
  padded.reset();
  host_mirror.reset();
  for (auto& m : dm) m->pool.reset();
}

std::vector<access_desc> space_memory::device_grants() const {
  std::vector<access_desc> g;
  for (auto* d : devs) g.push_back({ferry::location::on_device(d->info().ordinal), access::read_write});
  return g;
}

void space_memory::map_mirror(void* va, const physical_chunk& c, bool host_chunk) {
  dev.map(va, c);
  auto g = device_grants();
  if (host_chunk) g.push_back({ferry::location::on_host(), access::read_write});
  dev.set_access(va, c.size(), g);
}

void space_memory::ensure_chunk(location at, std::uint64_t p) {
  if (at == host) {
    if (hostc[p]) return;
    timed tm{t_.allocate};
    auto c = dev.allocate(page, ferry::location::on_host());
    map_mirror(host_mirror.at(p * page), c, true);
    hostc[p] = std::move(c);
    return;
  }
  devmem& m = on(at);
  if (m.slot_of[p] >= 0) return;
  std::lock_guard l(slot_mu_);
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
    timed tm{t_.allocate};
    // The home device makes the chunk, in the memory of the device it is for.
    auto c = dev.allocate(page, ferry::location::on_device(devs[at - 1]->info().ordinal));
    map_mirror(m.pool.at(static_cast<std::uint64_t>(i) * page), c, false);
    m.slots[i] = std::move(c);
    if (!m.holes.empty()) m.holes.pop_back();
    else ++m.made;
  }
  m.slot_of[p] = i;
}

void space_memory::drop(std::uint64_t p, location at) noexcept {
  if (at == host) return;  // host chunks stay with their page
  devmem& m = on(at);
  if (m.slot_of[p] < 0) return;
  std::lock_guard l(slot_mu_);
  m.idle.push_back(static_cast<std::uint32_t>(m.slot_of[p]));
  m.slot_of[p] = -1;
}

void space_memory::trim() {
  std::lock_guard l(slot_mu_);
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

void space_memory::zero_sync(location at, std::byte* dst) {
  // Copies, as the page moves' (a memset could be run by the driver as a kernel, which would wait
  // behind a user's kernel that holds every SM -- one that spins until the CPU acts -- and a page is
  // made fresh for the CPU's allocations while such a kernel may run).
  const std::byte* zeros = host_mirror.at(npages * page);
  devmem& m = engine(host, at);
  std::lock_guard l(m.st_mu);
  for (std::uint64_t off = 0; off < page; off += pad) m.st->copy(dst + off, zeros, pad);
  timed tm{t_.copy_wait};
  m.st->synchronize(deadline_after(deadline_));
}

void space_memory::copy_sync(location from, location to, std::byte* dst, const std::byte* src) {
  devmem& m = engine(from, to);
  std::lock_guard l(m.st_mu);
  m.st->copy(dst, src, page);
  timed tm{t_.copy_wait};
  m.st->synchronize(deadline_after(deadline_));
}

}  // namespace ferry::vm
