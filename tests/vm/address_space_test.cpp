// Unified memory on the sim backend: CPU faults (SIGSEGV -> service thread) from many threads,
// migrations both ways, eviction under a small device cap, DONTNEED and READ_MOSTLY, with data checked.
#include <ferry/core/checksum.hpp>
#include <ferry/core/units.hpp>
#include <ferry/io/file_engine.hpp>
#include <ferry/mem/registration.hpp>
#include <ferry/runtime.hpp>
#include <ferry/vm/address_space.hpp>

#include "support/data.hpp"
#include "support/sim.hpp"
#include "support/errors.hpp"
#include "support/fork_touch.hpp"
#include "support/loader_churn.hpp"
#include "support/prefetch_mover.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <sys/wait.h>
#include <unistd.h>
#include <thread>
#include <tuple>

using namespace ferry;
using ::testing::HasSubstr;

namespace {

settings sim_cfg() { return test::sim_settings(64ull << 20); }

void fill(std::byte* p, std::size_t n, std::uint64_t seed) { ferry::test::fill_random(p, n, seed); }
std::uint64_t sum(const std::byte* p, std::size_t n) { return checksum64(p, n); }
// Tests that assert where pages are: no background return (on a loaded machine its quiet time may
// pass between two steps of a test); pages still go back at launches.
vm::space_options placed() {
  vm::space_options o;
  o.return_quiet = std::chrono::nanoseconds::zero();
  return o;
}

}  // namespace

TEST(VmSpace, CpuFaultsFromEightThreadsMoveTheirPagesBothWays) {
  runtime rt(sim_cfg());
  device& dev = rt.devices().get("sim:0");
  vm::space_options o = placed();
  o.fault_ahead = 1;  // a fault moves one page at first: many threads fault on the same pages at once
  vm::address_space as(dev, 32 * (64 << 10), o);
  const std::size_t pg = as.page_bytes();
  auto* p = static_cast<std::byte*>(as.alloc(16 * pg));
  std::vector<std::uint64_t> want(16);
  std::vector<std::thread> th;
  for (int t = 0; t < 8; ++t)
    th.emplace_back([&, t] {  // first touch by the CPU: alloc put the zeroed pages on the device; they come over
      for (int k = 0; k < 2; ++k) {
        std::size_t i = static_cast<std::size_t>(2 * t + k);
        fill(p + i * pg, pg, 100 + i);
        want[i] = sum(p + i * pg, pg);
      }
    });
  for (auto& x : th) x.join();
  th.clear();
  as.advise(p, 16 * pg, vm::advice::prefetch, memory_kind::device);
  for (std::size_t i = 0; i < 16; ++i) EXPECT_EQ(as.pages().snapshot(i).valid, 2u) << "page " << i << " only on the device";
  std::atomic<int> bad{0};
  for (int t = 0; t < 8; ++t)
    th.emplace_back([&, t] {  // every thread reads every page: concurrent faults on the same pages
      for (std::size_t j = 0; j < 16; ++j) {
        std::size_t i = (j + static_cast<std::size_t>(t)) % 16;
        if (sum(p + i * pg, pg) != want[i]) bad++;
      }
    });
  for (auto& x : th) x.join();
  EXPECT_EQ(bad, 0);
  auto s = as.stats();
  // 16 first touches + 16 pages back from the device, each page by a fault of its own or moved ahead
  // of one (faults that come in sequence grow the window past fault_ahead, depending on the order
  // in which the threads' faults arrive).
  EXPECT_GE(as.cpu_faults() + s.fault_ahead, 32u);
  EXPECT_EQ(s.migrations_h2d, 16u);
  EXPECT_EQ(s.migrations_d2h, 32u);  // twice: the first touches, then the reads
  EXPECT_EQ(s.populated, 16u);  // by alloc, on the device
}

// FERRY_VM_REPORT: a space says, when it ends, where its time went -- its counts are the space's own,
// and the largest part of the time is named.
TEST(VmSpace, TheReportAtTheEndSaysWhereTheTimeWent) {
  settings cfg = sim_cfg();
  cfg.vm_report = true;
  runtime rt(cfg);
  device& dev = rt.devices().get("sim:0");
  vm::space_options o = vm::space_options::from(cfg);
  o.return_quiet = std::chrono::nanoseconds::zero();
  o.page_bytes = 0;
  o.fault_ahead = 1;
  EXPECT_TRUE(o.report) << "FERRY_VM_REPORT reaches the space's options";
  std::string said, printed;
  {
    vm::address_space as(dev, 8 * (64 << 10), o);
    const std::size_t pg = as.page_bytes();
    auto* p = static_cast<std::byte*>(as.alloc(4 * pg));
    fill(p, 4 * pg, 3);  // CPU first touch: faults move the pages to the host
    as.advise(p, 4 * pg, vm::advice::prefetch, memory_kind::device);
    said = as.report();
    auto s = as.stats();
    EXPECT_THAT(said, HasSubstr("CPU faults " + std::to_string(as.cpu_faults()) + " "));
    EXPECT_THAT(said, HasSubstr("to a device " + std::to_string(s.migrations_h2d) + " (" + format_size(s.bytes_h2d) + ")"));
    EXPECT_THAT(said, HasSubstr("to the host " + std::to_string(s.migrations_d2h) + " (" + format_size(s.bytes_d2h) + ")"));
    EXPECT_GE(s.migrations_h2d, 4u);
    EXPECT_GT(as.timings().cpu_fault, 0u) << "the time serving CPU faults is counted";
    EXPECT_THAT(said, HasSubstr("most of it: "));
    EXPECT_EQ(said.find("launch callbacks turned on in ") != std::string::npos, as.returns_pages())
        << "the start-up cost of the launch callbacks is said when the space has them";
    testing::internal::CaptureStderr();
  }
  printed = testing::internal::GetCapturedStderr();
  EXPECT_THAT(printed, HasSubstr("ferry unified memory on sim:0"));
  EXPECT_THAT(printed, HasSubstr("migrations: to a device")) << "printed when the space ends";
}

// CPU first touch of fresh memory from 8 threads at once, each writing its own stretch, with the
// default fault-ahead: faults of other threads arrive while pages move ahead behind one thread.
// Every page ends on the host with the bytes its thread wrote, readable without another fault.
TEST(VmSpace, EightThreadsFirstTouchFreshMemoryWhilePagesMoveAhead) {
  runtime rt(sim_cfg());
  device& dev = rt.devices().get("sim:0");
  vm::address_space as(dev, 80 * (64 << 10), placed());
  const std::size_t pg = as.page_bytes(), per = 8 * pg;
  auto* p = static_cast<std::byte*>(as.alloc(8 * per));
  ASSERT_EQ(as.resident(dev), 64u) << "fresh pages start on the device";
  std::vector<std::uint64_t> want(8);
  std::vector<std::thread> th;
  for (int t = 0; t < 8; ++t)
    th.emplace_back([&, t] {
      fill(p + static_cast<std::size_t>(t) * per, per, 500 + static_cast<std::uint64_t>(t));
      want[static_cast<std::size_t>(t)] = sum(p + static_cast<std::size_t>(t) * per, per);
    });
  for (auto& x : th) x.join();
  auto settled = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (as.resident(dev) != 0 && std::chrono::steady_clock::now() < settled) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(as.resident(dev), 0u);
  const std::uint64_t faults = as.cpu_faults();
  for (std::size_t t = 0; t < 8; ++t) EXPECT_EQ(sum(p + t * per, per), want[t]) << "thread " << t << "'s stretch";
  EXPECT_EQ(as.cpu_faults(), faults) << "every page is the CPU's";
  EXPECT_EQ(as.stats().migrations_d2h, 64u) << "each page moved once";
}

