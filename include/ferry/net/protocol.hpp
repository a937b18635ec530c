#pragma once
// ferry's storage wire protocol (the storage service, `ferry serve`, and its clients).
//
// Every message is one frame: a fixed 32-byte little-endian header, then `payload_len` bytes.
//   u32 magic 'FRY1' | u16 version | u16 type | u32 flags | u32 payload_len | u64 request_id | u32 credits | u32 reserved
// Decoding never trusts a length: every field is bounds-checked against the frame, strings against
// their limits, and anything malformed is a protocol_error naming what was wrong — never a crash,
// never an allocation sized by the peer beyond the negotiated maximum. Many requests may be
// outstanding per connection (request ids); `credits` carry the server's flow control (how many more
// requests the client may send), so a slow or hostile client cannot make the server buffer without bound.
#include <ferry/core/error.hpp>
#include <ferry/core/export.hpp>

#include <cstdint>
#include <span>
#include <string>
#include <variant>
#include <vector>

namespace ferry::net {

inline constexpr std::uint32_t frame_magic = 0x31595246;  // "FRY1"
// Raised whenever the wire format changes; both sides must speak the same one (a frame of another
// version is refused, naming both).
inline constexpr std::uint16_t protocol_version = 9;
inline constexpr std::size_t header_size = 32;
inline constexpr std::size_t max_path = 4096;
inline constexpr std::size_t max_message = 1 << 20;  // control messages; bulk data moves outside frames
inline constexpr std::size_t max_data = 4 << 20;     // largest data message a client may send (write data)
inline constexpr std::size_t nonce_size = 32, mac_size = 32;
inline constexpr std::size_t max_rkey = 4096;
inline constexpr std::size_t max_ports = 64;  // lane ports a hello may name
inline constexpr std::size_t ticket_size = 16;
inline constexpr std::size_t lend_token_size = 16;
inline constexpr std::size_t max_socket_name = 100;  // an abstract Unix socket name (sun_path less its NUL)
inline constexpr std::size_t max_read_ranges = 1024;             // ranges one read_many may name
inline constexpr std::uint64_t max_read_range = 64 << 10;         // bytes of one of them
inline constexpr std::uint64_t max_read_many_bytes = 256 << 10;  // their bytes in all (the answer is one message)

enum class msg_type : std::uint16_t {
  hello = 1,      // versions, nonce, lanes; at the door the lanes' ports; on a lane the door's ticket
  challenge = 2,  // server -> client: server nonce, whether a secret is required
  auth = 3,       // client -> server: HMAC-SHA256(secret, server nonce | client nonce)
  welcome = 4,    // server -> client: accepted; limits (from the door: a ticket)
  lend = 5,       // client -> server: a region of the client's memory the server may write/read directly (passed descriptor)
  read = 10,      // path, offset, length
  write = 11,     // path, offset, length (data follows outside the frame)
  stat = 12,      // path
  list = 13,      // path (a directory)
  read_into = 14,   // path, offset, length, address inside the lent region: the server writes the data there
  write_from = 15,  // path, offset, length, address inside the lent region: the server takes the data from there
  read_rma = 16,    // path, offset, length, address + packed rkey of registered client memory: the server puts the data there
  write_rma = 17,   // path, offset, length, address + packed rkey of registered client memory: the server gets the data from there
  open_write = 18,  // path, mode: a new file beside the target that write pieces fill; answered complete{0, handle}
  end_write = 19,   // handle, size, how: commit it into place (or abort); answered complete{0, size}
  read_many = 23,   // path, version, ranges: answered by one complete with every range's data after it
  complete = 20,  // status + bytes for a read/write
  stat_reply = 21,
  list_reply = 22,
  error = 30,     // code + message
};

// `lanes`: connections the client opens in all (the server spreads the further ones over its workers).
// At the server's door (its TCP port): the client's `nonce` (for the challenge) and `ports`, where the
// client's lanes listen for the server's connections, one per lane, on the address the client
// reaches the door from. On a lane: no nonce (a lane's first frames must stay small: UCX 1.13 loses
// shared-memory messages over 100 bytes sent while an endpoint is still being wired) and the door's
// `ticket` -- first from the server (so that the client knows the connection is its server's), then
// from the client.
struct hello {
  std::uint16_t min_version = 1, max_version = 1;
  std::uint32_t max_outstanding = 0;
  std::vector<std::uint8_t> nonce;   // empty or nonce_size bytes
  std::uint16_t lanes = 1;
  std::vector<std::uint8_t> ticket;  // empty or ticket_size bytes
  std::vector<std::uint16_t> ports;  // at most max_ports
};
struct challenge { std::vector<std::uint8_t> nonce; bool secret_required = false; };
struct auth { std::vector<std::uint8_t> mac; };
// `instance` tells server processes apart (random per start): a client's lanes must all reach the same
// one. From the door: `ticket`, which the server's connections to the client's lanes present and which
// is good for the client's lanes until the handshake deadline. On a lane: no ticket.
struct welcome {
  std::uint32_t credits = 0;
  std::uint64_t max_request = 0;
  bool writable = false;
  std::uint64_t instance = 0;
  std::vector<std::uint8_t> ticket;
  // Where a same-host client passes the descriptors of regions it lends (an abstract Unix socket;
  // empty: the server maps none), and the token that ties them to this session.
  std::string lending;
  std::vector<std::uint8_t> token = std::vector<std::uint8_t>(lend_token_size);
  bool operator==(const welcome&) const = default;
};
// [addr, addr + length) of the client's memory, backed by the region it passed to the lending socket
// under `region` (length 0: the region at `addr` is given back).
struct lend { std::uint64_t addr = 0, length = 0, region = 0; };
// `notify` (0: none): the address, inside a lent region, of a 16-byte record {request id, bytes}
// the server writes -- request id last -- once the data is in place, before it sends the completion:
// a client polling the record sees a small read done without receiving a message.
// `version` (reads; 0: any): the file the read must come from, as stat_reply gave it. The pieces of
// one read name the same version, so a file replaced in between fails the read instead of mixing two.
struct read_into { std::string path; std::uint64_t offset = 0, length = 0, addr = 0, notify = 0, version = 0; };
struct write_from { std::string path; std::uint64_t offset = 0, length = 0, addr = 0, handle = 0; };
// RMA where the transport really has it (verbs): the client registers its memory for the network
// and names it by address and packed rkey; the server RMA-writes (read) or RMA-reads (write) it.
struct read_rma { std::string path; std::uint64_t offset = 0, length = 0, addr = 0; std::vector<std::uint8_t> rkey; std::uint64_t version = 0; };
struct write_rma { std::string path; std::uint64_t offset = 0, length = 0, addr = 0; std::vector<std::uint8_t> rkey; std::uint64_t handle = 0; };
struct read_req { std::string path; std::uint64_t offset = 0, length = 0, version = 0; };
// Several small ranges of one file in one request (a GPU cache's misses, many pages at a time), answered
// in one message: complete{0, bytes} followed by 8 bytes per range (little-endian: the bytes read there,
// short only at the file's end), then each range's `length` bytes in order (past a short count: zeros).
// bytes = 8 x ranges + their lengths. 1 to max_read_ranges ranges of 1 to max_read_range bytes, at most
// max_read_many_bytes in all; `version` as a read's (0: the version the first range finds, for all).
// `into` (not 0): the answer's bytes go there instead, in a region the client lent (read_into's
// addr), and the complete carries none.
struct read_range { std::uint64_t offset = 0, length = 0; };
struct read_many { std::string path; std::uint64_t version = 0; std::vector<read_range> ranges; std::uint64_t into = 0; };
// The bytes of read_many's answer for `ranges`.
inline std::uint64_t read_many_answer_bytes(const std::vector<read_range>& ranges) noexcept {
  std::uint64_t n = 8 * ranges.size();
  for (const auto& g : ranges) n += g.length;
  return n;
}
struct write_req { std::string path; std::uint64_t offset = 0, length = 0, handle = 0; };
// Writes are atomic per file. open_write makes a new, unnamed file beside the target (`keep`: a
// copy of the target's current content, for updates; else empty) and answers its handle; write
// pieces (write, write_from, write_rma) name the handle and fill it; end_write renames it over the
// target in one step (commit) or drops it (abort). Until the commit the target is untouched, and a
// client that goes away leaves it untouched: its open writes are dropped with its connection.
enum class write_mode : std::uint8_t { replace = 0, keep = 1 };
enum class write_end : std::uint8_t {
  commit = 0,       // into place as written
  commit_size = 1,  // into place, its size set to `size` first (a replaced file has no stale tail)
  abort = 2,
};
// `size_hint` (0: none): the size the new version will have, set up front so that pieces arriving
// out of order fill it instead of extending it (the commit sets the exact size).
struct open_write { std::string path; write_mode mode = write_mode::replace; std::uint64_t size_hint = 0; };
struct end_write { std::uint64_t handle = 0, size = 0; write_end how = write_end::commit; };
struct stat_req { std::string path; };
// A listing comes in pages, in name order (bytes): the names after `after` ("" : from the first).
struct list_req { std::string path; std::string after; };
struct complete { std::int32_t status = 0; std::uint64_t bytes = 0; };  // status: 0 or an errno value
// version: which file the path names now (its device and inode), for reads that must see one version.
struct stat_reply { std::uint64_t size = 0; std::uint32_t mode = 0; std::int64_t mtime_ns = 0; std::uint64_t version = 0; };
// The version of a file by its device and inode: never 0.
inline std::uint64_t file_version(std::uint64_t dev, std::uint64_t ino) noexcept {
  std::uint64_t v = ino ^ ((dev << 40) | (dev >> 24)) ^ 0x9e3779b97f4a7c15ull;
  return v ? v : 1;
}
struct list_entry { std::string name; std::uint8_t kind = 0; std::uint64_t size = 0; };  // kind: 0 file, 1 dir, 2 other
struct list_reply { std::vector<list_entry> entries; bool more = false; };  // more: ask again after the last
struct error_reply { std::int32_t code = 0; std::string message; };

using body = std::variant<hello, challenge, auth, welcome, read_req, write_req, stat_req, list_req, complete,
                          stat_reply, list_reply, error_reply, lend, read_into, write_from, read_rma, write_rma, open_write,
                          end_write, read_many>;

struct message {
  std::uint64_t request_id = 0;
  std::uint32_t credits = 0;
  body b;
};

// Encodes one frame. Throws invalid_argument for values that could not be decoded (a path with a NUL
// byte or too long, too many entries for max_message).
FERRY_API std::vector<std::byte> encode(const message& m);
// The same, with room for `extra` bytes after the frame (a reply's inline data, read in after it).
FERRY_API std::vector<std::byte> encode(const message& m, std::size_t extra);
// The same into `out` (its contents replaced, its capacity kept): a sender that reuses one buffer
// encodes a frame per request without allocating.
FERRY_API void encode_into(const message& m, std::vector<std::byte>& out);

// Decodes exactly one frame from `bytes` (header + payload). Throws protocol_error naming the
// offending field for anything malformed: bad magic, unsupported version, unknown type, truncated or
// trailing bytes, oversize lengths, NUL bytes in paths.
FERRY_API message decode(std::span<const std::byte> bytes);

// Reads just the header of a frame: payload length (already checked against max_message) and type.
struct frame_info {
  msg_type type;
  std::uint32_t payload_len;
  std::uint64_t request_id;
};
FERRY_API frame_info peek_header(std::span<const std::byte> bytes);

}  // namespace ferry::net
