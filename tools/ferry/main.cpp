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

  ferry::cli::cp_options cp;
  auto* cp_cmd = app.add_subcommand(
      "cp", "Copy between files (file:PATH) and memory (host, pinned, gpu:N, sim:N, each +OFFSET), verified by checksums");
  cp_cmd->add_option("src", cp.src, "Source endpoint")->required();
  cp_cmd->add_option("dst", cp.dst, "Destination endpoint")->required();
  cp_cmd->add_option("--size", cp.size, "Bytes to copy, e.g. 1GiB (default: the source file's size, else 64MiB)");
  cp_cmd->add_option("--via", cp.via, "file -> file through this endpoint (host or gpu:N; default host)");
  cp_cmd->add_flag("!--no-verify", cp.verify, "Skip the checksum verification");
  cp_cmd->add_flag("--progress", cp.progress, "Show a progress bar (default: on a terminal, for >= 256 MiB)");

  ferry::cli::bench_options bench;
  auto* bench_cmd = app.add_subcommand("bench", "Benchmarks against the baselines measured in the same run");
  bench_cmd->require_subcommand(1);
  auto* bench_local = bench_cmd->add_subcommand("local", "Host<->GPU, GPU<->GPU: ferry vs cudaMemcpy / cudaMemcpyPeer");
  bench_local->add_option("--device", bench.device, "Device (default: FERRY_BACKEND's choice)");
  bench_local->add_option("--peer", bench.peer, "Second GPU for GPU->GPU (default: another GPU if present)");
  bench_local->add_option("--sizes", bench.sizes, "Comma-separated sizes")->capture_default_str();
  bench_local->add_option("--budget", bench.budget, "Bytes per trial (iterations = budget / size)")->capture_default_str();
  bench_local->add_option("--trials", bench.trials, "Trials per measurement (best is kept)")->capture_default_str();
  bench_local->add_flag("--json", bench.json, "Print JSON");
  bench_local->add_option("--json-out", bench.json_out, "Also write the JSON to this file");

  ferry::cli::bench_file_options bfile;
  auto* bench_file = bench_cmd->add_subcommand("file", "File -> GPU: ferry vs the disk's ceiling, naive pread+cudaMemcpy, torch");
  bench_file->add_option("--path", bfile.path, "Directory (or file path) for the test file")->required();
  bench_file->add_option("--size", bfile.size, "Test file size")->capture_default_str();
  bench_file->add_option("--device", bfile.device, "Device (default: FERRY_BACKEND's choice)");
  bench_file->add_option("--compare-script", bfile.compare_script, "Script loading the same file the way users do");
  bench_file->add_option("--json-out", bfile.json_out, "Write the results as JSON here");
  bench_file->add_flag("--keep", bfile.keep, "Keep the test file");

  ferry::cli::bench_remote_options bremote;
  auto* bench_remote = bench_cmd->add_subcommand("remote", "ferry:// read/write (host, GPU) vs raw UCX put/get/AM/tag (ucx_perftest), tcp and shm");
  bench_remote->add_option("--transports", bremote.transports, "Comma-separated: tcp, shm")->capture_default_str();
  bench_remote->add_option("--sizes", bremote.sizes, "Block sizes")->capture_default_str();
  bench_remote->add_option("--qd", bremote.qds, "Queue depths")->capture_default_str();
  bench_remote->add_option("--ops", bremote.ops, "Comma-separated: read, write")->capture_default_str();
  bench_remote->add_option("--budget", bremote.budget, "Bytes per measurement")->capture_default_str();
  bench_remote->add_option("--file-size", bremote.file_size, "Size of the served file")->capture_default_str();
  bench_remote->add_option("--device", bremote.device, "Device memory to read into (default: the first GPU, if any)");
  bench_remote->add_option("--dir", bremote.dir, "Directory for the served file (default: temp directory)");
  bench_remote->add_option("--perftest", bremote.perftest, "ucx_perftest binary (the raw baseline)")->capture_default_str();
  bench_remote->add_option("--json-out", bremote.json_out, "Write the results as JSON here");

  ferry::cli::bench_vm_options bvm;
  auto* bench_vm = bench_cmd->add_subcommand("vm", "Unified memory: ferry's address space vs CUDA managed memory (UVM)");
  bench_vm->add_option("--size", bvm.size, "Data per test")->capture_default_str();
  bench_vm->add_option("--cap", bvm.cap, "Device cap of the oversubscription test (default: size / 2)");
  bench_vm->add_option("--device", bvm.device, "Device (default: FERRY_BACKEND's choice)");
  bench_vm->add_option("--rounds", bvm.rounds, "Rounds per test (the median is reported)")->capture_default_str();
  bench_vm->add_option("--json-out", bvm.json_out, "Write the results as JSON here");

  ferry::cli::serve_options serve;
  auto* serve_cmd = app.add_subcommand("serve", "Serve the files under a directory over UCX (ferry://host:port/path)");
  serve_cmd->add_option("--root", serve.root, "Directory to export")->required();
  serve_cmd->add_option("--listen", serve.listen, "HOST:PORT to listen on (port 0: any); with FERRY_SERVE_WORKERS=N the next N-1 ports are used too")->capture_default_str();
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

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    ferry::runtime rt;
    if (*info_cmd) return ferry::cli::run_info(rt, info);
    if (*demo_cmd) return ferry::cli::run_demo(rt, demo);
    if (*cp_cmd) return ferry::cli::run_cp(rt, cp);
    if (*bench_local) return ferry::cli::run_bench_local(rt, bench);
    if (*bench_file) return ferry::cli::run_bench_file(rt, bfile);
    if (*bench_remote) return ferry::cli::run_bench_remote(rt, bremote);
    if (*bench_vm) return ferry::cli::run_bench_vm(rt, bvm);
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
