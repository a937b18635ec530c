// http:// and https:// files (include/ferry/store/http.hpp): a file_source per opened URL, and one
// engine per registration -- a libcurl multi handle and the thread that drives it -- that runs every
// range request, lands each piece and reports it.
#include <ferry/core/interrupt.hpp>
#include <ferry/store/http.hpp>

#include <ferry/io/file.hpp>
#include <ferry/mem/pinned_pool.hpp>
#include <ferry/mem/registration.hpp>
#include <ferry/xfer/engine.hpp>
#include <ferry/xfer/staged_copies.hpp>

#include "core/logging.hpp"
#include "mem/streaming_copy.hpp"
#include "store/curl_api.hpp"

#include <fmt/format.h>
#include <pthread.h>

#include <algorithm>
#include <charconv>
#include <array>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace ferry::store {

http_options http_options_from(const store_settings& s, registration_cache* cache, transfer_engine* engine) {
  http_options o;
  o.cache = cache;
  o.engine = engine;
  o.piece = s.http_piece;
  o.connections = s.http_connections;
  o.threads = s.http_threads > 0 ? s.http_threads : default_http_threads();
  o.retries = s.http_retries;
  o.deadline = s.deadline;
  o.ca_file = s.http_ca_file;
  o.curl_library = s.curl_library;
  return o;
}

