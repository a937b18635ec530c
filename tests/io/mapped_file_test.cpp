// Reads through a file mapping, and what happens when the file shrinks under it.
#include <ferry/io/mapped_file.hpp>

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <random>
#include <vector>

using namespace ferry;

namespace {
struct temp_file {
  std::filesystem::path path;
  int fd = -1;
  explicit temp_file(std::size_t n, std::vector<unsigned char>& data) {
    path = std::filesystem::temp_directory_path() / ("ferry-mapped-" + std::to_string(::getpid()) + "-" + std::to_string(n));
    fd = ::open(path.c_str(), O_CREAT | O_TRUNC | O_RDWR, 0600);
    data.resize(n);
    std::mt19937_64 rng(n);
    for (auto& b : data) b = static_cast<unsigned char>(rng());
    EXPECT_EQ(::pwrite(fd, data.data(), n, 0), static_cast<ssize_t>(n));
  }
  ~temp_file() {
    ::close(fd);
    std::filesystem::remove(path);
  }
};
}  // namespace

TEST(MappedFile, ReadsMatchTheFileAndRangesOutsideItAreRefused) {
  std::vector<unsigned char> data;
  temp_file f(1 << 20, data);
  mapped_file m(f.fd);
  ASSERT_EQ(m.size(), data.size());
  std::mt19937_64 rng(7);
  std::vector<unsigned char> out(8192);
  for (int i = 0; i < 200; ++i) {
    std::uint64_t n = 1 + rng() % out.size(), off = rng() % (data.size() - n + 1);
    ASSERT_TRUE(m.read(out.data(), n, off)) << off << "+" << n;
    ASSERT_EQ(std::memcmp(out.data(), data.data() + off, n), 0) << off << "+" << n;
  }
  EXPECT_TRUE(m.read(out.data(), 1, data.size() - 1));
  EXPECT_FALSE(m.read(out.data(), 2, data.size() - 1));
  EXPECT_FALSE(m.read(out.data(), 1, data.size()));
  EXPECT_FALSE(m.read(out.data(), 1, ~std::uint64_t{0}));
  EXPECT_FALSE(m.read(out.data(), ~std::uint64_t{0}, 1));

  mapped_file moved = std::move(m);
  EXPECT_EQ(m.size(), 0u);
  EXPECT_FALSE(m.read(out.data(), 1, 0));
  EXPECT_TRUE(moved.read(out.data(), 16, 4096));

  std::vector<unsigned char> none;
  temp_file empty(0, none);
  mapped_file e(empty.fd);
  EXPECT_EQ(e.size(), 0u);
  EXPECT_FALSE(e.read(out.data(), 1, 0));
  EXPECT_EQ(mapped_file(-1).size(), 0u);
}

TEST(MappedFile, AFileTruncatedUnderTheMappingFailsTheReadInsteadOfKillingTheProcess) {
  std::vector<unsigned char> data;
  temp_file f(64 << 10, data);
  mapped_file m(f.fd);
  ASSERT_EQ(m.size(), 64u << 10);
  ASSERT_EQ(::ftruncate(f.fd, 8 << 10), 0);
  std::vector<unsigned char> out(8192);
  for (int i = 0; i < 3; ++i) {  // the guard works again after it caught one
    EXPECT_FALSE(m.read(out.data(), 4096, 16 << 10));
    EXPECT_FALSE(m.read(out.data(), 8192, 4096));  // straddles the new end
    ASSERT_TRUE(m.read(out.data(), 4096, 0));
    EXPECT_EQ(std::memcmp(out.data(), data.data(), 4096), 0);
  }
}

// The destination may be a peer's shared-memory file mapped here (a client's lent region), which
// the peer can truncate: writing past its end fails the copy too.
TEST(MappedFile, ADestinationTruncatedUnderItsMappingFailsTheCopyInsteadOfKillingTheProcess) {
  std::vector<unsigned char> data, junk;
  temp_file src(64 << 10, data);
  temp_file dst((64 << 10) + 1, junk);  // another size: another file name
  mapped_file m(src.fd);
  auto* d = static_cast<unsigned char*>(::mmap(nullptr, 64 << 10, PROT_READ | PROT_WRITE, MAP_SHARED, dst.fd, 0));
  ASSERT_NE(d, MAP_FAILED);
  ASSERT_TRUE(m.read(d + (40 << 10), 4096, 4096));
  EXPECT_EQ(std::memcmp(d + (40 << 10), data.data() + 4096, 4096), 0);
  ASSERT_EQ(::ftruncate(dst.fd, 8 << 10), 0);
  for (int i = 0; i < 2; ++i) {
    EXPECT_FALSE(m.read(d + (40 << 10), 4096, 0));
    EXPECT_FALSE(guarded_copy(d + 4096, data.data(), 8192));  // straddles the destination's new end
    ASSERT_TRUE(m.read(d, 4096, 8192));
    EXPECT_EQ(std::memcmp(d, data.data() + 8192, 4096), 0);
  }
  ::munmap(d, 64 << 10);
}

TEST(MappedFileDeathTest, ASigbusOutsideAGuardedReadStillEndsTheProcess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  std::vector<unsigned char> data;
  temp_file f(64 << 10, data);
  EXPECT_DEATH(
      {
        mapped_file m(f.fd);
        unsigned char b;
        m.read(&b, 1, 0);  // installs the guard's handler
        ::ftruncate(f.fd, 4096);
        auto* p = static_cast<volatile unsigned char*>(::mmap(nullptr, 64 << 10, PROT_READ, MAP_SHARED, f.fd, 0));
        std::printf("%d\n", p[32 << 10]);  // past the end, unguarded
      },
      "");
}
