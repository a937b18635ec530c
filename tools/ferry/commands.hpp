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

struct cp_options {
  std::string src, dst;
  std::string size;  // default: the source file's size, or 64 MiB for memory
  std::string via;   // file -> file through this endpoint (default host)
  bool progress = false;
  bool verify = true;
};
int run_cp(runtime& rt, const cp_options& o);

struct bench_options {
  std::string device;  // default: the default device
  std::string peer;    // default: another GPU when there is one
  std::string sizes = "4KiB,64KiB,1MiB,16MiB,64MiB,256MiB,1GiB";
  std::string budget = "1GiB";  // bytes moved per trial (iterations = budget / size, 2..2000)
  int trials = 3;
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
  std::string budget = "512MiB";     // bytes per measurement (requests = budget / block, 3*qd..20000)
  std::string file_size = "1GiB";    // the served file
  std::string device;                // default: the first GPU; none: host only
  std::string dir;                   // where the served file goes (default: the temp directory)
  std::string perftest = "ucx_perftest";
  std::string json_out;
};
int run_bench_remote(runtime& rt, const bench_remote_options& o);

struct remote_uri {
  std::string host;
  std::uint16_t port = 0;
  std::string path;
};
// Parses ferry://host:port/path (host may be [IPv6]); throws invalid_argument naming the URI.
remote_uri parse_uri(const std::string& uri);

struct bench_vm_options {
  std::string size = "4GiB";   // data per test (UVM and ferry each; never more than the GPU has free)
  std::string cap;             // device cap of the streaming test (default: size / 2)
  std::string device;          // default: the default device
  int rounds = 5;              // the median round is reported
  std::string json_out;
};
int run_bench_vm(runtime& rt, const bench_vm_options& o);
// "ferry settings not at their defaults: FERRY_X=v ..." (or "ferry settings: all defaults"), so a
// benchmark's output records the configuration it measured.
std::string changed_settings(const settings& s);

struct serve_options {
  std::string root;
  std::string listen = "127.0.0.1:7070";
  std::string secret_file;  // clients must prove they know this secret
  bool writable = false;
  bool insecure = false;
};
// The secret from FERRY_SECRET_FILE, or empty.
std::string client_secret(runtime& rt);
int run_serve(runtime& rt, const serve_options& o);
int run_ls(runtime& rt, const std::string& uri, bool stat_only);

struct job_options {
  std::string device;  // default: a GPU if present, else sim:0
  int files = 4;
  std::string size = "64MiB";
};
int run_job(runtime& rt, const job_options& o);

}  // namespace ferry::cli