namespace {

using clk = std::chrono::steady_clock;
using namespace std::chrono_literals;

using curl::lib;

// libcurl, loaded and initialised once per process (curl::load), before any other call of it.
void global_init(const http_options& o) { curl::load(o.curl_library); }

errc code_of(CURLcode rc) {
  switch (rc) {
    case CURLE_OPERATION_TIMEDOUT: return errc::timeout;
    case CURLE_UNSUPPORTED_PROTOCOL:
    case CURLE_URL_MALFORMAT: return errc::invalid_argument;
    case CURLE_OUT_OF_MEMORY: return errc::out_of_memory;
    default: return errc::network_error;
  }
}

// On the way, not final: the next attempt may get through (from the byte this one reached).
bool retriable(CURLcode rc) {
  switch (rc) {
    case CURLE_COULDNT_CONNECT:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_PARTIAL_FILE:
    case CURLE_GOT_NOTHING:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM: return true;
    default: return false;
  }
}
bool retriable(long status) { return status >= 500 || status == 429 || status == 408; }

// `where`: the file as messages show it (uri_for_messages(url), or the s3:// URI), and the byte
// offset or the step.
error status_error(long status, const char* op, const std::string& where) {
  errc c = status == 404 || status == 410   ? errc::not_found
           : status == 401 || status == 403 ? errc::permission_denied
           : status == 416                  ? errc::out_of_range
           : status >= 500 || status == 412 ? errc::io_error
                                            : errc::protocol_error;
  std::string detail = fmt::format("the server answered HTTP {}", status);
  if (status == 412) detail += " (the file changed since it was opened)";
  if (status == 403) detail += " (no access: the credentials, or the object's permissions)";
  if (status >= 300 && status < 400 && where.starts_with("s3://"))
    detail += " (a redirect, not followed with credentials: the bucket's region is not AWS_REGION?)";
  return error(c, op, where, detail);
}

error curl_error(CURLcode rc, const char* errbuf, const char* op, const std::string& where) {
  std::string detail = lib().easy_strerror(rc);
  if (errbuf && *errbuf) detail += std::string(": ") + errbuf;
  return error(code_of(rc), op, where, detail);
}

// An S3 request's signature (AWS SigV4, made by libcurl) and the headers it needs.
struct s3_signing {
  std::string region, userpwd, token;
};

// What every request of ours says: only http and https (also after a redirect), a deadline for
// connecting and one for moving no byte, certificates always checked.
void common(CURL* c, const std::string& url, const http_options& o, char* errbuf, const s3_signing* sign) {
  const long secs = std::max<long>(1, static_cast<long>(std::chrono::duration_cast<std::chrono::seconds>(o.deadline).count()));
  lib().easy_setopt(c, CURLOPT_URL, url.c_str());
  lib().easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  // Redirects: never for a signed (S3) request, whose session token would go to the next host too;
  // from https only to https.
  lib().easy_setopt(c, CURLOPT_FOLLOWLOCATION, sign ? 0L : 1L);
  lib().easy_setopt(c, CURLOPT_MAXREDIRS, 8L);
  lib().easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
  lib().easy_setopt(c, CURLOPT_REDIR_PROTOCOLS_STR, url.starts_with("https:") ? "https" : "http,https");
  lib().easy_setopt(c, CURLOPT_CONNECTTIMEOUT, secs);
  lib().easy_setopt(c, CURLOPT_LOW_SPEED_LIMIT, 1L);
  lib().easy_setopt(c, CURLOPT_LOW_SPEED_TIME, secs);
  lib().easy_setopt(c, CURLOPT_HTTP_VERSION, static_cast<long>(CURL_HTTP_VERSION_2TLS));
  lib().easy_setopt(c, CURLOPT_USERAGENT, "ferry");
  // A receive buffer of 512 KiB (the most libcurl 7.88 takes; 16 KiB by default): a system call and a
  // write callback per 512 KiB of a body instead of per 16 KiB (docs/design/remote-sources.md).
  lib().easy_setopt(c, CURLOPT_BUFFERSIZE, 512L << 10);
  lib().easy_setopt(c, CURLOPT_ERRORBUFFER, errbuf);
  if (!o.ca_file.empty()) lib().easy_setopt(c, CURLOPT_CAINFO, o.ca_file.c_str());
  if (sign) {
    const std::string how = "aws:amz:" + sign->region + ":s3";
    lib().easy_setopt(c, CURLOPT_AWS_SIGV4, how.c_str());
    lib().easy_setopt(c, CURLOPT_USERPWD, sign->userpwd.c_str());
  }
}

// The headers of a request: the version the ranges must come from, and what S3 signs.
curl_slist* headers_for(const std::string& etag, const s3_signing* sign, bool put = false) {
  curl_slist* h = nullptr;
  if (!etag.empty()) h = lib().slist_append(h, ("If-Match: " + etag).c_str());
  if (put) h = lib().slist_append(h, "Expect:");  // no 100-continue round trip
  if (sign) {
    // A GET or HEAD has no body: the SHA-256 of nothing; a PUT's body is not hashed (S3 allows it).
    h = lib().slist_append(h, put ? "x-amz-content-sha256: UNSIGNED-PAYLOAD"
                                 : "x-amz-content-sha256: e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    if (!sign->token.empty()) h = lib().slist_append(h, ("x-amz-security-token: " + sign->token).c_str());
  }
  return h;
}

// What a file's requests go to, and what its messages call it.
struct target {
  std::string url, name;
  std::shared_ptr<const s3_signing> sign;  // null: unsigned
};

struct head_result : target {
  std::uint64_t size = 0;
  std::string etag;  // strong ETags only: ranges must come from the version seen here (If-Match)
};

// What an answer's headers say of the file: its version (a strong ETag) and, for a range, its size.
struct head_lines {
  std::string etag;
  std::int64_t total = -1;  // from "Content-Range: bytes a-b/total"
};

std::size_t on_head_line(char* b, std::size_t sz, std::size_t n, void* ud) {
  auto& h = *static_cast<head_lines*>(ud);
  std::string_view line(b, sz * n);
  while (!line.empty() && (line.back() == '\r' || line.back() == '\n' || line.back() == ' ')) line.remove_suffix(1);
  auto value = [&](std::size_t skip) {
    std::string_view v = line.substr(skip);
    while (!v.empty() && (v.front() == ' ' || v.front() == '\t')) v.remove_prefix(1);
    return v;
  };
  if (line.size() > 5 && strncasecmp(line.data(), "etag:", 5) == 0) {
    std::string_view v = value(5);
    h.etag = v.starts_with("W/") ? std::string() : std::string(v);  // a weak one cannot be matched
  } else if (line.size() > 14 && strncasecmp(line.data(), "content-range:", 14) == 0) {
    std::string_view v = value(14);
    if (auto slash = v.rfind('/'); slash != std::string_view::npos && v.substr(slash + 1) != "*") {
      std::int64_t t = 0;
      auto [p, ec] = std::from_chars(v.data() + slash + 1, v.data() + v.size(), t);
      if (ec == std::errc() && p == v.data() + v.size()) h.total = t;
    }
  } else if (line.starts_with("HTTP/")) {
    h = {};  // a new answer (after a redirect): its own headers count
  }
  return sz * n;
}

// The body of the first-byte GET: one byte expected; a server that sends the whole file instead is
// cut off (its Content-Length still says the size).
std::size_t discard_body(char*, std::size_t sz, std::size_t n, void* ud) {
  auto& seen = *static_cast<std::uint64_t*>(ud);
  seen += sz * n;
  return seen <= 1 ? sz * n : 0;
}

head_result head(const target& t, const http_options& o) {
  global_init(o);
  head_result h;
  static_cast<target&>(h) = t;
  // HEAD; where the server refuses it (a presigned URL is signed for GET only, some servers take no
  // HEAD), the first byte by GET, whose Content-Range says the size.
  for (const bool by_get : {false, true}) {
    std::unique_ptr<CURL, void (*)(CURL*)> c(lib().easy_init(), lib().easy_cleanup);
    if (!c) fail(errc::out_of_memory, "http.open", t.name, "curl_easy_init failed");
    char err[CURL_ERROR_SIZE] = {};
    common(c.get(), t.url, o, err, t.sign.get());
    // Headers only (and a byte): the whole answer within the deadline, not just some progress.
    lib().easy_setopt(c.get(), CURLOPT_TIMEOUT_MS, static_cast<long>(std::chrono::duration_cast<std::chrono::milliseconds>(o.deadline).count()));
    std::unique_ptr<curl_slist, void (*)(curl_slist*)> hdr(headers_for({}, t.sign.get()), lib().slist_free_all);
    if (hdr) lib().easy_setopt(c.get(), CURLOPT_HTTPHEADER, hdr.get());
    head_lines lines;
    std::uint64_t seen = 0;
    if (by_get) {
      lib().easy_setopt(c.get(), CURLOPT_RANGE, "0-0");
      lib().easy_setopt(c.get(), CURLOPT_WRITEFUNCTION, discard_body);
      lib().easy_setopt(c.get(), CURLOPT_WRITEDATA, &seen);
    } else {
      lib().easy_setopt(c.get(), CURLOPT_NOBODY, 1L);
    }
    lib().easy_setopt(c.get(), CURLOPT_HEADERFUNCTION, on_head_line);
    lib().easy_setopt(c.get(), CURLOPT_HEADERDATA, &lines);
    if (interruptible()) {  // the caller's Ctrl-C ends the wait (libcurl asks about once a second)
      lib().easy_setopt(c.get(), CURLOPT_NOPROGRESS, 0L);
      lib().easy_setopt(c.get(), CURLOPT_XFERINFOFUNCTION,
                       +[](void*, curl_off_t, curl_off_t, curl_off_t, curl_off_t) -> int { return interrupted() ? 1 : 0; });
    }
    CURLcode rc = lib().easy_perform(c.get());
    if (rc == CURLE_ABORTED_BY_CALLBACK) fail(errc::cancelled, "http.open", t.name, "interrupted by the caller");
    if (rc != CURLE_OK && !(by_get && rc == CURLE_WRITE_ERROR)) throw curl_error(rc, err, "http.open", t.name + " offset 0");
    long status = 0;
    lib().easy_getinfo(c.get(), CURLINFO_RESPONSE_CODE, &status);
    if (!by_get && (status == 403 || status == 405 || status == 501)) continue;
    if (status < 200 || status >= 300) throw status_error(status, "http.open", t.name + " offset 0");
    curl_off_t len = -1;
    lib().easy_getinfo(c.get(), CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &len);
    if (by_get && status == 206) len = lines.total;
    if (len < 0) fail(errc::not_supported, "http.open", t.name, "the server gives no size for it (no Content-Length)");
    char* at = nullptr;
    lib().easy_getinfo(c.get(), CURLINFO_EFFECTIVE_URL, &at);
    h.size = static_cast<std::uint64_t>(len);
    h.etag = lines.etag;
    if (at) h.url = at;
    break;
  }
  return h;
}

// A read's or a write's pieces end one by one, on the lanes' threads: told once the last one has.
struct request {
  std::mutex mu;
  int left = 0;
  std::uint64_t bytes = 0;
  std::optional<error> err;
  file_source::completion done;
};

// One request on the wire, on one connection of a lane: a range of a read (into the caller's memory or a
// staging buffer), a whole-file PUT or an upload's part, or a small POST or DELETE of a multipart upload.
struct piece {
  std::shared_ptr<request> req;
  std::shared_ptr<const head_result> h;
  std::uint64_t offset = 0, len = 0, got = 0;  // the file's [offset, offset + len); got: bytes landed
  std::byte* dst = nullptr;                    // the caller's memory for byte `offset`
  memory_region user;                          // staged: the destination, classified once
  pinned_pool* pool = nullptr;                 // staged: where the landing buffer comes from
  pinned_pool::buffer slot;
  source_deadline until;                       // moved on as bytes land (a batch that follows progress)
  clk::time_point last_moved{};                // the piece's own last byte (or its start)
  clk::time_point not_before{};
  int attempts = 0;
  long status = 0;
  bool enough = false;                         // a 200 answer (the whole file) cut off once the range was in
  bool put = false;                            // an upload of [dst, dst + len) as the whole file (got: bytes sent)
  std::int64_t range_start = -1;               // the answer's Content-Range start
  std::uint64_t slot_at = 0, slot_len = 0;     // put from device memory: the source's bytes in the slot
  transfer_engine* eng = nullptr;              // put from device memory: copies the source into the slot
  std::optional<error> bad;                    // the answer cannot be used (set by on_data)
  std::string url;                             // where it goes, when not the file's URL (a part, a POST)
  std::string step;                            // a multipart upload's step or part, for messages
  const char* method = nullptr;                // POST or DELETE: `body` out, the answer into `answer`
  std::string body;
  std::shared_ptr<std::string> answer;
  std::string* etag_out = nullptr;             // a part: its answer's ETag (in `etags`, held here)
  std::shared_ptr<std::vector<std::string>> etags;
  CURL* easy = nullptr;
  curl_slist* headers = nullptr;
  char errbuf[CURL_ERROR_SIZE] = {};
};

// A piece's messages and its libcurl callbacks (on its lane's thread).

// Where a piece is, for messages: the file and the byte offset, or the multipart step or part.
std::string where(const piece& p) {
  if (!p.step.empty()) return fmt::format("{} ({})", p.h->name, p.step);
  return fmt::format("{} offset {}", p.h->name, p.offset + (p.put ? 0 : p.got));
}
const char* op_of(const piece& p) { return p.put || p.method ? "http.write" : "http.read"; }
// How long before its deadline a piece ends (so that its own error, naming it, and an upload's
// abort come before the batch's wait gives up): a tenth of a moving deadline's window, at most half
// a second; none for a fixed deadline (the caller's whole budget).
std::chrono::nanoseconds margin(const piece& p) {
  return std::min<std::chrono::nanoseconds>(p.until.idle() / 10, std::chrono::milliseconds(500));
}
// Bytes of the piece moved: its batch's deadline and its own stall clock go on.
void progressed(piece& p) {
  p.until.moved();
  p.last_moved = clk::now();
}

// The body of an answer, as it comes: into the caller's memory or the staging buffer, never more
// than the range, and nothing of an error page.
std::size_t on_data(char* b, std::size_t sz, std::size_t n, void* ud) {
  auto& p = *static_cast<piece*>(ud);
  const std::size_t bytes = sz * n;
  if (!p.status) {
    lib().easy_getinfo(p.easy, CURLINFO_RESPONSE_CODE, &p.status);
    if (p.status == 206 && p.range_start >= 0 && p.range_start != static_cast<std::int64_t>(p.offset + p.got)) {
      p.bad = error(errc::protocol_error, "http.read", fmt::format("{} offset {}", p.h->name, p.offset + p.got),
                    fmt::format("the server answered a range from byte {} instead", p.range_start));
      return 0;
    }
  }
  if (p.status != 200 && p.status != 206) return bytes;  // not the file's bytes (an error's page): see ended()
  if (p.status == 200 && p.offset + p.got != 0) {
    p.bad = error(errc::not_supported, "http.read", fmt::format("{} offset {}", p.h->name, p.offset + p.got),
                  "the server ignored the byte range (answered 200, not 206): it cannot serve parts of a file");
    return 0;
  }
  const std::size_t take = static_cast<std::size_t>(std::min<std::uint64_t>(bytes, p.len - p.got));
  // Into a staging buffer, which only the device's copy reads next: around the caches. Into the
  // caller's memory, which the caller reads, as it comes.
  if (p.slot) streaming_copy(p.slot.data() + p.got, b, take);
  else std::memcpy(p.dst + p.got, b, take);
  p.got += take;
  progressed(p);
  if (take == bytes) return bytes;
  if (p.status == 200) {
    p.enough = true;  // the whole file came; the range is in
    return 0;
  }
  p.bad = error(errc::protocol_error, "http.read", fmt::format("{} offset {}", p.h->name, p.offset),
                fmt::format("the server sent more than the {} bytes asked for", p.len));
  return 0;
}

// An upload's body, as libcurl asks for it: from the caller's host memory, or from device memory a
// staging buffer at a time (copied by the transfer engine on this lane's thread).
std::size_t on_send(char* b, std::size_t sz, std::size_t n, void* ud) {
  auto& p = *static_cast<piece*>(ud);
  const std::size_t room = sz * n;
  if (p.got == p.len) return 0;
  if (!p.slot) {
    const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(room, p.len - p.got));
    std::memcpy(b, p.dst + p.got, k);
    p.got += k;
    progressed(p);
    return k;
  }
  if (p.got == p.slot_at + p.slot_len) {  // the slot is sent: the source's next stretch into it
    p.slot_at = p.got;
    p.slot_len = std::min<std::uint64_t>(p.slot.size(), p.len - p.got);
    try {
      p.eng->copy(transfer_request{p.slot.data(), p.dst + p.slot_at, p.slot_len, &p.slot.region(), &p.user}, {p.until.at()});
    } catch (const error& e) {
      p.bad = e;
      return CURL_READFUNC_ABORT;
    }
  }
  const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(room, p.slot_at + p.slot_len - p.got));
  std::memcpy(b, p.slot.data() + (p.got - p.slot_at), k);
  p.got += k;
  progressed(p);
  return k;
}
std::size_t discard(char*, std::size_t sz, std::size_t n, void*) { return sz * n; }
// A POST's or DELETE's answer: kept (a small XML document; more than a MiB is not one of S3's).
std::size_t on_answer(char* b, std::size_t sz, std::size_t n, void* ud) {
  auto& p = *static_cast<piece*>(ud);
  if (p.answer->size() + sz * n > (1u << 20)) return 0;
  p.answer->append(b, sz * n);
  progressed(p);  // S3 keeps a long CompleteMultipartUpload alive with whitespace
  return sz * n;
}
// A part's ETag, which the upload's completion lists.
std::size_t on_part_header(char* b, std::size_t sz, std::size_t n, void* ud) {
  auto& p = *static_cast<piece*>(ud);
  head_lines h;
  on_head_line(b, sz, n, &h);
  if (!h.etag.empty()) *p.etag_out = h.etag;
  return sz * n;
}
// A range answer's first byte (Content-Range: bytes a-b/total), checked against the one asked for.
std::size_t on_header(char* b, std::size_t sz, std::size_t n, void* ud) {
  auto& p = *static_cast<piece*>(ud);
  std::string_view line(b, sz * n);
  if (line.starts_with("HTTP/")) p.range_start = -1;
  if (line.size() > 14 && strncasecmp(line.data(), "content-range:", 14) == 0) {
    std::string_view v = line.substr(14);
    auto at = v.find("bytes ");
    std::int64_t first = -1;
    if (at != std::string_view::npos) std::from_chars(v.data() + at + 6, v.data() + v.size(), first);
    p.range_start = first;
  }
  return sz * n;
}

