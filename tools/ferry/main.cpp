// ferry: the command line front end.
#include "commands.hpp"

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdio>

int main(int argc, char** argv) {
  CLI::App app{"ferry: direct data paths between GPU memory, host memory, files and remote storage"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("ferry ") + ferry::version());

  ferry::cli::info_options info;
  auto* info_cmd = app.add_subcommand("info", "Show GPUs, peers, host topology, UCX, io_uring, cuFile, userfaultfd");
  info_cmd->add_flag("--json", info.json, "Print JSON instead of a table");
  info_cmd->add_flag("--settings", info.settings, "Also print every FERRY_* setting with its value, default and meaning");
  info_cmd->add_option("--path", info.path, "Check whether cuFile can register a file at this path (file or directory)");

  ferry::cli::demo_options demo;
  auto* demo_cmd = app.add_subcommand("demo", "Short tour of the device interface (sim device unless --device names a GPU)");
  demo_cmd->add_option("--device", demo.device, "Device to use: sim:N, gpu:N (default: FERRY_BACKEND's choice)");
  demo_cmd->add_option("--size", demo.size, "Bytes to move, e.g. 64MiB")->capture_default_str();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    ferry::runtime rt;
    if (*info_cmd) return ferry::cli::run_info(rt, info);
    if (*demo_cmd) return ferry::cli::run_demo(rt, demo);
  } catch (const ferry::error& e) {
    std::fprintf(stderr, "ferry: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ferry: internal error: %s\n", e.what());
    return 70;
  }
  return 0;
}
