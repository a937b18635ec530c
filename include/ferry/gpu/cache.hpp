#pragma once
// The host side of the GPU page cache: makes the cache (frames, page tables, a proxy and its ring)
// in the requesters' memory, maps byte ranges of files as arrays kernels take by value
// (array.hpp), writes dirty pages back on flush, and reports what kernels met. docs/design/gpu-access.md.
//
//   gpu::cache c(rt, rt.devices().get("cuda:0"));
//   auto a = c.map<float>(file::open(path, open_mode::read), 0, count);
//   kernel<<<g, b, 0, my_stream>>>(a, ...);   // the user's kernel, on the user's stream
//   cudaStreamSynchronize(my_stream);
//   c.check();                                 // throws what the kernel's failed accesses met
#include <ferry/core/export.hpp>
#include <ferry/device/device.hpp>
#include <ferry/gpu/array.hpp>
#include <ferry/gpu/proxy.hpp>
#include <ferry/gpu/settings.hpp>
#include <ferry/io/file.hpp>

#include <chrono>
#include <memory>

namespace ferry::gpu {

struct FERRY_API cache_options {
  std::uint64_t bytes = gpu_settings{}.gpu_cache_bytes;      // frames, rounded down to whole pages
  std::uint32_t page_bytes = gpu_settings{}.gpu_cache_page;  // a power of two, 4 KiB to 2 MiB
  std::uint64_t landing_bytes = gpu_settings{}.gpu_cache_landing;  // pinned host memory pages pass through
  std::uint32_t arrays = 256;                                      // how many ranges may be mapped
  // The longest a requester waits for each step: a slot, an answer, a frame. Longer than the proxy's
  // deadline per request (requests.deadline), so that a request the proxy gives up on is answered
  // (timed_out) before its requester stops waiting, and its landing slot is not retired.
  std::chrono::nanoseconds wait = 2 * core_settings{}.deadline;
  proxy_options requests;  // the ring, the proxy's deadline per request; by == host: host threads request
  static cache_options from(const gpu_settings& s);
};

struct cache_stats {
  cache_counters counted;  // by the requesters
  proxy_stats requests;    // by the proxy
  std::uint32_t frames = 0;
  std::uint32_t page_bytes = 0;
};

class FERRY_API cache {
 public:
  // Misses are read by `files` (and its transfer engine); `dev` runs the kernels that use it. Both
  // must outlive the cache.
  cache(file_engine& files, device& dev, cache_options o = {});
  // Writes dirty pages back (flush); failures are logged. No kernel may be using the cache.
  ~cache();
  cache(const cache&) = delete;
  cache& operator=(const cache&) = delete;

  // Elements [first, first + count) of the file read as T: the array starts at byte first *
  // sizeof(T). Writes need a file opened for writing. Map before launching the kernels that use it
  // (see proxy::add).
  template <typename T>
  array<T> map(std::shared_ptr<file> f, std::uint64_t first, std::uint64_t count) {
    return array<T>(view(), map_bytes(std::move(f), first * sizeof(T), count * sizeof(T)));
  }
  // The bytes [offset, offset + bytes) of the file as one array's range.
  array_desc map_bytes(std::shared_ptr<file> f, std::uint64_t offset, std::uint64_t bytes);
  // `count` elements of memory ferry knows -- ferry unified memory, host or device memory -- as an
  // array: misses copy its pages in, write-backs (`writable`) copy them back, both by the transfer
  // engine; each copy of unified memory holds its pages in place (as every transfer of it does). The memory
  // must outlive the cache; what kernels wrote reaches it by write-back or flush().
  template <typename T>
  array<T> map_memory(T* p, std::uint64_t count, bool writable = false) {
    return array<T>(view(), map_memory_bytes(p, count * sizeof(T), writable));
  }
  array_desc map_memory_bytes(void* p, std::uint64_t bytes, bool writable = false);

  cache_view view() const noexcept;
  // Writes every dirty page to its source and marks it clean; returns how many. Call it when no
  // kernel that uses the cache runs (after synchronizing their streams).
  std::uint64_t flush();
  // Throws what the requesters' failed accesses met since the last check (the first status, with
  // the proxy's reasons), and clears it.
  void check();
  cache_stats stats() const;
  proxy& requests() noexcept;

  struct impl;

 private:
  std::unique_ptr<impl> impl_;
};

}  // namespace ferry::gpu
