// The peer-memory clients of the mem layer (host memory, CUDA-known memory), and read-only pins.
#include <ferry/core/error.hpp>
#include <ferry/mem/registration.hpp>

#include "core/logging.hpp"
#ifdef FERRY_HAVE_CUDA
#include "mem/cuda/driver.hpp"
#endif

#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <mutex>
#include <vector>

namespace ferry {
namespace {

std::uintptr_t page_size() { return static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE)); }

// Whether [p, p+n) is host memory ferry may use: a freed cudaMalloc address stays mapped PROT_NONE
// inside CUDA's UVA reservation, and must not pass for host memory. A range of a few pages is read
// one byte per page in one call (every page mapped and readable, in the one system call a small
// request can afford); a larger one is checked by msync (every page mapped: ENOMEM otherwise) and
// the reads of its first and last bytes.
constexpr std::uintptr_t few_pages = 64;
// 1: every byte read; 0: one was not readable; -1: process_vm_readv is not allowed here.
int read_bytes(const std::uintptr_t* at, std::size_t k) {
  std::array<char, few_pages> got;
  std::array<iovec, few_pages> local, remote;
  for (std::size_t i = 0; i < k; ++i) {
    local[i] = {&got[i], 1};
    remote[i] = {reinterpret_cast<void*>(at[i]), 1};
  }
  ssize_t r = ::process_vm_readv(::getpid(), local.data(), k, remote.data(), k, 0);
  if (r < 0 && (errno == ENOSYS || errno == EPERM)) return -1;
  return r == static_cast<ssize_t>(k) ? 1 : 0;
}
bool mapped(const void* p, std::uint64_t n) {
  const std::uintptr_t ps = page_size(), a = reinterpret_cast<std::uintptr_t>(p), e = a + n;
  const std::uintptr_t first = a & ~(ps - 1), pages = (e - first + ps - 1) / ps;
  std::array<std::uintptr_t, few_pages> at;
  if (pages <= few_pages) {
    for (std::uintptr_t i = 0; i < pages; ++i) at[i] = std::max(a, first + i * ps);
    int r = read_bytes(at.data(), pages);
    if (r >= 0) return r == 1;
  }
  if (::msync(reinterpret_cast<void*>(first), e - first, MS_ASYNC) != 0) return false;
  at[0] = a;
  at[1] = e - 1;
  return read_bytes(at.data(), 2) != 0;  // not allowed: trust msync
}

#ifdef FERRY_HAVE_CUDA
// A context for driver calls that need one: the primary context of the GPU the constructing thread
// works on (a torchrun rank's, its current context's device), else of device 0. Retaining device 0's
// in every process would make a context on GPU 0 for every rank of a node.
struct cuda_ctx {
  const cuda::driver_api* api = nullptr;
  CUcontext ctx = nullptr;
  explicit cuda_ctx(const std::string& lib) {
    const cuda::driver_status& st = cuda::load(lib);
    if (!st.api || st.device_count == 0) return;
    CUdevice d = 0;
    CUcontext current = nullptr;
    const bool has_current = st.api->cuCtxGetCurrent(&current) == CUDA_SUCCESS && current &&
                             st.api->cuCtxGetDevice(&d, current) == CUDA_SUCCESS;
    if (!has_current && st.api->cuDeviceGet(&d, 0) != CUDA_SUCCESS) return;
    if (st.api->cuDevicePrimaryCtxRetain(&ctx, d) != CUDA_SUCCESS) return;
    api = st.api;
  }
  // That primary context, current until the scope ends.
  cuda::context_scope current() const { return cuda::context_scope(*api, ctx); }
};
#endif

