// The file engine on CPU memory and sim devices.
#include <ferry/core/checksum.hpp>
#include <ferry/device/mapped_memory.hpp>
#include <ferry/runtime.hpp>

#include "io/file_engine_impl.hpp"
#include "support/errors.hpp"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <liburing.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <barrier>
#include <csignal>
#include <condition_variable>
#include <filesystem>
#include <cstring>
#include <mutex>
#include <fstream>
#include <random>
#include <thread>

using namespace ferry;
using ::testing::HasSubstr;

namespace {

settings file_settings(direct_io direct = direct_io::automatic) {
  settings s;
  s.backend = backend_choice::sim;
  s.sim_capacity = 64ull << 20;
  s.sim_granularity = 1ull << 20;
  s.io_chunk = 64ull << 10;
  s.io_depth = 4;
  s.io_threads = 2;
  s.io_direct = direct;
  s.deadline = std::chrono::seconds(30);
  return s;
}

// Unique per process: ctest runs the tests of this file in parallel processes.
std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "ferry-io-" + std::to_string(::getpid()) + "-" + name;
}

std::vector<unsigned char> random_bytes(std::size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  std::mt19937 rng(seed);
  for (auto& c : v) c = static_cast<unsigned char>(rng());
  return v;
}

void write_file(const std::string& p, const std::vector<unsigned char>& data) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
}

// Reads `bytes` of `f` from offset 0 into sim device memory through the file engine, then copies
// them back to the host for the caller to compare.
std::vector<unsigned char> read_through_sim(runtime& rt, file& f, std::size_t bytes) {
  mapped_memory sim = allocate_mapped(rt.devices().get("sim:0"), bytes);
  EXPECT_EQ(rt.files().read(f, 0, sim.data(), bytes), bytes);
  std::vector<unsigned char> back(bytes);
  auto st = rt.devices().get("sim:0").create_stream();
  st->copy(back.data(), sim.data(), back.size());
  st->synchronize();
  return back;
}

// Whether this kernel lets a ring register a sparse table of descriptors (5.19 and later): the file
// engine's workers register descriptors there, and use plain ones elsewhere.
bool kernel_registers_files() {
  io_uring ring{};
  if (io_uring_queue_init(4, &ring, 0) < 0) return false;
  const bool ok = io_uring_register_files_sparse(&ring, 1) == 0;
  io_uring_queue_exit(&ring);
  return ok;
}

class FileRead : public ::testing::TestWithParam<direct_io> {};

TEST_P(FileRead, EveryAlignmentOfOffsetLengthAndBufferIntoHostAndSim) {
  runtime rt(file_settings(GetParam()));
  std::string p = temp_path("matrix");
  auto data = random_bytes(1 << 20, 1);
  write_file(p, data);
  auto f = file::open(p, open_mode::read);
  if (GetParam() == direct_io::always && f->direct_fd() < 0) GTEST_SKIP() << "no O_DIRECT on " << p;
  mapped_memory dev = allocate_mapped(rt.devices().get("sim:0"), 2 << 20);
  std::vector<unsigned char> host(1 << 20 | 64);
  for (std::uint64_t off : {0ul, 1ul, 4095ul, 4096ul, 65537ul}) {
    for (std::uint64_t len : {1ul, 511ul, 4096ul, 100000ul, 300001ul}) {
      for (std::uint64_t boff : {0ul, 1ul, 8ul}) {
        std::memset(host.data(), 0xEE, host.size());
        ASSERT_EQ(rt.files().read(*f, off, host.data() + boff, len), len);
        ASSERT_EQ(std::memcmp(host.data() + boff, data.data() + off, len), 0) << off << " " << len << " " << boff;
        // Not a byte around the asked range is written (buffered reads land in place).
        if (boff) {
          ASSERT_EQ(host[boff - 1], 0xEE) << off << " " << len << " " << boff;
        }
        ASSERT_EQ(host[boff + len], 0xEE) << off << " " << len << " " << boff;
        ASSERT_EQ(rt.files().read(*f, off, dev.data() + boff, len), len);
        std::vector<unsigned char> back(len);
        rt.engine().copy(back.data(), dev.data() + boff, len);
        ASSERT_EQ(std::memcmp(back.data(), data.data() + off, len), 0) << "sim " << off << " " << len << " " << boff;
      }
    }
  }
  if (GetParam() == direct_io::never) {
    EXPECT_GT(rt.files().counters().get("reads.in_place").value(), 0u) << "buffered reads into host memory skip the staging slots";
  }
}

// A buffered read into host memory stops at the end of the file: the bytes after it in the caller's
// buffer stay as they were.
TEST(File, InPlaceReadAtEndOfFileWritesNothingPastIt) {
  runtime rt(file_settings(direct_io::never));
  std::string p = temp_path("eof-in-place");
  auto data = random_bytes(10000, 12);
  write_file(p, data);
  auto f = file::open(p, open_mode::read);
  std::vector<unsigned char> buf(20000, 0xAA);
  EXPECT_EQ(rt.files().read(*f, 9000, buf.data() + 3, 5000), 1000u);
  EXPECT_EQ(std::memcmp(buf.data() + 3, data.data() + 9000, 1000), 0);
  EXPECT_EQ(buf[2], 0xAA);
  EXPECT_EQ(buf[1003], 0xAA) << "nothing past EOF is written";
  EXPECT_GT(rt.files().counters().get("reads.in_place").value(), 0u);
}

INSTANTIATE_TEST_SUITE_P(DirectModes, FileRead, ::testing::Values(direct_io::automatic, direct_io::always, direct_io::never),
                         [](const auto& i) { return std::string(to_string(i.param)); });

// Whether page `k` of the file at `p` is in the page cache (mincore on a mapping of it).
bool page_cached(const std::string& p, std::uint64_t k) {
  int fd = ::open(p.c_str(), O_RDONLY);
  void* m = ::mmap(nullptr, 4096, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(k * 4096));
  unsigned char in = 0;
  ::mincore(m, 4096, &in);
  ::munmap(m, 4096);
  ::close(fd);
  return in & 1;
}

