#include "store/landing.hpp"

#include <ferry/core/error.hpp>

#include "core/logging.hpp"

#include <fmt/format.h>

#include <algorithm>

namespace ferry::store::detail {

landing_region::landing_region(std::uint64_t slot_bytes, int slots, int records, std::uint64_t small_bytes, int small_slots,
                               std::uint64_t group_bytes, int group_slots)
    : slot_bytes_(slot_bytes),
      small_bytes_(small_bytes),
      group_bytes_(group_bytes),
      slots_(slots),
      small_slots_(small_bytes ? small_slots : 0),
      group_slots_(group_bytes ? group_slots : 0),
      records_n_(records) {
  std::size_t slot_area = static_cast<std::size_t>(slots) * slot_bytes + static_cast<std::size_t>(small_slots_) * small_bytes +
                          static_cast<std::size_t>(group_slots_) * group_bytes;
  std::size_t record_area = (static_cast<std::size_t>(records) * 64 + 4095) & ~std::size_t{4095};
  mem_ = std::make_unique<shared_region>(slot_area + record_area);
  records_ = mem_->data() + slot_area;
  for (int i = slots - 1; i >= 0; --i) free_slots_.push_back(i);
  for (int i = slots + small_slots_ - 1; i >= slots; --i) free_small_.push_back(i);
  for (int i = slots + small_slots_ + group_slots_ - 1; i >= slots + small_slots_; --i) free_group_.push_back(i);
  for (int i = records - 1; i >= 0; --i) free_records_.push_back(i);
}

int landing_region::take_slot(std::uint64_t bytes, lending_clock::time_point until, const std::string& peer) {
  if (bytes > slot_bytes_) fail(errc::internal, "store.request", peer, fmt::format("{} bytes for a landing slot of {}", bytes, slot_bytes_));
  const bool small = small_slots_ && bytes <= small_bytes_;
  auto& from = small ? free_small_ : free_slots_;
  std::unique_lock l(mu_);
  if (!cv_.wait_until(l, until, [&] { return !from.empty() || spent(); }))
    fail(errc::timeout, "store.request", peer, "no free landing slot before the deadline");
  if (spent()) return -1;
  int s = from.back();
  from.pop_back();
  return s;
}

int landing_region::try_take_slot(std::uint64_t bytes) {
  const bool small = small_slots_ && bytes <= small_bytes_;
  if (!small && bytes > slot_bytes_) return -1;
  auto& from = small ? free_small_ : free_slots_;
  std::lock_guard l(mu_);
  if (from.empty() || spent()) return -1;
  int s = from.back();
  from.pop_back();
  return s;
}

int landing_region::try_take_group_slot(std::uint64_t bytes) {
  if (!group_slots_ || bytes > group_bytes_) return -1;
  std::lock_guard l(mu_);
  if (free_group_.empty() || spent()) return -1;
  int s = free_group_.back();
  free_group_.pop_back();
  return s;
}

int landing_region::in_use() const {
  std::lock_guard l(mu_);
  return slots_ + small_slots_ + group_slots_ - static_cast<int>(free_slots_.size() + free_small_.size() + free_group_.size()) -
         static_cast<int>(quarantined_slots_.load(std::memory_order_relaxed) + quarantined_small_.load(std::memory_order_relaxed) +
                          quarantined_group_.load(std::memory_order_relaxed)) +
         records_n_ - static_cast<int>(free_records_.size()) - static_cast<int>(quarantined_records_.load(std::memory_order_relaxed));
}

int landing_region::try_take_record() {
  std::lock_guard l(mu_);
  if (free_records_.empty() || spent()) return -1;
  int r = free_records_.back();
  free_records_.pop_back();
  return r;
}

void landing_region::give_back(std::vector<int>& to, int i, bool answered, std::atomic<std::uint64_t>& quarantined) {
  {
    std::lock_guard l(mu_);
    if (answered) to.push_back(i);
    else quarantined.fetch_add(1, std::memory_order_relaxed);
  }
  // Slot waiters (records are never waited for): a slot is free, or the region may be spent now. All
  // of them: a slot of one size serves only the waiters for that size, and one woken alone might be
  // waiting for the other.
  cv_.notify_all();
}

const memory_region* landing_region::pinned(registration_cache& cache, const std::string& peer) {
  std::lock_guard l(pin_mu_);
  if (!pin_tried_) {
    pin_tried_ = true;
    try {
      pin_ = cache.acquire(mem_->data(), mem_->size());
      pinned_region_.store(&pin_.region(), std::memory_order_release);
    } catch (const error& e) {
      log::warn("store", "{}: cannot pin the landing region ({}); GPU copies from it are slower", peer, e.what());
    }
  }
  return pinned_region_.load(std::memory_order_acquire);
}

lent_buffers::buffer& lent_buffers::make(std::size_t bytes) {
  auto b = std::make_unique<buffer>();
  // Resident from the start, as a pinned or registered buffer is: otherwise its pages are made by
  // the server's first writes into it, one fault per page under one lock of the memfd, which cost
  // the first reads into a fresh buffer a large part of their speed.
  b->r = std::make_unique<shared_region>(bytes, true);
  std::lock_guard l(mu_);
  return *all_.emplace_back(std::move(b));
}

void lent_buffers::publish(buffer& b) {
  std::lock_guard l(mu_);
  live_.push_back(&b);
  republish();
}

lent_buffers::buffer* lent_buffers::withdraw(const void* p) {
  std::lock_guard l(mu_);
  auto it = std::find_if(live_.begin(), live_.end(), [&](buffer* b) { return b->r->data() == p; });
  if (it == live_.end()) return nullptr;
  buffer* b = *it;
  live_.erase(it);
  republish();
  return b;
}

void lent_buffers::republish() {
  auto t = std::make_unique<std::vector<span>>();
  for (buffer* b : live_) t->push_back({b->r->data(), b->r->size(), b});
  spans_.store(t.get(), std::memory_order_release);
  tables_.push_back(std::move(t));
  live_count_.store(live_.size(), std::memory_order_relaxed);
}

bool lent_buffers::covers(const std::byte* p, std::uint64_t n, std::uint64_t all) const {
  if (n == 0 || !any()) return false;
  const auto* t = spans_.load(std::memory_order_acquire);
  if (!t) return false;
  for (auto& s : *t)
    if (p >= s.base && n <= s.size && static_cast<std::uint64_t>(p - s.base) <= s.size - n)
      return s.b->lanes.load(std::memory_order_acquire) == all;
  return false;
}

std::vector<lent_buffers::buffer*> lent_buffers::live() const {
  std::lock_guard l(mu_);
  return live_;
}

void lent_buffers::lane_lost(int lane) {
  std::lock_guard l(mu_);
  for (buffer* b : live_) b->lanes.fetch_and(~(std::uint64_t{1} << lane));
}

}  // namespace ferry::store::detail
