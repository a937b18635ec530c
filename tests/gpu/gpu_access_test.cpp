// GPU-initiated reads on a real GPU (label "gpu"; exit 77 without one): the kernel's warps put read
// requests into a ferry::gpu::proxy's ring and wait for the answers; the proxy serves them from a
// file into device memory. The kernel (tests/gpu/access_kernels.cu) is loaded and launched by the
// test itself, on its own stream.
#include <ferry/gpu/cache.hpp>
#include <ferry/gpu/proxy.hpp>
#include <ferry/runtime.hpp>
#include <ferry/vm/address_space.hpp>

#include "mem/cuda/driver.hpp"
#include "support/cuda_user.hpp"
#include "support/data.hpp"
#include "support/served_process.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string_view>
#include <thread>
#include <fstream>
#include <sys/mman.h>
#include <unistd.h>

namespace ferry::detail {
extern const unsigned char ferry_access_kernels[];
}

using namespace ferry;
using ::testing::HasSubstr;

namespace {

settings g_settings;
std::string g_ferry_binary;  // `ferry`, for a server the test can kill (ctest passes --ferry-binary PATH)
const cuda::driver_api* g_api = nullptr;

#define CU(call) cuda::check(g_api->call, "test", #call)

std::uint64_t mix(std::uint64_t i, unsigned seed) {
  std::uint64_t z = (i + seed) * 0x9E3779B97F4A7C15ull;
  return z ^ (z >> 29);
}

struct device_buffer {
  CUdeviceptr p = 0;
  explicit device_buffer(std::size_t n) {
    CU(cuMemAlloc(&p, n));
    CU(cuMemsetD8Async(p, 0, n, nullptr));
  }
  ~device_buffer() { g_api->cuMemFree(p); }
  template <typename T>
  T* as() const { return reinterpret_cast<T*>(p); }
};

// The user's side: primary context, the kernels, a stream.
struct user_program : test::cuda_user {
  CUfunction read = nullptr;
  user_program() : cuda_user(*g_api, ferry::detail::ferry_access_kernels), read(fn("gpu_access_read")) {}
};

struct data_file : test::random_file {
  data_file(std::size_t n, std::uint64_t seed) : random_file(::testing::TempDir(), "ferry-gpu-access", n, seed) {}
};

struct run_result {
  std::vector<std::byte> dst;
  std::vector<unsigned> statuses;
};

// Runs the kernel against the proxy. A request the kernel gave up on may still be served later,
// into memory freed here: then the proxy goes first (it waits for what it still serves).
run_result run(user_program& u, std::unique_ptr<gpu::proxy>& pxp, std::uint64_t file_bytes, std::uint64_t chunk, unsigned warps,
               unsigned per_warp, unsigned seed, bool past_end) {
  gpu::proxy& px = *pxp;
  const std::uint64_t chunks = static_cast<std::uint64_t>(warps) * per_warp;
  device_buffer dst(chunks * chunk), st(chunks * 4);
  gpu::ring_view v = px.view();
  unsigned* donep = px.answer_words(warps).data();
  unsigned char* dstp = dst.as<unsigned char>();
  unsigned long long fb = file_bytes, ch = chunk;
  unsigned pe = past_end ? 1 : 0;
  unsigned* stp = st.as<unsigned>();
  unsigned long long wait_ns = 30'000'000'000ull;  // per request: a kernel that is not served ends
  void* args[] = {&v, &donep, &dstp, &fb, &ch, &warps, &per_warp, &seed, &pe, &wait_ns, &stp};
  CU(cuLaunchKernel(u.read, (warps * 32 + 255) / 256, 1, 1, 256, 1, 1, 0, u.s, args, nullptr));
  CU(cuStreamSynchronize(u.s));  // the kernel's own waits end at their deadlines
  auto ps = px.stats();
  std::printf("proxy: %llu requests taken, %llu failed, %llu bytes; first slot seq %llu\n",
              static_cast<unsigned long long>(ps.requests), static_cast<unsigned long long>(ps.failed),
              static_cast<unsigned long long>(ps.bytes), static_cast<unsigned long long>(v.slots[0].seq));
  auto errs = px.errors();
  for (std::size_t i = 0; i < errs.size() && i < 3; ++i) std::printf("proxy error: %s\n", errs[i].c_str());
  run_result r;
  r.dst.resize(chunks * chunk);
  r.statuses.resize(chunks);
  CU(cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(r.dst.data()), dst.p, r.dst.size(), u.s));
  CU(cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(r.statuses.data()), st.p, chunks * 4, u.s));
  CU(cuStreamSynchronize(u.s));
  for (auto x : r.statuses)
    if (x == static_cast<unsigned>(gpu::status::timed_out) || x == 100) {
      pxp.reset();
      break;
    }
  return r;
}

}  // namespace

