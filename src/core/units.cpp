#include <ferry/core/error.hpp>
#include <ferry/core/units.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <limits>

namespace ferry {

namespace {

std::string lower(std::string_view s) {
  std::string r(s);
  std::transform(r.begin(), r.end(), r.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return r;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// Splits "64KiB" into 64 and "kib"; false when no leading number.
bool split_number(std::string_view text, std::uint64_t& n, std::string& unit) {
  text = trim(text);
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
  if (ec != std::errc() || p == text.data()) return false;
  unit = lower(trim(std::string_view(p, text.data() + text.size() - p)));
  return true;
}

}  // namespace

std::uint64_t parse_size(std::string_view text, std::string_view what) {
  std::uint64_t n = 0;
  std::string unit;
  auto bad = [&](std::string_view why) {
    fail(errc::invalid_argument, "parse", fmt::format("{}='{}'", what, text),
         fmt::format("{} (expected e.g. 4096, 64KiB, 2MiB, 1GiB)", why));
  };
  if (!split_number(text, n, unit)) bad("not a size");
  std::uint64_t mult = 0;
  if (unit.empty() || unit == "b") mult = 1;
  else if (unit == "k" || unit == "kb" || unit == "kib") mult = KiB;
  else if (unit == "m" || unit == "mb" || unit == "mib") mult = MiB;
  else if (unit == "g" || unit == "gb" || unit == "gib") mult = GiB;
  else if (unit == "t" || unit == "tb" || unit == "tib") mult = GiB * 1024;
  else bad(fmt::format("unknown unit '{}'", unit));
  if (n > std::numeric_limits<std::uint64_t>::max() / mult) bad("too large");
  return n * mult;
}

std::chrono::nanoseconds parse_duration(std::string_view text, std::string_view what) {
  std::uint64_t n = 0;
  std::string unit;
  auto bad = [&](std::string_view why) {
    fail(errc::invalid_argument, "parse", fmt::format("{}='{}'", what, text),
         fmt::format("{} (expected e.g. 250ms, 30s, 2m, 100us)", why));
  };
  if (!split_number(text, n, unit)) bad("not a duration");
  std::uint64_t ns_per = 0;
  if (unit == "ns") ns_per = 1;
  else if (unit == "us") ns_per = 1000;
  else if (unit.empty() || unit == "ms") ns_per = 1000000;
  else if (unit == "s") ns_per = 1000000000ull;
  else if (unit == "m" || unit == "min") ns_per = 60000000000ull;
  else if (unit == "h") ns_per = 3600000000000ull;
  else bad(fmt::format("unknown unit '{}'", unit));
  if (n > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) / ns_per) bad("too large");
  return std::chrono::nanoseconds(static_cast<std::int64_t>(n * ns_per));
}

std::string format_size(std::uint64_t b) {
  static constexpr const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  double v = static_cast<double>(b);
  while (v >= 1024 && u < 5) { v /= 1024; ++u; }
  if (u == 0) return fmt::format("{} B", b);
  if (v == static_cast<double>(static_cast<std::uint64_t>(v))) return fmt::format("{} {}", static_cast<std::uint64_t>(v), units[u]);
  return fmt::format("{:.2f} {}", v, units[u]);
}

std::string format_rate(double bps) {
  if (bps >= 1e9) return fmt::format("{:.2f} GB/s", bps / 1e9);
  if (bps >= 1e6) return fmt::format("{:.2f} MB/s", bps / 1e6);
  return fmt::format("{:.2f} kB/s", bps / 1e3);
}

std::string format_duration(std::chrono::nanoseconds d) {
  auto n = d.count();
  if (n == 0) return "0s";
  if (n % 60000000000 == 0) return fmt::format("{}m", n / 60000000000);
  if (n % 1000000000 == 0) return fmt::format("{}s", n / 1000000000);
  if (n % 1000000 == 0) return fmt::format("{}ms", n / 1000000);
  if (n % 1000 == 0) return fmt::format("{}us", n / 1000);
  return fmt::format("{}ns", n);
}

}  // namespace ferry
