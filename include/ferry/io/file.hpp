#pragma once
// Files as transfer endpoints: read and write ranges between a file and any memory ferry knows
// (host pageable or pinned, GPU, sim), synchronously or as batches with the transfer engine's
// semantics (transfer_batch: poll, wait with deadline, cancel, per-request results).
//
// Backend: io_uring (liburing). O_DIRECT when the file system allows it — any offset, length and
// buffer work: the aligned superset is read into pinned staging buffers (the transfer engine's
// staging pool, shared with every staged path) and only the asked bytes are delivered (buffered reads
// into host memory land in place, no staging); page-cache-resident ranges are read
// buffered (faster than bypassing a warm cache). Reads and host->device copies overlap: several
// staging buffers are in flight. cuFile (GPUDirect Storage) is probed (see probe_cufile); where
// handle registration fails (cuFile error 5027, for example) io_uring is used and the reason is
// reported by `ferry info --path`.
#include <ferry/core/export.hpp>
#include <ferry/core/settings.hpp>
#include <ferry/io/file_source.hpp>
#include <ferry/xfer/engine.hpp>

#include <memory>
#include <string>

namespace ferry {

enum class open_mode {
  read,        // existing file, read only
  read_write,  // existing file
  create,      // create or truncate, read-write
};

class FERRY_API file {
 public:
  // Throws not_found / permission_denied / ... naming the path and the errno. A path with a scheme
  // ("ferry://host:port/path") is opened by the scheme's registered opener (see file_source.hpp; a
  // ferry::runtime registers ferry://); such a file has no descriptors (fd() is -1).
  static std::shared_ptr<file> open(const std::string& path, open_mode mode);
  // A descriptor of a regular file opened elsewhere (a server resolves paths beneath its root
  // itself): the file owns it from now on (closes it, even when adopt throws). `path` names it in
  // errors. With `direct`, an O_DIRECT descriptor is opened again from this one (large cold ranges
  // then bypass the page cache); without, all I/O goes through the page cache.
  static std::shared_ptr<file> adopt(int fd, std::string path, bool writable, bool direct = true);
  // A file whose bytes `source` moves (what a scheme's opener returns, or memory presented as a
  // file): file engine batches and the GPU page cache take it like any other. `name` names it in
  // errors; writes need `writable`.
  static std::shared_ptr<file> over(std::shared_ptr<file_source> source, std::string name, bool writable);
  ~file();
  file(const file&) = delete;
  file& operator=(const file&) = delete;

  const std::string& path() const noexcept { return path_; }
  std::uint64_t size() const;          // current size (fstat)
  void resize(std::uint64_t bytes);    // ftruncate (sparse when growing)
  void sync();                         // fsync
  // Reads on this thread, for ranges too small to be worth a hand-off to the engine's threads;
  // returns the bytes read (short at the end of the file). Errors name the path and offset.
  std::uint64_t read_here(void* dst, std::uint64_t bytes, std::uint64_t offset) const;
  // Writes on this thread, likewise (through the page cache); all of it or throws.
  void write_here(const void* src, std::uint64_t bytes, std::uint64_t offset) const;
  bool writable() const noexcept { return writable_; }
  int fd() const noexcept { return fd_; }
  // The remote side of a file opened through a scheme, else null.
  const std::shared_ptr<file_source>& source() const noexcept { return source_; }
  int direct_fd() const noexcept { return dfd_; }  // -1 when O_DIRECT is refused here
  std::uint32_t dio_align() const noexcept { return align_; }  // offset/length/buffer alignment for O_DIRECT
  // A number no other file object of this process has had (for what is kept per file beyond one
  // call, where an address or a descriptor number may come back for another file).
  std::uint64_t id() const noexcept { return id_; }

 private:
  file();
  std::uint64_t id_;
  std::string path_;
  int fd_ = -1, dfd_ = -1;
  std::uint32_t align_ = 4096;
  bool writable_ = false;
  std::shared_ptr<file_source> source_;
};

struct file_request {
  std::shared_ptr<file> f;
  std::uint64_t offset = 0;
  void* mem = nullptr;      // destination of a read, source of a write
  std::uint64_t bytes = 0;
  bool write = false;
};

// Which backend serves a path, and why (for `ferry info --path` and logs).
struct file_backend_choice {
  std::string backend;  // "io_uring" or "cufile"
  bool direct = false;  // O_DIRECT possible
  std::uint32_t align = 0;
  std::string reason;
};

class FERRY_API file_engine {
 public:
  file_engine(transfer_engine& xfer, device_registry& devices, registration_cache& cache, const settings& s);
  ~file_engine();
  file_engine(const file_engine&) = delete;
  file_engine& operator=(const file_engine&) = delete;

  // Reads past the end of a file complete with the bytes that exist (request_result::bytes_done);
  // a file that shrinks while it is read fails the request.
  // With transfer_options::on (a user's stream), each request is a pipeline on that stream: the
  // file side reads into FERRY_STREAM_SLOTS pinned staging buffers on ferry's threads, ahead of the
  // stream, and the stream waits for each buffer, copies it into `mem` and hands it back -- so `mem`
  // is written in the stream's order (work enqueued after submit sees it) and no CPU waits for the
  // stream. Writes likewise: the stream copies `mem` into a buffer once its earlier work is done,
  // ferry's threads write it to the file. Local files and ferry:// alike; device, pinned, pageable
  // and unified memory. A read must lie within the file (a file that ends first fails the request);
  // on any failure or deadline the stream is released (the bytes it then copies are not the
  // file's) and the result says so. docs/design/stream-ordering.md.
  transfer_batch submit(std::span<const file_request> requests, transfer_options o = {});
  // A batch no thread waits for: `done` is called once with every request's result when all are
  // final, on the thread that finished the last one (an engine thread, or this one before submit
  // returns). It must not block. The batch runs until it is done or its deadline passes.
  using completion = transfer_engine::completion;
  void submit(std::span<const file_request> requests, transfer_options o, completion done);
  // One stream-ordered request (submit with transfer_options::on = &s): `dst` gets the file's bytes
  // in s's order; write_async takes `src` in s's order. The handle reports the result; destroying it
  // before the stream reached the request cancels it (the stream is still released).
  transfer_batch read_async(std::shared_ptr<file> f, std::uint64_t offset, void* dst, std::uint64_t bytes, stream& s,
                            transfer_options o = {});
  transfer_batch write_async(std::shared_ptr<file> f, std::uint64_t offset, const void* src, std::uint64_t bytes,
                             stream& s, transfer_options o = {});
  // Synchronous helpers; read returns the bytes read (short at EOF).
  std::uint64_t read(file& f, std::uint64_t offset, void* dst, std::uint64_t bytes, transfer_options o = {});
  void write(file& f, std::uint64_t offset, const void* src, std::uint64_t bytes, bool fsync = false,
             transfer_options o = {});

  // Settles now how requests for `f` into `dev`'s memory will be served (opens cuFile and registers
  // the file when cuFile may serve it). Those first calls may wait for the device's running kernels: whoever
  // serves requests while the device runs kernels that wait for them (gpu::proxy) prepares first.
  void prepare(file& f, const device& dev);
  file_backend_choice backend_for(const std::string& path);
  ferry::stats& counters() noexcept;

  struct impl;

 private:
  void start(const std::shared_ptr<transfer_batch::state>& b, std::span<const file_request> requests);
  void start_on(const std::shared_ptr<transfer_batch::state>& b, std::span<const file_request> requests, stream& s);
  std::unique_ptr<impl> impl_;
};

}  // namespace ferry
