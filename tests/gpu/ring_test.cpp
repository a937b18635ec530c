// The request ring of the gpu layer (include/ferry/gpu/ring.hpp) on the CPU: host threads stand in
// for warps, one thread for the proxy. The same header is compiled into kernels.
#include <ferry/gpu/ring.hpp>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

using namespace ferry;

namespace {

struct ring {
  std::vector<gpu::slot> slots;
  std::vector<gpu::ring_words> words;
  std::uint32_t capacity;
  explicit ring(std::uint32_t cap, std::uint32_t rings = 1) : slots(std::size_t{cap} * rings), words(rings), capacity(cap) {
    gpu::init(slots.data(), cap, rings);
    gpu::init(words.data(), cap, rings);
  }
  gpu::ring_view view() { return {slots.data(), words.data(), capacity, static_cast<std::uint32_t>(words.size())}; }
  std::uint64_t& tail(std::uint32_t k = 0) { return words[k].tail; }
  std::int32_t& credits(std::uint32_t k = 0) { return words[k].credits; }
};

// A request that carries its own check: every field derived from (thread, i).
gpu::request make(std::uint32_t thread, std::uint64_t i, std::uint32_t* done) {
  gpu::request r;
  r.offset = (static_cast<std::uint64_t>(thread) << 40) | i;
  r.bytes = i * 7 + thread;
  r.addr = ~r.offset;
  r.done = reinterpret_cast<std::uint64_t>(done);
  r.source = thread;
  r.kind = i % 2 ? gpu::op::write : gpu::op::read;
  return r;
}
bool intact(const gpu::request& r) {
  std::uint32_t thread = r.source;
  std::uint64_t i = r.offset & ((1ull << 40) - 1);
  return (r.offset >> 40) == thread && r.bytes == i * 7 + thread && r.addr == ~r.offset &&
         r.kind == (i % 2 ? gpu::op::write : gpu::op::read);
}

constexpr std::uint64_t second = 1'000'000'000;

}  // namespace

// 8 requesters, 20,000 requests each, through a ring of 64 slots (full most of the time): the proxy
// takes every request once, intact, in ticket order, and every requester gets its own answers.
TEST(GpuRing, EightRequestersAndAProxyLoseAndMixNothing) {
  ring q(64);
  auto v = q.view();
  constexpr int threads = 8;
  constexpr std::uint64_t each = 20000;
  std::atomic<bool> stop{false};
  std::vector<std::uint64_t> seen(threads, 0);
  std::uint64_t bad = 0, taken = 0;
  std::thread proxy([&] {
    std::uint64_t head = 0;
    gpu::request r;
    while (taken < threads * each && !stop) {
      if (!gpu::take(v, head, r)) {
        std::this_thread::yield();
        continue;
      }
      ++taken;
      if (!intact(r)) {
        ++bad;
        continue;
      }
      seen[r.source]++;
      gpu::give(r, head - 1, gpu::status::ok);
    }
  });
  std::vector<std::thread> ts;
  std::atomic<std::uint64_t> unanswered{0}, refused{0};
  for (std::uint32_t t = 0; t < threads; ++t)
    ts.emplace_back([&, t] {
      std::uint32_t done = 0;  // one word per requester, reused by every request
      for (std::uint64_t i = 0; i < each; ++i) {
        std::uint64_t ticket = gpu::submit(v, make(t, i, &done), 10 * second);
        if (ticket == gpu::no_ticket) {
          refused++;
          continue;
        }
        if (gpu::wait(v, &done, ticket, 10 * second) != gpu::status::ok) unanswered++;
      }
    });
  for (auto& x : ts) x.join();
  stop = true;
  proxy.join();
  EXPECT_EQ(refused.load(), 0u);
  EXPECT_EQ(unanswered.load(), 0u);
  EXPECT_EQ(bad, 0u);
  EXPECT_EQ(taken, threads * each);
  for (int t = 0; t < threads; ++t) EXPECT_EQ(seen[static_cast<std::size_t>(t)], each) << "requester " << t;
  EXPECT_EQ(q.tail(), threads * each);
  EXPECT_EQ(q.credits(), 64) << "every credit came back";
}

