// `ferry run -- PROGRAM [ARGS...]`: runs an unmodified program with libferry_preload.so in its
// LD_PRELOAD (tools/preload/preload.cpp): its reads and writes of GPU memory go through ferry.
#include "commands.hpp"

#include <ferry/core/error.hpp>

#include <dlfcn.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

namespace ferry::cli {

std::string preload_library() {
  // Beside libferry, wherever it was loaded from (the build tree, an installation, a wheel).
  Dl_info di{};
  if (!::dladdr(reinterpret_cast<void*>(&ferry::version), &di) || !di.dli_fname)
    fail(errc::not_found, "ferry run", "libferry", "cannot tell where libferry was loaded from");
  std::error_code ec;
  auto dir = std::filesystem::weakly_canonical(std::filesystem::path(di.dli_fname).parent_path(), ec);
  if (ec) dir = std::filesystem::path(di.dli_fname).parent_path();
  const auto path = dir / "libferry_preload.so";
  if (::access(path.c_str(), R_OK) != 0)
    fail_errno(errno, "ferry run", path.string(), "libferry_preload.so must be installed beside libferry");
  return path.string();
}

int run_program(std::vector<std::string> args) {
  if (!args.empty() && args.front() == "--") args.erase(args.begin());
  if (args.empty()) fail(errc::invalid_argument, "ferry run", "command", "expected: ferry run -- PROGRAM [ARGS...]");
  std::string preload = preload_library();
  if (const char* old = std::getenv("LD_PRELOAD"); old && *old) preload += std::string(":") + old;
  ::setenv("LD_PRELOAD", preload.c_str(), 1);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  // As a shell reports it: 127 when there is no such program, 126 when it cannot be run.
  const int e = errno;
  std::fprintf(stderr, "ferry: error: ferry run %s: %s\n", args[0].c_str(), describe_errno(e).c_str());
  return e == ENOENT ? 127 : 126;
}

}  // namespace ferry::cli