// How much of a range the page cache holds: a large range is estimated from windows spread over it
// (asking about every page cost a 4 GiB load tens of milliseconds), close enough for the choice
// between the page cache and O_DIRECT.
TEST(File, CachedFractionOfALargeRangeIsEstimatedFromWindows) {
  std::string p = temp_path("cached-fraction");
  write_file(p, random_bytes(32 << 20, 5));
  int fd = ::open(p.c_str(), O_RDONLY);
  struct gone {
    std::string p;
    int fd;
    ~gone() {
      if (fd >= 0) ::close(fd);
      std::filesystem::remove(p);
    }
  } cleanup{p, fd};
  ASSERT_GE(fd, 0);
  const double all = io_detail::cached_fraction(fd, 0, 32 << 20);
  if (all < 0) GTEST_SKIP() << "no cachestat here (Linux 6.5+)";
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  if (io_detail::cached_fraction(fd, 0, 4096) > 0) GTEST_SKIP() << p << ": the page cache keeps the file (tmpfs?)";
  EXPECT_LT(io_detail::cached_fraction(fd, 0, 32 << 20), 0.1);
  std::vector<char> half(16 << 20);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);  // no readahead past the half read
  ASSERT_EQ(::pread(fd, half.data(), half.size(), 0), static_cast<ssize_t>(half.size()));
  const double estimate = io_detail::cached_fraction(fd, 0, 32 << 20);
  EXPECT_GT(estimate, 0.35);
  EXPECT_LT(estimate, 0.65) << "the first half of the file cached";
  EXPECT_GT(io_detail::cached_fraction(fd, 0, 16 << 20), 0.9);
  EXPECT_LT(io_detail::cached_fraction(fd, 16 << 20, 16 << 20), 0.1);
  EXPECT_GT(io_detail::cached_fraction(fd, 100, 900 << 10), 0.9) << "a small range: every page asked";
  const double unaligned = io_detail::cached_fraction(fd, 100, (32 << 20) - 100);
  EXPECT_GT(unaligned, 0.35);
  EXPECT_LT(unaligned, 0.65) << "windows at unaligned offsets";
}

// In automatic mode a small read asks the page cache only; what is not there it reads with O_DIRECT,
// and a range partly there it finishes through the page cache. Either way the bytes are the file's,
// at every alignment, into host memory and a device.
TEST(File, SmallReadsTheCacheLacksAreReadDirectlyOrFinishedBuffered) {
  runtime rt(file_settings(direct_io::automatic));
  std::string p = temp_path("cold");
  auto data = random_bytes(1 << 20, 21);
  write_file(p, data);
  auto f = file::open(p, open_mode::read);
  if (f->direct_fd() < 0) GTEST_SKIP() << "no O_DIRECT on " << p << ": automatic mode reads through the page cache only";
  auto evict = [&] {
    ::fdatasync(f->fd());
    ::posix_fadvise(f->fd(), 0, 0, POSIX_FADV_DONTNEED);
  };
  evict();
  if (page_cached(p, 3)) GTEST_SKIP() << p << ": the page cache keeps the file after POSIX_FADV_DONTNEED (tmpfs?)";
  mapped_memory dev = allocate_mapped(rt.devices().get("sim:0"), 1 << 20);
  std::vector<unsigned char> host(64 << 10);
  for (std::uint64_t off : {1ul, 4096ul, 12345ul, 200000ul}) {
    for (std::uint64_t len : {1ul, 4096ul, 9000ul, 40000ul}) {
      evict();
      std::memset(host.data(), 0xEE, host.size());
      ASSERT_EQ(rt.files().read(*f, off, host.data() + 3, len), len);
      ASSERT_EQ(std::memcmp(host.data() + 3, data.data() + off, len), 0) << off << " " << len;
      ASSERT_EQ(host[2], 0xEE);
      ASSERT_EQ(host[3 + len], 0xEE) << "nothing past the range is written";
      evict();
      ASSERT_EQ(rt.files().read(*f, off, dev.data() + 5, len), len);
      std::vector<unsigned char> back(len);
      rt.engine().copy(back.data(), dev.data() + 5, len);
      ASSERT_EQ(std::memcmp(back.data(), data.data() + off, len), 0) << "sim " << off << " " << len;
    }
  }
  // The first page of the range cached, the rest not: a short answer from the cache, the rest buffered.
  evict();
  {
    int fd = ::open(p.c_str(), O_RDONLY);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);  // no readahead: that one page only
    unsigned char one[4096];
    ASSERT_EQ(::pread(fd, one, sizeof one, 5 * 4096), 4096);
    ::close(fd);
  }
  if (!page_cached(p, 5) || page_cached(p, 6)) GTEST_SKIP() << "could not cache exactly one page of " << p;
  const std::uint64_t before = rt.files().counters().get("reads.missed_cache").value();
  ASSERT_EQ(rt.files().read(*f, 5 * 4096 + 100, host.data(), 3 * 4096), 3u * 4096);
  EXPECT_EQ(std::memcmp(host.data(), data.data() + 5 * 4096 + 100, 3 * 4096), 0);
  EXPECT_EQ(rt.files().counters().get("reads.missed_cache").value(), before) << "part came from the cache: the rest is read buffered";
  EXPECT_TRUE(page_cached(p, 7)) << "the rest went through the page cache";
  // A cached small read is no miss.
  const std::uint64_t cached_before = rt.files().counters().get("reads.missed_cache").value();
  ASSERT_EQ(rt.files().read(*f, 5 * 4096, host.data(), 4096), 4096u);
  EXPECT_EQ(std::memcmp(host.data(), data.data() + 5 * 4096, 4096), 0);
  EXPECT_EQ(rt.files().counters().get("reads.missed_cache").value(), cached_before);
  // Two I/Os of one small read into a device (its 4 KiB-aligned range is a chunk and a page): the
  // first misses the cache while the second, its last page cached, delivers. Nothing is read twice.
  evict();
  {
    int fd = ::open(p.c_str(), O_RDONLY);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
    unsigned char one[4096];
    ASSERT_EQ(::pread(fd, one, sizeof one, 16 * 4096), 4096);
    ::close(fd);
  }
  if (!page_cached(p, 16) || page_cached(p, 3)) GTEST_SKIP() << "could not cache exactly page 16 of " << p;
  ASSERT_EQ(rt.files().read(*f, 100, dev.data(), 64 << 10), 64u << 10) << "the request's bytes, each once";
  std::vector<unsigned char> back(64 << 10);
  rt.engine().copy(back.data(), dev.data(), back.size());
  EXPECT_EQ(std::memcmp(back.data(), data.data() + 100, back.size()), 0);
  // The reads above that the cache lacked went direct, unless the disk won every race: an RWF_NOWAIT
  // read starts the readahead of what it lacks, and a disk that answers before the read looks again
  // (a RAM-backed virtual disk) leaves nothing missed. The engine must miss where a plain
  // RWF_NOWAIT read of an evicted page misses.
  auto missed = [&] { return rt.files().counters().get("reads.missed_cache").value() > 0; };
  for (int i = 0; i < 50 && !missed(); ++i) {
    evict();
    ASSERT_EQ(rt.files().read(*f, 9 * 4096, host.data(), 4096), 4096u);
  }
  if (missed()) return;
  int plain_misses = 0;
  for (int i = 0; i < 50; ++i) {
    evict();
    iovec v{host.data(), 4096};
    plain_misses += ::preadv2(f->fd(), &v, 1, 9 * 4096, RWF_NOWAIT) < 0 && errno == EAGAIN;
  }
  EXPECT_EQ(plain_misses, 0) << "RWF_NOWAIT reads of evicted pages missed, yet none of the engine's went direct";
  GTEST_SKIP() << p << ": every RWF_NOWAIT read of an evicted page found it read (a disk that answers as it is asked)";
}

