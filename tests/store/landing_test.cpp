// The client's landing region and allocated-buffer registry (internal: compiled into this binary).
#include "store/landing.hpp"

#include <ferry/core/error.hpp>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <set>
#include <thread>
#include <vector>

using namespace ferry;
using namespace ferry::store::detail;
using ::testing::HasSubstr;

namespace {

auto soon() { return std::chrono::steady_clock::now() + std::chrono::milliseconds(50); }

// A slot comes back only when the server answered for it, and a caller waiting for a slot gets a
// timeout naming the peer, not a hang; a region that lost half its slots hands out nothing more.
TEST(StoreLanding, SlotsComeBackOnlyWhenAnsweredAndASpentRegionHandsOutNothing) {
  landing_region lr(64 << 10, 2, 3);
  int a = lr.take_slot(64 << 10, soon(), "peer-x"), b = lr.take_slot(64 << 10, soon(), "peer-x");
  ASSERT_NE(a, b);
  EXPECT_EQ(std::abs(lr.slot(a) - lr.slot(b)), 64 << 10);
  EXPECT_GE(lr.slot(a), lr.region().data());
  try {
    lr.take_slot(64 << 10, soon(), "peer-x");
    FAIL() << "a third slot out of two";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::timeout);
    EXPECT_THAT(e.what(), HasSubstr("no free landing slot"));
    EXPECT_THAT(e.what(), HasSubstr("peer-x"));
  }
  lr.give_back_slot(a, false);  // the server may still write it
  EXPECT_EQ(lr.quarantined(), 1u);
  // One of two slots lost: the region is spent, and a caller is told so (-1) instead of waiting.
  EXPECT_TRUE(lr.spent());
  EXPECT_EQ(lr.take_slot(64 << 10, soon(), "peer-x"), -1) << "a spent region handed out a slot";
  lr.give_back_slot(b, true);
  EXPECT_EQ(lr.take_slot(64 << 10, soon(), "peer-x"), -1) << "a spent region handed out a slot";
  EXPECT_EQ(lr.try_take_record(), -1) << "a spent region handed out a record";
}

// Notify records: past the slots, a cache line each, inside the lent region; one the server may still
// write is never handed out again.
TEST(StoreLanding, RecordsLieInsideTheRegionAndComeBackOnlyWhenAnswered) {
  landing_region lr(64 << 10, 2, 3);
  std::set<int> recs;
  for (int i = 0; i < 3; ++i) recs.insert(lr.try_take_record());
  EXPECT_EQ(recs, (std::set<int>{0, 1, 2}));
  EXPECT_EQ(lr.try_take_record(), -1) << "none free: the read goes without one";
  for (int r : recs) {
    auto* p = reinterpret_cast<const std::byte*>(lr.record(r));
    EXPECT_GE(p, lr.slot(1) + (64 << 10));
    EXPECT_LE(p + 16, lr.region().data() + lr.region().size());
  }
  EXPECT_EQ(reinterpret_cast<const std::byte*>(lr.record(1)) - reinterpret_cast<const std::byte*>(lr.record(0)), 64);
  lr.give_back_record(0, false);
  EXPECT_EQ(lr.try_take_record(), -1);
  EXPECT_EQ(lr.quarantined(), 1u);
  EXPECT_FALSE(lr.spent()) << "records do not spend the region";
  EXPECT_EQ(lr.in_use(), 2);
  lr.give_back_record(2, true);
  EXPECT_EQ(lr.try_take_record(), 2);
}

// A quarantined slot is never handed out again; the region is spent once half its slots are lost,
// and a caller waiting for a slot then learns it at once.
TEST(StoreLanding, AQuarantinedSlotIsNeverReusedAndHalfLostSpendsTheRegion) {
  landing_region lr(64 << 10, 4, 1);
  std::vector<int> s;
  for (int i = 0; i < 4; ++i) s.push_back(lr.take_slot(64 << 10, soon(), "peer-y"));
  lr.give_back_slot(s[0], false);
  EXPECT_FALSE(lr.spent());
  EXPECT_THROW(lr.take_slot(64 << 10, soon(), "peer-y"), error) << "a quarantined slot was handed out again";
  lr.give_back_slot(s[1], true);
  EXPECT_EQ(lr.take_slot(64 << 10, soon(), "peer-y"), s[1]);
  // A waiter (no slot free) is woken by the loss that spends the region.
  std::thread later([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    lr.give_back_slot(s[2], false);
  });
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(lr.take_slot(64 << 10, std::chrono::steady_clock::now() + std::chrono::seconds(10), "peer-y"), -1);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  later.join();
  EXPECT_TRUE(lr.spent());
  EXPECT_EQ(lr.quarantined(), 2u);
}