// A forked child that touches unified memory (a host-resident page, a device-resident one) ends at
// once with SIGSEGV and a message naming why; it never reaches the parent's service thread, and the
// parent's pages and faults are unaffected.
TEST(VmSpace, AForkedChildTouchingUnifiedMemoryEndsAndTheParentGoesOn) {
  runtime rt(sim_cfg());
  device& dev = rt.devices().get("sim:0");
  vm::address_space as(dev, 8 * (64 << 10), vm::space_options{});
  const std::size_t pg = as.page_bytes();
  auto* p = static_cast<std::byte*>(as.alloc(4 * pg));
  std::vector<std::uint64_t> want(4);
  for (std::size_t i = 0; i < 4; ++i) {
    fill(p + i * pg, pg, 40 + i);
    want[i] = sum(p + i * pg, pg);
  }
  as.advise(p + 2 * pg, 2 * pg, vm::advice::prefetch, memory_kind::device);  // pages 2, 3 on the device
  for (std::size_t page : {std::size_t{0}, std::size_t{3}}) {
    SCOPED_TRACE(page == 0 ? "host-resident page" : "device-resident page");
    auto end = ferry::test::fork_touch(p + page * pg);
    ASSERT_NE(end.status, -1) << "the child hung";
    EXPECT_TRUE(WIFSIGNALED(end.status) && WTERMSIG(end.status) == SIGSEGV) << "status " << end.status;
    EXPECT_THAT(end.said, HasSubstr("belongs to the process that made it"));
  }
  for (std::size_t i = 0; i < 4; ++i) EXPECT_EQ(sum(p + i * pg, pg), want[i]) << "the parent's page " << i;
  fill(p, pg, 77);  // the parent still faults and writes as before
  EXPECT_EQ(sum(p, pg), checksum64(p, pg));
}

// The return policy without hints: pages the CPU took from the device (its writes faulted them
// over) go back before the next kernel launch -- the kernel then reads device memory -- unless their
// PREFERRED_LOCATION is the host.
TEST(VmSpace, PagesTheCpuTookGoBackToTheDeviceBeforeTheNextLaunch) {
  runtime rt(sim_cfg());
  device& dev = rt.devices().get("sim:0");
  vm::space_options o;
  o.return_quiet = std::chrono::nanoseconds::zero();  // at launches only
  o.return_hold = {};  // the CPU's read right after a launch does not hold pages (the next test holds)
  vm::address_space as(dev, 16 * (64 << 10), o);
  ASSERT_TRUE(as.returns_pages()) << "the sim reports its launches";
  const std::size_t pg = as.page_bytes(), n = 8 * pg;
  auto* p = static_cast<std::byte*>(as.alloc(n));
  ASSERT_EQ(as.resident(dev), 8u) << "alloc puts fresh pages on the device";
  auto st = dev.create_stream();
  as.attach_stream(*st);
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(round == 0 ? "no hints" : "page 0 prefers the host");
    fill(p, n, 300 + static_cast<std::uint64_t>(round));  // the CPU's init: every page faults over to the host
    const std::uint64_t want = sum(p, n);
    EXPECT_EQ(as.resident(dev), 0u);
    // Round 1: the CPU's read below took every page back, and page 0 then stopped being taken (it prefers the host).
    EXPECT_EQ(as.pages().cpu_taken(), round == 0 ? 8u : 7u);
    std::uint64_t got = 0;
    st->checksum(p, n, &got);  // the user's kernel
    st->synchronize();
    EXPECT_EQ(got, want) << "the kernel reads what the CPU wrote";
    for (std::size_t i = 0; i < 8; ++i)
      EXPECT_EQ(as.pages().snapshot(i).valid, i == 0 && round == 1 ? 1u : 2u) << "page " << i;
    EXPECT_EQ(sum(p, n), want) << "and the CPU reads it back";
    as.advise(p, pg, vm::advice::preferred_location, memory_kind::host);
  }
  EXPECT_EQ(as.stats().returns, 15u);
  as.detach_stream(*st);
}

// In the background: pages the CPU took and left alone for the quiet time go back to the device
// (no launch needed); a page the CPU keeps using -- taken back right after its return -- is held on
// the host.
TEST(VmSpace, QuietPagesGoBackInTheBackgroundAndAPageKeptInUseStays) {
  runtime rt(sim_cfg());
  device& dev = rt.devices().get("sim:0");
  vm::space_options o;
  o.return_at_launch = false;
  o.return_quiet = std::chrono::milliseconds(50);
  o.return_hold = std::chrono::seconds(30);
  o.fault_ahead = 1;  // page 0's faults must not pull its quiet neighbours back to the host
  vm::address_space as(dev, 16 * (64 << 10), o);
  const std::size_t pg = as.page_bytes(), n = 8 * pg;
  auto* p = static_cast<std::byte*>(as.alloc(n));
  fill(p, n, 400);
  const std::uint64_t want = sum(p, n);
  ASSERT_EQ(as.pages().cpu_taken(), 8u);
  auto* hot = reinterpret_cast<volatile std::uint64_t*>(p);
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  bool settled = false;
  while (!settled && std::chrono::steady_clock::now() < until) {
    *hot = *hot;  // the CPU keeps writing page 0 (the same value: the data stays checkable)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    settled = as.stats().return_holds >= 1 && as.resident(dev) == 7u;
  }
  ASSERT_TRUE(settled) << "returns " << as.stats().returns << ", holds " << as.stats().return_holds << ", resident "
                       << as.resident(dev);
  EXPECT_EQ(as.pages().snapshot(0).valid, 1u) << "the page in use stays on the host";
  for (std::size_t i = 1; i < 8; ++i) EXPECT_EQ(as.pages().snapshot(i).valid, 2u) << "quiet page " << i << " went back";
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(as.pages().snapshot(0).valid, 1u) << "and is held there past the quiet time";
  auto st = dev.create_stream();
  as.attach_stream(*st);
  std::uint64_t got = 0;
  st->checksum(p, n, &got);
  st->synchronize();
  EXPECT_EQ(got, want);
  as.detach_stream(*st);
  EXPECT_EQ(sum(p, n), want) << "the CPU's view after the moves";
}

// An attached stream whose queries fail (the driver shut down at the process's exit while pages were
// still taken): the background return gives up, said once, and the service thread goes on -- it
// serves the next CPU fault. Before, the failure left the service thread and ended the process.
namespace {
class failing_stream final : public stream {
 public:
  explicit failing_stream(device& d) : stream(d, true) {}
  std::atomic<int> asked{0};

 private:
  [[noreturn]] void gone() {
    asked++;
    fail(errc::unavailable, "stream.query", "test stream", "the driver has shut down");
  }
  void do_copy(void*, const void*, std::size_t) override { gone(); }
  void do_fill_pattern(void*, std::size_t, std::uint64_t) override { gone(); }
  void do_checksum(const void*, std::size_t, std::uint64_t*) override { gone(); }
  std::unique_ptr<event> do_record() override { gone(); }
  void do_wait(event&) override { gone(); }
  bool do_idle() override { gone(); }
  void do_synchronize(deadline) override { gone(); }
  void do_write_value(std::uint32_t*, std::uint32_t) override { gone(); }
  void do_wait_value(const std::uint32_t*, std::uint32_t) override { gone(); }
  native_stream do_native_handle() const noexcept override { return {77}; }
};
}  // namespace