class host_client final : public peer_memory_client {
 public:
  explicit host_client([[maybe_unused]] const std::string& driver)
#ifdef FERRY_HAVE_CUDA
      : cuda_(driver)
#endif
  {
  }
  std::string_view name() const noexcept override { return "host"; }
  std::optional<memory_region> acquire(const void* p, std::uint64_t n) override {
    if (!mapped(p, n)) return std::nullopt;
    return memory_region{memory_type::host_pageable, device_kind::none, -1, reinterpret_cast<std::uintptr_t>(p), n, 0, this};
  }
  std::uint64_t pin(const memory_region&, std::uintptr_t base, std::uint64_t size) override {
#ifdef FERRY_HAVE_CUDA
    if (cuda_.api) {
      auto cs = cuda_.current();
      cuda::check(cuda_.api->cuMemHostRegister(reinterpret_cast<void*>(base), size, CU_MEMHOSTREGISTER_PORTABLE),
                  "mem.pin", fmt::format("host {}", describe_range(base, size)));
      return 1;
    }
#endif
    // No CUDA: page-lock so the cache behaves (and costs) the same way on CPU-only machines.
    if (::mlock(reinterpret_cast<void*>(base), size) != 0)
      fail_errno(errno, "mem.pin", fmt::format("host {}", describe_range(base, size)), "mlock failed (RLIMIT_MEMLOCK?)");
    return 2;
  }
  void unpin(std::uint64_t cookie, std::uintptr_t base, std::uint64_t size) noexcept override {
#ifdef FERRY_HAVE_CUDA
    if (cookie == 1 && cuda_.api) {
      auto cs = cuda_.current();
      cuda_.api->cuMemHostUnregister(reinterpret_cast<void*>(base));
      return;
    }
#endif
    if (cookie == 2) ::munlock(reinterpret_cast<void*>(base), size);
  }
  // Host memory that goes away is reported by the munmap hooks; nothing to check per hit.
  bool still_valid(const memory_region&) override { return true; }

 private:
#ifdef FERRY_HAVE_CUDA
  cuda_ctx cuda_;
#endif
};

#ifdef FERRY_HAVE_CUDA
class cuda_client final : public peer_memory_client {
 public:
  explicit cuda_client(cuda_ctx c) : c_(std::move(c)) {}
  std::string_view name() const noexcept override { return "cuda"; }
  std::optional<memory_region> acquire(const void* p, std::uint64_t n) override {
    auto cs = c_.current();
    unsigned type = 0;
    int ordinal = -1;
    unsigned managed = 0;
    unsigned long long buffer_id = 0;
    CUdeviceptr start = 0;
    size_t size = 0;
    CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                   CU_POINTER_ATTRIBUTE_IS_MANAGED, CU_POINTER_ATTRIBUTE_BUFFER_ID,
                                   CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE};
    void* data[] = {&type, &ordinal, &managed, &buffer_id, &start, &size};
    if (c_.api->cuPointerGetAttributes(6, attrs, data, reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS || type == 0)
      return std::nullopt;  // not memory the driver knows: host pageable, or foreign
    memory_region r;
    r.client = this;
    r.buffer_id = buffer_id;
    r.base = start ? static_cast<std::uintptr_t>(start) : reinterpret_cast<std::uintptr_t>(p);
    r.size = size ? size : n;
    if (managed) {
      r.type = memory_type::managed;
      r.ordinal = ordinal;
      r.device = device_kind::cuda;
    } else if (type == CU_MEMORYTYPE_DEVICE) {
      r.type = memory_type::device;
      r.ordinal = ordinal;
      r.device = device_kind::cuda;
    } else if (type == CU_MEMORYTYPE_HOST) {
      // Only a range wholly inside what CUDA registered is pinned; a range that merely starts in a
      // registered prefix is pageable beyond it (the cache registers the rest).
      if (!r.contains(reinterpret_cast<std::uintptr_t>(p), n)) return std::nullopt;
      r.type = memory_type::host_pinned;
    } else {
      return std::nullopt;
    }
    return r;
  }
  // Device, managed and already-pinned host memory need no pinning for CUDA copy engines.
  std::uint64_t pin(const memory_region&, std::uintptr_t, std::uint64_t) override { return 0; }
  void unpin(std::uint64_t, std::uintptr_t, std::uint64_t) noexcept override {}
  bool pin_is_free() const noexcept override { return true; }
  // cudaFree + cudaMalloc at the same address gives a new buffer id.
  bool still_valid(const memory_region& r) override {
    auto cs = c_.current();
    unsigned long long id = 0;
    CUpointer_attribute a = CU_POINTER_ATTRIBUTE_BUFFER_ID;
    void* d = &id;
    return c_.api->cuPointerGetAttributes(1, &a, &d, static_cast<CUdeviceptr>(r.base)) == CUDA_SUCCESS &&
           id == r.buffer_id && id != 0;
  }

