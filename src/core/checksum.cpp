#include <ferry/core/checksum.hpp>

#include <algorithm>
#include <cstring>

namespace ferry {

void fill_pattern(void* dst, std::size_t bytes, std::uint64_t seed) noexcept {
  auto* p = static_cast<unsigned char*>(dst);
  std::size_t words = bytes / 8;
  for (std::size_t i = 0; i < words; ++i) {
    std::uint64_t w = splitmix64(seed + i);
    std::memcpy(p + i * 8, &w, 8);
  }
  if (std::size_t tail = bytes % 8) {
    std::uint64_t w = splitmix64(seed + words);
    std::memcpy(p + words * 8, &w, tail);
  }
}

std::uint64_t checksum64(const void* src, std::size_t bytes) noexcept {
  auto* p = static_cast<const unsigned char*>(src);
  std::size_t words = bytes / 8;
  std::uint64_t sum = bytes * golden64;
  for (std::size_t i = 0; i < words; ++i) {
    std::uint64_t w;
    std::memcpy(&w, p + i * 8, 8);
    sum += splitmix64(w ^ (i * golden64));
  }
  if (std::size_t tail = bytes % 8) {
    std::uint64_t w = 0;
    std::memcpy(&w, p + words * 8, tail);
    sum += splitmix64(w ^ (words * golden64));
  }
  return sum;
}

void checksum64_stream::update(const void* p, std::size_t n) noexcept {
  auto* b = static_cast<const unsigned char*>(p);
  bytes_ += n;
  while (n) {
    if (carry_len_ == 0 && n >= 8) {  // fast path: whole words
      std::uint64_t w;
      std::memcpy(&w, b, 8);
      sum_ += splitmix64(w ^ (word_++ * golden64));
      b += 8;
      n -= 8;
      continue;
    }
    std::size_t take = std::min<std::size_t>(n, 8 - carry_len_);
    std::memcpy(reinterpret_cast<unsigned char*>(&carry_) + carry_len_, b, take);
    carry_len_ += static_cast<unsigned>(take);
    b += take;
    n -= take;
    if (carry_len_ == 8) {
      sum_ += splitmix64(carry_ ^ (word_++ * golden64));
      carry_ = 0;
      carry_len_ = 0;
    }
  }
}

std::uint64_t checksum64_stream::value() const noexcept {
  std::uint64_t s = sum_ + bytes_ * golden64;
  if (carry_len_) s += splitmix64(carry_ ^ (word_ * golden64));
  return s;
}

std::uint64_t pattern_checksum(std::size_t bytes, std::uint64_t seed) noexcept {
  std::size_t words = bytes / 8;
  std::uint64_t sum = bytes * golden64;
  for (std::size_t i = 0; i < words; ++i) sum += splitmix64(splitmix64(seed + i) ^ (i * golden64));
  if (std::size_t tail = bytes % 8) {
    std::uint64_t w = splitmix64(seed + words) & ((1ull << (8 * tail)) - 1);
    sum += splitmix64(w ^ (words * golden64));
  }
  return sum;
}

}  // namespace ferry
