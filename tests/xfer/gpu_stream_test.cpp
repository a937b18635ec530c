// ferry on a user's CUDA streams (label "gpu"; exit 77 without a GPU). The user's side is written
// the way a user writes it: their own streams (cuStreamCreate, the legacy and per-thread default
// streams), their own kernels (tests/support/user_kernels.cu, launched here, not by ferry), their
// own allocations (cuMemAlloc, cuMemHostRegister) -- and no synchronization between their kernels
// and ferry's stream-ordered batches.
#include <ferry/runtime.hpp>
#include <ferry/vm/address_space.hpp>

#include "mem/cuda/driver.hpp"
#include "support/served_process.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <spawn.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>
#include <fstream>
#include <thread>

namespace ferry::detail {
extern const unsigned char ferry_user_kernels[];
}

using namespace ferry;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

namespace {

settings g_settings;
const cuda::driver_api* g_api = nullptr;

#define CU(call) cuda::check(g_api->call, "test", #call)

unsigned value_at(std::uint64_t i, unsigned seed) {
  std::uint64_t z = (i + seed) * 0x9E3779B97F4A7C15ull;
  return static_cast<unsigned>(z ^ (z >> 29));
}

// The user's program: the primary context of cuda:0 (as the runtime API, torch and CuPy use), their
// kernels, their streams.
struct user_program {
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  CUmodule mod = nullptr;
  CUfunction produce = nullptr, consume = nullptr;
  user_program() {
    CU(cuDeviceGet(&dev, 0));
    CU(cuDevicePrimaryCtxRetain(&ctx, dev));
    CU(cuCtxSetCurrent(ctx));
    CU(cuModuleLoadData(&mod, ferry::detail::ferry_user_kernels));
    CU(cuModuleGetFunction(&produce, mod, "user_produce"));
    CU(cuModuleGetFunction(&consume, mod, "user_consume"));
  }
  ~user_program() {
    g_api->cuModuleUnload(mod);
    g_api->cuDevicePrimaryCtxRelease(dev);
  }
  void launch_produce(CUstream s, void* dst, std::uint64_t bytes, unsigned seed, std::uint64_t spin_ns) {
    unsigned long long words = bytes / 4, sp = spin_ns;
    void* args[] = {&dst, &words, &seed, &sp};
    CU(cuLaunchKernel(produce, 264, 1, 1, 256, 1, 1, 0, s, args, nullptr));
  }
  void launch_consume(CUstream s, const void* src, std::uint64_t bytes, unsigned seed, unsigned long long* bad) {
    unsigned long long words = bytes / 4;
    void* args[] = {const_cast<void**>(&src), &words, &seed, &bad};
    CU(cuLaunchKernel(consume, 264, 1, 1, 256, 1, 1, 0, s, args, nullptr));
  }
};

struct cu_buffer {
  CUdeviceptr p = 0;
  explicit cu_buffer(std::size_t n) { CU(cuMemAlloc(&p, n)); }
  ~cu_buffer() { g_api->cuMemFree(p); }
  void* data() const { return reinterpret_cast<void*>(p); }
};

// Pinned host memory the way cudaHostRegister makes it.
struct registered_host {
  std::vector<std::byte> v;
  explicit registered_host(std::size_t n) : v(n) { CU(cuMemHostRegister(v.data(), n, 0)); }
  ~registered_host() { g_api->cuMemHostUnregister(v.data()); }
  void* data() { return v.data(); }
};

CUcontext current() {
  CUcontext c = nullptr;
  CU(cuCtxGetCurrent(&c));
  return c;
}

// Producer kernel -> ferry batch (device -> device, and pageable host -> device through ferry's
// CPU-side staging) -> consumer kernels, on stream `s`; the producer runs long enough that a batch
// not ordered behind it would copy stale bytes.
void produce_transfer_consume(runtime& rt, user_program& u, CUstream s, const char* which) {
  SCOPED_TRACE(which);
  const std::size_t n = 64ull << 20;
  cu_buffer a(n), b(n), c(n), bad(8);
  std::vector<unsigned> host(n / 4);
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = value_at(i, 9);
  registered_host result(8);
  CU(cuMemsetD8Async(bad.p, 0, 8, s));
  u.launch_produce(s, c.data(), n, 0, 0);          // c gets stale content
  u.launch_produce(s, a.data(), n, 7, 50'000'000);  // the producer: 50 ms, then a = value_at(i, 7)
  auto view = rt.devices().get("cuda:0").wrap_stream(native_stream{reinterpret_cast<std::uintptr_t>(s)});
  transfer_options o;
  o.on = view.get();
  std::vector<transfer_request> reqs = {{b.data(), a.data(), n}, {c.data(), host.data(), n}};
  transfer_batch t = rt.engine().submit(reqs, o);
  auto* badp = reinterpret_cast<unsigned long long*>(bad.p);
  u.launch_consume(s, b.data(), n, 7, badp);  // the consumers
  u.launch_consume(s, c.data(), n, 9, badp);
  CU(cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(result.data()), bad.p, 8, s));
  EXPECT_FALSE(t.poll()) << "the batch finished before the producer could have";
  CU(cuStreamSynchronize(s));  // the test's check, after everything was enqueued
  ASSERT_TRUE(t.wait()) << (t.results()[0].err ? t.results()[0].err->what() : "");
  std::uint64_t mismatches = 0;
  std::memcpy(&mismatches, result.data(), 8);
  EXPECT_EQ(mismatches, 0u) << "the consumers saw stale bytes";
  EXPECT_EQ(t.results()[0].path, transfer_path::direct);
}

