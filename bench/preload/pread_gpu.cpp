// pread_gpu FILE [--chunk BYTES] [--way device|pinned|threads|both|all] [--rounds N] [--make BYTES]: a plain CUDA
// program (the runtime API, nvcc's default static cudart, nothing of ferry's) that reads FILE into cudaMalloc'd
// memory in pread calls of --chunk bytes (16 MiB), one way or several, alternating:
//   device   pread straight into the device memory: the kernel refuses it (EFAULT) unless the program
//            runs under `ferry run`, whose preload library routes it to ferry's file engine
//   pinned   pread into a pinned host buffer, then cudaMemcpy to the device, chunk by chunk: what a
//            program does without ferry
//   threads  the most a program can do per call without ferry: each chunk read by a pool of threads (one
//            per core, at most 16, made once) in 1 MiB preads into a pinned buffer of the chunk's size,
//            each piece copied on as it lands (cudaMemcpyAsync on the thread's own stream), all of them
//            synchronized before the next chunk: the floor of one synchronous call on the machine
// `both` is device and pinned, `all` the three. Each way's bytes are checked against the file (FNV-1a of
// the device memory copied back, against the file's read through the page cache). Prints one line per
// round and way: seconds, GB/s. With --make, FILE is first written with BYTES of pseudo-random data, and
// removed at the end (the GPU test). Exit 0 when every read was complete and equal; 77 when there is no
// usable GPU.
#include <cuda_runtime.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
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

// The threads way's pool: each call's range split among the threads, each reading its share in
// pieces and copying each piece on as it lands; the call returns when every thread has synchronized.
class pool {
 public:
  pool(int fd, unsigned char* pinned) : fd_(fd), pinned_(pinned) {
    const unsigned n = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
    streams_.resize(n);
    for (auto& s : streams_) check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    for (unsigned t = 0; t < n; ++t) threads_.emplace_back([this, t] { run(t); });
  }
  ~pool() {
    {
      std::lock_guard l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
    for (auto& s : streams_) cudaStreamDestroy(s);
  }
  // [off, off + n) of the file into dev; false on a failed or short read or copy.
  bool call(unsigned char* dev, std::uint64_t off, std::size_t n) {
    std::unique_lock l(mu_);
    dev_ = dev, off_ = off, n_ = n, left_ = threads_.size(), ok_ = true, ++gen_;
    cv_.notify_all();
    done_.wait(l, [&] { return left_ == 0; });
    return ok_;
  }

 private:
  void run(unsigned t) {
    std::uint64_t seen = 0;
    for (;;) {
      unsigned char* dev;
      std::uint64_t off;
      std::size_t n;
      {
        std::unique_lock l(mu_);
        cv_.wait(l, [&] { return stop_ || gen_ != seen; });
        if (stop_) return;
        seen = gen_, dev = dev_, off = off_, n = n_;
      }
      const std::size_t share = (n + threads_.size() - 1) / threads_.size(), lo = std::min(n, t * share), hi = std::min(n, lo + share);
      bool ok = true;
      for (std::size_t a = lo; ok && a < hi; a += piece) {
        const std::size_t k = std::min(piece, hi - a);
        ok = ::pread(fd_, pinned_ + a, k, static_cast<off_t>(off + a)) == static_cast<ssize_t>(k) &&
             check(cudaMemcpyAsync(dev + off + a, pinned_ + a, k, cudaMemcpyHostToDevice, streams_[t]), "cudaMemcpyAsync");
      }
      ok = check(cudaStreamSynchronize(streams_[t]), "cudaStreamSynchronize") && ok;
      std::lock_guard l(mu_);
      ok_ = ok_ && ok;
      if (--left_ == 0) done_.notify_one();
    }
  }
  static constexpr std::size_t piece = 1 << 20;
  int fd_;
  unsigned char* pinned_;
  std::vector<cudaStream_t> streams_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_, done_;
  std::uint64_t gen_ = 0;
  bool stop_ = false, ok_ = true;
  unsigned char* dev_ = nullptr;
  std::uint64_t off_ = 0;
  std::size_t n_ = 0, left_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: pread_gpu FILE [--chunk BYTES] [--way device|pinned|threads|both|all] [--rounds N] [--make BYTES]\n");
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
  if (way != "device" && way != "pinned" && way != "threads" && way != "both" && way != "all") {
    std::fprintf(stderr, "pread_gpu: --way must be device, pinned, threads, both or all\n");
    return 2;
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
  std::unique_ptr<pool> threads;
  if (way == "threads" || way == "all") threads = std::make_unique<pool>(fd, pinned);
  bool all_ok = true;
  for (int r = 0; r < rounds; ++r) {
    for (const char* w : {"device", "pinned", "threads"}) {
      if (way != w && !(way == "both" && std::string(w) != "threads") && way != "all") continue;
      check(cudaMemset(dev, 0, size), "cudaMemset");
      check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      const auto t0 = std::chrono::steady_clock::now();
      bool ok = true;
      if (std::string(w) == "threads")
        for (std::uint64_t off = 0; ok && off < size; off += chunk) ok = threads->call(dev, off, static_cast<std::size_t>(std::min<std::uint64_t>(chunk, size - off)));
      else
        ok = load(fd, size, chunk, dev, pinned, std::string(w) == "device");
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
      std::printf("round %d %-7s %8.3f s %8.2f GB/s  %s\n", r + 1, w, s, static_cast<double>(size) / s / 1e9,
                  ok ? "equal to the file" : "FAILED");
      std::fflush(stdout);
    }
  }
  threads.reset();
  cudaFree(dev);
  cudaFreeHost(pinned);
  ::close(fd);
  if (make) ::unlink(path);
  return all_ok ? 0 : 1;
}
