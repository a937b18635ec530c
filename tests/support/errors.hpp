#pragma once
// Runs f and returns the text of the ferry::error it throws, or "(no error)": tests assert the
// message, since the message is what a user sees.
#include <ferry/core/error.hpp>

#include <string>

namespace ferry::test {

template <typename F>
std::string error_text(F&& f) {
  try {
    f();
  } catch (const error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace ferry::test
