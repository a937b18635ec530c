#include "device/cuda/cuda_device.hpp"

#include "core/fault_note.hpp"
#include "core/logging.hpp"
#include "mem/cuda/driver.hpp"
#include "device/cuda/cupti.hpp"
#include "device/cuda/nvml.hpp"
#include "device/poll.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <utility>
#include <vector>

namespace ferry::detail {
extern const unsigned char ferry_cuda_kernels[];
extern const std::size_t ferry_cuda_kernels_size;
}  // namespace ferry::detail

namespace ferry::cuda {
namespace {

const driver_api& api_or_throw(const device_settings& s, std::string_view op) {
  const driver_status& st = load(s.cuda_driver);
  if (!st.api) fail(errc::unavailable, std::string(op), "cuda", st.reason);
  return *st.api;
}

CUmemAccess_flags to_cu(access a) {
  switch (a) {
    case access::none: return CU_MEM_ACCESS_FLAGS_PROT_NONE;
    case access::read: return CU_MEM_ACCESS_FLAGS_PROT_READ;
    case access::read_write: return CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  return CU_MEM_ACCESS_FLAGS_PROT_NONE;
}

class cuda_device;

class cuda_event final : public event {
 public:
  cuda_event(const driver_api& api, CUcontext ctx, CUevent e, std::string name)
      : api_(api), ctx_(ctx), e_(e), name_(std::move(name)) {}
  ~cuda_event() override {
    context_scope cs(api_, ctx_);
    api_.cuEventDestroy(e_);
  }
  CUevent handle() const { return e_; }

 private:
  bool do_query() override {
    context_scope cs(api_, ctx_);
    CUresult r = api_.cuEventQuery(e_);
    if (r == CUDA_ERROR_NOT_READY) return false;
    check(r, "event.query", name_);
    return true;
  }
  std::string do_describe() const override { return name_; }
  const driver_api& api_;
  CUcontext ctx_;
  CUevent e_;
  std::string name_;
};

class cuda_device final : public device, public cupti::launch_sink {
 public:
  cuda_device(int ordinal, const device_settings& s)
      : device(make_info(ordinal, s), s.deadline), api_(api_or_throw(s, "cuda.open")), cupti_library_(s.cupti_library) {
    check(api_.cuDeviceGet(&dev_, ordinal), "cuda.open", id());
    check(api_.cuDevicePrimaryCtxRetain(&ctx_, dev_), "cuda.open", id());
    CUmemAllocationProp prop = device_prop(location::on_device());
    size_t g = 0;
    check(api_.cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), "cuda.granularity", id());
    info_.granularity = g;
  }
  ~cuda_device() override {
    cupti::unwatch(*this);
    {
      context_scope cs(api_, ctx_);
      for (auto& e : launched_) api_.cuEventDestroy(e.event);
      for (auto ev : spare_events_) api_.cuEventDestroy(ev);
    }
    if (module_) {
      context_scope cs(api_, ctx_);
      api_.cuModuleUnload(module_);
    }
    api_.cuDevicePrimaryCtxRelease(dev_);
  }

  const driver_api& api() const { return api_; }
  // The device's context, current until the returned scope ends (then the caller's again).
  [[nodiscard]] context_scope make_current() const {
    context_scope cs(api_, ctx_);
    check(cs.status(), "cuda.set_context", id());
    return cs;
  }
  CUcontext context() const { return ctx_; }
  CUdevice cu_device() const { return dev_; }
  std::uint64_t next_stream_serial() { return ++streams_; }

  // Kernels of kernels.cu, loaded on first use.
  CUfunction kernel(const char* name) {
    std::call_once(module_once_, [&] {
      auto cs = make_current();
      check(api_.cuModuleLoadData(&module_, detail::ferry_cuda_kernels), "cuda.load_kernels", id());
      check(api_.cuModuleGetFunction(&fill_, module_, "ferry_fill_pattern"), "cuda.load_kernels", id());
      check(api_.cuModuleGetFunction(&checksum_, module_, "ferry_checksum"), "cuda.load_kernels", id());
      check(api_.cuModuleGetFunction(&copy_, module_, "ferry_copy"), "cuda.load_kernels", id());
    });
    std::string_view n(name);
    return n == "ferry_fill_pattern" ? fill_ : n == "ferry_copy" ? copy_ : checksum_;
  }
  unsigned launch_blocks() const { return static_cast<unsigned>(sm_count_ * 8); }
  // Whether s captures a CUDA graph now (with the device's context current).
  bool capturing(CUstream s) const noexcept {
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    // An error (the legacy stream while another stream captures) counts as capturing.
    return api_.cuStreamIsCapturing(s, &st) != CUDA_SUCCESS || st != CU_STREAM_CAPTURE_STATUS_NONE;
  }

 private:
  static device_info make_info(int ordinal, const device_settings& s) {
    const driver_api& api = api_or_throw(s, "cuda.open");
    device_info i;
    i.backend = device_kind::cuda;
    i.ordinal = ordinal;
    std::string res = fmt::format("cuda:{}", ordinal);
    CUdevice d = 0;
    check(api.cuDeviceGet(&d, ordinal), "cuda.open", res);
    char name[256] = {};
    check(api.cuDeviceGetName(name, sizeof name, d), "cuda.device_name", res);
    i.name = name;
    CUuuid u{};
    if (api.cuDeviceGetUuid(&u, d) == CUDA_SUCCESS) {
      auto* b = reinterpret_cast<const unsigned char*>(u.bytes);
      i.uuid = fmt::format("GPU-{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
                           b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
                           b[14], b[15]);
    }
    size_t total = 0;
    check(api.cuDeviceTotalMem(&total, d), "cuda.total_memory", res);
    i.total_memory = total;
    auto attr = [&](CUdevice_attribute a, int fallback) {
      int v = fallback;
      return api.cuDeviceGetAttribute(&v, a, d) == CUDA_SUCCESS ? v : fallback;
    };
    i.cc_major = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0);
    i.cc_minor = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0);
    i.numa_node = attr(CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, -1);
    i.copy_engines = attr(CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT, 0);
    char bus[32] = {};
    if (api.cuDeviceGetPCIBusId(bus, sizeof bus, d) == CUDA_SUCCESS) i.pci_bus_id = bus;
    return i;
  }