TEST(VmSpace, AStreamThatCannotBeAskedStopsTheBackgroundReturnNotTheService) {
  runtime rt(sim_cfg());
  device& dev = rt.devices().get("sim:0");
  vm::space_options o;
  o.return_at_launch = false;
  o.return_quiet = std::chrono::milliseconds(20);
  o.fault_ahead = 1;  // no pages moved ahead of the fault: the one taken is the one touched
  vm::address_space as(dev, 16 * (64 << 10), o);
  ASSERT_TRUE(as.returns_pages());
  const std::size_t pg = as.page_bytes();
  auto* p = static_cast<std::byte*>(as.alloc(4 * pg));
  fill(p, pg, 700);  // the CPU takes page 0: the background return will look at it
  ASSERT_EQ(as.pages().cpu_taken(), 1u);
  failing_stream bad(dev);
  ::testing::internal::CaptureStderr();
  as.attach_stream(bad);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (bad.asked.load() < 3 && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const std::string said = ::testing::internal::GetCapturedStderr();
  EXPECT_GE(bad.asked.load(), 3) << "the background return did not look again after the first failure";
  EXPECT_THAT(said, HasSubstr("returning quiet pages to the device failed"));
  EXPECT_THAT(said, HasSubstr("said once"));
  EXPECT_EQ(as.pages().snapshot(0).valid, 1u) << "the taken page stays on the host";
  as.detach_stream(bad);
  fill(p + 2 * pg, pg, 701);  // the service thread still serves faults
  std::vector<std::byte> want(pg);
  fill(want.data(), pg, 701);
  EXPECT_EQ(sum(p + 2 * pg, pg), sum(want.data(), pg));
}

// A sequential CPU writer slower than the quiet time: the pages moved ahead of it are not returned
// in the background before it gets to them (each would fault back and be held on the host as a
// page the CPU keeps using); once it has passed them they go back.
TEST(VmSpace, PagesMovedAheadOfASlowCpuWriterStayUntilItHasPassedThem) {
  runtime rt(sim_cfg());
  device& dev = rt.devices().get("sim:0");
  vm::space_options o;
  o.return_at_launch = false;
  o.return_quiet = std::chrono::milliseconds(10);
  o.return_hold = std::chrono::seconds(2);
  o.fault_ahead = 4;
  vm::address_space as(dev, 32 * (64 << 10), o);
  const std::size_t pg = as.page_bytes(), pages = 16, n = pages * pg;
  auto* p = static_cast<std::byte*>(as.alloc(n));
  ASSERT_EQ(as.resident(dev), pages);
  for (std::size_t i = 0; i < pages; ++i) {
    fill(p + i * pg, pg, 500 + i);
    std::this_thread::sleep_for(std::chrono::milliseconds(40));  // slower than the quiet time
  }
  EXPECT_EQ(as.stats().return_holds, 0u) << "pages returned ahead of the writer and taken back";
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (as.resident(dev) < pages && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(as.resident(dev), pages) << "every page went back once the writer was done";
  EXPECT_EQ(as.stats().return_holds, 0u);
  for (std::size_t i = 0; i < pages; ++i) {
    std::vector<std::byte> want(pg);
    fill(want.data(), pg, 500 + i);
    EXPECT_EQ(sum(p + i * pg, pg), sum(want.data(), pg)) << "page " << i;
  }
}

// A CPU fault that cannot be served within the space's deadline (its page is pinned by a transfer
// that never ends, so it cannot move to the host) ends the process with a message naming the
// address and why -- never a silent hang.
TEST(VmSpaceDeathTest, AFaultThatCannotBeServedInTimeEndsWithAMessage) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        runtime rt(sim_cfg());
        device& dev = rt.devices().get("sim:0");
        vm::space_options o = placed();
        o.deadline = std::chrono::milliseconds(300);
        vm::address_space as(dev, 4 * (64 << 10), o);
        auto* p = static_cast<volatile std::byte*>(as.alloc(64 << 10));  // on the device
        as.pages().pin(0);                                                // a transfer holds it there
        [[maybe_unused]] std::byte b = p[0];                              // the CPU's read must move it
      },
      "CPU fault at 0x[0-9a-f]+ \\(page 0, read\\) failed: .*pinned by a transfer past the deadline(.|\n)*"
      "fault could not be resolved");
}

// A page larger than the device granularity is zeroed piece by piece (from one zeroed chunk of the
// granularity): every piece, on the device and on the host, and again when the page is allocated anew.
TEST(VmSpace, FreshPagesOfSeveralGranulesAreZeroEverywhere) {
  runtime rt(sim_cfg());
  device& dev = rt.devices().get("sim:0");
  vm::space_options o = placed();
  const std::uint64_t g = dev.granularity();
  o.page_bytes = 4 * g;
  o.device_capacity = 2 * o.page_bytes;
  vm::address_space as(dev, 8 * o.page_bytes, o);
  ASSERT_EQ(as.page_bytes(), 4 * g);
  const std::size_t n = 3 * as.page_bytes();  // two pages on the device, the third on the host
  std::vector<std::byte> zeros(n);
  auto st = dev.create_stream();
  as.attach_stream(*st);
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(round);
    auto* p = static_cast<std::byte*>(as.alloc(n));
    EXPECT_EQ(as.pages().snapshot(2).mapped, vm::host) << "past the cap: host memory";
    std::uint64_t got = 0;
    st->checksum(p, n, &got);
    st->synchronize();
    EXPECT_EQ(got, checksum64(zeros.data(), n)) << "fresh memory reads as zeros on the device";
    EXPECT_EQ(std::memcmp(p, zeros.data(), n), 0) << "and for the CPU, every granule";
    st->fill_pattern(p, n, 77 + round);  // dirty every granule before the page is made fresh again
    st->synchronize();
    as.free(p);
  }
  as.detach_stream(*st);
}

// A device writes memory fresh from alloc before the CPU or a PREFETCH touched it (a kernel's first
// touch): every byte is mapped and zero when alloc returns -- on the device while the space has
// room there, in host memory beyond it -- and an allocation made again over freed pages is zero
// again. (An unmapped page would fail the device's fill: "reserved but not mapped".)
TEST(VmSpace, ADeviceMayTouchFreshMemoryFirst) {
  runtime rt(sim_cfg());
  device& dev = rt.devices().get("sim:0");
  vm::space_options o = placed();
  o.device_capacity = 4 * (64 << 10);
  vm::address_space as(dev, 16 * (64 << 10), o);
  const std::size_t pg = as.page_bytes(), n = 6 * pg;
  auto* p = static_cast<std::byte*>(as.alloc(n));
  EXPECT_EQ(as.resident(dev), 4u) << "as many pages on the device as the cap allows";
  for (std::size_t i = 0; i < 6; ++i) EXPECT_NE(as.pages().snapshot(i).mapped, -1) << "page " << i;
  EXPECT_EQ(as.pages().snapshot(5).mapped, vm::host) << "past the cap: host memory";
  auto st = dev.create_stream();
  as.attach_stream(*st);
  std::vector<std::byte> zeros(n);
  std::uint64_t got = 0;
  st->checksum(p, n, &got);
  st->synchronize();
  EXPECT_EQ(got, checksum64(zeros.data(), n)) << "fresh memory reads as zeros on the device";
  st->fill_pattern(p, n, 42);  // the device's first touch, writing
  st->synchronize();
  EXPECT_EQ(checksum64(p, n), pattern_checksum(n, 42)) << "the CPU sees what the device wrote";
  as.free(p);
  auto* q = static_cast<std::byte*>(as.alloc(n));
  ASSERT_EQ(q, p) << "first fit: the same pages";
  st->checksum(q, n, &got);
  st->synchronize();
  EXPECT_EQ(got, checksum64(zeros.data(), n)) << "allocated again: zero again, on the device";
  EXPECT_EQ(checksum64(q, n), checksum64(zeros.data(), n)) << "and for the CPU";
  as.detach_stream(*st);
}

