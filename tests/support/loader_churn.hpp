#pragma once
// A checkpoint loader into unified memory over its device cap while the model's own code churns the
// space (the offload abort of bench/results/offload): tensors of odd sizes, packed so that they share
// pages, read from a file again and again (into pages prefetched to the device, then to the host)
// while another thread allocates and frees, writes from the CPU, copies from pageable host memory and
// prefetches, so that pages are evicted, populated and remapped around the loader's pinned ones.
// Runs for about `seconds`; every byte read must arrive (gtest assertions). Returns a line to print.
#include <ferry/core/error.hpp>
#include <ferry/io/file_engine.hpp>
#include <ferry/runtime.hpp>
#include <ferry/vm/address_space.hpp>

#include "support/data.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

namespace ferry::test {

// The model's side: allocations of 1 KiB .. 3 pages, each written by the CPU, copied into from
// pageable host memory or prefetched to the device, at most 12 alive; until `stop`.
class model_churn {
 public:
  model_churn(runtime& rt, vm::address_space& as)
      : t_([this, &rt, &as] {
          const std::size_t pg = as.page_bytes();
          std::mt19937_64 rng(37);
          std::vector<void*> live;
          std::vector<std::byte> src(3 * pg);
          fill_random(src.data(), src.size(), 41);
          while (!stop_) {
            try {
              std::size_t n = 1024 + rng() % (3 * pg - 1024);
              void* q = as.alloc(n);
              live.push_back(q);
              switch (rng() % 3) {
                case 0: std::memset(q, 1, n); break;
                case 1: rt.engine().copy(q, src.data(), n); break;
                default: as.advise(q, n, vm::advice::prefetch, memory_kind::device);
              }
              if (live.size() > 12) {
                auto k = static_cast<std::ptrdiff_t>(rng() % live.size());
                as.free(live[static_cast<std::size_t>(k)]);
                live.erase(live.begin() + k);
              }
              allocations_++;
            } catch (const error& e) {
              if (e.code() != errc::out_of_memory) {
                failure_ = e.what();
                break;
              }
              std::this_thread::yield();  // the space is full: the loader's frees make room
            }
          }
          for (void* q : live) as.free(q);
        }) {}
  ~model_churn() { stop(); }
  void stop() {
    stop_ = true;
    if (t_.joinable()) t_.join();
  }
  int allocations() const { return allocations_.load(); }
  const std::string& failure() const { return failure_; }  // after stop()

 private:
  std::atomic<bool> stop_{false};
  std::atomic<int> allocations_{0};
  std::string failure_;
  std::thread t_;  // last: starts after the rest exists
};

// `as` should not hold pages back from the device after an eviction (space_options::thrash_lapse 0):
// the device rounds are meant to read into device pages.
inline std::string loader_under_churn(runtime& rt, vm::address_space& as, int seconds) {
  const std::size_t pg = as.page_bytes();
  // The tensors' data begins after a header, as in a safetensors file: file offsets are not the
  // destinations' offsets modulo a page or 4 KiB.
  constexpr std::size_t header = 4040;
  // Tensors of 4 MiB + 1016 bytes and of 8 KiB in turns, packed in one allocation of 24 pages.
  std::vector<std::pair<std::size_t, std::size_t>> tensors;  // offset, bytes
  for (std::size_t at = 0;;) {
    std::size_t n = tensors.size() % 2 ? 8192 : (std::size_t{4} << 20) + 1016;
    if (at + n > 24 * pg) break;
    tensors.push_back({at, n});
    at += n;
  }
  EXPECT_FALSE(tensors.empty()) << "pages of " << pg << " bytes: too small for this test";
  if (tensors.empty()) return {};
  const std::size_t total = tensors.back().first + tensors.back().second;
  auto path = std::filesystem::path("/tmp") / ("ferry-vm-loader-churn-" + std::to_string(::getpid()) + ".bin");
  std::vector<std::byte> data(header + total), back(total);
  fill_random(data.data(), data.size(), 31);
  write_file(path, data.data(), data.size());
  auto f = file::open(path.string(), open_mode::read);
  auto* p = static_cast<std::byte*>(as.alloc(24 * pg));
  model_churn model(rt, as);
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  int rounds = 0, on_device = 0;
  bool right = true;
  for (; right && (rounds < 2 || std::chrono::steady_clock::now() < until); ++rounds) {
    as.advise(p, 24 * pg, vm::advice::prefetch, rounds % 2 ? memory_kind::host : memory_kind::device);
    if (rounds % 2 == 0 && as.pages().resident(1) > 0) ++on_device;
    std::vector<file_request> reqs;
    for (auto [at, n] : tensors) reqs.push_back({f, header + at, p + at, n, false});
    auto b = rt.files().submit(reqs);
    EXPECT_TRUE(b.wait()) << "round " << rounds;
    b.check();
    rt.engine().copy(back.data(), p, total);
    right = std::memcmp(back.data(), data.data() + header, total) == 0;
    EXPECT_TRUE(right) << "round " << rounds << ": the tensors read differ from the file";
  }
  model.stop();
  EXPECT_EQ(model.failure(), "");
  EXPECT_GT(on_device, 0) << "no device round found pages on the device";
  as.free(p);
  std::filesystem::remove(path);
  return std::to_string(rounds) + " loads of " + std::to_string(tensors.size()) + " tensors (" + std::to_string(on_device) +
         " into pages on the device) while the other thread made " + std::to_string(model.allocations()) +
         " allocations; evictions " + std::to_string(as.stats().evictions);
}

}  // namespace ferry::test
