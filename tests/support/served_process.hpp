#pragma once
// `ferry serve --root ROOT --listen 127.0.0.1:0` in a process of its own, which a test can kill
// (SIGKILL: the server dies as a crashed one does, its connections reset). Its port is read from
// the line it prints once it listens. `listen_port` 0 takes a free port; a given one lets a test start a
// server again where a killed one listened. `env` ("NAME=VALUE") is added to the server's environment,
// replacing the test's own value of each name: `through_the_server` makes a server that lends no file,
// so that a same-host client's reads take the road a client on another host takes.
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace ferry::test {

inline const std::vector<std::string> through_the_server = {"FERRY_SERVE_LEND_FILES=0"};

struct served_process {
  pid_t pid = -1;
  int out = -1;
  bool stopped = false;  // stop() saw it stopped, and no resume() since
  std::uint16_t port = 0;
  served_process(const std::string& ferry, const std::filesystem::path& root, std::uint16_t listen_port = 0,
                 const std::vector<std::string>& extra = {}, const std::vector<std::string>& env = {}) {
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, p[1], 1);
    std::string r = root.string();
    std::vector<std::string> args = {ferry, "serve", "--root", r, "--listen", "127.0.0.1:" + std::to_string(listen_port)};
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<std::string> vars;
    for (char** e = environ; *e; ++e) {
      bool replaced = false;
      for (const auto& v : env) replaced = replaced || std::strncmp(*e, v.c_str(), v.find('=') + 1) == 0;
      if (!replaced) vars.emplace_back(*e);
    }
    vars.insert(vars.end(), env.begin(), env.end());
    std::vector<char*> envp;
    for (auto& v : vars) envp.push_back(v.data());
    envp.push_back(nullptr);
    int rc = ::posix_spawn(&pid, ferry.c_str(), &fa, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&fa);
    ::close(p[1]);
    out = p[0];
    if (rc != 0) {
      pid = -1;
      ::close(out);
      throw std::runtime_error(ferry + ": posix_spawn: " + std::strerror(rc));
    }
    // "ferry serve: ROOT on 127.0.0.1:PORT (...)": the port, once it listens.
    std::string line;
    pollfd pf{out, POLLIN, 0};
    char c = 0;
    while (line.find('\n') == std::string::npos && ::poll(&pf, 1, 20000) == 1 && ::read(out, &c, 1) == 1) line += c;
    auto at = line.find("127.0.0.1:");
    if (at == std::string::npos || at + 10 >= line.size() || line[at + 10] < '0' || line[at + 10] > '9') {
      kill();
      ::close(out);
      throw std::runtime_error("ferry serve did not report its port: " + line);
    }
    port = static_cast<std::uint16_t>(std::stoi(line.substr(at + 10)));
  }
  // Stops the server without ending it (SIGSTOP): its connections stay open, nothing is answered.
  // Returns once every thread of it has stopped (the parent is told, WUNTRACED): on a busy machine
  // a server thread may otherwise still answer what is sent right after the signal.
  void stop() {
    if (pid <= 0 || stopped) return;  // (a stop is reported once)
    ::kill(pid, SIGSTOP);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    int status = 0;
    while (std::chrono::steady_clock::now() < until) {
      const pid_t r = ::waitpid(pid, &status, WUNTRACED | WNOHANG);
      if (r == pid && WIFSTOPPED(status)) {
        stopped = true;
        return;
      }
      if (r == pid) {
        pid = -1;  // reaped: never signalled again
        throw std::runtime_error("ferry serve ended instead of stopping");
      }
      if (r < 0 && errno != EINTR) throw std::runtime_error(std::string("waitpid: ") + std::strerror(errno));
      ::usleep(1000);
    }
    throw std::runtime_error("ferry serve did not stop within 10 s of SIGSTOP");
  }
  // Lets a stopped server go on (SIGCONT).
  void resume() {
    if (pid > 0) ::kill(pid, SIGCONT);
    stopped = false;
  }
  // SIGTERM, then the server's exit: its wait status, or -1 when it had not exited within `t` (then
  // it is killed).
  int terminate(std::chrono::seconds t = std::chrono::seconds(20)) {
    if (pid <= 0) return -1;
    ::kill(pid, SIGTERM);
    const auto until = std::chrono::steady_clock::now() + t;
    int status = 0;
    while (std::chrono::steady_clock::now() < until) {
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        pid = -1;
        return status;
      }
      ::usleep(20000);
    }
    kill();
    return -1;
  }
  // Still running (one that ended is reaped: `ended` has its wait status).
  bool alive() {
    if (pid > 0 && ::waitpid(pid, &ended, WNOHANG) == pid) pid = -1;
    return pid > 0;
  }
  int ended = 0;
  void kill() {
    if (pid <= 0) return;
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    pid = -1;
  }
  ~served_process() {
    kill();
    ::close(out);
  }
  served_process(const served_process&) = delete;
  served_process& operator=(const served_process&) = delete;
};

}  // namespace ferry::test