TEST(File, ShortReadAtEndOfFileNeverGarbage) {
  runtime rt(file_settings(direct_io::always));
  std::string p = temp_path("eof");
  auto data = random_bytes(10000, 2);
  write_file(p, data);
  auto f = file::open(p, open_mode::read);
  std::vector<unsigned char> buf(20000, 0xAA);
  EXPECT_EQ(rt.files().read(*f, 9000, buf.data(), 5000), 1000u);
  EXPECT_EQ(std::memcmp(buf.data(), data.data() + 9000, 1000), 0);
  EXPECT_EQ(buf[1000], 0xAA) << "nothing past EOF is written";
  EXPECT_EQ(rt.files().read(*f, 20000, buf.data(), 10), 0u);
}

TEST(File, PartialCompletionsAndEintrAreRetried) {
  settings s = file_settings(direct_io::never);
  s.io_inject = "partial,eintr";
  runtime rt(s);
  std::string p = temp_path("inject");
  auto data = random_bytes(3 << 20, 3);
  write_file(p, data);
  auto f = file::open(p, open_mode::read);
  std::vector<unsigned char> buf(data.size());
  EXPECT_EQ(rt.files().read(*f, 0, buf.data(), buf.size()), buf.size());
  EXPECT_EQ(buf, data);
  EXPECT_GT(rt.files().counters().get("io.partial").value(), 0u);
  EXPECT_GT(rt.files().counters().get("io.retries").value(), 0u);
  // Writes too.
  auto w = file::open(temp_path("inject-w"), open_mode::create);
  rt.files().write(*w, 0, data.data(), data.size(), true);
  std::fill(buf.begin(), buf.end(), 0);
  EXPECT_EQ(rt.files().read(*w, 0, buf.data(), buf.size()), buf.size());
  EXPECT_EQ(buf, data);
}

TEST(File, WriteThenReadRoundTripsThroughHostAndSim) {
  runtime rt(file_settings());
  auto data = random_bytes((3 << 20) + 777, 4);
  auto f = file::open(temp_path("rw"), open_mode::create);
  // Unaligned offset so head and tail take the buffered path and the middle O_DIRECT.
  rt.files().write(*f, 4097, data.data(), data.size(), true);
  EXPECT_EQ(f->size(), 4097 + data.size());
  mapped_memory dev = allocate_mapped(rt.devices().get("sim:0"), 4 << 20);
  EXPECT_EQ(rt.files().read(*f, 4097, dev.data(), data.size()), data.size());
  auto s = rt.devices().get("sim:0").create_stream();
  std::uint64_t sum = 0;
  s->checksum(dev.data(), data.size(), &sum);
  s->synchronize();
  EXPECT_EQ(sum, checksum64(data.data(), data.size()));
  // Device -> file.
  auto g = file::open(temp_path("rw2"), open_mode::create);
  rt.files().write(*g, 0, dev.data(), data.size());
  std::vector<unsigned char> back(data.size());
  EXPECT_EQ(rt.files().read(*g, 0, back.data(), back.size()), back.size());
  EXPECT_EQ(back, data);
}

TEST(File, SparseFilesBeyondFourGiB) {
  runtime rt(file_settings());
  auto f = file::open(temp_path("sparse"), open_mode::create);
  const std::uint64_t off = (5ull << 30) + 12345;
  auto data = random_bytes(200000, 5);
  rt.files().write(*f, off, data.data(), data.size());
  EXPECT_EQ(f->size(), off + data.size());
  std::vector<unsigned char> back(data.size());
  EXPECT_EQ(rt.files().read(*f, off, back.data(), back.size()), back.size());
  EXPECT_EQ(back, data);
  std::vector<unsigned char> hole(100000, 1);
  EXPECT_EQ(rt.files().read(*f, 1ull << 32, hole.data(), hole.size()), hole.size());
  EXPECT_EQ(std::count(hole.begin(), hole.end(), 0), static_cast<long>(hole.size())) << "a hole reads as zeros";
  f->resize(0);
}

TEST(File, TruncatedWhileReadingIsAnErrorNotAHang) {
  settings s = file_settings(direct_io::never);
  s.io_depth = 2;
  s.sim_copy_gbps = 0.02;  // slow device copies keep the pipeline waiting
  runtime rt(s);
  std::string p = temp_path("trunc");
  auto data = random_bytes(8 << 20, 6);
  write_file(p, data);
  auto f = file::open(p, open_mode::read);
  mapped_memory dev = allocate_mapped(rt.devices().get("sim:0"), 8 << 20);
  file_request r{f, 0, dev.data(), data.size(), false};
  auto t0 = std::chrono::steady_clock::now();
  transfer_batch b = rt.files().submit({&r, 1});
  // Truncated once the read is under way (its first bytes delivered), with most of it still to come.
  while (b.bytes_done() == 0 && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10))
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_LT(b.bytes_done(), data.size() / 2);
  ::truncate(p.c_str(), 1 << 20);
  EXPECT_FALSE(b.wait());
  auto res = b.results()[0];
  EXPECT_EQ(res.state, request_state::failed);
  ASSERT_TRUE(res.err);
  EXPECT_THAT(res.err->what(), HasSubstr("truncated while reading"));
  EXPECT_THAT(res.err->what(), HasSubstr(p));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
}

TEST(File, RemovedWhileReadingStillReadsTheOpenFile) {
  // POSIX: an open file outlives its name; the read completes with the right data, no hang.
  runtime rt(file_settings());
  std::string p = temp_path("removed");
  auto data = random_bytes(4 << 20, 7);
  write_file(p, data);
  auto f = file::open(p, open_mode::read);
  std::vector<unsigned char> buf(data.size());
  file_request r{f, 0, buf.data(), buf.size(), false};
  transfer_batch b = rt.files().submit({&r, 1});
  ::unlink(p.c_str());
  EXPECT_TRUE(b.wait());
  EXPECT_EQ(buf, data);
}

TEST(File, ClearErrorsNamingThePath) {
  runtime rt(file_settings());
  EXPECT_THAT(test::error_text([] { file::open("/nonexistent/dir/weights.bin", open_mode::read); }),
              HasSubstr("file.open /nonexistent/dir/weights.bin: cannot open for reading: No such file or directory"));
  EXPECT_THAT(test::error_text([] { file::open(::testing::TempDir(), open_mode::read); }), HasSubstr("is a directory"));
  // Read-only file opened for a write request.
  std::string p = temp_path("ro");
  write_file(p, random_bytes(100, 8));
  auto f = file::open(p, open_mode::read);
  std::vector<unsigned char> buf(100);
  EXPECT_THAT(test::error_text([&] { rt.files().write(*f, 0, buf.data(), 100); }), HasSubstr("opened read-only"));
  EXPECT_THAT(test::error_text([&] { rt.files().read(*f, 0, nullptr, 100); }), HasSubstr("null memory pointer"));
  // Permission denied: root bypasses file modes, so check it as an unprivileged user in a child.
  ::chmod(p.c_str(), 0000);
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  pid_t pid = ::fork();
  if (pid == 0) {
    if (::geteuid() == 0 && ::setuid(65534) != 0) _exit(2);
    std::string t = test::error_text([&] { file::open(p, open_mode::read); });
    [[maybe_unused]] auto n = ::write(fds[1], t.data(), t.size());
    _exit(0);
  }
  ::close(fds[1]);
  char msg[512] = {};
  [[maybe_unused]] auto n = ::read(fds[0], msg, sizeof msg - 1);
  ::waitpid(pid, nullptr, 0);
  EXPECT_THAT(std::string(msg), HasSubstr("file.open " + p + ": cannot open for reading: Permission denied"));
  EXPECT_THAT(std::string(msg), HasSubstr("[permission_denied]"));
}

