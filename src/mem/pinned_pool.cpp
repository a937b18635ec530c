#include <ferry/core/error.hpp>
#include <ferry/mem/pinned_pool.hpp>

#include "core/logging.hpp"

#include <fmt/format.h>
#include <linux/mempolicy.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstring>

namespace ferry {

pinned_pool::buffer& pinned_pool::buffer::operator=(buffer&& o) noexcept {
  if (this != &o) {
    reset();
    pool_ = std::exchange(o.pool_, nullptr);
    data_ = o.data_;
    region_ = o.region_;
  }
  return *this;
}
std::size_t pinned_pool::buffer::size() const noexcept { return pool_ ? pool_->bytes_ : 0; }
void pinned_pool::buffer::reset() noexcept {
  if (pool_) pool_->put(data_, region_);
  pool_ = nullptr;
  data_ = nullptr;
  region_ = nullptr;
}

pinned_pool::pinned_pool(registration_cache& cache, std::size_t bytes, int count, int numa_node)
    : cache_(cache), bytes_(bytes), count_(count), numa_(numa_node) {
  if (bytes == 0 || count <= 0)
    fail(errc::invalid_argument, "mem.pool", fmt::format("pinned pool {}x{} numa {}", count, bytes, numa_node), "empty pool");
  // Segments of at most 64 MiB (and 8 buffers): a process that stages a little pins a little, and
  // growing costs one allocation and registration per segment, not per buffer.
  per_segment_ = static_cast<int>(std::clamp<std::size_t>((64ull << 20) / bytes, 1, 8));
  std::unique_lock l(mu_);
  grow(l);
}

namespace {
// Binds [p, p+n) to NUMA node `node` before its first touch: mbind(2) itself, where hwloc would
// first load the whole host topology (tens of milliseconds on a large host, paid by a process's
// first transfer) to make the same call.
bool bind_to_node(void* p, std::size_t n, int node) {
  constexpr std::size_t bits = 8 * sizeof(unsigned long);
  if (node < 0 || node >= 1024) return false;
  unsigned long mask[1024 / bits] = {};
  mask[static_cast<std::size_t>(node) / bits] = 1ul << (static_cast<std::size_t>(node) % bits);
  return ::syscall(SYS_mbind, p, n, MPOL_BIND, mask, 1024ul, 0u) == 0;
}
}  // namespace

bool pinned_pool::grow(std::unique_lock<std::mutex>& l) {
  if (allocated_ >= count_) return false;
  if (growing_) return true;  // another thread is making a segment: its buffers come to the waiters
  // Segments double from one buffer: the first transfer of a process waits for one buffer's
  // allocation and pinning, not a whole segment's; a busy pool soon grows in large steps. The pages
  // are made and pinned without the lock, so buffers keep coming back and going out meanwhile.
  int n = std::min({next_segment_, per_segment_, count_ - allocated_});
  next_segment_ = std::min(2 * next_segment_, per_segment_);
  growing_ = true;
  l.unlock();
  std::unique_ptr<segment> seg;
  try {
    seg = make_segment(n);
  } catch (...) {
    l.lock();
    growing_ = false;
    cv_.notify_all();
    throw;
  }
  l.lock();
  growing_ = false;
  const memory_region* r = &seg->reg.region();
  for (int i = n - 1; i >= 0; --i) free_.push_back({seg->base + static_cast<std::size_t>(i) * bytes_, r});
  allocated_ += n;
  handed_ = 0;
  segments_.push_back(std::move(seg));
  cv_.notify_all();
  return true;
}

std::unique_ptr<pinned_pool::segment> pinned_pool::make_segment(int n) const {
  std::string res = fmt::format("pinned pool {}x{} numa {}", count_, bytes_, numa_);
  auto seg = std::make_unique<segment>();
  seg->bytes = bytes_ * static_cast<std::size_t>(n);
  void* p = ::mmap(nullptr, seg->bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) fail_errno(errno, "mem.pool", res, "cannot map staging memory");
  seg->base = static_cast<std::byte*>(p);
  // Bind before first touch so the pages come from the GPU's NUMA node.
  if (numa_ >= 0 && !bind_to_node(p, seg->bytes, numa_))
    log::debug("mem", "{}: mbind failed ({}); using default placement", res, std::strerror(errno));
  // Huge pages where the kernel has them (a 2 MiB fault instead of 512), then every page now, not
  // during a transfer: in one call where the kernel can (5.14+), else by touching them.
  const auto t0 = std::chrono::steady_clock::now();
  ::madvise(p, seg->bytes, MADV_HUGEPAGE);
#ifdef MADV_POPULATE_WRITE
  if (::madvise(p, seg->bytes, MADV_POPULATE_WRITE) != 0) std::memset(p, 0, seg->bytes);
#else
  std::memset(p, 0, seg->bytes);
#endif
  const auto t1 = std::chrono::steady_clock::now();
  try {
    seg->reg = cache_.acquire(p, seg->bytes);  // held for the pool's life: never evicted
  } catch (...) {
    ::munmap(p, seg->bytes);
    throw;
  }
  log::debug("mem", "{}: +{} buffers ({} bytes): pages {} us, registration {} us", res, n, seg->bytes,
             std::chrono::duration_cast<std::chrono::microseconds>(t1 - t0).count(),
             std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t1).count());
  return seg;
}

