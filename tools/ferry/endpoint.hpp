#pragma once
// Local endpoints of `ferry cp` and `ferry-bench`: "host", "pinned", "gpu:N" / "cuda:N", "sim:N",
// each optionally "+OFFSET" (bytes into the buffer, a multiple of 8), allocated by the CLI.
#include <ferry/device/mapped_memory.hpp>
#include <ferry/runtime.hpp>

#include <string>

namespace ferry::cli {

class endpoint {
 public:
  // Parses and allocates `bytes` (+ offset). `peers`: devices that must reach it directly.
  endpoint(runtime& rt, const std::string& spec, std::uint64_t bytes, std::span<device* const> peers = {});
  ~endpoint();
  endpoint(const endpoint&) = delete;
  endpoint& operator=(const endpoint&) = delete;

  std::byte* data() const noexcept { return ptr_; }
  const std::string& spec() const noexcept { return spec_; }
  device* dev() const noexcept { return dev_; }  // null for host memory
  void fill(std::uint64_t bytes, std::uint64_t seed);
  std::uint64_t checksum(std::uint64_t bytes, std::uint64_t offset = 0);

  // The device an endpoint spec names, or null for host endpoints (no allocation).
  static device* device_of(runtime& rt, const std::string& spec);

 private:
  std::string spec_;
  device* dev_ = nullptr;
  mapped_memory mem_;
  void* host_ = nullptr;
  std::size_t host_len_ = 0;
  registration pin_;
  std::byte* ptr_ = nullptr;
};

}  // namespace ferry::cli
