#pragma once
// Sub-commands of the `ferry` CLI. Each returns the process exit code.
#include <ferry/runtime.hpp>

#include <string>

namespace ferry::cli {

struct info_options {
  bool json = false;
  bool settings = false;
  std::string path;  // probe cuFile handle registration here
};
int run_info(runtime& rt, const info_options& o);

struct demo_options {
  std::string device;           // empty: the default device
  std::string size = "64MiB";
};
int run_demo(runtime& rt, const demo_options& o);

}  // namespace ferry::cli
