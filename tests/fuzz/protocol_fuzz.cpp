// libFuzzer target for the wire-protocol decoder: any input must decode or be refused with a
// ferry::error (protocol_error); anything else (a crash, a sanitizer report, another exception) is a bug.
#include <ferry/net/protocol.hpp>

#include <cstdlib>

extern "C" int LLVMFuzzerTestOneInput(const unsigned char* data, std::size_t size) {
  try {
    auto m = ferry::net::decode({reinterpret_cast<const std::byte*>(data), size});
    // What decodes must re-encode to the same bytes (no silent reinterpretation).
    auto again = ferry::net::encode(m);
    if (again.size() != size) std::abort();
  } catch (const ferry::error& e) {
    if (e.code() != ferry::errc::protocol_error) std::abort();
  }
  return 0;
}
