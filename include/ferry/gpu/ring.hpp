#pragma once
// GPU-initiated requests, the wire between kernels and ferry's host proxy (docs/design/gpu-access.md):
// a bounded ring of request slots that GPU threads fill and a host thread drains, and an answer word
// per requester that the proxy sets once the data is in place. One header for both sides: it compiles as
// CUDA device code (in the user's kernels) and as host C++ (the proxy, and the CPU tests in which host
// threads stand in for warps).
//
// A ring_view may hold several rings side by side, each drained by its own proxy thread: a requester
// names one by a hint (its warp, its landing slot), and its ticket carries the ring it went to.
//
// Protocol, per ring (a bounded multi-producer queue with a sequence number per slot, one consumer):
//  - credits: a requester takes one before its ticket and gives it back when its wait ends (the
//    answer, or its deadline), so at most `capacity` requests are under way and a requester that
//    holds a credit finds its slot free (or about to be).
//  - ticket t comes from one fetch-and-add on `tail` (never a compare-and-swap loop: thousands of
//    requesters share that word). Slot t % capacity is free for t when its seq == t; the requester
//    writes the request there and publishes it by storing seq = t + 1 (release).
//  - the proxy, at head h, takes slot h % capacity once its seq == h + 1 (acquire), copies the
//    request out and frees the slot for ticket h + capacity (seq = h + capacity, release).
//  - the proxy answers, after the data is in place, by storing the ticket's tag (24 bits, below) and
//    a status byte into the request's 32-bit answer word (`done`, release): a plain CPU store, so the
//    word is in host memory (pinned and mapped for the device, for kernels). The requester owns its
//    word while the request is under way and waits for its own ticket's answer: a late answer to an
//    earlier request that used the same word never matches (unless 2^24 requests lie between them).
// Memory: slots in host memory pinned and mapped for the device: the proxy polls them without a PCIe
// round trip, the GPU writes requests with posted writes, and each requester reads only its own
// slot's seq and its own answer word across PCIe -- never a word thousands of requesters poll at
// once (reads of one host address from many warps queue behind each other for milliseconds), and no
// stream operation per answer (a GPU's front end runs those one at a time). `tail` and the credits
// where the requesters are (device memory on a GPU: their atomics never cross PCIe, and x86 hosts
// lack PCIe atomics). Every wait has a deadline.
#include <cstdint>

#if defined(__CUDACC__)
#include <cuda/atomic>

#include <chrono>
#include <thread>
#define FERRY_GPU_HD __host__ __device__
#else
#include <atomic>
#include <chrono>
#include <thread>
#define FERRY_GPU_HD
#endif

namespace ferry::gpu {

enum class op : std::uint32_t { read = 1, write = 2 };

// What a requester asks of the proxy: bytes [offset, offset + bytes) of source `source` into (read)
// or from (write) `addr`, then its answer into the 32-bit word at `done` (host memory).
struct request {
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
  std::uint64_t addr = 0;
  std::uint64_t done = 0;
  std::uint32_t source = 0;
  op kind = op::read;
};

// A slot on its own cache line: requesters of neighbouring tickets do not share lines.
struct alignas(64) slot {
  std::uint64_t seq = 0;
  request r;
};

// The answer's low byte. Beyond `ok`, the proxy's error: the host side keeps the full message.
enum class status : std::uint8_t { pending = 0, ok = 1, failed = 2, out_of_range = 3, timed_out = 4 };

// Each ring's own words, on a line of their own: the tail and the credits (starting at capacity).
struct alignas(64) ring_words {
  std::uint64_t tail = 0;
  std::int32_t credits = 0;
};

// What a requester holds; plain pointers, valid where it runs.
struct ring_view {
  slot* slots = nullptr;          // rings x capacity: ring k's slots from k * capacity on
  ring_words* words = nullptr;    // one per ring
  std::uint32_t capacity = 0;     // slots per ring: a power of two, at most 2^24
  std::uint32_t rings = 1;        // a power of two, at most 256 (answer tags stay distinct across rings)
  // Ring k alone.
  FERRY_GPU_HD ring_view ring(std::uint32_t k) const { return {slots + std::uint64_t{k} * capacity, words + k, capacity, 1}; }
};

namespace detail {
#if defined(__CUDACC__)
template <typename T>
using ref = cuda::atomic_ref<T, cuda::thread_scope_system>;
namespace mo = cuda::std;
FERRY_GPU_HD inline std::uint64_t now_ns() {
#if defined(__CUDA_ARCH__)
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#else
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::steady_clock::now().time_since_epoch())
                                        .count());
#endif
}
FERRY_GPU_HD inline void pause(unsigned ns = 200) {
#if defined(__CUDA_ARCH__)
  __nanosleep(ns);
#else
  (void)ns;
  std::this_thread::yield();
#endif
}
#else
template <typename T>
using ref = std::atomic_ref<T>;
namespace mo = std;
inline std::uint64_t now_ns() {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}
inline void pause(unsigned = 200) { std::this_thread::yield(); }
#endif
}  // namespace detail