// A file of value_at(i, seed) words.
std::filesystem::path words_file(std::size_t bytes, unsigned seed) {
  auto p = std::filesystem::path("/tmp") / ("ferry-gpu-stream-" + std::to_string(::getpid()) + "-" + std::to_string(seed));
  std::vector<unsigned> w(bytes / 4);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = value_at(i, seed);
  std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(w.data()), static_cast<std::streamsize>(bytes));
  return p;
}

// The streams issue's scenario: producer kernel -> consumer kernel -> ferry reads a file into the
// buffer the consumer just read -> consumer kernel on the file's data, all on one stream of the
// user's, nothing synchronized in between.
void produce_consume_read_consume(runtime& rt, user_program& u, CUstream s, const char* which) {
  SCOPED_TRACE(which);
  const std::size_t n = 64ull << 20;
  auto path = words_file(n, 21);
  auto f = file::open(path.string(), open_mode::read);
  cu_buffer a(n), bad(16);
  registered_host result(16);
  auto* badp = reinterpret_cast<unsigned long long*>(bad.p);
  CU(cuMemsetD8Async(bad.p, 0, 16, s));
  u.launch_produce(s, a.data(), n, 7, 50'000'000);  // 50 ms, then a = value_at(i, 7)
  u.launch_consume(s, a.data(), n, 7, badp);        // reads what the producer wrote
  auto view = rt.devices().get("cuda:0").wrap_stream(native_stream{reinterpret_cast<std::uintptr_t>(s)});
  transfer_options o;
  o.on = view.get();
  file_request q{f, 0, a.data(), n, false};
  transfer_batch t = rt.files().submit({&q, 1}, o);  // overwrites it: only after the consumer
  u.launch_consume(s, a.data(), n, 21, badp + 1);     // reads the file's words
  CU(cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(result.data()), bad.p, 16, s));
  CU(cuStreamSynchronize(s));
  ASSERT_TRUE(t.wait()) << (t.results()[0].err ? t.results()[0].err->what() : "");
  std::uint64_t mism[2] = {};
  std::memcpy(mism, result.data(), 16);
  EXPECT_EQ(mism[0], 0u) << "the first consumer saw the file's bytes: the read overtook it";
  EXPECT_EQ(mism[1], 0u) << "the second consumer saw stale bytes: it overtook the read";
  std::filesystem::remove(path);
}