  CUmemAllocationProp device_prop(location where) {
    CUmemAllocationProp p{};
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    if (where.kind == memory_kind::device) {
      p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      p.location.id = where.id >= 0 ? where.id : info_.ordinal;
      CUdevice d = dev_;
      if (p.location.id != info_.ordinal) {  // a peer's memory, to map here: only with peer access
        std::string res = fmt::format("{} location=cuda:{}", id(), p.location.id);
        int can = 0;
        check(api_.cuDeviceGet(&d, p.location.id), "device.allocate", res);
        check(api_.cuDeviceCanAccessPeer(&can, dev_, d), "device.allocate", res);
        if (!can) fail(errc::not_supported, "device.allocate", res, "the GPUs have no peer access: this device cannot map the peer's memory");
      }
      int rdma = 0;
      if (api_.cuDeviceGetAttribute(&rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, d) ==
              CUDA_SUCCESS && rdma)
        p.allocFlags.gpuDirectRDMACapable = 1;
    } else {
      p.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
      p.location.id = where.id >= 0 ? where.id : (info_.numa_node >= 0 ? info_.numa_node : 0);
    }
    return p;
  }

  memory_usage do_memory() override {
    auto cs = make_current();
    size_t f = 0, t = 0;
    check(api_.cuMemGetInfo(&f, &t), "cuda.memory_info", id());
    return {f, t};
  }
  std::uint64_t do_granularity(location where) override {
    if (where.kind == memory_kind::device) return info_.granularity;
    CUmemAllocationProp p = device_prop(where);
    size_t g = 0;
    check(api_.cuMemGetAllocationGranularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM), "cuda.granularity",
          fmt::format("{} host numa {}", id(), p.location.id));
    return g;
  }
  std::uint64_t do_allocate(std::uint64_t bytes, location where) override {
    auto cs = make_current();
    CUmemAllocationProp p = device_prop(where);
    CUmemGenericAllocationHandle h = 0;
    check(api_.cuMemCreate(&h, bytes, &p, 0), "device.allocate",
          fmt::format("{} bytes={} location={}", id(), bytes,
                      where.kind == memory_kind::device ? fmt::format("cuda:{}", p.location.id) : fmt::format("host numa {}", p.location.id)));
    std::lock_guard l(numa_mu_);
    host_numa_[h] = where.kind == memory_kind::host ? p.location.id : -1;
    return h;
  }
  void do_free(std::uint64_t handle, std::uint64_t, location) noexcept override {
    context_scope cs(api_, ctx_);
    if (CUresult r = api_.cuMemRelease(handle); r != CUDA_SUCCESS)
      log::error("cuda", "{}: cuMemRelease failed: {}", id(), describe(r));
    std::lock_guard l(numa_mu_);
    host_numa_.erase(handle);
  }
  std::uintptr_t do_reserve(std::uint64_t bytes, std::uint64_t alignment) override {
    auto cs = make_current();
    CUdeviceptr p = 0;
    check(api_.cuMemAddressReserve(&p, bytes, alignment, 0, 0), "device.reserve", fmt::format("{} bytes={}", id(), bytes));
    return static_cast<std::uintptr_t>(p);
  }
  void do_release(std::uintptr_t base, std::uint64_t bytes) noexcept override {
    context_scope cs(api_, ctx_);
    if (CUresult r = api_.cuMemAddressFree(base, bytes); r != CUDA_SUCCESS)
      log::error("cuda", "{}: cuMemAddressFree failed: {}", id(), describe(r));
  }
  void do_map(std::uintptr_t va, std::uint64_t bytes, std::uint64_t handle, location) override {
    auto cs = make_current();
    check(api_.cuMemMap(va, bytes, 0, handle, 0), "device.map", fmt::format("{} va={}", id(), describe_range(va, bytes)));
  }
  void do_unmap(std::uintptr_t va, std::uint64_t bytes) noexcept override {
    context_scope cs(api_, ctx_);
    if (CUresult r = api_.cuMemUnmap(va, bytes); r != CUDA_SUCCESS)
      log::error("cuda", "{}: cuMemUnmap({}) failed: {}", id(), describe_range(va, bytes), describe(r));
  }
  bool do_unmap_run(std::uintptr_t va, std::uint64_t bytes) noexcept override {
    if (!unmap_runs_) return false;
    context_scope cs(api_, ctx_);
    if (CUresult r = api_.cuMemUnmap(va, bytes); r != CUDA_SUCCESS) {
      // Not every driver takes a range of several allocations: one at a time from now on.
      log::warn("cuda", "{}: cuMemUnmap of a run of mappings ({}) failed: {}; unmapping one chunk per call", id(),
                describe_range(va, bytes), describe(r));
      unmap_runs_ = false;
      return false;
    }
    return true;
  }
  void do_set_access(std::uintptr_t va, std::uint64_t bytes, const mapping& m,
                     std::span<const access_desc> grants) override {
    auto cs = make_current();
    std::vector<CUmemAccessDesc> d;
    for (auto& g : grants) {
      CUmemAccessDesc a{};
      a.flags = to_cu(g.flags);
      if (g.who.kind == memory_kind::device) {
        a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        a.location.id = g.who.id >= 0 ? g.who.id : info_.ordinal;
      } else {
        std::lock_guard l(numa_mu_);
        a.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
        a.location.id = host_numa_.count(m.chunk) ? host_numa_[m.chunk] : 0;
      }
      d.push_back(a);
    }
    check(api_.cuMemSetAccess(va, bytes, d.data(), d.size()), "device.set_access",
          fmt::format("{} va={}", id(), describe_range(va, bytes)));
  }
  std::unique_ptr<stream> do_create_stream() override;
  std::unique_ptr<stream> do_wrap_stream(native_stream n) override;
  bool do_watch_launches(std::string& why) override { return cupti::watch(cupti_library_, ctx_, *this, why); }
  // Work captured into a graph does not run now (the graph's launch is reported when it comes),
  // and a capturing stream must not be touched: the observers are not told.
  bool reported(CUstream s, bool known) noexcept override { return watched() && !(known && capturing(s)); }
  void on_launch(bool enter, CUstream s, bool known, bool ok) noexcept override {
    auto& mine = t_entered_[this];
    if (enter) {
      ++mine;
      entered_++;
      launching();
      return;
    }
    if (ok && known) mark_launched(s);
    if (mine > 0) {  // (an exit whose entry came before the watch began has none)
      --mine;
      entered_--;
    }
    launched();
  }
  // Reported calls between their entry and their exit, on any thread: their work is on a stream
  // already but its event comes only at the exit, so until then it is not known to be done.
  std::atomic<int> entered_{0};
  static inline thread_local std::map<const cuda_device*, int> t_entered_;  // this thread's share (kept at 0)
  // No reported call of another thread is between its entry and its exit (the caller's own, a launch
  // asking from inside its report, does not count).
  bool others_entered() const noexcept {
    auto it = t_entered_.find(this);
    return entered_.load() > (it == t_entered_.end() ? 0 : it->second);
  }
  // After a reported call's work: an event per stream, recorded again by each call (in the caller's
  // context, which is this device's: the callback matched it). The per-thread default stream is one
  // handle for every thread's own stream: it is told apart by the thread.
  struct launched_on {
    CUstream stream;
    std::thread::id thread;  // for CU_STREAM_PER_THREAD only
    CUevent event;
  };
  void mark_launched(CUstream s) noexcept {
    context_scope cs(api_, ctx_);  // the capture mode relaxed for these calls too
    std::thread::id t = s == CU_STREAM_PER_THREAD ? std::this_thread::get_id() : std::thread::id{};
    std::lock_guard l(launched_mu_);
    if (launched_.size() >= 64) prune_launched();  // streams made and destroyed: finished ones go
    auto it = std::find_if(launched_.begin(), launched_.end(), [&](auto& e) { return e.stream == s && e.thread == t; });
    CUevent ev = nullptr;
    if (it != launched_.end()) {
      ev = it->event;
    } else if (!spare_events_.empty()) {
      ev = spare_events_.back();
      spare_events_.pop_back();
      launched_.push_back({s, t, ev});
    } else if (CUresult r = api_.cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING); r == CUDA_SUCCESS) {
      launched_.push_back({s, t, ev});
    } else {
      log::warn("cuda", "{}: an event to follow a launch could not be made: {}", id(), describe(r));
      return;
    }
    if (CUresult r = api_.cuEventRecord(ev, s); r != CUDA_SUCCESS)
      log::debug("cuda", "{}: an event after a launch on stream {} could not be recorded: {}", id(),
                 static_cast<const void*>(s), describe(r));
  }
  // Drops the entries whose work finished (their events go back to the spares); true when none is
  // left running. Caller holds launched_mu_ with the context current.
  bool prune_launched() noexcept {
    bool done = true;
    for (std::size_t i = 0; i < launched_.size();) {
      // Any answer but "not ready" means finished: an error is the stream's, for its owner to see.
      if (api_.cuEventQuery(launched_[i].event) == CUDA_ERROR_NOT_READY) {
        done = false;
        ++i;
        continue;
      }
      spare_events_.push_back(launched_[i].event);
      launched_[i] = launched_.back();
      launched_.pop_back();
    }
    return done;
  }
  bool do_launched_work_done() noexcept override {
    if (others_entered()) return false;
    context_scope cs(api_, ctx_);
    std::lock_guard l(launched_mu_);
    return prune_launched();
  }

 public:
  // The work last reported on every thread's per-thread default stream has finished. A view of
  // CU_STREAM_PER_THREAD names the calling thread's own stream, and a space asks its attached streams
  // from its fault service's thread: this is what that view can know of the program's threads' work.
  bool per_thread_work_done() noexcept {
    if (others_entered()) return false;  // (which stream is not known until the exit)
    context_scope cs(api_, ctx_);
    std::lock_guard l(launched_mu_);
    if (prune_launched()) return true;  // what is left still runs
    return std::none_of(launched_.begin(), launched_.end(), [](const launched_on& e) { return e.stream == CU_STREAM_PER_THREAD; });
  }

 private:
  void do_enable_peer_access(device& peer) override {
    auto* p = dynamic_cast<cuda_device*>(&peer);
    std::lock_guard l(numa_mu_);
    if (peers_enabled_.count(p)) return;
    int can = 0;
    check(api_.cuDeviceCanAccessPeer(&can, dev_, p->dev_), "device.enable_peer_access", id() + " -> " + peer.id());
    if (!can)
      fail(errc::not_supported, "device.enable_peer_access", id() + " -> " + peer.id(), "the GPUs have no peer access");
    auto cs = make_current();
    CUresult r = api_.cuCtxEnablePeerAccess(p->ctx_, 0);
    if (r != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED) check(r, "device.enable_peer_access", id() + " -> " + peer.id());
    peers_enabled_.insert(p);
  }

  std::set<cuda_device*> peers_enabled_;
  std::mutex launched_mu_;
  std::vector<launched_on> launched_;  // streams with reported work, an event after it
  std::vector<CUevent> spare_events_;
  const driver_api& api_;
  std::string cupti_library_;
  CUdevice dev_ = 0;
  CUcontext ctx_ = nullptr;
  int sm_count_ = [this] {
    int v = 0;
    api_.cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, info_.ordinal);
    return v > 0 ? v : 16;
  }();
  std::once_flag module_once_;
  CUmodule module_ = nullptr;
  CUfunction fill_ = nullptr, checksum_ = nullptr, copy_ = nullptr;
  std::mutex numa_mu_;
  std::map<std::uint64_t, int> host_numa_;
  std::atomic<bool> unmap_runs_{true};
  std::atomic<std::uint64_t> streams_{0};
};

