#include <ferry/net/protocol.hpp>

#include "support/errors.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <random>
#include <set>
#include <variant>

using namespace ferry;
using namespace ferry::net;
using ::testing::HasSubstr;

namespace {

std::vector<std::uint8_t> bytes32(std::uint8_t v) { return std::vector<std::uint8_t>(32, v); }

std::vector<message> samples() {
  return {
      {1, 0, hello{1, 1, 64, bytes32(7), 4, std::vector<std::uint8_t>(ticket_size, 5), {40001, 40002, 40003, 40004}}},
      {2, 0, challenge{bytes32(9), true}},
      {3, 0, auth{bytes32(1)}},
      {4, 16, welcome{16, 1ull << 30, true, 0x5eed5eed5eed5eedull, std::vector<std::uint8_t>(ticket_size, 0xcd),
                      "ferry-serve-5eed-42", std::vector<std::uint8_t>(lend_token_size, 0xab)}},
      {5, 0, read_req{"data/shard-0001.bin", 1ull << 33, 4096}},
      {6, 0, write_req{"out/x", 7, 9, 0x1234567890abcdefull}},
      {7, 0, stat_req{"a"}},
      {8, 0, list_req{"dir/sub", "after-this"}},
      {9, 3, complete{0, 12345}},
      {10, 0, stat_reply{99, 0100644, 1700000000123456789}},
      {11, 0, list_reply{{{"a.bin", 0, 10}, {"sub", 1, 0}}, true}},
      {12, 0, error_reply{2, "no such file"}},
      {13, 0, lend{0x7f0000000000, 256 << 20, 77}},
      {14, 0, read_into{"kv/block-7", 4096, 1 << 20, 0x7f0000100000}},
      {14, 0, read_into{"kv/block-7", 4096, 4096, 0x7f0000100000, 0x7f0000000fc0}},
      {15, 0, write_from{"kv/block-8", 0, 4096, 0x7f0000200000}},
      {16, 0, read_rma{"kv/block-9", 8192, 1 << 20, 0x7f0000300000, std::vector<std::uint8_t>(60, 3)}},
      {17, 0, write_rma{"kv/block-10", 0, 4096, 0x7f0000400000, std::vector<std::uint8_t>(60, 4)}},
      {18, 0, read_rma{"empty-key", 0, 1, 0x1000, {}}},  // found by the fuzzer: an empty rkey (memcpy from null)
      {19, 0, open_write{"out/new.bin", write_mode::keep, 5 << 20}},
      {20, 0, end_write{0x1234567890abcdefull, 1 << 20, write_end::commit_size}},
      {21, 0, read_many{"cache/pages.bin", 0x77, {{4096, 4096}, {1ull << 33, 100}, {0, 1}}, 0x7f0012340000}},
  };
}

// Every message type round-trips; the samples cover every type. With FERRY_FUZZ_SEEDS=DIR the frames are
// written there too: the fuzzer's seed corpus (scripts/fuzz-protocol) comes from the current encoder.
TEST(Protocol, EveryMessageRoundTrips) {
  std::set<std::size_t> types;
  const char* seeds = std::getenv("FERRY_FUZZ_SEEDS");
  int n = 0;
  for (auto& m : samples()) {
    types.insert(m.b.index());
    auto frame = encode(m);
    if (seeds) {
      std::ofstream f(std::string(seeds) + "/seed-" + std::to_string(n++), std::ios::binary);
      f.write(reinterpret_cast<const char*>(frame.data()), static_cast<std::streamsize>(frame.size()));
      ASSERT_TRUE(f.good()) << "cannot write a seed into " << seeds;
    }
    message d = decode(frame);
    EXPECT_EQ(d.request_id, m.request_id);
    EXPECT_EQ(d.credits, m.credits);
    EXPECT_EQ(d.b.index(), m.b.index());
    EXPECT_EQ(encode(d), frame) << "re-encoding is identical";
  }
  auto r = std::get<read_req>(decode(encode(samples()[4])).b);
  EXPECT_EQ(r.path, "data/shard-0001.bin");
  EXPECT_EQ(r.offset, 1ull << 33);
  EXPECT_EQ(std::get<write_req>(decode(encode(samples()[5])).b).handle, 0x1234567890abcdefull);
  auto ow = std::get<open_write>(decode(encode(samples()[19])).b);
  EXPECT_EQ(ow.path, "out/new.bin");
  EXPECT_EQ(ow.mode, write_mode::keep);
  EXPECT_EQ(ow.size_hint, 5u << 20);
  auto ew = std::get<end_write>(decode(encode(samples()[20])).b);
  EXPECT_EQ(ew.handle, 0x1234567890abcdefull);
  EXPECT_EQ(ew.size, 1u << 20);
  EXPECT_EQ(ew.how, write_end::commit_size);
  auto bad_end = encode(samples()[20]);
  bad_end.back() = std::byte{7};
  EXPECT_THAT(test::error_text([&] { decode(bad_end); }), HasSubstr("unknown write end 7"));
  auto w = std::get<welcome>(decode(encode(samples()[3])).b);
  EXPECT_EQ(w, std::get<welcome>(samples()[3].b)) << "instance and ticket survive the wire";
  EXPECT_EQ(types.size(), std::variant_size_v<body>) << "a message type without a sample (and so without a fuzz seed)";
}

// A sender reuses one buffer for every frame (no allocation per request): whatever it held
// before, longer or shorter, the bytes are exactly encode()'s.
TEST(Protocol, EncodingIntoAReusedBufferGivesTheSameBytes) {
  auto all = samples();
  std::vector<std::byte> buf;
  for (int pass = 0; pass < 2; ++pass) {
    for (auto& m : all) {
      encode_into(m, buf);
      EXPECT_EQ(buf, encode(m)) << "message " << m.request_id;
      EXPECT_EQ(decode(buf).request_id, m.request_id);
    }
    std::reverse(all.begin(), all.end());
  }
  // A frame that cannot be encoded throws; the buffer is then usable again.
  EXPECT_THROW(encode_into({1, 0, read_req{std::string("a\0b", 3), 0, 1}}, buf), error);
  encode_into(all[0], buf);
  EXPECT_EQ(buf, encode(all[0]));
}

TEST(Protocol, HandshakeLanesPortsAndTicketsAreChecked) {
  auto text = [](std::vector<std::byte> f) { return test::error_text([&] { decode(f); }); };
  // A hello's layout after the header: min u16, max u16, max_outstanding u32, nonce (u16 length +
  // bytes), lanes u16, ticket (u16 length + bytes), port count u8, ports u16 each.
  constexpr std::size_t lanes_at = header_size + 2 + 2 + 4 + 2 + nonce_size;
  constexpr std::size_t ticket_at = lanes_at + 2;
  auto hi = [](std::vector<std::uint8_t> ticket, std::vector<std::uint16_t> ports) {
    return encode({1, 0, hello{1, 1, 64, std::vector<std::uint8_t>(nonce_size, 1), static_cast<std::uint16_t>(ports.size()),
                               std::move(ticket), std::move(ports)}});
  };
  auto zero_lanes = hi({}, {1000});
  zero_lanes[lanes_at] = zero_lanes[lanes_at + 1] = std::byte{0};
  EXPECT_THAT(text(zero_lanes), HasSubstr("0 lanes (1 to 64)"));
  auto many = hi({}, {1000});
  many[ticket_at + 2] = std::byte{200};  // the port count (the ticket is empty)
  EXPECT_THAT(text(many), HasSubstr("200 ports (at most 64)"));
  auto zero = hi({}, {1000});
  zero[ticket_at + 3] = zero[ticket_at + 4] = std::byte{0};
  EXPECT_THAT(text(zero), HasSubstr("port 0"));
  auto short_list = hi({}, {1000, 1001});
  short_list[ticket_at + 2] = std::byte{64};  // claims more ports than the frame holds
  EXPECT_THAT(text(short_list), HasSubstr("truncated port"));
  auto odd_ticket = hi(std::vector<std::uint8_t>(ticket_size, 9), {1000});
  odd_ticket[ticket_at] = std::byte{ticket_size - 1};
  EXPECT_THAT(text(odd_ticket), HasSubstr("a ticket of 15 bytes (want 16)"));
  EXPECT_THAT(test::error_text([&] { hi({}, std::vector<std::uint16_t>(max_ports + 1, 9)); }), HasSubstr("ports"));
  EXPECT_THAT(test::error_text([&] { hi(std::vector<std::uint8_t>(ticket_size + 1, 9), {1}); }), HasSubstr("ticket"));
  auto odd_nonce = hi({}, {1000});
  odd_nonce[header_size + 8] = std::byte{nonce_size - 1};
  EXPECT_THAT(text(odd_nonce), HasSubstr("nonce"));
}

TEST(Protocol, LentRegionsAndDirectRequestsAreBoundsChecked) {
  // An address range that wraps is refused by the decoder, before the server looks at it.
  auto wrap = encode({1, 0, read_into{"f", 0, 4096, ~0ull - 100}});
  EXPECT_THAT(test::error_text([&] { decode(wrap); }), HasSubstr("address + length overflows"));
  auto odd = encode({1, 0, read_into{"f", 0, 4096, 4096, 4097}});
  EXPECT_THAT(test::error_text([&] { decode(odd); }), HasSubstr("notify record misaligned"));
  auto region = encode({1, 0, lend{~0ull - 10, 100, 1}});
  EXPECT_THAT(test::error_text([&] { decode(region); }), HasSubstr("address + length overflows"));
  // A welcome's lending socket name is bounded, and its token has its fixed size.
  welcome w;
  w.lending = std::string(max_socket_name + 1, 'x');
  EXPECT_THAT(test::error_text([&] { encode({1, 0, w}); }), HasSubstr("lending socket"));
  w.lending = "s";
  w.token.resize(3);
  EXPECT_THAT(test::error_text([&] { encode({1, 0, w}); }), HasSubstr("expected 16 bytes"));
  // RMA requests: the same checks on the address range and the rkey.
  auto rwrap = encode({1, 0, read_rma{"f", 0, 4096, ~0ull - 100, {1, 2}}});
  EXPECT_THAT(test::error_text([&] { decode(rwrap); }), HasSubstr("address + length overflows"));
  auto rrk = encode({1, 0, write_rma{"f", 0, 4096, 4096, {1, 2, 3}}});
  rrk[header_size + 24] = std::byte{200};  // rkey length: 200 bytes claimed, 3 + path present
  EXPECT_THAT(test::error_text([&] { decode(rrk); }), HasSubstr("truncated"));
  EXPECT_THAT(test::error_text([&] { encode({1, 0, read_rma{"f", 0, 1, 0, std::vector<std::uint8_t>(max_rkey + 1)}}); }),
              HasSubstr("rkey"));
}

// Several ranges in one read: the count, each range and their sum are bounded by the decoder, before
// the server sizes an answer for them.
TEST(Protocol, ReadManyRangesAreBounded) {
  auto m = std::get<read_many>(decode(encode(samples()[21])).b);
  EXPECT_EQ(m.path, "cache/pages.bin");
  EXPECT_EQ(m.version, 0x77u);
  EXPECT_EQ(m.into, 0x7f0012340000u);
  ASSERT_EQ(m.ranges.size(), 3u);
  EXPECT_EQ(m.ranges[1].offset, 1ull << 33);
  EXPECT_EQ(m.ranges[1].length, 100u);
  EXPECT_EQ(read_many_answer_bytes(m.ranges), 3 * 8 + 4096 + 100 + 1u);
  auto text = [](const read_many& r) { return test::error_text([&] { decode(encode({1, 0, r})); }); };
  EXPECT_THAT(test::error_text([] { encode({1, 0, read_many{"f", 0, {}}}); }), HasSubstr("0 ranges"));
  EXPECT_THAT(test::error_text([] { encode({1, 0, read_many{"f", 0, std::vector<read_range>(max_read_ranges + 1, {0, 1})}}); }),
              HasSubstr("1025 ranges"));
  EXPECT_THAT(text({"f", 0, {{0, 1}, {7, 0}}}), HasSubstr("an empty range"));
  EXPECT_THAT(text({"f", 0, {{~0ull - 10, 100}}}), HasSubstr("overflows"));
  EXPECT_THAT(text({"f", 0, std::vector<read_range>(max_read_many_bytes / max_read_range + 1, {0, max_read_range})}), HasSubstr("in all"));
  EXPECT_THAT(text({"f", 0, {{0, max_read_range + 1}}}), HasSubstr("a range of 65537 bytes"));
  EXPECT_THAT(text({"f", 0, {{0, ~0ull >> 1}}}), HasSubstr("at most 65536"));
  EXPECT_NO_THROW(decode(encode({1, 0, read_many{"f", 0, std::vector<read_range>(max_read_ranges, {0, max_read_many_bytes / max_read_ranges})}})));
  // A count that claims more ranges than the frame holds is truncated, not allocated for.
  auto f = encode({1, 0, read_many{"f", 0, {{0, 1}}}});
  f[header_size + 16] = std::byte{0x04};  // the count's low byte (after version and into): 1 -> 4
  EXPECT_THAT(test::error_text([&] { decode(f); }), HasSubstr("truncated"));
}

TEST(Protocol, MalformedFramesAreRefusedWithTheReason) {
  auto frame = encode(samples()[4]);
  auto text = [](std::vector<std::byte> f) { return test::error_text([&] { decode(f); }); };
  auto bad_magic = frame;
  bad_magic[0] = std::byte{0};
  EXPECT_THAT(text(bad_magic), HasSubstr("bad magic"));
  auto bad_version = frame;
  bad_version[4] = static_cast<std::byte>(protocol_version + 1);
  EXPECT_THAT(text(bad_version), HasSubstr("unsupported protocol version " + std::to_string(protocol_version + 1)));
  auto truncated = frame;
  truncated.pop_back();
  EXPECT_THAT(text(truncated), HasSubstr("header says"));
  auto trailing = frame;
  trailing.push_back(std::byte{0});
  EXPECT_THAT(text(trailing), HasSubstr("header says"));
  auto oversize = frame;
  oversize[12] = std::byte{0xff};
  oversize[13] = std::byte{0xff};
  oversize[14] = std::byte{0xff};
  EXPECT_THAT(text(oversize), HasSubstr("exceeds"));
  auto unknown = frame;
  unknown[6] = std::byte{77};
  EXPECT_THAT(text(unknown), HasSubstr("unknown message type 77"));
  EXPECT_THAT(text({}), HasSubstr("shorter than a header"));
  // A NUL byte inside a path.
  auto nul = encode({1, 0, stat_req{"abc"}});
  nul[header_size + 3] = std::byte{0};
  EXPECT_THAT(text(nul), HasSubstr("NUL byte"));
  EXPECT_THAT(test::error_text([] { encode({1, 0, stat_req{std::string("a\0b", 3)}}); }), HasSubstr("NUL byte"));
  EXPECT_THAT(test::error_text([] { encode({1, 0, stat_req{std::string(5000, 'x')}}); }), HasSubstr("longer than 4096"));
  // An absurd entry count is refused before anything is allocated.
  auto lr = encode({1, 0, list_reply{}});
  lr[header_size + 4] = std::byte{0x7f};
  EXPECT_THAT(text(lr), HasSubstr("does not fit the frame"));
  try {
    decode(bad_magic);
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::protocol_error);
  }
}

// Random mutations of valid frames: each either decodes or is refused with a ferry::error.
TEST(Protocol, RandomMutationsNeverCrash) {
  std::mt19937 rng(42);
  int refused = 0, decoded = 0;
  auto all = samples();
  for (int i = 0; i < 200000; ++i) {
    auto f = encode(all[rng() % all.size()]);
    int flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < flips; ++k) f[rng() % f.size()] = static_cast<std::byte>(rng());
    if (rng() % 8 == 0) f.resize(rng() % (f.size() + 1));
    try {
      decode(f);
      ++decoded;
    } catch (const error& e) {
      ASSERT_EQ(e.code(), errc::protocol_error) << e.what();
      ++refused;
    }
  }
  EXPECT_GT(refused, 0);
  EXPECT_GT(decoded, 0);
}

}  // namespace
