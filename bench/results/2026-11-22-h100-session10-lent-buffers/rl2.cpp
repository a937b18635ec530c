#include <ferry/store/service.hpp>
#include <ferry/runtime.hpp>
#include <unistd.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <thread>
int main(int argc, char** argv) {
  int n = argc > 1 ? atoi(argv[1]) : 200000;
  int fd = ::open("/tmp/exp/root/f", O_CREAT | O_RDWR, 0644); std::vector<char> d(1 << 20, 'x'); ::pwrite(fd, d.data(), d.size(), 0); ::close(fd);
  int p[2]; pipe(p);
  pid_t pid = fork();
  if (!pid) {
    ferry::store::server_options o; o.root = "/tmp/exp/root"; o.workers = getenv("WORKERS") ? atoi(getenv("WORKERS")) : 1;
    ferry::store::server s(o); uint16_t port = s.port(); write(p[1], &port, 2);
    char c; read(0, &c, 1); pause(); return 0;
  }
  uint16_t port; read(p[0], &port, 2);
  ferry::runtime rt; auto co = ferry::store::client_options_from(rt.config(), &rt.registrations(), &rt.engine()); co.lanes = getenv("LANES") ? atoi(getenv("LANES")) : 1;
  ferry::store::client c("127.0.0.1", port, co);
  std::vector<char> buf(4096); std::vector<double> t, ts;
  for (int i = 0; i < n; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    auto tk = c.start_read("f", (i % 256) * 4096, buf.data(), 4096, t0 + std::chrono::seconds(5));
    auto t1 = std::chrono::steady_clock::now();
    c.finish(tk);
    auto t2 = std::chrono::steady_clock::now();
    t.push_back(std::chrono::duration<double, std::micro>(t2 - t0).count());
    ts.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  std::sort(t.begin(), t.end()); std::sort(ts.begin(), ts.end());
  printf("4 KiB read QD1: p50 %.2f us p90 %.2f us; start_read p50 %.2f us (%s)\n", t[n / 2], t[n * 9 / 10], ts[n / 2], c.stats().transports.c_str());
  kill(pid, SIGKILL); waitpid(pid, nullptr, 0);
}
