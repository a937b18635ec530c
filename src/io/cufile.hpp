#pragma once
// GPUDirect Storage through cuFile, loaded at run time (no link dependency). Used for file <-> CUDA
// device memory when the library loads, the driver opens, the file's handle registers and the first
// read works; otherwise the file engine uses io_uring and says why.
#include <ferry/device/device.hpp>
#include <ferry/io/file.hpp>
#include <ferry/io/settings.hpp>

#include <functional>
#include <map>
#include <mutex>
#include <string>

namespace ferry::cufile {

// The stable C ABI of the cuFile entry points ferry uses (cufile.h is not installed with the
// toolkit here): shared by the backend and the probe.
struct cu_error {
  int err;     // CUfileOpError (0 = success)
  int cu_err;  // CUresult
};
struct cu_descr {
  int type;  // CU_FILE_HANDLE_TYPE_OPAQUE_FD = 1
  union {
    int fd;
    void* handle;
  } handle;
  const void* fs_ops;
};

// Whether the nvidia-fs kernel driver is loaded. Without it cuFile runs in compatibility mode (its
// own POSIX reads through bounce buffers), which is no faster than the io_uring path, while opening
// its driver costs the first read most of a second: FERRY_FILE_BACKEND=auto does not try it then.
bool nvidia_fs_loaded();

class backend {
 public:
  // `cuda_driver`: the CUDA driver library the device layer loads (FERRY_CUDA_DRIVER).
  backend(const io_settings& s, const std::string& cuda_driver);
  ~backend();
  // Registers f's handle on first use; false (with why) when cuFile cannot serve this file. A file
  // system on which registration failed once is not tried again (the verdict is kept per st_dev).
  bool usable(file& f, std::string& why);
  // Reads [off, off+n) into device memory `dst` of CUDA device `ordinal` in pieces of `chunk`,
  // calling progress(bytes) after each; returns the bytes read (short at EOF). Throws on errors.
  std::uint64_t read(file& f, int ordinal, void* dst, std::uint64_t off, std::uint64_t n, std::uint64_t chunk,
                     deadline until, const std::function<void(std::uint64_t)>& progress);
  void write(file& f, int ordinal, const void* src, std::uint64_t off, std::uint64_t n, std::uint64_t chunk,
             deadline until, const std::function<void(std::uint64_t)>& progress);
  // Forget f (its handle is deregistered).
  void forget(file& f);
  // Stop using cuFile for f (a probe read failed); usable() then reports why.
  void refuse(file& f, const std::string& why);

 private:
  std::uint64_t transfer(file& f, int ordinal, bool write, void* mem, std::uint64_t off, std::uint64_t n,
                         std::uint64_t chunk, deadline until, const std::function<void(std::uint64_t)>& progress);
  struct api;
  api* api_ = nullptr;
  std::string why_;  // why the library/driver is unusable, empty if usable
  std::mutex mu_;
  std::map<std::uint64_t, void*> handles_;  // by file::id(): a later file may get a dead one's address
  std::map<std::uint64_t, std::string> refused_;
  std::map<unsigned long, std::string> refused_fs_;  // st_dev -> why handle registration failed there
  std::string lib_, driver_;
};

}  // namespace ferry::cufile
