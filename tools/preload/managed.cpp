// Managed memory of an unmodified CUDA program on ferry's unified memory: the driver entry points
// behind cudaMallocManaged and its companions, as the program's CUDA runtime (static or shared) gets
// them from cuGetProcAddress (driver_hook.cpp hands out these wrappers instead). Each wrapper serves
// ferry's pointers and passes every other call to the driver's own function unchanged.
//
// The memory is one address space on the device of the context current at the first allocation (or
// ferry's default device where ferry sees no CUDA device: sim in the CPU tests), as large as that
// device's memory and the host's, kept until the process ends. When ferry's runtime cannot start,
// every allocation stays CUDA's (said once in the log).
//
// Streams: migrations wait for the work queued on attached streams: the legacy default stream, and
// every stream the program names to a prefetch, a stream attach or a kernel launch (from then until
// it is destroyed). A kernel launched by a way not seen here (a graph, another library's own driver
// table) may run while its pages move.
#include "preload.hpp"

#include <ferry/core/error.hpp>
#include <ferry/core/log.hpp>
#include <ferry/device/registry.hpp>
#include <ferry/runtime.hpp>
#include <ferry/vm/address_space.hpp>
#include <ferry/vm/block_pool.hpp>

#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace ferry::preload {
namespace {

// A line in ferry's log at FERRY_LOG's level (the program's stderr is its own otherwise).
void say(log_level l, const std::string& what) {
  if (log_enabled(l)) log_message(l, "preload", what);
}

// The driver's own function for one ABI of a served entry point, stored when it was handed out.
struct slot {
  std::atomic<void*> real{nullptr};
};

template <typename Fn>
Fn real(slot& s) {
  return reinterpret_cast<Fn>(s.real.load(std::memory_order_acquire));
}

struct heap {
  device& dev;
  runtime& rt;
  bool report;
  vm::address_space space;
  // Allocations of up to a quarter of a page share pages, blocks of their power-of-two class: a page
  // (32 MiB by default) for each small allocation would make a program of many small ones hold a page
  // of device and host memory for each, and move a page for each. Freed whole-page allocations go back
  // to the space at once (keep 1 byte): only small blocks are reused, and zeroed when they are.
  vm::block_pool pool{space, 1};
  std::once_flag zeros_made;
  std::byte* zeros = nullptr;  // small_max() zero bytes, the source that zeroes a reused block
  std::mutex mu;
  std::vector<std::pair<std::uintptr_t, std::unique_ptr<stream>>> attached;
  std::vector<std::uintptr_t> foreign;  // streams that could not be attached (another device's)

