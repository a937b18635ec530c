#pragma once
// Leveled logging to stderr. The level comes from FERRY_LOG (settings) when a runtime is created;
// logging is process-wide because stderr is.
#include <ferry/core/export.hpp>

#include <string_view>

namespace ferry {

enum class log_level { trace = 0, debug, info, warn, error, off };

FERRY_API std::string_view to_string(log_level l) noexcept;
FERRY_API void set_log_level(log_level l) noexcept;
FERRY_API log_level current_log_level() noexcept;
inline bool log_enabled(log_level l) noexcept { return l >= current_log_level() && l != log_level::off; }
// Writes "ferry <time> <level> [<component>] <message>" as one line (one write(2), so lines never interleave).
FERRY_API void log_message(log_level l, std::string_view component, std::string_view message) noexcept;

}  // namespace ferry
