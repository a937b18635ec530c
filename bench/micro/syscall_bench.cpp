// What the system calls on a small ferry:// read's path cost on this machine: the server's pread of
// 4 KiB from the page cache, and the epoll_wait(0) UCX's tcp transport makes on every progress call
// of a worker with a tcp lane. They set the floor under the 4 KiB QD1 latency next to the raw UCX
// round trip.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <string>
#include <vector>

#include <fcntl.h>
#include <sys/epoll.h>
#include <unistd.h>

namespace {

void BM_Pread4KiBPageCache(benchmark::State& state) {
  std::string path = "/tmp/ferry-syscall-bench-" + std::to_string(::getpid());
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    state.SkipWithError("cannot create a file under /tmp");
    return;
  }
  ::unlink(path.c_str());
  std::vector<char> data(1 << 20, 1);
  if (::write(fd, data.data(), data.size()) != static_cast<ssize_t>(data.size())) {
    state.SkipWithError("cannot write the file");
    ::close(fd);
    return;
  }
  char buf[4096];
  std::size_t i = 0;
  for (auto _ : state) {
    ssize_t r = ::pread(fd, buf, sizeof buf, static_cast<off_t>((i++ % 256) * 4096));
    benchmark::DoNotOptimize(r);
  }
  ::close(fd);
}
BENCHMARK(BM_Pread4KiBPageCache);

void BM_EpollWaitZeroTimeout(benchmark::State& state) {
  int ep = ::epoll_create1(EPOLL_CLOEXEC);
  epoll_event ev[4];
  for (auto _ : state) benchmark::DoNotOptimize(::epoll_wait(ep, ev, 4, 0));
  ::close(ep);
}
BENCHMARK(BM_EpollWaitZeroTimeout);

}  // namespace
