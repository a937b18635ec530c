#pragma once
// http://, https:// and s3:// files in the file API (docs/design/remote-sources.md). While the returned
// registration lives, file::open("https://host/path") gives a file that file_engine
// batches, the synchronous helpers and everything built on them (ferry cp, ferry.open,
// ferry.safetensors.load) read like a local one, into any memory ferry knows (host, pinned, GPU,
// sim), with the same per-request results and deadlines. A ferry::runtime registers it for itself.
//
// Opening asks the server for the file's size and version (HEAD: Content-Length, ETag). A read is cut
// into range requests of at most `piece` bytes, at most `connections` under way at once, each on
// a connection of its own, spread over `threads` libcurl threads; each range must come from the version
// seen at open (If-Match), so a file replaced under a read fails it instead of mixing two. GPU and
// sim memory is landed in the transfer engine's pinned staging buffers and copied on by the engine;
// host memory directly. A piece whose connection is reset or closed, or that gets a 5xx or 429
// answer, is tried again from the byte it reached (`retries` times, pausing 0.1 s doubling to 2 s);
// one that moves no byte for `deadline` fails. Errors name the URL and the byte offset.
// A file opened for writing (create) takes one write of the whole file, sent as one PUT (s3:// larger
// than a part: a multipart upload, its parts in parallel, aborted when one fails). As with
// ferry://, files opened through a runtime are closed before the runtime goes.
// s3://bucket/key is such a request to the bucket's endpoint, signed (SigV4, by libcurl) with the
// standard AWS environment or the shared credentials file; anonymous without either.
#include <ferry/core/export.hpp>
#include <ferry/io/file_source.hpp>
#include <ferry/store/settings.hpp>

#include <chrono>
#include <functional>
#include <string>

namespace ferry {
class registration_cache;
class transfer_engine;
}  // namespace ferry

namespace ferry::store {

struct http_options {
  // Memory kinds and staging, as for the ferry:// client: without them every pointer is host memory.
  registration_cache* cache = nullptr;
  transfer_engine* engine = nullptr;
  std::uint64_t piece = store_settings{}.http_piece;       // FERRY_HTTP_PIECE
  int connections = store_settings{}.http_connections;     // FERRY_HTTP_CONNECTIONS
  int threads = 1;                                             // FERRY_HTTP_THREADS (resolved)
  int retries = store_settings{}.http_retries;             // FERRY_HTTP_RETRIES
  std::chrono::nanoseconds deadline = core_settings{}.deadline;  // no byte for this long: fail
  std::string ca_file = store_settings{}.http_ca_file;     // FERRY_HTTP_CA_FILE
  std::string curl_library = store_settings{}.curl_library;  // FERRY_CURL_LIBRARY
};

FERRY_API http_options http_options_from(const store_settings& s, registration_cache* cache, transfer_engine* engine);

// Registers "http", "https" and "s3" with the file API; the options are taken on the first open.
struct http_registration {
  scheme_registration http, https, s3;
};
FERRY_API http_registration register_http_files(std::function<http_options()> options);

}  // namespace ferry::store
