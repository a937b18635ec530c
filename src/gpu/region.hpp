#pragma once
// Memory of the gpu layer's own (rings, the page cache's frames and words), where its requesters run:
// device memory for kernels; for host requesters, host memory mapped for the device and the CPU at
// one address.
#include <ferry/device/device.hpp>
#include <ferry/gpu/proxy.hpp>

#include <vector>

namespace ferry::gpu {

struct region {
  physical_chunk chunk;
  va_range va;  // after the chunk: unmapped before the chunk is returned
  std::uint64_t bytes = 0;
  region() = default;
  region(device& dev, std::uint64_t want, requesters by) {
    const std::uint64_t g = dev.granularity();
    bytes = (want + g - 1) / g * g;
    va = dev.reserve(bytes);
    chunk = dev.allocate(bytes, by == requesters::device ? location::on_device() : location::on_host());
    dev.map(va.base(), chunk);
    std::vector<access_desc> who{{location::on_device(dev.info().ordinal), access::read_write}};
    if (by == requesters::host) who.push_back({location::on_host(), access::read_write});
    dev.set_access(va.base(), bytes, who);
  }
};

}  // namespace ferry::gpu