TEST(GpuStreams, ProducerConsumerFileReadConsumerOnTheUsersStreams) {
  runtime rt(g_settings);
  user_program u;
  CUstream s = nullptr;
  CU(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  produce_consume_read_consume(rt, u, s, "user stream");
  g_api->cuStreamDestroy(s);
  produce_consume_read_consume(rt, u, reinterpret_cast<CUstream>(native_stream::per_thread().handle), "per-thread default stream");
}

// A file cut short while the stream-ordered read waits behind the user's kernel: the read fails,
// says so, and the stream is released well within the deadline.
TEST(GpuStreams, AFileTruncatedUnderAStreamOrderedReadReleasesTheStream) {
  runtime rt(g_settings);
  user_program u;
  CUstream s = nullptr;
  CU(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  const std::size_t n = 128ull << 20;
  auto path = words_file(n, 3);
  auto f = file::open(path.string(), open_mode::read);
  cu_buffer a(n), bad(8);
  u.launch_produce(s, a.data(), n, 1, 300'000'000);  // the user's kernel: 300 ms
  auto view = rt.devices().get("cuda:0").wrap_stream(native_stream{reinterpret_cast<std::uintptr_t>(s)});
  transfer_options o;
  o.on = view.get();
  o.until = deadline_after(10s);
  file_request q{f, 0, a.data(), n, false};
  transfer_batch t = rt.files().submit({&q, 1}, o);
  std::filesystem::resize_file(path, 40ull << 20);  // cut under the read
  CU(cuMemsetD8Async(bad.p, 0, 8, s));              // the user's next step
  auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(t.wait());
  ASSERT_TRUE(t.results()[0].err);
  EXPECT_THAT(t.results()[0].err->what(), HasSubstr(path.string()));
  CU(cuStreamSynchronize(s));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s) << "the stream was held past the failure";
  g_api->cuStreamDestroy(s);
  std::filesystem::remove(path);
}

// `ferry serve` in a process of its own (tests/support/served_process.hpp); the ferry binary comes
// from ctest: --ferry-binary PATH.
std::string g_ferry_binary;

// The server is killed while a stream-ordered read of one of its files waits behind the user's
// kernel: the read fails, names the server, and the user's stream goes on well within the deadline.
TEST(GpuStreams, AServerKilledUnderAStreamOrderedReadReleasesTheStream) {
  if (g_ferry_binary.empty()) GTEST_SKIP() << "needs --ferry-binary PATH (ctest passes it)";
  auto root = std::filesystem::path("/tmp") / ("ferry-gpu-serve-" + std::to_string(::getpid()));
  std::filesystem::create_directories(root);
  const std::size_t n = 256ull << 20;
  std::filesystem::rename(words_file(n, 5), root / "data.bin");
  test::served_process srv(g_ferry_binary, root, 0, {}, test::through_the_server);
  runtime rt(g_settings);
  user_program u;
  CUstream s = nullptr;
  CU(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  auto f = file::open("ferry://127.0.0.1:" + std::to_string(srv.port) + "/data.bin", open_mode::read);
  cu_buffer a(n), bad(8);
  u.launch_produce(s, a.data(), n, 1, 300'000'000);  // the user's kernel: 300 ms
  auto view = rt.devices().get("cuda:0").wrap_stream(native_stream{reinterpret_cast<std::uintptr_t>(s)});
  transfer_options o;
  o.until = deadline_after(20s);
  transfer_batch t = rt.files().read_async(f, 0, a.data(), n, *view, o);
  srv.kill();                            // the server dies under the read
  CU(cuMemsetD8Async(bad.p, 0, 8, s));  // the user's next step
  auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(t.wait());
  auto r = t.results()[0];
  EXPECT_EQ(r.state, request_state::failed) << "the failure was noticed, not waited out to the deadline";
  ASSERT_TRUE(r.err);
  EXPECT_THAT(r.err->what(), HasSubstr("127.0.0.1:" + std::to_string(srv.port)));
  CU(cuStreamSynchronize(s));
  auto took = std::chrono::steady_clock::now() - start;
  EXPECT_LT(took, 10s) << "the stream was held past the failure";
  std::printf("server killed: the read failed and the stream went on after %.0f ms: %s\n",
              std::chrono::duration<double, std::milli>(took).count(), r.err->what());
  g_api->cuStreamDestroy(s);
  std::filesystem::remove_all(root);
}

TEST(GpuStreams, ProducerBatchConsumerOnTheUsersOwnStream) {
  runtime rt(g_settings);
  user_program u;
  CUstream s = nullptr;
  CU(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));  // as torch makes its streams
  produce_transfer_consume(rt, u, s, "user stream");
  g_api->cuStreamDestroy(s);
}

TEST(GpuStreams, ProducerBatchConsumerOnTheDefaultStreams) {
  runtime rt(g_settings);
  user_program u;
  produce_transfer_consume(rt, u, reinterpret_cast<CUstream>(native_stream::per_thread().handle), "per-thread default stream");
  produce_transfer_consume(rt, u, nullptr, "legacy default stream (0)");
}

TEST(GpuStreams, ADeadlineReleasesTheUsersStream) {
  runtime rt(g_settings);
  user_program u;
  CUstream s = nullptr;
  CU(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  const std::size_t n = 1 << 20;
  cu_buffer a(n), b(n), bad(8);
  u.launch_produce(s, a.data(), n, 1, 1'500'000'000);  // the user's kernel: 1.5 s
  auto view = rt.devices().get("cuda:0").wrap_stream(native_stream{reinterpret_cast<std::uintptr_t>(s)});
  transfer_request q{b.data(), a.data(), n};
  transfer_options o;
  o.on = view.get();
  o.until = deadline_after(200ms);
  transfer_batch t = rt.engine().submit({&q, 1}, o);
  CU(cuMemsetD8Async(bad.p, 0, 8, s));  // later work of the user's
  EXPECT_FALSE(t.wait());
  EXPECT_EQ(t.results()[0].state, request_state::timed_out);
  ASSERT_TRUE(t.results()[0].err);
  EXPECT_THAT(t.results()[0].err->what(), HasSubstr("stream"));
  auto start = std::chrono::steady_clock::now();
  view->synchronize(deadline_after(10s));  // not blocked forever: the kernel ends, then the released gate
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  g_api->cuStreamDestroy(s);
}

TEST(GpuStreams, TheCallersContextIsRestoredAfterEveryCall) {
  // A thread with no context current, and one with the primary context current: after each ferry
  // call the thread has what it had.
  for (bool with_ctx : {false, true}) {
    SCOPED_TRACE(with_ctx ? "primary context current" : "no context current");
    std::thread([&] {
      CUdevice d = 0;
      CUcontext primary = nullptr;
      CU(cuDeviceGet(&d, 0));
      CU(cuDevicePrimaryCtxRetain(&primary, d));
      CUcontext want = with_ctx ? primary : nullptr;
      CU(cuCtxSetCurrent(want));
      runtime rt(g_settings);
      EXPECT_EQ(current(), want) << "after runtime()";
      device& dev = rt.devices().get("cuda:0");
      auto s = dev.create_stream();
      EXPECT_EQ(current(), want) << "after create_stream";
      std::vector<std::byte> host(1 << 20);
      va_range r = dev.reserve(dev.granularity());
      physical_chunk ch = dev.allocate(dev.granularity());
      dev.map(r.base(), ch);
      access_desc g[] = {{location::on_device(0), access::read_write}};
      dev.set_access(r.base(), dev.granularity(), g);
      EXPECT_EQ(current(), want) << "after allocate/map/set_access";
      rt.engine().copy(r.base(), host.data(), host.size());
      rt.engine().copy(host.data(), r.base(), host.size());
      EXPECT_EQ(current(), want) << "after engine copies";
      s->fill_pattern(r.base(), 4096, 1);
      s->synchronize();
      EXPECT_EQ(current(), want) << "after stream work";
      auto v = dev.wrap_stream(s->native_handle());
      EXPECT_EQ(current(), want) << "after wrap_stream";
      (void)rt.registrations().classify(host.data(), host.size());
      EXPECT_EQ(current(), want) << "after classify";
      dev.unmap(r.base(), dev.granularity());
      g_api->cuCtxSetCurrent(nullptr);
      g_api->cuDevicePrimaryCtxRelease(d);
    }).join();
  }
}

TEST(GpuStreams, CudaHostRegisteredMemoryIsPinnedAndCopiedDirectly) {
  runtime rt(g_settings);
  user_program u;
  const std::size_t n = 8 << 20;
  registered_host h(n);
  memory_region r = rt.registrations().classify(h.data(), n);
  EXPECT_EQ(r.type, memory_type::host_pinned);
  cu_buffer d(n);
  transfer_request q{d.data(), h.data(), n};
  transfer_batch t = rt.engine().submit({&q, 1});
  ASSERT_TRUE(t.wait());
  EXPECT_EQ(t.results()[0].path, transfer_path::direct) << "pinned by the user: no staging, no second registration";
}

// Unified memory with the user's stream attached: the user's kernel spins, then writes every page;
// the CPU touches the last page while it spins. The CPU's fault must wait for the kernel (else it
// would read stale bytes, or the kernel would write a page the migration unmapped).
TEST(GpuStreams, UnifiedMemoryWaitsForTheUsersKernelOnAnAttachedStream) {
  runtime rt(g_settings);
  user_program u;
  device& dev = rt.devices().get("cuda:0");
  const std::size_t n = 256ull << 20;
  vm::address_space as(dev, n);
  auto* p = static_cast<unsigned*>(as.alloc(n));
  as.advise(p, n, vm::advice::prefetch, memory_kind::device);
  CUstream s = nullptr;
  CU(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  auto view = dev.wrap_stream(native_stream{reinterpret_cast<std::uintptr_t>(s)});
  as.attach_stream(*view);
  u.launch_produce(s, p, n, 5, 300'000'000);  // 300 ms, then p[i] = value_at(i, 5)
  volatile unsigned last = p[n / 4 - 1];      // the CPU faults the last page at once
  EXPECT_EQ(last, value_at(n / 4 - 1, 5));
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n / 4; ++i) bad += p[i] != value_at(i, 5);
  EXPECT_EQ(bad, 0u) << "the CPU saw words the kernel had not written yet";
  CU(cuStreamSynchronize(s));
  as.detach_stream(*view);
  g_api->cuStreamDestroy(s);
}

TEST(GpuStreams, AStreamOfAnotherContextIsRefusedByName) {
  runtime rt(g_settings);
  device& dev = rt.devices().get("cuda:0");
  CUdevice d = 0;
  CUcontext other = nullptr, before = current();
  CU(cuDeviceGet(&d, 0));
  CU(cuCtxCreate(&other, nullptr, 0, d));  // a driver-API context of the user's, not the primary one
  CUstream s = nullptr;
  CU(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  try {
    dev.wrap_stream(native_stream{reinterpret_cast<std::uintptr_t>(s)});
    FAIL() << "a stream of another context was wrapped";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::invalid_argument);
    EXPECT_THAT(e.what(), HasSubstr("context"));
  }
  EXPECT_EQ(current(), other) << "the caller's own context is still current";
  g_api->cuStreamDestroy(s);
  g_api->cuCtxDestroy(other);
  g_api->cuCtxSetCurrent(before);
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
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string_view(argv[i]) == "--ferry-binary") g_ferry_binary = argv[i + 1];
  return RUN_ALL_TESTS();
}