// One worker runs several requests at once: a request queued behind a large one starts beside it
// (slots are shared round-robin), it does not wait for it to end.
TEST(File, OneWorkerRunsSeveralRequestsAtOnce) {
  settings s = file_settings();
  s.io_threads = 1;
  s.io_direct = direct_io::never;
  runtime rt(s);
  mapped_memory dev = allocate_mapped(rt.devices().get("sim:0"), 8 << 20);
  std::vector<std::shared_ptr<file>> files;
  std::vector<std::vector<unsigned char>> data;
  std::vector<std::vector<unsigned char>> host(4, std::vector<unsigned char>(1 << 20));
  std::vector<file_request> reqs;
  for (int i = 0; i < 8; ++i) {
    std::string p = temp_path("several-" + std::to_string(i));
    data.push_back(random_bytes(1 << 20, 100 + i));
    write_file(p, data.back());
    files.push_back(file::open(p, open_mode::read));
    void* mem = i < 4 ? static_cast<void*>(host[i].data()) : static_cast<void*>(dev.data() + (i - 4) * (1 << 20));
    reqs.push_back({files.back(), 0, mem, 1 << 20, false});
  }
  transfer_batch b = rt.files().submit(reqs);
  ASSERT_TRUE(b.wait());
  for (int i = 0; i < 8; ++i) {
    std::vector<unsigned char> got(1 << 20);
    rt.engine().copy(got.data(), reqs[i].mem, 1 << 20);
    EXPECT_EQ(std::memcmp(got.data(), data[i].data(), got.size()), 0) << i;
  }
  EXPECT_GT(rt.files().counters().get("requests.beside_others").value(), 0u);
}

// The engine's threads are made as the work asks for them: two for a first small read, more for a
// batch of many I/O chunks (one per four), never more than FERRY_IO_THREADS.
// Makes the file engine's workers up to `n`: FERRY_IO_DEPTH (`depth`) requests at once ask for one each.
void make_workers(runtime& rt, const std::shared_ptr<file>& f, int n, int depth) {
  std::vector<unsigned char> buf(4096);
  std::vector<file_request> reqs(static_cast<std::size_t>(n * depth), file_request{f, 0, buf.data(), 4096, false});
  transfer_batch b = rt.files().submit(reqs);
  ASSERT_TRUE(b.wait());
  ASSERT_EQ(rt.files().counters().get("workers.made").value(), static_cast<std::uint64_t>(n));
}

TEST(File, WorkersAreMadeAsTheWorkAsksForThem) {
  settings s = file_settings();
  s.io_threads = 8;
  s.io_depth = 256;  // here only the bytes of a batch ask for workers
  s.io_direct = direct_io::never;
  s.io_chunk = 1 << 20;
  runtime rt(s);
  std::string p = temp_path("grow");
  auto data = random_bytes(128 << 20, 23);
  write_file(p, data);
  auto f = file::open(p, open_mode::read);
  std::vector<unsigned char> got(data.size());
  auto made = [&] { return rt.files().counters().get("workers.made").value(); };
  EXPECT_EQ(rt.files().read(*f, 0, got.data(), 4096), 4096u);
  EXPECT_EQ(made(), 2u) << "a first small read";
  EXPECT_EQ(rt.files().read(*f, 0, got.data(), 64 << 20), 64u << 20);
  EXPECT_EQ(made(), 2u) << "64 MiB: a worker per 32 MiB asked so far, two there are";
  EXPECT_EQ(rt.files().read(*f, 0, got.data(), got.size()), got.size());
  EXPECT_EQ(got, data);
  EXPECT_EQ(made(), 6u) << "128 MiB more: six";
  // A program reading in calls of 16 MiB, one after another, asks as one large read would.
  for (std::size_t at = 0; at < got.size(); at += 16 << 20) EXPECT_EQ(rt.files().read(*f, at, got.data() + at, 16 << 20), 16u << 20);
  EXPECT_EQ(got, data);
  EXPECT_EQ(made(), 8u) << "320 MiB in all: every worker there may be";
}

// Many requests at once ask for a worker per FERRY_IO_DEPTH of them, up to FERRY_IO_THREADS.
TEST(File, ManyRequestsMakeAWorkerPerQueueDepth) {
  settings s = file_settings();
  s.io_threads = 8;
  s.io_depth = 2;
  s.io_direct = direct_io::never;
  runtime rt(s);
  std::string p = temp_path("grow-many");
  auto data = random_bytes(1 << 20, 29);
  write_file(p, data);
  auto f = file::open(p, open_mode::read);
  std::vector<unsigned char> got(data.size());
  std::vector<file_request> reqs;
  for (int i = 0; i < 32; ++i) reqs.push_back({f, std::uint64_t(i) << 15, got.data() + (i << 15), 1 << 15, false});
  transfer_batch b = rt.files().submit(reqs);
  ASSERT_TRUE(b.wait());
  EXPECT_EQ(got, data);
  EXPECT_EQ(rt.files().counters().get("workers.made").value(), 8u) << "32 requests, 2 per worker: all there may be";
}

// Requests that come together go to different workers (a ring's kernel threads would copy a burst
// of page-cache reads one after another): with four workers, four requests run one per worker.
TEST(File, RequestsThatComeTogetherSpreadOverTheWorkers) {
  settings s = file_settings();
  s.io_threads = 4;
  s.io_direct = direct_io::never;
  s.io_chunk = 1 << 20;  // one I/O each: not cut into pieces
  runtime rt(s);
  std::string p = temp_path("spread");
  auto data = random_bytes(16 << 20, 17);
  write_file(p, data);
  auto f = file::open(p, open_mode::read);
  std::vector<unsigned char> got(16 << 20);
  make_workers(rt, f, 4, s.io_depth);
  EXPECT_EQ(rt.files().read(*f, 0, got.data(), got.size()), got.size());
  const auto beside = rt.files().counters().get("requests.beside_others").value();
  std::vector<file_request> reqs;
  for (int i = 0; i < 4; ++i) reqs.push_back({f, std::uint64_t(i) << 20, got.data() + (i << 20), 1 << 20, false});
  transfer_batch b = rt.files().submit(reqs);
  ASSERT_TRUE(b.wait());
  b.check();
  EXPECT_EQ(got, data);
  EXPECT_EQ(rt.files().counters().get("requests.beside_others").value(), beside);
}

