// The device interface's conformance suite: the same tests against every backend.
//   ferry_device_conformance --backend=sim    (CPU, label "cpu")
//   ferry_device_conformance --backend=cuda   (label "gpu"; exits 77 = skipped when no GPU is usable)
#include <ferry/core/checksum.hpp>
#include <ferry/device/registry.hpp>
#include <ferry/settings.hpp>

#include "support/errors.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>

using namespace ferry;
using ::testing::HasSubstr;

namespace {

std::string g_backend = "sim";
device_registry* g_registry = nullptr;

std::vector<std::uint64_t> random_words(std::size_t n, std::uint64_t seed) {
  std::vector<std::uint64_t> v(n);
  std::mt19937_64 rng(seed);
  for (auto& w : v) w = rng();
  return v;
}

// A reserved range with device chunks mapped and read-write for the device.
struct mapped_region {
  device& dev;
  va_range va;
  std::vector<physical_chunk> chunks;
  mapped_region(device& d, std::size_t nchunks, location where = location::on_device()) : dev(d) {
    std::uint64_t g = std::max(d.granularity(), d.granularity(where));
    va = d.reserve(g * nchunks);
    for (std::size_t i = 0; i < nchunks; ++i) {
      chunks.push_back(d.allocate(g, where));
      d.map(va.at(i * g), chunks.back());
    }
    access_desc rw[] = {{location::on_device(), access::read_write}};
    d.set_access(va.base(), va.size(), rw);
  }
  std::uint64_t size() const { return va.size(); }
};

class DeviceConformance : public ::testing::Test {
 protected:
  device& dev() { return g_registry->get(g_backend + ":0"); }
  std::uint64_t gran() { return dev().granularity(); }
  // The second device of the backend when it has peer access with the first; else null and why.
  device* peer(std::string& why) {
    device* other = nullptr;
    try {
      other = &g_registry->get(g_backend + ":1");
    } catch (const error&) {
      why = "only one " + g_backend + " device";
      return nullptr;
    }
    if (!g_registry->peer(dev(), *other).access) {
      why = "no peer access between " + dev().id() + " and " + other->id();
      return nullptr;
    }
    return other;
  }
};

TEST_F(DeviceConformance, InfoIsFilledIn) {
  const device_info& i = dev().info();
  EXPECT_EQ(to_string(i.backend), g_backend);
  EXPECT_EQ(i.ordinal, 0);
  EXPECT_FALSE(i.name.empty());
  EXPECT_GT(i.total_memory, 0u);
  EXPECT_GT(i.granularity, 0u);
  EXPECT_EQ(i.granularity & (i.granularity - 1), 0u) << "granularity is a power of two";
  memory_usage m = dev().memory();
  EXPECT_LE(m.free, m.total);
}

TEST_F(DeviceConformance, MapCopyRoundTripWithRandomData) {
  mapped_region r(dev(), 3);
  auto src = random_words(r.size() / 8, 1);
  std::vector<std::uint64_t> back(src.size(), 0);
  auto s = dev().create_stream();
  s->copy(r.va.base(), src.data(), r.size());
  s->copy(back.data(), r.va.base(), r.size());
  s->synchronize();
  EXPECT_EQ(std::memcmp(src.data(), back.data(), r.size()), 0);
  // Unaligned offsets and odd lengths across chunk boundaries.
  std::vector<unsigned char> bytes(r.size(), 0);
  std::uint64_t off = gran() - 3, len = gran() + 11;
  s->copy(bytes.data(), r.va.at(off), len);
  s->synchronize();
  EXPECT_EQ(std::memcmp(bytes.data(), reinterpret_cast<const unsigned char*>(src.data()) + off, len), 0);
}

TEST_F(DeviceConformance, CopyBySmsMovesDataBetweenHostAndDeviceChunks) {
  mapped_region d(dev(), 2);
  std::uint64_t g = std::max(gran(), dev().granularity(location::on_host()));
  va_range hv = dev().reserve(2 * g);
  physical_chunk hc = dev().allocate(2 * g, location::on_host());
  dev().map(hv.base(), hc);
  access_desc both[] = {{location::on_device(), access::read_write}, {location::on_host(), access::read_write}};
  dev().set_access(hv.base(), hv.size(), both);
  auto src = random_words(hv.size() / 8, 7);
  std::memcpy(hv.base(), src.data(), hv.size());
  auto s = dev().create_stream();
  s->copy(d.va.base(), hv.base(), hv.size(), copy_engine::sm);  // host chunk -> device
  s->synchronize();
  std::memset(hv.base(), 0, hv.size());
  s->copy(hv.base(), d.va.base(), hv.size(), copy_engine::sm);  // and back
  s->synchronize();
  EXPECT_EQ(std::memcmp(hv.base(), src.data(), hv.size()), 0);
  // Unaligned ends and an odd length across the device chunks' boundary: the byte path.
  std::memset(hv.base(), 0, hv.size());
  std::uint64_t off = g - 5, len = g - 13;
  s->copy(static_cast<std::byte*>(hv.base()) + 3, d.va.at(off), len, copy_engine::sm);
  s->synchronize();
  EXPECT_EQ(std::memcmp(static_cast<std::byte*>(hv.base()) + 3, reinterpret_cast<const std::byte*>(src.data()) + off, len), 0);
  // Memory outside the device's ranges is refused, naming the end.
  std::vector<std::uint64_t> plain(16);
  try {
    s->copy(plain.data(), d.va.base(), sizeof(std::uint64_t) * plain.size(), copy_engine::sm);
    ADD_FAILURE() << "an SM copy into ordinary host memory was accepted";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("dst"), std::string::npos) << e.what();
  }
  dev().unmap(hv.base(), hv.size());
}

