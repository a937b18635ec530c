#pragma once
// Sub-commands of `ferry-bench`: ferry next to baselines measured in the same run, with the
// project's pass/fail targets. Each returns the process exit code.
#include <ferry/runtime.hpp>

#include <chrono>
#include <string>

namespace ferry::cli {

// Seconds since t0 (steady clock), what every benchmark times with.
inline double secs_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct bench_options {
  std::string device;  // default: the default device
  std::string peer;    // default: another GPU when there is one
  // Sizes the device cannot hold (two buffers each, in its free memory) are skipped with a note.
  std::string sizes = "4KiB,64KiB,1MiB,16MiB,64MiB,256MiB,1GiB";
  std::string budget = "1GiB";  // bytes moved per trial (iterations = budget / size, 2..2000)
  int trials = 5;
  bool json = false;
  std::string json_out;  // also write the JSON here
};
int run_bench_local(runtime& rt, const bench_options& o);

struct bench_file_options {
  std::string path;            // a directory (the test file is created there) or a file path
  std::string size = "4GiB";
  std::string device;          // default: the default device
  std::string compare_script;  // e.g. scripts/bench-torch-load.py, run on the same file
  std::string json_out;
  bool keep = false;           // keep the test file
};
int run_bench_file(runtime& rt, const bench_file_options& o);

struct bench_remote_options {
  std::string transports = "tcp,shm";
  std::string sizes = "4KiB,64KiB,1MiB,4MiB,16MiB,64MiB";
  std::string qds = "1,4,16,64";
  std::string ops = "read,write";
  std::string memory = "host,lent,gpu";  // which rows: the caller's host memory, client-allocated, the device's
  std::string budget = "512MiB";     // bytes per measurement (requests = budget / block, 3*qd..20000)
  std::string file_size = "1GiB";    // the served file
  std::string device;                // default: the first GPU; none: host only
  std::string dir;                   // where the served file goes (default: the temp directory)
  std::string perftest = "ucx_perftest";
  std::string json_out;
};
// The server it measures is this program's own `serve` (the `ferry serve` code, in a child process).
int run_bench_remote(runtime& rt, const bench_remote_options& o);

struct bench_vm_options {
  std::string size = "4GiB";   // data per test (UVM and ferry each; never more than the GPU has free)
  std::string cap;             // device cap of the streaming test (default: size / 2)
  std::string device;          // default: the default device
  int rounds = 5;              // the median round is reported
  std::string json_out;
};
int run_bench_vm(runtime& rt, const bench_vm_options& o);

// Reads [0, bytes) of the file at `p` with buffered 16 MiB preads (into the page cache too); bytes
// per second.
double read_buffered(const std::string& p, std::uint64_t bytes);

struct bench_pipeline_options {
  std::string path;            // a directory (the test file is created there) or a file path
  std::string size = "4GiB";
  std::string chunk = "64MiB";  // one read_async and one kernel each
  int buffers = 4;             // device buffers the chunks take in turn
  double kernel_ratio = 1.0;   // the kernels' total time / the reads' total time
  std::string device;          // default: the default device
  int rounds = 3;              // the median round is reported
  std::string json_out;
  bool keep = false;
};
// Needs a CUDA GPU (a user's kernel runs on every chunk); a build without CUDA says so.
int run_bench_pipeline(runtime& rt, const bench_pipeline_options& o);

struct bench_gather_options {
  std::string path;            // a directory (the test file is created there) or a file path
  std::string size = "4GiB";   // the dataset (a power of two)
  std::string cache;           // ferry's GPU page cache (default: size / 4)
  std::string page = "4KiB";   // its page, and the staged baseline's
  std::uint64_t accesses = 1 << 20;  // elements each kernel gathers
  std::uint64_t step = 1 << 16;      // accesses per step of the host-orchestrated baseline
  std::string device;          // default: the default device
  int rounds = 3;              // the median round is reported
  std::string json_out;
  bool keep = false;
};
// Needs a CUDA GPU; a build without CUDA says so.
int run_bench_gather(runtime& rt, const bench_gather_options& o);

struct bench_bfs_options {
  std::string path;                   // a directory (the graph file is created there) or a file path
  std::uint64_t vertices = 1u << 22;  // a power of two
  std::uint64_t degree = 32;          // edges per vertex, on average
  std::string cache;                  // ferry's GPU page cache (default: the CSR's size / 4)
  std::string page = "4KiB";          // its page, and the staged baseline's
  std::string device;
  int rounds = 3;
  std::string json_out;
  bool keep = false;
};
// Needs a CUDA GPU; a build without CUDA says so.
int run_bench_bfs(runtime& rt, const bench_bfs_options& o);

// "ferry settings not at their defaults: FERRY_X=v ..." (or "ferry settings: all defaults"), so a
// benchmark's output records the configuration it measured.
std::string changed_settings(const settings& s);

}  // namespace ferry::cli
