#pragma once
// cudaMallocManaged-style calls on ferry's unified memory, for programs written for CUDA managed
// memory (UVM). Such a program switches with one include and one allocation call:
//
//   #include <cuda_runtime.h>
//   #include <ferry/cuda_managed.hpp>             // added
//   ferry::managed::malloc_managed(&x, bytes);    // was cudaMallocManaged(&x, bytes)
//
// cudaMemPrefetchAsync, cudaMemAdvise, cudaStreamAttachMemAsync, cudaFree and cudaStreamDestroy
// keep their names: after this header they are macros for the functions below, which serve ferry's
// pointers and pass every other pointer on to CUDA unchanged. Define FERRY_MANAGED_NO_MACROS before
// including it to call ferry::managed::* by name instead.
//
// The memory is one process-wide address_space on the current CUDA device (the first call's), as
// large as that device's memory plus the host's, made on the first malloc_managed and kept until the
// process ends. Header-only: it uses the runtime API types and calls the CUDA runtime the program
// already links. Streams: migrations wait for the work queued on attached streams -- the legacy
// default stream always, and every stream given to cudaMemPrefetchAsync or
// cudaStreamAttachMemAsync (from then until cudaStreamDestroy). A kernel on a stream never named
// to these calls may run while its pages move (attach it with cudaStreamAttachMemAsync). What else
// differs from UVM: docs/design/unified-memory.md, "Programs written for UVM".
#include <ferry/core/error.hpp>
#include <ferry/runtime.hpp>
#include <ferry/vm/address_space.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace ferry::managed {

namespace detail {

struct heap {
  runtime rt;
  device& dev;
  vm::address_space space;
  std::mutex mu;
  std::vector<std::pair<cudaStream_t, std::unique_ptr<stream>>> attached;

  explicit heap(int ordinal)
      : rt(settings::from_env()), dev(rt.devices().get(device_kind::cuda, ordinal)), space(dev, vm::whole_memory_size(dev), vm::space_options::from(rt.config())) {
    attach(nullptr);  // the legacy default stream
  }
  bool owns(const void* p) const {
    auto a = reinterpret_cast<std::uintptr_t>(p), b = reinterpret_cast<std::uintptr_t>(space.base());
    return a >= b && a < b + space.size();
  }
  void attach(cudaStream_t s) {
    std::lock_guard l(mu);
    for (auto& [h, v] : attached)
      if (h == s) return;
    auto v = dev.wrap_stream(native_stream{s ? reinterpret_cast<std::uintptr_t>(s) : native_stream::legacy().handle});
    space.attach_stream(*v);
    attached.emplace_back(s, std::move(v));
  }
  void detach(cudaStream_t s) {
    std::lock_guard l(mu);
    for (auto it = attached.begin(); it != attached.end(); ++it)
      if (it->first == s) {
        space.detach_stream(*it->second);
        attached.erase(it);
        return;
      }
  }
};

// The process's heap; made by the first allocation, never destroyed (at exit CUDA may already be
// torn down, and the memory goes with the process).
inline heap*& heap_slot() {
  static heap* h = nullptr;
  return h;
}
inline std::mutex& heap_mu() {
  static std::mutex m;
  return m;
}
inline heap* existing() {
  std::lock_guard l(heap_mu());
  return heap_slot();
}
inline std::string& last_message() {
  thread_local std::string m;
  return m;
}

// A ferry error as the CUDA runtime's code; its message stays for last_error().
inline cudaError_t to_cuda(const std::exception& e) {
  last_message() = e.what();
  if (const auto* fe = dynamic_cast<const error*>(&e)) {
    switch (fe->code()) {
      case errc::out_of_memory: return cudaErrorMemoryAllocation;
      case errc::invalid_argument:
      case errc::bad_address:
      case errc::out_of_range: return cudaErrorInvalidValue;
      case errc::unavailable: return cudaErrorNoDevice;
      default: return cudaErrorUnknown;
    }
  }
  return cudaErrorUnknown;
}

inline ferry::location where(cudaMemLocation l) {
  if (l.type == cudaMemLocationTypeDevice) return ferry::location{memory_kind::device, l.id};
  return ferry::location::on_host();
}

}  // namespace detail

// What the last failed call of this thread said (ferry's message: what, where, why).
inline const std::string& last_error() { return detail::last_message(); }