// The piece is off libcurl for good (curl thread only).
void let_go(piece& p) {
  if (p.easy) lib().easy_cleanup(p.easy);
  p.easy = nullptr;
  if (p.headers) lib().slist_free_all(p.headers);
  p.headers = nullptr;
}

class http_engine;

// S3's multipart upload (CreateMultipartUpload, UploadPart for each part in parallel, each tried
// again on its own, CompleteMultipartUpload; AbortMultipartUpload when a part failed), over an
// engine's lanes: each step starts the next from its completion, on the lanes' threads.
class s3_multipart {
 public:
  // A part: FERRY_HTTP_PIECE (`piece_bytes`), at least S3's smallest part (5 MiB) and large enough that the
  // object takes at most S3's 10,000 parts.
  static std::uint64_t part_bytes(std::uint64_t bytes, std::uint64_t piece_bytes) {
    constexpr std::uint64_t mib = 1 << 20, least = 5 * mib, most_parts = 10000, largest = 5ull << 30;
    const std::uint64_t need = (bytes + most_parts - 1) / most_parts;
    return std::min(largest, std::max({piece_bytes, least, (need + mib - 1) / mib * mib}));
  }
  // Uploads `whole` (the object's bytes, as a write's piece) in parts of `part` bytes.
  static void start(http_engine& e, std::shared_ptr<piece> whole, std::uint64_t part, file_source::completion done);

