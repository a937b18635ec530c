#include <ferry/core/error.hpp>
#include <ferry/vm/probe.hpp>

#include <fcntl.h>
#include <fmt/format.h>
#include <linux/userfaultfd.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>

namespace ferry {

capability probe_userfaultfd() {
  capability c;
  c.name = "userfaultfd";
  std::ifstream unpriv("/proc/sys/vm/unprivileged_userfaultfd");
  std::string v;
  if (unpriv >> v) c.add("unprivileged_userfaultfd", v);
  c.add("euid", std::to_string(::geteuid()));
#ifdef SYS_userfaultfd
  int fd = static_cast<int>(::syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK));
  if (fd < 0) {
    int e = errno;
    c.reason = fmt::format("userfaultfd() failed: {}{}", describe_errno(e),
                           e == EPERM ? " (needs root/CAP_SYS_PTRACE or vm.unprivileged_userfaultfd=1)" : "");
    return c;
  }
  uffdio_api api{};
  api.api = UFFD_API;
  api.features = 0;
  if (::ioctl(fd, UFFDIO_API, &api) != 0) {
    c.reason = fmt::format("UFFDIO_API failed: {}", describe_errno(errno));
    ::close(fd);
    return c;
  }
  std::string f;
  auto feat = [&](std::uint64_t bit, const char* name) {
    if (api.features & bit) f += (f.empty() ? "" : " ") + std::string(name);
  };
  feat(UFFD_FEATURE_MISSING_SHMEM, "missing_shmem");
#ifdef UFFD_FEATURE_PAGEFAULT_FLAG_WP
  feat(UFFD_FEATURE_PAGEFAULT_FLAG_WP, "wp");
#endif
#ifdef UFFD_FEATURE_MINOR_SHMEM
  feat(UFFD_FEATURE_MINOR_SHMEM, "minor_shmem");
#endif
#ifdef UFFD_FEATURE_THREAD_ID
  feat(UFFD_FEATURE_THREAD_ID, "thread_id");
#endif
  c.add("features", f.empty() ? "none" : f);
  ::close(fd);
  c.available = true;
#else
  c.reason = "this kernel's headers have no userfaultfd system call";
#endif
  return c;
}

}  // namespace ferry