// A program that reads a little before its first allocation or after its last (a benchmark's
// off-by-some loop) touches mapped memory, as next to cudaMalloc's, instead of ending: the space's
// first and last pages have a mapped page beside them, for the CPU and every device. What lands
// there is never anyone's data.
TEST(VmSpace, ReadsJustOutsideTheSpaceTouchMappedMemory) {
  runtime rt(sim_cfg());
  device& dev = rt.devices().get("sim:0");
  vm::address_space as(dev, 4 * (64 << 10), placed());
  auto* p = static_cast<std::byte*>(as.alloc(as.size()));
  ASSERT_EQ(p, as.base()) << "the first allocation starts the space";
  fill(p, as.size(), 9);
  const std::uint64_t want = sum(p, as.size());
  const std::size_t n = 8192;  // within the pads (at least the device granularity)
  auto* before = p - n;
  auto* after = p + as.size();
  std::vector<std::byte> seen(n);
  std::memcpy(seen.data(), before, n);  // the CPU reads before the first byte
  std::memcpy(seen.data(), after, n);   // and after the last
  std::memset(before, 0x5a, n);         // writes there land somewhere harmless
  std::memset(after, 0xa5, n);
  auto st = dev.create_stream();
  as.attach_stream(*st);
  std::uint64_t got = 0;
  st->checksum(before, n, &got);  // the device reads them too
  st->synchronize();
  std::vector<std::byte> pattern(n, std::byte{0x5a});
  EXPECT_EQ(got, checksum64(pattern.data(), n)) << "the device sees what the CPU wrote before the space";
  st->checksum(after, n, &got);
  st->synchronize();
  std::fill(pattern.begin(), pattern.end(), std::byte{0xa5});
  EXPECT_EQ(got, checksum64(pattern.data(), n));
  EXPECT_EQ(sum(p, as.size()), want) << "the space's own bytes are untouched";
  as.detach_stream(*st);
  as.free(p);
}

// An allocator's free comes as soon as the last work on the memory is queued, not done (torch frees a
// tensor that way): memory allocated again is zeroed only after the attached streams' earlier work,
// which still reads the old bytes.
TEST(VmSpace, MemoryAllocatedAgainIsZeroedAfterTheWorkQueuedBeforeItsFree) {
  runtime rt(sim_cfg());
  device& dev = rt.devices().get("sim:0");
  vm::space_options o = placed();
  o.device_capacity = 64 << 10;  // one page, taken by `first`: the test's pages live in host memory, where
  vm::address_space as(dev, 16 * (64 << 10), o);  // zeroing reuses the very chunk the old work reads
  const std::size_t pg = as.page_bytes(), n = 2 * pg;
  void* first = as.alloc(pg);
  auto st = dev.create_stream();
  as.attach_stream(*st);
  std::vector<std::byte> big_src(48 << 20), big_dst(48 << 20);
  for (int round = 0; round < 5; ++round) {
    auto* a = static_cast<std::byte*>(as.alloc(n));
    ASSERT_EQ(as.pages().snapshot(1).mapped, vm::host);
    fill(a, n, 60 + static_cast<std::uint64_t>(round));
    const std::uint64_t want = sum(a, n);
    st->copy(big_dst.data(), big_src.data(), big_src.size());  // keeps the stream busy for a while
    std::uint64_t got = 0;
    st->checksum(a, n, &got);  // queued: reads a after the copy
    as.free(a);                // the program is done with a (its last use is queued)
    auto* b = static_cast<std::byte*>(as.alloc(n));  // the same pages, zeroed
    ASSERT_EQ(b, a);
    st->synchronize();
    EXPECT_EQ(got, want) << "round " << round << ": the queued read saw the next allocation's zeros";
    as.free(b);
  }
  as.free(first);
  as.detach_stream(*st);
}

TEST(VmSpace, EvictionUnderASmallCapKeepsRandomData) {
  runtime rt(sim_cfg());
  device& dev = rt.devices().get("sim:0");
  vm::space_options o = placed();
  o.device_capacity = 3 * (64 << 10);
  o.thrash_lapse = {};  // every PREFETCH migrates: this test is about eviction
  for (auto pol : {vm::replacement::lru, vm::replacement::fifo}) {
    o.policy = pol;
    vm::address_space as(dev, 16 * (64 << 10), o);
    const std::size_t pg = as.page_bytes();
    auto* p = static_cast<std::byte*>(as.alloc(12 * pg));
    std::vector<std::uint64_t> want(12);
    for (std::size_t i = 0; i < 12; ++i) {
      fill(p + i * pg, pg, 7 + i);
      want[i] = sum(p + i * pg, pg);
    }
    for (int round = 0; round < 3; ++round)
      for (std::size_t i = 0; i < 12; ++i) {
        as.advise(p + i * pg, pg, vm::advice::prefetch, memory_kind::device);
        EXPECT_LE(as.pages().resident(1), 3u);
      }
    for (std::size_t i = 0; i < 12; ++i) EXPECT_EQ(sum(p + i * pg, pg), want[i]) << "page " << i;
    auto s = as.stats();
    EXPECT_GE(s.evictions, 30u);
    EXPECT_GT(s.writebacks, 0u) << "prefetched pages had no host copy left: evicting them must write back";
  }
}

// A stream over twice the cap, twice: the second pass finds the pages of the first half evicted a
// moment ago (thrashing), leaves them on the host -- the device reads them there -- and keeps the
// second half resident instead of evicting it again.
TEST(VmSpace, StreamingOverTwiceTheCapHoldsThrashingPagesOnTheHost) {
  runtime rt(sim_cfg());
  device& dev = rt.devices().get("sim:0");
  vm::space_options o = placed();  // default thrashing mitigation
  o.device_capacity = 4 * (64 << 10);
  vm::address_space as(dev, 16 * (64 << 10), o);
  const std::size_t pg = as.page_bytes();
  constexpr std::size_t n = 8;
  auto* p = static_cast<std::byte*>(as.alloc(n * pg));
  std::vector<std::uint64_t> want(n), got(n);
  for (std::size_t i = 0; i < n; ++i) {
    fill(p + i * pg, pg, 50 + i);
    want[i] = sum(p + i * pg, pg);
  }
  auto st = dev.create_stream();
  as.attach_stream(*st);
  for (int pass = 0; pass < 2; ++pass) {
    auto before = as.stats();
    for (std::size_t w = 0; w < n; w += 2) {
      as.advise(p + w * pg, 2 * pg, vm::advice::prefetch, memory_kind::device);
      st->checksum(p + w * pg, pg, &got[w]);
      st->checksum(p + (w + 1) * pg, pg, &got[w + 1]);
    }
    st->synchronize();
    for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(got[i], want[i]) << "pass " << pass << " page " << i << " as the device reads it";
    auto after = as.stats();
    if (pass == 0) {
      EXPECT_EQ(after.evictions - before.evictions, 4u);
      EXPECT_EQ(after.thrash_holds, 0u);
    } else {
      EXPECT_EQ(after.evictions, before.evictions) << "the second pass evicts nothing";
      EXPECT_EQ(after.thrash_holds, 4u);
      for (std::size_t i = 0; i < 4; ++i) EXPECT_EQ(as.pages().snapshot(i).valid, 1u) << "page " << i << " held on the host";
      for (std::size_t i = 4; i < n; ++i) EXPECT_EQ(as.pages().snapshot(i).valid, 2u) << "page " << i << " still on the device";
    }
  }
  as.detach_stream(*st);
  for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(sum(p + i * pg, pg), want[i]) << "page " << i << " on the CPU";
}