// Threads that submit at the same moment cannot see each other's jobs in the workers' loads yet;
// each breaks equal loads from a worker of its own, so four threads' requests submitted together
// run on four workers, not one behind another on the first (a server's progress threads, each
// with a piece of one client's read, submit so).
TEST(File, RequestsOfThreadsSubmittingTogetherSpreadOverTheWorkers) {
  settings s = file_settings(direct_io::never);
  s.io_threads = 4;
  s.io_chunk = 4 << 20;  // one I/O each, not cut into pieces
  s.io_inline = 0;
  runtime rt(s);
  std::string p = temp_path("spread-threads");
  auto data = random_bytes(16 << 20, 19);
  write_file(p, data);
  auto f = file::open(p, open_mode::read);
  make_workers(rt, f, 4, s.io_depth);
  const auto beside = rt.files().counters().get("requests.beside_others").value();
  constexpr int rounds = 150;
  std::barrier together(4);
  std::vector<std::thread> threads;
  std::vector<std::vector<unsigned char>> got(4, std::vector<unsigned char>(4 << 20));
  std::atomic<int> wrong{0};
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int r = 0; r < rounds; ++r) {
        together.arrive_and_wait();
        file_request q{f, std::uint64_t(t) << 22, got[t].data(), 4 << 20, false};
        transfer_batch b = rt.files().submit({&q, 1});
        if (!b.wait() || b.results()[0].bytes_done != (4u << 20) ||
            std::memcmp(got[t].data(), data.data() + (std::size_t(t) << 22), 4 << 20) != 0)
          wrong++;
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(rt.files().counters().get("requests.beside_others").value(), beside)
      << "a request of one thread ran on a worker beside another's in " << rounds << " rounds of four threads";
}

// Into host memory the unit of those pieces is the inline size (the kernel copies straight into the
// destination, one copy per piece), into device memory an I/O chunk (each I/O takes a staging
// buffer); with inlining off, an I/O chunk for both.
TEST(File, ASmallPageCacheReadIsCutInPiecesOfTheInlineSize) {
  settings s = file_settings(direct_io::never);
  s.io_threads = 4;
  s.io_chunk = 8ull << 20;
  std::string p = temp_path("inline-pieces");
  auto data = random_bytes(4 << 20, 29);
  write_file(p, data);
  for (bool inlining : {true, false}) {
    s.io_inline = inlining ? 1ull << 20 : 0;
    runtime rt(s);
    auto f = file::open(p, open_mode::read);
    std::vector<unsigned char> got(4 << 20);
    // Four workers first (a batch of 16 I/O chunks), as a busy engine has them.
    {
      std::vector<unsigned char> big(128ull << 20);
      std::vector<file_request> warm;
      for (int i = 0; i < 16; ++i) warm.push_back({f, 0, big.data() + (std::size_t(i) << 23), 4ull << 20, false});
      transfer_batch w = rt.files().submit(warm);
      ASSERT_TRUE(w.wait());
      w.check();
    }
    ASSERT_EQ(rt.files().counters().get("workers.made").value(), 4u);
    const auto before = rt.files().counters().get("requests.pieces").value();
    EXPECT_EQ(rt.files().read(*f, 0, got.data(), got.size()), got.size());
    EXPECT_EQ(got, data);
    EXPECT_EQ(rt.files().counters().get("requests.pieces").value() - before, inlining ? 4u : 0u) << "host memory, inline " << s.io_inline;
    EXPECT_EQ(read_through_sim(rt, *f, data.size()), data);
    // Into device memory too, as the batch is smaller than a chunk for every worker (not below the
    // inline size: without inlining, a chunk).
    EXPECT_EQ(rt.files().counters().get("requests.pieces").value() - before, inlining ? 8u : 0u) << "device memory, inline " << s.io_inline;
  }
}

// Small reads of adjacent file ranges into one device's memory are read as one range and copied on
// to each request's memory: each request still gets exactly its bytes (short ones at the end of the
// file, nothing past it), whatever the alignment of its offset, length and memory.
TEST(File, AdjacentSmallReadsIntoADeviceAreReadTogether) {
  for (direct_io direct : {direct_io::never, direct_io::always}) {
    runtime rt(file_settings(direct));
    std::string p = temp_path("grouped");
    auto data = random_bytes(256 << 10, 31);
    write_file(p, data);
    auto f = file::open(p, open_mode::read);
    device& sim = rt.devices().get("sim:0");
    auto st = sim.create_stream();
    auto read_back = [&](const mapped_memory& m, std::uint64_t at, std::uint64_t n) {
      std::vector<unsigned char> v(n);
      st->copy(v.data(), m.data() + at, n);
      st->synchronize();
      return v;
    };
    const std::vector<std::uint64_t> sizes = {1, 7, 4096, 5000, 8191, 1234, 16384, 3, 100, 9000, 4096, 777};
    std::vector<mapped_memory> mem;
    std::vector<file_request> reqs;
    std::uint64_t off = 333;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      mem.push_back(allocate_mapped(sim, 64 << 10));
      reqs.push_back({f, off, mem.back().data() + 5 + i, sizes[i], false});
      off += sizes[i];
    }
    const auto grouped = rt.files().counters().get("requests.grouped").value();
    transfer_batch b = rt.files().submit(reqs);
    ASSERT_TRUE(b.wait());
    EXPECT_GT(rt.files().counters().get("requests.grouped").value(), grouped) << "some were read with the one before";
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      EXPECT_EQ(b.results()[i].bytes_done, sizes[i]) << "request " << i;
      auto want = std::vector<unsigned char>(data.begin() + static_cast<std::ptrdiff_t>(reqs[i].offset),
                                             data.begin() + static_cast<std::ptrdiff_t>(reqs[i].offset + sizes[i]));
      EXPECT_EQ(read_back(mem[i], 5 + i, sizes[i]), want) << "request " << i;
    }
    // At the end of the file: the one across it reads what there is, the one past it nothing.
    const std::uint64_t end = data.size();
    const std::vector<std::pair<std::uint64_t, std::uint64_t>> tail = {{end - 5000, 3000}, {end - 2000, 1500}, {end - 500, 1000}, {end + 500, 200}};
    std::vector<file_request> last;
    for (std::size_t i = 0; i < tail.size(); ++i) last.push_back({f, tail[i].first, mem[i].data(), tail[i].second, false});
    transfer_batch t = rt.files().submit(last);
    ASSERT_TRUE(t.wait());
    const std::vector<std::uint64_t> got = {3000, 1500, 500, 0};
    for (std::size_t i = 0; i < tail.size(); ++i) {
      EXPECT_EQ(t.results()[i].bytes_done, got[i]) << "tail request " << i;
      if (!got[i]) continue;
      auto want = std::vector<unsigned char>(data.begin() + static_cast<std::ptrdiff_t>(tail[i].first),
                                             data.begin() + static_cast<std::ptrdiff_t>(tail[i].first + got[i]));
      EXPECT_EQ(read_back(mem[i], 0, got[i]), want) << "tail request " << i;
    }
  }
}

