// GPU-initiated reads on a real GPU (label "gpu"; exit 77 without one): the kernel's warps put read
// requests into a ferry::gpu::proxy's ring and wait for the answers; the proxy serves them from a
// file into device memory. The kernel (tests/gpu/access_kernels.cu) is loaded and launched by the
// test itself, on its own stream.
#include <ferry/gpu/proxy.hpp>
#include <ferry/runtime.hpp>

#include "mem/cuda/driver.hpp"
#include "support/data.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <unistd.h>

namespace ferry::detail {
extern const unsigned char ferry_access_kernels[];
}

using namespace ferry;
using ::testing::HasSubstr;

namespace {

settings g_settings;
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

// The user's side: primary context, the kernel, a stream.
struct user_program {
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  CUmodule mod = nullptr;
  CUfunction read = nullptr;
  CUstream s = nullptr;
  user_program() {
    CU(cuDeviceGet(&dev, 0));
    CU(cuDevicePrimaryCtxRetain(&ctx, dev));
    CU(cuCtxSetCurrent(ctx));
    CU(cuModuleLoadData(&mod, ferry::detail::ferry_access_kernels));
    CU(cuModuleGetFunction(&read, mod, "gpu_access_read"));
    CU(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  }
  ~user_program() {
    g_api->cuStreamDestroy(s);
    g_api->cuModuleUnload(mod);
    g_api->cuDevicePrimaryCtxRelease(dev);
  }
};

struct data_file {
  std::filesystem::path path;
  std::vector<std::byte> bytes;
  data_file(std::size_t n, std::uint64_t seed) : bytes(n) {
    path = std::filesystem::path(::testing::TempDir()) / ("ferry-gpu-access-" + std::to_string(::getpid()));
    test::fill_random(bytes.data(), n, seed);
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(n));
  }
  ~data_file() { std::filesystem::remove(path); }
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
  device_buffer dst(chunks * chunk), done(warps * 4), st(chunks * 4);
  gpu::ring_view v = px.view();
  unsigned* donep = done.as<unsigned>();
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
  auto px = std::make_unique<gpu::proxy>(rt, rt.devices().get("cuda:0"));
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
  auto px = std::make_unique<gpu::proxy>(rt, rt.devices().get("cuda:0"));
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
  auto px = std::make_unique<gpu::proxy>(rt, rt.devices().get("cuda:0"));
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

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  g_settings = settings::from_env();
  const cuda::driver_status& st = cuda::load(g_settings.cuda_driver);
  g_api = st.api;
  if (!st.api || st.device_count == 0) {
    std::printf("SKIPPED: no usable CUDA device: %s\n", st.api ? "no device" : st.reason.c_str());
    return 77;
  }
  return RUN_ALL_TESTS();
}
