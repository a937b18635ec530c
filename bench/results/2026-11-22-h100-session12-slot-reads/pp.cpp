// Ping-pong model of a 4 KiB read through a shared slot: the "server" copies 4 KiB into the slot and
// raises a flag, the "client" waits for it and copies the slot out (or not). Variants price the
// cross-core data movement.
#include <immintrin.h>
#include <cpuid.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
struct alignas(64) line { std::atomic<std::uint64_t> v; char pad[56]; };
struct shared { line req, resp, go; alignas(4096) unsigned char slot[16384]; };
static bool has_cldemote() { unsigned a, b, c, d; if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false; return c & (1u << 25); }
__attribute__((target("cldemote"))) static void demote(const void* p, size_t n) { for (size_t i = 0; i < n; i += 64) _cldemote((void*)((const char*)p + i)); }
__attribute__((target("clflushopt"))) static void flushopt(const void* p, size_t n) { for (size_t i = 0; i < n; i += 64) _mm_clflushopt((void*)((const char*)p + i)); }
__attribute__((target("avx2"))) static void nt_copy(void* d, const void* s, size_t n) {
  for (size_t i = 0; i < n; i += 32) _mm256_stream_si256((__m256i*)((char*)d + i), _mm256_loadu_si256((const __m256i*)((const char*)s + i)));
  _mm_sfence();
}
int main(int argc, char** argv) {
  const int n = argc > 1 ? atoi(argv[1]) : 200000;
  const size_t len = argc > 2 ? atoi(argv[2]) : 4096;
  bool cld = has_cldemote();
  printf("cldemote %s\n", cld ? "supported" : "not supported (a no-op hint)");
  const char* names[] = {"client no copy (like perftest)", "client memcpy out", "client prefetch all lines + memcpy", "server NT stores, client memcpy",
                         "server memcpy + cldemote, client memcpy", "client memcpy + cldemote slot", "client memcpy + clflushopt slot",
                         "both cldemote"};
  for (int var = 0; var < 8; ++var) {
    auto* s = (shared*)mmap(nullptr, sizeof(shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    new (s) shared();
    pid_t pid = fork();
    if (!pid) {
      std::vector<unsigned char> src(1 << 20, 7);
      for (std::uint64_t i = 1;; ++i) {
        std::uint64_t r;
        while ((r = s->req.v.load(std::memory_order_acquire)) != i) if (r == ~0ull) _exit(0);
        const unsigned char* from = src.data() + (i % 256) * 4096;
        if (var == 3) nt_copy(s->slot, from, len);
        else std::memcpy(s->slot, from, len);
        if ((var == 4 || var == 7) && cld) demote(s->slot, len);
        s->resp.v.store(i, std::memory_order_release);
      }
    }
    std::vector<unsigned char> dst(16384);
    std::vector<double> t(n);
    for (int i = 1; i <= n; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      s->req.v.store(i, std::memory_order_release);
      while (s->resp.v.load(std::memory_order_acquire) != (std::uint64_t)i) _mm_pause();
      if (var == 2) for (size_t k = 0; k < len; k += 64) _mm_prefetch((const char*)s->slot + k, _MM_HINT_T0);
      if (var != 0) std::memcpy(dst.data(), s->slot, len);
      if ((var == 5 || var == 7) && cld) demote(s->slot, len);
      if (var == 6) flushopt(s->slot, len);
      asm volatile("" ::"r"(dst.data()) : "memory");
      t[i - 1] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    }
    s->req.v.store(~0ull);
    waitpid(pid, nullptr, 0);
    std::sort(t.begin(), t.end());
    printf("%-44s %zu B: p50 %.3f us  p90 %.3f us\n", names[var], len, t[n / 2], t[n * 9 / 10]);
    munmap(s, sizeof(shared));
  }
}
