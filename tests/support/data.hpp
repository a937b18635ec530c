#pragma once
// Test data helpers: reproducible random bytes, whole-file writes and reads.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <unistd.h>
#include <vector>

namespace ferry::test {

inline std::vector<unsigned char> random_bytes(std::size_t n, std::uint64_t seed) {
  std::vector<unsigned char> v(n);
  std::mt19937_64 rng(seed);
  for (auto& c : v) c = static_cast<unsigned char>(rng());
  return v;
}

// Fills [p, p+n) with reproducible random 8-byte words (a tail of under 8 bytes is left as it is).
inline void fill_random(std::byte* p, std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (std::size_t i = 0; i + 8 <= n; i += 8) {
    std::uint64_t v = rng();
    std::memcpy(p + i, &v, 8);
  }
}

// Writes n bytes as the whole content of file p.
inline void write_file(const std::filesystem::path& p, const void* data, std::size_t n) {
  std::ofstream(p, std::ios::binary).write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
}

inline std::vector<unsigned char> slurp(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// A file of n reproducible random bytes in the test's temporary directory (its name made unique
// by the process id), removed when it goes; `bytes` is what it was written with.
struct random_file {
  std::filesystem::path path;
  std::vector<std::byte> bytes;
  random_file(const std::filesystem::path& dir, const std::string& name, std::size_t n, std::uint64_t seed) : bytes(n) {
    path = dir / (name + "-" + std::to_string(::getpid()));
    fill_random(bytes.data(), n, seed);
    write_file(path, bytes.data(), n);
  }
  ~random_file() { std::filesystem::remove(path); }
  random_file(const random_file&) = delete;
  random_file& operator=(const random_file&) = delete;
  std::vector<std::byte> on_disk() const {
    std::vector<std::byte> b(std::filesystem::file_size(path));
    std::ifstream(path, std::ios::binary).read(reinterpret_cast<char*>(b.data()), static_cast<std::streamsize>(b.size()));
    return b;
  }
};

}  // namespace ferry::test
