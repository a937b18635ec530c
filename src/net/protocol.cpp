#include <ferry/net/protocol.hpp>

#include <fmt/format.h>

#include <bit>
#include <cstring>
#include <type_traits>
#include <utility>

namespace ferry::net {
namespace {

[[noreturn]] void bad(std::string_view what) { fail(errc::protocol_error, "net.decode", "frame", std::string(what)); }

// Integers on the wire are little-endian: stored with one memcpy on little-endian hosts (a frame
// is encoded and decoded per request; byte-by-byte loops cost a tenth of a 4 KiB request over
// shared memory).
template <typename T>
T to_wire(T v) {
  if constexpr (std::endian::native == std::endian::little || sizeof(T) == 1) {
    return v;
  } else {
    unsigned char b[sizeof(T)];
    std::memcpy(b, &v, sizeof v);
    for (std::size_t i = 0; i < sizeof(T) / 2; ++i) std::swap(b[i], b[sizeof(T) - 1 - i]);
    std::memcpy(&v, b, sizeof v);
    return v;
  }
}

// Appends to `out` from its start: the bytes land at `pos` and the vector is cut to size at the
// end, so a reused buffer is neither cleared nor zeroed again per frame.
class writer {
 public:
  explicit writer(std::vector<std::byte>& o) : out(o) {}
  template <typename T>
  void put(T v) {
    static_assert(std::is_integral_v<T>);
    v = to_wire(v);
    raw(&v, sizeof v);
  }
  // Overwrites a value put earlier at byte `at` (the header's payload length, known at the end).
  template <typename T>
  void patch(std::size_t at, T v) {
    v = to_wire(v);
    std::memcpy(out.data() + at, &v, sizeof v);
  }
  void bytes(const std::vector<std::uint8_t>& b, std::size_t exact) {
    if (b.size() != exact) fail(errc::invalid_argument, "net.encode", "frame", fmt::format("expected {} bytes, got {}", exact, b.size()));
    raw(b.data(), b.size());
  }
  void str(const std::string& s, std::size_t limit, std::string_view what) {
    if (s.size() > limit) fail(errc::invalid_argument, "net.encode", std::string(what), fmt::format("longer than {} bytes", limit));
    if (std::memchr(s.data(), 0, s.size())) fail(errc::invalid_argument, "net.encode", std::string(what), "contains a NUL byte");
    put(static_cast<std::uint16_t>(s.size()));
    raw(s.data(), s.size());
  }
  void raw(const void* p, std::size_t n) {
    if (out.size() - pos < n) out.resize(std::max(2 * out.size(), pos + n + 64));
    if (n) std::memcpy(out.data() + pos, p, n);
    pos += n;
  }
  std::size_t size() const { return pos; }
  void finish() { out.resize(pos); }
  std::vector<std::byte>& out;
  std::size_t pos = 0;
};

class reader {
 public:
  explicit reader(std::span<const std::byte> b) : b_(b) {}
  template <typename T>
  T get(std::string_view what) {
    static_assert(std::is_integral_v<T>);
    if (b_.size() - pos_ < sizeof(T)) bad(fmt::format("truncated {} at byte {}", what, pos_));
    T v;
    std::memcpy(&v, b_.data() + pos_, sizeof v);
    pos_ += sizeof(T);
    return to_wire(v);
  }
  std::vector<std::uint8_t> bytes(std::size_t n, std::string_view what) {
    if (b_.size() - pos_ < n) bad(fmt::format("truncated {} at byte {}", what, pos_));
    std::vector<std::uint8_t> v(n);
    if (n) std::memcpy(v.data(), b_.data() + pos_, n);  // an empty vector has no data pointer
    pos_ += n;
    return v;
  }
  std::string str(std::size_t limit, std::string_view what) {
    auto n = get<std::uint16_t>(what);
    if (n > limit) bad(fmt::format("{} of {} bytes exceeds the limit {}", what, n, limit));
    if (b_.size() - pos_ < n) bad(fmt::format("truncated {} at byte {}", what, pos_));
    if (std::memchr(b_.data() + pos_, 0, n)) bad(fmt::format("{} contains a NUL byte", what));
    std::string s(reinterpret_cast<const char*>(b_.data() + pos_), n);
    pos_ += n;
    return s;
  }
  void skip(std::size_t n) {
    if (b_.size() - pos_ < n) bad(fmt::format("truncated frame at byte {}", pos_));
    pos_ += n;
  }
  void end() {
    if (pos_ != b_.size()) bad(fmt::format("{} trailing bytes", b_.size() - pos_));
  }
  std::size_t left() const { return b_.size() - pos_; }

