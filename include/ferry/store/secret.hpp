#pragma once
// The storage service's shared secret, read from a file (FERRY_SECRET_FILE, `ferry serve --secret-file`).
#include <ferry/core/export.hpp>

#include <string>

namespace ferry::store {

// The file's contents without a trailing newline; throws naming the path when it is missing or empty.
FERRY_API std::string read_secret_file(const std::string& path);

}  // namespace ferry::store
