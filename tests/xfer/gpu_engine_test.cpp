// GPU tests of the transfer engine and the registration cache (label "gpu"; exit 77 without a GPU).
#include <ferry/core/checksum.hpp>
#include <ferry/device/mapped_memory.hpp>
#include <ferry/io/file_engine.hpp>
#include <ferry/mem/dmabuf.hpp>
#include <ferry/runtime.hpp>

#include "mem/cuda/driver.hpp"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <random>

using namespace ferry;
using ::testing::HasSubstr;

namespace {

settings g_settings;
int g_gpus = 0;
const cuda::driver_api* g_api = nullptr;

void make_current(int ordinal) {
  CUdevice d = 0;
  CUcontext c = nullptr;
  cuda::check(g_api->cuDeviceGet(&d, ordinal), "test", "cuDeviceGet");
  cuda::check(g_api->cuDevicePrimaryCtxRetain(&c, d), "test", "retain");
  cuda::check(g_api->cuCtxSetCurrent(c), "test", "set current");
}

// cudaMalloc-style memory (cuMemAlloc), as users of torch and friends have.
struct cu_buffer {
  CUdeviceptr p = 0;
  std::size_t n = 0;
  cu_buffer(int ordinal, std::size_t bytes) : n(bytes) {
    make_current(ordinal);
    cuda::check(g_api->cuMemAlloc(&p, n), "test", "cuMemAlloc");
  }
  ~cu_buffer() { free(); }
  void free() {
    if (p) g_api->cuMemFree(p);
    p = 0;
  }
  std::byte* data() const { return reinterpret_cast<std::byte*>(p); }
};

std::vector<unsigned char> random_bytes(std::size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  std::mt19937_64 rng(seed);
  for (std::size_t i = 0; i + 8 <= n; i += 8) {
    auto w = rng();
    std::memcpy(v.data() + i, &w, 8);
  }
  return v;
}

std::uint64_t sum_on(runtime& rt, const std::string& dev, const void* p, std::size_t n) {
  auto s = rt.devices().get(dev).create_stream();
  std::uint64_t x = 0;
  s->checksum(p, n, &x);
  s->synchronize();
  return x;
}

transfer_path copy(runtime& rt, void* d, const void* s, std::size_t n) {
  transfer_request r{d, s, n};
  transfer_batch b = rt.engine().submit({&r, 1});
  b.wait();
  b.check();
  return b.results()[0].path;
}

TEST(GpuEngine, EveryPathRoundTripsRandomData) {
  runtime rt(g_settings);
  const std::size_t n = (96ull << 20) + 4096 + 8;  // not a multiple of any chunk size
  auto src = random_bytes(n, 1);
  const std::uint64_t want = checksum64(src.data(), n);
  cu_buffer d0(0, n), d0b(0, n);
  EXPECT_EQ(copy(rt, d0.data(), src.data(), n), transfer_path::bounce);  // first sight of a pageable range
  EXPECT_EQ(sum_on(rt, "cuda:0", d0.data(), n), want);
  EXPECT_EQ(copy(rt, d0.data(), src.data(), n), transfer_path::registered);  // seen again: registered
  EXPECT_EQ(sum_on(rt, "cuda:0", d0.data(), n), want);
  EXPECT_EQ(copy(rt, d0b.data(), d0.data(), n), transfer_path::direct);
  EXPECT_EQ(sum_on(rt, "cuda:0", d0b.data(), n), want);
  std::vector<unsigned char> back(n, 0);
  EXPECT_EQ(copy(rt, back.data(), d0b.data(), n), transfer_path::bounce);
  EXPECT_EQ(back, src);
  // Pinned host memory (registered through the cache) both ways.
  std::vector<unsigned char> pinned(n, 0);
  registration hold = rt.registrations().acquire(pinned.data(), n);
  EXPECT_EQ(copy(rt, pinned.data(), d0.data(), n), transfer_path::registered);
  EXPECT_EQ(pinned, src);
  EXPECT_EQ(copy(rt, d0b.data(), pinned.data(), n), transfer_path::registered);
  EXPECT_EQ(sum_on(rt, "cuda:0", d0b.data(), n), want);
  // Unaligned offsets and small sizes, many in one batch.
  std::vector<transfer_request> reqs;
  for (std::size_t i = 0; i < 100; ++i) reqs.push_back({back.data() + i * 1001, d0.data() + i * 1001 + 3, 997});
  std::memset(back.data(), 0, n);
  transfer_batch b = rt.engine().submit(reqs);
  ASSERT_TRUE(b.wait());
  for (std::size_t i = 0; i < 100; ++i)
    ASSERT_EQ(std::memcmp(back.data() + i * 1001, src.data() + i * 1001 + 3, 997), 0) << "request " << i;
}

TEST(GpuEngine, GpuToGpuPeerAndStaged) {
  if (g_gpus < 2) GTEST_SKIP() << "needs two GPUs";
  const std::size_t n = (256ull << 20) + 8;
  auto src = random_bytes(n, 2);
  const std::uint64_t want = checksum64(src.data(), n);
  {
    runtime rt(g_settings);
    cu_buffer a(0, n), b(1, n);
    copy(rt, a.data(), src.data(), n);
    EXPECT_EQ(copy(rt, b.data(), a.data(), n), transfer_path::peer);
    EXPECT_EQ(sum_on(rt, "cuda:1", b.data(), n), want);
    EXPECT_EQ(copy(rt, a.data(), b.data(), n), transfer_path::peer);  // and back
    EXPECT_EQ(sum_on(rt, "cuda:0", a.data(), n), want);
    // VMM-mapped memory on both GPUs, granted to each other.
    device* g0 = &rt.devices().get("cuda:0");
    device* g1 = &rt.devices().get("cuda:1");
    mapped_memory m0 = allocate_mapped(*g0, n, location::on_device(), {&g1, 1});
    mapped_memory m1 = allocate_mapped(*g1, n, location::on_device(), {&g0, 1});
    copy(rt, m0.data(), src.data(), n);
    EXPECT_EQ(copy(rt, m1.data(), m0.data(), n), transfer_path::peer);
    EXPECT_EQ(sum_on(rt, "cuda:1", m1.data(), n), want);
  }
  settings s = g_settings;
  s.xfer_peer = false;
  runtime rt(s);
  cu_buffer a(0, n), b(1, n);
  copy(rt, a.data(), src.data(), n);
  EXPECT_EQ(copy(rt, b.data(), a.data(), n), transfer_path::staged);
  EXPECT_EQ(sum_on(rt, "cuda:1", b.data(), n), want);
}

TEST(GpuEngine, FreedAndReallocatedDeviceMemoryIsNeverServedStale) {
  runtime rt(g_settings);
  registration_cache& cache = rt.registrations();
  const std::size_t n = 64ull << 20;
  auto first = std::make_unique<cu_buffer>(0, n);
  CUdeviceptr addr = first->p;
  {
    registration r = cache.acquire(first->data(), n);
    EXPECT_EQ(r.region().type, memory_type::device);
    EXPECT_EQ(r.region().device_id(), "cuda:0");
  }
  std::uint64_t old_id = cache.classify(first->data(), n).buffer_id;
  first->free();
  // Freed: never classified as the old device buffer.
  memory_region gone = cache.classify(reinterpret_cast<void*>(addr), n);
  EXPECT_TRUE(gone.type == memory_type::unknown || gone.buffer_id != old_id) << to_string(gone.type);
  std::vector<unsigned char> host(4096, 7);
  EXPECT_THROW(rt.engine().copy(reinterpret_cast<void*>(addr), host.data(), host.size()), error);
  // Re-allocate: the driver usually hands back the same address.
  cu_buffer again(0, n);
  auto before = cache.stats().stale_detected;
  registration r2 = cache.acquire(again.data(), n);
  EXPECT_NE(r2.region().buffer_id, old_id);
  if (again.p == addr) EXPECT_EQ(cache.stats().stale_detected, before + 1) << "same address, new buffer: stale entry dropped";
  else GTEST_LOG_(INFO) << "the driver returned a different address; stale detection not exercised";
  auto src = random_bytes(n, 3);
  rt.engine().copy(again.data(), src.data(), n);
  EXPECT_EQ(sum_on(rt, "cuda:0", again.data(), n), checksum64(src.data(), n));
}

TEST(GpuEngine, APageCacheReadIntoDeviceMemoryCopiesTheFilesOwnPages) {
  settings st = g_settings;
  st.io_mapped = 16ull << 20;  // FERRY_IO_MAPPED
  runtime rt(st);
  const std::size_t n = (72ull << 20) + 4096 + 5;  // more than one mapped piece, and a partial page
  auto data = random_bytes(n, 4);
  char path[] = "/tmp/ferry-gpu-mapped-XXXXXX";
  int fd = ::mkstemp(path);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::write(fd, data.data(), n), static_cast<ssize_t>(n));  // in the page cache now
  ::close(fd);
  auto f = file::open(path, open_mode::read);
  cu_buffer d(0, n);
  // The whole file, and a range at an odd offset into an odd place.
  std::uint64_t before = rt.files().counters().get("reads.mapped").value();
  const std::uint64_t pinned = rt.registrations().stats().bytes_pinned;
  EXPECT_EQ(rt.files().read(*f, 0, d.data(), n), n);
  EXPECT_EQ(sum_on(rt, "cuda:0", d.data(), n), checksum64(data.data(), n));
  const std::size_t off = 3 * 4096 + 17, len = (9ull << 20) + 333;
  EXPECT_EQ(rt.files().read(*f, off, d.data() + 8, len), len);
  EXPECT_EQ(sum_on(rt, "cuda:0", d.data() + 8, len), checksum64(data.data() + off, len));
  // Every piece of both reads (a large read is cut into pieces for several threads) was mapped.
  auto& c = rt.files().counters();
  EXPECT_GE(c.get("reads.mapped").value(), before + 2);
  EXPECT_EQ(c.get("reads.direct").value() + c.get("reads.buffered").value(), 0u) << "a piece was staged or read around the page cache";
  // Nothing stays mapped (nor pinned: a pin ends before its mapping): the pages are the page cache's again.
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) EXPECT_EQ(line.find(path), std::string::npos) << "left mapped: " << line;
  EXPECT_EQ(rt.registrations().stats().bytes_pinned, pinned) << "file pages pinned through the cache";
  ::unlink(path);
}

