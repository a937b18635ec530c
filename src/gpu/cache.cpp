// The host side of the GPU page cache (see include/ferry/gpu/cache.hpp).
#include <ferry/core/error.hpp>
#include <ferry/gpu/cache.hpp>
#include <ferry/io/file_engine.hpp>
#include <ferry/mem/registration.hpp>
#include <ferry/xfer/engine.hpp>

#include "core/logging.hpp"
#include "gpu/region.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

namespace ferry::gpu {

cache_options cache_options::from(const gpu_settings& s) {
  cache_options o;
  o.bytes = s.gpu_cache_bytes;
  o.page_bytes = s.gpu_cache_page;
  o.landing_bytes = s.gpu_cache_landing;
  o.wait = 2 * s.deadline;
  o.requests = proxy_options::from(s);
  return o;
}

namespace {

std::string_view name(status s) {
  switch (s) {
    case status::pending: return "pending";
    case status::ok: return "ok";
    case status::failed: return "failed";
    case status::out_of_range: return "out of range";
    case status::timed_out: return "timed out";
  }
  return "unknown";
}

constexpr std::uint64_t align64(std::uint64_t n) { return (n + 63) / 64 * 64; }

}  // namespace

struct cache::impl {
  struct mapped {
    std::shared_ptr<file> f;
    array_desc d;
    region entries;
  };

  file_engine& files;
  device& dev;
  cache_options o;
  region frames, meta;
  // The landing slots: host memory, pinned (registered with the devices) and so readable by
  // kernels at the same address, and a target the file engine reads into without staging.
  struct landing_area {
    registration_cache* cache = nullptr;
    unsigned char* p = nullptr;
    std::uint64_t bytes = 0;
    registration reg;
    landing_area() = default;
    landing_area(const landing_area&) = delete;
    landing_area& operator=(const landing_area&) = delete;
    // Unregistered from the devices before the memory goes back: a registration the cache kept
    // would outlive the mapping, and the driver would still count that address range as its own
    // (a later allocation of the user's that lands there fails, CUDA_ERROR_ALREADY_MAPPED).
    ~landing_area() {
      reg = registration{};
      if (!p) return;
      try {
        cache->invalidate(reinterpret_cast<std::uintptr_t>(p), bytes);
      } catch (const std::exception& e) {
        log::error("gpu", "unregistering the cache's landing area: {}", e.what());
      }
      std::free(p);
    }
  } landing;
  cache_view v;
  mutable std::mutex mu;
  std::vector<mapped> arrays;  // mu
  // After the memory, so they go first: the stream's copies and the proxy's requests (it waits for
  // those it still serves) end before the memory is returned.
  std::unique_ptr<stream> st;  // the host's reads and writes of the cache's words
  std::unique_ptr<proxy> px;

  impl(file_engine& fe, device& d, cache_options opt) : files(fe), dev(d), o(opt) {
    const std::uint32_t ps = o.page_bytes;
    expects(ps >= 4096 && ps <= (2u << 20) && (ps & (ps - 1)) == 0, "gpu.cache", fmt::format("page_bytes={}", ps),
            "a page must be a power of two from 4 KiB to 2 MiB");
    expects(o.bytes >= ps && o.bytes / ps < (1ull << 31), "gpu.cache", fmt::format("bytes={} page_bytes={}", o.bytes, ps),
            "the cache must hold at least one page and fewer than 2^31");
    expects(o.arrays >= 1 && o.arrays < (1u << 16), "gpu.cache", fmt::format("arrays={}", o.arrays),
            "from 1 to 65535 arrays");
    expects(o.wait.count() > 0, "gpu.cache", "wait", "must be positive");
    expects(o.landing_bytes >= ps, "gpu.cache", fmt::format("landing_bytes={} page_bytes={}", o.landing_bytes, ps),
            "the landing area must hold at least one page");
    v.frame_count = static_cast<std::uint32_t>(o.bytes / ps);
    v.page_shift = static_cast<std::uint32_t>(__builtin_ctz(ps));
    v.wait_ns = static_cast<std::uint64_t>(o.wait.count());
    const requesters by = o.requests.by;
    st = dev.create_stream();
    frames = region(dev, std::uint64_t{v.frame_count} * ps, by);

    v.landing_count = static_cast<std::uint32_t>(std::min<std::uint64_t>(o.landing_bytes / ps, v.frame_count));
    const std::uint64_t landing_bytes = std::uint64_t{v.landing_count} * ps;
    landing.cache = &files.registrations();
    landing.p = static_cast<unsigned char*>(std::aligned_alloc(ps, landing_bytes));
    if (!landing.p) fail(errc::out_of_memory, "gpu.cache", fmt::format("landing_bytes={}", o.landing_bytes), "no host memory for the landing area");
    landing.bytes = landing_bytes;
    landing.reg = files.registrations().acquire(landing.p, landing_bytes);
    v.landing = landing.p;

