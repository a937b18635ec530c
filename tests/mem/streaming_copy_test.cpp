// The copy around the caches into staging buffers (src/mem/streaming_copy.hpp): the same bytes as
// memcpy at every alignment of either side and every length around its line and size thresholds,
// and nothing written outside the destination's range.
#include "mem/streaming_copy.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace ferry {
namespace {

TEST(StreamingCopy, CopiesExactlyTheRangeAtAnyAlignmentAndLength) {
  constexpr std::size_t guard = 128;
  std::vector<unsigned char> src(70000), dst(70000 + 2 * guard + 64);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 131 + 7);
  const std::size_t lengths[] = {0, 1, 63, 64, 65, 4095, 4096, 4097, 4160, 8191, 65536 + 17, 69000};
  for (std::size_t n : lengths)
    for (std::size_t so : {0, 1, 5, 16, 33, 63})
      for (std::size_t d_off : {0, 1, 7, 32, 48, 63}) {
        std::fill(dst.begin(), dst.end(), static_cast<unsigned char>(0xA5));
        unsigned char* d = dst.data() + guard + d_off;
        streaming_copy(d, src.data() + so, n);
        for (std::size_t i = 0; i < n; ++i)
          ASSERT_EQ(d[i], src[so + i]) << "length " << n << ", source offset " << so << ", destination offset " << d_off << ", byte " << i;
        for (unsigned char* q = dst.data(); q < d; ++q) ASSERT_EQ(*q, 0xA5) << "written before the range (length " << n << ")";
        for (unsigned char* q = d + n; q < dst.data() + dst.size(); ++q) ASSERT_EQ(*q, 0xA5) << "written past the range (length " << n << ")";
      }
}

}  // namespace
}  // namespace ferry
