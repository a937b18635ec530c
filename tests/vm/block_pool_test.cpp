// vm::block_pool on the sim backend: small blocks share pages per class and stream, freed blocks come
// back on their own stream only, whole-page blocks keep their size, release() gives kept pages back,
// and a full space is made room in by releasing what is kept.
#include <ferry/core/error.hpp>
#include <ferry/runtime.hpp>
#include <ferry/vm/block_pool.hpp>

#include "support/errors.hpp"
#include "support/sim.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <set>
#include <vector>

using namespace ferry;
using ::testing::HasSubstr;

namespace {
struct fixture {
  runtime rt{test::sim_settings(64ull << 20, 2ull << 20)};
  device& dev = rt.devices().get("sim:0");
  vm::address_space as{dev, 16 * dev.granularity()};
  vm::block_pool pool{as};
  std::uint64_t pg = as.page_bytes();
};
}  // namespace

TEST(VmBlockPool, SmallBlocksShareAPagePerClassAndStreamAndHoldTheirBytes) {
  fixture f;
  std::vector<std::byte*> blocks;
  for (int i = 0; i < 100; ++i) blocks.push_back(static_cast<std::byte*>(f.pool.alloc(3000 + i, 1)));  // class 4 KiB
  EXPECT_EQ(f.pool.stats().pages, 1u) << "100 blocks of 4 KiB in one 2 MiB page";
  EXPECT_EQ(f.pool.stats().in_use, 100u * 4096);
  for (int i = 0; i < 100; ++i) std::memset(blocks[i], i + 1, 3000 + i);
  for (int i = 0; i < 100; ++i)
    for (int k = 0; k < 3000 + i; k += 97) ASSERT_EQ(static_cast<int>(blocks[i][k]), i + 1) << "block " << i << " overlaps another";
  f.pool.alloc(100, 1);  // another class: a page of its own
  f.pool.alloc(3000, 2);  // another stream: a page of its own
  EXPECT_EQ(f.pool.stats().pages, 3u);
}

TEST(VmBlockPool, AFreedBlockComesBackOnItsOwnStreamOnly) {
  fixture f;
  void* a = f.pool.alloc(5000, 7);
  f.pool.free(a);
  void* other = f.pool.alloc(5000, 8);
  EXPECT_NE(other, a) << "a block freed on stream 7 is not handed to stream 8";
  EXPECT_EQ(f.pool.alloc(6000, 7), a) << "the same class on the same stream reuses it";
  EXPECT_GE(f.pool.stats().reused, 1u);

  void* big = f.pool.alloc(3 * f.pg - 5, 7);  // three pages
  f.pool.free(big);
  EXPECT_NE(f.pool.alloc(2 * f.pg, 7), big) << "a whole-page block goes to a request of its page count only";
  EXPECT_EQ(f.pool.alloc(2 * f.pg + 1, 7), big);
}

TEST(VmBlockPool, ReleaseGivesKeptPagesBackAndAFullSpaceReleasesToFit) {
  fixture f;
  std::vector<void*> held;
  for (int i = 0; i < 6; ++i) held.push_back(f.pool.alloc(2 * f.pg, 1));  // 12 of 16 pages
  void* small = f.pool.alloc(1000, 1);
  for (void* p : held) f.pool.free(p);
  EXPECT_EQ(f.pool.stats().kept, 12 * f.pg + f.pg - 1024);
  // 4 pages free in the space, 8 asked on another stream: the kept whole-page blocks make room.
  void* wide = f.pool.alloc(8 * f.pg, 2);
  EXPECT_NE(wide, nullptr);
  EXPECT_EQ(f.pool.stats().pages, 8u + 1u) << "the kept blocks went back; the small block's page stays";
  f.pool.free(wide);
  f.pool.free(small);
  EXPECT_EQ(f.pool.release(), 9 * f.pg);
  EXPECT_EQ(f.pool.stats().pages, 0u);
  EXPECT_EQ(f.pool.stats().kept, 0u);
  void* all = f.as.alloc(16 * f.pg);  // every page is the space's again
  f.as.free(all);
}

TEST(VmBlockPool, PointersItDidNotHandOutAreRefused) {
  fixture f;
  void* a = f.pool.alloc(64, 0);
  std::byte x{};
  EXPECT_THAT(test::error_text([&] { f.pool.free(&x); }), HasSubstr("not a block of this pool in use"));
  f.pool.free(a);
  EXPECT_THAT(test::error_text([&] { f.pool.free(a); }), HasSubstr("not a block of this pool in use")) << "freed twice";
  EXPECT_THAT(test::error_text([&] { f.pool.alloc(0, 0); }), HasSubstr("at least one byte"));
  EXPECT_THROW(f.pool.alloc(32 * f.pg, 0), error) << "more than the space holds";
}
