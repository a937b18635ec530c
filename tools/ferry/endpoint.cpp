#include "endpoint.hpp"

#include <ferry/core/checksum.hpp>
#include <ferry/core/units.hpp>

#include <fmt/format.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstring>

namespace ferry::cli {
namespace {

std::pair<std::string, std::uint64_t> split(const std::string& spec) {
  auto plus = spec.find('+');
  if (plus == std::string::npos) return {spec, 0};
  return {spec.substr(0, plus), parse_size(spec.substr(plus + 1), "endpoint offset")};
}

}  // namespace

device* endpoint::device_of(runtime& rt, const std::string& spec) {
  auto [kind, off] = split(spec);
  if (kind == "host" || kind == "pinned") return nullptr;
  if (kind.starts_with("file:")) fail(errc::invalid_argument, "cp", spec, "a file is not a memory endpoint here");
  return &rt.devices().get(kind);
}

endpoint::endpoint(runtime& rt, const std::string& spec, std::uint64_t bytes, std::span<device* const> peers)
    : spec_(spec) {
  auto [kind, off] = split(spec);
  if (off % 8) fail(errc::invalid_argument, "cp", spec, "offset must be a multiple of 8 (for on-device verification)");
  std::uint64_t total = bytes + off;
  dev_ = device_of(rt, spec);
  if (dev_) {
    mem_ = allocate_mapped(*dev_, total, location::on_device(), peers);
    ptr_ = mem_.data() + off;
    return;
  }
  host_len_ = total;
  host_ = ::mmap(nullptr, host_len_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (host_ == MAP_FAILED) fail_errno(errno, "cp", spec, fmt::format("cannot allocate {}", format_size(total)));
  std::memset(host_, 0, host_len_);  // populate: measure copies, not page faults
  ptr_ = static_cast<std::byte*>(host_) + off;
  if (kind == "pinned") pin_ = rt.registrations().acquire(host_, host_len_);
}

endpoint::~endpoint() {
  pin_ = registration{};
  if (host_ && host_ != MAP_FAILED) ::munmap(host_, host_len_);
}

void endpoint::fill(std::uint64_t bytes, std::uint64_t seed) {
  if (!dev_) return fill_pattern(ptr_, bytes, seed);
  auto s = dev_->create_stream();
  s->fill_pattern(ptr_, bytes, seed);
  s->synchronize();
}

std::uint64_t endpoint::checksum(std::uint64_t bytes, std::uint64_t offset) {
  if (!dev_) return checksum64(ptr_ + offset, bytes);
  auto s = dev_->create_stream();
  std::uint64_t sum = 0;
  s->checksum(ptr_ + offset, bytes, &sum);
  s->synchronize();
  return sum;
}

}  // namespace ferry::cli