    // The words: owner[frames], arrays[o.arrays], hand, counters, error, landing locks.
    const std::uint64_t at_owner = 0;
    const std::uint64_t at_arrays = align64(at_owner + 8ull * v.frame_count);
    const std::uint64_t at_hand = align64(at_arrays + sizeof(array_desc) * o.arrays);
    const std::uint64_t at_counters = align64(at_hand + 8);
    const std::uint64_t at_error = align64(at_counters + sizeof(cache_counters));
    const std::uint64_t at_locks = align64(at_error + 4);
    const std::uint64_t total = at_locks + 4ull * v.landing_count;
    meta = region(dev, total, by);
    std::vector<std::byte> init(total);
    for (std::uint32_t f = 0; f < v.frame_count; ++f) std::memcpy(init.data() + at_owner + 8ull * f, &owner_word::free, 8);
    copy_words(meta.va.base(), init.data(), total);

    v.frames = frames.va.at<unsigned char>(0);
    v.owner = meta.va.at<std::uint64_t>(at_owner);
    v.arrays = meta.va.at<array_desc>(at_arrays);
    v.hand = meta.va.at<std::uint64_t>(at_hand);
    v.counters = meta.va.at<cache_counters>(at_counters);
    v.error = meta.va.at<std::uint32_t>(at_error);
    v.landing_lock = meta.va.at<std::uint32_t>(at_locks);
    px = std::make_unique<proxy>(files, dev, o.requests);
    v.ring = px->view();
    v.landing_done = px->answer_words(v.landing_count).data();
  }

  ~impl() {
    // The proxy first: it waits for what it still serves (a late write-back must not land after
    // the flush), then the flush writes what is dirty through the file engine.
    px.reset();
    try {
      flush();
    } catch (const std::exception& e) {
      log::error("gpu", "{}: the page cache's dirty pages could not all be written back: {}", dev.id(), e.what());
    }
    try {
      st->synchronize(deadline_after(o.requests.deadline));
    } catch (const std::exception& e) {
      log::error("gpu", "{}: the page cache's own copies: {}", dev.id(), e.what());
    }
  }

  // The host's reads and writes of the cache's words (in device memory for kernels): a copy on the
  // cache's stream, waited for.
  void copy_words(void* dst, const void* src, std::size_t bytes) {
    st->copy(dst, src, bytes);
    st->synchronize(deadline_after(o.requests.deadline));
  }

  array_desc map_bytes(std::shared_ptr<file> f, std::uint64_t offset, std::uint64_t bytes) {
    expects(f != nullptr, "gpu.cache.map", "file", "a null file");
    const std::string what = fmt::format("{} offset={} bytes={}", f->path(), offset, bytes);
    expects(bytes > 0 && offset + bytes >= offset, "gpu.cache.map", what, "an empty or overflowing range");
    const std::uint64_t pages = (bytes + o.page_bytes - 1) / o.page_bytes;
    expects(pages <= owner_word::page_mask, "gpu.cache.map", what, "more pages than a page table holds");
    std::lock_guard l(mu);
    if (arrays.size() >= o.arrays)
      fail(errc::out_of_memory, "gpu.cache.map", what, fmt::format("the cache maps at most {} ranges (cache_options::arrays)", o.arrays));
    mapped m;
    m.entries = region(dev, pages * 8, o.requests.by);
    static const std::vector<std::byte> zeros(1 << 20);
    for (std::uint64_t at = 0; at < pages * 8; at += zeros.size())
      st->copy(m.entries.va.at<std::byte>(at), zeros.data(), std::min<std::uint64_t>(zeros.size(), pages * 8 - at));
    m.d.entries = m.entries.va.at<std::uint64_t>(0);
    m.d.base = offset;
    m.d.bytes = bytes;
    m.d.id = static_cast<std::uint32_t>(arrays.size());
    m.d.source = px->add(f);
    m.f = std::move(f);
    copy_words(const_cast<array_desc*>(v.arrays) + m.d.id, &m.d, sizeof m.d);
    arrays.push_back(std::move(m));
    return arrays.back().d;
  }

