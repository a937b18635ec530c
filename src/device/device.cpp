#include <ferry/device/device.hpp>

#include "device/poll.hpp"

#include "core/logging.hpp"

#include <fmt/format.h>

#include <algorithm>

#include <thread>

namespace ferry {

namespace {
std::string access_name(access a) {
  switch (a) {
    case access::none: return "none";
    case access::read: return "r";
    case access::read_write: return "rw";
  }
  return "?";
}
bool aligned(std::uint64_t v, std::uint64_t a) { return a && v % a == 0; }
}  // namespace

// ---- physical_chunk / va_range ---------------------------------------------------------------

physical_chunk& physical_chunk::operator=(physical_chunk&& o) noexcept {
  if (this != &o) {
    reset();
    owner_ = std::exchange(o.owner_, nullptr);
    handle_ = std::exchange(o.handle_, 0);
    size_ = std::exchange(o.size_, 0);
    where_ = o.where_;
  }
  return *this;
}

void physical_chunk::reset() noexcept {
  if (owner_) owner_->release_chunk(*this);
  owner_ = nullptr;
  handle_ = size_ = 0;
}

va_range& va_range::operator=(va_range&& o) noexcept {
  if (this != &o) {
    reset();
    owner_ = std::exchange(o.owner_, nullptr);
    base_ = std::exchange(o.base_, 0);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

void va_range::reset() noexcept {
  if (owner_) owner_->release_range(*this);
  owner_ = nullptr;
  base_ = size_ = 0;
}

// ---- event / stream --------------------------------------------------------------------------

event::~event() = default;

void event::wait(deadline until) {
  if (!detail::poll_until(until, [&] { return do_query(); }))
    fail(errc::timeout, "event.wait", do_describe(), "deadline expired before the work completed");
}

stream::~stream() = default;

stream::stream(device& owner, bool view)
    : owner_(&owner), view_(view), c_copies_(&owner.counters().get("copies")), c_copy_bytes_(&owner.counters().get("copy_bytes")),
      c_copy_batches_(&owner.counters().get("copy_batches")) {}

void stream::copy(void* dst, const void* src, std::size_t bytes, copy_engine by) {
  if (bytes == 0) return;
  if (!dst || !src)
    fail(errc::invalid_argument, "stream.copy", fmt::format("{} dst={} src={}", owner_->id(), dst, src),
         "null pointer");
  if (reinterpret_cast<std::uintptr_t>(dst) + bytes < reinterpret_cast<std::uintptr_t>(dst) ||
      reinterpret_cast<std::uintptr_t>(src) + bytes < reinterpret_cast<std::uintptr_t>(src))
    fail(errc::out_of_range, "stream.copy", fmt::format("{} bytes={}", owner_->id(), bytes),
         "length overflows the address space");
  c_copies_->add();
  c_copy_bytes_->add(bytes);
  if (by == copy_engine::sm) owner_->counters().get("sm_copies").add();
  // One DMA per mapped chunk on either side (a plain device allocation is one mapping: one copy).
  auto* d = static_cast<std::byte*>(dst);
  auto* s = static_cast<const std::byte*>(src);
  std::size_t done = 0;
  while (done < bytes) {
    std::size_t n = bytes - done;
    std::uint64_t rd = owner_->mapping_rest(d + done), rs = owner_->mapping_rest(s + done);
    if (rd) n = static_cast<std::size_t>(std::min<std::uint64_t>(n, rd));
    if (rs) n = static_cast<std::size_t>(std::min<std::uint64_t>(n, rs));
    // A kernel cannot reach ordinary (pageable) host memory, and a bad address there is fatal to the
    // device context, so SM copies take only memory mapped in this device's ranges.
    if (by == copy_engine::sm && (!rd || !rs))
      fail(errc::invalid_argument, "stream.copy",
           fmt::format("{} dst={} src={}", owner_->id(), describe_range(dst, bytes), describe_range(src, bytes)),
           fmt::format("a copy by SMs needs both ends mapped in {}'s ranges ({} is not)", owner_->id(), rd ? "src" : "dst"));
    if (by == copy_engine::sm) do_copy_sm(d + done, s + done, n);
    else do_copy(d + done, s + done, n);
    done += n;
  }
}

void stream::copy_batch(std::span<const copy_desc> copies) {
  std::vector<copy_desc> pieces;
  pieces.reserve(copies.size());
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < copies.size(); ++i) {
    auto [dst, src, bytes] = copies[i];
    if (bytes == 0) continue;
    if (!dst || !src)
      fail(errc::invalid_argument, "stream.copy_batch", fmt::format("{} copy {} dst={} src={}", owner_->id(), i, dst, src), "null pointer");
    if (reinterpret_cast<std::uintptr_t>(dst) + bytes < reinterpret_cast<std::uintptr_t>(dst) ||
        reinterpret_cast<std::uintptr_t>(src) + bytes < reinterpret_cast<std::uintptr_t>(src))
      fail(errc::out_of_range, "stream.copy_batch", fmt::format("{} copy {} bytes={}", owner_->id(), i, bytes),
           "length overflows the address space");
    // One DMA per mapped chunk on either side, as copy().
    auto* d = static_cast<std::byte*>(dst);
    auto* s = static_cast<const std::byte*>(src);
    for (std::size_t done = 0; done < bytes;) {
      std::size_t n = bytes - done;
      if (std::uint64_t rd = owner_->mapping_rest(d + done)) n = static_cast<std::size_t>(std::min<std::uint64_t>(n, rd));
      if (std::uint64_t rs = owner_->mapping_rest(s + done)) n = static_cast<std::size_t>(std::min<std::uint64_t>(n, rs));
      pieces.push_back({d + done, s + done, n});
      done += n;
    }
    total += bytes;
  }
  if (pieces.empty()) return;
  do_copy_batch(pieces);
  c_copies_->add(copies.size());
  c_copy_bytes_->add(total);
  c_copy_batches_->add();
}

void stream::fill_pattern(void* dst, std::size_t bytes, std::uint64_t seed) {
  if (bytes == 0) return;
  if (!dst || reinterpret_cast<std::uintptr_t>(dst) % 8)
    fail(errc::invalid_argument, "stream.fill_pattern", fmt::format("{} {}", owner_->id(), describe_range(dst, bytes)),
         "destination must be non-null and 8-byte aligned");
  do_fill_pattern(dst, bytes, seed);
}

void stream::checksum(const void* src, std::size_t bytes, std::uint64_t* result) {
  if (!result)
    fail(errc::invalid_argument, "stream.checksum", owner_->id(), "result pointer is null");
  if (bytes != 0 && (!src || reinterpret_cast<std::uintptr_t>(src) % 8))
    fail(errc::invalid_argument, "stream.checksum", fmt::format("{} {}", owner_->id(), describe_range(src, bytes)),
         "source must be non-null and 8-byte aligned");
  do_checksum(src, bytes, result);
}

void stream::write_value(std::uint32_t* addr, std::uint32_t value) {
  if (!addr || reinterpret_cast<std::uintptr_t>(addr) % alignof(std::uint32_t))
    fail(errc::invalid_argument, "stream.write_value", describe_range(addr, 4), "needs a 4-byte aligned word");
  do_write_value(addr, value);
}
void stream::wait_value(const std::uint32_t* addr, std::uint32_t value) {
  if (!addr || reinterpret_cast<std::uintptr_t>(addr) % alignof(std::uint32_t))
    fail(errc::invalid_argument, "stream.wait_value", describe_range(addr, 4), "needs a 4-byte aligned word");
  do_wait_value(addr, value);
}
std::unique_ptr<event> stream::record() { return do_record(); }
void stream::wait(event& e) { do_wait(e); }
bool stream::idle() { return do_idle(); }
void stream::synchronize(deadline until) { do_synchronize(until); }
void stream::synchronize() { do_synchronize(deadline_after(owner_->default_timeout())); }

// ---- device ----------------------------------------------------------------------------------

device::device(device_info info, std::chrono::nanoseconds default_timeout)
    : info_(std::move(info)),
      default_timeout_(default_timeout),
      c_alloc_(stats_.get("chunks_allocated")),
      c_alloc_bytes_(stats_.get("chunk_bytes_allocated")),
      c_free_(stats_.get("chunks_freed")),
      c_map_(stats_.get("maps")),
      c_unmap_(stats_.get("unmaps")) {}

device::~device() {
  // Ranges and chunks must not outlive their device; anything left is a leak in the caller.
  if (!mappings_.empty() || !ranges_.empty() || !chunks_.empty())
    log::warn("device", "{} destroyed with {} mappings, {} ranges, {} chunks still alive", id(), mappings_.size(),
              ranges_.size(), chunks_.size());
}

std::uint64_t device::granularity(location where) { return do_granularity(where); }

physical_chunk device::allocate(std::uint64_t bytes, location where) {
  std::uint64_t g = do_granularity(where);
  if (bytes == 0 || !aligned(bytes, g))
    fail(errc::invalid_argument, "device.allocate", fmt::format("{} bytes={}", id(), bytes),
         fmt::format("size must be a positive multiple of the granularity {}", g));
  if (where.kind == memory_kind::device && (where.id < -1 || where.id >= 64))
    fail(errc::out_of_range, "device.allocate", fmt::format("{} bytes={}", id(), bytes),
         fmt::format("device ordinal {} out of range", where.id));
  physical_chunk c;
  c.handle_ = do_allocate(bytes, where);
  c.owner_ = this;
  c.size_ = bytes;
  c.where_ = where;
  {
    std::lock_guard lock(mu_);
    chunks_[c.handle_] = chunk_state{bytes, where, 0, false};
  }
  c_alloc_.add();
  c_alloc_bytes_.add(bytes);
  return c;
}

void device::release_chunk(physical_chunk& c) noexcept {
  std::lock_guard lock(mu_);
  auto it = chunks_.find(c.handle_);
  if (it == chunks_.end()) return;
  if (it->second.mappings > 0) {
    it->second.released = true;  // freed by the last unmap
    return;
  }
  do_free(c.handle_, it->second.size, it->second.where);
  chunks_.erase(it);
  c_free_.add();
}

va_range device::reserve(std::uint64_t bytes) {
  std::uint64_t g = do_granularity(location::on_device());
  if (bytes == 0 || !aligned(bytes, g))
    fail(errc::invalid_argument, "device.reserve", fmt::format("{} bytes={}", id(), bytes),
         fmt::format("size must be a positive multiple of the granularity {}", g));
  va_range r;
  r.base_ = do_reserve(bytes, g);
  r.owner_ = this;
  r.size_ = bytes;
  std::lock_guard lock(mu_);
  ranges_[r.base_] = range_rec{bytes, ++next_range_serial_};
  return r;
}

void device::release_range(va_range& r) noexcept {
  std::lock_guard lock(mu_);
  auto it = ranges_.find(r.base_);
  if (it == ranges_.end()) return;
  // Unmap whatever the caller left mapped, so the range can be returned.
  for (auto m = mappings_.lower_bound(r.base_); m != mappings_.end() && m->first < r.base_ + r.size_;) {
    auto next = std::next(m);
    try {
      unmap_locked(m->first, m->second.size);
    } catch (...) {
    }
    m = next;
  }
  do_release(r.base_, r.size_);
  ranges_.erase(it);
}

const device::mapping* device::find_mapping(std::uintptr_t p, std::uintptr_t* base) const {
  auto it = mappings_.upper_bound(p);
  if (it == mappings_.begin()) return nullptr;
  --it;
  if (p >= it->first + it->second.size) return nullptr;
  if (base) *base = it->first;
  return &it->second;
}

std::uint64_t device::mapping_rest(const void* p) const {
  auto a = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard lock(mu_);
  std::uintptr_t base = 0;
  const mapping* m = find_mapping(a, &base);
  return m ? base + m->size - a : 0;
}

bool device::owns(const void* p, std::size_t bytes) const {
  auto a = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard lock(mu_);
  auto it = ranges_.upper_bound(a);
  if (it == ranges_.begin()) return false;
  --it;
  return a >= it->first && a + bytes <= it->first + it->second.size;
}

std::optional<device::range_info> device::range_containing(const void* p) const {
  auto a = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard lock(mu_);
  auto it = ranges_.upper_bound(a);
  if (it == ranges_.begin()) return std::nullopt;
  --it;
  if (a >= it->first + it->second.size) return std::nullopt;
  return range_info{it->first, it->second.size, it->second.serial};
}

launch_observer::~launch_observer() = default;

namespace {
// Launches under way on this thread: a launch made inside an observer's call, or a driver launch
// inside a runtime one, counts once.
thread_local int t_launch_depth = 0;
}  // namespace

bool device::watch_launches(launch_observer& o, std::string& why) {
  if (!do_watch_launches(why)) return false;
  std::unique_lock l(launch_mu_);
  if (std::find(launch_obs_.begin(), launch_obs_.end(), &o) == launch_obs_.end()) launch_obs_.push_back(&o);
  watchers_.store(launch_obs_.size(), std::memory_order_relaxed);
  return true;
}

void device::unwatch_launches(launch_observer& o) noexcept {
  std::unique_lock l(launch_mu_);
  std::erase(launch_obs_, &o);
  watchers_.store(launch_obs_.size(), std::memory_order_relaxed);
}

void device::launching() noexcept {
  if (t_launch_depth++ > 0) return;
  launch_mu_.lock_shared();
  for (auto* o : launch_obs_) o->before_launch();
}

void device::launched() noexcept {
  if (t_launch_depth == 0 || --t_launch_depth > 0) return;
  for (auto* o : launch_obs_) o->after_launch();
  launch_mu_.unlock_shared();
}

void device::enable_peer_access(device& peer) {
  if (&peer == this) return;
  if (peer.info().backend != info_.backend)
    fail(errc::not_supported, "device.enable_peer_access", id() + " -> " + peer.id(), "devices of different backends");
  do_enable_peer_access(peer);
}

std::string device::describe_address(const void* p) const {
  auto a = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard lock(mu_);
  std::uintptr_t base = 0;
  if (const mapping* m = find_mapping(a, &base))
    return fmt::format("mapped at {} ({} chunk, device {}, host {})", describe_range(base, m->size),
                       m->where.kind == memory_kind::device ? "device" : "host", access_name(m->device_access),
                       access_name(m->host_access));
  auto it = ranges_.upper_bound(a);
  if (it != ranges_.begin() && a < std::prev(it)->first + std::prev(it)->second.size)
    return fmt::format("reserved but not mapped (range {})",
                       describe_range(std::prev(it)->first, std::prev(it)->second.size));
  return "not in any range of " + id();
}

void device::check_access(const void* p, std::size_t bytes, bool write, int engine_ordinal, std::string_view op,
                          std::string_view side) const {
  auto a = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard lock(mu_);
  auto r = ranges_.upper_bound(a + bytes - 1);
  // Only ranges overlapping [a, a+bytes) matter; find the first one.
  if (r == ranges_.begin()) return;
  auto first = ranges_.upper_bound(a);
  if (first != ranges_.begin() && std::prev(first)->first + std::prev(first)->second.size > a) --first;
  for (auto it = first; it != r; ++it) {
    std::uintptr_t lo = std::max(a, it->first), hi = std::min(a + bytes, it->first + it->second.size);
    for (std::uintptr_t cur = lo; cur < hi;) {
      std::uintptr_t base = 0;
      const mapping* m = find_mapping(cur, &base);
      auto res = [&] { return fmt::format("{} {}={}", id(), side, describe_range(p, bytes)); };  // on failure only
      if (!m)
        fail(errc::bad_address, std::string(op), res(), fmt::format("{:#x} is reserved on {} but not mapped", cur, id()));
      bool self = engine_ordinal == info_.ordinal;
      auto bit = engine_ordinal >= 0 && engine_ordinal < 64 ? std::uint64_t{1} << engine_ordinal : 0;
      bool ok = self ? (write ? m->device_access == access::read_write : m->device_access != access::none)
                     : (write ? (m->peer_write & bit) != 0 : (m->peer_read & bit) != 0);
      if (!ok)
        fail(errc::bad_address, std::string(op), res(),
             fmt::format("{:#x} is mapped on {} without {} access for {}:{}", cur, id(), write ? "write" : "read",
                         to_string(info_.backend), engine_ordinal));
      cur = base + m->size;
    }
  }
}

void device::map(void* va, const physical_chunk& chunk) {
  auto a = reinterpret_cast<std::uintptr_t>(va);
  std::string res = fmt::format("{} va={}", id(), describe_range(va, chunk.size()));
  if (!chunk) fail(errc::invalid_argument, "device.map", res, "empty chunk");
  if (chunk.owner() != this)
    fail(errc::invalid_argument, "device.map", res,
         fmt::format("chunk belongs to {}", chunk.owner()->id()));
  std::uint64_t g = do_granularity(location::on_device());
  if (!aligned(a, g))
    fail(errc::invalid_argument, "device.map", res, fmt::format("address not aligned to the granularity {}", g));
  std::lock_guard lock(mu_);
  auto r = ranges_.upper_bound(a);
  if (r == ranges_.begin() || a + chunk.size() > std::prev(r)->first + std::prev(r)->second.size ||
      a < std::prev(r)->first)
    fail(errc::bad_address, "device.map", res, "not inside a range reserved on this device");
  auto next = mappings_.lower_bound(a);
  if ((next != mappings_.end() && next->first < a + chunk.size()) || find_mapping(a))
    fail(errc::busy, "device.map", res, "overlaps an existing mapping");
  do_map(a, chunk.size(), chunk.handle(), chunk.where());
  mappings_[a] = mapping{chunk.size(), chunk.handle(), chunk.where()};
  chunks_[chunk.handle()].mappings++;
  c_map_.add();
}

void device::unmap_locked(std::uintptr_t a, std::uint64_t bytes) {
  std::string res = fmt::format("{} va={}", id(), describe_range(a, bytes));
  // The range must be exactly a run of whole mappings.
  std::uintptr_t p = a;
  while (p < a + bytes) {
    auto it = mappings_.find(p);
    if (it == mappings_.end())
      fail(errc::bad_address, "device.unmap", res,
           fmt::format("no mapping starts at {:#x} (ranges must cover whole mappings)", p));
    p += it->second.size;
  }
  if (p != a + bytes)
    fail(errc::invalid_argument, "device.unmap", res, "range ends inside a mapping");
  // Several mappings in one backend call where it can (CUDA: one cuMemUnmap for a run of chunks).
  bool whole = bytes > mappings_.find(a)->second.size && do_unmap_run(a, bytes);
  for (p = a; p < a + bytes;) {
    auto it = mappings_.find(p);
    std::uint64_t sz = it->second.size, h = it->second.chunk;
    if (!whole) do_unmap(p, sz);
    mappings_.erase(it);
    c_unmap_.add();
    auto c = chunks_.find(h);
    if (c != chunks_.end() && --c->second.mappings == 0 && c->second.released) {
      do_free(h, c->second.size, c->second.where);
      chunks_.erase(c);
      c_free_.add();
    }
    p += sz;
  }
}

void device::unmap(void* va, std::uint64_t bytes) {
  if (bytes == 0) fail(errc::invalid_argument, "device.unmap", id(), "zero length");
  std::lock_guard lock(mu_);
  unmap_locked(reinterpret_cast<std::uintptr_t>(va), bytes);
}

void device::set_access(void* va, std::uint64_t bytes, std::span<const access_desc> grants) {
  auto a = reinterpret_cast<std::uintptr_t>(va);
  std::string res = fmt::format("{} va={}", id(), describe_range(va, bytes));
  if (bytes == 0) fail(errc::invalid_argument, "device.set_access", res, "zero length");
  std::lock_guard lock(mu_);
  // Validate everything before changing anything.
  for (auto& g : grants)
    if (g.who.kind == memory_kind::device && (g.who.id < -1 || g.who.id >= 64))
      fail(errc::out_of_range, "device.set_access", res, fmt::format("device ordinal {} out of range", g.who.id));
  for (std::uintptr_t p = a; p < a + bytes;) {
    auto it = mappings_.find(p);
    if (it == mappings_.end())
      fail(errc::bad_address, "device.set_access", res, fmt::format("{:#x} is not the start of a mapping", p));
    for (auto& g : grants)
      if (g.who.kind == memory_kind::host && g.flags != access::none && it->second.where.kind == memory_kind::device)
        fail(errc::not_supported, "device.set_access", res,
             "the CPU cannot be granted access to device memory; map a host chunk instead");
    p += it->second.size;
    if (p > a + bytes) fail(errc::invalid_argument, "device.set_access", res, "range ends inside a mapping");
  }
  // One backend call per run of adjacent mappings of the same memory, then each mapping's record.
  for (auto first = mappings_.find(a); first != mappings_.end() && first->first < a + bytes;) {
    auto last = std::next(first);
    std::uintptr_t e = first->first + first->second.size;
    for (; last != mappings_.end() && last->first == e && e < a + bytes && last->second.where.kind == first->second.where.kind &&
           last->second.where.id == first->second.where.id;
         ++last)
      e += last->second.size;
    do_set_access(first->first, e - first->first, first->second, grants);
    for (; first != last; ++first) {
      auto& m = first->second;
      for (auto& g : grants) {
        if (g.who.kind == memory_kind::host) m.host_access = g.flags;
        else if (g.who.id == -1 || g.who.id == info_.ordinal) m.device_access = g.flags;
        else if (g.who.id >= 0 && g.who.id < 64) {
          auto bit = std::uint64_t{1} << g.who.id;
          m.peer_read = g.flags != access::none ? (m.peer_read | bit) : (m.peer_read & ~bit);
          m.peer_write = g.flags == access::read_write ? (m.peer_write | bit) : (m.peer_write & ~bit);
        }
      }
    }
  }
}

std::unique_ptr<stream> device::create_stream() { return do_create_stream(); }
std::unique_ptr<stream> device::wrap_stream(native_stream s) { return do_wrap_stream(s); }

}  // namespace ferry
