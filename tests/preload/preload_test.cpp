// libferry_preload.so's syscalls (tools/preload/preload.cpp), run with it in LD_PRELOAD (ctest sets
// it): plain read/pread/write/pwrite calls, as an unmodified program makes them, with sim device
// memory (which the CPU cannot reach, like a GPU's) as their buffer. The memory comes from the
// preload library's own runtime (ferry_preload_runtime), so that both know it.
#include <ferry/device/mapped_memory.hpp>
#include <ferry/runtime.hpp>

#include "support/data.hpp"

#include <gtest/gtest.h>

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

using namespace ferry;

runtime& rt() {
  using get_fn = runtime* (*)();
  auto get = reinterpret_cast<get_fn>(::dlsym(RTLD_DEFAULT, "ferry_preload_runtime"));
  if (!get) throw std::runtime_error("libferry_preload.so is not loaded (run this test with it in LD_PRELOAD)");
  runtime* r = get();
  if (!r) throw std::runtime_error("the preload library's runtime did not start");
  return *r;
}

struct temp_file {
  std::string path;
  explicit temp_file(const std::vector<unsigned char>& data) {
    char tmpl[] = "/tmp/ferry-preload-XXXXXX";
    int fd = ::mkstemp(tmpl);
    path = tmpl;
    EXPECT_EQ(::pwrite(fd, data.data(), data.size(), 0), static_cast<ssize_t>(data.size()));
    ::close(fd);
  }
  ~temp_file() { ::unlink(path.c_str()); }
  std::vector<unsigned char> contents() const { return test::slurp(path); }
};

// Where two byte strings first differ ("" when equal), for messages that say more than gtest's dump.
std::string difference(const std::vector<unsigned char>& got, const std::vector<unsigned char>& want) {
  if (got.size() != want.size()) return "size " + std::to_string(got.size()) + " against " + std::to_string(want.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i]) return "first difference at byte " + std::to_string(i);
  return "";
}

std::vector<unsigned char> back(const mapped_memory& m, std::size_t at, std::size_t n) {
  std::vector<unsigned char> v(n);
  rt().engine().copy(v.data(), reinterpret_cast<const unsigned char*>(m.data()) + at, n);
  return v;
}

