// ferry-bench: end-to-end benchmarks of ferry against baselines measured in the same run, with the
// project's pass/fail targets. Kept out of the user CLI (`ferry`); shares its endpoints and server.
#include "bench.hpp"

#include "commands.hpp"

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdio>

namespace ferry::cli {

std::string changed_settings(const settings& s) {
  std::string out;
  for (auto& r : s.describe())
    if (r.value != r.default_value) out += fmt::format(" {}={}", r.name, r.value);
  return out.empty() ? "ferry settings: all defaults" : "ferry settings not at their defaults:" + out;
}

}  // namespace ferry::cli

int main(int argc, char** argv) {
  CLI::App app{"ferry-bench: ferry next to the baselines measured in the same run (host, GPU, files, ferry://, unified memory)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("ferry-bench ") + ferry::version());

  ferry::cli::bench_options bench;
  auto* bench_local = app.add_subcommand("local", "Host<->GPU, GPU<->GPU: ferry vs cudaMemcpy / cudaMemcpyPeer");
  bench_local->add_option("--device", bench.device, "Device (default: FERRY_BACKEND's choice)");
  bench_local->add_option("--peer", bench.peer, "Second GPU for GPU->GPU (default: another GPU if present)");
  bench_local->add_option("--sizes", bench.sizes, "Comma-separated sizes (those the device cannot hold are skipped)")
      ->capture_default_str();
  bench_local->add_option("--budget", bench.budget, "Bytes per trial (iterations = budget / size)")->capture_default_str();
  bench_local->add_option("--trials", bench.trials, "Trials per measurement (best is kept)")->capture_default_str();
  bench_local->add_flag("--json", bench.json, "Print JSON");
  bench_local->add_option("--json-out", bench.json_out, "Also write the JSON to this file");

  ferry::cli::bench_file_options bfile;
  auto* bench_file = app.add_subcommand("file", "File -> GPU: ferry vs the disk's ceiling, naive pread+cudaMemcpy, torch");
  bench_file->add_option("--path", bfile.path, "Directory (or file path) for the test file")->required();
  bench_file->add_option("--size", bfile.size, "Test file size")->capture_default_str();
  bench_file->add_option("--device", bfile.device, "Device (default: FERRY_BACKEND's choice)");
  bench_file->add_option("--compare-script", bfile.compare_script, "Script loading the same file the way users do");
  bench_file->add_option("--json-out", bfile.json_out, "Write the results as JSON here");
  bench_file->add_flag("--keep", bfile.keep, "Keep the test file");

  ferry::cli::bench_remote_options bremote;
  auto* bench_remote = app.add_subcommand("remote", "ferry:// read/write (host, GPU) vs raw UCX put/get/AM/tag (ucx_perftest), tcp and shm");
  bench_remote->add_option("--transports", bremote.transports, "Comma-separated: tcp, shm")->capture_default_str();
  bench_remote->add_option("--sizes", bremote.sizes, "Block sizes")->capture_default_str();
  bench_remote->add_option("--qd", bremote.qds, "Queue depths")->capture_default_str();
  bench_remote->add_option("--ops", bremote.ops, "Comma-separated: read, write")->capture_default_str();
  bench_remote->add_option("--memory", bremote.memory,
                           "Comma-separated: host, lent (client-allocated, same host only), gpu (the --device)")
      ->capture_default_str();
  bench_remote->add_option("--budget", bremote.budget, "Bytes per measurement")->capture_default_str();
  bench_remote->add_option("--file-size", bremote.file_size, "Size of the served file")->capture_default_str();
  bench_remote->add_option("--device", bremote.device, "Device memory to read into (default: the first GPU, if any)");
  bench_remote->add_option("--dir", bremote.dir, "Directory for the served file (default: temp directory)");
  bench_remote->add_option("--perftest", bremote.perftest, "ucx_perftest binary (the raw baseline)")->capture_default_str();
  bench_remote->add_option("--json-out", bremote.json_out, "Write the results as JSON here");

  ferry::cli::bench_vm_options bvm;
  auto* bench_vm = app.add_subcommand("vm", "Unified memory: ferry's address space vs CUDA managed memory (UVM)");
  bench_vm->add_option("--size", bvm.size, "Data per test")->capture_default_str();
  bench_vm->add_option("--cap", bvm.cap, "Device cap of the oversubscription test (default: size / 2)");
  bench_vm->add_option("--device", bvm.device, "Device (default: FERRY_BACKEND's choice)");
  bench_vm->add_option("--rounds", bvm.rounds, "Rounds per test (the median is reported)")->capture_default_str();
  bench_vm->add_option("--json-out", bvm.json_out, "Write the results as JSON here");

  ferry::cli::bench_pipeline_options bpipe;
  auto* bench_pipe = app.add_subcommand("pipeline", "Read chunk i of a file, then a kernel on it, on the user's streams: "
                                                    "stream-ordered ferry vs serialized and KvikIO-style, next to the ideal");
  bench_pipe->add_option("--path", bpipe.path, "Directory (or file path) for the test file")->required();
  bench_pipe->add_option("--size", bpipe.size, "Test file size")->capture_default_str();
  bench_pipe->add_option("--chunk", bpipe.chunk, "Bytes per read and per kernel")->capture_default_str();
  bench_pipe->add_option("--buffers", bpipe.buffers, "Device buffers the chunks take in turn")->capture_default_str();
  bench_pipe->add_option("--kernel-ratio", bpipe.kernel_ratio, "All kernels' time / all reads' time")->capture_default_str();
  bench_pipe->add_option("--device", bpipe.device, "Device (default: FERRY_BACKEND's choice)");
  bench_pipe->add_option("--rounds", bpipe.rounds, "Rounds per row (the median is reported)")->capture_default_str();
  bench_pipe->add_option("--json-out", bpipe.json_out, "Write the results as JSON here");
  bench_pipe->add_flag("--keep", bpipe.keep, "Keep the test file");

  ferry::cli::bench_gather_options bgather;
  auto* bench_gather = app.add_subcommand("gather", "A user's kernel gathers random elements of a dataset 4x its GPU cache: "
                                                        "ferry's GPU page cache vs zero-copy host memory and host-orchestrated staging");
  bench_gather->add_option("--path", bgather.path, "Directory (or file path) for the dataset file")->required();
  bench_gather->add_option("--size", bgather.size, "Dataset size (a power of two)")->capture_default_str();
  bench_gather->add_option("--cache", bgather.cache, "ferry's GPU page cache (default: size / 4)");
  bench_gather->add_option("--page", bgather.page, "Page of the cache and of the staged baseline")->capture_default_str();
  bench_gather->add_option("--accesses", bgather.accesses, "Elements each kernel gathers")->capture_default_str();
  bench_gather->add_option("--step", bgather.step, "Accesses per step of the staged baseline")->capture_default_str();
  bench_gather->add_option("--device", bgather.device, "Device (default: FERRY_BACKEND's choice)");
  bench_gather->add_option("--rounds", bgather.rounds, "Rounds per row (the median is reported)")->capture_default_str();
  bench_gather->add_option("--json-out", bgather.json_out, "Write the results as JSON here");
  bench_gather->add_flag("--keep", bgather.keep, "Keep the dataset file");

  ferry::cli::bench_bfs_options bbfs;
  auto* bench_bfs = app.add_subcommand("bfs", "A user's breadth-first search over a generated power-law graph whose CSR is 4x its GPU cache: "
                                              "ferry's GPU page cache vs zero-copy host memory and host-orchestrated staging");
  bench_bfs->add_option("--path", bbfs.path, "Directory (or file path) for the graph file")->required();
  bench_bfs->add_option("--vertices", bbfs.vertices, "Vertices (a power of two)")->capture_default_str();
  bench_bfs->add_option("--degree", bbfs.degree, "Edges per vertex on average")->capture_default_str();
  bench_bfs->add_option("--cache", bbfs.cache, "ferry's GPU page cache (default: the CSR's size / 4)");
  bench_bfs->add_option("--page", bbfs.page, "Page of the cache and of the staged baseline")->capture_default_str();
  bench_bfs->add_option("--device", bbfs.device, "Device (default: FERRY_BACKEND's choice)");
  bench_bfs->add_option("--rounds", bbfs.rounds, "Rounds per row (the median is reported)")->capture_default_str();
  bench_bfs->add_option("--json-out", bbfs.json_out, "Write the results as JSON here");
  bench_bfs->add_flag("--keep", bbfs.keep, "Keep the graph file");

  // The server `remote` measures, started as a child process of this program (not for users: hidden).
  ferry::cli::serve_options serve;
  auto* serve_cmd = app.add_subcommand("serve", "The server of `remote` (same code as `ferry serve`)")->group("");
  serve_cmd->add_option("--root", serve.root)->required();
  serve_cmd->add_option("--listen", serve.listen);
  serve_cmd->add_flag("--writable", serve.writable);
  serve_cmd->add_flag("--insecure", serve.insecure);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    ferry::runtime rt;
    if (*bench_local) return ferry::cli::run_bench_local(rt, bench);
    if (*bench_file) return ferry::cli::run_bench_file(rt, bfile);
    if (*bench_remote) return ferry::cli::run_bench_remote(rt, bremote);
    if (*bench_vm) return ferry::cli::run_bench_vm(rt, bvm);
    if (*bench_pipe) return ferry::cli::run_bench_pipeline(rt, bpipe);
    if (*bench_gather) return ferry::cli::run_bench_gather(rt, bgather);
    if (*bench_bfs) return ferry::cli::run_bench_bfs(rt, bbfs);
    if (*serve_cmd) return ferry::cli::run_serve(rt, serve);
  } catch (const ferry::error& e) {
    std::fprintf(stderr, "ferry-bench: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ferry-bench: internal error: %s\n", e.what());
    return 70;
  }
  return 0;
}
