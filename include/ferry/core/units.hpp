#pragma once
// Parsing and printing of sizes, durations and rates, shared by settings and the CLI.
#include <ferry/core/export.hpp>

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

namespace ferry {

inline constexpr std::size_t KiB = 1024;
inline constexpr std::size_t MiB = 1024 * KiB;
inline constexpr std::size_t GiB = 1024 * MiB;

// "4096", "64K", "64KiB", "2M", "2MiB", "1G", "1GiB", "1T" (binary multiples; case-insensitive; "k"=="KiB").
// Throws invalid_argument naming `what` and the text on anything else, including overflow.
FERRY_API std::uint64_t parse_size(std::string_view text, std::string_view what = "size");
// "250ms", "30s", "2m", "100us", "5000" (milliseconds). Throws invalid_argument as parse_size.
FERRY_API std::chrono::nanoseconds parse_duration(std::string_view text, std::string_view what = "duration");

// "1 GiB", "1.5 MiB", "512 B".
FERRY_API std::string format_size(std::uint64_t bytes);
// "12.34 GB/s" (decimal, as bandwidth is usually quoted).
FERRY_API std::string format_rate(double bytes_per_second);
// "30s", "250ms", "15us" (exact when possible).
FERRY_API std::string format_duration(std::chrono::nanoseconds d);

}  // namespace ferry