 private:
  std::span<const std::byte> b_;
  std::size_t pos_ = 0;
};

// A byte string of at most `limit` bytes: u16 length, then the bytes.
void blob(writer& p, const std::vector<std::uint8_t>& b, std::size_t limit, std::string_view what) {
  if (b.size() > limit) fail(errc::invalid_argument, "net.encode", std::string(what), fmt::format("longer than {} bytes", limit));
  p.put(static_cast<std::uint16_t>(b.size()));
  p.raw(b.data(), b.size());
}
// A ticket: empty, or exactly ticket_size bytes.
std::vector<std::uint8_t> ticket(reader& r) {
  auto n = r.get<std::uint16_t>("ticket length");
  if (n != 0 && n != ticket_size) bad(fmt::format("a ticket of {} bytes (want {})", n, ticket_size));
  return r.bytes(n, "ticket");
}

std::uint16_t type_of(const body& b) {
  return std::visit(
      [](const auto& v) -> std::uint16_t {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, hello>) return static_cast<std::uint16_t>(msg_type::hello);
        else if constexpr (std::is_same_v<T, challenge>) return static_cast<std::uint16_t>(msg_type::challenge);
        else if constexpr (std::is_same_v<T, auth>) return static_cast<std::uint16_t>(msg_type::auth);
        else if constexpr (std::is_same_v<T, welcome>) return static_cast<std::uint16_t>(msg_type::welcome);
        else if constexpr (std::is_same_v<T, read_req>) return static_cast<std::uint16_t>(msg_type::read);
        else if constexpr (std::is_same_v<T, write_req>) return static_cast<std::uint16_t>(msg_type::write);
        else if constexpr (std::is_same_v<T, stat_req>) return static_cast<std::uint16_t>(msg_type::stat);
        else if constexpr (std::is_same_v<T, list_req>) return static_cast<std::uint16_t>(msg_type::list);
        else if constexpr (std::is_same_v<T, complete>) return static_cast<std::uint16_t>(msg_type::complete);
        else if constexpr (std::is_same_v<T, stat_reply>) return static_cast<std::uint16_t>(msg_type::stat_reply);
        else if constexpr (std::is_same_v<T, list_reply>) return static_cast<std::uint16_t>(msg_type::list_reply);
        else if constexpr (std::is_same_v<T, lend>) return static_cast<std::uint16_t>(msg_type::lend);
        else if constexpr (std::is_same_v<T, read_into>) return static_cast<std::uint16_t>(msg_type::read_into);
        else if constexpr (std::is_same_v<T, read_many>) return static_cast<std::uint16_t>(msg_type::read_many);
        else if constexpr (std::is_same_v<T, write_from>) return static_cast<std::uint16_t>(msg_type::write_from);
        else if constexpr (std::is_same_v<T, read_rma>) return static_cast<std::uint16_t>(msg_type::read_rma);
        else if constexpr (std::is_same_v<T, write_rma>) return static_cast<std::uint16_t>(msg_type::write_rma);
        else if constexpr (std::is_same_v<T, open_write>) return static_cast<std::uint16_t>(msg_type::open_write);
        else if constexpr (std::is_same_v<T, end_write>) return static_cast<std::uint16_t>(msg_type::end_write);
        else return static_cast<std::uint16_t>(msg_type::error);
      },
      b);
}

}  // namespace

std::vector<std::byte> encode(const message& m) { return encode(m, 0); }

