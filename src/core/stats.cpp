#include <ferry/core/stats.hpp>

namespace ferry {

counter& stats::get(std::string_view name) {
  std::lock_guard lock(mu_);
  for (auto& [n, c] : counters_)
    if (n == name) return c;
  return counters_.emplace_back(std::piecewise_construct, std::forward_as_tuple(name), std::forward_as_tuple()).second;
}

std::vector<std::pair<std::string, std::uint64_t>> stats::snapshot() const {
  std::lock_guard lock(mu_);
  std::vector<std::pair<std::string, std::uint64_t>> out;
  for (auto& [n, c] : counters_) out.emplace_back(n, c.value());
  return out;
}

}  // namespace ferry
