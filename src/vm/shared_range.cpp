// A unified address space's shared range. See shared_range.hpp.
#include "vm/shared_range.hpp"

#include "core/logging.hpp"

#include <algorithm>

namespace ferry::vm {

shared_range::shared_range(space_memory& mem, space_clock& t)
    : mem_(mem),
      t_(t),
      mapped_(mem.npages, 0),
      at_(mem.npages, -1),
      host_w_(mem.npages, 0),
      cpu_(new std::atomic<std::uint8_t>[mem.npages]),
      write_taken_(mem.npages, 0) {
  for (std::uint64_t i = 0; i < mem.npages; ++i) cpu_[i] = 0;
}

template <typename F>
void shared_range::runs(std::vector<std::uint64_t>& pages, F&& f) {
  std::sort(pages.begin(), pages.end());
  for (std::size_t i = 0; i < pages.size();) {
    std::size_t j = i + 1;
    while (j < pages.size() && pages[j] == pages[j - 1] + 1) ++j;
    f(pages[i], static_cast<std::uint64_t>(j - i));
    i = j;
  }
}

void shared_range::map(std::uint64_t p, location at, bool writable) {
  timed tm{t_.map};
  mem_.dev.map(mem_.shared.at(p * mem_.page), mem_.chunk(at, p));
  mapped_[p] = 1;
  at_[p] = at;
  host_w_[p] = at == host && writable;
  cpu_[p] = 0;
  write_taken_[p] = 0;
}

void shared_range::unmap(std::vector<std::uint64_t> pages) {
  timed tm{t_.unmap};
  runs(pages, [&](std::uint64_t first, std::uint64_t n) {
    mem_.dev.unmap(mem_.shared.at(first * mem_.page), n * mem_.page);
    for (std::uint64_t p = first; p < first + n; ++p) {
      mapped_[p] = 0;
      at_[p] = -1;
      cpu_[p] = 0;
      write_taken_[p] = 0;
    }
  });
}

void shared_range::grant_devices(std::vector<std::uint64_t> pages) {
  timed tm{t_.access};
  auto g = mem_.device_grants();
  runs(pages, [&](std::uint64_t first, std::uint64_t n) { mem_.dev.set_access(mem_.shared.at(first * mem_.page), n * mem_.page, g); });
}

void shared_range::grant_cpu(std::vector<std::uint64_t>& pages) {
  timed tm{t_.access};
  for (bool w : {false, true}) {
    std::vector<std::uint64_t> these;
    for (auto p : pages)
      if (static_cast<bool>(host_w_[p]) == w) these.push_back(p);
    auto g = mem_.device_grants();
    g.push_back({ferry::location::on_host(), w ? access::read_write : access::read});
    runs(these, [&](std::uint64_t first, std::uint64_t n) {
      mem_.dev.set_access(mem_.shared.at(first * mem_.page), n * mem_.page, g);
      for (std::uint64_t p = first; p < first + n; ++p) cpu_[p] = w ? 3 : 1;
    });
    if (w && !these.empty() && remember_.load()) {  // (emptied by launches: only while they are watched)
      std::lock_guard l(writable_mu_);
      cpu_writable_.insert(cpu_writable_.end(), these.begin(), these.end());
    }
  }
}

void shared_range::take_cpu_writes(page_table& table) noexcept {
  std::vector<std::uint64_t> pages;
  {
    std::lock_guard l(writable_mu_);
    pages.swap(cpu_writable_);
  }
  if (pages.empty()) return;
  std::sort(pages.begin(), pages.end());
  pages.erase(std::unique(pages.begin(), pages.end()), pages.end());
  std::vector<access_desc> g;
  try {
    g = mem_.device_grants();
    g.push_back({ferry::location::on_host(), access::read});
  } catch (const std::exception& e) {
    log::warn("vm", "{}: taking the CPU's write access for a launch failed: {}", mem_.dev.id(), e.what());
    return;
  }
  for (auto p : pages) {
    try {
      table.locked(p, [&] {
        if (!mapped_at(p, host) || cpu_[p].load() != 3) return;
        timed tm{t_.access};
        mem_.dev.set_access(mem_.shared.at(p * mem_.page), mem_.page, g);
        cpu_[p] = 1;
        write_taken_[p] = 1;
      });
    } catch (const std::exception& e) {
      // The page stays writable: a CPU write may then run beside the kernel, as before this step.
      log::warn("vm", "{}: taking the CPU's write access to page {} for a launch failed: {}", mem_.dev.id(), p, e.what());
    }
  }
}

}  // namespace ferry::vm