// A program's lone read into device memory, a little over a megabyte for each worker, runs on every
// worker: the pieces are equal (whole pages), not whole numbers of an aligned unit, which would have
// left half the workers idle.
TEST(File, ALoneReadIntoADeviceRunsOnEveryWorker) {
  settings s = file_settings(direct_io::never);
  s.io_threads = 6;
  s.io_chunk = 4ull << 20;
  s.io_inline = 1ull << 20;
  runtime rt(s);
  std::string p = temp_path("lone-read");
  auto data = random_bytes(7ull << 20, 37);  // 7 MiB over 6 workers: pieces of 1.17 MiB, not a page multiple
  write_file(p, data);
  auto f = file::open(p, open_mode::read);
  make_workers(rt, f, 6, s.io_depth);
  const auto before = rt.files().counters().get("requests.pieces").value();
  EXPECT_EQ(read_through_sim(rt, *f, data.size()), data);
  EXPECT_EQ(rt.files().counters().get("requests.pieces").value() - before, 6u);
}

// A read of many I/O chunks from the page cache is cut into pieces for several workers; the pieces
// are one request: its bytes, its short read at the end of the file. Writes are not cut.
TEST(File, ALargeRequestIsCutIntoPiecesForSeveralWorkers) {
  settings s = file_settings(direct_io::never);
  s.io_threads = 4;
  runtime rt(s);
  std::string p = temp_path("pieces");
  auto data = random_bytes((3 << 20) + 1234, 23);
  write_file(p, data);
  auto f = file::open(p, open_mode::read);
  std::vector<unsigned char> got(4 << 20, 0xee);
  make_workers(rt, f, 4, s.io_depth);
  // From an unaligned offset to past the end of the file, into host and sim memory.
  EXPECT_EQ(rt.files().read(*f, 777, got.data(), 4 << 20), data.size() - 777);
  EXPECT_TRUE(std::equal(data.begin() + 777, data.end(), got.begin()));
  EXPECT_EQ(got[data.size() - 777], 0xee) << "nothing written past the bytes that exist";
  EXPECT_EQ(rt.files().counters().get("requests.pieces").value(), 4u);
  EXPECT_EQ(read_through_sim(rt, *f, data.size()), data);
  // A large write (not cut) lands whole.
  std::string q = temp_path("pieces-w");
  auto w = file::open(q, open_mode::create);
  rt.files().write(*w, 0, data.data(), data.size(), true);
  std::vector<unsigned char> written(data.size());
  std::ifstream(q, std::ios::binary).read(reinterpret_cast<char*>(written.data()), static_cast<std::streamsize>(written.size()));
  EXPECT_EQ(written, data);
  EXPECT_EQ(rt.files().counters().get("requests.pieces").value(), 8u) << "the two reads were cut, the write was not";
  // Cut short before the read: the pieces past the end are empty, the request is the short read.
  ::truncate(p.c_str(), 1 << 20);
  transfer_batch b = rt.files().submit(std::vector<file_request>{{f, 0, got.data(), 3 << 20, false}});
  ASSERT_TRUE(b.wait());
  EXPECT_EQ(b.results()[0].bytes_done, 1u << 20);
  // Cut short while its pieces run: all of it read, or failed as truncated; never done with a hole.
  for (int round = 0; round < 20; ++round) {
    write_file(p, data);
    auto g = file::open(p, open_mode::read);
    std::fill(got.begin(), got.end(), 0xee);
    transfer_batch c = rt.files().submit(std::vector<file_request>{{g, 0, got.data(), data.size(), false}});
    ::truncate(p.c_str(), 1 << 20);
    c.wait();
    auto res = c.results()[0];
    if (res.state == request_state::done) {
      EXPECT_EQ(res.bytes_done, data.size()) << "round " << round << ": done, but short of what the file had";
      EXPECT_TRUE(std::equal(data.begin(), data.end(), got.begin())) << "round " << round;
    } else {
      ASSERT_TRUE(res.err) << "round " << round;
      EXPECT_THAT(res.err->what(), HasSubstr("truncated")) << "round " << round;
    }
  }
  ::unlink(p.c_str());
  ::unlink(q.c_str());
}

// A batch without a handle: the completion comes once, with every result, bad requests included.
TEST(File, ABatchWithoutAHandleReportsThroughItsCompletionOnce) {
  runtime rt(file_settings());
  std::string p = temp_path("completion");
  auto data = random_bytes(300000, 9);
  write_file(p, data);
  auto f = file::open(p, open_mode::read);
  std::vector<unsigned char> a(300000), c(1000);
  std::vector<file_request> reqs{{f, 0, a.data(), a.size(), false}, {f, 0, nullptr, 10, false}, {f, 299500, c.data(), 1000, false}};
  std::mutex mu;
  std::condition_variable cv;
  int calls = 0;
  std::vector<request_result> got;
  rt.files().submit(reqs, {}, [&](std::span<const request_result> r) {
    std::lock_guard l(mu);
    ++calls;
    got.assign(r.begin(), r.end());
    cv.notify_all();
  });
  std::unique_lock l(mu);
  ASSERT_TRUE(cv.wait_for(l, std::chrono::seconds(30), [&] { return calls > 0; }));
  l.unlock();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(calls, 1);
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0].state, request_state::done);
  EXPECT_EQ(got[0].bytes_done, 300000u);
  EXPECT_EQ(std::memcmp(a.data(), data.data(), a.size()), 0);
  EXPECT_EQ(got[1].state, request_state::failed);
  ASSERT_TRUE(got[1].err.has_value());
  EXPECT_THAT(got[1].err->what(), HasSubstr("null memory pointer"));
  EXPECT_EQ(got[2].state, request_state::done);
  EXPECT_EQ(got[2].bytes_done, 500u);  // short at the end of the file
}

