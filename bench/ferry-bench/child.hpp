#pragma once
// A child process of a benchmark (a server it measures against), its output captured.
#include <ferry/core/error.hpp>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <map>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace ferry::cli {

// A child process with stdout captured; killed (SIGKILL) when it outlives its deadline or the object.
struct child {
  pid_t pid = -1;
  int out = -1;
  child(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env) {
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0) fail_errno(errno, "bench", "pipe");
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, p[1], 1);
    posix_spawn_file_actions_adddup2(&fa, p[1], 2);
    std::vector<std::string> envs;
    for (char** e = environ; *e; ++e) {
      std::string kv = *e;
      if (!env.count(kv.substr(0, kv.find('=')))) envs.push_back(kv);
    }
    for (auto& [k, v] : env) envs.push_back(k + "=" + v);
    std::vector<char*> a, e;
    for (auto& s : argv) a.push_back(const_cast<char*>(s.c_str()));
    a.push_back(nullptr);
    for (auto& s : envs) e.push_back(const_cast<char*>(s.c_str()));
    e.push_back(nullptr);
    int rc = ::posix_spawnp(&pid, a[0], &fa, nullptr, a.data(), e.data());
    posix_spawn_file_actions_destroy(&fa);
    ::close(p[1]);
    out = p[0];
    if (rc != 0) {
      ::close(out);
      fail_errno(rc, "bench", argv[0], "cannot start");
    }
  }
  ~child() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
    if (out >= 0) ::close(out);
  }
  // Reads output until EOF or `until`; returns what was read.
  std::string read_all(std::chrono::steady_clock::time_point until) {
    std::string s;
    char buf[4096];
    for (;;) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now()).count();
      if (left <= 0) break;
      pollfd pf{out, POLLIN, 0};
      if (::poll(&pf, 1, static_cast<int>(std::min<long long>(left, 1000))) <= 0) continue;
      ssize_t n = ::read(out, buf, sizeof buf);
      if (n <= 0) break;
      s.append(buf, static_cast<std::size_t>(n));
    }
    return s;
  }
  bool ended = false;  // its output reached its end (read_line)
  std::string read_line(std::chrono::steady_clock::time_point until) {
    std::string s;
    char c;
    while (std::chrono::steady_clock::now() < until) {
      pollfd pf{out, POLLIN, 0};
      if (::poll(&pf, 1, 100) <= 0) continue;
      if (::read(out, &c, 1) != 1) {
        ended = true;
        break;
      }
      if (c == '\n') break;
      s += c;
    }
    return s;
  }
  // The first line holding `needle` (a server's listening address), reading past others (log lines
  // such as a warning about the environment); what was read instead when none came by `until`.
  std::string read_line_with(const std::string& needle, std::chrono::steady_clock::time_point until) {
    std::string seen;
    while (!ended && std::chrono::steady_clock::now() < until) {
      std::string line = read_line(until);
      if (line.find(needle) != std::string::npos) return line;
      if (!line.empty()) seen += (seen.empty() ? "" : " | ") + line;
    }
    return seen;
  }
  int wait(std::chrono::steady_clock::time_point until) {
    while (std::chrono::steady_clock::now() < until) {
      int st = 0;
      pid_t r = ::waitpid(pid, &st, WNOHANG);
      if (r == pid) {
        pid = -1;
        return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return -1;
  }
};

}  // namespace ferry::cli
