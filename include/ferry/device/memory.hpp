#pragma once
// Device memory as the accelerator interface (ferry/device/device.hpp) hands it out: physical chunks
// on a device or in host memory, reserved virtual address ranges they are mapped into, and who may
// access a mapping.
#include <ferry/core/export.hpp>

#include <cstddef>
#include <cstdint>
#include <utility>

namespace ferry {

class device;

// Where physical memory lives.
enum class memory_kind { device, host };

struct location {
  memory_kind kind = memory_kind::device;
  // device: ordinal of a device of the same backend (-1: the device asked); host: NUMA node (-1: any).
  int id = -1;
  static location on_device(int ordinal = -1) { return {memory_kind::device, ordinal}; }
  static location on_host(int numa_node = -1) { return {memory_kind::host, numa_node}; }
};

enum class access : unsigned { none = 0, read = 1, read_write = 3 };

// Grants `who` (a device of this backend, or the host CPUs) access to a mapped range.
struct access_desc {
  location who;
  access flags = access::read_write;
};

struct memory_usage {
  std::uint64_t free = 0;
  std::uint64_t total = 0;
};

// A chunk of physical memory. Move-only; freed when the last owner lets go. A chunk released
// while still mapped stays alive until its last mapping is unmapped (as with cuMemRelease).
class FERRY_API physical_chunk {
 public:
  physical_chunk() = default;
  physical_chunk(physical_chunk&& o) noexcept { *this = std::move(o); }
  physical_chunk& operator=(physical_chunk&& o) noexcept;
  physical_chunk(const physical_chunk&) = delete;
  physical_chunk& operator=(const physical_chunk&) = delete;
  ~physical_chunk() { reset(); }

  explicit operator bool() const noexcept { return owner_ != nullptr; }
  std::uint64_t size() const noexcept { return size_; }
  location where() const noexcept { return where_; }
  std::uint64_t handle() const noexcept { return handle_; }  // backend-specific
  device* owner() const noexcept { return owner_; }
  void reset() noexcept;

 private:
  friend class device;
  device* owner_ = nullptr;
  std::uint64_t handle_ = 0;
  std::uint64_t size_ = 0;
  location where_;
};

// A reserved virtual address range: no memory behind it until chunks are mapped. Move-only; on
// destruction every chunk still mapped in it is unmapped and the range is returned.
class FERRY_API va_range {
 public:
  va_range() = default;
  va_range(va_range&& o) noexcept { *this = std::move(o); }
  va_range& operator=(va_range&& o) noexcept;
  va_range(const va_range&) = delete;
  va_range& operator=(const va_range&) = delete;
  ~va_range() { reset(); }

  explicit operator bool() const noexcept { return owner_ != nullptr; }
  void* base() const noexcept { return reinterpret_cast<void*>(base_); }
  std::uintptr_t address() const noexcept { return base_; }
  std::uint64_t size() const noexcept { return size_; }
  template <typename T = std::byte>
  T* at(std::uint64_t offset) const noexcept { return reinterpret_cast<T*>(base_ + offset); }
  device* owner() const noexcept { return owner_; }
  void reset() noexcept;

 private:
  friend class device;
  device* owner_ = nullptr;
  std::uintptr_t base_ = 0;
  std::uint64_t size_ = 0;
};

}  // namespace ferry