// Ranges move in batches (two in flight), room is made by batched evictions, and a CPU fault brings
// the following device-resident pages along (fault-ahead): the data survives every path, on the CPU
// and as the device's copy engine reads it.
TEST(VmSpace, BatchedPrefetchEvictionAndFaultAheadKeepTheData) {
  runtime rt(sim_cfg());
  device& dev = rt.devices().get("sim:0");
  vm::space_options o = placed();
  o.device_capacity = 8 * (64 << 10);
  o.batch = 2;  // a quarter of the cap: batches of 2, two in flight
  o.fault_ahead = 4;
  o.thrash_lapse = {};  // every PREFETCH migrates: this test is about batched eviction
  vm::address_space as(dev, 40 * (64 << 10), o);
  const std::size_t pg = as.page_bytes();
  constexpr std::size_t n = 24;
  auto* p = static_cast<std::byte*>(as.alloc(n * pg));
  std::vector<std::uint64_t> want(n);
  for (std::size_t i = 0; i < n; ++i) {
    fill(p + i * pg, pg, 300 + i);
    want[i] = sum(p + i * pg, pg);
  }
  auto st = dev.create_stream();
  auto device_sums_ok = [&](std::size_t first, std::size_t end) {
    std::vector<std::uint64_t> got(end - first);
    for (std::size_t i = first; i < end; ++i) st->checksum(p + i * pg, pg, &got[i - first]);
    st->synchronize();
    for (std::size_t i = first; i < end; ++i) EXPECT_EQ(got[i - first], want[i]) << "page " << i << " as the device sees it";
  };
  // Everything to the device: only the last 8 fit; the rest go back to host in batched evictions.
  as.advise(p, n * pg, vm::advice::prefetch, memory_kind::device);
  EXPECT_EQ(as.pages().resident(1), 8u);
  for (std::size_t i = n - 8; i < n; ++i) EXPECT_EQ(as.pages().snapshot(i).valid, 2u) << "page " << i;
  device_sums_ok(0, n);  // device-resident pages from device memory, the others over the "bus"
  auto s = as.stats();
  EXPECT_GT(s.batches, 8u);
  EXPECT_GE(s.evictions, 16u);
  EXPECT_GT(s.writebacks, 0u) << "pages moved to the device alone are dirty: evicting them copies back";
  // The CPU reads it all back: a fault on a device page brings the next ones along, after the
  // faulting thread runs on (a read that overtakes them faults and moves its own page). Every
  // device page moves once, by a fault or ahead of one; once moved, the CPU may read it: a second
  // pass faults no more.
  auto s0 = as.stats();
  for (std::size_t i = 0; i < n - 8; ++i) EXPECT_EQ(sum(p + i * pg, pg), want[i]) << "page " << i;
  for (std::size_t i = n - 8; i < n; ++i) EXPECT_EQ(sum(p + i * pg, pg), want[i]) << "page " << i;
  auto s1 = as.stats();
  EXPECT_EQ(s1.migrations_d2h - s0.migrations_d2h, 8u) << "the 8 device-resident pages, once each";
  EXPECT_EQ((s1.faults - s0.faults) + (s1.fault_ahead - s0.fault_ahead), 8u);
  EXPECT_GE(s1.fault_ahead - s0.fault_ahead, 1u) << "a fault brought pages along";
  std::uint64_t cpu1 = as.cpu_faults();
  for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(sum(p + i * pg, pg), want[i]) << "page " << i;
  EXPECT_EQ(as.cpu_faults(), cpu1) << "pages moved ahead are the CPU's at once";
  EXPECT_EQ(as.pages().resident(1), 0u);
  // READ_MOSTLY: the device gets duplicates, evictions drop them without copying.
  as.advise(p, n * pg, vm::advice::read_mostly);
  auto before = as.stats();
  as.advise(p, n * pg, vm::advice::prefetch, memory_kind::device);
  auto after = as.stats();
  EXPECT_GE(after.clean_drops - before.clean_drops, 16u);
  EXPECT_EQ(after.writebacks, before.writebacks);
  device_sums_ok(0, n);
  for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(sum(p + i * pg, pg), want[i]) << "page " << i << " (read-mostly)";
  // Back to host in batches, then a write makes the host copy the only one again.
  as.advise(p, n * pg, vm::advice::no_read_mostly);
  as.advise(p, n * pg, vm::advice::prefetch, memory_kind::host);
  EXPECT_EQ(as.pages().resident(1), 0u);
  fill(p, pg, 999);
  EXPECT_EQ(as.pages().snapshot(0).valid, 1u);
  as.free(p);
}

TEST(VmSpace, DontneedThenCpuReadAndReadMostlyInvalidation) {
  runtime rt(sim_cfg());
  device& dev = rt.devices().get("sim:0");
  vm::address_space as(dev, 8 * (64 << 10));
  const std::size_t pg = as.page_bytes();
  auto* p = static_cast<std::byte*>(as.alloc(2 * pg));
  fill(p, 2 * pg, 5);
  auto want = sum(p, 2 * pg);
  as.advise(p, 2 * pg, vm::advice::prefetch, memory_kind::device);
  as.advise(p, 2 * pg, vm::advice::dontneed);
  EXPECT_EQ(as.pages().snapshot(0).valid, 1u);
  EXPECT_EQ(sum(p, 2 * pg), want) << "DONTNEED kept the data";
  // READ_MOSTLY: the device gets a copy and the host keeps one (CPU reads need no copy) ...
  as.advise(p, pg, vm::advice::read_mostly);
  as.advise(p, pg, vm::advice::prefetch, memory_kind::device);
  EXPECT_EQ(as.pages().snapshot(0).valid, 3u);
  auto d2h = as.stats().migrations_d2h;
  EXPECT_EQ(sum(p, pg), sum(p, pg));
  EXPECT_EQ(as.stats().migrations_d2h, d2h) << "a CPU read of a duplicated page copies nothing";
  // ... until the CPU writes: the device copy is invalidated.
  p[100] = std::byte{0x42};
  EXPECT_EQ(as.pages().snapshot(0).valid, 1u);
  EXPECT_GE(as.stats().invalidations, 1u);
  as.advise(p, pg, vm::advice::prefetch, memory_kind::device);
  as.advise(p, pg, vm::advice::prefetch, memory_kind::host);
  EXPECT_EQ(p[100], std::byte{0x42});
  // Bad input.
  EXPECT_THAT(test::error_text([&] { as.advise(p + 100 * pg, pg, vm::advice::prefetch); }), HasSubstr("not inside this address space"));
  EXPECT_THAT(test::error_text([&] { as.free(p + 1); }), HasSubstr("not an allocation"));
  EXPECT_THAT(test::error_text([&] { as.alloc(100 * pg); }), HasSubstr("no 100 free pages"));
  as.free(p);
}