 private:
  static void upload_parts(http_engine& e, std::shared_ptr<piece> whole, std::uint64_t part, std::string id, file_source::completion done);
};

// The text of the first <tag>...</tag> in a small XML answer ("" when there is none).
std::string xml_text(const std::string& xml, const std::string& tag) {
  const auto a = xml.find("<" + tag + ">");
  if (a == std::string::npos) return {};
  const auto from = a + tag.size() + 2, b = xml.find("</" + tag + ">", from);
  return b == std::string::npos ? std::string() : xml.substr(from, b - from);
}
// A query value: every byte but the unreserved ones percent-encoded (as SigV4 canonicalizes it).
std::string encode_query(std::string_view v) {
  std::string out;
  for (unsigned char ch : v) {
    if (std::isalnum(ch) || ch == '-' || ch == '_' || ch == '.' || ch == '~') out += static_cast<char>(ch);
    else out += fmt::format("%{:02X}", ch);
  }
  return out;
}

// The engine of a registration: its lanes run every piece -- started when a connection and (into device
// memory) a staging buffer are free, ended on its answer: landed (copied on), tried again, or failed -- and
// tell each read or write when its last piece has ended.
class http_engine {
 public:
  explicit http_engine(http_options o) : o_(std::move(o)) {
    if (o_.engine) copies_.emplace(*o_.engine);
    global_init(o_);
    const int k = std::max(1, o_.threads);
    per_lane_ = static_cast<std::size_t>(std::max(1, o_.connections / k));
    // Lanes: a libcurl multi handle each, driven by a thread of its own that waits in
    // curl_multi_poll (woken by curl_multi_wakeup when requests come or buffers return); a read's
    // pieces are spread over them, since one thread's receiving and copying is one core's.
    try {
      for (int i = 0; i < k; ++i) {
        auto l = std::make_unique<lane>();
        l->multi = lib().multi_init();
        if (!l->multi) fail(errc::out_of_memory, "http.engine", "libcurl", "curl_multi_init failed");
        lib().multi_setopt(l->multi, CURLMOPT_MAX_HOST_CONNECTIONS, static_cast<long>(per_lane_));
        // Each piece on a connection of its own, HTTP/2 too: bulk data moves faster over several
        // TCP connections than as streams of one.
        lib().multi_setopt(l->multi, CURLMOPT_PIPELINING, static_cast<long>(CURLPIPE_NOTHING));
        lanes_.push_back(std::move(l));
      }
      // Dedicated, not the executor's: each drives its libcurl multi handle, which one thread at a time may use.
      for (auto& l : lanes_)
        l->thread = std::thread([this, p = l.get()] {
          ::pthread_setname_np(::pthread_self(), "ferry-http");  // (named for top, perf and the benchmarks' CPU by thread)
          loop(*p);
        });
    } catch (...) {
      end();
      throw;
    }
  }
  ~http_engine() { end(); }
  http_engine(const http_engine&) = delete;
  http_engine& operator=(const http_engine&) = delete;

  const http_options& options() const noexcept { return o_; }

  void end() noexcept {
    {
      std::lock_guard l(mu_);
      stop_ = true;
    }
    for (auto& l : lanes_)
      if (l->multi) lib().multi_wakeup(l->multi);
    for (auto& l : lanes_)
      if (l->thread.joinable()) l->thread.join();  // each fails what is left, after the copies under way
    for (auto& l : lanes_)
      if (l->multi) lib().multi_cleanup(l->multi);
    lanes_.clear();
  }

  std::string describe() const {
    return fmt::format("HTTP (libcurl {}): {} requests, {} tried again{}", lib().version_info(CURLVERSION_NOW)->version,
                       n_pieces_.load(), n_retries_.load(), n_staged_.load() ? " -> copy on (transfer engine)" : "");
  }

  void read(const std::shared_ptr<const head_result>& h, std::uint64_t offset, std::byte* mem, std::uint64_t bytes,
            const source_deadline& until, file_source::completion done) {
    if (offset >= h->size || bytes == 0) return done(0, nullptr);
    bytes = std::min(bytes, h->size - offset);  // short at the end of the file
    memory_region user;
    pinned_pool* pool = nullptr;
    if (o_.cache) {
      user = o_.cache->classify(mem, bytes);
      if (user.type == memory_type::unknown)
        fail(errc::bad_address, "http.read", fmt::format("{}+{}", static_cast<void*>(mem), bytes), "not memory ferry knows (freed, or never mapped?)");
      if (user.type == memory_type::device || user.type == memory_type::unified) {
        if (!o_.engine) fail(errc::invalid_argument, "http.read", user.device_id(), "device memory needs a transfer engine for staging");
        pool = &o_.engine->staging_for(user);
      }
    }
    const std::uint64_t step = pool ? std::min<std::uint64_t>(o_.piece, pool->buffer_bytes()) : o_.piece;
    auto req = std::make_shared<request>();
    req->bytes = bytes;
    req->done = std::move(done);
    req->left = static_cast<int>((bytes + step - 1) / step);
    std::vector<std::shared_ptr<piece>> ps;
    for (std::uint64_t off = 0; off < bytes; off += step) {
      auto p = std::make_shared<piece>();
      p->req = req;
      p->h = h;
      p->offset = offset + off;
      p->len = std::min(step, bytes - off);
      p->dst = mem + off;
      p->user = user;
      p->pool = pool;
      p->until = until;
      ps.push_back(std::move(p));
    }
    enqueue(ps, "http.read");
  }

