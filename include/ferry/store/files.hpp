#pragma once
// ferry:// paths in the file API. While the returned registration lives, file::open("ferry://h:p/x")
// gives a file served by `ferry serve` on h:p: file_engine batches, the synchronous read/write
// helpers and everything built on them (ferry cp file:..., user code) work on it as on a local file,
// into and out of any memory ferry knows (host, pinned, GPU, sim), with the same deadlines and
// per-request results. A ferry::runtime registers it for itself; files opened through it must be
// closed before the runtime goes.
//
// One store::client per host:port is shared by every file opened there (its lanes, credits and
// landing region serve them all). A request goes to the client's queue (client::submit) and is completed on
// the thread that ends it, mostly a lane's progress thread, so submit() never blocks on the network; a read or write whose connection was lost (server restarted)
// is retried once after reconnecting, within the request's deadline. Modes: read (the file must
// exist), read_write (the server must be writable; a missing file is created by the first write);
// create is refused (the protocol has no truncate).
#include <ferry/io/file_source.hpp>
#include <ferry/store/client.hpp>

#include <functional>

namespace ferry::store {

FERRY_API scheme_registration register_ferry_files(std::function<client_options()> options);

}  // namespace ferry::store