// A worker registers the descriptors of files it reads more than once with its ring, as many as
// it keeps (the least recently used replaced). Many files read in turn (each twice, so that each is
// registered: more files than a worker keeps), and files replaced at their path (the new one may get
// the old one's descriptor number, even its address), read each its own bytes.
TEST_P(FileRead, FilesReadInTurnAndFilesReplacedAtTheirPathReadTheirOwnBytes) {
  settings s = file_settings(GetParam());
  s.io_threads = 1;
  runtime rt(s);
  constexpr int n = 48;  // more than a worker keeps registered
  std::vector<std::shared_ptr<file>> files;
  std::vector<std::vector<unsigned char>> data;
  for (int i = 0; i < n; ++i) {
    std::string p = temp_path("turn-" + std::to_string(i));
    data.push_back(random_bytes(16384, 300 + i));
    write_file(p, data.back());
    files.push_back(file::open(p, open_mode::read));
  }
  if (GetParam() == direct_io::always && files[0]->direct_fd() < 0) GTEST_SKIP() << "no O_DIRECT on " << files[0]->path();
  std::vector<unsigned char> got(4096);
  for (int round = 0; round < 4; ++round)
    for (int i = 0; i < n; ++i)
      for (int twice = 0; twice < 2; ++twice) {
        std::fill(got.begin(), got.end(), 0);
        ASSERT_EQ(rt.files().read(*files[i], 4096u * round, got.data(), 4096), 4096u);
        ASSERT_EQ(std::memcmp(got.data(), data[i].data() + 4096 * round, 4096), 0) << "file " << i << " round " << round;
      }
  std::string p = temp_path("replaced");
  for (int k = 0; k < 4; ++k) {
    auto bytes = random_bytes(8192, 400 + k);
    ::unlink(p.c_str());
    write_file(p, bytes);
    auto f = file::open(p, open_mode::read);
    for (int again = 0; again < 3; ++again) {
      ASSERT_EQ(rt.files().read(*f, 4096, got.data(), 4096), 4096u);
      ASSERT_EQ(std::memcmp(got.data(), bytes.data() + 4096, 4096), 0) << "version " << k;
    }
  }
  if (kernel_registers_files()) {
    EXPECT_GT(rt.files().counters().get("files.registered").value(), 32u) << "fewer registrations than files read twice";
  }
  for (int i = 0; i < n; ++i) ::unlink(temp_path("turn-" + std::to_string(i)).c_str());
  ::unlink(p.c_str());
}

// Registered descriptors let go while the worker runs (unused for a second) and when it has been
// idle for a second: files read again afterwards read right.
TEST(File, FilesReadAgainAfterTheirDescriptorsWereLetGoReadRight) {
  settings s = file_settings(direct_io::never);
  s.io_threads = 1;
  runtime rt(s);
  std::vector<std::shared_ptr<file>> f;
  std::vector<std::vector<unsigned char>> data;
  for (int i = 0; i < 2; ++i) {
    std::string p = temp_path("letgo-" + std::to_string(i));
    data.push_back(random_bytes(65536, 600 + i));
    write_file(p, data.back());
    f.push_back(file::open(p, open_mode::read));
  }
  std::vector<unsigned char> got(4096);
  auto read_twice = [&](int i, std::uint64_t at) {
    for (int twice = 0; twice < 2; ++twice) {
      std::fill(got.begin(), got.end(), 0);
      ASSERT_EQ(rt.files().read(*f[i], at, got.data(), got.size()), got.size());
      ASSERT_EQ(std::memcmp(got.data(), data[i].data() + at, got.size()), 0) << "file " << i << " at " << at;
    }
  };
  read_twice(0, 0);
  // File 1 keeps the worker busy for over two seconds: file 0's slot, unused, is let go.
  for (auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(2200); std::chrono::steady_clock::now() < until;)
    read_twice(1, 4096);
  read_twice(0, 8192);
  // Idle for over a second: every slot is let go.
  std::this_thread::sleep_for(std::chrono::milliseconds(1300));
  read_twice(0, 12288);
  read_twice(1, 16384);
  if (kernel_registers_files()) {
    EXPECT_GE(rt.files().counters().get("files.registered").value(), 4u);
  }
  for (int i = 0; i < 2; ++i) ::unlink(temp_path("letgo-" + std::to_string(i)).c_str());
}

// Many files read at once by one worker through its kernel threads (each I/O handed to io-wq, which
// looks its registered descriptor up when it runs it): a slot replaced or let go under an I/O would
// read another file's bytes, or fail.
TEST(File, ReadsInFlightKeepTheirRegisteredDescriptors) {
  settings s = file_settings(direct_io::never);
  s.io_threads = 1;
  s.io_depth = 16;
  s.io_chunk = 64 << 10;
  s.io_inline = 4096;  // every I/O to io-wq
  runtime rt(s);
  constexpr int n = 96;  // three times the slots a worker registers
  constexpr std::size_t size = 128 << 10;
  std::vector<std::shared_ptr<file>> files;
  std::vector<std::vector<unsigned char>> data;
  for (int i = 0; i < n; ++i) {
    std::string p = temp_path("inflight-" + std::to_string(i));
    data.push_back(random_bytes(size, 500 + i));
    write_file(p, data.back());
    files.push_back(file::open(p, open_mode::read));
  }
  for (int round = 0; round < 16; ++round) {
    std::vector<std::vector<unsigned char>> got(n, std::vector<unsigned char>(size));
    std::vector<file_request> reqs;
    for (int k = 0; k < n; ++k) {
      int i = (k * 7 + round * 5) % n;  // another order each round; each file in two requests (of one I/O
      // each) one after the other, so that the second registers its descriptor
      reqs.push_back({files[i], 0, got[i].data(), size / 2, false});
      reqs.push_back({files[i], size / 2, got[i].data() + size / 2, size / 2, false});
    }
    transfer_batch b = rt.files().submit(reqs);
    ASSERT_TRUE(b.wait());
    b.check();
    for (int i = 0; i < n; ++i) ASSERT_EQ(got[i], data[i]) << "file " << i << " round " << round;
  }
  if (kernel_registers_files()) {
    EXPECT_GT(rt.files().counters().get("files.registered").value(), 0u);
  }
  for (int i = 0; i < n; ++i) ::unlink(temp_path("inflight-" + std::to_string(i)).c_str());
}

// A descriptor opened elsewhere: regular files are read through the engine, others refused by name.
TEST(File, AnAdoptedDescriptorIsReadLikeAnOpenedFile) {
  runtime rt(file_settings());
  std::string p = temp_path("adopted");
  auto data = random_bytes(200000, 10);
  write_file(p, data);
  auto f = file::adopt(::open(p.c_str(), O_RDONLY | O_CLOEXEC), "served/" + p, false);
  std::vector<unsigned char> got(200000);
  EXPECT_EQ(rt.files().read(*f, 0, got.data(), got.size()), got.size());
  EXPECT_EQ(got, data);
  std::vector<unsigned char> small(100);
  EXPECT_EQ(f->read_here(small.data(), 100, 199950), 50u);
  EXPECT_EQ(std::memcmp(small.data(), data.data() + 199950, 50), 0);
  EXPECT_THAT(test::error_text([&] { rt.files().write(*f, 0, got.data(), 10); }), HasSubstr("opened read-only"));
  std::string fifo = temp_path("adopted-fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  int fd = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  EXPECT_THAT(test::error_text([&] { file::adopt(fd, fifo, false); }), HasSubstr(fifo + ": not a regular file"));
  ::unlink(fifo.c_str());
}

}  // namespace

