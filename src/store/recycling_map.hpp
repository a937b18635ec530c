#pragma once
// A std::map whose nodes are kept for reuse (store layer, its own sources only).
#include <map>
#include <utility>
#include <vector>

namespace ferry::store::detail {

// A map whose nodes are recycled: the ferry:// client inserts and erases an entry for every request
// (its pieces by request id), and the allocator round trips would cost more than the entries'
// bookkeeping. At most 64 nodes are kept.
template <typename K, typename V>
struct recycling_map {
  std::map<K, V> m;
  std::vector<typename std::map<K, V>::node_type> spare;
  void put(K k, V v) {
    if (spare.empty()) {
      m.insert_or_assign(k, std::move(v));
      return;
    }
    auto nh = std::move(spare.back());
    spare.pop_back();
    nh.key() = k;
    nh.mapped() = std::move(v);
    auto r = m.insert(std::move(nh));
    if (!r.inserted) r.position->second = std::move(r.node.mapped());
  }
  void erase(typename std::map<K, V>::iterator it) {
    auto nh = m.extract(it);
    nh.mapped() = V{};
    if (spare.size() < 64) spare.push_back(std::move(nh));
  }
  void erase(const K& k) {
    auto it = m.find(k);
    if (it != m.end()) erase(it);
  }
  // Removes k's entry and returns its value (moved out), or a default value.
  V take(const K& k) {
    auto it = m.find(k);
    if (it == m.end()) return V{};
    V v = std::move(it->second);
    erase(it);
    return v;
  }
  auto find(const K& k) { return m.find(k); }
  auto begin() { return m.begin(); }
  auto end() { return m.end(); }
  void clear() {
    m.clear();
    spare.clear();
  }
};

}  // namespace ferry::store::detail
