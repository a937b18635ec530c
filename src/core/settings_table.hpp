#pragma once
// What the layers' settings tables (src/<layer>/settings.cpp) are written with: parsers that throw
// bad_setting and printers; and setting_tables, the loading rules of a snapshot made of those layers'
// structs (ferry/settings.hpp): FERRY_CONFIG file, then environment, describe() and names().
#include <ferry/core/settings.hpp>
#include <ferry/core/units.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ferry {

// ---- parsers (each throws bad_setting saying what is wrong) and printers ------------------------

std::int64_t parse_int(std::string_view v, std::int64_t lo, std::int64_t hi);
double parse_double(std::string_view v, double lo, double hi);
std::uint64_t parse_size_in(std::string_view v, std::uint64_t lo, std::uint64_t hi, bool pow2 = false);
// "250ms", "45s", "1min", as parse_duration (core/units.hpp).
std::chrono::nanoseconds parse_duration_value(std::string_view v);
std::chrono::nanoseconds parse_duration_in(std::string_view v, std::chrono::nanoseconds lo, std::chrono::nanoseconds hi);
bool parse_bool(std::string_view v);  // 1|0|true|false|yes|no|on|off
std::string nonempty(std::string_view v);
std::string show_double(double d);

template <typename E, std::size_t N>
E parse_enum(std::string_view v, const std::pair<std::string_view, E> (&choices)[N]) {
  for (auto& [name, e] : choices)
    if (v == name) return e;
  std::string list;
  for (auto& [name, e] : choices) list += (list.empty() ? "" : "|") + std::string(name);
  throw bad_setting{"expected one of " + list};
}

// The name a choice is written with (the first listed for it).
template <typename E, std::size_t N>
std::string_view enum_name(E v, const std::pair<std::string_view, E> (&choices)[N]) noexcept {
  for (auto& [name, e] : choices)
    if (e == v) return name;
  return "?";
}

// ---- loading rules --------------------------------------------------------------------------------

namespace settings_detail {
[[noreturn]] void unknown(std::string_view name, std::string_view origin);
[[noreturn]] void refused(std::string_view name, std::string_view value, std::string_view origin, const std::string& why);
// FERRY_CONFIG: "NAME = value" lines, '#' comments; set(name, value, origin) for each. A name that
// known() does not know is an error (a typo must not be ignored).
void read_file(const std::string& path, const std::function<bool(std::string_view)>& known,
               const std::function<void(std::string_view, std::string_view, std::string_view)>& set);
std::optional<std::string> process_env(std::string_view name);
// A misspelt FERRY_* variable would otherwise be silently ignored: warns of each that known() does not know.
void warn_unknown_env(const std::function<bool(std::string_view)>& known);
}  // namespace settings_detail

// The rows of every table of a snapshot type T, which derives from each table's struct, in the order
// the tables were added.
template <class T>
class setting_tables {
 public:
  // Adds the rows of S, a base of T, after those added before.
  template <class S>
  void add(std::span<const setting_row<S>> rows) {
    for (const auto& r : rows)
      rows_.push_back({r.name, r.doc, [p = r.parse](T& t, std::string_view v) { p(t, v); },
                       [f = r.format](const T& t) { return f(t); }});
  }

  void set(T& t, std::string_view name, std::string_view value, std::string_view origin) const {
    const entry* e = find(name);
    if (!e) settings_detail::unknown(name, origin);
    apply(*e, t, value, origin);
  }

  T load(const setting_lookup& env) const {
    T t;
    if (auto cfg = env("FERRY_CONFIG"); cfg && !cfg->empty())
      settings_detail::read_file(*cfg, [this](std::string_view n) { return find(n) != nullptr; },
                                 [&](std::string_view n, std::string_view v, std::string_view origin) { set(t, n, v, origin); });
    for (auto& e : rows_)
      if (auto v = env(e.name)) apply(e, t, *v, "environment");
    return t;
  }

  T from_env() const {
    T t = load(settings_detail::process_env);
    settings_detail::warn_unknown_env([this](std::string_view n) { return find(n) != nullptr; });
    return t;
  }

  std::vector<setting_value> describe(const T& t) const {
    static const T def;
    std::vector<setting_value> out;
    out.reserve(rows_.size());
    for (auto& e : rows_) out.push_back({std::string(e.name), e.format(t), e.format(def), std::string(e.doc)});
    return out;
  }

  std::vector<std::string_view> names() const {
    std::vector<std::string_view> out;
    for (auto& e : rows_) out.push_back(e.name);
    return out;
  }

 private:
  struct entry {
    std::string_view name;
    std::string_view doc;
    std::function<void(T&, std::string_view)> parse;
    std::function<std::string(const T&)> format;
  };
  static void apply(const entry& e, T& t, std::string_view value, std::string_view origin) {
    try {
      e.parse(t, value);
    } catch (const bad_setting& b) {
      settings_detail::refused(e.name, value, origin, b.why);
    }
  }
  const entry* find(std::string_view name) const {
    for (auto& e : rows_)
      if (e.name == name) return &e;
    return nullptr;
  }
  std::vector<entry> rows_;
};

}  // namespace ferry