// One space over two devices: every pointer is valid on the CPU and on both; pages move between
// host and either device and from one device to the other; each device reads pages living on the
// other (peer access); READ_MOSTLY copies on both devices are invalidated by a CPU write; each device
// has its own cap.
TEST(VmSpace, TwoDevicesShareOnePointer) {
  runtime rt(sim_cfg());
  device& d0 = rt.devices().get("sim:0");
  device& d1 = rt.devices().get("sim:1");
  device* both[] = {&d0, &d1};
  vm::space_options o = placed();
  o.device_capacity = 6 * (64 << 10);
  o.thrash_lapse = {};
  o.return_at_launch = false;  // the CPU-written pages stay on the host until the prefetches below
  vm::address_space as(both, 32 * (64 << 10), o);
  EXPECT_EQ(as.devices().size(), 2u);
  EXPECT_EQ(as.device_capacity(d1), 6u * (64 << 10));
  const std::size_t pg = as.page_bytes(), n = 4 * pg;
  auto* p = static_cast<std::byte*>(as.alloc(n));
  fill(p, n, 17);  // first touch on the CPU: host pages
  const auto want = sum(p, n);
  auto s0 = d0.create_stream(), s1 = d1.create_stream();
  as.attach_stream(*s0);
  as.attach_stream(*s1);
  auto dsum = [&](stream& s) {
    std::uint64_t r = 0;
    s.checksum(p, n, &r);
    s.synchronize();
    return r;
  };
  EXPECT_EQ(dsum(*s0), want) << "sim:0 reads host-resident pages";
  EXPECT_EQ(dsum(*s1), want) << "sim:1 reads them too";

  as.advise(p, n, vm::advice::prefetch, location::on_device(1));
  EXPECT_EQ(as.resident(d1), 4u);
  EXPECT_EQ(as.resident(d0), 0u);
  EXPECT_EQ(as.stats().migrations_h2d, 4u);
  EXPECT_EQ(dsum(*s1), want) << "sim:1 reads its own memory";
  EXPECT_EQ(dsum(*s0), want) << "sim:0 reads pages living on sim:1 (peer access)";

  as.advise(p, n, vm::advice::prefetch, location::on_device(0));
  EXPECT_EQ(as.resident(d0), 4u);
  EXPECT_EQ(as.resident(d1), 0u);
  EXPECT_EQ(as.stats().migrations_d2d, 4u) << "device to device, not through the host";
  EXPECT_EQ(dsum(*s1), want);

  s1->fill_pattern(p, n, 23);  // sim:1 writes pages living on sim:0
  s1->synchronize();
  EXPECT_EQ(sum(p, n), pattern_checksum(n, 23)) << "the CPU reads what sim:1 wrote (fault path)";

  // READ_MOSTLY: a copy on each device and the host; a CPU write leaves the host's alone.
  as.advise(p, pg, vm::advice::read_mostly);
  as.advise(p, pg, vm::advice::prefetch, location::on_device(0));
  as.advise(p, pg, vm::advice::prefetch, location::on_device(1));
  EXPECT_EQ(as.pages().snapshot(0).valid, 7u) << "host, sim:0 and sim:1 hold copies";
  p[5] = std::byte{0x5a};
  EXPECT_EQ(as.pages().snapshot(0).valid, 1u);
  EXPECT_GE(as.stats().invalidations, 2u);
  as.advise(p, pg, vm::advice::prefetch, location::on_device(1));
  std::vector<std::byte> back(pg);
  s0->copy(back.data(), p, pg);  // sim:0's engine reads the page on sim:1
  s0->synchronize();
  EXPECT_EQ(back[5], std::byte{0x5a});
  as.advise(p, pg, vm::advice::no_read_mostly);

  // DONTNEED on one device; the other keeps its pages.
  as.advise(p, n, vm::advice::prefetch, location::on_device(0));
  as.advise(p + pg, pg, vm::advice::prefetch, location::on_device(1));
  as.advise(p, n, vm::advice::dontneed, location::on_device(0));
  EXPECT_EQ(as.resident(d0), 0u);
  EXPECT_EQ(as.resident(d1), 1u);

  // Each device has its own cap: 10 pages on sim:1 evict, none on sim:0.
  auto* q = static_cast<std::byte*>(as.alloc(10 * pg));
  fill(q, 10 * pg, 29);
  const auto wq = sum(q, 10 * pg);
  as.advise(q, 10 * pg, vm::advice::prefetch, location::on_device(1));
  EXPECT_LE(as.resident(d1), 6u);
  EXPECT_GE(as.stats().evictions, 4u);
  EXPECT_EQ(sum(q, 10 * pg), wq);

  // Bad input names what was wrong.
  EXPECT_THAT(test::error_text([&] { as.advise(p, pg, vm::advice::prefetch, location::on_device(5)); }),
              HasSubstr("not a device of this address space (sim:0, sim:1)"));
  device* twice[] = {&d0, &d0};
  EXPECT_THAT(test::error_text([&] { vm::address_space bad(twice, 4 * pg); }), HasSubstr("given twice"));
  as.detach_stream(*s0);
  as.detach_stream(*s1);
  as.free(q);
  as.free(p);
  EXPECT_EQ(as.resident(d0) + as.resident(d1), 0u);
}

TEST(VmSpace, DevicesWithoutPeerAccessCannotShareASpace) {
  settings c = sim_cfg();
  c.sim_peer = false;
  runtime rt(c);
  device* both[] = {&rt.devices().get("sim:0"), &rt.devices().get("sim:1")};
  EXPECT_THAT(test::error_text([&] { vm::address_space as(both, 4 * (64 << 10)); }), HasSubstr("FERRY_SIM_PEER=0"));
}

// Attached streams: their queued work completes before a migration copies or remaps (the data the
// CPU faults in is the finished fill). The sim backend runs work in order, so this cannot show the
// race itself -- tests/vm/gpu_vm_test.cpp does, on independent CUDA streams.
TEST(VmSpace, AttachedStreamsAndTheirErrors) {
  settings c = sim_cfg();
  c.sim_granularity = 1 << 20;
  runtime rt(c);
  device& dev = rt.devices().get("sim:0");
  vm::address_space as(dev, 32 << 20);
  const std::size_t n = 24 << 20;
  auto* p = static_cast<std::byte*>(as.alloc(n));
  auto s = dev.create_stream();
  as.attach_stream(*s);
  as.attach_stream(*s);  // idempotent
  for (int round = 0; round < 3; ++round) {
    as.advise(p, n, vm::advice::prefetch, memory_kind::device);
    s->fill_pattern(p, n, 300 + static_cast<std::uint64_t>(round));  // queued, not waited for
    EXPECT_EQ(sum(p, n), pattern_checksum(n, 300 + static_cast<std::uint64_t>(round))) << "round " << round;
  }
  as.detach_stream(*s);
  auto other = rt.devices().get("sim:1").create_stream();
  EXPECT_THAT(test::error_text([&] { as.attach_stream(*other); }), HasSubstr("another device"));
}

// A CPU touch of a device page while the program's stream still runs work waits for that work (a
// space without GPU faults moves pages only between kernels), and the space says once that the
// program may be using the same memory from the CPU and a running kernel at the same time.
TEST(VmSpace, ACpuTouchWhileAStreamRunsWaitsAndIsToldOnce) {
  settings c = sim_cfg();
  c.sim_granularity = 1 << 20;
  runtime rt(c);
  device& dev = rt.devices().get("sim:0");
  vm::address_space as(dev, 8 << 20);
  auto* p = static_cast<std::byte*>(as.alloc(4 << 20));
  auto s = dev.create_stream();
  as.attach_stream(*s);
  alignas(4) std::uint32_t hold = 0;
  std::string said;
  for (int round = 0; round < 2; ++round) {
    as.advise(p, 4 << 20, vm::advice::prefetch, memory_kind::device);
    s->wait_value(&hold, static_cast<std::uint32_t>(round + 1));  // a long kernel of the program's
    std::thread release([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      std::atomic_ref<std::uint32_t>(hold).store(static_cast<std::uint32_t>(round + 1));
    });
    ::testing::internal::CaptureStderr();
    const auto t0 = std::chrono::steady_clock::now();
    p[round] = std::byte{7};  // the CPU faults while the stream waits
    const auto waited = std::chrono::steady_clock::now() - t0;
    said += ::testing::internal::GetCapturedStderr();
    release.join();
    EXPECT_GE(waited, std::chrono::milliseconds(80)) << "the fault did not wait for the stream's work";
    EXPECT_EQ(p[round], std::byte{7});
  }
  as.detach_stream(*s);
  EXPECT_THAT(said, HasSubstr("while the program's work on its streams ran"));
  EXPECT_EQ(said.find("while the program's work"), said.rfind("while the program's work")) << "said more than once:\n" << said;
}

// A page that stays on the host through a launch (here: its PREFERRED_LOCATION) is reached by the
// kernel in place. While the launched work may run, the CPU still reads the page at once, but its
// write waits for that work: a CPU write (an atomic counter both sides add to, say) never runs
// beside a kernel on the same page, whose atomics over the bus are not atomic with the CPU's.
TEST(VmSpace, ACpuWriteToAHostPageWaitsForTheWorkLaunchedSince) {
  settings c = sim_cfg();
  c.sim_granularity = 1 << 20;
  runtime rt(c);
  device& dev = rt.devices().get("sim:0");
  vm::address_space as(dev, 8 << 20, placed());
  ASSERT_TRUE(as.returns_pages()) << "the sim reports its launches";
  const std::size_t n = 2 << 20;
  auto* p = static_cast<std::byte*>(as.alloc(n));
  as.advise(p, n, vm::advice::preferred_location, memory_kind::host);
  fill(p, n, 500);  // the CPU writes both pages: on the host, writable
  auto s = dev.create_stream();
  as.attach_stream(*s);
  using clk = std::chrono::steady_clock;
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(round);
    alignas(4) std::uint32_t hold = 0;
    s->wait_value(&hold, 1);  // the program's work, running until released
    std::uint64_t got = 0;
    s->checksum(p, n, &got);  // a launch: the pages stay on the host
    std::atomic<clk::rep> released{0};
    std::thread release([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      released = clk::now().time_since_epoch().count();
      std::atomic_ref<std::uint32_t>(hold).store(1);
    });
    volatile std::byte b = p[1 << 20];  // a read goes on
    (void)b;
    const auto read_at = clk::now().time_since_epoch().count();
    p[round] = std::byte{9};  // a write waits for the work
    const auto written_at = clk::now().time_since_epoch().count();
    release.join();
    EXPECT_LT(read_at, released.load()) << "a read waited for the stream";
    EXPECT_GE(written_at, released.load()) << "the CPU wrote beside the launched work";
    EXPECT_EQ(p[round], std::byte{9});
    s->synchronize();
    p[(1 << 20) + round] = std::byte{9};  // with nothing launched since, the next page is written too
    EXPECT_EQ(p[(1 << 20) + round], std::byte{9});
  }
  EXPECT_EQ(as.resident(dev), 0u) << "the pages stayed on the host throughout";
  // The user can tell where the time went: the writes' waits, apart from the faults' own work.
  EXPECT_GE(as.timings().write_wait, 2 * 250'000'000ull);
  const std::string said = as.report();
  EXPECT_THAT(said, HasSubstr("CPU writes to host pages after a launch"));
  EXPECT_THAT(said, HasSubstr("most of it")) << said;
  EXPECT_THAT(said, HasSubstr("CPU writes waiting for kernels")) << said;
  as.detach_stream(*s);
}

