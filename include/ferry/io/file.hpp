#pragma once
// A file as a transfer endpoint: an open local file (its buffered and O_DIRECT descriptors), or a
// remote one whose file_source moves the data (ferry://). The file engine (ferry/io/file_engine.hpp)
// reads and writes its ranges.
//
// Backend (the file engine's): io_uring (liburing). O_DIRECT when the file system allows it — any offset, length and
// buffer work: the aligned superset is read into pinned staging buffers (the transfer engine's
// staging pool, shared with every staged path) and only the asked bytes are delivered (buffered reads
// into host memory land in place, no staging); page-cache-resident ranges are read
// buffered (faster than bypassing a warm cache). Reads and host->device copies overlap: several
// staging buffers are in flight. cuFile (GPUDirect Storage) is probed (see probe_cufile); where
// handle registration fails (cuFile error 5027, for example) io_uring is used and the reason is
// reported by `ferry info --path`.
#include <ferry/core/export.hpp>
#include <ferry/io/file_source.hpp>

#include <cstdint>
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
  // A descriptor the caller keeps (and closes): used as it is, never closed here, and no O_DIRECT
  // descriptor opened beside it, since closing any descriptor of a file drops the process's record
  // locks on it (fcntl F_SETLK); all I/O goes through the page cache.
  static std::shared_ptr<file> borrow(int fd, std::string path, bool writable);
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
  // The remote side of a file opened through a scheme, else null (a local file, or one whose scheme's
  // server on this host lent its descriptor: file_source::take_descriptor).
  const std::shared_ptr<file_source>& source() const noexcept { return source_; }
  // Opened by URI, the descriptor lent by the scheme's server on this host: read as a local file.
  bool lent() const noexcept { return lent_; }
  // Where its bytes come from, for a person to read: the source's description, or a local file's.
  std::string describe() const;
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
  bool owned_ = true;  // fd_ is closed with the file (not when borrowed)
  bool lent_ = false;  // opened by URI, its descriptor lent by the scheme's server
  std::shared_ptr<file_source> source_;
};

}  // namespace ferry