// A remote file whose requests end only when their deadline passes (a server that stalls), as a
// source must: by watching source_deadline::at(). Each request waits on a thread of its own.
class stalled_source final : public file_source {
 public:
  // `late`: how long after the deadline a request ends (a source slow to notice it).
  explicit stalled_source(std::chrono::milliseconds late = {}) : late_(late) {}
  ~stalled_source() override {
    for (auto& t : threads_) t.join();
  }
  std::uint64_t size() override { return 1 << 20; }
  void start(bool, std::uint64_t, void*, std::uint64_t, const source_deadline& until, completion done) override {
    threads_.emplace_back([until, late = late_, done = std::move(done)] {
      while (std::chrono::steady_clock::now() < until.at()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      std::this_thread::sleep_for(late);
      error e = until.cancelled() ? error(errc::cancelled, "stalled.read", "stalled://x", "cancelled")
                                  : error(errc::timeout, "stalled.read", "stalled://x", "deadline passed");
      done(0, &e);
    });
  }

 private:
  std::chrono::milliseconds late_;
  std::vector<std::thread> threads_;
};

// A batch whose remote requests outlive its deadline: wait() ends them as timed out, each error
// naming its file and offset (not the request's index).
TEST(File, ARemoteRequestPastItsDeadlineIsNamedByFileAndOffset) {
  runtime rt(file_settings());
  auto reg = register_file_scheme("stalled", [](const std::string&, open_mode) {
    return std::make_shared<stalled_source>(std::chrono::milliseconds(400));
  });
  auto x = file::open("stalled://x", open_mode::read);
  auto y = file::open("stalled://y", open_mode::read);
  std::vector<std::byte> buf(4 * 4096);
  // Runs of requests on x, y, then x again: each named by its own file.
  std::vector<file_request> rs{{x, 0, buf.data(), 4096, false},
                               {y, 12345, buf.data() + 4096, 4096, false},
                               {x, 777, buf.data() + 8192, 4096, false},
                               {x, 99, buf.data() + 12288, 4096, false}};
  transfer_options fixed;
  fixed.until = std::chrono::steady_clock::now() + std::chrono::milliseconds(50);
  transfer_batch b = rt.files().submit(rs, fixed);
  EXPECT_FALSE(b.wait());
  ASSERT_EQ(b.results()[1].state, request_state::timed_out);
  EXPECT_THAT(b.results()[0].err->what(), HasSubstr("stalled://x offset 0"));
  EXPECT_THAT(b.results()[1].err->what(), HasSubstr("stalled://y offset 12345"));
  EXPECT_THAT(b.results()[2].err->what(), HasSubstr("stalled://x offset 777"));
  EXPECT_THAT(b.results()[3].err->what(), HasSubstr("stalled://x offset 99"));
  EXPECT_THAT(b.results()[1].err->what(), HasSubstr("deadline passed with 0 of 4096 bytes"));
}

// cancel() ends a remote file's requests under way (its source sees the batch's deadline passed),
// so a batch over a stalled server ends at once, not at its deadline; wait(t) returns at t meanwhile.
TEST(File, CancelEndsRemoteRequestsUnderWay) {
  runtime rt(file_settings());
  auto reg = register_file_scheme("stalled", [](const std::string&, open_mode) { return std::make_shared<stalled_source>(); });
  auto f = file::open("stalled://x", open_mode::read);
  std::vector<std::byte> buf(4096);
  file_request r{f, 0, buf.data(), buf.size(), false};
  transfer_options o;
  o.idle = std::chrono::seconds(30);
  using clk = std::chrono::steady_clock;
  {
    transfer_batch b = rt.files().submit({&r, 1}, o);
    auto t0 = clk::now();
    EXPECT_FALSE(b.wait(t0 + std::chrono::milliseconds(50)));
    EXPECT_GE(clk::now() - t0, std::chrono::milliseconds(50));
    EXPECT_FALSE(b.poll());
    b.cancel();
    EXPECT_FALSE(b.wait());
    EXPECT_LT(clk::now() - t0, std::chrono::seconds(5)) << "the cancel did not reach the request under way";
    EXPECT_EQ(b.results()[0].state, request_state::cancelled);
    EXPECT_EQ(b.results()[0].err->code(), errc::cancelled);
  }
  {
    auto t0 = clk::now();
    {
      transfer_batch b = rt.files().submit({&r, 1}, o);  // destroyed unfinished: cancelled, waited for
    }
    EXPECT_LT(clk::now() - t0, std::chrono::seconds(5)) << "a batch destroyed unfinished waited for its deadline";
  }
  {
    transfer_options fixed;  // a fixed deadline is seen by the source, as a moving one
    fixed.until = clk::now() + std::chrono::milliseconds(100);
    transfer_batch b = rt.files().submit({&r, 1}, fixed);
    EXPECT_FALSE(b.wait());
    EXPECT_EQ(b.results()[0].state, request_state::timed_out);
  }
}

// A runtime used, then the process forks (a data loader's worker): in the child the parent's runtime
// refuses work with an error naming both processes and ends without waiting for threads that are
// not there; a runtime made in the child reads; the parent reads on.
TEST(File, AForkedChildMakesARuntimeOfItsOwn) {
  auto path = std::filesystem::temp_directory_path() / ("ferry-fork-" + std::to_string(::getpid()) + ".bin");
  std::vector<std::byte> data(1 << 20);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::byte>(i * 7 + 3);
  { std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size())); }
  auto parent = std::make_unique<runtime>(file_settings());
  std::vector<std::byte> got(data.size());
  auto f = file::open(path.string(), open_mode::read);
  ASSERT_EQ(parent->files().read(*f, 0, got.data(), got.size()), got.size());  // its threads run now
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    int code = 0;
    try {
      parent->files();
      code = 1;  // the parent's runtime took work
    } catch (const error& e) {
      if (std::string(e.what()).find("was forked from the one that made the runtime") == std::string::npos) code = 2;
    }
    parent.reset();  // must neither wait for the parent's threads nor terminate
    {
      runtime mine(file_settings());
      std::vector<std::byte> b(data.size());
      if (mine.files().read(*f, 0, b.data(), b.size()) != b.size() || b != data) code = code ? code : 3;
    }
    ::_exit(code);
  }
  int status = -1;
  for (int i = 0; i < 1000 && ::waitpid(child, &status, WNOHANG) == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (!WIFEXITED(status) && !WIFSIGNALED(status)) {
    ::kill(child, SIGKILL);
    ::waitpid(child, &status, 0);
    FAIL() << "the child did not end within 10 s (it waited for threads of the parent's runtime)";
  }
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status
                                                              << " (1: the parent's runtime took work, 2: its error, 3: the child's read)";
  std::fill(got.begin(), got.end(), std::byte{0});
  EXPECT_EQ(parent->files().read(*f, 0, got.data(), got.size()), got.size());
  EXPECT_EQ(got, data);
  std::filesystem::remove(path);
}