// The wait of such a write is bounded: work that outlasts the space's deadline (a kernel that waits for
// the CPU, or a long one beside a CPU producer) lets the write go on beside it, said once -- it
// neither hangs the CPU nor ends the process.
TEST(VmSpace, ACpuWriteWaitsForLaunchedWorkOnlyUntilTheDeadline) {
  settings c = sim_cfg();
  c.sim_granularity = 1 << 20;
  runtime rt(c);
  device& dev = rt.devices().get("sim:0");
  vm::space_options o = placed();
  o.deadline = std::chrono::milliseconds(300);
  vm::address_space as(dev, 8 << 20, o);
  const std::size_t n = 2 << 20;  // two pages
  auto* p = static_cast<std::byte*>(as.alloc(n));
  as.advise(p, n, vm::advice::preferred_location, memory_kind::host);
  fill(p, n, 600);
  auto s = dev.create_stream();
  as.attach_stream(*s);
  using clk = std::chrono::steady_clock;
  alignas(4) std::uint32_t hold = 0;
  s->wait_value(&hold, 1);  // work that ends only after the writes below
  std::uint64_t got = 0;
  s->checksum(p, n, &got);  // a launch: it takes the CPU's write access to both pages
  ::testing::internal::CaptureStderr();
  auto t0 = clk::now();
  p[0] = std::byte{5};
  const auto waited = clk::now() - t0;
  // The same work still runs: a write to the other page only looks, it does not wait a deadline again.
  t0 = clk::now();
  p[1 << 20] = std::byte{6};
  const auto waited_again = clk::now() - t0;
  const std::string said = ::testing::internal::GetCapturedStderr();
  EXPECT_GE(waited, std::chrono::milliseconds(250)) << "the write did not wait for the launched work";
  EXPECT_LT(waited_again, std::chrono::milliseconds(150)) << "a second write waited the deadline again for the same work: " << said;
  EXPECT_EQ(p[0], std::byte{5});
  EXPECT_EQ(p[1 << 20], std::byte{6});
  EXPECT_THAT(said, HasSubstr("the write goes on beside it"));
  std::atomic_ref<std::uint32_t>(hold).store(1);
  s->synchronize();
  // That work seen finished, a write after the next launch waits for its work again.
  alignas(4) std::uint32_t hold2 = 0;
  s->wait_value(&hold2, 1);
  s->checksum(p, n, &got);
  std::thread release([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    std::atomic_ref<std::uint32_t>(hold2).store(1);
  });
  t0 = clk::now();
  p[1] = std::byte{7};
  const auto waited_after = clk::now() - t0;
  release.join();
  EXPECT_GE(waited_after, std::chrono::milliseconds(150)) << "writes went on looking after the work had finished";
  EXPECT_EQ(p[1], std::byte{7});
  s->synchronize();
  as.detach_stream(*s);
}

// A prefetch does not hold the program while its stream's work runs (CUDA runs it in the stream's
// order): a kernel that waits for the CPU to act after the call must not make the call wait for it
// (a deadline, then an error, before). The pages move once the stream is idle.
TEST(VmSpace, APrefetchBehindBusyStreamsReturnsAndMovesThePagesWhenTheyAreIdle) {
  runtime rt(sim_cfg());
  device& dev = rt.devices().get("sim:0");
  vm::space_options o = placed();
  o.deadline = std::chrono::seconds(5);
  vm::address_space as(dev, 16 * (64 << 10), o);
  const std::size_t n = 4 * (64 << 10);
  auto* p = static_cast<std::byte*>(as.alloc(n));
  as.advise(p, n, vm::advice::prefetch, memory_kind::host);
  fill(p, n, 601);
  const std::uint64_t before = sum(p, n);
  ASSERT_EQ(as.resident(dev), 0u);
  auto s = dev.create_stream();
  as.attach_stream(*s);
  alignas(4) std::uint32_t hold = 0;
  s->wait_value(&hold, 1);  // work that ends only after the CPU acts, after the prefetch
  using clk = std::chrono::steady_clock;
  auto t0 = clk::now();
  as.advise(p, n, vm::advice::prefetch, memory_kind::device);
  EXPECT_LT(clk::now() - t0, std::chrono::seconds(1)) << "the prefetch waited for the stream's work";
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  EXPECT_EQ(as.resident(dev), 0u) << "pages moved while the stream's work still ran";
  std::atomic_ref<std::uint32_t>(hold).store(1);
  s->synchronize();
  const auto settled = clk::now() + std::chrono::seconds(5);
  while (as.resident(dev) != 4u && clk::now() < settled) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(as.resident(dev), 4u) << "the prefetch was not done once the stream was idle";
  EXPECT_EQ(sum(p, n), before);
  // A prefetch while the streams are idle is done before the call returns, as before.
  as.advise(p, n, vm::advice::prefetch, memory_kind::host);
  EXPECT_EQ(as.resident(dev), 0u);
  as.detach_stream(*s);
  as.free(p);
}

// Unified memory as a DMA target: file reads into a unified pointer while another thread keeps
// moving its pages between host and device. The space is a peer-memory client of the runtime's
// registration cache: each request pins the pages it uses (in place, exclusive) only while it runs.
TEST(VmSpace, FileReadsIntoUnifiedMemoryWhilePagesMove) {
  runtime rt(sim_cfg());
  device& dev = rt.devices().get("sim:0");
  vm::space_options o = placed();
  o.device_capacity = 4 * (64 << 10);
  vm::address_space as(dev, 16 * (64 << 10), o);
  const std::size_t pg = as.page_bytes(), n = 8 * pg;
  auto* p = static_cast<std::byte*>(as.alloc(n));
  EXPECT_EQ(rt.registrations().classify(p + 5, 100).type, memory_type::unified);
  auto path = std::filesystem::path(::testing::TempDir()) / ("ferry-vm-" + std::to_string(::getpid()) + ".bin");
  std::vector<std::byte> data(n);
  fill(data.data(), n, 99);
  ferry::test::write_file(path, data.data(), n);
  auto f = file::open(path.string(), open_mode::read);
  ferry::test::prefetch_mover mover(as, p, 8, pg, 3);
  // Rounds go on until the mover has moved pages meanwhile (on a loaded machine its thread may
  // get little time): what is asserted is that reads stay right while pages move, not a rate.
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (int round = 0; round < 6 || (mover.moves() <= 10 && std::chrono::steady_clock::now() < until); ++round) {
    std::memset(p, 0, n);  // the CPU clears it (faults pages back as needed)
    file_request r{f, 0, p, n, false};
    auto b = rt.files().submit({&r, 1});
    ASSERT_TRUE(b.wait());
    b.check();
    EXPECT_EQ(sum(p, n), checksum64(data.data(), n)) << "round " << round;
  }
  mover.stop();
  std::filesystem::remove(path);
  EXPECT_GT(mover.moves(), 10);
  EXPECT_EQ(mover.errors(), 0);
  for (std::size_t i = 0; i < 8; ++i) EXPECT_EQ(as.pages().snapshot(i).pins, 0u) << "page " << i << " unpinned after the reads";
  EXPECT_GT(as.stats().migrations_h2d, 0u);
}

