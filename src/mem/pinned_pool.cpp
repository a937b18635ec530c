#include <ferry/core/error.hpp>
#include <ferry/mem/pinned_pool.hpp>

#include "core/logging.hpp"

#include <fmt/format.h>
#include <hwloc.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstring>

namespace ferry {

pinned_pool::buffer& pinned_pool::buffer::operator=(buffer&& o) noexcept {
  if (this != &o) {
    reset();
    pool_ = std::exchange(o.pool_, nullptr);
    data_ = o.data_;
  }
  return *this;
}
std::size_t pinned_pool::buffer::size() const noexcept { return pool_ ? pool_->bytes_ : 0; }
void pinned_pool::buffer::reset() noexcept {
  if (pool_) pool_->put(data_);
  pool_ = nullptr;
  data_ = nullptr;
}

pinned_pool::pinned_pool(registration_cache& cache, std::size_t bytes, int count, int numa_node)
    : bytes_(bytes), count_(count), numa_(numa_node) {
  std::string res = fmt::format("pinned pool {}x{} numa {}", count, bytes, numa_node);
  if (bytes == 0 || count <= 0) fail(errc::invalid_argument, "mem.pool", res, "empty pool");
  mapped_ = bytes * static_cast<std::size_t>(count);
  void* p = ::mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) fail_errno(errno, "mem.pool", res, "cannot map staging memory");
  base_ = static_cast<std::byte*>(p);
  if (numa_node >= 0) {
    // Bind before first touch so the pages come from the GPU's NUMA node.
    hwloc_topology_t topo;
    if (hwloc_topology_init(&topo) == 0 && hwloc_topology_load(topo) == 0) {
      hwloc_obj_t node = hwloc_get_numanode_obj_by_os_index(topo, static_cast<unsigned>(numa_node));
      if (node && hwloc_set_area_membind(topo, p, mapped_, node->nodeset, HWLOC_MEMBIND_BIND,
                                         HWLOC_MEMBIND_BYNODESET) != 0)
        log::debug("mem", "{}: membind failed ({}); using default placement", res, std::strerror(errno));
      hwloc_topology_destroy(topo);
    }
  }
  std::memset(p, 0, mapped_);  // fault the pages in now, not during a transfer
  try {
    reg_ = cache.acquire(p, mapped_);  // held for the pool's life: never evicted
  } catch (...) {
    ::munmap(p, mapped_);
    throw;
  }
  for (int i = count - 1; i >= 0; --i) free_.push_back(base_ + static_cast<std::size_t>(i) * bytes);
}

pinned_pool::~pinned_pool() {
  {
    std::lock_guard l(mu_);
    if (free_.size() != static_cast<std::size_t>(count_))
      log::error("mem", "pinned pool destroyed with {} buffers still in use", count_ - static_cast<int>(free_.size()));
  }
  reg_ = registration{};
  ::munmap(base_, mapped_);
}

pinned_pool::buffer pinned_pool::get(std::chrono::steady_clock::time_point until) {
  std::unique_lock l(mu_);
  if (!cv_.wait_until(l, until, [&] { return !free_.empty(); }))
    fail(errc::timeout, "mem.pool.get", fmt::format("pinned pool {}x{}", count_, bytes_),
         "no staging buffer became free before the deadline");
  std::byte* d = free_.back();
  free_.pop_back();
  return buffer(this, d);
}

pinned_pool::buffer pinned_pool::try_get() {
  std::lock_guard l(mu_);
  if (free_.empty()) return {};
  std::byte* d = free_.back();
  free_.pop_back();
  return buffer(this, d);
}

void pinned_pool::put(std::byte* d) noexcept {
  {
    std::lock_guard l(mu_);
    free_.push_back(d);
  }
  cv_.notify_one();
}

}  // namespace ferry