  // The whole file from [mem, mem + bytes): one PUT, or for s3:// beyond one part a multipart
  // upload (device memory through staging buffers).
  void write(const std::shared_ptr<const head_result>& h, const std::byte* mem, std::uint64_t bytes, const source_deadline& until,
             file_source::completion done) {
    auto p = std::make_shared<piece>();
    if (o_.cache && bytes) {
      p->user = o_.cache->classify(mem, bytes);
      if (p->user.type == memory_type::unknown)
        fail(errc::bad_address, "http.write", fmt::format("{}+{}", static_cast<const void*>(mem), bytes), "not memory ferry knows (freed, or never mapped?)");
      if (p->user.type == memory_type::device || p->user.type == memory_type::unified) {
        if (!o_.engine) fail(errc::invalid_argument, "http.write", p->user.device_id(), "device memory needs a transfer engine for staging");
        p->pool = &o_.engine->staging_for(p->user);
        p->eng = o_.engine;
      }
    }
    p->h = h;
    p->put = true;
    p->len = bytes;
    p->dst = const_cast<std::byte*>(mem);  // read from, never written
    p->until = until;
    const std::uint64_t part = s3_multipart::part_bytes(bytes, o_.piece);
    if (h->name.starts_with("s3://") && bytes > part) return s3_multipart::start(*this, std::move(p), part, std::move(done));
    auto req = std::make_shared<request>();
    req->bytes = bytes;
    req->done = std::move(done);
    req->left = 1;
    p->req = req;
    enqueue({std::move(p)}, "http.write");
  }

 private:
  friend class s3_multipart;  // (its steps are the engine's pieces: enqueue, exchange)
  struct lane {
    CURLM* multi = nullptr;
    std::vector<std::shared_ptr<piece>> incoming;  // mu_
    std::thread thread;
  };

  // Pieces onto the lanes, spread round robin; each lane's thread starts them.
  void enqueue(std::vector<std::shared_ptr<piece>> ps, const char* op) {
    const std::size_t first = next_lane_.fetch_add(ps.size());
    const std::size_t n = ps.size();
    {
      std::lock_guard l(mu_);
      if (stop_) fail(errc::cancelled, op, ps.empty() ? std::string("http") : ps[0]->h->name, "the runtime is going");
      for (std::size_t i = 0; i < n; ++i) lanes_[(first + i) % lanes_.size()]->incoming.push_back(std::move(ps[i]));
    }
    n_pieces_ += n;
    for (std::size_t i = 0; i < std::min(n, lanes_.size()); ++i) lib().multi_wakeup(lanes_[(first + i) % lanes_.size()]->multi);
  }

  // One request with a small body and answer (the multipart upload's POSTs and DELETE), its answer
  // handed to `then` on a lane's thread.
  void exchange(const std::shared_ptr<const head_result>& h, const char* method, std::string step, std::string query,
                std::string body, source_deadline until, std::function<void(const std::string& answer, const error*)> then) {
    auto p = std::make_shared<piece>();
    auto answer = std::make_shared<std::string>();
    p->h = h;
    p->method = method;
    p->step = std::move(step);
    p->url = h->url + "?" + query;
    p->body = std::move(body);
    p->answer = answer;
    p->until = until;
    auto req = std::make_shared<request>();
    req->left = 1;
    req->done = [answer, then = std::move(then)](std::uint64_t, const error* e) { then(*answer, e); };
    p->req = req;
    enqueue({std::move(p)}, "http.write");
  }

  void begin(lane& L, piece& p) {
    if (!p.easy && !(p.easy = lib().easy_init())) fail(errc::out_of_memory, "http.read", p.h->name, "curl_easy_init failed");
    p.last_moved = clk::now();  // its stall clock starts with each attempt
    lib().easy_reset(p.easy);
    p.errbuf[0] = 0;
    p.status = 0;
    p.enough = false;
    common(p.easy, p.url.empty() ? p.h->url : p.url, o_, p.errbuf, p.h->sign.get());
    const bool sends = p.put || p.method;
    if (!p.headers) p.headers = headers_for(sends ? std::string() : p.h->etag, p.h->sign.get(), sends);
    if (p.headers) lib().easy_setopt(p.easy, CURLOPT_HTTPHEADER, p.headers);
    if (p.method) {
      p.answer->clear();
      if (std::string_view(p.method) == "POST") {
        lib().easy_setopt(p.easy, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(p.body.size()));
        lib().easy_setopt(p.easy, CURLOPT_POSTFIELDS, p.body.c_str());
      } else {
        lib().easy_setopt(p.easy, CURLOPT_CUSTOMREQUEST, p.method);
      }
      lib().easy_setopt(p.easy, CURLOPT_WRITEFUNCTION, on_answer);
      lib().easy_setopt(p.easy, CURLOPT_WRITEDATA, &p);
      lib().easy_setopt(p.easy, CURLOPT_PRIVATE, &p);
      if (lib().multi_add_handle(L.multi, p.easy) != CURLM_OK) fail(errc::internal, "http.write", p.h->name, "curl_multi_add_handle failed");
      return;
    }
    if (p.put) {
      p.got = p.slot_at = p.slot_len = 0;  // an upload starts again from its first byte
      if (p.etag_out) p.etag_out->clear();  // this attempt's answer names it
      lib().easy_setopt(p.easy, CURLOPT_UPLOAD, 1L);
      lib().easy_setopt(p.easy, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(p.len));
      lib().easy_setopt(p.easy, CURLOPT_READFUNCTION, on_send);
      lib().easy_setopt(p.easy, CURLOPT_READDATA, &p);
      lib().easy_setopt(p.easy, CURLOPT_WRITEFUNCTION, discard);
      if (p.etag_out) {
        lib().easy_setopt(p.easy, CURLOPT_HEADERFUNCTION, on_part_header);
        lib().easy_setopt(p.easy, CURLOPT_HEADERDATA, &p);
      }
      lib().easy_setopt(p.easy, CURLOPT_PRIVATE, &p);
      if (lib().multi_add_handle(L.multi, p.easy) != CURLM_OK) fail(errc::internal, "http.write", p.h->name, "curl_multi_add_handle failed");
      return;
    }
    const std::string range = fmt::format("{}-{}", p.offset + p.got, p.offset + p.len - 1);
    lib().easy_setopt(p.easy, CURLOPT_RANGE, range.c_str());
    p.range_start = -1;
    lib().easy_setopt(p.easy, CURLOPT_HEADERFUNCTION, on_header);
    lib().easy_setopt(p.easy, CURLOPT_HEADERDATA, &p);
    // libcurl's 16 KiB receive buffer costs a recv and a callback per 16 KiB, which bound a thread
    // well below its connections' rate; half a MiB still fits a core's cache for the copy out of it.
    lib().easy_setopt(p.easy, CURLOPT_BUFFERSIZE, 512L << 10);
    lib().easy_setopt(p.easy, CURLOPT_WRITEFUNCTION, on_data);
    lib().easy_setopt(p.easy, CURLOPT_WRITEDATA, &p);
    lib().easy_setopt(p.easy, CURLOPT_PRIVATE, &p);
    if (lib().multi_add_handle(L.multi, p.easy) != CURLM_OK) fail(errc::internal, "http.read", p.h->name, "curl_multi_add_handle failed");
  }

