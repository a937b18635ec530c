#pragma once
// The file engine: reads and writes ranges between files (ferry/io/file.hpp) and any memory ferry
// knows (host pageable or pinned, GPU, sim), synchronously or as batches with the transfer engine's
// semantics (transfer_batch: poll, wait with deadline, cancel, per-request results).
// docs/design/file-engine.md has the decisions.
#include <ferry/core/export.hpp>
#include <ferry/io/file.hpp>
#include <ferry/io/settings.hpp>
#include <ferry/xfer/engine.hpp>

#include <memory>
#include <span>
#include <string>

namespace ferry {

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
  file_engine(transfer_engine& xfer, device_registry& devices, registration_cache& cache, const io_settings& s);
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
  // What it moves device copies through and classifies memory with (those it was made with): the
  // layers above that read files into device memory use the same.
  transfer_engine& transfers() noexcept;
  registration_cache& registrations() noexcept;

  struct impl;

 private:
  void start(const std::shared_ptr<transfer_batch::state>& b, std::span<const file_request> requests);
  void start_on(const std::shared_ptr<transfer_batch::state>& b, std::span<const file_request> requests, stream& s);
  std::unique_ptr<impl> impl_;
};

}  // namespace ferry