std::vector<std::byte> encode(const message& m, std::size_t extra) {
  // One buffer, sized for the common small frame up front: growing a vector field by field would
  // allocate several times.
  std::vector<std::byte> out;
  out.reserve(header_size + 96 + extra);
  encode_into(m, out);
  return out;
}

void encode_into(const message& m, std::vector<std::byte>& out) {
  writer p(out);
  p.put(frame_magic);
  p.put(protocol_version);
  p.put(type_of(m.b));
  p.put(std::uint32_t{0});
  const std::size_t len_at = p.size();
  p.put(std::uint32_t{0});  // payload length, patched below
  p.put(m.request_id);
  p.put(m.credits);
  p.put(std::uint32_t{0});
  if (p.size() != header_size) fail(errc::internal, "net.encode", "frame", "header layout out of step with header_size");
  std::visit(
      [&](const auto& v) {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, hello>) {
          p.put(v.min_version);
          p.put(v.max_version);
          p.put(v.max_outstanding);
          if (!v.nonce.empty() && v.nonce.size() != nonce_size)
            fail(errc::invalid_argument, "net.encode", "nonce", fmt::format("{} bytes (0 or {})", v.nonce.size(), nonce_size));
          blob(p, v.nonce, nonce_size, "nonce");
          p.put(v.lanes);
          blob(p, v.ticket, ticket_size, "ticket");
          if (v.ports.size() > max_ports) fail(errc::invalid_argument, "net.encode", "ports", fmt::format("more than {}", max_ports));
          p.put(static_cast<std::uint8_t>(v.ports.size()));
          for (auto port : v.ports) p.put(port);
        } else if constexpr (std::is_same_v<T, challenge>) {
          p.bytes(v.nonce, nonce_size);
          p.put(static_cast<std::uint8_t>(v.secret_required));
        } else if constexpr (std::is_same_v<T, auth>) {
          p.bytes(v.mac, mac_size);
        } else if constexpr (std::is_same_v<T, welcome>) {
          p.put(v.credits);
          p.put(v.max_request);
          p.put(static_cast<std::uint8_t>(v.writable));
          p.put(v.instance);
          blob(p, v.ticket, ticket_size, "ticket");
          p.str(v.lending, max_socket_name, "lending socket");
          p.bytes(v.token, lend_token_size);
        } else if constexpr (std::is_same_v<T, read_req> || std::is_same_v<T, write_req>) {
          p.put(v.offset);
          p.put(v.length);
          p.str(v.path, max_path, "path");
          if constexpr (std::is_same_v<T, write_req>) p.put(v.handle);
          else p.put(v.version);
        } else if constexpr (std::is_same_v<T, read_many>) {
          if (v.ranges.empty() || v.ranges.size() > max_read_ranges)
            fail(errc::invalid_argument, "net.encode", "read_many", fmt::format("{} ranges (1 to {})", v.ranges.size(), max_read_ranges));
          p.put(v.version);
          p.put(v.into);
          p.put(static_cast<std::uint16_t>(v.ranges.size()));
          for (const auto& g : v.ranges) {
            p.put(g.offset);
            p.put(g.length);
          }
          p.str(v.path, max_path, "path");
        } else if constexpr (std::is_same_v<T, open_write>) {
          p.put(static_cast<std::uint8_t>(v.mode));
          p.put(v.size_hint);
          p.str(v.path, max_path, "path");
        } else if constexpr (std::is_same_v<T, end_write>) {
          p.put(v.handle);
          p.put(v.size);
          p.put(static_cast<std::uint8_t>(v.how));
        } else if constexpr (std::is_same_v<T, lend>) {
          p.put(v.addr);
          p.put(v.length);
          p.put(v.region);
        } else if constexpr (std::is_same_v<T, read_into> || std::is_same_v<T, write_from>) {
          p.put(v.offset);
          p.put(v.length);
          p.put(v.addr);
          p.str(v.path, max_path, "path");
          if constexpr (std::is_same_v<T, read_into>) {
            p.put(v.notify);
            p.put(v.version);
          } else {
            p.put(v.handle);
          }
        } else if constexpr (std::is_same_v<T, read_rma> || std::is_same_v<T, write_rma>) {
          p.put(v.offset);
          p.put(v.length);
          p.put(v.addr);
          if (v.rkey.size() > max_rkey) fail(errc::invalid_argument, "net.encode", "rkey", fmt::format("longer than {} bytes", max_rkey));
          p.put(static_cast<std::uint16_t>(v.rkey.size()));
          p.bytes(v.rkey, v.rkey.size());
          p.str(v.path, max_path, "path");
          if constexpr (std::is_same_v<T, write_rma>) p.put(v.handle);
          else p.put(v.version);
        } else if constexpr (std::is_same_v<T, stat_req>) {
          p.str(v.path, max_path, "path");
        } else if constexpr (std::is_same_v<T, list_req>) {
          p.str(v.path, max_path, "path");
          p.str(v.after, 255, "list cursor");
        } else if constexpr (std::is_same_v<T, complete>) {
          p.put(v.status);
          p.put(v.bytes);
        } else if constexpr (std::is_same_v<T, stat_reply>) {
          p.put(v.size);
          p.put(v.mode);
          p.put(v.mtime_ns);
          p.put(v.version);
        } else if constexpr (std::is_same_v<T, list_reply>) {
          p.put(static_cast<std::uint8_t>(v.more ? 1 : 0));
          p.put(static_cast<std::uint32_t>(v.entries.size()));
          for (auto& e : v.entries) {
            p.put(e.kind);
            p.put(e.size);
            p.str(e.name, 255, "entry name");
          }
        } else {
          p.put(v.code);
          p.str(v.message, 1024, "error message");
        }
      },
      m.b);
  std::size_t payload = p.size() - header_size;
  if (payload > max_message)
    fail(errc::invalid_argument, "net.encode", "frame", fmt::format("payload of {} bytes exceeds {}", payload, max_message));
  p.patch(len_at, static_cast<std::uint32_t>(payload));
  p.finish();
}

