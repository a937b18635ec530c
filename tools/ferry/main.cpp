// ferry: the command line front end.
#include "commands.hpp"

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdio>
#include <string_view>
#include <vector>

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

  ferry::cli::cp_options cp;
  auto* cp_cmd = app.add_subcommand(
      "cp", "Copy between any two of: memory (host, pinned, gpu:N, sim:N, each +OFFSET), files (file:PATH) and "
            "ferry://host:port/path, verified by checksums");
  cp_cmd->add_option("src", cp.src, "Source endpoint")->required();
  cp_cmd->add_option("dst", cp.dst, "Destination endpoint")->required();
  cp_cmd->add_option("--size", cp.size, "Bytes to copy, e.g. 1GiB (default: the source file's size, else 64MiB)");
  cp_cmd->add_option("--via", cp.via, "Between files and ferry://, the data passes through this memory (host, pinned, gpu:N, sim:N; default host)");
  cp_cmd->add_flag("!--no-verify", cp.verify, "Skip the checksum verification");
  cp_cmd->add_flag("--progress", cp.progress, "Show a progress bar (default: on a terminal, for >= 256 MiB)");

  // The benchmarks live in their own program; an old `ferry bench ...` line gets pointed there.
  auto* bench_cmd = app.add_subcommand("bench", "Moved: benchmarks are the ferry-bench program")->group("");
  bench_cmd->set_help_flag();
  bench_cmd->allow_extras()->prefix_command();

  ferry::cli::serve_options serve;
  auto* serve_cmd = app.add_subcommand("serve", "Serve the files under a directory over UCX (ferry://host:port/path)");
  serve_cmd->add_option("--root", serve.root, "Directory to export")->required();
  serve_cmd->add_option("--listen", serve.listen, "HOST:PORT to listen on (port 0: any)")->capture_default_str();
  serve_cmd->add_option("--secret-file", serve.secret_file, "Require clients to prove they know this shared secret");
  serve_cmd->add_flag("--writable", serve.writable, "Allow writes (needs --secret-file, or --insecure)");
  serve_cmd->add_flag("--insecure", serve.insecure, "Allow --writable without a shared secret (anyone who can connect may write)");
  std::string ls_uri, stat_uri;
  auto* ls_cmd = app.add_subcommand("ls", "List a remote directory: ferry ls ferry://host:port/dir");
  ls_cmd->add_option("uri", ls_uri, "ferry://host:port/path")->required();
  auto* stat_cmd = app.add_subcommand("stat", "Size and mode of a remote file");
  stat_cmd->add_option("uri", stat_uri, "ferry://host:port/path")->required();

  ferry::cli::job_options job;
  auto* job_cmd = app.add_subcommand("job", "The end-to-end job: dataset -> ferry serve -> ferry:// -> device memory, verified");
  job_cmd->add_option("--device", job.device, "Device (default: a GPU if present, else sim:0)");
  job_cmd->add_option("--files", job.files, "Number of files")->capture_default_str();
  job_cmd->add_option("--size", job.size, "Size of each file")->capture_default_str();

  // `ferry run` takes everything after it as the program's command line (handled before parsing,
  // so that the program's own options and a `--` reach it as they are); listed here for --help.
  auto* run_cmd = app.add_subcommand("run", "Run an unmodified program with its reads and writes of GPU memory through ferry: "
                                                  "ferry run -- PROGRAM [ARGS...]");
  run_cmd->allow_extras();
  if (argc >= 2 && std::string_view(argv[1]) == "run") {
    std::vector<std::string> args(argv + 2, argv + argc);
    if (args.empty() || args[0] == "-h" || args[0] == "--help") {
      std::printf("%s\nUsage: ferry run [--] PROGRAM [ARGS...]\n", run_cmd->get_description().c_str());
      return args.empty() ? 2 : 0;
    }
    try {
      return ferry::cli::run_program(std::move(args));
    } catch (const ferry::error& e) {
      std::fprintf(stderr, "ferry: error: %s\n", e.what());
      return 1;
    }
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (*bench_cmd) {
    std::fprintf(stderr, "ferry: the benchmarks moved out of the ferry command into the ferry-bench program "
                         "(installed beside it): run `ferry-bench local|file|remote|vm ...` with the same options\n");
    return 2;
  }
  try {
    ferry::runtime rt;
    if (*info_cmd) return ferry::cli::run_info(rt, info);
    if (*demo_cmd) return ferry::cli::run_demo(rt, demo);
    if (*cp_cmd) return ferry::cli::run_cp(rt, cp);
    if (*serve_cmd) return ferry::cli::run_serve(rt, serve);
    if (*job_cmd) return ferry::cli::run_job(rt, job);
    if (*ls_cmd) return ferry::cli::run_ls(rt, ls_uri, false);
    if (*stat_cmd) return ferry::cli::run_ls(rt, stat_uri, true);
  } catch (const ferry::error& e) {
    std::fprintf(stderr, "ferry: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ferry: internal error: %s\n", e.what());
    return 70;
  }
  return 0;
}
