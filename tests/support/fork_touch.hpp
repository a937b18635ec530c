#pragma once
// A forked child that reads then writes one byte at `p`, the way a user's child process would touch
// memory it inherited. Returns how the child ended (waitpid status; -1 if it hung and was killed
// after `wait`) and what it wrote to stderr.
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstddef>
#include <string>
#include <thread>

namespace ferry::test {

struct child_end {
  int status = -1;
  std::string said;
};

inline child_end fork_touch(std::byte* p, std::chrono::milliseconds wait = std::chrono::seconds(5)) {
  int err[2];
  if (::pipe(err) != 0) return {};
  pid_t child = ::fork();
  if (child == 0) {
    ::dup2(err[1], 2);
    volatile std::byte b = p[7];
    (void)b;
    p[0] = std::byte{0x5a};
    ::_exit(0);
  }
  ::close(err[1]);
  child_end out;
  int status = 0;
  pid_t got = 0;
  auto until = std::chrono::steady_clock::now() + wait;
  while ((got = ::waitpid(child, &status, WNOHANG)) == 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  if (got == 0) {
    ::kill(child, SIGKILL);
    ::waitpid(child, &status, 0);
  } else {
    out.status = status;
  }
  out.said.resize(4096);
  out.said.resize(static_cast<std::size_t>(std::max<ssize_t>(0, ::read(err[0], out.said.data(), out.said.size()))));
  ::close(err[0]);
  return out;
}

}  // namespace ferry::test
