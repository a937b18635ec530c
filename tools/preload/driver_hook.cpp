// The way into an unmodified program's CUDA driver calls. The CUDA runtime, linked statically (nvcc's
// default) or as a shared library, loads libcuda.so.1 with dlopen and finds cuGetProcAddress with
// dlsym; every other entry point it gets from cuGetProcAddress. So this library defines dlsym: a
// lookup of cuGetProcAddress(_v2) by anyone but ferry gets a getter that asks the driver and hands
// out managed.cpp's wrapper where ferry serves the entry point (the driver's own function stays
// with the wrapper for everything that is not ferry's). Every other lookup goes on to the C
// library's dlsym as if nothing stood between: the definition is a few instructions that jump there
// with the caller's own return address, which dlsym needs for RTLD_NEXT.
//
// Not switched: a program that links libcuda.so directly and calls cuMemAllocManaged by name, and
// code that gets the driver's getter some other way than dlsym (dlvsym, a hard-coded table). Only
// x86-64 has the dlsym definition; elsewhere nothing is switched.
#include "preload.hpp"

#include <ferry/core/log.hpp>

#include <cuda.h>
#include <dlfcn.h>

#include <atomic>
#include <cstring>

namespace ferry::preload {
namespace {

using get_proc_v1 = CUresult (*)(const char*, void**, int, cuuint64_t);
using get_proc_v2 = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
std::atomic<get_proc_v1> driver_v1{nullptr};
std::atomic<get_proc_v2> driver_v2{nullptr};

CUresult hooked_v2(const char* symbol, void** pfn, int version, cuuint64_t flags, CUdriverProcAddressQueryResult* found);
CUresult hooked_v1(const char* symbol, void** pfn, int version, cuuint64_t flags);

// The hooked getter of one ABI in place of the driver's `fn` (kept, the first one seen).
void* getter_instead_of(void* fn, bool v2) {
  if (v2) {
    get_proc_v2 none = nullptr;
    driver_v2.compare_exchange_strong(none, reinterpret_cast<get_proc_v2>(fn));
    return reinterpret_cast<void*>(&hooked_v2);
  }
  get_proc_v1 none = nullptr;
  driver_v1.compare_exchange_strong(none, reinterpret_cast<get_proc_v1>(fn));
  return reinterpret_cast<void*>(&hooked_v1);
}

// What a lookup through the driver's getter gives the program: the getter itself (the runtime may
// ask the getter for it) or ferry's wrapper.
void* handed_out(const char* symbol, void* fn, int version, cuuint64_t flags) {
  if (std::strcmp(symbol, "cuGetProcAddress") == 0) return getter_instead_of(fn, version >= 12000);
  return managed_entry(symbol, fn, version, flags);
}

CUresult hooked_v2(const char* symbol, void** pfn, int version, cuuint64_t flags, CUdriverProcAddressQueryResult* found) {
  const CUresult r = driver_v2.load()(symbol, pfn, version, flags, found);
  if (r == CUDA_SUCCESS && symbol && pfn && *pfn) *pfn = handed_out(symbol, *pfn, version, flags);
  return r;
}

CUresult hooked_v1(const char* symbol, void** pfn, int version, cuuint64_t flags) {
  const CUresult r = driver_v1.load()(symbol, pfn, version, flags);
  if (r == CUDA_SUCCESS && symbol && pfn && *pfn) *pfn = handed_out(symbol, *pfn, version, flags);
  return r;
}

// The bases of this library and of libferry: lookups from there are ferry's own (its driver table
// must be the driver's).
bool from_ferry(void* caller) {
  static void* const own = [] {
    Dl_info i{};
    return ::dladdr(reinterpret_cast<void*>(&from_ferry), &i) ? i.dli_fbase : nullptr;
  }();
  static void* const library = [] {
    Dl_info i{};
    return ::dladdr(reinterpret_cast<void*>(&ferry::log_message), &i) ? i.dli_fbase : nullptr;
  }();
  Dl_info i{};
  if (!::dladdr(caller, &i)) return false;
  return i.dli_fbase == own || i.dli_fbase == library;
}

}  // namespace

void* driver_entry(const char* symbol, int version) {
  void* fn = nullptr;
  if (auto v2 = driver_v2.load()) {
    if (v2(symbol, &fn, version, CU_GET_PROC_ADDRESS_DEFAULT, nullptr) == CUDA_SUCCESS) return fn;
  } else if (auto v1 = driver_v1.load()) {
    if (v1(symbol, &fn, version, CU_GET_PROC_ADDRESS_DEFAULT) == CUDA_SUCCESS) return fn;
  }
  return nullptr;
}

}  // namespace ferry::preload

