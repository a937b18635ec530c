#include "io/cufile.hpp"

#include <ferry/core/error.hpp>

#include "core/logging.hpp"
#ifdef FERRY_HAVE_CUDA
#include "mem/cuda/driver.hpp"
#endif

#include <dlfcn.h>
#include <fmt/format.h>

#include <cerrno>

#include <sys/stat.h>
#include <unistd.h>

namespace ferry::cufile {

struct backend::api {
  cu_error (*driver_open)() = nullptr;
  cu_error (*driver_close)() = nullptr;
  cu_error (*handle_register)(void**, cu_descr*) = nullptr;
  void (*handle_deregister)(void*) = nullptr;
  long (*read)(void*, void*, std::size_t, long, long) = nullptr;
  long (*write)(void*, const void*, std::size_t, long, long) = nullptr;
};

bool nvidia_fs_loaded() { return ::access("/sys/module/nvidia_fs", F_OK) == 0 || ::access("/proc/driver/nvidia-fs", F_OK) == 0; }

backend::backend(const io_settings& s, const std::string& cuda_driver) : lib_(s.cufile_library), driver_(cuda_driver) {
#ifdef FERRY_HAVE_CUDA
  if (s.file_backend == file_backend_kind::automatic && !nvidia_fs_loaded()) {
    why_ = "the nvidia-fs driver is not loaded, so cuFile could only run in compatibility mode (FERRY_FILE_BACKEND=cufile uses it anyway)";
    return;
  }
  const cuda::driver_status& st = cuda::load(cuda_driver);
  if (!st.api) {
    why_ = "no CUDA driver: " + st.reason;
    return;
  }
  void* h = ::dlopen(lib_.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = ::dlerror();
    why_ = fmt::format("cannot load {} ({})", lib_, e ? e : "?");
    return;
  }
  auto a = new api;
  auto sym = [&](auto& fn, const char* name) { fn = reinterpret_cast<std::decay_t<decltype(fn)>>(::dlsym(h, name)); };
  sym(a->driver_open, "cuFileDriverOpen");
  sym(a->driver_close, "cuFileDriverClose_v2");
  if (!a->driver_close) sym(a->driver_close, "cuFileDriverClose");
  sym(a->handle_register, "cuFileHandleRegister");
  sym(a->handle_deregister, "cuFileHandleDeregister");
  sym(a->read, "cuFileRead");
  sym(a->write, "cuFileWrite");
  if (!a->driver_open || !a->handle_register || !a->handle_deregister || !a->read || !a->write) {
    why_ = lib_ + " lacks cuFileDriverOpen/HandleRegister/Read/Write";
    delete a;
    return;
  }
  cu_error e = a->driver_open();
  if (e.err != 0) {
    why_ = fmt::format("cuFileDriverOpen failed (cuFile error {}, CUresult {})", e.err, e.cu_err);
    delete a;
    return;
  }
  api_ = a;
#else
  why_ = "this build has no CUDA support";
#endif
}

backend::~backend() {
  if (!api_) return;
  for (auto& [f, h] : handles_) api_->handle_deregister(h);
  if (api_->driver_close) api_->driver_close();
  delete api_;
}

bool backend::usable(file& f, std::string& why) {
  if (!api_) {
    why = why_;
    return false;
  }
  std::lock_guard l(mu_);
  if (handles_.count(f.id())) return true;
  if (auto it = refused_.find(f.id()); it != refused_.end()) {
    why = it->second;
    return false;
  }
  cu_descr d{};
  d.type = 1;
  d.handle.fd = f.direct_fd() >= 0 ? f.direct_fd() : f.fd();
  struct stat st{};
  const bool known_fs = ::fstat(d.handle.fd, &st) == 0;
  if (known_fs)
    if (auto it = refused_fs_.find(static_cast<unsigned long>(st.st_dev)); it != refused_fs_.end()) {
      why = it->second;
      refused_[f.id()] = why;
      return false;
    }
  void* h = nullptr;
  cu_error e = api_->handle_register(&h, &d);
  if (e.err != 0) {
    why = fmt::format("cuFileHandleRegister failed on {} (cuFile error {})", f.path(), e.err);
    refused_[f.id()] = why;
    if (known_fs) refused_fs_[static_cast<unsigned long>(st.st_dev)] = why + ", and so on its file system";
    return false;
  }
  handles_[f.id()] = h;
  return true;
}

void backend::forget(file& f) {
  std::lock_guard l(mu_);
  if (auto it = handles_.find(f.id()); it != handles_.end()) {
    api_->handle_deregister(it->second);
    handles_.erase(it);
  }
  refused_.erase(f.id());
}

void backend::refuse(file& f, const std::string& why) {
  forget(f);
  std::lock_guard l(mu_);
  refused_[f.id()] = why;
}

namespace {
#ifdef FERRY_HAVE_CUDA
// The device's primary context, current (for cuFile) until the scope ends.
cuda::context_scope make_current(const std::string& driver, int ordinal) {
  const cuda::driver_status& st = cuda::load(driver);
  CUdevice d = 0;
  CUcontext c = nullptr;
  cuda::check(st.api->cuDeviceGet(&d, ordinal), "cufile", "cuDeviceGet");
  cuda::check(st.api->cuDevicePrimaryCtxRetain(&c, d), "cufile", "primary context");
  st.api->cuDevicePrimaryCtxRelease(d);  // the device object keeps its own reference
  cuda::context_scope cs(*st.api, c);
  cuda::check(cs.status(), "cufile", "set context");
  return cs;
}
#endif
std::string describe_ret(long r) {
  if (r == -1) return describe_errno(errno);
  return fmt::format("cuFile error {}", -r);
}
}  // namespace

std::uint64_t backend::transfer(file& f, [[maybe_unused]] int ordinal, bool write, void* mem, std::uint64_t off,
                                std::uint64_t n, std::uint64_t chunk, deadline until,
                                const std::function<void(std::uint64_t)>& progress) {
#ifdef FERRY_HAVE_CUDA
  auto cs = make_current(driver_, ordinal);
#endif
  void* h = nullptr;
  {
    std::lock_guard l(mu_);
    h = handles_.at(f.id());
  }
  const char* op = write ? "file.write" : "file.read";
  std::uint64_t done = 0;
  while (done < n) {
    if (std::chrono::steady_clock::now() >= until) fail(errc::timeout, op, f.path(), "deadline passed (cuFile)");
    std::uint64_t want = std::min(chunk, n - done);
    long r = write ? api_->write(h, mem, want, static_cast<long>(off + done), static_cast<long>(done))
                   : api_->read(h, mem, want, static_cast<long>(off + done), static_cast<long>(done));
    // A read of 0 is end of file; a write of 0 is a failure.
    if (r < 0 || (write && r == 0))
      fail(errc::io_error, op, fmt::format("{} offset {}", f.path(), off + done),
           std::string(write ? "cuFileWrite" : "cuFileRead") + " failed: " + describe_ret(r));
    if (r == 0) break;
    done += static_cast<std::uint64_t>(r);
    progress(static_cast<std::uint64_t>(r));
  }
  return done;
}

std::uint64_t backend::read(file& f, int ordinal, void* dst, std::uint64_t off, std::uint64_t n, std::uint64_t chunk,
                            deadline until, const std::function<void(std::uint64_t)>& progress) {
  return transfer(f, ordinal, false, dst, off, n, chunk, until, progress);
}

void backend::write(file& f, int ordinal, const void* src, std::uint64_t off, std::uint64_t n, std::uint64_t chunk,
                    deadline until, const std::function<void(std::uint64_t)>& progress) {
  transfer(f, ordinal, true, const_cast<void*>(src), off, n, chunk, until, progress);
}

}  // namespace ferry::cufile