// 512 warps, 16 random 4 KiB reads each, of a 64 MiB file: every chunk in device memory equals the
// file's bytes at the offset the kernel chose, every answer ok.
// One warp, one read: the smallest round trip (kernel -> ring -> proxy -> file -> device memory ->
// answer).
TEST(GpuAccess, OneWarpReadsOneChunk) {
  runtime rt(g_settings);
  user_program u;
  data_file d(1ull << 20, 20);
  auto px = std::make_unique<gpu::proxy>(rt.files(), rt.devices().get("cuda:0"));
  px->add(file::open(d.path.string(), open_mode::read));
  run_result r = run(u, px, d.bytes.size(), 4096, 1, 1, 3, false);
  ASSERT_EQ(r.statuses[0], static_cast<unsigned>(gpu::status::ok));
  std::uint64_t off = (mix(0, 3) % (d.bytes.size() / 4096)) * 4096;
  EXPECT_EQ(std::memcmp(r.dst.data(), d.bytes.data() + off, 4096), 0);
}

TEST(GpuAccess, WarpsReadRandomChunksOfAFileIntoDeviceMemory) {
  runtime rt(g_settings);
  user_program u;
  data_file d(64ull << 20, 21);
  auto px = std::make_unique<gpu::proxy>(rt.files(), rt.devices().get("cuda:0"));
  ASSERT_EQ(px->add(file::open(d.path.string(), open_mode::read)), 0u);
  const std::uint64_t chunk = 4096;
  const unsigned warps = 512, per = 16, seed = 5;
  auto t0 = std::chrono::steady_clock::now();
  run_result r = run(u, px, d.bytes.size(), chunk, warps, per, seed, false);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::size_t not_ok = 0, wrong = 0;
  for (std::uint64_t k = 0; k < std::uint64_t{warps} * per; ++k) {
    not_ok += r.statuses[k] != static_cast<unsigned>(gpu::status::ok);
    std::uint64_t off = (mix(k, seed) % (d.bytes.size() / chunk)) * chunk;
    wrong += std::memcmp(r.dst.data() + k * chunk, d.bytes.data() + off, chunk) != 0;
  }
  EXPECT_EQ(not_ok, 0u);
  EXPECT_EQ(wrong, 0u);
  ASSERT_TRUE(px);
  EXPECT_EQ(px->stats().requests, std::uint64_t{warps} * per);
  std::printf("%u warps x %u reads of %llu bytes: %.3f s (%.0f requests/s; one request per warp at a time)\n", warps, per,
              static_cast<unsigned long long>(chunk), s, warps * per / s);
}