 private:
  cuda_ctx c_;
};
#endif

#ifdef FERRY_HAVE_CUDA
class cuda_read_only_pins final : public read_only_pins {
 public:
  explicit cuda_read_only_pins(const cuda::driver_api* api, int devices) : api_(api), contexts_(static_cast<std::size_t>(devices)) {}
  ~cuda_read_only_pins() override {
    for (std::size_t i = 0; i < contexts_.size(); ++i)
      if (contexts_[i]) {
        CUdevice d = 0;
        if (api_->cuDeviceGet(&d, static_cast<int>(i)) == CUDA_SUCCESS) api_->cuDevicePrimaryCtxRelease(d);
      }
  }
  memory_region pin(const void* p, std::uint64_t n, int ordinal) override {
    auto cs = cuda::context_scope(*api_, context(ordinal));
    cuda::check(api_->cuMemHostRegister(const_cast<void*>(p), n, CU_MEMHOSTREGISTER_READ_ONLY), "mem.pin",
                fmt::format("read-only host {} for cuda:{}", describe_range(p, n), ordinal));
    return memory_region{memory_type::host_pinned, device_kind::none, -1, reinterpret_cast<std::uintptr_t>(p), n, 0, nullptr};
  }
  void unpin(const void* p, int ordinal) noexcept override {
    try {
      auto cs = cuda::context_scope(*api_, context(ordinal));
      api_->cuMemHostUnregister(const_cast<void*>(p));
    } catch (...) {
    }
  }

 private:
  // The primary context of a GPU, retained on first use (a GPU the process never copies to gets none).
  CUcontext context(int ordinal) {
    std::lock_guard l(mu_);
    auto& c = contexts_.at(static_cast<std::size_t>(ordinal));
    if (!c) {
      CUdevice d = 0;
      cuda::check(api_->cuDeviceGet(&d, ordinal), "mem.pin", fmt::format("cuda:{}", ordinal));
      cuda::check(api_->cuDevicePrimaryCtxRetain(&c, d), "mem.pin", fmt::format("cuda:{}", ordinal));
    }
    return c;
  }
  const cuda::driver_api* api_;
  std::mutex mu_;
  std::vector<CUcontext> contexts_;
};
#endif

}  // namespace

read_only_pins::~read_only_pins() = default;

std::unique_ptr<read_only_pins> read_only_pins::make([[maybe_unused]] const std::string& cuda_driver) {
#ifdef FERRY_HAVE_CUDA
  const cuda::driver_status& st = cuda::load(cuda_driver);
  if (st.api && st.device_count > 0) return std::make_unique<cuda_read_only_pins>(st.api, st.device_count);
#endif
  return nullptr;
}

std::unique_ptr<peer_memory_client> make_host_client(const std::string& cuda_driver) {
  return std::make_unique<host_client>(cuda_driver);
}

std::unique_ptr<peer_memory_client> make_cuda_client([[maybe_unused]] const std::string& cuda_driver) {
#ifdef FERRY_HAVE_CUDA
  cuda_ctx c(cuda_driver);
  if (c.api) return std::make_unique<cuda_client>(std::move(c));
#endif
  return nullptr;
}

}  // namespace ferry