// Small pieces take small slots, past the large ones, and only those; a large piece never takes a
// small slot, and waits for a large one while small ones are free. Small slots lost spend the region
// as large ones do (half of them).
TEST(StoreLanding, SmallPiecesTakeSmallSlotsAndLargeOnesNever) {
  landing_region lr(1 << 20, 2, 4, 64 << 10, 4);
  EXPECT_GE(lr.region().size(), 2u * (1 << 20) + 4u * (64 << 10) + 4 * 64);
  std::set<int> small;
  for (int i = 0; i < 4; ++i) {
    int s = lr.take_slot(4096, soon(), "peer-z");
    ASSERT_GE(s, 2) << "a 4 KiB piece took a large slot";
    EXPECT_EQ(lr.slot(s), lr.slot(0) + 2 * (1 << 20) + static_cast<std::ptrdiff_t>(s - 2) * (64 << 10));
    small.insert(s);
  }
  EXPECT_EQ(small.size(), 4u);
  EXPECT_THROW(lr.take_slot(64 << 10, soon(), "peer-z"), error) << "no small slot free: a small piece took a large one";
  int big = lr.take_slot((64 << 10) + 1, soon(), "peer-z"), big2 = lr.take_slot(1 << 20, soon(), "peer-z");
  EXPECT_LT(big, 2);
  EXPECT_LT(big2, 2);
  EXPECT_EQ(lr.in_use(), 6);
  lr.give_back_slot(*small.begin(), true);
  lr.give_back_slot(big, true);
  EXPECT_EQ(lr.take_slot((64 << 10) + 1, soon(), "peer-z"), big) << "a large piece takes the large slot, not the small one";
  EXPECT_EQ(lr.take_slot(100, soon(), "peer-z"), *small.begin());
  // Half the small slots lost: spent, though every large slot is fine.
  auto it = small.begin();
  lr.give_back_slot(*it++, false);
  EXPECT_FALSE(lr.spent());
  lr.give_back_slot(*it++, false);
  EXPECT_TRUE(lr.spent());
  EXPECT_EQ(lr.quarantined(), 2u);
}

// A request takes an allocated buffer's fast path only when the buffer is live and every lane's
// server mapped it; a freed buffer is never found again, and its entry stays valid for a racing reader.
// Group slots (for the answers of reads sent as one request) lie after the small ones, are taken
// only by try_take_group_slot and only for what they hold, come back like the others, and half of
// them lost spends the region.
TEST(StoreLanding, GroupSlotsLieAfterTheSmallOnesAndAreTakenOnlyForAnswers) {
  landing_region lr(1 << 20, 2, 4, 64 << 10, 2, 260 << 10, 4);
  EXPECT_GE(lr.region().size(), 2u * (1 << 20) + 2u * (64 << 10) + 4u * (260 << 10) + 4 * 64);
  EXPECT_EQ(lr.try_take_group_slot((260 << 10) + 1), -1) << "an answer larger than a group slot took one";
  std::set<int> group;
  for (int i = 0; i < 4; ++i) {
    int s = lr.try_take_group_slot(256 << 10);
    ASSERT_GE(s, 4) << "a group answer took a piece's or a small slot";
    EXPECT_EQ(lr.slot(s), lr.slot(0) + 2 * (1 << 20) + 2 * (64 << 10) + static_cast<std::ptrdiff_t>(s - 4) * (260 << 10));
    EXPECT_LE(lr.slot(s) + (260 << 10), reinterpret_cast<const std::byte*>(lr.record(0))) << "a group slot runs into the records";
    group.insert(s);
  }
  EXPECT_EQ(group.size(), 4u);
  EXPECT_EQ(lr.try_take_group_slot(4096), -1) << "no group slot free";
  int small = lr.try_take_slot(4096), big = lr.try_take_slot(1 << 20);
  EXPECT_TRUE(small >= 2 && small < 4) << "a small piece took a group slot: " << small;
  EXPECT_LT(big, 2);
  EXPECT_EQ(lr.in_use(), 6);
  auto it = group.begin();
  lr.give_back_slot(*it, true);
  EXPECT_EQ(lr.try_take_group_slot(8192), *it) << "an answered group slot did not come back";
  lr.give_back_slot(*it++, false);
  EXPECT_FALSE(lr.spent());
  lr.give_back_slot(*it++, false);
  EXPECT_TRUE(lr.spent()) << "half the group slots lost and the region not spent";
  EXPECT_EQ(lr.try_take_group_slot(4096), -1) << "a spent region handed out a group slot";
  EXPECT_EQ(lr.quarantined(), 2u);
}

TEST(StoreLanding, AllocatedBuffersAreFoundOnlyWhileLiveAndMappedByEveryLane) {
  lent_buffers lb;
  const std::uint64_t all = 0b11;
  auto& b = lb.make(1 << 20);
  const std::byte* p = b.r->data();
  EXPECT_FALSE(lb.covers(p, 10, all)) << "not published yet";
  lb.publish(b);
  EXPECT_TRUE(lb.any());
  EXPECT_FALSE(lb.covers(p, 10, all)) << "no lane mapped it";
  b.lanes = all;
  EXPECT_TRUE(lb.covers(p + 100, 1000, all));
  EXPECT_TRUE(lb.covers(p, 1 << 20, all));
  EXPECT_FALSE(lb.covers(p + 1, 1 << 20, all)) << "one byte past the end";
  EXPECT_FALSE(lb.covers(p - 1, 2, all)) << "one byte before the start";
  lb.lane_lost(1);
  EXPECT_FALSE(lb.covers(p, 10, all)) << "a lane that reconnected has not mapped it yet";
  b.lanes = all;
  EXPECT_EQ(lb.live().size(), 1u);
  EXPECT_EQ(lb.withdraw(p), &b);
  EXPECT_FALSE(lb.covers(p, 10, all));
  EXPECT_FALSE(lb.any());
  lb.retire(b);
  EXPECT_EQ(b.r, nullptr);
  EXPECT_EQ(lb.withdraw(p), nullptr) << "freed twice";
}

}  // namespace