// Reads that run past the end of the file come back to the kernel as out_of_range, the others
// as usual; the proxy keeps the reasons.
TEST(GpuAccess, ReadsPastTheEndAreStatusesInTheKernel) {
  runtime rt(g_settings);
  user_program u;
  data_file d(8ull << 20, 22);
  auto px = std::make_unique<gpu::proxy>(rt.files(), rt.devices().get("cuda:0"));
  px->add(file::open(d.path.string(), open_mode::read));
  const std::uint64_t chunk = 4096;
  const unsigned warps = 64, per = 8, seed = 6;
  run_result r = run(u, px, d.bytes.size(), chunk, warps, per, seed, true);
  std::size_t past = 0, wrong = 0;
  for (std::uint64_t k = 0; k < std::uint64_t{warps} * per; ++k) {
    if (k % 7 == 0) {
      past += r.statuses[k] == static_cast<unsigned>(gpu::status::out_of_range);
      continue;
    }
    EXPECT_EQ(r.statuses[k], static_cast<unsigned>(gpu::status::ok)) << "chunk " << k;
    std::uint64_t off = (mix(k, seed) % (d.bytes.size() / chunk)) * chunk;
    wrong += std::memcmp(r.dst.data() + k * chunk, d.bytes.data() + off, chunk) != 0;
  }
  EXPECT_EQ(past, (std::uint64_t{warps} * per + 6) / 7);
  EXPECT_EQ(wrong, 0u);
  ASSERT_TRUE(px);
  auto e = px->errors();
  ASSERT_FALSE(e.empty());
  EXPECT_THAT(e.back(), HasSubstr("only 2048 bytes exist there"));
}

// The page cache: the user's kernels take gpu::array<T> by value; every thread is a requester.
namespace {

template <std::size_t N>
struct bytes_of {
  unsigned char b[N];
};

void to_host(void* dst, CUdeviceptr src, std::size_t bytes) {
  CU(cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(dst), src, bytes, nullptr));
  CU(cuStreamSynchronize(nullptr));
}

// The user's kernel must end by itself: waits for it at most a minute; if it has not ended, says
// where the cache and its proxy stand and fails (the kernel is left running: the binary's other
// tests may then fail too, but nothing waits for ever).
bool kernel_ended(user_program& u, gpu::cache& c) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (g_api->cuStreamQuery(u.s) == CUDA_ERROR_NOT_READY && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (g_api->cuStreamQuery(u.s) != CUDA_ERROR_NOT_READY) {
    CU(cuStreamSynchronize(u.s));
    return true;
  }
  auto s = c.stats();
  std::printf("the kernel still runs after a minute: %llu hits, %llu misses, %llu write-backs, %llu failures, %llu retired; proxy "
              "%llu requests, %llu failed, %llu batches\n",
              static_cast<unsigned long long>(s.counted.hits), static_cast<unsigned long long>(s.counted.misses),
              static_cast<unsigned long long>(s.counted.writebacks), static_cast<unsigned long long>(s.counted.failures),
              static_cast<unsigned long long>(s.counted.retired), static_cast<unsigned long long>(s.requests.requests),
              static_cast<unsigned long long>(s.requests.failed), static_cast<unsigned long long>(s.requests.batches));
  for (auto& e : c.requests().errors()) std::printf("proxy error: %s\n", e.c_str());
  std::fflush(stdout);
  ADD_FAILURE() << "the kernel did not end within a minute";
  return false;
}

gpu::cache_options small_cache(std::uint64_t bytes, std::uint32_t page) {
  gpu::cache_options o = gpu::cache_options::from(g_settings);
  o.bytes = bytes;
  o.page_bytes = page;
  return o;
}

// 16384 threads each read one random element of `a`, whose bytes are `want`.
template <typename T>
void gather_matches(user_program& u, gpu::cache& c, gpu::array<T> a, const std::byte* want, const char* kernel) {
  CUfunction fn = u.fn(kernel);
  unsigned long long n = 16384;
  unsigned seed = sizeof(T);
  device_buffer out(n * sizeof(T)), st(n * 4);
  T* outp = out.as<T>();
  unsigned* stp = st.as<unsigned>();
  void* args[] = {&a, &outp, &n, &seed, &stp};
  CU(cuLaunchKernel(fn, static_cast<unsigned>(n / 256), 1, 1, 256, 1, 1, 0, u.s, args, nullptr));
  if (!kernel_ended(u, c)) return;
  std::vector<T> got(n);
  std::vector<unsigned> sts(n);
  to_host(got.data(), out.p, n * sizeof(T));
  to_host(sts.data(), st.p, n * 4);
  std::size_t not_ok = 0, wrong = 0;
  for (std::uint64_t i = 0; i < n; ++i) {
    not_ok += sts[i] != static_cast<unsigned>(gpu::status::ok);
    const std::uint64_t idx = mix(i, seed) % a.size();
    wrong += std::memcmp(&got[i], want + idx * sizeof(T), sizeof(T)) != 0;
  }
  EXPECT_EQ(not_ok, 0u) << sizeof(T) << "-byte elements";
  EXPECT_EQ(wrong, 0u) << sizeof(T) << "-byte elements";
}