TEST_F(DeviceConformance, DeviceToDeviceCopyWithinTheDevice) {
  mapped_region a(dev(), 1), b(dev(), 1);
  auto s = dev().create_stream();
  s->fill_pattern(a.va.base(), a.size(), 99);
  s->copy(b.va.base(), a.va.base(), a.size());
  std::uint64_t sum = 0;
  s->checksum(b.va.base(), b.size(), &sum);
  s->synchronize();
  EXPECT_EQ(sum, pattern_checksum(b.size(), 99));
}

TEST_F(DeviceConformance, DeviceChecksumAndPatternMatchTheCpu) {
  mapped_region r(dev(), 2);
  auto s = dev().create_stream();
  for (std::uint64_t len : {std::uint64_t{8}, std::uint64_t{13}, std::uint64_t{4096 + 5}, r.size()}) {
    auto src = random_words(r.size() / 8, len);
    std::uint64_t got = 0;
    s->copy(r.va.base(), src.data(), len);
    s->checksum(r.va.base(), len, &got);
    s->synchronize();
    EXPECT_EQ(got, checksum64(src.data(), len)) << "len " << len;
    s->fill_pattern(r.va.base(), len, 7);
    std::vector<unsigned char> back(len);
    s->copy(back.data(), r.va.base(), len);
    s->synchronize();
    EXPECT_EQ(checksum64(back.data(), len), pattern_checksum(len, 7)) << "len " << len;
  }
}

TEST_F(DeviceConformance, HostChunkIsCoherentForCpuAndDeviceAtTheSameAddress) {
  std::uint64_t g = dev().granularity(location::on_host());
  va_range va = dev().reserve(std::max(g, gran()));
  physical_chunk c = dev().allocate(va.size(), location::on_host());
  dev().map(va.base(), c);
  access_desc grants[] = {{location::on_device(), access::read_write}, {location::on_host(), access::read_write}};
  dev().set_access(va.base(), va.size(), grants);
  // CPU writes, device reads the same address.
  fill_pattern(va.base(), va.size(), 5);
  auto s = dev().create_stream();
  std::uint64_t sum = 0;
  s->checksum(va.base(), va.size(), &sum);
  s->synchronize();
  EXPECT_EQ(sum, pattern_checksum(va.size(), 5));
  // Device writes, CPU reads the same address.
  s->fill_pattern(va.base(), va.size(), 6);
  s->synchronize();
  EXPECT_EQ(checksum64(va.base(), va.size()), pattern_checksum(va.size(), 6));
  dev().unmap(va.base(), va.size());
}

