#include <ferry/device/mapped_memory.hpp>

namespace ferry {

mapped_memory& mapped_memory::operator=(mapped_memory&& o) noexcept {
  if (this != &o) {
    this->~mapped_memory();
    new (this) mapped_memory();
    va_ = std::move(o.va_);
    chunks_ = std::move(o.chunks_);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

mapped_memory::~mapped_memory() {
  // Unmap before the chunks go (the range's release would do it too, but explicitly is clearer).
  if (va_ && !chunks_.empty()) va_.owner()->unmap(va_.base(), va_.size());
  chunks_.clear();
  va_.reset();
}

mapped_memory allocate_mapped(device& d, std::uint64_t bytes, location where, std::span<device* const> peers) {
  expects(bytes > 0, "device.allocate_mapped", d.id(), "zero bytes");
  std::uint64_t g = std::max(d.granularity(), d.granularity(where));
  std::uint64_t total = (bytes + g - 1) / g * g;
  mapped_memory m;
  m.va_ = d.reserve(total);
  m.bytes_ = bytes;
  for (std::uint64_t off = 0; off < total; off += g) {
    m.chunks_.push_back(d.allocate(g, where));
    d.map(m.va_.at(off), m.chunks_.back());
  }
  std::vector<access_desc> grants{{location::on_device(), access::read_write}};
  for (device* p : peers)
    if (p && p != &d) grants.push_back({location::on_device(p->info().ordinal), access::read_write});
  if (where.kind == memory_kind::host) grants.push_back({location::on_host(), access::read_write});
  d.set_access(m.va_.base(), total, grants);
  return m;
}

}  // namespace ferry
