// The settings machinery every layer's table is written with (core/settings_table.hpp), and core's table.
#include <ferry/core/error.hpp>
#include <ferry/core/settings.hpp>
#include <ferry/core/units.hpp>

#include "core/logging.hpp"
#include "core/settings_table.hpp"

#include <fmt/format.h>

#include <charconv>
#include <cstdlib>
#include <fstream>

extern char** environ;

namespace ferry {

std::int64_t parse_int(std::string_view v, std::int64_t lo, std::int64_t hi) {
  std::int64_t n = 0;
  auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (ec != std::errc() || p != v.data() + v.size()) throw bad_setting{"not an integer"};
  if (n < lo || n > hi) throw bad_setting{fmt::format("out of range [{}, {}]", lo, hi)};
  return n;
}

double parse_double(std::string_view v, double lo, double hi) {
  std::string s(v);
  char* end = nullptr;
  double d = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size()) throw bad_setting{"not a number"};
  if (!(d >= lo && d <= hi)) throw bad_setting{fmt::format("out of range [{}, {}]", lo, hi)};
  return d;
}

std::uint64_t parse_size_in(std::string_view v, std::uint64_t lo, std::uint64_t hi, bool pow2) {
  std::uint64_t n;
  try {
    n = parse_size(v);
  } catch (const error& e) {
    throw bad_setting{e.detail()};
  }
  if (n < lo || n > hi) throw bad_setting{fmt::format("out of range [{}, {}]", format_size(lo), format_size(hi))};
  if (pow2 && (n & (n - 1)) != 0) throw bad_setting{"must be a power of two"};
  return n;
}

std::chrono::nanoseconds parse_duration_value(std::string_view v) {
  try {
    return parse_duration(v);
  } catch (const error& e) {
    throw bad_setting{e.detail()};
  }
}

std::chrono::nanoseconds parse_duration_in(std::string_view v, std::chrono::nanoseconds lo, std::chrono::nanoseconds hi) {
  auto d = parse_duration_value(v);
  if (d < lo || d > hi) throw bad_setting{fmt::format("out of range [{}, {}]", format_duration(lo), format_duration(hi))};
  return d;
}

bool parse_bool(std::string_view v) {
  if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
  if (v == "0" || v == "false" || v == "no" || v == "off") return false;
  throw bad_setting{"expected 1|0|true|false|yes|no|on|off"};
}

std::string nonempty(std::string_view v) {
  if (v.empty()) throw bad_setting{"must not be empty"};
  return std::string(v);
}

std::string show_double(double d) { return fmt::format("{}", d); }

namespace {

constexpr std::pair<std::string_view, log_level> log_levels[] = {
    {"trace", log_level::trace}, {"debug", log_level::debug}, {"info", log_level::info},
    {"warn", log_level::warn},   {"error", log_level::error}, {"off", log_level::off}};

// clang-format off
constexpr setting_row<core_settings> rows[] = {
  {"FERRY_LOG", "Log level: trace|debug|info|warn|error|off. Logs go to stderr.",
   [](core_settings& s, std::string_view v) { s.log = parse_enum(v, log_levels); },
   [](const core_settings& s) { return std::string(to_string(s.log)); }},
  {"FERRY_DEADLINE", "Default deadline of every wait (stream sync, transfer, request) when the caller gives none; a transfer batch without a fixed deadline fails only when no byte has moved for this long.",
   [](core_settings& s, std::string_view v) {
     s.deadline = parse_duration_value(v);
     if (s.deadline <= std::chrono::nanoseconds::zero()) throw bad_setting{"must be positive"};
   },
   [](const core_settings& s) { return format_duration(s.deadline); }},
};
// clang-format on

std::string_view trim(std::string_view s) {
  auto issp = [](char c) { return c == ' ' || c == '\t' || c == '\r'; };
  while (!s.empty() && issp(s.front())) s.remove_prefix(1);
  while (!s.empty() && issp(s.back())) s.remove_suffix(1);
  return s;
}

}  // namespace

std::span<const setting_row<core_settings>> core_settings::table() { return rows; }

namespace settings_detail {

void unknown(std::string_view name, std::string_view origin) {
  fail(errc::not_found, "settings.set", std::string(name), fmt::format("unknown setting (from {})", origin));
}

void refused(std::string_view name, std::string_view value, std::string_view origin, const std::string& why) {
  fail(errc::invalid_argument, "settings.parse", fmt::format("{}='{}' (from {})", name, value, origin), why);
}

void read_file(const std::string& path, const std::function<bool(std::string_view)>& known,
               const std::function<void(std::string_view, std::string_view, std::string_view)>& set) {
  std::ifstream in(path);
  if (!in) fail_errno(errno, "settings.load", "FERRY_CONFIG=" + path, "cannot open config file");
  std::string line;
  for (int lineno = 1; std::getline(in, line); ++lineno) {
    std::string_view l = trim(line);
    if (l.empty() || l.front() == '#') continue;
    auto eq = l.find('=');
    std::string origin = fmt::format("{}:{}", path, lineno);
    if (eq == std::string_view::npos)
      fail(errc::invalid_argument, "settings.load", origin, fmt::format("expected NAME = value, got '{}'", l));
    std::string_view name = trim(l.substr(0, eq)), value = trim(l.substr(eq + 1));
    if (!known(name)) fail(errc::invalid_argument, "settings.load", origin, fmt::format("unknown setting '{}'", name));
    set(name, value, origin);
  }
}

std::optional<std::string> process_env(std::string_view name) {
  if (const char* v = std::getenv(std::string(name).c_str())) return std::string(v);
  return std::nullopt;
}

void warn_unknown_env(const std::function<bool(std::string_view)>& known) {
  for (char** e = environ; e && *e; ++e) {
    std::string_view kv(*e);
    if (!kv.starts_with("FERRY_")) continue;
    auto name = kv.substr(0, kv.find('='));
    if (name != "FERRY_CONFIG" && !known(name))
      log::warn("settings", "ignoring unknown environment variable {} (see `ferry info --settings`)", name);
  }
}

}  // namespace settings_detail

}  // namespace ferry