TEST_F(DeviceConformance, MapRejectsBadInput) {
  va_range va = dev().reserve(2 * gran());
  physical_chunk c = dev().allocate(gran());
  auto text = [](auto f) { return test::error_text(f); };
  EXPECT_THAT(text([&] { dev().map(va.at(4096), c); }), HasSubstr("not aligned to the granularity"));
  EXPECT_THAT(text([&] { dev().map(va.at(2 * gran()), c); }), HasSubstr("not inside a range reserved"));
  dev().map(va.base(), c);
  physical_chunk c2 = dev().allocate(gran());
  EXPECT_THAT(text([&] { dev().map(va.base(), c2); }), HasSubstr("overlaps an existing mapping"));
  EXPECT_THAT(text([&] { dev().unmap(va.at(gran()), gran()); }), HasSubstr("no mapping starts at"));
  EXPECT_THAT(text([&] { dev().allocate(gran() + 1); }), HasSubstr("multiple of the granularity"));
  EXPECT_THAT(text([&] { dev().allocate(0); }), HasSubstr("positive multiple"));
  EXPECT_THAT(text([&] { dev().reserve(gran() / 2); }), HasSubstr("multiple of the granularity"));
  access_desc cpu[] = {{location::on_host(), access::read_write}};
  EXPECT_THAT(text([&] { dev().set_access(va.base(), gran(), cpu); }), HasSubstr("cannot be granted access to device memory"));
  EXPECT_THAT(text([&] { dev().set_access(va.at(gran()), gran(), cpu); }), HasSubstr("is not the start of a mapping"));
  dev().unmap(va.base(), gran());
}

TEST_F(DeviceConformance, CopyToUnmappedOrInaccessibleAddressIsBadAddress) {
  va_range va = dev().reserve(2 * gran());
  physical_chunk c = dev().allocate(gran());
  dev().map(va.base(), c);  // mapped but no access granted yet
  std::vector<std::uint64_t> host(512, 1);
  auto s = dev().create_stream();
  try {
    s->copy(va.at(gran()), host.data(), 4096);
    s->synchronize();
    FAIL() << "copy into an unmapped address succeeded";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::bad_address);
    EXPECT_THAT(e.what(), HasSubstr("reserved on " + dev().id() + " but not mapped"));
    EXPECT_THAT(e.what(), HasSubstr("dst="));
  }
  try {
    s->copy(va.base(), host.data(), 4096);
    FAIL() << "copy into a mapping without access succeeded";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::bad_address);
    EXPECT_THAT(e.what(), HasSubstr("without write access"));
  }
  // The stream still works after refused requests.
  access_desc rw[] = {{location::on_device(), access::read_write}};
  dev().set_access(va.base(), gran(), rw);
  s->copy(va.base(), host.data(), 4096);
  s->synchronize();
  dev().unmap(va.base(), gran());
}

TEST_F(DeviceConformance, NullAndOverflowingArgumentsAreRefused) {
  auto s = dev().create_stream();
  std::uint64_t x = 0;
  EXPECT_THROW(s->copy(nullptr, &x, 8), error);
  EXPECT_THROW(s->copy(&x, reinterpret_cast<void*>(~std::uintptr_t{0} - 4), 64), error);
  EXPECT_THROW(s->fill_pattern(reinterpret_cast<char*>(&x) + 1, 4, 1), error);
  EXPECT_THROW(s->checksum(&x, 8, nullptr), error);
}

TEST_F(DeviceConformance, EventsOrderWorkAcrossStreams) {
  mapped_region r(dev(), 1);
  auto a = dev().create_stream();
  auto b = dev().create_stream();
  a->fill_pattern(r.va.base(), r.size(), 11);
  auto e = a->record();
  b->wait(*e);
  std::uint64_t sum = 0;
  b->checksum(r.va.base(), r.size(), &sum);
  b->synchronize();
  EXPECT_TRUE(e->done());
  EXPECT_EQ(sum, pattern_checksum(r.size(), 11));
  e->wait(deadline_after(std::chrono::seconds(5)));
  EXPECT_TRUE(a->idle());
}

TEST_F(DeviceConformance, ChunkReleasedWhileMappedStaysUsableUntilUnmapped) {
  va_range va = dev().reserve(gran());
  {
    physical_chunk c = dev().allocate(gran());
    dev().map(va.base(), c);
  }  // released here, still mapped
  access_desc rw[] = {{location::on_device(), access::read_write}};
  dev().set_access(va.base(), gran(), rw);
  auto s = dev().create_stream();
  s->fill_pattern(va.base(), gran(), 3);
  std::uint64_t sum = 0;
  s->checksum(va.base(), gran(), &sum);
  s->synchronize();
  EXPECT_EQ(sum, pattern_checksum(gran(), 3));
  dev().unmap(va.base(), gran());
}

