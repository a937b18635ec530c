// The client's landing region: shared memory (a sealed memfd) lent to a same-host server, cut into
// slots of one piece where reads land and writes are staged, small slots for small pieces (a 4 KiB
// read holding a slot of a whole piece left a few slots for many small reads in flight, and they
// queued for them), group slots for the answers of small reads sent as one request (in a piece's slot
// each, few could be under way), plus notify records that a server
// answering a small read at once writes after the data (the waiting caller polls its record instead
// of taking the completion off the queue). A slot or record is given back once the server answered
// for it; one whose request was abandoned while the server might still write is never reused
// (quarantined), so a late write can only land where nobody looks. A region that lost half its slots
// that way is spent: the client lends a fresh one in its place (a server killed under a large read
// takes every slot in flight with it, and none would ever come back).
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
  // `slots` slots of `slot_bytes`, `small_slots` of `small_bytes`, `group_slots` of `group_bytes` and
  // `records` notify records. Throws when no shared memory can be made.
  landing_region(std::uint64_t slot_bytes, int slots, int records, std::uint64_t small_bytes = 0, int small_slots = 0,
                 std::uint64_t group_bytes = 0, int group_slots = 0);

  const shared_region& region() const { return *mem_; }
  // Slots 0 .. slots-1 are of a piece, then the small ones, then those for answers of reads in one
  // request (groups).
  std::byte* slot(int i) const {
    const std::size_t pieces = static_cast<std::size_t>(slots_) * slot_bytes_, smalls = static_cast<std::size_t>(small_slots_) * small_bytes_;
    if (i < slots_) return mem_->data() + static_cast<std::size_t>(i) * slot_bytes_;
    if (i < slots_ + small_slots_) return mem_->data() + pieces + static_cast<std::size_t>(i - slots_) * small_bytes_;
    return mem_->data() + pieces + smalls + static_cast<std::size_t>(i - slots_ - small_slots_) * group_bytes_;
  }
  const std::uint64_t* record(int i) const { return reinterpret_cast<const std::uint64_t*>(records_ + 64 * static_cast<std::size_t>(i)); }

  // A free slot for `bytes` (at most a piece), waiting for one until `until` (then a timeout naming
  // `peer`); -1 once the region is spent (at once, or while waiting): the caller replaces it. A piece
  // that fits a small slot takes one of those only (many small reads never hold the large slots a
  // large read waits for).
  int take_slot(std::uint64_t bytes, lending_clock::time_point until, const std::string& peer);
  // A free slot that holds `bytes`, at once, or -1 (none free, more bytes than a slot holds, or the
  // region spent): for a caller that has another way to go rather than wait.
  int try_take_slot(std::uint64_t bytes);
  // A free group slot that holds `bytes`, at once, or -1 (none, or more bytes than one holds).
  int try_take_group_slot(std::uint64_t bytes);
  // The bytes the smallest slot and the largest hold.
  std::uint64_t smallest_slot() const { return small_slots_ ? small_bytes_ : slot_bytes_; }
  std::uint64_t largest_slot() const { return slot_bytes_; }
  // Slots and records taken and not given back (in flight, or held by a request about to send).
  int in_use() const;
  // Half the slots of any size or more are quarantined.
  bool spent() const {
    return 2 * quarantined_slots_.load(std::memory_order_relaxed) >= static_cast<std::uint64_t>(slots_) ||
           (small_slots_ && 2 * quarantined_small_.load(std::memory_order_relaxed) >= static_cast<std::uint64_t>(small_slots_)) ||
           (group_slots_ && 2 * quarantined_group_.load(std::memory_order_relaxed) >= static_cast<std::uint64_t>(group_slots_));
  }
  // A free notify record at once, or -1 (the read then waits for its completion message); none from
  // a spent region.
  int try_take_record();
  // `answered`: the server answered for it, so it may be used again; else it is quarantined.
  void give_back_slot(int i, bool answered) {
    if (i < slots_) give_back(free_slots_, i, answered, quarantined_slots_);
    else if (i < slots_ + small_slots_) give_back(free_small_, i, answered, quarantined_small_);
    else give_back(free_group_, i, answered, quarantined_group_);
  }
  void give_back_record(int i, bool answered) { give_back(free_records_, i, answered, quarantined_records_); }
  // Slots and records quarantined.
  std::uint64_t quarantined() const {
    return quarantined_slots_.load(std::memory_order_relaxed) + quarantined_small_.load(std::memory_order_relaxed) +
           quarantined_group_.load(std::memory_order_relaxed) + quarantined_records_.load(std::memory_order_relaxed);
  }

  // The region as pinned for DMA (GPU copies to and from slots), pinned on the first call through
  // `cache`; null when it cannot be pinned (the engine then classifies and bounces).
  const memory_region* pinned(registration_cache& cache, const std::string& peer);
  // The pinned region if pinned already, else null. Lock-free.
  const memory_region* pinned() const { return pinned_region_.load(std::memory_order_acquire); }

 private:
  std::uint64_t slot_bytes_, small_bytes_, group_bytes_;
  int slots_, small_slots_, group_slots_, records_n_;
  std::unique_ptr<shared_region> mem_;
  std::byte* records_ = nullptr;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  void give_back(std::vector<int>& to, int i, bool answered, std::atomic<std::uint64_t>& quarantined);
  std::vector<int> free_slots_, free_small_, free_group_, free_records_;  // mu_; the most recently freed last (likeliest still cached)
  std::atomic<std::uint64_t> quarantined_slots_{0}, quarantined_small_{0}, quarantined_group_{0}, quarantined_records_{0};
  std::mutex pin_mu_;
  bool pin_tried_ = false;  // pin_mu_
  registration pin_;
  std::atomic<const memory_region*> pinned_region_{nullptr};
};

// Buffers the caller allocated from the client (client::allocate): shared memory lent to every
// lane's server like the landing region, so requests on them move no data and make no copy on the
// client. Which lanes' servers mapped each one is a bit per lane. Requests look buffers up without a
// lock: the live buffers' spans are republished on every change (never changed in place); old
// tables and freed entries stay until the client goes, so a request racing a free reads valid memory.
class lent_buffers {
 public:
  struct buffer {
    std::unique_ptr<shared_region> r;  // null once freed
    std::atomic<std::uint64_t> lanes{0};
  };
  // Makes a buffer of `bytes`, not yet lent to any lane.
  buffer& make(std::size_t bytes);
  // Makes `b` visible to requests.
  void publish(buffer& b);
  // Takes the buffer at `p` out of the live set; null if there is none. Its memory stays until retire().
  buffer* withdraw(const void* p);
  void retire(buffer& b) { b.r.reset(); }
  // Whether [p, p+n) lies in a live buffer whose lanes are exactly `all`. Lock-free.
  bool covers(const std::byte* p, std::uint64_t n, std::uint64_t all) const;
  std::vector<buffer*> live() const;
  bool any() const { return live_count_.load(std::memory_order_relaxed) != 0; }
  // A lane's server is gone: no buffer is mapped there any more.
  void lane_lost(int lane);

 private:
  struct span {
    const std::byte* base;
    std::uint64_t size;
    const buffer* b;
  };
  void republish();  // mu_ held
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<buffer>> all_;  // every buffer ever made
  std::vector<buffer*> live_;
  std::atomic<std::size_t> live_count_{0};
  std::atomic<const std::vector<span>*> spans_{nullptr};
  std::vector<std::unique_ptr<const std::vector<span>>> tables_;
};

}  // namespace ferry::store::detail
