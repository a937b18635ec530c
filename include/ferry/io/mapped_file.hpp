#pragma once
// A file mapped read-only and read by memcpy: no system call per read. For small reads on a hot
// path (a storage server answering 4 KiB requests), a system call per read is a large part of a
// shared-memory round trip. A file truncated under the mapping would make a read of the lost pages
// raise SIGBUS; every read runs under a guard that turns that into a failed read, so the caller
// falls back to pread, which then sees the new end of file. Nothing else of the process's SIGBUS
// handling changes (signals that are not from a guarded read go to the handler installed before).
#include <ferry/core/export.hpp>

#include <cstddef>
#include <cstdint>

namespace ferry {

class FERRY_API mapped_file {
 public:
  mapped_file() = default;
  // Maps fd's first `size` bytes (its size now, from fstat) read-only and shared; an empty file or
  // a failed mmap leaves the mapping empty (every read then returns false).
  explicit mapped_file(int fd);
  ~mapped_file();
  mapped_file(mapped_file&& o) noexcept;
  mapped_file& operator=(mapped_file&& o) noexcept;
  mapped_file(const mapped_file&) = delete;
  mapped_file& operator=(const mapped_file&) = delete;

  std::uint64_t size() const { return size_; }
  // Copies [offset, offset+n) of the file into dst: true when the range lies inside the mapping
  // and every page of it was readable; false (dst partly written) when it does not, or the file
  // shrank under the mapping (SIGBUS caught).
  bool read(void* dst, std::uint64_t n, std::uint64_t offset) const;

 private:
  const std::byte* base_ = nullptr;
  std::uint64_t size_ = 0;
};

// memcpy between mappings that may raise SIGBUS (a mapping past its file's end, on either side --
// a peer's shared-memory file truncated under the destination): false if it did.
FERRY_API bool guarded_copy(void* dst, const void* src, std::size_t n);
// Writes the record {first, second} to `at` (8-byte aligned, in such a mapping) for a reader that
// polls `first`: `second` is stored before `first` (release), so a reader that sees `first`
// (acquire) sees `second` and everything written before. False if the mapping raised SIGBUS.
FERRY_API bool guarded_publish(std::uint64_t* at, std::uint64_t first, std::uint64_t second);

}  // namespace ferry
