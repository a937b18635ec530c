#include <ferry/core/error.hpp>
#include <ferry/io/probe.hpp>

#include "io/cufile.hpp"

#include <dlfcn.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <liburing.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace ferry {

capability probe_io_uring() {
  capability c;
  c.name = "io_uring";
  utsname u{};
  if (::uname(&u) == 0) c.add("kernel", u.release);
  c.add("liburing", FERRY_LIBURING_VERSION);  // as built against (liburing 2.3 has no version call)
  io_uring ring{};
  int r = io_uring_queue_init(4, &ring, 0);
  if (r < 0) {
    c.reason = fmt::format("io_uring_queue_init failed: {}", describe_errno(-r));
    return c;
  }
  io_uring_probe* p = io_uring_get_probe_ring(&ring);
  if (p) {
    struct {
      int op;
      const char* name;
    } ops[] = {{IORING_OP_READ, "read"},           {IORING_OP_WRITE, "write"},
               {IORING_OP_READ_FIXED, "read_fixed"}, {IORING_OP_WRITE_FIXED, "write_fixed"},
               {IORING_OP_READV, "readv"},          {IORING_OP_FSYNC, "fsync"}};
    std::string have, missing;
    for (auto& o : ops) (io_uring_opcode_supported(p, o.op) ? have : missing) += std::string(o.name) + " ";
    c.add("opcodes", have.empty() ? "none" : have.substr(0, have.size() - 1));
    if (!missing.empty()) c.add("missing", missing.substr(0, missing.size() - 1));
    c.add("last_opcode", std::to_string(p->last_op));
    io_uring_free_probe(p);
  }
  io_uring_queue_exit(&ring);
  c.available = true;
  return c;
}

using cufile_error = cufile::cu_error;
using cufile_descr = cufile::cu_descr;
using cufile_handle = void*;

capability probe_cufile(const io_settings& s, bool cuda_available, const std::string& path) {
  capability c;
  c.name = "cufile";
  void* h = ::dlopen(s.cufile_library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = ::dlerror();
    c.add("library", "not found");
    c.reason = fmt::format("cannot load {} ({}); the file layer uses its io_uring path", s.cufile_library,
                           e ? e : "?");
    return c;
  }
  c.add("library", s.cufile_library);
  if (!cuda_available) {
    c.reason = "cuFile needs a CUDA driver and GPU, and there is none";
    return c;
  }
  auto open = reinterpret_cast<cufile_error (*)()>(::dlsym(h, "cuFileDriverOpen"));
  auto close2 = reinterpret_cast<cufile_error (*)()>(::dlsym(h, "cuFileDriverClose_v2"));
  auto close1 = reinterpret_cast<cufile_error (*)()>(::dlsym(h, "cuFileDriverClose"));
  auto reg = reinterpret_cast<cufile_error (*)(cufile_handle*, cufile_descr*)>(::dlsym(h, "cuFileHandleRegister"));
  auto dereg = reinterpret_cast<void (*)(cufile_handle)>(::dlsym(h, "cuFileHandleDeregister"));
  if (!open || !reg || !dereg) {
    c.reason = s.cufile_library + " lacks cuFileDriverOpen/cuFileHandleRegister";
    return c;
  }
  cufile_error e = open();
  if (e.err != 0) {
    c.add("driver_open", fmt::format("failed (cuFile error {}, CUresult {})", e.err, e.cu_err));
    c.reason = "cuFileDriverOpen failed";
    return c;
  }
  c.add("driver_open", "ok");
  c.available = true;
  if (!path.empty()) {
    struct stat st{};
    std::string file = path;
    bool temp = false;
    if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
      file = path + "/.ferry-cufile-probe-XXXXXX";
      int tfd = ::mkstemp(file.data());
      if (tfd >= 0) {
        ::close(tfd);
        temp = true;
      }
    }
    int fd = ::open(file.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
    if (fd < 0) {
      c.add("handle_register", fmt::format("cannot open {} with O_DIRECT: {}", file, describe_errno(errno)));
      c.available = false;
      c.reason = "O_DIRECT open failed on " + path;
    } else {
      cufile_descr d{};
      d.type = 1;
      d.handle.fd = fd;
      cufile_handle fh = nullptr;
      cufile_error r = reg(&fh, &d);
      if (r.err == 0) {
        c.add("handle_register", "ok on " + path);
        dereg(fh);
      } else {
        c.add("handle_register", fmt::format("failed on {} (cuFile error {})", path, r.err));
        c.available = false;
        c.reason = fmt::format("cuFileHandleRegister fails on {} (error {}): the file layer will use io_uring there", path,
                               r.err);
      }
      ::close(fd);
    }
    if (temp) ::unlink(file.c_str());
  }
  if (close2) close2();
  else if (close1) close1();
  return c;
}

}  // namespace ferry