TEST(Preload, PreadIntoDeviceMemoryAtOddOffsetsAndSizes) {
  auto data = test::random_bytes(9'000'001, 1);
  temp_file f(data);
  auto dev = allocate_mapped(rt().devices().get("sim:0"), 16 << 20);
  auto* p = reinterpret_cast<unsigned char*>(dev.data());
  int fd = ::open(f.path.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  EXPECT_EQ(::pread(fd, p + 3, 5'000'003, 777), 5'000'003);
  EXPECT_EQ(back(dev, 3, 5'000'003), std::vector<unsigned char>(data.begin() + 777, data.begin() + 777 + 5'000'003));
  // Across the end of the file: short; at or past it: 0.
  EXPECT_EQ(::pread(fd, p, 4 << 20, 8'000'000), 1'000'001);
  EXPECT_EQ(back(dev, 0, 1'000'001), std::vector<unsigned char>(data.begin() + 8'000'000, data.end()));
  EXPECT_EQ(::pread(fd, p, 4096, 9'000'001), 0);
  EXPECT_EQ(::pread(fd, p, 4096, 20'000'000), 0);
  // The descriptor's offset is not pread's to move.
  EXPECT_EQ(::lseek(fd, 0, SEEK_CUR), 0);
  ::close(fd);
}

TEST(Preload, ReadMovesTheOffsetAsTheKernelWould) {
  auto data = test::random_bytes(3 << 20, 2);
  temp_file f(data);
  auto dev = allocate_mapped(rt().devices().get("sim:0"), 4 << 20);
  auto* p = reinterpret_cast<unsigned char*>(dev.data());
  int fd = ::open(f.path.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::lseek(fd, 1000, SEEK_SET), 1000);
  EXPECT_EQ(::read(fd, p, 1 << 20), 1 << 20);
  EXPECT_EQ(::lseek(fd, 0, SEEK_CUR), 1000 + (1 << 20));
  EXPECT_EQ(::read(fd, p + (1 << 20), 4 << 20), (3 << 20) - 1000 - (1 << 20));  // the rest, short
  EXPECT_EQ(::read(fd, p, 4096), 0);                                            // at the end
  EXPECT_EQ(back(dev, 0, (3 << 20) - 1000), std::vector<unsigned char>(data.begin() + 1000, data.end()));
  ::close(fd);
}

TEST(Preload, WritesFromDeviceMemoryLandInTheFile) {
  auto data = test::random_bytes(6 << 20, 3);
  auto before = test::random_bytes(1 << 20, 4);
  temp_file f(before);
  auto dev = allocate_mapped(rt().devices().get("sim:0"), 6 << 20);
  rt().engine().copy(dev.data(), data.data(), data.size());
  auto* p = reinterpret_cast<const unsigned char*>(dev.data());
  int fd = ::open(f.path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  // pwrite inside and past the end; write at the offset, which moves.
  EXPECT_EQ(::pwrite(fd, p, 100'000, 5), 100'000);
  EXPECT_EQ(::pwrite(fd, p + 7, 2'000'000, 1'500'000), 2'000'000);
  ASSERT_EQ(::lseek(fd, 4'000'000, SEEK_SET), 4'000'000);
  EXPECT_EQ(::write(fd, p + 11, 1'000'000), 1'000'000);
  EXPECT_EQ(::lseek(fd, 0, SEEK_CUR), 5'000'000);
  ::close(fd);
  std::vector<unsigned char> want = before;
  want.resize(5'000'000, 0);
  std::memcpy(want.data() + 5, data.data(), 100'000);
  std::memcpy(want.data() + 1'500'000, data.data() + 7, 2'000'000);
  std::memcpy(want.data() + 4'000'000, data.data() + 11, 1'000'000);
  EXPECT_EQ(difference(f.contents(), want), "");

  // O_APPEND: at the end, whatever the offset.
  fd = ::open(f.path.c_str(), O_WRONLY | O_APPEND);
  ASSERT_GE(fd, 0);
  EXPECT_EQ(::write(fd, p, 300'000), 300'000);
  ::close(fd);
  want.insert(want.end(), data.begin(), data.begin() + 300'000);
  EXPECT_EQ(difference(f.contents(), want), "");
}

TEST(Preload, WhatIsNotRoutedKeepsTheKernelsAnswer) {
  auto data = test::random_bytes(1 << 20, 5);
  temp_file f(data);
  auto dev = allocate_mapped(rt().devices().get("sim:0"), 2 << 20);
  int fd = ::open(f.path.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  // Host memory: the C library's read, as before.
  std::vector<unsigned char> host(1 << 20);
  EXPECT_EQ(::pread(fd, host.data(), host.size(), 0), 1 << 20);
  EXPECT_EQ(host, data);
  // Memory nobody owns (a PROT_NONE mapping): EFAULT, as without the library.
  void* none = ::mmap(nullptr, 1 << 20, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(none, MAP_FAILED);
  errno = 0;
  EXPECT_EQ(::pread(fd, none, 4096, 0), -1);
  EXPECT_EQ(errno, EFAULT);
  ::munmap(none, 1 << 20);
  // A range that runs past the device allocation: not memory ferry knows whole, so EFAULT.
  errno = 0;
  EXPECT_EQ(::pread(fd, reinterpret_cast<unsigned char*>(dev.data()) + (2 << 20) - 4096, 8192, 0), -1);
  EXPECT_EQ(errno, EFAULT);
  // A pipe into device memory: not a regular file, not routed (its bytes are not ours to take).
  int pfd[2];
  ASSERT_EQ(::pipe(pfd), 0);
  ASSERT_EQ(::write(pfd[1], "abc", 3), 3);
  errno = 0;
  EXPECT_EQ(::read(pfd[0], dev.data(), 3), -1);
  EXPECT_EQ(errno, EFAULT);
  ::close(pfd[0]);
  ::close(pfd[1]);
  // A descriptor not open for reading: the kernel's EBADF comes first.
  int wfd = ::open(f.path.c_str(), O_WRONLY);
  errno = 0;
  EXPECT_EQ(::pread(wfd, dev.data(), 4096, 0), -1);
  EXPECT_EQ(errno, EBADF);
  ::close(wfd);
  errno = 0;
  EXPECT_EQ(::pread(-1, dev.data(), 4096, 0), -1);
  EXPECT_EQ(errno, EBADF);
  ::close(fd);
}

TEST(Preload, TheProgramsRecordLocksStayAndAForkedChildKeepsEfault) {
  auto data = test::random_bytes(2 << 20, 6);
  temp_file f(data);
  auto dev = allocate_mapped(rt().devices().get("sim:0"), 2 << 20);
  int fd = ::open(f.path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  struct flock lk {};
  lk.l_type = F_WRLCK;
  lk.l_whence = SEEK_SET;
  ASSERT_EQ(::fcntl(fd, F_SETLK, &lk), 0);
  EXPECT_EQ(::pread(fd, dev.data(), 1 << 20, 0), 1 << 20);  // routed
  EXPECT_EQ(::pwrite(fd, dev.data(), 4096, 0), 4096);         // routed
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Another process sees the parent's lock still held; its own read of device memory keeps EFAULT.
    struct flock q {};
    q.l_type = F_WRLCK;
    q.l_whence = SEEK_SET;
    const bool locked = ::fcntl(fd, F_GETLK, &q) == 0 && q.l_type == F_WRLCK && q.l_pid == ::getppid();
    errno = 0;
    const bool efault = ::pread(fd, dev.data(), 4096, 0) == -1 && errno == EFAULT;
    ::_exit(locked && efault ? 0 : (locked ? 2 : 1));
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: the lock was dropped by a routed call; 2: the child's read was routed";
  ::close(fd);
}

}  // namespace
