#pragma once
// Device memory ready to use: a reserved range with chunks mapped and access granted. The common
// case of the device interface in one call (tools, tests, benchmarks).
#include <ferry/device/device.hpp>

#include <span>
#include <vector>

namespace ferry {

class FERRY_API mapped_memory {
 public:
  mapped_memory() = default;
  mapped_memory(mapped_memory&&) noexcept = default;
  mapped_memory& operator=(mapped_memory&&) noexcept;
  ~mapped_memory();

  std::byte* data() const noexcept { return va_.at(0); }
  std::uint64_t size() const noexcept { return bytes_; }  // as asked; the mapping is rounded up
  device* owner() const noexcept { return va_.owner(); }

 private:
  friend FERRY_API mapped_memory allocate_mapped(device&, std::uint64_t, location, std::span<device* const>);
  va_range va_;
  std::vector<physical_chunk> chunks_;
  std::uint64_t bytes_ = 0;
};

// `bytes` (rounded up to the granularity) of memory at `where` mapped in a range of `d`, read-write
// for `d` and for every device in `peers` (same backend), and for the CPU when `where` is host memory.
FERRY_API mapped_memory allocate_mapped(device& d, std::uint64_t bytes, location where = location::on_device(),
                                        std::span<device* const> peers = {});

}  // namespace ferry
