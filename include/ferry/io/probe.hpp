#pragma once
// Probes for the file layer: io_uring (liburing) and cuFile (GPUDirect Storage, loaded at run time).
#include <ferry/core/capability.hpp>
#include <ferry/core/export.hpp>
#include <ferry/io/settings.hpp>

#include <string>

namespace ferry {

// Can this process create an io_uring, and which of the opcodes ferry uses does the kernel support?
FERRY_API capability probe_io_uring();

// Is cuFile usable: library loadable, driver opens, and (when `path` is non-empty) does
// cuFileHandleRegister work for a file at `path` (a file, or a directory where a temporary file is
// created and removed)? `cuda_available` false skips the driver steps (cuFile needs CUDA).
FERRY_API capability probe_cufile(const io_settings& s, bool cuda_available, const std::string& path);

}  // namespace ferry
