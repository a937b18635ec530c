// Smallest useful ferry program: move data to a device and verify it there.
#include <ferry/core/checksum.hpp>
#include <ferry/runtime.hpp>

#include <cstdio>
#include <vector>

int main() try {
  ferry::runtime rt;
  ferry::device& dev = rt.devices().default_device();  // a GPU if there is one, else sim:0
  std::uint64_t g = dev.granularity();
  ferry::va_range va = dev.reserve(g);
  ferry::physical_chunk chunk = dev.allocate(g);
  dev.map(va.base(), chunk);
  ferry::access_desc rw{ferry::location::on_device(), ferry::access::read_write};
  dev.set_access(va.base(), g, {&rw, 1});

  std::vector<unsigned char> host(g);
  ferry::fill_pattern(host.data(), host.size(), 2024);
  auto s = dev.create_stream();
  std::uint64_t sum = 0;
  s->copy(va.base(), host.data(), host.size());
  s->checksum(va.base(), host.size(), &sum);
  s->synchronize();
  bool ok = sum == ferry::pattern_checksum(host.size(), 2024);
  std::printf("ferry %s: %zu bytes to %s, checksum %s\n", ferry::version(), host.size(), dev.id().c_str(),
              ok ? "verified" : "MISMATCH");
  dev.unmap(va.base(), g);
  return ok ? 0 : 1;
} catch (const ferry::error& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}
