#pragma once
// Sub-commands of the `ferry` CLI. Each returns the process exit code.
#include <ferry/runtime.hpp>
#include <ferry/store/client.hpp>
#include <ferry/store/server.hpp>

#include <string>
#include <string_view>
#include <vector>

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
  std::string via;   // between files and ferry://: the memory the data passes through (default host)
  bool progress = false;
  bool verify = true;
};
int run_cp(runtime& rt, const cp_options& o);

// `ferry run -- PROGRAM [ARGS...]`: execs PROGRAM with libferry_preload.so in LD_PRELOAD; returns only
// when it could not (126/127, as a shell). Needs no runtime.
int run_program(std::vector<std::string> args);

struct remote_uri {
  std::string host;
  std::uint16_t port = 0;
  std::string path;
};
// Parses ferry://host:port/path (host may be [IPv6]); throws invalid_argument naming the URI.
remote_uri parse_uri(const std::string& uri);

struct serve_options {
  std::string root;
  std::string listen = "127.0.0.1:7070";
  std::string secret_file;  // clients must prove they know this secret
  bool writable = false;
  bool insecure = false;
};
// The secret from FERRY_SECRET_FILE, or empty.
std::string client_secret(runtime& rt);
// How a client's data moved, for summaries: through the landing region a same-host server mapped,
// by RMA, or in messages.
int run_serve(runtime& rt, const serve_options& o);
int run_ls(runtime& rt, const std::string& uri, bool stat_only);

struct job_options {
  std::string device;  // default: a GPU if present, else sim:0
  int files = 4;
  std::string size = "64MiB";
};
int run_job(runtime& rt, const job_options& o);

}  // namespace ferry::cli
