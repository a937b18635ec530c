// The client's landing region: shared memory (a sealed memfd) lent to a same-host server, cut into
// slots of one piece where reads land and writes are staged, plus notify records that a server
// answering a small read at once writes after the data (the waiting caller polls its record instead
// of taking the completion off the queue). A slot or record is given back once the server answered
// for it; one whose request was abandoned while the server might still write is never reused
// (quarantined), so a late write can only land where nobody looks.
#pragma once

#include <ferry/mem/registration.hpp>

#include "store/lending.hpp"

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace ferry::store::detail {

class landing_region {
 public:
  // `slots` slots of `slot_bytes` and `records` notify records. Throws when no shared memory can be made.
  landing_region(std::uint64_t slot_bytes, int slots, int records);

  const shared_region& region() const { return *mem_; }
  std::byte* slot(int i) const { return mem_->data() + static_cast<std::size_t>(i) * slot_bytes_; }
  const std::uint64_t* record(int i) const { return reinterpret_cast<const std::uint64_t*>(records_ + 64 * static_cast<std::size_t>(i)); }

  // A free slot, waiting for one until `until` (then a timeout naming `peer`).
  int take_slot(lending_clock::time_point until, const std::string& peer);
  // A free notify record at once, or -1 (the read then waits for its completion message).
  int try_take_record();
  // `answered`: the server answered for it, so it may be used again; else it is quarantined.
  void give_back_slot(int i, bool answered);
  void give_back_record(int i, bool answered);
  std::uint64_t quarantined() const { return quarantined_.load(std::memory_order_relaxed); }

  // The region as pinned for DMA (GPU copies to and from slots), pinned on the first call through
  // `cache`; null when it cannot be pinned (the engine then classifies and bounces).
  const memory_region* pinned(registration_cache& cache, const std::string& peer);
  // The pinned region if pinned already, else null. Lock-free.
  const memory_region* pinned() const { return pinned_region_.load(std::memory_order_acquire); }

 private:
  std::uint64_t slot_bytes_;
  std::unique_ptr<shared_region> mem_;
  std::byte* records_ = nullptr;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int> free_slots_, free_records_;  // mu_; the most recently freed last (likeliest still cached)
  std::atomic<std::uint64_t> quarantined_{0};
  std::mutex pin_mu_;
  bool pin_tried_ = false;  // pin_mu_
  registration pin_;
  std::atomic<const memory_region*> pinned_region_{nullptr};
};

}  // namespace ferry::store::detail