frame_info peek_header(std::span<const std::byte> bytes) {
  if (bytes.size() < header_size) bad(fmt::format("{} bytes is shorter than a header ({})", bytes.size(), header_size));
  reader r(bytes.first(header_size));
  if (r.get<std::uint32_t>("magic") != frame_magic) bad("bad magic (not a ferry frame)");
  auto version = r.get<std::uint16_t>("version");
  if (version != protocol_version) bad(fmt::format("unsupported protocol version {} (this side speaks {})", version, protocol_version));
  auto type = r.get<std::uint16_t>("type");
  r.get<std::uint32_t>("flags");
  auto len = r.get<std::uint32_t>("payload length");
  if (len > max_message) bad(fmt::format("payload length {} exceeds {}", len, max_message));
  auto id = r.get<std::uint64_t>("request id");
  return {static_cast<msg_type>(type), len, id};
}

message decode(std::span<const std::byte> bytes) {
  frame_info fi = peek_header(bytes);
  if (bytes.size() != header_size + fi.payload_len)
    bad(fmt::format("frame is {} bytes but its header says {}", bytes.size(), header_size + fi.payload_len));
  reader h(bytes.first(header_size));
  h.skip(24);  // magic, version, type, flags, payload length, request id: checked by peek_header
  message m;
  m.request_id = fi.request_id;
  m.credits = h.get<std::uint32_t>("credits");
  reader r(bytes.subspan(header_size));
  switch (fi.type) {
    case msg_type::hello: {
      hello v;
      v.min_version = r.get<std::uint16_t>("min version");
      v.max_version = r.get<std::uint16_t>("max version");
      if (v.min_version > v.max_version) bad("min version above max version");
      v.max_outstanding = r.get<std::uint32_t>("max outstanding");
      v.nonce = r.bytes(r.get<std::uint16_t>("nonce length"), "nonce");
      if (!v.nonce.empty() && v.nonce.size() != nonce_size) bad(fmt::format("a nonce of {} bytes (0 or {})", v.nonce.size(), nonce_size));
      v.lanes = r.get<std::uint16_t>("lanes");
      if (v.lanes == 0 || v.lanes > max_ports) bad(fmt::format("{} lanes (1 to {})", v.lanes, max_ports));
      v.ticket = ticket(r);
      auto n = r.get<std::uint8_t>("port count");
      if (n > max_ports) bad(fmt::format("{} ports (at most {})", n, max_ports));
      for (unsigned i = 0; i < n; ++i) {
        v.ports.push_back(r.get<std::uint16_t>("port"));
        if (v.ports.back() == 0) bad("port 0");
      }
      m.b = std::move(v);
      break;
    }
    case msg_type::challenge: {
      challenge v;
      v.nonce = r.bytes(nonce_size, "nonce");
      auto s = r.get<std::uint8_t>("secret flag");
      if (s > 1) bad("secret flag is not 0 or 1");
      v.secret_required = s == 1;
      m.b = std::move(v);
      break;
    }
    case msg_type::auth:
      m.b = auth{r.bytes(mac_size, "mac")};
      break;
    case msg_type::welcome: {
      welcome v;
      v.credits = r.get<std::uint32_t>("credits");
      v.max_request = r.get<std::uint64_t>("max request");
      auto w = r.get<std::uint8_t>("writable flag");
      if (w > 1) bad("writable flag is not 0 or 1");
      v.writable = w == 1;
      v.instance = r.get<std::uint64_t>("instance");
      v.ticket = ticket(r);
      v.lending = r.str(max_socket_name, "lending socket");
      v.token = r.bytes(lend_token_size, "lending token");
      m.b = std::move(v);
      break;
    }
    case msg_type::read:
    case msg_type::write: {
      std::uint64_t off = r.get<std::uint64_t>("offset");
      std::uint64_t len = r.get<std::uint64_t>("length");
      if (off + len < off) bad("offset + length overflows");
      std::string path = r.str(max_path, "path");
      if (fi.type == msg_type::read) m.b = read_req{std::move(path), off, len, r.get<std::uint64_t>("version")};
      else m.b = write_req{std::move(path), off, len, r.get<std::uint64_t>("handle")};
      break;
    }
    case msg_type::read_many: {
      read_many v;
      v.version = r.get<std::uint64_t>("version");
      v.into = r.get<std::uint64_t>("answer address");
      auto n = r.get<std::uint16_t>("range count");
      if (n == 0 || n > max_read_ranges) bad(fmt::format("{} ranges (1 to {})", n, max_read_ranges));
      v.ranges.resize(n);
      std::uint64_t total = 0;
      for (auto& g : v.ranges) {
        g.offset = r.get<std::uint64_t>("range offset");
        g.length = r.get<std::uint64_t>("range length");
        if (g.length == 0) bad("an empty range");
        if (g.offset + g.length < g.offset) bad("range offset + length overflows");
        if (g.length > max_read_range) bad(fmt::format("a range of {} bytes (at most {})", g.length, max_read_range));
        if ((total += g.length) > max_read_many_bytes) bad(fmt::format("ranges of more than {} bytes in all", max_read_many_bytes));
      }
      v.path = r.str(max_path, "path");
      m.b = std::move(v);
      break;
    }
    case msg_type::open_write: {
      auto mode = r.get<std::uint8_t>("write mode");
      if (mode > 1) bad(fmt::format("unknown write mode {}", mode));
      auto hint = r.get<std::uint64_t>("size hint");
      m.b = open_write{r.str(max_path, "path"), static_cast<write_mode>(mode), hint};
      break;
    }
    case msg_type::end_write: {
      end_write v;
      v.handle = r.get<std::uint64_t>("handle");
      v.size = r.get<std::uint64_t>("size");
      auto how = r.get<std::uint8_t>("end");
      if (how > 2) bad(fmt::format("unknown write end {}", how));
      v.how = static_cast<write_end>(how);
      m.b = v;
      break;
    }
    case msg_type::lend: {
      lend v;
      v.addr = r.get<std::uint64_t>("address");
      v.length = r.get<std::uint64_t>("length");
      if (v.addr + v.length < v.addr) bad("address + length overflows");
      v.region = r.get<std::uint64_t>("region");
      m.b = std::move(v);
      break;
    }
    case msg_type::read_into:
    case msg_type::write_from: {
      std::uint64_t off = r.get<std::uint64_t>("offset");
      std::uint64_t len = r.get<std::uint64_t>("length");
      std::uint64_t addr = r.get<std::uint64_t>("address");
      if (off + len < off) bad("offset + length overflows");
      if (addr + len < addr) bad("address + length overflows");
      std::string path = r.str(max_path, "path");
      if (fi.type == msg_type::read_into) {
        std::uint64_t notify = r.get<std::uint64_t>("notify");
        if (notify % 8 != 0 || notify + 16 < notify) bad("notify record misaligned or out of range");
        m.b = read_into{std::move(path), off, len, addr, notify, r.get<std::uint64_t>("version")};
      } else {
        m.b = write_from{std::move(path), off, len, addr, r.get<std::uint64_t>("handle")};
      }
      break;
    }
    case msg_type::read_rma:
    case msg_type::write_rma: {
      std::uint64_t off = r.get<std::uint64_t>("offset");
      std::uint64_t len = r.get<std::uint64_t>("length");
      std::uint64_t addr = r.get<std::uint64_t>("address");
      if (off + len < off) bad("offset + length overflows");
      if (addr + len < addr) bad("address + length overflows");
      auto n = r.get<std::uint16_t>("rkey length");
      if (n > max_rkey) bad(fmt::format("rkey of {} bytes exceeds the limit {}", n, max_rkey));
      auto rkey = r.bytes(n, "rkey");
      std::string path = r.str(max_path, "path");
      if (fi.type == msg_type::read_rma) m.b = read_rma{std::move(path), off, len, addr, std::move(rkey), r.get<std::uint64_t>("version")};
      else m.b = write_rma{std::move(path), off, len, addr, std::move(rkey), r.get<std::uint64_t>("handle")};
      break;
    }
    case msg_type::stat:
      m.b = stat_req{r.str(max_path, "path")};
      break;
    case msg_type::list: {
      list_req v;
      v.path = r.str(max_path, "path");
      v.after = r.str(255, "list cursor");
      m.b = std::move(v);
      break;
    }
    case msg_type::complete: {
      complete v;
      v.status = r.get<std::int32_t>("status");
      v.bytes = r.get<std::uint64_t>("bytes");
      m.b = v;
      break;
    }
    case msg_type::stat_reply: {
      stat_reply v;
      v.size = r.get<std::uint64_t>("size");
      v.mode = r.get<std::uint32_t>("mode");
      v.mtime_ns = r.get<std::int64_t>("mtime");
      v.version = r.get<std::uint64_t>("version");
      m.b = v;
      break;
    }
    case msg_type::list_reply: {
      list_reply v;
      auto more = r.get<std::uint8_t>("more");
      if (more > 1) bad(fmt::format("list reply 'more' is {}", more));
      v.more = more == 1;
      auto n = r.get<std::uint32_t>("entry count");
      // Each entry is at least 11 bytes: an absurd count is refused before any allocation.
      if (n > r.left() / 11) bad(fmt::format("entry count {} does not fit the frame", n));
      v.entries.reserve(n);
      for (std::uint32_t i = 0; i < n; ++i) {
        list_entry e;
        e.kind = r.get<std::uint8_t>("entry kind");
        if (e.kind > 2) bad(fmt::format("entry {} has unknown kind {}", i, e.kind));
        e.size = r.get<std::uint64_t>("entry size");
        e.name = r.str(255, "entry name");
        v.entries.push_back(std::move(e));
      }
      m.b = std::move(v);
      break;
    }
    case msg_type::error: {
      error_reply v;
      v.code = r.get<std::int32_t>("error code");
      v.message = r.str(1024, "error message");
      m.b = std::move(v);
      break;
    }
    default:
      bad(fmt::format("unknown message type {}", static_cast<unsigned>(fi.type)));
  }
  r.end();
  return m;
}

}  // namespace ferry::net
