#pragma once
// What a probe found out about one feature of this machine, for `ferry info` and for the layers
// that choose a path at run time. Probes never throw for a missing feature: they say why.
#include <string>
#include <utility>
#include <vector>

namespace ferry {

struct capability {
  std::string name;       // "io_uring", "cufile", "ucx", "userfaultfd", "hwloc"
  bool available = false;
  std::string reason;     // why not (or a caveat), in words
  std::vector<std::pair<std::string, std::string>> facts;  // ordered key/value details
  void add(std::string k, std::string v) { facts.emplace_back(std::move(k), std::move(v)); }
};

}  // namespace ferry
