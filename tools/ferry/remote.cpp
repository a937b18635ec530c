// `ferry serve`, `ferry ls`, `ferry stat`, and ferry:// sources for `ferry cp`.
#include "commands.hpp"

#include <ferry/core/units.hpp>
#include <ferry/store/client.hpp>
#include <ferry/store/secret.hpp>
#include <ferry/store/server.hpp>
#include <ferry/store/uri.hpp>

#include <fmt/format.h>
#include <signal.h>

#include <charconv>
#include <cstdlib>
#include <csignal>
#include <thread>

namespace ferry::cli {

remote_uri parse_uri(const std::string& text) {
  auto u = store::parse_uri(text);
  return {u.host, u.port, u.path};
}

std::string client_secret(runtime& rt) {
  return rt.config().secret_file.empty() ? std::string() : store::read_secret_file(rt.config().secret_file);
}

int run_serve(runtime& rt, const serve_options& o) {
  // SIGTERM / SIGINT stop the server gracefully: handled synchronously with sigtimedwait.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGUSR1);  // print stats on demand
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  store::server_options so = store::server_options_from(rt.config());
  so.root = o.root;
  auto colon = o.listen.rfind(':');
  if (colon == std::string::npos) fail(errc::invalid_argument, "serve", o.listen, "expected HOST:PORT");
  so.host = o.listen.substr(0, colon);
  so.port = static_cast<std::uint16_t>(std::stoi(o.listen.substr(colon + 1)));
  if (!o.secret_file.empty()) so.secret = store::read_secret_file(o.secret_file);
  so.writable = o.writable;
  so.insecure = o.insecure;
  store::server srv(rt.files(), so);
  fmt::print("ferry serve: {} on {}:{} ({}, {}{})\n", o.root, so.host, srv.port(), so.writable ? "writable" : "read-only",
             so.secret.empty() ? "no authentication" : "clients must know the secret",
             so.files && so.map ? ", lends same-host readers the files on local file systems" : "");
  std::fflush(stdout);
  timespec tick{1, 0};
  for (;;) {
    int sig = sigtimedwait(&set, nullptr, &tick);
    if (sig == SIGTERM || sig == SIGINT) break;
    if (sig == SIGUSR1) {
      auto st = srv.stats();
      fmt::print("ferry serve: {} connections ({} live), {} requests ({} reads, {} inline ({} mapped), {} writes), {} files lent, {} sent, {} received, {} errors\n",
                 st.connections, st.live_sessions, st.requests, st.reads, st.inline_replies, st.mapped_reads, st.writes,
                 st.files_lent, format_size(st.bytes_sent), format_size(st.bytes_received), st.errors);
      std::fflush(stdout);
    }
  }
  auto st = srv.stats();
  fmt::print("ferry serve: stopping; {} connections, {} requests, {} sent, {} received, {} errors\n", st.connections,
             st.requests, format_size(st.bytes_sent), format_size(st.bytes_received), st.errors);
  std::fflush(stdout);
  // Requests still in a file system that does not answer after the deadline hold their buffers
  // until it does; the process exits without them (the kernel ends them with it).
  if (std::size_t left = srv.stop(rt.config().deadline)) {
    fmt::print(stderr, "ferry serve: {} file requests never came back from the file system (a hung mount?); exiting without them\n", left);
    std::fflush(stderr);
    std::_Exit(1);
  }
  return 0;
}

int run_ls(runtime& rt, const std::string& uri, bool stat_only) {
  remote_uri r = parse_uri(uri);
  // Direct: listing and stat are not data requests, and the file API has no listing (ferry cp's data goes through it).
  store::client c(r.host, r.port, store::client_options_from(rt.config(), nullptr, nullptr));
  if (stat_only) {
    auto s = c.stat(r.path);
    fmt::print("{}: {} bytes, mode {:o}\n", printable(uri, 4096), s.size, s.mode);
    return 0;
  }
  for (auto& e : c.list(r.path))
    fmt::print("{:<4} {:>14}  {}\n", e.kind == 0 ? "file" : e.kind == 1 ? "dir" : "?", e.size, printable(e.name, 4096));
  return 0;
}

}  // namespace ferry::cli