class cuda_stream final : public stream {
 public:
  explicit cuda_stream(cuda_device& d)
      : stream(d), dev_(d), api_(d.api()), name_(fmt::format("{} stream#{}", d.id(), d.next_stream_serial())) {
    auto cs = d.make_current();
    check(api_.cuStreamCreate(&s_, CU_STREAM_NON_BLOCKING), "stream.create", name_);
  }
  // A view of a stream ferry did not make: checked to be this device's, in its primary context.
  cuda_stream(cuda_device& d, native_stream n)
      : stream(d, true), dev_(d), api_(d.api()), name_(view_name(d, n)), s_(reinterpret_cast<CUstream>(n.handle)) {
    if (n.handle <= native_stream::per_thread().handle) return;  // the default streams: of whichever context is current
    auto cs = d.make_current();
    CUcontext c = nullptr;
    CUgreenCtx green = nullptr;
    check(api_.cuStreamGetCtx(s_, &c, &green), "stream.wrap", name_);
    if (c != d.context()) {
      CUdevice other = -1;
      std::string whose = api_.cuStreamGetDevice(s_, &other) == CUDA_SUCCESS && other != d.cu_device()
                              ? fmt::format("it belongs to cuda:{}", other)
                              : "it belongs to another context than the device's primary one (the runtime API's)";
      fail(errc::invalid_argument, "stream.wrap", name_, whose);
    }
  }
  ~cuda_stream() override {
    if (is_view()) return;  // the user's stream: theirs to synchronize and destroy (perhaps already)
    try {
      do_synchronize(deadline_after(dev_.default_timeout()));
    } catch (const error& e) {
      log::warn("cuda", "{} destroyed with failed or unfinished work: {}", name_, e.what());
    }
    context_scope cs(api_, dev_.context());
    if (scratch_) api_.cuMemFree(scratch_);
    if (sync_word_) api_.cuMemFreeHost(sync_word_);
    api_.cuStreamDestroy(s_);
  }