TEST(GpuEngine, DmabufExportGivesAValidFd) {
  cu_buffer b(0, 4ull << 20);
  auto aligned = (b.p + (2ull << 20) - 1) & ~((2ull << 20) - 1);
  try {
    dmabuf d = export_dmabuf(reinterpret_cast<void*>(aligned), 2ull << 20, g_settings.cuda_driver);
    EXPECT_GE(d.fd(), 0);
    EXPECT_NE(::fcntl(d.fd(), F_GETFD), -1);
    std::printf("dma-buf fd %d for %s\n", d.fd(), describe_range(reinterpret_cast<void*>(aligned), 2ull << 20).c_str());
  } catch (const error& e) {
    if (e.code() == errc::not_supported) GTEST_SKIP() << e.what();
    throw;
  }
  EXPECT_THROW(export_dmabuf(reinterpret_cast<void*>(aligned + 1), 4096, g_settings.cuda_driver), error);
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  g_settings = settings::from_env();
  const cuda::driver_status& st = cuda::load(g_settings.cuda_driver);
  if (!st.api || st.device_count == 0) {
    std::printf("SKIPPED: no usable CUDA device: %s\n", st.api ? "no device" : st.reason.c_str());
    return 77;
  }
  g_api = st.api;
  g_gpus = st.device_count;
  return RUN_ALL_TESTS();
}
