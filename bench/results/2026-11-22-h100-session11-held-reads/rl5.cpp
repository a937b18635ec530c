// Experiment: 4 KiB QD1 reads with rdtsc probes in a tracing build of libferry (see /tmp/lt).
#include <ferry/store/service.hpp>
#include <ferry/runtime.hpp>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <sched.h>
#include <x86intrin.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
extern "C" { extern std::uint64_t* ferry_lat_trace; }
static void pin(const char* env) {
  if (!getenv(env)) return;
  cpu_set_t s; CPU_ZERO(&s); CPU_SET(atoi(getenv(env)), &s); sched_setaffinity(0, sizeof s, &s);
}
int main(int argc, char** argv) {
  int n = argc > 1 ? atoi(argv[1]) : 50000;
  std::uint64_t file_mb = getenv("FILE_MB") ? atoll(getenv("FILE_MB")) : 1;
  bool seq = getenv("SEQ") != nullptr;
  bool trace = getenv("NOTRACE") == nullptr;
  std::string root = getenv("ROOT") ? getenv("ROOT") : "/tmp/exp/root";
  std::string fpath = root + "/f";
  int fd = ::open(fpath.c_str(), O_CREAT | O_RDWR, 0644);
  std::vector<char> d(1 << 20, 'x');
  for (std::uint64_t i = 0; i < file_mb; ++i) ::pwrite(fd, d.data(), d.size(), i << 20);
  ::close(fd);
  auto* tr = static_cast<std::uint64_t*>(mmap(nullptr, 65536 * 16 * 8, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  if (trace) ferry_lat_trace = tr;
  int p[2]; pipe(p);
  pid_t pid = fork();
  if (!pid) {
    pin("SERVER_CPU");
    ferry::store::server_options o; o.root = root; o.workers = 1;
    ferry::store::server s(o); uint16_t port = s.port(); write(p[1], &port, 2);
    pause(); return 0;
  }
  pin("CLIENT_CPU");
  uint16_t port; read(p[0], &port, 2);
  ferry::runtime rt; auto co = ferry::store::client_options_from(rt.config(), &rt.registrations(), &rt.engine()); co.lanes = 1;
  ferry::store::client c("127.0.0.1", port, co);
  std::vector<char> vb(4096); char* bp = getenv("HOST") ? vb.data() : (char*)c.allocate(4096);
  std::vector<double> t; t.reserve(n);
  const std::uint64_t pages = (file_mb << 20) / 4096;
  for (int i = 0; i < 2000; ++i) c.finish(c.start_read("f", (i % 256) * 4096, bp, 4096, std::chrono::steady_clock::now() + std::chrono::seconds(5)));
  std::uint64_t first_rid_guess = 0;
  for (int k = 0; k < 65536; ++k) if (tr[k * 16 + 15]) first_rid_guess = k;  // last rid used in warm-up
  auto c0 = std::chrono::steady_clock::now(); auto r0 = __rdtsc();
  for (int i = 0; i < n; ++i) {
    std::uint64_t pg = seq ? (i % pages) : (i % std::min<std::uint64_t>(pages, 256));
    auto t0 = std::chrono::steady_clock::now();
    if (getenv("ASYNC")) c.finish(c.start_read("f", pg * 4096, bp, 4096, t0 + std::chrono::seconds(5)));
    else c.read("f", pg * 4096, bp, 4096, t0 + std::chrono::seconds(5));
    auto t2 = std::chrono::steady_clock::now();
    t.push_back(std::chrono::duration<double, std::micro>(t2 - t0).count());
  }
  auto c1 = std::chrono::steady_clock::now(); auto r1 = __rdtsc();
  double ghz = (r1 - r0) / std::chrono::duration<double, std::nano>(c1 - c0).count();
  std::sort(t.begin(), t.end());
  printf("4 KiB read QD1 %s, file %lu MiB %s: p50 %.2f us p90 %.2f us (steady_clock; tsc %.3f GHz) [%s]\n", getenv("HOST") ? "host" : "allocated",
         (unsigned long)file_mb, seq ? "sequential" : "256 pages cyclic", t[n / 2], t[n * 9 / 10], ghz, c.stats().transports.c_str());
  if (trace) {
    struct seg { int a, b; const char* what; };
    seg segs[] = {{0, 1, "client: entry -> request id (checks, mu, credit)"},
                  {1, 2, "client: bookkeeping under mu (pend/ops) -> send_frame"},
                  {2, 3, "client: enter() the worker"},
                  {3, 4, "client: encode + ucp_am_send_nbx"},
                  {4, 5, "client: leave() the worker"},
                  {4, 6, "wire: client send returned -> server AM callback entry"},
                  {6, 7, "server: find connection + decode"},
                  {7, 8, "server: dispatch to read_direct_here"},
                  {8, 9, "server: read_small (4 KiB copy)"},
                  {9, 10, "server: publish notify record"},
                  {9, 11, "wire: server record -> client sees it"},
                  {11, 12, "client: find connection + decode"},
                  {12, 13, "client: on_frame -> settled"},
                  {13, 14, "client: settled -> drive returns"},
                  {14, 15, "client: drive returned -> finish checks"},
                  {5, 11, "client: start() returned -> reply seen"},
                  {0, 15, "total (start entry -> finish)"}};
    printf("%-72s %8s %8s %8s\n", "segment", "p10 ns", "p50 ns", "p90 ns");
    for (auto& s : segs) {
      std::vector<double> v;
      for (std::uint64_t k = first_rid_guess + 1; k < 65536; ++k) {
        auto a = tr[k * 16 + s.a], b = tr[k * 16 + s.b];
        if (a && b && tr[k * 16 + 15]) v.push_back((double)(std::int64_t)(b - a) / ghz);
      }
      if (v.empty()) { printf("%-72s (none)\n", s.what); continue; }
      std::sort(v.begin(), v.end());
      printf("%-72s %8.0f %8.0f %8.0f\n", s.what, v[v.size() / 10], v[v.size() / 2], v[v.size() * 9 / 10]);
    }
  }
  kill(pid, SIGKILL); waitpid(pid, nullptr, 0);
}