constexpr std::uint64_t no_ticket = ~0ull;
// A ticket: the ring's own count in the low 48 bits, the ring above them.
constexpr int ring_shift = 48;
FERRY_GPU_HD constexpr std::uint32_t ring_of(std::uint64_t ticket) { return static_cast<std::uint32_t>(ticket >> ring_shift); }
// What an answer carries of its ticket: the ticket's place among all the rings' tickets (its ring's
// count x rings + ring), low 24 bits -- distinct for the tickets of different rings, so a word one
// requester uses for requests to several rings never takes one ring's answer for another's.
FERRY_GPU_HD constexpr std::uint32_t tag(std::uint64_t ticket, std::uint32_t rings) {
  return static_cast<std::uint32_t>(((ticket & ((1ull << ring_shift) - 1)) * rings + ring_of(ticket)) & 0xffffff);
}

// Puts `r` into ring `hint % v.rings`, waiting for a credit at most `wait_ns`. Returns the request's
// ticket, or no_ticket when no credit came (nothing was taken: the ring is as it was) or -- only when
// the proxy took nothing for a whole wait while requests timed out in the ring -- the ticket's slot
// stayed taken (that ticket is lost, and the ring stops at it: docs/design/gpu-access.md, limits).
FERRY_GPU_HD inline std::uint64_t submit(const ring_view& all, const request& r, std::uint64_t wait_ns, std::uint32_t hint = 0) {
  const std::uint32_t k = hint % all.rings;
  const ring_view v = all.ring(k);
  const std::uint64_t start = detail::now_ns();
  detail::ref<std::int32_t> credits(v.words->credits);
  // Many may wait for a credit at once, all on this one word: each looks (a load) before it takes
  // (one fetch-and-subtract, undone if it came too late), and backs off up to 6.4 us between looks
  // so that the word stays free for those giving credits back.
  for (unsigned nap = 200;;) {
    if (credits.load(detail::mo::memory_order_relaxed) > 0) {
      if (credits.fetch_sub(1, detail::mo::memory_order_acquire) > 0) break;
      credits.fetch_add(1, detail::mo::memory_order_relaxed);
    }
    if (detail::now_ns() - start > wait_ns) return no_ticket;
    detail::pause(nap);
    nap = nap < 6400 ? 2 * nap : nap;
  }
  const std::uint64_t t = detail::ref<std::uint64_t>(v.words->tail).fetch_add(1, detail::mo::memory_order_relaxed);
  slot& s = v.slots[t & (v.capacity - 1)];
  detail::ref<std::uint64_t> seq(s.seq);
  // The slot has a wait of its own: a credit won late must not leave its ticket no time.
  const std::uint64_t ticketed = detail::now_ns();
  for (unsigned nap = 200; seq.load(detail::mo::memory_order_acquire) != t;) {
    if (detail::now_ns() - ticketed > wait_ns) {
      credits.fetch_add(1, detail::mo::memory_order_release);
      return no_ticket;
    }
    detail::pause(nap);
    nap = nap < 3200 ? 2 * nap : nap;
  }
  s.r = r;
  seq.store(t + 1, detail::mo::memory_order_release);
  return (std::uint64_t{k} << ring_shift) | (t & ((1ull << ring_shift) - 1));
}

