#include <ferry/core/log.hpp>

#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <chrono>

namespace ferry {
namespace {
std::atomic<log_level> g_level{log_level::warn};
}

std::string_view to_string(log_level l) noexcept {
  switch (l) {
    case log_level::trace: return "trace";
    case log_level::debug: return "debug";
    case log_level::info: return "info";
    case log_level::warn: return "warn";
    case log_level::error: return "error";
    case log_level::off: return "off";
  }
  return "?";
}

void set_log_level(log_level l) noexcept { g_level.store(l, std::memory_order_relaxed); }
log_level current_log_level() noexcept { return g_level.load(std::memory_order_relaxed); }

void log_message(log_level l, std::string_view component, std::string_view message) noexcept {
  try {
    using namespace std::chrono;
    auto us = duration_cast<microseconds>(system_clock::now().time_since_epoch()).count();
    std::string line = fmt::format("ferry {}.{:06d} {:5} [{}] {}\n", us / 1000000, us % 1000000, to_string(l),
                                   component, message);
    // One write so concurrent lines never interleave; a failed log write is not worth failing for.
    [[maybe_unused]] auto n = ::write(STDERR_FILENO, line.data(), line.size());
  } catch (...) {
  }
}

}  // namespace ferry
