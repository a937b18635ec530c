#pragma once
// The host side of the benchmarks' kernels (pipeline_kernels.cu, embedded as a fatbin): the module
// image and the word function the kernels use, to write their inputs and check their results.
#include <ferry/runtime.hpp>

#include <cstdint>
#include <string>

namespace ferry::detail {
extern const unsigned char ferry_bench_kernels[];
}

namespace ferry::cli {
// Word i of the data for `seed`; pipeline_kernels.cu computes the same.
inline unsigned word_at(std::uint64_t i, unsigned seed) {
  std::uint64_t z = (i + seed) * 0x9E3779B97F4A7C15ull;
  return static_cast<unsigned>(z ^ (z >> 29));
}

// Writes a file of `bytes` (a multiple of 4) holding word_at(j, seed) at word j, through ferry, then
// reads it once so that the page cache holds it.
void write_word_file(runtime& rt, const std::string& path, std::uint64_t bytes, unsigned seed);
}  // namespace ferry::cli