// Waits for the answer to ticket `t` in the word at `done`, at most `wait_ns`; status::timed_out when
// it did not come. Every ticket is waited for once: that gives its credit back -- on a timeout only
// if the proxy has taken the request out of its slot. A request still in its slot keeps its credit
// (the ring has one request fewer under way from then on): given back, a later ticket could find
// that slot still taken, give up, and leave a hole the proxy would wait at for ever.
FERRY_GPU_HD inline status wait(const ring_view& v, const std::uint32_t* done, std::uint64_t ticket, std::uint64_t wait_ns) {
  const std::uint32_t want = tag(ticket, v.rings);
  detail::ref<std::uint32_t> w(*const_cast<std::uint32_t*>(done));
  const std::uint64_t start = detail::now_ns();
  status s = status::timed_out;
  unsigned nap = 400;
  for (;;) {
    std::uint32_t a = w.load(detail::mo::memory_order_acquire);
    if ((a >> 8) == want && static_cast<status>(a & 0xff) != status::pending) {
      s = static_cast<status>(a & 0xff);
      break;
    }
    if (detail::now_ns() - start > wait_ns) break;
    detail::pause(nap);  // backing off: the word is across PCIe, and a request takes tens of microseconds
    nap = nap < 6400 ? 2 * nap : nap;
  }
  const ring_view mine = v.ring(ring_of(ticket) % v.rings);
  const std::uint64_t t = ticket & ((1ull << ring_shift) - 1);
  if (s != status::timed_out ||
      detail::ref<std::uint64_t>(mine.slots[t & (mine.capacity - 1)].seq).load(detail::mo::memory_order_acquire) != t + 1)
    detail::ref<std::int32_t>(mine.words->credits).fetch_add(1, detail::mo::memory_order_release);
  return s;
}

// The proxy's side (one consumer per ring; `v` one ring, v.ring(k)): takes the request at `head` if it
// is there, frees its slot and advances head.
FERRY_GPU_HD inline bool take(const ring_view& v, std::uint64_t& head, request& out) {
  slot& s = v.slots[head & (v.capacity - 1)];
  detail::ref<std::uint64_t> seq(s.seq);
  if (seq.load(detail::mo::memory_order_acquire) != head + 1) return false;
  out = s.r;
  seq.store(head + v.capacity, detail::mo::memory_order_release);
  ++head;
  return true;
}

// The answer to `ticket` of a view of `rings` rings, as the proxy writes it into the requester's word.
FERRY_GPU_HD constexpr std::uint32_t answer(std::uint64_t ticket, status st, std::uint32_t rings = 1) {
  return tag(ticket, rings) << 8 | static_cast<std::uint8_t>(st);
}

// The proxy's answer to request `r` (after the data is in place).
inline void give(const request& r, std::uint64_t ticket, status st, std::uint32_t rings = 1) {
  detail::ref<std::uint32_t>(*reinterpret_cast<std::uint32_t*>(r.done)).store(answer(ticket, st, rings), detail::mo::memory_order_release);
}

// Slots start with seq == their index in their ring; each ring's tail at 0 and credits at capacity.
FERRY_GPU_HD inline void init(slot* slots, std::uint32_t capacity, std::uint32_t rings = 1) {
  for (std::uint64_t i = 0; i < std::uint64_t{capacity} * rings; ++i) slots[i].seq = i % capacity;
}
FERRY_GPU_HD inline void init(ring_words* words, std::uint32_t capacity, std::uint32_t rings = 1) {
  for (std::uint32_t k = 0; k < rings; ++k) {
    words[k].tail = 0;
    words[k].credits = static_cast<std::int32_t>(capacity);
  }
}

}  // namespace ferry::gpu