// A space made with default options is known to every registration cache of the process -- the
// runtime's, and one made after the space -- so ferry's transfers hold the pages they copy. Eight
// threads copy random 4 KiB pages of CPU-written unified memory concurrently; every word is checked
// (a space the caches did not know was copied as plain device memory: zeros, or "not mapped").
TEST(VmSpace, EveryRegistrationCacheKnowsASpaceAndItsCopiesAreRight) {
  runtime rt(sim_cfg());
  device& dev = rt.devices().get("sim:0");
  vm::address_space as(dev, 4 << 20, vm::space_options::from(rt.config()));
  const std::uint64_t words = (1 << 20) / 4, pages = words * 4 / 4096;
  auto* p = static_cast<std::uint32_t*>(as.alloc(words * 4));
  auto value = [](std::uint64_t i) { return static_cast<std::uint32_t>(i * 0x9E3779B1u + 3); };
  for (std::uint64_t i = 0; i < words; ++i) p[i] = value(i);
  EXPECT_EQ(rt.registrations().classify(p + 7, 64).type, memory_type::unified);
  {
    runtime later(sim_cfg());
    EXPECT_EQ(later.registrations().classify(p + 7, 64).type, memory_type::unified);
  }
  constexpr int threads = 8, rounds = 400, per_round = 8;
  std::vector<std::uint32_t> dst(threads * per_round * 1024);
  std::atomic<int> wrong{0}, failed{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t)
    ts.emplace_back([&, t] {
      std::uint64_t x = 0x9E3779B97F4A7C15ull * (t + 1);
      for (int round = 0; round < rounds; ++round) {
        std::vector<transfer_request> q;
        std::vector<std::uint64_t> pg;
        for (int k = 0; k < per_round; ++k) {
          x ^= x << 13, x ^= x >> 7, x ^= x << 17;
          pg.push_back(x % pages);
          q.push_back({dst.data() + (t * per_round + k) * 1024, p + pg.back() * 1024, 4096});
        }
        std::atomic<int> left{per_round};
        for (auto& one : q) {
          try {
            rt.engine().submit({&one, 1}, {}, [&](std::span<const request_result> r) {
              if (r[0].state != request_state::done) failed++;
              left--;
            });
          } catch (const std::exception& e) {
            ADD_FAILURE() << "submit: " << e.what();
            left--;
          }
        }
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
        while (left.load() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
        if (left.load()) {  // a completion lost: the callbacks still hold `left`, so no way on but out
          std::fprintf(stderr, "%d copies never completed\n", left.load());
          std::abort();
        }
        for (int k = 0; k < per_round; ++k)
          for (int w = 0; w < 1024; ++w)
            if (dst[(t * per_round + k) * 1024 + w] != value(pg[k] * 1024 + w)) {
              wrong++;
              break;
            }
      }
    });
  for (auto& th : ts) th.join();
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(wrong.load(), 0) << "pages copied wrong of " << threads * rounds * per_round;
  for (std::uint64_t i = 0; i < (words * 4 + as.page_bytes() - 1) / as.page_bytes(); ++i)
    EXPECT_EQ(as.pages().snapshot(i).pins, 0u) << "page " << i << " unpinned after the copies";
}

// The loader of a model larger than its device cap while the model's code churns the space
// (tests/support/loader_churn.hpp; on a GPU, GpuVm.LoaderReadsWhileOtherAllocationsComeAndGoOverTheCap).
TEST(VmSpace, LoaderReadsWhileOtherAllocationsComeAndGoOverTheCap) {
  runtime rt(test::sim_settings(512ull << 20, 2ull << 20));
  device& dev = rt.devices().get("sim:0");
  vm::space_options o;  // the default fault deadline: a busy CI machine may be slow to serve a fault
  o.device_capacity = 8 * dev.granularity();
  o.thrash_lapse = std::chrono::nanoseconds(0);
  vm::address_space as(dev, 96 * dev.granularity(), o);
  std::printf("%s\n", test::loader_under_churn(rt, as, 2).c_str());
}

// A copy into unified memory covers pages mapped in one place only: the driver decides how to copy
// a range from what it finds there (the offload abort: a copy from a device page on into host pages
// was done by the CPU). one_place says where a range's first place ends; the engine's copies across
// places are cut there and every byte arrives.
TEST(VmSpace, ACopyIsCutWherePagesAreMappedElsewhere) {
  runtime rt(test::sim_settings(64ull << 20, 2ull << 20));
  device& dev = rt.devices().get("sim:0");
  vm::address_space as(dev, 8 * dev.granularity());
  const std::size_t pg = as.page_bytes();
  auto* p = static_cast<std::byte*>(as.alloc(3 * pg));
  auto put = [&](memory_kind a, memory_kind b, memory_kind c) {
    as.advise(p, pg, vm::advice::prefetch, a);
    as.advise(p + pg, pg, vm::advice::prefetch, b);
    as.advise(p + 2 * pg, pg, vm::advice::prefetch, c);
  };
  auto* at = p + pg - 1016;
  const std::size_t n = 2 * pg;  // 1016 bytes of page 0, page 1, all but 1016 bytes of page 2
  const memory_region m = rt.registrations().classify(at, n);
  ASSERT_EQ(m.type, memory_type::unified);
  ASSERT_NE(m.client, nullptr);
  auto one_place = [&](const std::byte* q, std::uint64_t k) { return m.client->one_place(reinterpret_cast<std::uintptr_t>(q), k); };

  put(memory_kind::device, memory_kind::host, memory_kind::host);
  EXPECT_EQ(one_place(at, n), 1016u) << "the device page's part alone";
  EXPECT_EQ(one_place(at + 1016, n - 1016), n - 1016) << "the two host pages together";
  put(memory_kind::host, memory_kind::host, memory_kind::device);
  EXPECT_EQ(one_place(at, n), 1016u + pg) << "the host pages, up to the device one";
  EXPECT_EQ(one_place(p + 10, 100), 100u) << "within one page";

  std::vector<std::byte> src(n), back(n);
  counter& cut = rt.engine().counters().get("copies.cut_at_place");
  put(memory_kind::device, memory_kind::host, memory_kind::host);
  std::uint64_t before = cut.value();
  rt.engine().copy(at, src.data(), n);
  EXPECT_EQ(cut.value() - before, 1u) << "the copy is cut once: after the device page's 1016 bytes";
  put(memory_kind::host, memory_kind::host, memory_kind::host);
  before = cut.value();
  rt.engine().copy(at, src.data(), n);
  EXPECT_EQ(cut.value(), before) << "pages in one place: one copy";
  for (const auto& [a, b, c] : {std::tuple{memory_kind::device, memory_kind::host, memory_kind::host},
                                 std::tuple{memory_kind::host, memory_kind::device, memory_kind::host},
                                 std::tuple{memory_kind::device, memory_kind::host, memory_kind::device}}) {
    put(a, b, c);
    test::fill_random(src.data(), n, static_cast<std::uint64_t>(a) * 9 + static_cast<std::uint64_t>(b) * 3 + static_cast<std::uint64_t>(c));
    std::memset(back.data(), 0, n);
    rt.engine().copy(at, src.data(), n);
    rt.engine().copy(back.data(), at, n);
    EXPECT_EQ(std::memcmp(back.data(), src.data(), n), 0);
  }
  for (int i = 0; i < 3; ++i) EXPECT_EQ(as.pages().snapshot(static_cast<std::uint64_t>(i)).pins, 0u) << "page " << i;
  as.free(p);
}
