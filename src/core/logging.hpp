#pragma once
// Internal formatting front end for ferry/core/log.hpp: formats only when the level is enabled.
#include <ferry/core/log.hpp>

#include <fmt/format.h>

namespace ferry::log {

template <typename... A>
void at(log_level l, std::string_view component, fmt::format_string<A...> f, A&&... a) {
  if (log_enabled(l)) log_message(l, component, fmt::format(f, std::forward<A>(a)...));
}
template <typename... A>
void debug(std::string_view c, fmt::format_string<A...> f, A&&... a) { at(log_level::debug, c, f, std::forward<A>(a)...); }
template <typename... A>
void info(std::string_view c, fmt::format_string<A...> f, A&&... a) { at(log_level::info, c, f, std::forward<A>(a)...); }
template <typename... A>
void warn(std::string_view c, fmt::format_string<A...> f, A&&... a) { at(log_level::warn, c, f, std::forward<A>(a)...); }
template <typename... A>
void error(std::string_view c, fmt::format_string<A...> f, A&&... a) { at(log_level::error, c, f, std::forward<A>(a)...); }

}  // namespace ferry::log
