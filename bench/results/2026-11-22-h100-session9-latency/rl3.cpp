// Diagnostic: 4 KiB QD1 ferry:// reads over shm with rdtsc stamps at points in client and server.
#include <ferry/store/service.hpp>
#include <ferry/runtime.hpp>
#include <x86intrin.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>
extern "C" unsigned long long* ferry_trace;
static void pin(const char* env) {
  const char* v = getenv(env);
  if (!v || !*v) return;
  cpu_set_t s; CPU_ZERO(&s);
  std::string x = v; size_t a = 0;
  while (a < x.size()) { size_t b = x.find(',', a); if (b == std::string::npos) b = x.size(); CPU_SET(atoi(x.substr(a, b - a).c_str()), &s); a = b + 1; }
  sched_setaffinity(0, sizeof s, &s);
}
int main(int argc, char** argv) {
  int n = argc > 1 ? atoi(argv[1]) : 100000;
  const char* root = getenv("ROOT") ? getenv("ROOT") : "/tmp/exp/root";
  std::string f = std::string(root) + "/f";
  int fd = ::open(f.c_str(), O_CREAT | O_RDWR, 0644); std::vector<char> d(1 << 20, 'x'); (void)!::pwrite(fd, d.data(), d.size(), 0); ::close(fd);
  auto* tr = static_cast<unsigned long long*>(mmap(nullptr, 8192, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  int p[2]; (void)!pipe(p);
  pid_t pid = fork();
  if (!pid) {
    pin("CPU_SRV");
    ferry_trace = tr;
    ferry::store::server_options o; o.root = root; o.workers = getenv("WORKERS") ? atoi(getenv("WORKERS")) : 1;
    ferry::store::server s(o); uint16_t port = s.port(); (void)!write(p[1], &port, 2);
    pause(); return 0;
  }
  uint16_t port; (void)!read(p[0], &port, 2);
  ferry::runtime rt; auto co = ferry::store::client_options_from(rt.config(), &rt.registrations(), &rt.engine());
  co.lanes = getenv("LANES") ? atoi(getenv("LANES")) : 1;
  ferry::store::client c("127.0.0.1", port, co);
  pin("CPU_CLI");
  // tsc calibration
  auto c0 = std::chrono::steady_clock::now(); auto r0 = __rdtsc();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  double tpn = double(__rdtsc() - r0) / std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - c0).count();
  std::vector<char> buf(4096);
  const int K = 13;
  std::vector<std::vector<double>> seg(32);
  std::vector<double> tot;
  const int pairs[][2] = {{12, 0}, {0, 1}, {1, 2}, {2, 3}, {2, 4}, {4, 5}, {5, 6}, {4, 13}, {13, 14}, {14, 15}, {15, 16}, {16, 17}, {17, 5}, {5, 10}, {10, 7}, {7, 8}, {8, 9}, {9, 11}, {12, 11}, {6, 10}};
  const char* names[] = {"call->start", "client pre-send", "send_frame", "back to wait", "REQ one-way (sent->srv cb)", "server handle", "server send_reply", "  srv decode", "  srv cb->read_inline", "  srv reply_space", "  srv last file", "  srv map copy", "  srv ->send",
                         "REPLY one-way (srv send->cli cb)", "client decode", "client on_inline", "settle->drive ret", "drive ret->finish ret", "TOTAL", "srv send ret->cli cb"};
  const int np = sizeof pairs / sizeof pairs[0];
  for (int i = 0; i < n + 1000; ++i) {
    ferry_trace = i >= 1000 ? tr : nullptr;
    for (int k = 0; k < 20; ++k) tr[k * 8] = 0;
    auto ts = __rdtsc();
    auto tk = c.start_read("f", (i % 256) * 4096, buf.data(), 4096, std::chrono::steady_clock::now() + std::chrono::seconds(5));
    c.finish(tk);
    auto te = __rdtsc();
    if (i < 1000) continue;
    tr[12 * 8] = ts; tr[11 * 8] = te;
    bool ok = true;
    for (int k : {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 13, 14, 15, 16, 17}) ok = ok && tr[k * 8];
    if (!ok) continue;
    for (int k = 0; k < np; ++k) seg[k].push_back(double((long long)(tr[pairs[k][1] * 8] - tr[pairs[k][0] * 8])) / tpn / 1000.0);
  }
  ferry_trace = nullptr;
  printf("lanes %d, %zu traced of %d, tsc %.3f GHz (%s)\n", co.lanes, seg[0].size(), n, tpn, c.stats().transports.c_str());
  for (int k = 0; k < np; ++k) {
    auto& v = seg[k]; if (v.empty()) continue;
    std::sort(v.begin(), v.end());
    printf("  %-34s p50 %6.3f us  p10 %6.3f  p90 %6.3f\n", names[k], v[v.size() / 2], v[v.size() / 10], v[v.size() * 9 / 10]);
  }
  kill(pid, SIGKILL); waitpid(pid, nullptr, 0);
}