  // The piece's end, on any thread: its buffer back, its request told when it was the last.
  void finish(const std::shared_ptr<piece>& p, const error* e) {
    if (p->slot) {
      p->slot = {};
      for (auto& l : lanes_) lib().multi_wakeup(l->multi);  // pieces may be waiting for a buffer
    }
    request& r = *p->req;
    file_source::completion done;
    std::optional<error> err;
    {
      std::lock_guard l(r.mu);
      if (e && !r.err) r.err = *e;
      if (--r.left > 0) return;
      done = std::move(r.done);
      err = r.err;
    }
    done(err ? 0 : r.bytes, err ? &*err : nullptr);
  }

  // An answer ended (curl thread): landed, tried again later, or failed.
  void ended(std::shared_ptr<piece> p, CURLcode rc, std::vector<std::shared_ptr<piece>>& waiting) {
    long status = p->status;
    if (!status) lib().easy_getinfo(p->easy, CURLINFO_RESPONSE_CODE, &status);
    const std::uint64_t at = p->offset + (p->put ? 0 : p->got);  // an upload (a part) is sent again whole
    const std::string here = where(*p);
    if (p->bad) {
      let_go(*p);
      return finish(p, &*p->bad);
    }
    if (p->put && rc == CURLE_OK && status >= 200 && status < 300 && p->got == p->len) {
      let_go(*p);
      if (p->etag_out && p->etag_out->empty()) {
        error e(errc::protocol_error, "http.write", where(*p), "the server kept the part without naming it (no ETag)");
        return finish(p, &e);
      }
      return finish(p, nullptr);
    }
    if (p->method && rc == CURLE_OK && status >= 200 && status < 300) {
      let_go(*p);
      return finish(p, nullptr);
    }
    if (!p->put && (rc == CURLE_OK || (rc == CURLE_WRITE_ERROR && p->enough)) && p->got == p->len && (status == 206 || status == 200)) {
      let_go(*p);
      return landed(std::move(p));
    }
    bool again;
    std::optional<error> e;
    const char* op = p->put || p->method ? "http.write" : "http.read";
    if (rc != CURLE_OK) {
      e = curl_error(rc, p->errbuf, op, here);
      again = retriable(rc);
    } else if (status < 200 || status >= 300) {
      e = status_error(status, op, here);
      again = retriable(status);
    } else {
      e = error(errc::io_error, op, here,
                p->put ? fmt::format("the server answered before all {} bytes were sent", p->len)
                       : fmt::format("the answer ended after {} of the {} bytes asked for", p->got, p->len));
      again = true;
    }
    const auto now = clk::now();
    const auto pause = std::min<std::chrono::milliseconds>(2000ms, 100ms * (1 << std::min(p->attempts, 5)));
    if (again && p->attempts < o_.retries && now + pause < p->until.at() - margin(*p)) {
      ++p->attempts;
      ++n_retries_;
      p->not_before = now + pause;
      log::info("http", "{}; trying again from offset {} in {} ms (attempt {} of {})", e->what(), at, pause.count(),
                p->attempts + 1, o_.retries + 1);
      waiting.push_back(std::move(p));
      return;
    }
    let_go(*p);
    finish(p, &*e);
  }

  // Every byte of the piece is in: done, or (staged) copied on by the transfer engine first.
  void landed(std::shared_ptr<piece> p) {
    if (!p->slot) return finish(p, nullptr);
    n_staged_ += p->len;
    copies_->start({p->dst, p->slot.data(), p->len, &p->user, &p->slot.region()}, p->until.at(),
                   [this, p](const error* e) { finish(p, e); });
  }

  void loop(lane& L) {
    std::vector<std::shared_ptr<piece>> waiting, running;
    for (;;) {
      {
        std::lock_guard l(mu_);
        if (stop_) break;
        for (auto& p : L.incoming) waiting.push_back(std::move(p));
        L.incoming.clear();
      }
      const auto now = clk::now();
      // Start what may: its pause over, a staging buffer had, a connection's worth of room.
      for (auto it = waiting.begin(); it != waiting.end();) {
        auto& p = *it;
        if (now > p->until.at() - margin(*p)) {
          error e = p->until.cancelled() ? error(errc::cancelled, op_of(*p), where(*p), "the batch was cancelled before it was sent")
                                         : error(errc::timeout, op_of(*p), where(*p), "the request's deadline passed before it could be sent");
          let_go(*p);
          finish(p, &e);
          it = waiting.erase(it);
          continue;
        }
        // A part of an upload another part of which failed for good is not sent: the upload is aborted.
        bool given_up = false;
        if (p->etag_out) {
          std::lock_guard rl(p->req->mu);
          given_up = p->req->err.has_value();
        }
        if (given_up) {
          let_go(*p);
          finish(p, nullptr);
          it = waiting.erase(it);
          continue;
        }
        if (p->not_before > now || running.size() >= per_lane_) {
          ++it;
          continue;
        }
        if (p->pool && !p->slot && !(p->slot = p->pool->try_get(pinned_pool::growth::now))) {
          ++it;
          continue;
        }
        try {
          begin(L, *p);
        } catch (const error& e) {
          let_go(*p);
          finish(p, &e);
          it = waiting.erase(it);
          continue;
        }
        running.push_back(std::move(p));
        it = waiting.erase(it);
      }
      int still = 0;
      lib().multi_perform(L.multi, &still);
      int left = 0;
      bool freed = false;  // a piece ended: one waiting may start now, not after the poll's timeout
      while (CURLMsg* m = lib().multi_info_read(L.multi, &left)) {
        if (m->msg != CURLMSG_DONE) continue;
        CURL* easy = m->easy_handle;
        const CURLcode rc = m->data.result;
        lib().multi_remove_handle(L.multi, easy);
        auto it = std::find_if(running.begin(), running.end(), [&](auto& q) { return q->easy == easy; });
        if (it == running.end()) continue;
        auto p = std::move(*it);
        running.erase(it);
        ended(std::move(p), rc, waiting);
        freed = true;
      }
      // A piece ends a little before its batch's deadline (margin: its own error then names it, and
      // an upload's abort is on its way), and, under a deadline that follows progress, when nothing
      // of it has moved for the window while other requests of the batch kept the deadline going.
      int wait_ms = freed && !waiting.empty() ? 0 : waiting.empty() ? 1000 : 20;
      for (auto it = running.begin(); it != running.end();) {
        piece& q = **it;
        const auto idle = q.until.idle();
        const auto now2 = clk::now();
        auto remaining = q.until.at() - margin(q) - now2;
        if (idle > 0ns) remaining = std::min<std::chrono::nanoseconds>(remaining, q.last_moved + idle - margin(q) - now2);
        if (remaining > 0ns) {
          wait_ms = static_cast<int>(std::min<std::int64_t>(wait_ms, std::chrono::ceil<std::chrono::milliseconds>(remaining).count()));
          ++it;
          continue;
        }
        lib().multi_remove_handle(L.multi, q.easy);
        error e = q.until.cancelled()
                      ? error(errc::cancelled, op_of(q), where(q), "the batch was cancelled")
                      : error(errc::timeout, op_of(q), where(q),
                              idle > 0ns ? fmt::format("nothing of it moved for {} ms", std::chrono::duration_cast<std::chrono::milliseconds>(idle).count())
                                         : std::string("the request's deadline passed"));
        let_go(**it);
        finish(*it, &e);
        it = running.erase(it);
      }
      lib().multi_poll(L.multi, nullptr, 0, wait_ms, nullptr);
    }
    // Going: what is left fails; the engine's copies under way end first (they use this engine).
    error gone(errc::cancelled, "http", "http", "the runtime is going");
    for (auto& p : running) {
      lib().multi_remove_handle(L.multi, p->easy);
      let_go(*p);
      finish(p, &gone);
    }
    std::vector<std::shared_ptr<piece>> rest;
    {
      std::lock_guard l(mu_);
      rest.swap(L.incoming);
    }
    for (auto* list : {&waiting, &rest})
      for (auto& p : *list) {
        let_go(*p);
        finish(p, &gone);
      }
    if (copies_) copies_->wait();
  }

