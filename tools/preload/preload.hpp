#pragma once
// What the parts of libferry_preload.so share: the process's one runtime (preload.cpp), the managed
// memory it serves (managed.cpp) and the way in to the CUDA driver's entry points (driver_hook.cpp).
#include <ferry/runtime.hpp>

#include <cstdint>

namespace ferry::preload {

// The process's runtime, made on first use; null when it could not start (the reason is logged
// once), after exit began, or in a child forked from a process that had one.
runtime* get_runtime();

// At exit, before the runtime would end: prints the managed memory's report when FERRY_VM_REPORT
// asks for it. True when managed memory exists: then the runtime is left to the process's end
// (the program's pointers stay valid while its other threads and CUDA's exit handlers run).
bool managed_at_exit();

// The wrapper to hand out instead of the driver's entry point `real`, found under `symbol` (the
// plain name cuGetProcAddress is asked for) at ABI `version` with cuGetProcAddress `flags`; `real`
// itself for every entry point ferry does not serve (managed.cpp's table).
void* managed_entry(const char* symbol, void* real, int version, std::uint64_t flags);

// The driver's own entry point `symbol` at ABI `version`, through the driver's cuGetProcAddress as
// the program's CUDA found it (null before the program looked for it, or when the driver lacks it).
void* driver_entry(const char* symbol, int version);

}  // namespace ferry::preload
