#pragma once
// Test data helpers: reproducible random bytes and whole-file reads.
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <vector>

namespace ferry::test {

inline std::vector<unsigned char> random_bytes(std::size_t n, std::uint64_t seed) {
  std::vector<unsigned char> v(n);
  std::mt19937_64 rng(seed);
  for (auto& c : v) c = static_cast<unsigned char>(rng());
  return v;
}

inline std::vector<unsigned char> slurp(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

}  // namespace ferry::test
