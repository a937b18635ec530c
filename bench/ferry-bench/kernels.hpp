#pragma once
// The host side of the benchmarks' kernels (pipeline_kernels.cu, embedded as a fatbin): the module
// image and the word function the kernels use, to write their inputs and check their results.
#include <cstdint>

namespace ferry::detail {
extern const unsigned char ferry_bench_kernels[];
}

namespace ferry::cli {
// Word i of the data for `seed`; pipeline_kernels.cu computes the same.
inline unsigned word_at(std::uint64_t i, unsigned seed) {
  std::uint64_t z = (i + seed) * 0x9E3779B97F4A7C15ull;
  return static_cast<unsigned>(z ^ (z >> 29));
}
}  // namespace ferry::cli