 private:
  static std::string view_name(cuda_device& d, native_stream n) {
    if (n.handle == 0 || n == native_stream::legacy()) return d.id() + " legacy default stream";
    if (n == native_stream::per_thread()) return d.id() + " per-thread default stream";
    return fmt::format("{} user stream {:#x}", d.id(), n.handle);
  }
  native_stream do_native_handle() const noexcept override { return {reinterpret_cast<std::uintptr_t>(s_)}; }
  void do_write_value(std::uint32_t* addr, std::uint32_t value) override {
    auto cs = dev_.make_current();
    // The default flags: a fence first, so whoever sees the value sees the writes before it.
    if (CUresult r = api_.cuStreamWriteValue32(s_, reinterpret_cast<CUdeviceptr>(addr), value, CU_STREAM_WRITE_VALUE_DEFAULT);
        r != CUDA_SUCCESS)
      check(r, "stream.write_value", fmt::format("{} at {}", name_, describe_range(addr, 4)));
  }
  void do_wait_value(const std::uint32_t* addr, std::uint32_t value) override {
    auto cs = dev_.make_current();
    if (CUresult r = api_.cuStreamWaitValue32(s_, reinterpret_cast<CUdeviceptr>(addr), value, CU_STREAM_WAIT_VALUE_GEQ);
        r != CUDA_SUCCESS)
      check(r, "stream.wait_value", fmt::format("{} at {}", name_, describe_range(addr, 4)));
  }