  http_options o_;
  std::vector<std::unique_ptr<lane>> lanes_;
  std::size_t per_lane_ = 1;                      // pieces under way per lane
  std::atomic<std::size_t> next_lane_{0};
  std::mutex mu_;
  std::optional<staged_copies> copies_;          // with an engine
  bool stop_ = false;                             // mu_
  std::atomic<std::uint64_t> n_pieces_{0}, n_retries_{0}, n_staged_{0};
};

void s3_multipart::start(http_engine& e, std::shared_ptr<piece> whole, std::uint64_t part, file_source::completion done) {
  auto h = whole->h;
  const source_deadline until = whole->until;
  if (whole->len > (5ull << 40))
    fail(errc::invalid_argument, "http.write", h->name, fmt::format("{} bytes: an S3 object holds at most 5 TiB", whole->len));
  e.exchange(h, "POST", "starting the multipart upload", "uploads=", {}, until,
           [ep = &e, whole, part, done](const std::string& answer, const error* failed) mutable {
    if (failed) return done(0, failed);
    std::string id = xml_text(answer, "UploadId");
    if (id.empty()) {
      error bad(errc::protocol_error, "http.write", whole->h->name, "the server started no multipart upload (no UploadId in its answer)");
      return done(0, &bad);
    }
    try {
      upload_parts(*ep, std::move(whole), part, encode_query(id), done);
    } catch (const error& e2) {
      done(0, &e2);
    } catch (...) {
      error bad(errc::internal, "http.write", whole->h->name, "the parts could not be started");
      done(0, &bad);
    }
  });
}

void s3_multipart::upload_parts(http_engine& e, std::shared_ptr<piece> whole, std::uint64_t part, std::string id, file_source::completion done) {
  const std::uint64_t n = (whole->len + part - 1) / part;
  auto etags = std::make_shared<std::vector<std::string>>(n);
  auto h = whole->h;
  const source_deadline until = whole->until;
  auto req = std::make_shared<request>();
  req->bytes = whole->len;
  req->left = static_cast<int>(n);
  // The parts the server holds are let go when the upload fails (an upload left open costs its
  // owner storage), with a deadline of its own (the write's may be what passed); the write fails
  // with its own error whatever the abort answers.
  auto abort = [ep = &e, h, id](const error& why, file_source::completion& then) {
    auto err = std::make_shared<error>(why);
    try {
      ep->exchange(h, "DELETE", "aborting the multipart upload", "uploadId=" + id, {}, source_deadline(clk::now() + ep->options().deadline),
               [err, then](const std::string&, const error*) { then(0, err.get()); });
    } catch (...) {
      then(0, err.get());
    }
  };
  req->done = [ep = &e, h, id, etags, until, abort, done = std::move(done)](std::uint64_t bytes, const error* why) mutable {
    if (why) return abort(*why, done);
    std::string xml = "<CompleteMultipartUpload>";
    for (std::size_t i = 0; i < etags->size(); ++i) xml += fmt::format("<Part><PartNumber>{}</PartNumber><ETag>{}</ETag></Part>", i + 1, (*etags)[i]);
    xml += "</CompleteMultipartUpload>";
    auto complete = [h, bytes, abort, done](const std::string& answer, const error* failed) mutable {
      if (failed) return abort(*failed, done);
      // S3 may answer 200 and then an error in the body (the upload failed while it assembled it).
      if (answer.find("<Error>") != std::string::npos) {
        error bad(errc::io_error, "http.write", h->name + " (completing the multipart upload)",
                  fmt::format("the server could not complete it: {} {}", xml_text(answer, "Code"), xml_text(answer, "Message")));
        return abort(bad, done);
      }
      done(bytes, nullptr);
    };
    try {
      ep->exchange(h, "POST", "completing the multipart upload", "uploadId=" + id, std::move(xml), until, complete);
    } catch (const error& e2) {
      done(0, &e2);
    } catch (...) {
      error bad(errc::internal, "http.write", h->name, "the multipart upload could not be completed");
      done(0, &bad);
    }
  };
  std::vector<std::shared_ptr<piece>> ps;
  for (std::uint64_t i = 0; i < n; ++i) {
    auto p = std::make_shared<piece>();
    p->req = req;
    p->h = h;
    p->put = true;
    p->url = fmt::format("{}?partNumber={}&uploadId={}", h->url, i + 1, id);
    p->step = fmt::format("part {} of {}, offset {}", i + 1, n, i * part);
    p->etag_out = &(*etags)[i];
    p->etags = etags;
    p->offset = i * part;
    p->len = std::min(part, whole->len - i * part);
    p->dst = whole->dst + i * part;
    p->user = whole->user;
    p->pool = whole->pool;
    p->eng = whole->eng;
    p->until = until;
    ps.push_back(std::move(p));
  }
  e.enqueue(std::move(ps), "http.write");
}


