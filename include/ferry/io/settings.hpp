#pragma once
// io's tunables: the file engine's backend, threads, queue depth and pieces (rows in
// src/io/settings.cpp; ferry/settings.hpp gathers every layer's).
#include <ferry/core/export.hpp>
#include <ferry/core/settings.hpp>
#include <ferry/mem/settings.hpp>

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace ferry {

// The file engine's backend: automatic takes cuFile where handle registration and a probe read work.
enum class file_backend_kind { automatic, io_uring, cufile };
// O_DIRECT for file reads: automatic uses it unless the range is in the page cache.
enum class direct_io { automatic, always, never };
FERRY_API std::string_view to_string(file_backend_kind v) noexcept;
FERRY_API std::string_view to_string(direct_io v) noexcept;

FERRY_API int default_io_threads() noexcept;  // three quarters of the hardware threads, 2..16

// With core's (FERRY_DEADLINE) and mem's (the staging buffers reads and writes land in). The device
// layer's (the CUDA driver) come with the device registry the file engine is given.
struct FERRY_API io_settings : virtual core_settings, virtual mem_settings {
  std::string cufile_library = "libcufile.so.0";
  file_backend_kind file_backend = file_backend_kind::automatic;
  direct_io io_direct = direct_io::automatic;
  int io_threads = 0;  // 0: default_io_threads()
  int io_depth = 16;
  std::uint64_t io_chunk = 4ull << 20;
  std::uint64_t io_mapped = 0;  // page-cache reads into a GPU: DMA from the file's pages (0: staged)
  std::uint64_t io_inline = 1ull << 20;  // buffered I/O up to this size is copied during submit
  std::string io_inject;               // test-only fault injection: "partial", "eintr", "partial,eintr"
  int stream_slots = 8;  // staging buffers of one stream-ordered file request (its pipeline depth)

  static std::span<const setting_row<io_settings>> table();
};

}  // namespace ferry
