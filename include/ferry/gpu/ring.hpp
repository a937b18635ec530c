#pragma once
// GPU-initiated requests, the wire between kernels and ferry's host proxy (docs/design/gpu-access.md):
// a bounded ring of request slots that GPU threads fill and a host thread drains, and a completion
// word per requester that the proxy sets once the data is in place. One header for both sides: it
// compiles as CUDA device code (in the user's kernels) and as host C++ (the proxy, and the CPU tests
// in which host threads stand in for warps).
//
// Protocol (a bounded multi-producer queue with a sequence number per slot, single consumer):
//  - slot i starts with seq == i. Ticket t may fill slot t % capacity when its seq == t: the
//    requester claims t by a compare-and-swap of `tail` from t to t + 1 -- only then, so a requester
//    that gives up on a full ring holds nothing --, writes the request, and publishes it by storing
//    seq = t + 1 (release).
//  - the proxy, at head h, takes slot h % capacity once its seq == h + 1 (acquire), copies the
//    request out and frees the slot for ticket h + capacity (seq = h + capacity, release).
//  - the proxy answers by storing the ticket's low 24 bits and a status byte into the request's
//    32-bit completion word, after the data is in place (a stream's write-value after its copy, on a
//    GPU). A requester waits for its own ticket's answer: a late answer to an earlier request that
//    used the same word never matches (unless 2^24 requests lie between them).
// Memory: slots in host memory pinned and mapped for the device (the proxy polls them without a
// PCIe round trip; the GPU writes them with posted writes); `tail` where the requesters are (device
// memory on a GPU: its compare-and-swap never crosses PCIe, and x86 hosts lack PCIe atomics); the
// completion word where the requester polls it (device memory on a GPU, written by the proxy's
// stream after the data). Every wait has a deadline.
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
// or from (write) `addr`, then its answer into the 32-bit word at `done`.
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

// What a requester holds; plain pointers, valid where it runs.
struct ring_view {
  slot* slots = nullptr;
  std::uint64_t* tail = nullptr;
  std::uint32_t capacity = 0;  // a power of two
  // Where the requesters are, like `tail`: requests submitted and not yet waited for take a credit
  // each, capacity in all, so a requester that holds one finds its slot free -- instead of many
  // polling a full ring's slots across PCIe. Null: no credits (the ring's own back-pressure only).
  std::uint32_t* credits = nullptr;
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

// Puts `r` into the ring, waiting while it is full, at most `wait_ns`. Returns the request's ticket,
// or no_ticket when the ring stayed full (nothing was taken: the ring is as it was).
FERRY_GPU_HD inline std::uint64_t submit(const ring_view& v, const request& r, std::uint64_t wait_ns) {
  detail::ref<std::uint64_t> tail(*v.tail);
  const std::uint64_t start = detail::now_ns();
  if (v.credits) {
    // Many may wait for a credit at once, all on this one word: each backs off (up to 6.4 us
    // between looks) so that the word stays free for those giving credits back.
    detail::ref<std::uint32_t> credits(*v.credits);
    unsigned nap = 200;
    for (;;) {
      std::uint32_t c = credits.load(detail::mo::memory_order_relaxed);
      if (c > 0 && credits.compare_exchange_weak(c, c - 1, detail::mo::memory_order_acquire, detail::mo::memory_order_relaxed)) break;
      if (detail::now_ns() - start > wait_ns) return no_ticket;
      if (c == 0) {
        detail::pause(nap);
        nap = nap < 6400 ? 2 * nap : nap;
      }
    }
  }
  for (;;) {
    std::uint64_t t = tail.load(detail::mo::memory_order_relaxed);
    slot& s = v.slots[t & (v.capacity - 1)];
    std::uint64_t seq = detail::ref<std::uint64_t>(s.seq).load(detail::mo::memory_order_acquire);
    if (seq == t) {
      if (tail.compare_exchange_weak(t, t + 1, detail::mo::memory_order_relaxed)) {
        s.r = r;
        detail::ref<std::uint64_t>(s.seq).store(t + 1, detail::mo::memory_order_release);
        return t;
      }
      continue;  // another requester took t: try the next ticket at once
    }
    // seq < t: the proxy has not freed this slot from the previous lap (the ring is full);
    // seq > t: another requester took t meanwhile (tail moved on). Either way, look again.
    if (seq < t && detail::now_ns() - start > wait_ns) {
      if (v.credits) detail::ref<std::uint32_t>(*v.credits).fetch_add(1, detail::mo::memory_order_release);
      return no_ticket;
    }
    detail::pause();
  }
}

// Waits for the answer to ticket `t` in the word at `done`, at most `wait_ns`; status::timed_out when
// it did not come. Every ticket is waited for once: that gives its credit back (its answer or its
// timeout, whichever comes first).
FERRY_GPU_HD inline status wait(const ring_view& v, const std::uint32_t* done, std::uint64_t t, std::uint64_t wait_ns) {
  detail::ref<std::uint32_t> w(*const_cast<std::uint32_t*>(done));
  const std::uint64_t start = detail::now_ns();
  status s = status::timed_out;
  unsigned nap = 200;
  for (;;) {
    std::uint32_t a = w.load(detail::mo::memory_order_acquire);
    if ((a >> 8) == (t & 0xffffff) && static_cast<status>(a & 0xff) != status::pending) {
      s = static_cast<status>(a & 0xff);
      break;
    }
    if (detail::now_ns() - start > wait_ns) break;
    detail::pause(nap);  // backing off: the word may be across PCIe, and polled by many
    nap = nap < 3200 ? 2 * nap : nap;
  }
  if (v.credits) detail::ref<std::uint32_t>(*v.credits).fetch_add(1, detail::mo::memory_order_release);
  return s;
}

// The proxy's side (one consumer per ring): takes the request at `head` if it is there, frees its
// slot and advances head.
FERRY_GPU_HD inline bool take(const ring_view& v, std::uint64_t& head, request& out) {
  slot& s = v.slots[head & (v.capacity - 1)];
  detail::ref<std::uint64_t> seq(s.seq);
  if (seq.load(detail::mo::memory_order_acquire) != head + 1) return false;
  out = s.r;
  seq.store(head + v.capacity, detail::mo::memory_order_release);
  ++head;
  return true;
}

// The answer to ticket t, as the proxy writes it into the requester's word.
FERRY_GPU_HD constexpr std::uint32_t answer(std::uint64_t t, status st) {
  return static_cast<std::uint32_t>((t & 0xffffff) << 8) | static_cast<std::uint8_t>(st);
}

// Slots start with seq == their index.
FERRY_GPU_HD inline void init(slot* slots, std::uint32_t capacity) {
  for (std::uint32_t i = 0; i < capacity; ++i) slots[i].seq = i;
}

}  // namespace ferry::gpu
