#pragma once
// The GPU page cache's state machine (docs/design/gpu-access.md): frames of one page size in the
// requesters' memory (device memory for kernels), a page table per mapped array, and the steps
// every requester runs -- acquire a page (a hit, or a miss it fills through the proxy's ring),
// use it, release it. Like ring.hpp, one header for both sides: kernels compile it with nvcc, the
// host compiler for the CPU tests in which host threads stand in for warps.
//
// A page table entry is one 64-bit word, changed only by compare-and-swap (or by the one requester
// that holds it busy):
//   bits 0-1  state: invalid (not cached), busy (being filled or written back), valid
//   bit  2    dirty (written since it was filled)
//   bit  3    referenced (the clock's second chance)
//   bits 8-31 requesters holding the page (a valid page is evicted only when none do)
//   bits 32-63 the frame that holds it
// A frame's owner word says which page it holds (array id and page number), or free, or locked by
// the requester that is evicting or filling it. Claiming a frame: the clock hand moves on; a frame
// that is free, or holds a valid page nobody holds and the clock has not marked again, is locked;
// the page it held goes invalid (a dirty one is written back first, busy meanwhile, so its readers
// wait instead of reading it from the source while the write is under way).
// Pages pass between the proxy and the frames through landing slots in pinned host memory: the
// proxy's reads land there (no copy engine, no stream operation per page) and the requester copies
// the page into its frame (or, to write back, out of it first).
#include <ferry/gpu/ring.hpp>

#include <cstring>