TEST_F(DeviceConformance, RangeReleaseUnmapsWhatIsLeft) {
  auto before = dev().counters().get("unmaps").value();
  {
    mapped_region r(dev(), 2);
  }
  EXPECT_EQ(dev().counters().get("unmaps").value(), before + 2);
}

TEST_F(DeviceConformance, PeerCopyWhenASecondDeviceExists) {
  std::string why;
  device* other = peer(why);
  if (!other) GTEST_SKIP() << why;
  mapped_region mine(dev(), 2);
  // Memory of the other device, granted to both.
  va_range va = other->reserve(mine.size());
  std::vector<physical_chunk> cs;
  for (std::uint64_t off = 0; off < va.size(); off += other->granularity()) {
    cs.push_back(other->allocate(other->granularity()));
    other->map(va.at(off), cs.back());
  }
  access_desc both[] = {{location::on_device(other->info().ordinal), access::read_write},
                        {location::on_device(dev().info().ordinal), access::read_write}};
  other->set_access(va.base(), va.size(), both);
  auto s = dev().create_stream();
  auto src = random_words(mine.size() / 8, 77);
  s->copy(mine.va.base(), src.data(), mine.size());
  s->copy(va.base(), mine.va.base(), mine.size());  // this device's engine writes the peer
  s->synchronize();
  auto t = other->create_stream();
  std::uint64_t sum = 0;
  t->checksum(va.base(), va.size(), &sum);
  t->synchronize();
  EXPECT_EQ(sum, checksum64(src.data(), mine.size()));
}

TEST_F(DeviceConformance, PeerMemoryMapsInThisDevicesRangeForBothDevices) {
  std::string why;
  device* other = peer(why);
  if (!other) GTEST_SKIP() << why;
  const int peer_ordinal = other->info().ordinal;
  std::uint64_t g = gran();
  auto before = other->memory().free;
  // One range of this device: a chunk of its own memory, then one of the peer's.
  va_range va = dev().reserve(2 * g);
  physical_chunk mine = dev().allocate(g);
  physical_chunk theirs = dev().allocate(g, location::on_device(peer_ordinal));
  EXPECT_EQ(theirs.where().id, peer_ordinal);
  EXPECT_EQ(theirs.owner(), &dev()) << "the chunk is this device's to map";
  if (g_backend == "sim") {
    EXPECT_EQ(other->memory().free, before - g) << "it counts against the peer's memory";
  }
  dev().map(va.at(0), mine);
  dev().map(va.at(g), theirs);
  access_desc both[] = {{location::on_device(dev().info().ordinal), access::read_write},
                        {location::on_device(peer_ordinal), access::read_write}};
  dev().set_access(va.base(), va.size(), both);
  auto src = random_words(2 * g / 8, 91);
  auto s = dev().create_stream();
  s->copy(va.base(), src.data(), 2 * g);  // this device writes both chunks
  s->synchronize();
  auto t = other->create_stream();
  std::uint64_t sum = 0;
  t->checksum(va.base(), 2 * g, &sum);  // the peer reads both, its own memory included, at the same address
  t->synchronize();
  EXPECT_EQ(sum, checksum64(src.data(), 2 * g));
  std::vector<std::uint64_t> back(2 * g / 8);
  t->copy(back.data(), va.at(g), g);  // the peer's engine copies its part out
  t->synchronize();
  EXPECT_EQ(0, std::memcmp(back.data(), src.data() + g / 8, g));
  va.reset();
  theirs.reset();
  if (g_backend == "sim") {
    EXPECT_EQ(other->memory().free, before);
  }
  EXPECT_THAT(test::error_text([&] { (void)dev().allocate(g, location::on_device(64)); }), HasSubstr("out of range"));
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], "--backend=", 10) == 0) g_backend = argv[i] + 10;
  settings s = settings::from_env();
  if (g_backend == "sim") s.sim_capacity = std::max<std::uint64_t>(s.sim_capacity, 256ull << 20);
  device_registry registry(s);
  g_registry = &registry;
  if (g_backend == "cuda") {
    backend_status st = registry.cuda_status();
    if (!st.available) {
      std::printf("SKIPPED: no usable CUDA device: %s\n", st.reason.c_str());
      return 77;
    }
  }
  return RUN_ALL_TESTS();
}
