#pragma once
// A deterministic data pattern and an order-independent checksum, computed identically on the CPU
// (here) and on devices (stream::fill_pattern / stream::checksum), so tests and benchmarks verify
// data where it lies instead of copying it back.
//
// Pattern: 8-byte little-endian word i of a buffer filled with `seed` is splitmix64(seed + i);
//          a tail shorter than 8 bytes holds the low bytes of its word.
// Checksum: sum over words i (tail zero-padded) of splitmix64(w_i ^ (i * golden)), plus
//          bytes * golden, modulo 2^64. A sum, so GPU blocks can add partial results in any order.
#include <ferry/core/export.hpp>

#include <cstddef>
#include <cstdint>

namespace ferry {

inline constexpr std::uint64_t golden64 = 0x9E3779B97F4A7C15ull;

constexpr std::uint64_t splitmix64(std::uint64_t x) noexcept {
  std::uint64_t z = x + golden64;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

FERRY_API void fill_pattern(void* dst, std::size_t bytes, std::uint64_t seed) noexcept;
FERRY_API std::uint64_t checksum64(const void* src, std::size_t bytes) noexcept;
// checksum64 over data that arrives in pieces (a file read chunk by chunk).
class FERRY_API checksum64_stream {
 public:
  void update(const void* p, std::size_t n) noexcept;
  std::uint64_t value() const noexcept;  // checksum64 of everything so far

 private:
  std::uint64_t sum_ = 0, bytes_ = 0, word_ = 0, carry_ = 0;
  unsigned carry_len_ = 0;
};

// Checksum of what fill_pattern(.., bytes, seed) writes, without a buffer.
FERRY_API std::uint64_t pattern_checksum(std::size_t bytes, std::uint64_t seed) noexcept;

}  // namespace ferry