pinned_pool::~pinned_pool() {
  std::lock_guard l(mu_);
  if (free_.size() != static_cast<std::size_t>(allocated_))
    log::error("mem", "pinned pool destroyed with {} buffers still in use", allocated_ - static_cast<int>(free_.size()));
  for (auto& s : segments_) {
    s->reg = registration{};
    ::munmap(s->base, s->bytes);
  }
}

int pinned_pool::allocated() const {
  std::lock_guard l(mu_);
  return allocated_;
}

pinned_pool::buffer pinned_pool::get(std::chrono::steady_clock::time_point until) {
  std::unique_lock l(mu_);
  while (free_.empty()) {
    if (!growing_ && allocated_ < count_) {
      grow(l);  // throws when no memory can be had
      continue;
    }
    // Another thread is growing the pool, or every buffer is out: one comes back (or the growth
    // fails, and this thread tries) before the deadline.
    if (!cv_.wait_until(l, until, [&] { return !free_.empty() || (!growing_ && allocated_ < count_); }))
      fail(errc::timeout, "mem.pool.get", fmt::format("pinned pool {}x{}", count_, bytes_),
           "no staging buffer became free before the deadline");
  }
  auto f = free_.back();
  free_.pop_back();
  ++handed_;
  return buffer(this, f.data, f.region);
}

pinned_pool::buffer pinned_pool::try_get(growth g) {
  std::unique_lock l(mu_);
  if (free_.empty()) {
    // The caller has buffers out that will come back. It makes a segment only once the pool has
    // gone round eight times since it last grew: making and pinning a buffer takes about as long
    // as one staged I/O, and the caller waits for it with its I/O in flight, so a short burst is
    // done sooner with the buffers there are; the pinned memory a process holds follows the load
    // it has carried, not its first burst.
    if (g == growth::when_used && handed_ < 8 * static_cast<std::uint64_t>(allocated_)) return {};
    try {
      if (growing_ || !grow(l) || free_.empty()) return {};
    } catch (const error& e) {
      log::debug("mem", "pinned pool {}x{} cannot grow ({}); no buffer now", count_, bytes_, e.what());
      return {};
    }
  }
  auto f = free_.back();
  free_.pop_back();
  ++handed_;
  return buffer(this, f.data, f.region);
}

void pinned_pool::put(std::byte* d, const memory_region* r) noexcept {
  {
    std::lock_guard l(mu_);
    free_.push_back({d, r});
  }
  cv_.notify_one();
}

}  // namespace ferry
