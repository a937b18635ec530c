#pragma once
// ferry://host:port/path names: a file under the root a `ferry serve` exports.
#include <ferry/core/export.hpp>

#include <cstdint>
#include <string>

namespace ferry::store {

struct uri {
  std::string host;  // name or address; [IPv6] without the brackets
  std::uint16_t port = 0;
  std::string path;  // relative to the server's root (no leading '/')
};

// Parses ferry://host:port/path (host may be [IPv6]); throws invalid_argument naming the URI.
FERRY_API uri parse_uri(const std::string& text);

}  // namespace ferry::store