  heap(device& d, runtime& r, const settings& s)
      : dev(d), rt(r), report(s.vm_report), space(d, vm::whole_memory_size(d), vm::space_options::from(s)) {
    // The report is printed at exit by managed_at_exit (the space is never destroyed).
    attach(native_stream::legacy().handle);
  }
  // A managed allocation, zeroed as UVM's memory reads before it is written (fresh pages are; a reused
  // block is zeroed by the transfer engine, which keeps its page in place meanwhile).
  void* alloc(std::uint64_t bytes) {
    bool reused = false;
    void* p = pool.alloc(bytes, 0, &reused);  // one stream: cuMemFree waits for the context's work
    if (!reused) return p;
    try {
      const std::uint64_t n = std::min(bytes, pool.small_max());
      std::call_once(zeros_made, [&] { zeros = static_cast<std::byte*>(std::calloc(pool.small_max(), 1)); });
      if (!zeros) fail(errc::out_of_memory, "preload.managed", "zeroing a reused block", "no host memory for its source");
      rt.engine().copy(p, zeros, n);
    } catch (...) {
      pool.free(p);
      throw;
    }
    return p;
  }
  bool owns(CUdeviceptr p) const {
    const auto b = reinterpret_cast<CUdeviceptr>(space.base());
    return p >= b && p < b + space.size();
  }
  // Throws when the stream is not one of the device's.
  void attach(std::uintptr_t h) {
    std::lock_guard l(mu);
    for (auto& [k, v] : attached)
      if (k == h) return;
    auto v = dev.wrap_stream(native_stream{h});
    space.attach_stream(*v);
    attached.emplace_back(h, std::move(v));
  }
  // For launches: a stream that cannot be attached is remembered and left alone.
  void attach_quietly(std::uintptr_t h) {
    {
      std::lock_guard l(mu);
      for (auto& a : attached)
        if (a.first == h) return;
      for (auto f : foreign)
        if (f == h) return;
    }
    try {
      attach(h);
    } catch (const std::exception& e) {
      say(log_level::debug, std::string("a launch's stream is not attached to managed memory: ") + e.what());
      std::lock_guard l(mu);
      foreign.push_back(h);
    }
  }
  void detach(std::uintptr_t h) {
    std::lock_guard l(mu);
    std::erase(foreign, h);
    for (auto it = attached.begin(); it != attached.end(); ++it)
      if (it->first == h) {
        space.detach_stream(*it->second);
        attached.erase(it);
        return;
      }
  }
};

std::mutex heap_mu;
std::atomic<heap*> the_heap{nullptr};
bool heap_refused = false;  // under heap_mu: ferry could not make it; allocations stay CUDA's

heap* existing() { return the_heap.load(std::memory_order_acquire); }

heap* heap_for_allocation() {
  if (heap* h = existing()) return h;
  std::lock_guard l(heap_mu);
  if (heap* h = existing()) return h;
  if (heap_refused) return nullptr;
  try {
    runtime* r = get_runtime();
    if (!r) throw error(errc::unavailable, "preload.managed", "runtime", "ferry's runtime did not start");
    device* d = nullptr;
    if (r->devices().cuda_status().available) {
      CUdevice ordinal = 0;
      auto get = reinterpret_cast<CUresult (*)(CUdevice*)>(driver_entry("cuCtxGetDevice", 2000));
      if (!get || get(&ordinal) != CUDA_SUCCESS) ordinal = 0;
      d = &r->devices().get(device_kind::cuda, ordinal);
    } else {
      d = &r->devices().default_device();
    }
    auto* h = new heap(*d, *r, r->config());
    the_heap.store(h, std::memory_order_release);
    say(log_level::info, "managed memory is ferry's unified memory on " + d->id());
    return h;
  } catch (const std::exception& e) {
    heap_refused = true;
    say(log_level::warn, std::string("managed memory stays CUDA's: ") + e.what());
    return nullptr;
  }
}

// A ferry error as the driver's result; the message (what, where, why) goes to the log, as a
// CUresult cannot carry it.
CUresult failed(const std::exception& e) {
  say(log_level::warn, e.what());
  if (const auto* fe = dynamic_cast<const error*>(&e)) {
    switch (fe->code()) {
      case errc::out_of_memory: return CUDA_ERROR_OUT_OF_MEMORY;
      case errc::invalid_argument:
      case errc::bad_address:
      case errc::out_of_range: return CUDA_ERROR_INVALID_VALUE;
      case errc::unavailable: return CUDA_ERROR_NO_DEVICE;
      default: return CUDA_ERROR_UNKNOWN;
    }
  }
  return CUDA_ERROR_UNKNOWN;
}

// A stream handle as the program meant it: the null stream is the legacy default stream, or the
// thread's own default stream for a program built with per-thread default streams.
template <bool PerThread>
std::uintptr_t stream_of(CUstream s) {
  if (s) return reinterpret_cast<std::uintptr_t>(s);
  return PerThread ? native_stream::per_thread().handle : native_stream::legacy().handle;
}

ferry::location where(CUmemLocation l) {
  if (l.type == CU_MEM_LOCATION_TYPE_DEVICE) return ferry::location{memory_kind::device, l.id};
  return ferry::location::on_host();  // host, a host NUMA node, the calling thread's node
}
ferry::location where(CUdevice d) {
  if (d == CU_DEVICE_CPU) return ferry::location::on_host();
  return ferry::location{memory_kind::device, d};
}

slot s_alloc, s_free, s_sync;

CUresult alloc_managed(CUdeviceptr* p, size_t bytes, unsigned flags) {
  heap* h = heap_for_allocation();
  if (!h) return real<PFN_cuMemAllocManaged_v6000>(s_alloc)(p, bytes, flags);
  if (!p || bytes == 0 || (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST)) return CUDA_ERROR_INVALID_VALUE;
  try {
    *p = reinterpret_cast<CUdeviceptr>(h->alloc(bytes));
    return CUDA_SUCCESS;
  } catch (const std::exception& e) {
    return failed(e);
  }
}

// Like cuMemFree of managed memory, the context's work ends first (a kernel may still use it).
CUresult mem_free(CUdeviceptr p) {
  heap* h = existing();
  if (!h || !h->owns(p)) return real<PFN_cuMemFree_v3020>(s_free)(p);
  if (auto sync = reinterpret_cast<CUresult (*)()>(driver_entry("cuCtxSynchronize", 2000)))
    if (CUresult r = sync(); r != CUDA_SUCCESS) return r;
  try {
    h->pool.free(reinterpret_cast<void*>(p));
    return CUDA_SUCCESS;
  } catch (const std::exception& e) {
    return failed(e);
  }
}

// Prefetch: the stream is attached, so the pages move after the work queued on it. When that work
// ends soon the move is made before the call returns (before the work queued after the call); else
// (a kernel that waits for the CPU to act after the call) the call returns and the space moves the
// pages once its streams are idle (FERRY_VM_PREFETCH_WAIT): kernels queued meanwhile reach them where
// they are.
template <bool PerThread>
CUresult prefetch_to(heap& h, CUdeviceptr p, size_t n, ferry::location to, CUstream s) {
  try {
    h.attach(stream_of<PerThread>(s));
    h.space.advise(reinterpret_cast<void*>(p), n, vm::advice::prefetch, to);
    return CUDA_SUCCESS;
  } catch (const std::exception& e) {
    return failed(e);
  }
}

template <slot& S, bool PerThread>
CUresult prefetch_v1(CUdeviceptr p, size_t n, CUdevice to, CUstream s) {
  heap* h = existing();
  if (!h || !h->owns(p)) return real<PFN_cuMemPrefetchAsync_v8000>(S)(p, n, to, s);
  return prefetch_to<PerThread>(*h, p, n, where(to), s);
}

template <slot& S, bool PerThread>
CUresult prefetch_v2(CUdeviceptr p, size_t n, CUmemLocation to, unsigned flags, CUstream s) {
  heap* h = existing();
  if (!h || !h->owns(p)) return real<PFN_cuMemPrefetchAsync_v12020>(S)(p, n, to, flags, s);
  return prefetch_to<PerThread>(*h, p, n, where(to), s);
}

// SET_ACCESSED_BY / UNSET_ACCESSED_BY change nothing: every page of the space is mapped for its
// devices already.
CUresult advise_on(heap& h, CUdeviceptr p, size_t n, CUmem_advise a, ferry::location at) {
  void* q = reinterpret_cast<void*>(p);
  try {
    switch (a) {
      case CU_MEM_ADVISE_SET_READ_MOSTLY: h.space.advise(q, n, vm::advice::read_mostly); break;
      case CU_MEM_ADVISE_UNSET_READ_MOSTLY: h.space.advise(q, n, vm::advice::no_read_mostly); break;
      case CU_MEM_ADVISE_SET_PREFERRED_LOCATION: h.space.advise(q, n, vm::advice::preferred_location, at); break;
      case CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION: h.space.advise(q, n, vm::advice::no_preferred_location); break;
      case CU_MEM_ADVISE_SET_ACCESSED_BY:
      case CU_MEM_ADVISE_UNSET_ACCESSED_BY: break;
      default: return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
  } catch (const std::exception& e) {
    return failed(e);
  }
}

slot s_advise_v1, s_advise_v2;

CUresult advise_v1(CUdeviceptr p, size_t n, CUmem_advise a, CUdevice d) {
  heap* h = existing();
  if (!h || !h->owns(p)) return real<PFN_cuMemAdvise_v8000>(s_advise_v1)(p, n, a, d);
  return advise_on(*h, p, n, a, where(d));
}

CUresult advise_v2(CUdeviceptr p, size_t n, CUmem_advise a, CUmemLocation l) {
  heap* h = existing();
  if (!h || !h->owns(p)) return real<PFN_cuMemAdvise_v12020>(s_advise_v2)(p, n, a, l);
  return advise_on(*h, p, n, a, where(l));
}

template <slot& S, bool PerThread>
CUresult attach_mem(CUstream s, CUdeviceptr p, size_t length, unsigned flags) {
  heap* h = existing();
  if (!h || !h->owns(p)) return real<PFN_cuStreamAttachMemAsync_v6000>(S)(s, p, length, flags);
  try {
    h->attach(stream_of<PerThread>(s));
    return CUDA_SUCCESS;
  } catch (const std::exception& e) {
    return failed(e);
  }
}

slot s_stream_destroy;

CUresult stream_destroy(CUstream s) {
  if (heap* h = existing(); h && s) h->detach(reinterpret_cast<std::uintptr_t>(s));
  return real<PFN_cuStreamDestroy_v4000>(s_stream_destroy)(s);
}

// Launches attach their stream, so that migrations wait for the kernel.
template <bool PerThread>
void launching_on(CUstream s) {
  if (heap* h = existing()) h->attach_quietly(stream_of<PerThread>(s));
}

template <slot& S, bool PerThread>
CUresult launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shared,
                CUstream s, void** params, void** extra) {
  launching_on<PerThread>(s);
  return real<PFN_cuLaunchKernel_v4000>(S)(f, gx, gy, gz, bx, by, bz, shared, s, params, extra);
}

template <slot& S, bool PerThread>
CUresult launch_ex(const CUlaunchConfig* c, CUfunction f, void** params, void** extra) {
  if (c) launching_on<PerThread>(c->hStream);
  return real<PFN_cuLaunchKernelEx_v11060>(S)(c, f, params, extra);
}

template <slot& S, bool PerThread>
CUresult launch_cooperative(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                            unsigned shared, CUstream s, void** params) {
  launching_on<PerThread>(s);
  return real<PFN_cuLaunchCooperativeKernel_v9000>(S)(f, gx, gy, gz, bx, by, bz, shared, s, params);
}

// A pointer attribute of ferry's managed memory, as UVM answers it, over what the driver said of
// the mapping (or in place of its error). False for an attribute that has no managed answer: the
// driver's stands.
bool managed_attribute(const heap& h, CUpointer_attribute a, void* data, CUdeviceptr p) {
  switch (a) {
    case CU_POINTER_ATTRIBUTE_IS_MANAGED:
    case CU_POINTER_ATTRIBUTE_MAPPED: *static_cast<bool*>(data) = true; return true;
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: *static_cast<bool*>(data) = false; return true;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: *static_cast<CUdeviceptr*>(data) = p; return true;
    case CU_POINTER_ATTRIBUTE_HOST_POINTER: *static_cast<void**>(data) = reinterpret_cast<void*>(p); return true;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE: *static_cast<unsigned*>(data) = CU_MEMORYTYPE_DEVICE; return true;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *static_cast<int*>(data) = h.dev.info().ordinal; return true;
    default: return false;
  }
}

slot s_attribute, s_attributes;

CUresult pointer_attribute(void* data, CUpointer_attribute a, CUdeviceptr p) {
  const CUresult r = real<PFN_cuPointerGetAttribute_v4000>(s_attribute)(data, a, p);
  heap* h = existing();
  if (!h || !h->owns(p) || !data) return r;
  if (a == CU_POINTER_ATTRIBUTE_MEMORY_TYPE && r == CUDA_SUCCESS) return r;  // where the page is now, as UVM
  return managed_attribute(*h, a, data, p) ? CUDA_SUCCESS : r;
}

CUresult pointer_attributes(unsigned n, CUpointer_attribute* as, void** data, CUdeviceptr p) {
  const CUresult r = real<PFN_cuPointerGetAttributes_v7000>(s_attributes)(n, as, data, p);
  heap* h = existing();
  if (!h || !h->owns(p) || !as || !data) return r;
  for (unsigned i = 0; i < n; ++i) {
    if (!data[i] || (as[i] == CU_POINTER_ATTRIBUTE_MEMORY_TYPE && r == CUDA_SUCCESS && *static_cast<unsigned*>(data[i]) != 0))
      continue;
    managed_attribute(*h, as[i], data[i], p);
  }
  return r == CUDA_SUCCESS || r == CUDA_ERROR_INVALID_VALUE ? CUDA_SUCCESS : r;
}

slot s_prefetch_v1, s_prefetch_v1_pt, s_prefetch_v2, s_prefetch_v2_pt, s_attach, s_attach_pt, s_launch, s_launch_pt,
    s_launch_ex, s_launch_ex_pt, s_launch_co, s_launch_co_pt;

// Which streams an entry point's ABI is for: the per-thread default stream (cuGetProcAddress's
// CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) or not, or either (no stream argument).
enum class flavour { legacy, per_thread, either };

struct served {
  const char* name;  // the plain name cuGetProcAddress is asked for
  int since;         // the ABI's version (cudaTypedefs.h's PFN_name_vNNNN)
  flavour streams;
  slot* real;
  void* wrapper;
};

template <typename Fn>
void* as_entry(Fn f) {
  return reinterpret_cast<void*>(f);
}

const served table[] = {
    {"cuMemAllocManaged", 6000, flavour::either, &s_alloc, as_entry(&alloc_managed)},
    {"cuMemFree", 3020, flavour::either, &s_free, as_entry(&mem_free)},
    {"cuMemPrefetchAsync", 8000, flavour::legacy, &s_prefetch_v1, as_entry(&prefetch_v1<s_prefetch_v1, false>)},
    {"cuMemPrefetchAsync", 8000, flavour::per_thread, &s_prefetch_v1_pt, as_entry(&prefetch_v1<s_prefetch_v1_pt, true>)},
    {"cuMemPrefetchAsync", 12020, flavour::legacy, &s_prefetch_v2, as_entry(&prefetch_v2<s_prefetch_v2, false>)},
    {"cuMemPrefetchAsync", 12020, flavour::per_thread, &s_prefetch_v2_pt, as_entry(&prefetch_v2<s_prefetch_v2_pt, true>)},
    {"cuMemAdvise", 8000, flavour::either, &s_advise_v1, as_entry(&advise_v1)},
    {"cuMemAdvise", 12020, flavour::either, &s_advise_v2, as_entry(&advise_v2)},
    {"cuStreamAttachMemAsync", 6000, flavour::legacy, &s_attach, as_entry(&attach_mem<s_attach, false>)},
    {"cuStreamAttachMemAsync", 6000, flavour::per_thread, &s_attach_pt, as_entry(&attach_mem<s_attach_pt, true>)},
    {"cuStreamDestroy", 4000, flavour::either, &s_stream_destroy, as_entry(&stream_destroy)},
    {"cuPointerGetAttribute", 4000, flavour::either, &s_attribute, as_entry(&pointer_attribute)},
    {"cuPointerGetAttributes", 7000, flavour::either, &s_attributes, as_entry(&pointer_attributes)},
    {"cuLaunchKernel", 4000, flavour::legacy, &s_launch, as_entry(&launch<s_launch, false>)},
    {"cuLaunchKernel", 4000, flavour::per_thread, &s_launch_pt, as_entry(&launch<s_launch_pt, true>)},
    {"cuLaunchKernelEx", 11060, flavour::legacy, &s_launch_ex, as_entry(&launch_ex<s_launch_ex, false>)},
    {"cuLaunchKernelEx", 11060, flavour::per_thread, &s_launch_ex_pt, as_entry(&launch_ex<s_launch_ex_pt, true>)},
    {"cuLaunchCooperativeKernel", 9000, flavour::legacy, &s_launch_co, as_entry(&launch_cooperative<s_launch_co, false>)},
    {"cuLaunchCooperativeKernel", 9000, flavour::per_thread, &s_launch_co_pt, as_entry(&launch_cooperative<s_launch_co_pt, true>)},
};

}  // namespace

void* managed_entry(const char* symbol, void* real_fn, int version, std::uint64_t flags) {
  if (!symbol || !real_fn || symbol[0] != 'c') return real_fn;
  const bool per_thread = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
  const served* best = nullptr;
  for (const auto& e : table) {
    if (e.since > version || std::strcmp(e.name, symbol) != 0) continue;
    if (e.streams != flavour::either && (e.streams == flavour::per_thread) != per_thread) continue;
    if (!best || e.since > best->since) best = &e;
  }
  if (!best) return real_fn;
  best->real->real.store(real_fn, std::memory_order_release);
  say(log_level::debug, std::string("serving ") + symbol + " (ABI " + std::to_string(best->since) + (per_thread ? ", per-thread stream" : "") + ")");
  return best->wrapper;
}

bool managed_at_exit() {
  heap* h = existing();
  if (!h) return false;
  if (h->report) {
    try {
      std::fputs(h->space.report().c_str(), stderr);
    } catch (const std::exception& e) {
      say(log_level::warn, std::string("no report of the managed memory: ") + e.what());
    }
  }
  return true;
}

}  // namespace ferry::preload
