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
  vm::block_pool pool{as, 16 * dev.granularity()};  // keeps all it is given back (the bound has a test of its own)
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

// A page that is not a power of two (FERRY_VM_PAGE=6MiB over 2 MiB granularity): small classes stop at
// 1 MiB (a quarter of the page, rounded down to a power of two), a request above that takes whole pages,
// and release() gives back exactly the pages of small blocks whose every block is free.
TEST(VmBlockPool, APageThatIsNotAPowerOfTwoKeepsSmallAndWholePageBlocksApart) {
  runtime rt{test::sim_settings(64ull << 20, 2ull << 20)};
  device& dev = rt.devices().get("sim:0");
  vm::space_options o;
  o.page_bytes = 3 * dev.granularity();
  vm::address_space as{dev, 8 * o.page_bytes, o};
  vm::block_pool pool{as};
  const std::uint64_t pg = as.page_bytes();
  ASSERT_EQ(pg, 6ull << 20);
  EXPECT_EQ(pool.small_max(), 1ull << 20);
  void* big = pool.alloc((1ull << 20) + (200 << 10), 0);  // above the small classes: one whole page
  EXPECT_EQ(pool.stats().pages, 1u);
  std::vector<void*> mib;
  for (int i = 0; i < 7; ++i) mib.push_back(pool.alloc(1ull << 20, 0));  // six per page: two pages
  EXPECT_EQ(pool.stats().pages, 3u);
  for (int i = 0; i < 6; ++i) pool.free(mib[static_cast<std::size_t>(i)]);  // the first page's six: all free
  pool.free(big);
  EXPECT_EQ(pool.release(), 2 * pg) << "the whole-page block and the small page whose blocks are all free";
  EXPECT_EQ(pool.stats().pages, 1u) << "the page with a block in use stays";
  std::memset(mib[6], 7, 1ull << 20);  // still usable
  pool.free(mib[6]);
  EXPECT_EQ(pool.release(), pg);
  void* all = as.alloc(8 * pg);  // every page is the space's again
  as.free(all);
}

// Kept whole-page blocks stay within `keep`: past it the blocks freed longest ago go back to the space.
TEST(VmBlockPool, KeptWholePageBlocksStayWithinTheBound) {
  fixture f;
  vm::block_pool pool{f.as, 2 * f.pg};
  std::vector<void*> b;
  for (int i = 0; i < 4; ++i) b.push_back(pool.alloc(f.pg, 0));
  for (void* p : b) pool.free(p);
  EXPECT_EQ(pool.stats().kept, 2 * f.pg);
  EXPECT_EQ(pool.stats().pages, 2u) << "the two freed first went back";
  EXPECT_EQ(pool.alloc(f.pg, 0), b[3]) << "the last freed is reused first";
  EXPECT_EQ(pool.alloc(f.pg, 0), b[2]);
}

// A pool that goes gives every page back to its space: blocks in use, kept blocks and small pages.
TEST(VmBlockPool, APoolThatGoesGivesEveryPageBack) {
  fixture f;
  {
    vm::block_pool pool{f.as};
    pool.alloc(3 * f.pg, 0);
    pool.free(pool.alloc(2 * f.pg, 1));
    pool.alloc(100, 0);
    pool.free(pool.alloc(70000, 2));
    EXPECT_EQ(pool.stats().pages, 3u + 2u + 1u + 1u);
  }
  void* all = f.as.alloc(16 * f.pg);
  f.as.free(all);
}

namespace {
// A marker the test passes by hand.
class hand_marker final : public event {
 public:
  explicit hand_marker(const bool& passed) : passed_(passed) {}

 private:
  bool do_query() override { return passed_; }
  std::string do_describe() const override { return "a test's marker"; }
  const bool& passed_;
};
}  // namespace

// A block freed while other streams may still use it is kept only once the markers recorded on them at
// the free have passed; until then an allocation like it gets another block.
TEST(VmBlockPool, ABlockOtherStreamsMayUseIsKeptOnceTheirMarkersPass) {
  runtime rt{test::sim_settings(64ull << 20, 2ull << 20)};
  device& dev = rt.devices().get("sim:0");
  vm::address_space as{dev, 16 * dev.granularity()};
  bool passed = false;
  int asked = 0;
  vm::block_pool pool{as, 0, [&](std::uintptr_t) {
                        ++asked;
                        std::vector<std::unique_ptr<event>> m;
                        m.push_back(std::make_unique<hand_marker>(passed));
                        return m;
                      }};
  void* small = pool.alloc(4000, 1);
  void* big = pool.alloc(3 << 20, 1);
  pool.free(small);
  pool.free(big);
  EXPECT_EQ(asked, 2);
  EXPECT_EQ(pool.stats().fenced, 4096u + (4u << 20));
  void* small2 = pool.alloc(4000, 1);
  void* big2 = pool.alloc(3 << 20, 1);
  EXPECT_NE(small2, small) << "fenced: not handed out again";
  EXPECT_NE(big2, big);
  EXPECT_EQ(pool.release(), 0u) << "fenced blocks are not kept yet, so not released either";
  passed = true;
  EXPECT_EQ(pool.alloc(4000, 1), small) << "its marker passed: kept, then reused";
  EXPECT_EQ(pool.alloc(3 << 20, 1), big);
  EXPECT_EQ(pool.stats().fenced, 0u);
}

namespace {
// A marker whose stream failed: its query throws.
class failed_marker final : public event {
 private:
  bool do_query() override { fail(errc::io_error, "test.marker", "a stream", "the stream failed"); }
  std::string do_describe() const override { return "a failed marker"; }
};
}  // namespace

// release() first keeps the fenced blocks whose markers passed (empty_cache after a synchronize gives them
// back); a marker whose stream failed counts as passed; a hook that cannot fence leaves the free working,
// the block's pages back to the space instead of kept.
TEST(VmBlockPool, FencedBlocksAfterTheirMarkersAndHooksThatFail) {
  runtime rt{test::sim_settings(64ull << 20, 2ull << 20)};
  device& dev = rt.devices().get("sim:0");
  vm::address_space as{dev, 16 * dev.granularity()};
  const std::uint64_t pg = as.page_bytes();
  bool passed = false;
  int mode = 0;  // 0: a hand marker, 1: a failed marker, 2: the hook throws
  vm::block_pool pool{as, 16 * pg, [&](std::uintptr_t) {
                        std::vector<std::unique_ptr<event>> m;
                        if (mode == 2) fail(errc::io_error, "test.fences", "streams", "cannot record");
                        if (mode == 1) m.push_back(std::make_unique<failed_marker>());
                        else m.push_back(std::make_unique<hand_marker>(passed));
                        return m;
                      }};
  pool.free(pool.alloc(2 * pg, 1));
  EXPECT_EQ(pool.release(), 0u) << "its marker has not passed";
  passed = true;
  EXPECT_EQ(pool.release(), 2 * pg) << "kept once its marker passed, then given back";
  mode = 1;
  void* b = pool.alloc(pg, 1);
  pool.free(b);
  EXPECT_EQ(pool.alloc(pg, 1), b) << "a failed stream's marker counts as passed";
  mode = 2;
  void* c = pool.alloc(pg, 1);
  const auto pages = pool.stats().pages;
  EXPECT_NO_THROW(pool.free(c));
  EXPECT_EQ(pool.stats().pages, pages - 1) << "not kept: back to the space";
  EXPECT_EQ(pool.stats().in_use, pg) << "b is still in use";
}