// The same over an array that starts 13 bytes into the file.
template <typename T>
void gather_matches_the_file(user_program& u, gpu::cache& c, const data_file& d, const char* kernel) {
  const std::uint64_t base = 13;
  auto a = gpu::array<T>(c.view(), c.map_bytes(file::open(d.path.string(), open_mode::read), base, d.bytes.size() - base));
  gather_matches<T>(u, c, a, d.bytes.data() + base, kernel);
}

std::uint32_t written_value(std::uint64_t i) { return static_cast<std::uint32_t>(i * 2654435761u + 7); }

// How many of the first n 4-byte elements of `disk` are not written_value(i).
std::size_t not_written(const std::vector<std::byte>& disk, std::uint64_t n) {
  std::size_t wrong = 0;
  for (std::uint64_t i = 0; i < n; ++i) {
    std::uint32_t v;
    std::memcpy(&v, disk.data() + 4 * i, 4);
    wrong += v != written_value(i);
  }
  return wrong;
}

// The kernel cache_write_4: threads write value(first + i) to elements first .. first + n - 1.
void write_elements(user_program& u, gpu::cache& c, const gpu::array<std::uint32_t>& a, unsigned long long first,
                    unsigned long long n) {
  CUfunction fn = u.fn("cache_write_4");
  device_buffer st(n * 4);
  unsigned* stp = st.as<unsigned>();
  gpu::array<std::uint32_t> arg = a;
  void* args[] = {&arg, &first, &n, &stp};
  CU(cuLaunchKernel(fn, static_cast<unsigned>((n + 255) / 256), 1, 1, 256, 1, 1, 0, u.s, args, nullptr));
  if (!kernel_ended(u, c)) return;
  std::vector<unsigned> sts(n);
  to_host(sts.data(), st.p, n * 4);
  std::size_t not_ok = 0;
  for (auto x : sts) not_ok += x != static_cast<unsigned>(gpu::status::ok);
  EXPECT_EQ(not_ok, 0u);
}

// One thread of the user's kernel reads the first element of every page of `a` in turn
// (cache_sweep_8, a miss each); take() brings back each page's value and status.
struct sweep {
  unsigned long long per_page = 4096 / 8, pages;
  device_buffer out, st;
  sweep(user_program& u, gpu::array<std::uint64_t>& a, std::uint64_t bytes) : pages(bytes / 4096), out(pages * 8), st(pages * 4) {
    CUfunction fn = u.fn("cache_sweep_8");
    auto* outp = out.as<unsigned long long>();
    unsigned* stp = st.as<unsigned>();
    void* args[] = {&a, &per_page, &pages, &outp, &stp};
    CU(cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, u.s, args, nullptr));
  }
  void take(std::vector<std::uint64_t>& got, std::vector<unsigned>& sts) const {
    got.resize(pages);
    sts.resize(pages);
    to_host(got.data(), out.p, pages * 8);
    to_host(sts.data(), st.p, pages * 4);
  }
};

}  // namespace

