#pragma once
// One device's resident pages in replacement order (vm layer, its own sources only): the front is
// kept, the back evicted first. LRU moves a touched page to the front; FIFO keeps arrival order.
#include <cstdint>
#include <list>
#include <mutex>
#include <vector>

namespace ferry::vm {

class replacement_order {
 public:
  // For pages 0 .. pages - 1; `lru`: a touch moves a page to the front.
  replacement_order(std::uint64_t pages, bool lru) : where_(pages), in_(pages, false), lru_(lru) {}

  // Page p arrived (at the front); nothing when it is already in.
  void insert(std::uint64_t p) {
    std::lock_guard l(mu_);
    if (in_[p]) return;
    l_.push_front(p);
    where_[p] = l_.begin();
    in_[p] = true;
  }
  // Page p was used.
  void touch(std::uint64_t p) {
    if (!lru_) return;
    std::lock_guard l(mu_);
    if (!in_[p]) return;
    l_.splice(l_.begin(), l_, where_[p]);
  }
  // Page p left.
  void remove(std::uint64_t p) {
    std::lock_guard l(mu_);
    if (!in_[p]) return;
    l_.erase(where_[p]);
    in_[p] = false;
  }
  // Calls f(first, last): the pages from the coldest to the warmest, while the order stays as it is.
  template <typename F>
  void coldest(F&& f) {
    std::lock_guard l(mu_);
    f(l_.crbegin(), l_.crend());
  }

 private:
  std::mutex mu_;
  std::list<std::uint64_t> l_;
  std::vector<std::list<std::uint64_t>::iterator> where_;
  std::vector<bool> in_;
  bool lru_;
};

}  // namespace ferry::vm