namespace ferry::gpu {

// One mapped range of a source, as requesters see it. Passed to kernels inside array<T>.
struct array_desc {
  std::uint64_t* entries = nullptr;  // one word per page
  std::uint64_t base = 0;            // the range's first byte in its source
  std::uint64_t bytes = 0;           // the range's length
  std::uint32_t source = 0;          // the proxy's source index
  std::uint32_t id = 0;              // index in cache_view::arrays
};

// Counted by requesters: an acquire that found its page valid (a hit) or filled it (a miss) -- per
// acquire, which on a GPU is per warp and page, not per thread.
struct cache_counters {
  std::uint64_t hits = 0;
  std::uint64_t misses = 0;
  std::uint64_t evictions = 0;
  std::uint64_t writebacks = 0;
  std::uint64_t failures = 0;
  std::uint64_t retired = 0;  // landing slots whose request went unanswered: the proxy may still use them
  // Where a request's time goes, summed over requests (GPU clock, ns): getting a landing slot, a
  // credit and a ticket (submit); then the answer; the copies between landing slot and frame.
  std::uint64_t submit_ns = 0;
  std::uint64_t answer_ns = 0;
  std::uint64_t copy_ns = 0;
};

struct cache_view {
  unsigned char* frames = nullptr;     // frame_count pages of 1 << page_shift bytes
  std::uint64_t* owner = nullptr;      // per frame
  const array_desc* arrays = nullptr;  // by id, for eviction
  std::uint64_t* hand = nullptr;       // the clock
  cache_counters* counters = nullptr;
  std::uint32_t* error = nullptr;  // the first failure's status, until the host takes it (cache::check)
  // Pinned host memory the proxy reads pages into and writes them from, one page per slot; frame f
  // passes through the first free slot from f % landing_count on, held by its lock word (in the
  // requesters' memory).
  unsigned char* landing = nullptr;
  std::uint32_t* landing_lock = nullptr;
  std::uint32_t* landing_done = nullptr;  // per slot: the answer word of its request (the proxy's, host memory)
  std::uint32_t landing_count = 0;
  ring_view ring;
  std::uint32_t frame_count = 0;
  std::uint32_t page_shift = 0;
  std::uint64_t wait_ns = 0;  // the longest a requester waits: for a slot, an answer, a frame, a busy page
};

namespace page_entry {
constexpr std::uint64_t state_mask = 3, invalid = 0, busy = 1, valid = 2;
constexpr std::uint64_t dirty = 4, referenced = 8;
constexpr std::uint64_t one_holder = 1ull << 8, holders_mask = 0xffffffull << 8;
constexpr int frame_shift = 32;
}  // namespace page_entry

namespace owner_word {
constexpr std::uint64_t free = ~0ull, locked = ~0ull - 1;
constexpr int id_shift = 48;
constexpr std::uint64_t page_mask = (1ull << id_shift) - 1;
}  // namespace owner_word

namespace detail {

FERRY_GPU_HD inline void count(std::uint64_t& c, std::uint64_t n = 1) {
  ref<std::uint64_t>(c).fetch_add(n, mo::memory_order_relaxed);
}

FERRY_GPU_HD inline status note_failure(const cache_view& c, status s) {
  count(c.counters->failures);
  std::uint32_t none = 0;
  ref<std::uint32_t>(*c.error).compare_exchange_strong(none, static_cast<std::uint32_t>(s), mo::memory_order_relaxed);
  return s;
}

FERRY_GPU_HD inline std::uint64_t page_bytes(const cache_view& c, const array_desc& a, std::uint64_t page) {
  std::uint64_t at = page << c.page_shift, ps = 1ull << c.page_shift;
  return a.bytes - at < ps ? a.bytes - at : ps;
}

FERRY_GPU_HD inline void copy_page(unsigned char* dst, const unsigned char* src, std::uint64_t n) {
#if defined(__CUDA_ARCH__)
  if (((reinterpret_cast<std::uint64_t>(dst) | reinterpret_cast<std::uint64_t>(src) | n) & 15) == 0) {
    auto* d = reinterpret_cast<uint4*>(dst);
    const auto* s = reinterpret_cast<const uint4*>(src);
    const std::uint64_t k = n / 16;
    std::uint64_t i = 0;
    for (; i + 8 <= k; i += 8) {  // eight loads in flight: the source may be across PCIe
      uint4 v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = s[i + j];
#pragma unroll
      for (int j = 0; j < 8; ++j) d[i + j] = v[j];
    }
    for (; i < k; ++i) d[i] = s[i];
    return;
  }
  for (std::uint64_t i = 0; i < n; ++i) dst[i] = src[i];
#else
  std::memcpy(dst, src, n);
#endif
}

// One request to the proxy for frame f (fill: read; write back: write), through f's landing slot,
// and its answer. A request the proxy took but did not answer in time may still be served later:
// its landing slot stays locked for good (retired), so a late answer can only land there. The slot
// is the first free one from f % landing_count on: a retired slot is passed over, not waited for.
FERRY_GPU_HD inline status exchange(const cache_view& c, op kind, const array_desc& a, std::uint64_t page, std::uint64_t f,
                                    std::uint64_t start) {
  const std::uint64_t te = now_ns();
  std::uint64_t ls = f % c.landing_count;
  for (std::uint64_t tries = 1;; ++tries, ls = (ls + 1) % c.landing_count) {
    std::uint32_t free_ = 0;
    if (ref<std::uint32_t>(c.landing_lock[ls]).compare_exchange_strong(free_, 1u, mo::memory_order_acquire, mo::memory_order_relaxed))
      break;
    if (tries % c.landing_count == 0) {  // a whole lap: every slot busy or retired
      if (now_ns() - start > c.wait_ns) return status::timed_out;
      pause();
    }
  }
  ref<std::uint32_t> lock(c.landing_lock[ls]);
  unsigned char* land = c.landing + (ls << c.page_shift);
  unsigned char* frame = c.frames + (f << c.page_shift);
  request r;
  r.source = a.source;
  r.offset = a.base + (page << c.page_shift);
  r.bytes = page_bytes(c, a, page);
  r.addr = reinterpret_cast<std::uint64_t>(land);
  r.done = reinterpret_cast<std::uint64_t>(c.landing_done + ls);
  r.kind = kind;
  const std::uint64_t t0 = now_ns();
  if (kind == op::write) copy_page(land, frame, r.bytes);  // published to the proxy by submit's release
  const std::uint64_t t1 = now_ns();
  std::uint64_t t = submit(c.ring, r, c.wait_ns, static_cast<std::uint32_t>(ls));  // landing slots spread over the rings
  const std::uint64_t t2 = now_ns();
  status s = t == no_ticket ? status::timed_out : wait(c.ring, c.landing_done + ls, t, c.wait_ns);
  const std::uint64_t t3 = now_ns();
  count(c.counters->submit_ns, (t2 - t1) + (t0 - te));
  count(c.counters->answer_ns, t3 - t2);
  if (t != no_ticket && s == status::timed_out) {
    count(c.counters->retired);
    return s;
  }
  if (s == status::ok && kind == op::read) copy_page(frame, land, r.bytes);
  count(c.counters->copy_ns, now_ns() - t3 + (t1 - t0));
  lock.store(0, mo::memory_order_release);
  return s;
}

// Locks a frame for a page to be filled into: a free one, or one whose page can go (written back
// first when dirty; a write-back that fails is noted and the frame passed over). Returns ok with
// `frame` locked, or timed_out.
FERRY_GPU_HD inline status claim(const cache_view& c, std::uint64_t start, std::uint64_t& frame) {
  using namespace page_entry;
  ref<std::uint64_t> hand(*c.hand);
  for (std::uint64_t tries = 1;; ++tries) {
    const std::uint64_t f = hand.fetch_add(1, mo::memory_order_relaxed) % c.frame_count;
    ref<std::uint64_t> o(c.owner[f]);
    std::uint64_t k = o.load(mo::memory_order_acquire);
    if (k != owner_word::locked && o.compare_exchange_strong(k, owner_word::locked, mo::memory_order_acq_rel, mo::memory_order_relaxed)) {
      if (k == owner_word::free) {
        frame = f;
        return status::ok;
      }
      const array_desc& a = c.arrays[k >> owner_word::id_shift];
      const std::uint64_t page = k & owner_word::page_mask;
      ref<std::uint64_t> e(a.entries[page]);
      std::uint64_t x = e.load(mo::memory_order_acquire);
      bool mine = false;
      if ((x & state_mask) == valid && (x >> frame_shift) == f && (x & holders_mask) == 0) {
        if (x & referenced) {
          e.compare_exchange_strong(x, x & ~referenced, mo::memory_order_relaxed, mo::memory_order_relaxed);
        } else if (x & dirty) {
          if (e.compare_exchange_strong(x, busy | (f << frame_shift), mo::memory_order_acq_rel, mo::memory_order_relaxed)) {
            status s = exchange(c, op::write, a, page, f, start);
            if (s != status::ok) {
              // Still valid and dirty: written back later, or by a flush; the failure is the host's
              // to see (cache::check), and this requester looks on for another frame.
              e.store(x, mo::memory_order_release);
              o.store(k, mo::memory_order_release);
              note_failure(c, s);
              if (now_ns() - start > c.wait_ns) return status::timed_out;
              continue;
            }
            e.store(invalid, mo::memory_order_release);
            count(c.counters->writebacks);
            mine = true;
          }
        } else {
          mine = e.compare_exchange_strong(x, invalid, mo::memory_order_acq_rel, mo::memory_order_relaxed);
        }
      }
      if (mine) {
        count(c.counters->evictions);
        frame = f;
        return status::ok;
      }
      o.store(k, mo::memory_order_release);
    }
    if (tries % c.frame_count == 0) {  // a whole lap without a frame: every page is held or busy
      if (now_ns() - start > c.wait_ns) return status::timed_out;
      pause();
    }
  }
}

// The miss path: the requester holds the entry busy; fills a frame and publishes the page.
FERRY_GPU_HD inline status fill(const cache_view& c, const array_desc& a, std::uint64_t page, std::uint32_t holders, bool write,
                                std::uint64_t start, std::uint64_t& frame) {
  using namespace page_entry;
  ref<std::uint64_t> e(a.entries[page]);
  std::uint64_t f = 0;
  status s = claim(c, start, f);
  if (s == status::ok) {
    s = exchange(c, op::read, a, page, f, start);
    if (s == status::ok) {
      e.store((f << frame_shift) | holders * one_holder | valid | referenced | (write ? dirty : 0), mo::memory_order_release);
      ref<std::uint64_t>(c.owner[f]).store((std::uint64_t{a.id} << owner_word::id_shift) | page, mo::memory_order_release);
      count(c.counters->misses);
      frame = f;
      return s;
    }
    ref<std::uint64_t>(c.owner[f]).store(owner_word::free, mo::memory_order_release);
  }
  e.store(invalid, mo::memory_order_release);
  return note_failure(c, s);
}

}  // namespace detail

// Takes `holders` holds on page `page` of `a` for reading (or writing: the page becomes dirty),
// filling it on a miss; `frame` is where its bytes are. Waits at most 6 c.wait_ns for a page another
// requester is filling, and c.wait_ns for each of its own steps. Every hold is given back by release().
FERRY_GPU_HD inline status acquire(const cache_view& c, const array_desc& a, std::uint64_t page, std::uint32_t holders, bool write,
                                   std::uint64_t& frame) {
  using namespace page_entry;
  detail::ref<std::uint64_t> e(a.entries[page]);
  const std::uint64_t start = detail::now_ns();
  unsigned nap = 200;
  for (;;) {
    std::uint64_t x = e.load(detail::mo::memory_order_acquire);
    const std::uint64_t st = x & state_mask;
    if (st == valid) {
      const std::uint64_t y = (x + holders * one_holder) | referenced | (write ? dirty : 0);
      if (e.compare_exchange_weak(x, y, detail::mo::memory_order_acq_rel, detail::mo::memory_order_relaxed)) {
        detail::count(c.counters->hits);
        frame = x >> frame_shift;
        return status::ok;
      }
      continue;
    }
    if (st == invalid) {
      if (e.compare_exchange_weak(x, busy, detail::mo::memory_order_acq_rel, detail::mo::memory_order_relaxed))
        return detail::fill(c, a, page, holders, write, start, frame);
      continue;
    }
    // Busy: being filled or written back by another requester, whose own steps (a frame, a landing
    // slot, a write-back, a read) each have the wait: this one waits as long as they all may.
    if (detail::now_ns() - start > 6 * c.wait_ns) return detail::note_failure(c, status::timed_out);
    detail::pause(nap);
    nap = nap < 3200 ? 2 * nap : nap;
  }
}

FERRY_GPU_HD inline void release(const array_desc& a, std::uint64_t page, std::uint32_t holders) {
  detail::ref<std::uint64_t>(a.entries[page]).fetch_sub(holders * page_entry::one_holder, detail::mo::memory_order_release);
}

}  // namespace ferry::gpu