// Random reads by the user's kernel of elements of 1 to 24 bytes from an array at an odd offset
// of a 16 MiB file, through a 4 MiB cache of 4 KiB pages: every value is the file's.
TEST(GpuCache, RandomReadsOfEveryElementSizeMatchTheFile) {
  runtime rt(g_settings);
  user_program u;
  data_file d(16ull << 20, 30);
  gpu::cache c(rt.files(), rt.devices().get("cuda:0"), small_cache(4 << 20, 4096));
  gather_matches_the_file<std::uint8_t>(u, c, d, "cache_gather_1");
  gather_matches_the_file<std::uint16_t>(u, c, d, "cache_gather_2");
  gather_matches_the_file<std::uint32_t>(u, c, d, "cache_gather_4");
  gather_matches_the_file<std::uint64_t>(u, c, d, "cache_gather_8");
  gather_matches_the_file<bytes_of<12>>(u, c, d, "cache_gather_12");
  gather_matches_the_file<bytes_of<16>>(u, c, d, "cache_gather_16");
  gather_matches_the_file<bytes_of<24>>(u, c, d, "cache_gather_24");
  auto s = c.stats();
  std::printf("cache: %llu hits, %llu misses, %llu evictions, %llu failures; proxy %llu requests\n",
              static_cast<unsigned long long>(s.counted.hits), static_cast<unsigned long long>(s.counted.misses),
              static_cast<unsigned long long>(s.counted.evictions), static_cast<unsigned long long>(s.counted.failures),
              static_cast<unsigned long long>(s.requests.requests));
  EXPECT_GT(s.counted.evictions, 0u);
  EXPECT_EQ(s.counted.failures, 0u);
  EXPECT_NO_THROW(c.check());
}

