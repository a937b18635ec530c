#pragma once
// CPU time per thread of a process, grouped by thread name (ferry names its threads: ferry-io,
// ferry-xfer, ferry-ucx, ...): taken before and after a measured pass, it says which threads did the
// work and how busy each kind was -- where a pipeline's bound is. From /proc/PID/task/TID/schedstat
// (time on a CPU, in nanoseconds) and .../comm; a thread that ends between the two looks is missed.
#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

namespace ferry::cli {

// Nanoseconds on a CPU per thread id of process `pid` (0: this one), with each thread's name.
struct thread_times {
  std::map<long, std::pair<std::string, std::uint64_t>> by_tid;

  static thread_times of(pid_t pid = 0) {
    thread_times t;
    const std::filesystem::path dir = pid ? "/proc/" + std::to_string(pid) + "/task" : "/proc/self/task";
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
      long tid = 0;
      try {
        tid = std::stol(e.path().filename().string());
      } catch (...) {
        continue;
      }
      std::ifstream sched(e.path() / "schedstat"), comm(e.path() / "comm");
      std::uint64_t ns = 0;
      std::string name;
      if (!(sched >> ns) || !std::getline(comm, name)) continue;  // (gone meanwhile)
      t.by_tid[tid] = {name, ns};
    }
    return t;
  }

  // Cores busy per thread name between `before` and this sample, over `seconds` (threads seen in
  // both; a name's threads summed), those above `least`.
  std::map<std::string, double> cores_since(const thread_times& before, double seconds, double least = 0.05) const {
    std::map<std::string, double> out;
    for (const auto& [tid, now] : by_tid) {
      auto it = before.by_tid.find(tid);
      if (it == before.by_tid.end() || now.second < it->second.second) continue;
      out[now.first] += static_cast<double>(now.second - it->second.second) / 1e9 / seconds;
    }
    for (auto it = out.begin(); it != out.end();) it = it->second < least ? out.erase(it) : std::next(it);
    return out;
  }
};

}  // namespace ferry::cli