// A file opened for reading (its size and version from the HEAD), or created: then it takes one
// write of the whole file, from offset 0 (what `ferry cp` and a save write): one PUT, or S3's parts.
class http_file final : public file_source {
 public:
  http_file(std::shared_ptr<http_engine> e, head_result h, bool create)
      : e_(std::move(e)), h_(std::make_shared<const head_result>(std::move(h))), create_(create) {}
  std::uint64_t size() override { return create_ ? written_->load() : h_->size; }
  std::string describe() override { return e_->describe(); }
  void start(bool write, std::uint64_t offset, void* mem, std::uint64_t bytes, const source_deadline& until, completion done) override {
    if (write != create_)
      fail(errc::not_supported, write ? "http.write" : "http.read", h_->name,
           write ? "opened for reading: open it for writing (create) to put it" : "opened for writing: it is read once written, opened again");
    if (!write) return e_->read(h_, offset, static_cast<std::byte*>(mem), bytes, until, std::move(done));
    if (offset != 0 || started_.exchange(true))
      fail(errc::not_supported, "http.write", h_->name,
           "an http://, https:// or s3:// file takes one write of the whole file, from offset 0 (the server replaces it whole)");
    // The completion may come after the caller let go of this file: it holds the count, not the file.
    e_->write(h_, static_cast<const std::byte*>(mem), bytes, until, [w = written_, bytes, d = std::move(done)](std::uint64_t n, const error* e) {
      if (!e) *w = bytes;
      d(n, e);
    });
  }

 private:
  std::shared_ptr<http_engine> e_;
  std::shared_ptr<const head_result> h_;
  bool create_;
  std::atomic<bool> started_{false};
  std::shared_ptr<std::atomic<std::uint64_t>> written_ = std::make_shared<std::atomic<std::uint64_t>>(0);
};

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

// An S3 key in a URL path: every byte but the unreserved ones and '/' percent-encoded (what SigV4
// canonicalizes, once).
std::string encode_key(std::string_view key) {
  std::string out;
  for (unsigned char ch : key) {
    if (std::isalnum(ch) || ch == '-' || ch == '_' || ch == '.' || ch == '~' || ch == '/') out += static_cast<char>(ch);
    else out += fmt::format("%{:02X}", ch);
  }
  return out;
}

// The shared credentials file's profile (AWS_SHARED_CREDENTIALS_FILE, else ~/.aws/credentials;
// AWS_PROFILE, else "default"): key id, secret, session token.
std::array<std::string, 3> credentials_file() {
  std::string path = env("AWS_SHARED_CREDENTIALS_FILE");
  if (path.empty() && !env("HOME").empty()) path = env("HOME") + "/.aws/credentials";
  std::string profile = env("AWS_PROFILE").empty() ? "default" : env("AWS_PROFILE");
  std::array<std::string, 3> got;
  std::FILE* f = path.empty() ? nullptr : std::fopen(path.c_str(), "r");
  if (!f) return got;
  char buf[4096];
  bool in = false;
  auto trim = [](std::string_view v) {
    while (!v.empty() && std::isspace(static_cast<unsigned char>(v.front()))) v.remove_prefix(1);
    while (!v.empty() && std::isspace(static_cast<unsigned char>(v.back()))) v.remove_suffix(1);
    return v;
  };
  while (std::fgets(buf, sizeof buf, f)) {
    std::string_view line = trim(buf);
    if (line.starts_with("[")) {
      in = trim(line.substr(1, line.find(']') - 1)) == profile;
      continue;
    }
    auto eq = line.find('=');
    if (!in || eq == std::string_view::npos) continue;
    std::string_view k = trim(line.substr(0, eq)), v = trim(line.substr(eq + 1));
    if (k == "aws_access_key_id") got[0] = v;
    else if (k == "aws_secret_access_key") got[1] = v;
    else if (k == "aws_session_token") got[2] = v;
  }
  std::fclose(f);
  return got;
}

// s3://bucket/key: the URL (AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, path-style; else AWS's
// virtual-host style in AWS_REGION) and the signature (the AWS_* environment, else the shared
// credentials file; neither: unsigned, for public objects).
target resolve_s3(const std::string& uri) {
  std::string_view s = uri;
  s.remove_prefix(5);
  const auto slash = s.find('/');
  if (slash == std::string_view::npos || slash == 0 || slash + 1 >= s.size())
    fail(errc::invalid_argument, "file.open", uri, "expected s3://bucket/key");
  const std::string bucket(s.substr(0, slash)), key = encode_key(s.substr(slash + 1));
  std::string region = env("AWS_REGION");
  if (region.empty()) region = env("AWS_DEFAULT_REGION");
  if (region.empty()) region = "us-east-1";
  std::string endpoint = env("AWS_ENDPOINT_URL_S3");
  if (endpoint.empty()) endpoint = env("AWS_ENDPOINT_URL");
  while (!endpoint.empty() && endpoint.back() == '/') endpoint.pop_back();
  target t;
  t.name = uri;
  if (!endpoint.empty()) t.url = endpoint + "/" + bucket + "/" + key;
  else if (bucket.find('.') != std::string::npos) t.url = "https://s3." + region + ".amazonaws.com/" + bucket + "/" + key;
  else t.url = "https://" + bucket + ".s3." + region + ".amazonaws.com/" + key;
  std::array<std::string, 3> c{env("AWS_ACCESS_KEY_ID"), env("AWS_SECRET_ACCESS_KEY"), env("AWS_SESSION_TOKEN")};
  if (c[0].empty() || c[1].empty()) c = credentials_file();
  if (!c[0].empty() && !c[1].empty()) t.sign = std::make_shared<const s3_signing>(s3_signing{region, c[0] + ":" + c[1], c[2]});
  return t;
}

struct http_registry {
  std::function<http_options()> options;
  std::mutex mu;
  std::shared_ptr<http_engine> engine;  // made on the first open

  std::shared_ptr<file_source> open(const std::string& uri, open_mode mode) {
    const bool s3 = uri.starts_with("s3://");
    target t = s3 ? resolve_s3(uri) : target{uri, uri_for_messages(uri), nullptr};
    if (mode == open_mode::read_write)
      fail(errc::not_supported, "file.open", t.name, "not in place: open it for reading, or for writing (create) to put it whole");
    std::shared_ptr<http_engine> e;
    {
      std::lock_guard l(mu);
      if (!engine) engine = std::make_shared<http_engine>(options());
      e = engine;
    }
    if (mode == open_mode::create) {
      head_result h;
      static_cast<target&>(h) = t;
      return std::make_shared<http_file>(std::move(e), std::move(h), true);
    }
    auto h = head(t, e->options());
    if (!s3) h.name = uri_for_messages(h.url);  // where the redirects led
    return std::make_shared<http_file>(std::move(e), std::move(h), false);
  }
};

}  // namespace

http_registration register_http_files(std::function<http_options()> options) {
  auto reg = std::make_shared<http_registry>();
  reg->options = std::move(options);
  auto open = [reg](const std::string& url, open_mode mode) { return reg->open(url, mode); };
  return {register_file_scheme("http", open), register_file_scheme("https", open), register_file_scheme("s3", open)};
}

}  // namespace ferry::store
