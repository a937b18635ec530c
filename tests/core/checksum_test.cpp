#include <ferry/core/checksum.hpp>

#include <gtest/gtest.h>

#include <random>
#include <vector>

using namespace ferry;

TEST(Checksum, PatternChecksumMatchesFilledBuffer) {
  for (std::size_t n : {0ul, 1ul, 7ul, 8ul, 9ul, 4095ul, 4096ul, 65543ul}) {
    std::vector<unsigned char> b(n + 8);
    fill_pattern(b.data(), n, 1234);
    EXPECT_EQ(checksum64(b.data(), n), pattern_checksum(n, 1234)) << n;
  }
}

TEST(Checksum, DetectsSingleBitFlipsAndSwaps) {
  std::vector<std::uint64_t> v(1024);
  std::mt19937_64 rng(7);
  for (auto& w : v) w = rng();
  auto base = checksum64(v.data(), v.size() * 8);
  v[100] ^= 1ull << 17;
  EXPECT_NE(checksum64(v.data(), v.size() * 8), base);
  v[100] ^= 1ull << 17;
  std::swap(v[1], v[2]);  // position matters
  EXPECT_NE(checksum64(v.data(), v.size() * 8), base);
}

TEST(Checksum, LengthMatters) {
  std::vector<unsigned char> zeros(64, 0);
  EXPECT_NE(checksum64(zeros.data(), 32), checksum64(zeros.data(), 64));
}

TEST(Checksum, DifferentSeedsDiffer) { EXPECT_NE(pattern_checksum(4096, 1), pattern_checksum(4096, 2)); }

TEST(Checksum, StreamingEqualsOneShot) {
  std::vector<unsigned char> b(100003);
  fill_pattern(b.data(), b.size(), 9);
  for (std::size_t piece : {1ul, 3ul, 8ul, 4096ul, 7777ul}) {
    checksum64_stream s;
    for (std::size_t off = 0; off < b.size(); off += piece) s.update(b.data() + off, std::min(piece, b.size() - off));
    EXPECT_EQ(s.value(), checksum64(b.data(), b.size())) << piece;
  }
}
