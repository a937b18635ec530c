#pragma once
// What every layer's tunables are declared with, and core's own tunables.
//
// Each layer owns its tunables: a struct in ferry/<layer>/settings.hpp and a table of rows in
// src/<layer>/settings.cpp, one row per FERRY_* variable with its documentation, parser and printer
// (the default is the member's initializer). ferry/settings.hpp gathers them into the one snapshot a
// runtime loads and `ferry info --settings` prints; the loading rules live once, in src/core.
#include <ferry/core/export.hpp>
#include <ferry/core/log.hpp>

#include <chrono>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace ferry {

// A value a row's parser refuses, and why; the loader adds the variable, the value and where it came from.
struct FERRY_API bad_setting {
  std::string why;
};

// One tunable of the settings struct S. `parse` reads text into it (throws bad_setting); `format`
// prints it back in a form `parse` accepts, so describe() output can be pasted into a config file.
template <class S>
struct setting_row {
  std::string_view name;  // FERRY_...
  std::string_view doc;
  void (*parse)(S&, std::string_view);
  std::string (*format)(const S&);
};

// A tunable as a snapshot describes it.
struct setting_value {
  std::string name;           // FERRY_...
  std::string value;          // current value, printed the way it is parsed
  std::string default_value;  // default, likewise
  std::string doc;
};

// Looks a variable up by name ("FERRY_LOG"); std::nullopt when unset.
using setting_lookup = std::function<std::optional<std::string>(std::string_view)>;

// core's tunables, which every layer reads. The layers' structs derive from it virtually (a snapshot
// holds one): keep its members, and those of any other virtual base, trivially copyable -- a defaulted
// move assignment may move a virtual base more than once (the compiler warns where a value would be lost).
struct FERRY_API core_settings {
  log_level log = log_level::warn;
  std::chrono::nanoseconds deadline = std::chrono::seconds(30);

  static std::span<const setting_row<core_settings>> table();
};

}  // namespace ferry
