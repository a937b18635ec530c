// pread_gpu FILE [--chunk BYTES] [--way device|pinned|both] [--rounds N] [--make BYTES]: a plain CUDA program (the
// runtime API, nvcc's default static cudart, nothing of ferry's) that reads FILE into cudaMalloc'd
// memory in pread calls of --chunk bytes (16 MiB), one way or both, alternating:
//   device   pread straight into the device memory: the kernel refuses it (EFAULT) unless the program
//            runs under `ferry run`, whose preload library routes it to ferry's file engine
//   pinned   pread into a pinned host buffer, then cudaMemcpy to the device, chunk by chunk: what a
//            program does without ferry
// Each way's bytes are checked against the file (FNV-1a of the device memory copied back, against
// the file's read through the page cache). Prints one line per round and way: seconds, GB/s. With
// --make, FILE is first written with BYTES of pseudo-random data, and removed at the end (the GPU test).
// Exit 0 when every read was complete and equal; 77 when there is no usable GPU.
#include <cuda_runtime.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

std::uint64_t fnv(const unsigned char* p, std::size_t n, std::uint64_t h = 1469598103934665603ull) {
  for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

bool check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "pread_gpu: %s: %s\n", what, cudaGetErrorString(e));
  return false;
}

// Every chunk of the file into dev, the given way; false on a failed or short call.
bool load(int fd, std::uint64_t size, std::uint64_t chunk, unsigned char* dev, unsigned char* pinned, bool direct) {
  for (std::uint64_t off = 0; off < size; off += chunk) {
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(chunk, size - off));
    const ssize_t got = ::pread(fd, direct ? dev + off : pinned, n, static_cast<off_t>(off));
    if (got != static_cast<ssize_t>(n)) {
      std::fprintf(stderr, "pread_gpu: pread of %zu bytes at offset %llu into %s memory: %s\n", n,
                   static_cast<unsigned long long>(off), direct ? "device" : "pinned",
                   got < 0 ? std::strerror(errno) : ("short: " + std::to_string(got)).c_str());
      return false;
    }
    if (!direct && !check(cudaMemcpy(dev + off, pinned, n, cudaMemcpyHostToDevice), "cudaMemcpy")) return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: pread_gpu FILE [--chunk BYTES] [--way device|pinned|both] [--rounds N]\n");
    return 2;
  }
  const char* path = argv[1];
  std::uint64_t chunk = 16ull << 20;
  std::string way = "both";
  int rounds = 1;
  std::uint64_t make = 0;
  for (int i = 2; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--chunk")) chunk = std::strtoull(argv[i + 1], nullptr, 10);
    else if (!std::strcmp(argv[i], "--way")) way = argv[i + 1];
    else if (!std::strcmp(argv[i], "--rounds")) rounds = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--make")) make = std::strtoull(argv[i + 1], nullptr, 10);
    else {
      std::fprintf(stderr, "pread_gpu: unknown option %s\n", argv[i]);
      return 2;
    }
  }
  if (chunk == 0 || rounds < 1) {
    std::fprintf(stderr, "pread_gpu: --chunk and --rounds must be at least 1\n");
    return 2;
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::fprintf(stderr, "pread_gpu: no usable GPU\n");
    return 77;
  }
  if (make) {
    const int out = ::open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    std::vector<unsigned char> block(1 << 20);
    std::uint64_t x = 88172645463325252ull;
    for (std::uint64_t off = 0; out >= 0 && off < make; off += block.size()) {
      for (auto& b : block) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        b = static_cast<unsigned char>(x);
      }
      const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(block.size(), make - off));
      if (::pwrite(out, block.data(), n, static_cast<off_t>(off)) != static_cast<ssize_t>(n)) return 1;
    }
    if (out < 0) {
      std::fprintf(stderr, "pread_gpu: %s: %s\n", path, std::strerror(errno));
      return 1;
    }
    ::close(out);
  }
  const int fd = ::open(path, O_RDONLY);
  struct stat st {};
  if (fd < 0 || ::fstat(fd, &st) != 0) {
    std::fprintf(stderr, "pread_gpu: %s: %s\n", path, std::strerror(errno));
    return 1;
  }
  const auto size = static_cast<std::uint64_t>(st.st_size);
  // The file's checksum, read through the page cache (it also warms it).
  std::vector<unsigned char> host(chunk);
  std::uint64_t want = 1469598103934665603ull;
  for (std::uint64_t off = 0; off < size; off += chunk) {
    const ssize_t got = ::pread(fd, host.data(), host.size(), static_cast<off_t>(off));
    if (got <= 0) return 1;
    want = fnv(host.data(), static_cast<std::size_t>(got), want);
  }
  unsigned char *dev = nullptr, *pinned = nullptr;
  if (!check(cudaMalloc(&dev, size), "cudaMalloc") || !check(cudaMallocHost(&pinned, chunk), "cudaMallocHost")) return 1;
  bool all_ok = true;
  for (int r = 0; r < rounds; ++r) {
    for (const char* w : {"device", "pinned"}) {
      if (way != "both" && way != w) continue;
      check(cudaMemset(dev, 0, size), "cudaMemset");
      check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      const auto t0 = std::chrono::steady_clock::now();
      bool ok = load(fd, size, chunk, dev, pinned, std::string(w) == "device");
      ok = check(cudaDeviceSynchronize(), "cudaDeviceSynchronize") && ok;
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::uint64_t got = 1469598103934665603ull;
      for (std::uint64_t off = 0; ok && off < size; off += chunk) {
        const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(chunk, size - off));
        ok = check(cudaMemcpy(host.data(), dev + off, n, cudaMemcpyDeviceToHost), "cudaMemcpy back");
        got = fnv(host.data(), n, got);
      }
      ok = ok && got == want;
      all_ok = all_ok && ok;
      std::printf("round %d %-6s %8.3f s %8.2f GB/s  %s\n", r + 1, w, s, static_cast<double>(size) / s / 1e9,
                  ok ? "equal to the file" : "FAILED");
      std::fflush(stdout);
    }
  }
  cudaFree(dev);
  cudaFreeHost(pinned);
  ::close(fd);
  if (make) ::unlink(path);
  return all_ok ? 0 : 1;
}