  std::uint64_t flush() {
    using namespace page_entry;
    std::lock_guard l(mu);
    std::uint64_t written = 0;
    for (auto& m : arrays) {
      const std::uint64_t pages = (m.d.bytes + o.page_bytes - 1) / o.page_bytes;
      std::vector<std::uint64_t> e(pages);
      copy_words(e.data(), m.d.entries, pages * 8);
      std::vector<file_request> reqs;
      std::vector<std::uint64_t> which;
      for (std::uint64_t p = 0; p < pages; ++p) {
        if ((e[p] & state_mask) != valid || !(e[p] & dirty)) continue;
        const std::uint64_t at = p * o.page_bytes;
        reqs.push_back({m.f, m.d.base + at, v.frames + (e[p] >> frame_shift) * o.page_bytes,
                        std::min<std::uint64_t>(o.page_bytes, m.d.bytes - at), true});
        which.push_back(p);
      }
      if (reqs.empty()) continue;
      transfer_options to;
      to.until = deadline_after(o.requests.deadline);
      transfer_batch b = files.submit(reqs, to);
      b.wait();
      b.check();
      for (std::uint64_t p : which) e[p] &= ~dirty;
      copy_words(m.d.entries, e.data(), pages * 8);
      written += reqs.size();
    }
    return written;
  }

  void check() {
    std::lock_guard l(mu);
    std::uint32_t err = 0;
    copy_words(&err, v.error, 4);
    if (!err) return;
    static const std::uint32_t none = 0;
    copy_words(v.error, &none, 4);
    const status s = static_cast<status>(err);
    std::string why;
    for (auto& e : px->errors()) why += "; " + e;
    if (why.size() > 2000) why = why.substr(why.size() - 2000);
    const errc c = s == status::out_of_range ? errc::out_of_range : s == status::timed_out ? errc::timeout : errc::io_error;
    fail(c, "gpu.cache", dev.id(),
         fmt::format("an access by a kernel (or host requester) failed: {}{}", name(s),
                     why.empty() ? std::string(" (the proxy reported nothing: the requester's own wait ran out)") : why));
  }
};

cache::cache(file_engine& files, device& dev, cache_options o) : impl_(std::make_unique<impl>(files, dev, o)) {}
cache::~cache() = default;

array_desc cache::map_bytes(std::shared_ptr<file> f, std::uint64_t offset, std::uint64_t bytes) {
  return impl_->map_bytes(std::move(f), offset, bytes);
}

namespace {
// Memory as a source of the cache: each page a copy by the transfer engine, which classifies the
// memory (and holds unified memory in place while it copies).
class memory_source final : public file_source {
 public:
  memory_source(transfer_engine& x, std::byte* base, std::uint64_t bytes) : x_(x), base_(base), bytes_(bytes) {}
  std::uint64_t size() override { return bytes_; }
  void start(bool write, std::uint64_t offset, void* mem, std::uint64_t bytes, const source_deadline& until,
             completion done) override {
    const std::uint64_t n = offset >= bytes_ ? 0 : std::min(bytes, bytes_ - offset);  // short at the end, like a file
    if (!n) return done(0, nullptr);
    const transfer_request q = write ? transfer_request{base_ + offset, mem, n} : transfer_request{mem, base_ + offset, n};
    transfer_options o;
    o.until = until.at();
    // Exactly once: a completion that ran inside submit and then threw must not be told again.
    auto told = std::make_shared<std::atomic<bool>>(false);
    try {
      x_.submit({&q, 1}, o, [done, told](std::span<const request_result> r) {
        if (told->exchange(true)) return;
        if (r[0].state == request_state::done) return done(r[0].bytes_done, nullptr);
        const error e = r[0].err ? *r[0].err : error(errc::internal, "gpu.cache.memory", "", "the copy did not finish");
        done(0, &e);
      });
    } catch (const error& e) {
      if (!told->exchange(true)) done(0, &e);
    }
  }

 private:
  transfer_engine& x_;
  std::byte* base_;
  std::uint64_t bytes_;
};
}  // namespace

array_desc cache::map_memory_bytes(void* p, std::uint64_t bytes, bool writable) {
  expects(p != nullptr, "gpu.cache.map_memory", "memory", "a null pointer");
  const std::string name = fmt::format("memory {}+{}", p, bytes);
  // Memory ferry does not know would fail at the first miss: refused here, naming it.
  const memory_region m = impl_->files.registrations().classify(p, bytes);
  if (m.type == memory_type::unknown)
    fail(errc::bad_address, "gpu.cache.map_memory", name, "not memory ferry knows (freed, or never allocated?)");
  auto f = file::over(std::make_shared<memory_source>(impl_->files.transfers(), static_cast<std::byte*>(p), bytes), name, writable);
  return impl_->map_bytes(std::move(f), 0, bytes);
}
cache_view cache::view() const noexcept { return impl_->v; }
std::uint64_t cache::flush() { return impl_->flush(); }
void cache::check() { impl_->check(); }
proxy& cache::requests() noexcept { return *impl_->px; }

cache_stats cache::stats() const {
  cache_stats s;
  std::lock_guard l(impl_->mu);
  impl_->copy_words(&s.counted, impl_->v.counters, sizeof s.counted);
  s.requests = impl_->px->stats();
  s.frames = impl_->v.frame_count;
  s.page_bytes = impl_->o.page_bytes;
  return s;
}

}  // namespace ferry::gpu