// The user allocates device memory after a cache used by their kernel is gone (and while a second
// one lives): the driver's allocations succeed, the cache's address ranges are returned whole.
TEST(GpuCache, TheUsersAllocationsAfterACacheIsGoneSucceed) {
  runtime rt(g_settings);
  user_program u;
  data_file d(16ull << 20, 31);
  for (std::uint64_t cache_mib : {64, 136, 136, 136}) {
    unsigned char* landing = nullptr;
    {
      gpu::cache c(rt.files(), rt.devices().get("cuda:0"), small_cache(cache_mib << 20, 4096));
      gather_matches_the_file<std::uint64_t>(u, c, d, "cache_gather_8");
      landing = c.view().landing;
    }
    // The cache's host memory is gone and so is its registration with the driver: the user maps
    // memory at that very address and registers it (a registration left behind makes this fail).
    void* again = ::mmap(landing, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    if (again == landing) {
      const CUresult r = g_api->cuMemHostRegister(again, 4096, 0);
      EXPECT_EQ(r, CUDA_SUCCESS) << "cuMemHostRegister at the destroyed cache's landing address: " << r;
      if (r == CUDA_SUCCESS) g_api->cuMemHostUnregister(again);
    }
    if (again != MAP_FAILED) ::munmap(again, 4096);
    void* pinned = nullptr;  // the user's pinned host memory too
    CU(cuMemHostAlloc(&pinned, 136 << 20, 0));
    for (std::size_t mib : {64, 136, 256}) {
      CUdeviceptr p = 0;
      const CUresult r = g_api->cuMemAlloc(&p, mib << 20);
      EXPECT_EQ(r, CUDA_SUCCESS) << "cuMemAlloc of " << mib << " MiB after a cache of " << cache_mib << " MiB was destroyed: " << r;
      if (r == CUDA_SUCCESS) {
        CU(cuMemsetD8Async(p, 1, mib << 20, u.s));
        CU(cuStreamSynchronize(u.s));
        g_api->cuMemFree(p);
      }
    }
    g_api->cuMemFreeHost(pinned);
  }
}

// The user's kernel gathers through a cache over ferry unified memory (a space on the GPU registered
// with the runtime's cache, 4x the cache, filled by the CPU): every element is the memory's.
TEST(GpuCache, AKernelGathersUnifiedMemoryThroughTheCache) {
  runtime rt(g_settings);
  user_program u;
  device& dev = rt.devices().get("cuda:0");
  data_file d(16ull << 20, 32);
  auto so = vm::space_options::from(rt.config());
  vm::address_space as(dev, 32ull << 20, so);
  void* p = as.alloc(d.bytes.size());
  std::memcpy(p, d.bytes.data(), d.bytes.size());
  {
    gpu::cache c(rt.files(), dev, small_cache(4 << 20, 4096));
    gather_matches<std::uint64_t>(u, c, c.map_memory(static_cast<std::uint64_t*>(p), d.bytes.size() / 8),
                                  d.bytes.data(), "cache_gather_8");
    auto s = c.stats();
    std::printf("cache over unified memory: %llu hits, %llu misses, %llu evictions\n", static_cast<unsigned long long>(s.counted.hits),
                static_cast<unsigned long long>(s.counted.misses), static_cast<unsigned long long>(s.counted.evictions));
    EXPECT_GT(s.counted.misses, 0u);
    EXPECT_NO_THROW(c.check());
  }
  as.free(p);
}

// 16384 threads of the user's kernel write distinct elements of one 64 KiB page; flush puts the
// page on disk: the file holds every value, and nothing else changed.
TEST(GpuCache, ConcurrentWritersToOnePageThenFlushLandOnDisk) {
  runtime rt(g_settings);
  user_program u;
  data_file d(1ull << 20, 31);
  gpu::cache c(rt.files(), rt.devices().get("cuda:0"), small_cache(4 << 20, 64 << 10));
  auto a = c.map<std::uint32_t>(file::open(d.path.string(), open_mode::read_write), 0, d.bytes.size() / 4);
  write_elements(u, c, a, 0, 16384);
  EXPECT_EQ(c.stats().counted.misses, 1u) << "one page, filled once";
  EXPECT_EQ(c.flush(), 1u);
  auto disk = d.on_disk();
  EXPECT_EQ(not_written(disk, 16384), 0u);
  EXPECT_EQ(std::memcmp(disk.data() + (64 << 10), d.bytes.data() + (64 << 10), d.bytes.size() - (64 << 10)), 0);
  EXPECT_NO_THROW(c.check());
}

// Writes over a file 4x the cache: dirty pages are written back as they are evicted, the rest by
// flush; the file then holds every value.
TEST(GpuCache, WritesOverAFileFourTimesTheCacheAreWrittenBackOnEviction) {
  runtime rt(g_settings);
  user_program u;
  data_file d(16ull << 20, 32);
  gpu::cache c(rt.files(), rt.devices().get("cuda:0"), small_cache(4 << 20, 4096));
  auto a = c.map<std::uint32_t>(file::open(d.path.string(), open_mode::read_write), 0, d.bytes.size() / 4);
  write_elements(u, c, a, 0, a.size());
  auto s = c.stats();
  EXPECT_GT(s.counted.writebacks, 0u);
  const std::uint64_t flushed = c.flush();
  std::printf("cache: %llu misses, %llu write-backs on eviction, %llu by flush\n", static_cast<unsigned long long>(s.counted.misses),
              static_cast<unsigned long long>(s.counted.writebacks), static_cast<unsigned long long>(flushed));
  EXPECT_EQ(s.counted.writebacks + flushed, d.bytes.size() / 4096) << "every page written once";
  auto disk = d.on_disk();
  EXPECT_EQ(not_written(disk, a.size()), 0u);
  EXPECT_NO_THROW(c.check());
}

// The file is cut short while the user's kernel reads it page by page: the pages past the new end
// come back to the kernel as out_of_range, the kernel ends, and the host's check throws.
TEST(GpuCache, AFileCutShortMidKernelIsAStatusInTheKernelAndAnExceptionOnTheHost) {
  runtime rt(g_settings);
  user_program u;
  data_file d(64ull << 20, 33);
  gpu::cache c(rt.files(), rt.devices().get("cuda:0"), small_cache(4 << 20, 4096));
  auto a = c.map<std::uint64_t>(file::open(d.path.string(), open_mode::read), 0, d.bytes.size() / 8);
  sweep k(u, a, d.bytes.size());
  const std::uint64_t pages = k.pages;
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::filesystem::resize_file(d.path, 8 << 20);
  if (!kernel_ended(u, c)) return;
  CU(cuStreamSynchronize(u.s));
  std::vector<std::uint64_t> got;
  std::vector<unsigned> sts;
  k.take(got, sts);
  std::size_t ok = 0, past = 0, other = 0, wrong = 0;
  for (std::uint64_t p = 0; p < pages; ++p) {
    if (sts[p] == static_cast<unsigned>(gpu::status::ok)) {
      ok++;
      wrong += std::memcmp(&got[p], d.bytes.data() + p * 4096, 8) != 0;
    } else if (sts[p] == static_cast<unsigned>(gpu::status::out_of_range)) {
      past++;
      EXPECT_GE(p, 2048u) << "a page before the new end";
    } else {
      other++;
    }
  }
  std::printf("pages read before the cut or before the new end: %zu; past it: %zu\n", ok, past);
  EXPECT_GE(ok, 2048u);
  EXPECT_GT(past, 0u);
  EXPECT_EQ(sts[pages - 1], static_cast<unsigned>(gpu::status::out_of_range));
  EXPECT_EQ(other, 0u);
  EXPECT_EQ(wrong, 0u);
  try {
    c.check();
    ADD_FAILURE() << "check did not throw";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::out_of_range);
    EXPECT_THAT(e.what(), HasSubstr("exist there"));
  }
}