// Four rings in one view, 8 requesters spreading requests over them by hint, a consumer thread per
// ring: each ring's consumer sees only its own ring's requests, every ticket names its ring, and
// every ring's credits come back.
TEST(GpuRing, RequestsSpreadOverSeveralRingsEachWithItsOwnConsumer) {
  constexpr std::uint32_t rings = 4;
  ring q(16, rings);
  auto v = q.view();
  constexpr int threads = 8;
  constexpr std::uint64_t each = 5000;
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> taken{0}, wrong_ring{0}, bad{0};
  std::vector<std::thread> consumers;
  for (std::uint32_t k = 0; k < rings; ++k)
    consumers.emplace_back([&, k] {
      const gpu::ring_view mine = v.ring(k);
      std::uint64_t head = 0;
      gpu::request r;
      while (!stop) {
        if (!gpu::take(mine, head, r)) {
          std::this_thread::yield();
          continue;
        }
        taken++;
        if (!intact(r)) bad++;
        // Requester t sends request i to ring (t + i) % rings.
        if ((r.source + (r.offset & 0xffffff)) % rings != k) wrong_ring++;
        gpu::give(r, (std::uint64_t{k} << gpu::ring_shift) | (head - 1), gpu::status::ok, rings);
      }
    });
  std::atomic<std::uint64_t> failed{0}, ticket_ring{0};
  std::vector<std::thread> ts;
  for (std::uint32_t t = 0; t < threads; ++t)
    ts.emplace_back([&, t] {
      std::uint32_t done = 0;
      for (std::uint64_t i = 0; i < each; ++i) {
        const auto hint = static_cast<std::uint32_t>(t + i);
        std::uint64_t ticket = gpu::submit(v, make(t, i, &done), 10 * second, hint);
        if (ticket == gpu::no_ticket || gpu::wait(v, &done, ticket, 10 * second) != gpu::status::ok) {
          failed++;
          continue;
        }
        if (gpu::ring_of(ticket) != hint % rings) ticket_ring++;
      }
    });
  for (auto& x : ts) x.join();
  stop = true;
  for (auto& x : consumers) x.join();
  EXPECT_EQ(failed.load(), 0u);
  EXPECT_EQ(bad.load(), 0u);
  EXPECT_EQ(wrong_ring.load(), 0u);
  EXPECT_EQ(ticket_ring.load(), 0u);
  EXPECT_EQ(taken.load(), threads * each);
  std::uint64_t tails = 0;
  for (std::uint32_t k = 0; k < rings; ++k) {
    tails += q.tail(k);
    EXPECT_EQ(q.credits(k), 16) << "ring " << k;
    EXPECT_EQ(q.tail(k), threads * each / rings) << "ring " << k << ": hints spread evenly";
  }
  EXPECT_EQ(tails, threads * each);
}

// Requests nobody has waited for hold every credit: the next submit gives up after its wait and
// takes nothing (no ticket, no slot). Once the proxy takes and answers them and their requesters'
// waits end, submits go through again with the next tickets.
TEST(GpuRing, AFullRingRefusesWithinTheWaitAndTakesNothing) {
  ring q(4);
  auto v = q.view();
  std::uint32_t done[5] = {};
  for (std::uint64_t i = 0; i < 4; ++i) EXPECT_EQ(gpu::submit(v, make(1, i, &done[i]), second), i);
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(gpu::submit(v, make(1, 4, &done[4]), 50'000'000), gpu::no_ticket);
  auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(took, std::chrono::milliseconds(50));
  EXPECT_LT(took, std::chrono::seconds(5));
  EXPECT_EQ(q.tail(), 4u) << "the refused request holds no ticket";
  EXPECT_EQ(q.credits(), 0);
  std::uint64_t head = 0;
  gpu::request r;
  for (std::uint64_t i = 0; i < 4; ++i) {
    ASSERT_TRUE(gpu::take(v, head, r));
    EXPECT_TRUE(intact(r));
    EXPECT_EQ(r.offset & 0xffff, i) << "in ticket order";
    gpu::give(r, i, gpu::status::ok);
  }
  EXPECT_FALSE(gpu::take(v, head, r)) << "nothing else was put in";
  EXPECT_EQ(gpu::submit(v, make(1, 4, &done[4]), 20'000'000), gpu::no_ticket) << "answered is not waited for: the credits are still held";
  for (std::uint64_t i = 0; i < 4; ++i) EXPECT_EQ(gpu::wait(v, &done[i], i, second), gpu::status::ok);
  EXPECT_EQ(q.credits(), 4);
  EXPECT_EQ(gpu::submit(v, make(1, 5, &done[4]), second), 4u);
  ASSERT_TRUE(gpu::take(v, head, r));
  EXPECT_EQ(r.offset & 0xffff, 5u);
}

// A request nobody answers: the requester's wait ends at its deadline (and gives its credit back).
// The late answer, arriving after the word was reused for the next request, is not taken for that
// request's.
TEST(GpuRing, AnUnansweredRequestTimesOutAndALateAnswerIsNotTakenForTheNext) {
  ring q(8);
  auto v = q.view();
  std::uint32_t done = 0;
  std::uint64_t first = gpu::submit(v, make(2, 0, &done), second);
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(gpu::wait(v, &done, first, 30'000'000), gpu::status::timed_out);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(30));
  EXPECT_EQ(q.credits(), 7) << "a request still in its slot keeps its credit";
  std::uint64_t second_ticket = gpu::submit(v, make(2, 1, &done), second);
  std::uint64_t head = 0;
  gpu::request r;
  ASSERT_TRUE(gpu::take(v, head, r));
  gpu::give(r, first, gpu::status::failed);  // the late answer
  ASSERT_TRUE(gpu::take(v, head, r));         // the second, taken and never answered
  EXPECT_EQ(gpu::wait(v, &done, second_ticket, 30'000'000), gpu::status::timed_out) << "the first's answer is not the second's";
  EXPECT_EQ(q.credits(), 7) << "taken, then timed out: the credit came back";
  std::uint64_t third = gpu::submit(v, make(2, 2, &done), second);
  ASSERT_TRUE(gpu::take(v, head, r));
  gpu::give(r, third, gpu::status::out_of_range);
  EXPECT_EQ(gpu::wait(v, &done, third, second), gpu::status::out_of_range) << "the error reaches the requester";
  EXPECT_EQ(q.credits(), 7);
}