// cudaMallocManaged. `flags` is cudaMemAttachGlobal or cudaMemAttachHost (both: every device of the
// space and the CPU may access the memory). Every byte is mapped and zero when this returns.
template <typename T>
cudaError_t malloc_managed(T** p, std::size_t bytes, unsigned flags = cudaMemAttachGlobal) {
  if (!p || bytes == 0 || (flags != cudaMemAttachGlobal && flags != cudaMemAttachHost)) return cudaErrorInvalidValue;
  try {
    detail::heap* h = nullptr;
    {
      std::lock_guard l(detail::heap_mu());
      if (!detail::heap_slot()) {
        int ordinal = 0;
        if (cudaError_t e = cudaGetDevice(&ordinal); e != cudaSuccess) return e;
        detail::heap_slot() = new detail::heap(ordinal);
      }
      h = detail::heap_slot();
    }
    *p = static_cast<T*>(h->space.alloc(bytes));
    return cudaSuccess;
  } catch (const std::exception& e) {
    return detail::to_cuda(e);
  }
}

// cudaFree: ferry's memory goes back to its space, any other pointer to CUDA.
inline cudaError_t free(void* p) {
  detail::heap* h = detail::existing();
  if (!h || !h->owns(p)) return cudaFree(p);
  try {
    h->space.free(p);
    return cudaSuccess;
  } catch (const std::exception& e) {
    return detail::to_cuda(e);
  }
}

// cudaMemPrefetchAsync: the stream is attached, so the pages move after the work queued on it and
// before the work queued after this call. The move itself happens before this returns (ferry
// migrates from the calling thread), not later on the stream.
inline cudaError_t mem_prefetch_async(const void* p, std::size_t bytes, cudaMemLocation location, unsigned flags,
                                      cudaStream_t s = nullptr) {
  detail::heap* h = detail::existing();
  if (!h || !h->owns(p)) return cudaMemPrefetchAsync(p, bytes, location, flags, s);
  try {
    h->attach(s);
    h->space.advise(const_cast<void*>(p), bytes, vm::advice::prefetch, detail::where(location));
    return cudaSuccess;
  } catch (const std::exception& e) {
    return detail::to_cuda(e);
  }
}

// cudaMemAdvise. SetAccessedBy / UnsetAccessedBy change nothing: every page of the space is mapped
// for every device of the space already.
inline cudaError_t mem_advise(const void* p, std::size_t bytes, cudaMemoryAdvise advice, cudaMemLocation location) {
  detail::heap* h = detail::existing();
  if (!h || !h->owns(p)) return cudaMemAdvise(p, bytes, advice, location);
  void* q = const_cast<void*>(p);
  try {
    switch (advice) {
      case cudaMemAdviseSetReadMostly: h->space.advise(q, bytes, vm::advice::read_mostly); break;
      case cudaMemAdviseUnsetReadMostly: h->space.advise(q, bytes, vm::advice::no_read_mostly); break;
      case cudaMemAdviseSetPreferredLocation:
        h->space.advise(q, bytes, vm::advice::preferred_location, detail::where(location));
        break;
      case cudaMemAdviseUnsetPreferredLocation: h->space.advise(q, bytes, vm::advice::no_preferred_location); break;
      case cudaMemAdviseSetAccessedBy:
      case cudaMemAdviseUnsetAccessedBy: break;
      default: return cudaErrorInvalidValue;
    }
    return cudaSuccess;
  } catch (const std::exception& e) {
    return detail::to_cuda(e);
  }
}

// cudaStreamAttachMemAsync: ferry's pointer makes the stream one whose work page moves wait for.
inline cudaError_t stream_attach_mem_async(cudaStream_t s, void* p, std::size_t length = 0,
                                           unsigned flags = cudaMemAttachSingle) {
  detail::heap* h = detail::existing();
  if (!h || !h->owns(p)) return cudaStreamAttachMemAsync(s, p, length, flags);
  try {
    h->attach(s);
    return cudaSuccess;
  } catch (const std::exception& e) {
    return detail::to_cuda(e);
  }
}

// cudaStreamDestroy: detached from the space first.
inline cudaError_t stream_destroy(cudaStream_t s) {
  if (detail::heap* h = detail::existing(); h && s) h->detach(s);
  return cudaStreamDestroy(s);
}

// The space behind malloc_managed (nullptr before the first allocation), for ferry's own APIs.
inline vm::address_space* space() {
  detail::heap* h = detail::existing();
  return h ? &h->space : nullptr;
}

}  // namespace ferry::managed

#ifndef FERRY_MANAGED_NO_MACROS
#undef cudaFree
#undef cudaMemPrefetchAsync
#undef cudaMemAdvise
#undef cudaStreamAttachMemAsync
#undef cudaStreamDestroy
#define cudaFree ferry::managed::free
#define cudaMemPrefetchAsync ferry::managed::mem_prefetch_async
#define cudaMemAdvise ferry::managed::mem_advise
#define cudaStreamAttachMemAsync ferry::managed::stream_attach_mem_async
#define cudaStreamDestroy ferry::managed::stream_destroy
#endif
