// `ferry serve`, `ferry ls`, `ferry stat`, and ferry:// sources for `ferry cp`.
#include "commands.hpp"

#include <ferry/core/units.hpp>
#include <ferry/store/service.hpp>

#include <fmt/format.h>
#include <signal.h>

#include <charconv>
#include <csignal>
#include <thread>

namespace ferry::cli {

remote_uri parse_uri(const std::string& uri) {
  std::string_view s = uri;
  auto bad = [&](std::string_view why) { fail(errc::invalid_argument, "uri", uri, std::string(why) + " (expected ferry://host:port/path)"); };
  if (!s.starts_with("ferry://")) bad("not a ferry:// URI");
  s.remove_prefix(8);
  auto slash = s.find('/');
  if (slash == std::string_view::npos) bad("no path");
  std::string_view hostport = s.substr(0, slash);
  remote_uri r;
  r.path = std::string(s.substr(slash + 1));
  std::string_view port;
  if (hostport.starts_with("[")) {
    auto close = hostport.find(']');
    if (close == std::string_view::npos || close + 1 >= hostport.size() || hostport[close + 1] != ':') bad("bad [IPv6]:port");
    r.host = std::string(hostport.substr(1, close - 1));
    port = hostport.substr(close + 2);
  } else {
    auto colon = hostport.rfind(':');
    if (colon == std::string_view::npos) bad("no port");
    r.host = std::string(hostport.substr(0, colon));
    port = hostport.substr(colon + 1);
  }
  unsigned p = 0;
  auto [ptr, ec] = std::from_chars(port.data(), port.data() + port.size(), p);
  if (ec != std::errc() || ptr != port.data() + port.size() || p == 0 || p > 65535) bad("bad port");
  r.port = static_cast<std::uint16_t>(p);
  if (r.path.empty()) bad("empty path");
  return r;
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
  store::server_options so;
  so.root = o.root;
  auto colon = o.listen.rfind(':');
  if (colon == std::string::npos) fail(errc::invalid_argument, "serve", o.listen, "expected HOST:PORT");
  so.host = o.listen.substr(0, colon);
  so.port = static_cast<std::uint16_t>(std::stoi(o.listen.substr(colon + 1)));
  if (!o.secret_file.empty()) so.secret = store::read_secret_file(o.secret_file);
  so.writable = o.writable;
  so.insecure = o.insecure;
  so.spin = rt.config().net_spin;
  so.threads = rt.config().serve_threads;
  so.workers = rt.config().serve_workers;
  so.map = rt.config().net_map;
  store::server srv(so);
  fmt::print("ferry serve: {} on {}:{} ({}, {})\n", o.root, so.host, srv.port(), so.writable ? "writable" : "read-only",
             so.secret.empty() ? "no authentication" : "clients must know the secret");
  std::fflush(stdout);
  timespec tick{1, 0};
  for (;;) {
    int sig = sigtimedwait(&set, nullptr, &tick);
    if (sig == SIGTERM || sig == SIGINT) break;
    if (sig == SIGUSR1) {
      auto st = srv.stats();
      fmt::print("ferry serve: {} connections ({} live), {} requests ({} reads, {} inline, {} writes), {} sent, {} received, {} errors\n",
                 st.connections, st.live_sessions, st.requests, st.reads, st.inline_replies, st.writes,
                 format_size(st.bytes_sent), format_size(st.bytes_received), st.errors);
      std::fflush(stdout);
    }
  }
  auto st = srv.stats();
  fmt::print("ferry serve: stopping; {} connections, {} requests, {} sent, {} received, {} errors\n", st.connections,
             st.requests, format_size(st.bytes_sent), format_size(st.bytes_received), st.errors);
  return 0;
}

int run_ls(runtime& rt, const std::string& uri, bool stat_only) {
  remote_uri r = parse_uri(uri);
  store::client c(r.host, r.port, store::client_options_from(rt.config(), nullptr, nullptr));
  if (stat_only) {
    auto s = c.stat(r.path);
    fmt::print("{}: {} bytes, mode {:o}\n", uri, s.size, s.mode);
    return 0;
  }
  for (auto& e : c.list(r.path))
    fmt::print("{:<4} {:>14}  {}\n", e.kind == 0 ? "file" : e.kind == 1 ? "dir" : "?", e.size, e.name);
  return 0;
}

}  // namespace ferry::cli