  void do_copy(void* dst, const void* src, std::size_t bytes) override {
    dev_.check_access(dst, bytes, true, dev_.info().ordinal, "stream.copy", "dst");
    dev_.check_access(src, bytes, false, dev_.info().ordinal, "stream.copy", "src");
    auto cs = dev_.make_current();
    fault_note::scope note("cuMemcpyAsync", dst, src, bytes);
    // The resource text only on failure: formatting it costs more than enqueueing a small copy.
    if (CUresult r = api_.cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(dst), reinterpret_cast<CUdeviceptr>(src), bytes, s_);
        r != CUDA_SUCCESS)
      check(r, "stream.copy", fmt::format("{} dst={} src={}", name_, describe_range(dst, bytes), describe_range(src, bytes)));
  }
  void do_copy_batch(std::span<const copy_desc> copies) override {
    if (!api_.cuMemcpyBatchAsync || copies.size() == 1) {  // a driver before 12.8, or nothing to batch
      for (auto& c : copies) do_copy(c.dst, c.src, c.bytes);
      return;
    }
    std::vector<CUdeviceptr> dsts(copies.size()), srcs(copies.size());
    std::vector<size_t> sizes(copies.size());
    for (std::size_t i = 0; i < copies.size(); ++i) {
      auto& c = copies[i];
      dev_.check_access(c.dst, c.bytes, true, dev_.info().ordinal, "stream.copy_batch", "dst");
      dev_.check_access(c.src, c.bytes, false, dev_.info().ordinal, "stream.copy_batch", "src");
      dsts[i] = reinterpret_cast<CUdeviceptr>(c.dst);
      srcs[i] = reinterpret_cast<CUdeviceptr>(c.src);
      sizes[i] = c.bytes;
    }
    CUmemcpyAttributes attr{};
    attr.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;  // as cuMemcpyAsync: after the stream's earlier work
    size_t first = 0;
    auto cs = dev_.make_current();
    fault_note::scope note("cuMemcpyBatchAsync (the first copy)", copies[0].dst, copies[0].src, copies[0].bytes);
    if (CUresult r = api_.cuMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), copies.size(), &attr, &first, 1, s_);
        r != CUDA_SUCCESS)
      check(r, "stream.copy_batch", fmt::format("{} {} copies, the first dst={} src={}", name_, copies.size(),
                                                describe_range(copies[0].dst, copies[0].bytes),
                                                describe_range(copies[0].src, copies[0].bytes)));
  }
  void do_copy_sm(void* dst, const void* src, std::size_t bytes) override {
    dev_.check_access(dst, bytes, true, dev_.info().ordinal, "stream.copy", "dst");
    dev_.check_access(src, bytes, false, dev_.info().ordinal, "stream.copy", "src");
    auto cs = dev_.make_current();
    unsigned long long b = bytes;
    void* args[] = {&dst, const_cast<void**>(&src), &b};
    launch("ferry_copy", args, bytes, 16);
  }
  // Enough 256-thread blocks for one `per_thread`-byte unit per thread, at most 8 per SM.
  void launch(const char* kernel, void** args, std::size_t bytes, std::size_t per_thread = 8) {
    unsigned blocks = static_cast<unsigned>(std::min<std::size_t>(dev_.launch_blocks(), (bytes / per_thread + 255) / 256 + 1));
    check(api_.cuLaunchKernel(dev_.kernel(kernel), blocks, 1, 1, 256, 1, 1, 0, s_, args, nullptr), "stream.launch",
          fmt::format("{} {}", name_, kernel));
  }
  void do_fill_pattern(void* dst, std::size_t bytes, std::uint64_t seed) override {
    dev_.check_access(dst, bytes, true, dev_.info().ordinal, "stream.fill_pattern", "dst");
    auto cs = dev_.make_current();
    unsigned long long b = bytes, sd = seed;
    void* args[] = {&dst, &b, &sd};
    launch("ferry_fill_pattern", args, bytes);
  }
  void do_checksum(const void* src, std::size_t bytes, std::uint64_t* result) override {
    dev_.check_access(src, bytes, false, dev_.info().ordinal, "stream.checksum", "src");
    auto cs = dev_.make_current();
    if (!scratch_) check(api_.cuMemAlloc(&scratch_, 8), "stream.checksum", name_ + " scratch");
    check(api_.cuMemsetD8Async(scratch_, 0, 8, s_), "stream.checksum", name_);
    unsigned long long b = bytes;
    void* args[] = {const_cast<void**>(&src), &b, &scratch_};
    launch("ferry_checksum", args, bytes);
    check(api_.cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(result), scratch_, 8, s_), "stream.checksum", name_);
  }
  std::unique_ptr<event> do_record() override {
    auto cs = dev_.make_current();
    CUevent e = nullptr;
    check(api_.cuEventCreate(&e, CU_EVENT_DISABLE_TIMING), "stream.record", name_);
    if (CUresult r = api_.cuEventRecord(e, s_); r != CUDA_SUCCESS) {
      api_.cuEventDestroy(e);
      check(r, "stream.record", name_);
    }
    return std::make_unique<cuda_event>(api_, dev_.context(), e, name_ + " event");
  }
  void do_wait(event& e) override {
    auto* ce = dynamic_cast<cuda_event*>(&e);
    if (!ce) fail(errc::invalid_argument, "stream.wait", name_, "event belongs to another backend");
    auto cs = dev_.make_current();
    check(api_.cuStreamWaitEvent(s_, ce->handle(), 0), "stream.wait", name_);
  }
  bool do_capturing() override {
    auto cs = dev_.make_current();
    return dev_.capturing(s_);
  }
  bool do_idle() override {
    auto cs = dev_.make_current();
    CUresult r = api_.cuStreamQuery(s_);
    if (r == CUDA_ERROR_NOT_READY) return false;
    check(r, "stream.query", name_);
    // The query saw the calling thread's own per-thread stream only (a fault is served on the space's
    // thread): the other threads' reported work on theirs counts too.
    if (is_view() && s_ == CU_STREAM_PER_THREAD) return dev_.per_thread_work_done();
    return true;
  }
  // The stream writes a sequence number into a pinned word of its own after the work enqueued so
  // far, and this thread watches the word: a load per look, where cuStreamQuery is a driver call
  // whose cost, per look, delays noticing the end of a small copy by microseconds. A failed stream
  // never writes the word: cuStreamQuery, now and then, reports its error. A view polls
  // cuStreamQuery only: the word would outlive the view until the user's stream wrote it, and the
  // view cannot know when that is (the user may destroy the stream before the view).
  void do_synchronize(deadline until) override {
    if (is_view()) {
      if (!detail::poll_until(until, [&] { return do_idle(); }))
        fail(errc::timeout, "stream.synchronize", name_, "deadline expired before the stream's work completed");
      return;
    }
    auto cs = dev_.make_current();
    if (!sync_word_) {
      void* p = nullptr;
      check(api_.cuMemHostAlloc(&p, 64, CU_MEMHOSTALLOC_PORTABLE), "stream.synchronize", name_ + " completion word");
      sync_word_ = static_cast<std::uint32_t*>(p);
      *sync_word_ = 0;
    }
    std::uint32_t seq = ++sync_seq_;
    check(api_.cuStreamWriteValue32(s_, reinterpret_cast<CUdeviceptr>(sync_word_), seq, CU_STREAM_WRITE_VALUE_DEFAULT),
          "stream.synchronize", name_);
    auto reached = [&] {
      return static_cast<std::int32_t>(std::atomic_ref<std::uint32_t>(*sync_word_).load(std::memory_order_acquire) - seq) >= 0;
    };
    // Looks at the word in a tight loop; a driver call (cuStreamQuery, for the stream's error) and
    // giving up the CPU only now and then, by time: each takes the driver's locks or a system call,
    // and calling them every few hundred looks cost a small copy more than the look itself saves.
    // Yields for 2 ms before it naps: a nap can overshoot by tens of microseconds, longer than a
    // copy of a megabyte takes (docs/design/transfer-engine.md, "Waiting for a copy").
    using namespace std::chrono_literals;
    auto queried = std::chrono::steady_clock::now();
    ferry::detail::backoff wait({.spin = 100us, .yield = 2ms, .nap = 20us, .most = 20us});
    for (unsigned i = 1;; ++i) {
      if (reached()) return;
      ferry::detail::cpu_relax();
      if (i % 64 == 0) {
        auto now = std::chrono::steady_clock::now();
        if (now - queried >= 20us) {
          queried = now;
          if (do_idle() || reached()) return;  // throws the stream's error, if it failed
        }
        if (now >= until) fail(errc::timeout, "stream.synchronize", name_, "deadline expired before the stream's work completed");
        wait.pause();
      }
    }
  }

  cuda_device& dev_;
  const driver_api& api_;
  std::string name_;
  CUstream s_ = nullptr;
  CUdeviceptr scratch_ = 0;
  std::uint32_t* sync_word_ = nullptr;  // pinned; written by the stream at each synchronize
  std::atomic<std::uint32_t> sync_seq_{0};
};