// The ferry:// server is killed while the user's kernel reads one of its files page by page: the
// pages after the kill come back to the kernel as error statuses, the kernel ends, and the host's
// check throws, naming the server.
TEST(GpuCache, AFerryServerKilledMidKernelIsAStatusInTheKernelAndAnExceptionOnTheHost) {
  if (g_ferry_binary.empty()) GTEST_SKIP() << "needs --ferry-binary PATH (ctest passes it)";
  const auto root = std::filesystem::path("/tmp") / ("ferry-gpu-access-serve-" + std::to_string(::getpid()));
  std::filesystem::create_directories(root);
  struct gone {
    std::filesystem::path p;
    ~gone() { std::filesystem::remove_all(p); }
  } cleanup{root};
  test::random_file d(root, "data.bin", 16ull << 20, 34);
  test::served_process srv(g_ferry_binary, root, 0, {}, test::through_the_server);
  const std::string server = "127.0.0.1:" + std::to_string(srv.port);
  runtime rt(g_settings);
  user_program u;
  gpu::cache c(rt.files(), rt.devices().get("cuda:0"), small_cache(1 << 20, 4096));
  auto a = c.map<std::uint64_t>(file::open("ferry://" + server + "/" + d.path.filename().string(), open_mode::read), 0,
                                d.bytes.size() / 8);
  sweep k(u, a, d.bytes.size());
  const std::uint64_t pages = k.pages;
  // Kill the server once the kernel is under way (some pages read), at most a few seconds in.
  for (int i = 0; i < 300 && c.stats().counted.misses < 64; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const auto killed_at = std::chrono::steady_clock::now();
  srv.kill();
  if (!kernel_ended(u, c)) return;
  const double after_kill = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
  std::vector<std::uint64_t> got;
  std::vector<unsigned> sts;
  k.take(got, sts);
  std::size_t ok = 0, failed = 0, wrong = 0;
  std::uint64_t first_failed = pages;
  for (std::uint64_t p = 0; p < pages; ++p) {
    if (sts[p] == static_cast<unsigned>(gpu::status::ok)) {
      ok++;
      wrong += std::memcmp(&got[p], d.bytes.data() + p * 4096, 8) != 0;
      EXPECT_LT(p, first_failed) << "a page read after a failed one: the server came back?";
    } else {
      failed++;
      first_failed = std::min(first_failed, p);
    }
  }
  std::printf("server killed: %zu pages read before, %zu failed after; the kernel ended %.1f s after the kill\n", ok, failed, after_kill);
  EXPECT_GE(ok, 64u);
  EXPECT_GT(failed, 0u);
  EXPECT_EQ(wrong, 0u);
  try {
    c.check();
    ADD_FAILURE() << "check did not throw";
  } catch (const error& e) {
    std::printf("cache::check: %s\n", e.what());
    EXPECT_THAT(e.what(), HasSubstr(server)) << "the error names the server";
  }
}

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string_view(argv[i]) == "--ferry-binary") g_ferry_binary = argv[i + 1];
  g_settings = settings::from_env();
  const cuda::driver_status& st = cuda::load(g_settings.cuda_driver);
  g_api = st.api;
  if (!st.api || st.device_count == 0) {
    std::printf("SKIPPED: no usable CUDA device: %s\n", st.api ? "no device" : st.reason.c_str());
    return 77;
  }
  return RUN_ALL_TESTS();
}