extern "C" {

// The C library's dlsym, found before main (or at the first lookup, if that comes earlier).
[[gnu::visibility("hidden")]] void* (*ferry_preload_libc_dlsym)(void*, const char*) = nullptr;

// Finds the C library's dlsym (before main, or at the first lookup if that comes first: from a
// constructor that runs before ours, or a sanitizer's runtime before it is ready -- hence no
// instrumentation here). dlvsym is the C library's own (this library does not define it): the
// version glibc 2.34+ gives new programs, else the old one.
[[gnu::visibility("hidden"), gnu::no_sanitize_address, gnu::constructor]] void ferry_preload_find_libc_dlsym() {
  void* f = ::dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
  if (!f) f = ::dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
  ferry_preload_libc_dlsym = reinterpret_cast<void* (*)(void*, const char*)>(f);
}

// Called by the dlsym below with the caller's return address: the getter to give instead of the
// driver's, or null to go on to the C library's dlsym.
[[gnu::visibility("hidden")]] void* ferry_preload_dlsym_pick(void* handle, const char* name, void* caller) {
  using namespace ferry::preload;
  if (!ferry_preload_libc_dlsym) ferry_preload_find_libc_dlsym();
  if (!name || std::strncmp(name, "cuGetProcAddress", 16) != 0 || from_ferry(caller)) return nullptr;
  const bool v2 = std::strcmp(name, "cuGetProcAddress_v2") == 0;
  if (!v2 && std::strcmp(name, "cuGetProcAddress") != 0) return nullptr;
  void* fn = ferry_preload_libc_dlsym(handle == RTLD_NEXT ? RTLD_DEFAULT : handle, name);
  return fn ? getter_instead_of(fn, v2) : nullptr;
}

}  // extern "C"

#if defined(__x86_64__)
// dlsym(handle, name): a name that does not begin "cuGetPro" goes straight to the C library's dlsym
// (a jump, not a call: it sees the caller's return address, which it needs for RTLD_NEXT), touching
// nothing else of this library but the finder above the first time. Otherwise pick(handle, name,
// return address): its answer when not null, else the same jump.
__asm__(R"(
  .text
  # calls a function with dlsym's arguments kept (the third instruction may set its third argument;
  # the stack stays 16-byte aligned: the return address and three registers)
  .macro ferry_preload_keeping_args call_what, third
  pushq %rdi
  .cfi_adjust_cfa_offset 8
  pushq %rsi
  .cfi_adjust_cfa_offset 8
  pushq %rdx
  .cfi_adjust_cfa_offset 8
  \third
  call \call_what
  popq %rdx
  .cfi_adjust_cfa_offset -8
  popq %rsi
  .cfi_adjust_cfa_offset -8
  popq %rdi
  .cfi_adjust_cfa_offset -8
  .endm
  .globl dlsym
  .type dlsym, @function
  .p2align 4
dlsym:
  .cfi_startproc
  endbr64
  testq %rsi, %rsi
  jz 1f
  leaq ferry_preload_prefix(%rip), %rax
  movq %rsi, %r11
3:
  movb (%rax), %cl
  testb %cl, %cl
  jz 4f
  cmpb %cl, (%r11)
  jne 1f
  incq %rax
  incq %r11
  jmp 3b
4:
  ferry_preload_keeping_args ferry_preload_dlsym_pick, "movq 24(%rsp), %rdx"
  testq %rax, %rax
  jz 1f
  ret
1:
  cmpq $0, ferry_preload_libc_dlsym(%rip)
  jne 2f
  ferry_preload_keeping_args ferry_preload_find_libc_dlsym, ""
2:
  jmp *ferry_preload_libc_dlsym(%rip)
  .cfi_endproc
  .size dlsym, .-dlsym
  .section .rodata
ferry_preload_prefix:
  .asciz "cuGetPro"
  .text
)");
#endif