std::unique_ptr<stream> cuda_device::do_create_stream() { return std::make_unique<cuda_stream>(*this); }
std::unique_ptr<stream> cuda_device::do_wrap_stream(native_stream n) { return std::make_unique<cuda_stream>(*this, n); }

}  // namespace

backend_probe probe(const device_settings& s) {
  const driver_status& st = load(s.cuda_driver);
  backend_probe p;
  p.available = st.api != nullptr && st.device_count > 0;
  p.driver_version = st.version;
  p.device_count = st.device_count;
  p.reason = st.api ? (st.device_count ? "" : "driver loaded but no CUDA device is visible") : st.reason;
  return p;
}

std::unique_ptr<device> create_device(int ordinal, const device_settings& s) {
  return std::make_unique<cuda_device>(ordinal, s);
}

host_link_info query_host_link(const device_settings& s, const std::string& pci_bus_id) {
  host_link_info l = nvml::query(s.nvml_library, pci_bus_id);
  if (!l.error.empty()) log::debug("cuda", "{}: NVML: {}", pci_bus_id, l.error);
  return l;
}

peer_link query_peer(const device_settings& s, int a, int b) {
  const driver_api& api = api_or_throw(s, "cuda.peer");
  peer_link l;
  CUdevice da = 0, db = 0;
  std::string res = fmt::format("cuda:{}<->cuda:{}", a, b);
  check(api.cuDeviceGet(&da, a), "cuda.peer", res);
  check(api.cuDeviceGet(&db, b), "cuda.peer", res);
  int can = 0;
  check(api.cuDeviceCanAccessPeer(&can, da, db), "cuda.peer", res);
  l.access = can != 0;
  int v = 0;
  if (api.cuDeviceGetP2PAttribute(&v, CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK, da, db) == CUDA_SUCCESS)
    l.performance_rank = v;
  if (api.cuDeviceGetP2PAttribute(&v, CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED, da, db) == CUDA_SUCCESS)
    l.native_atomics = v != 0;
  char ba[32] = {}, bb[32] = {};
  api.cuDeviceGetPCIBusId(ba, sizeof ba, da);
  api.cuDeviceGetPCIBusId(bb, sizeof bb, db);
  nvml::p2p_facts f = nvml::query_p2p(s.nvml_library, ba, bb);
  if (!l.access) l.link = "-";
  else if (f.known) l.link = f.nvlink ? "nvlink" : "pcie";
  else l.link = "unknown";
  return l;
}

}  // namespace ferry::cuda
