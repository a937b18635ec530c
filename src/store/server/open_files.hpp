#pragma once
// The server's open files (store/server/): files opened for reading, reused while their paths still
// name them, and where each lives (a local file system, or one that may not answer).
#include <ferry/io/file.hpp>
#include <ferry/io/mapped_file.hpp>
#include <ferry/net/protocol.hpp>
#include <ferry/store/root.hpp>

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/vfs.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

namespace ferry::store::detail {

using clk = std::chrono::steady_clock;

// Whether the file lives on a local disk or in memory, where a read waits at most for the disk: a
// progress thread may read it itself, and a same-host client may be lent it. A network or FUSE file
// system may not answer for as long as it likes (a hung mount, a daemon that stopped), which on a
// progress thread would stall every client of that worker; such files are read only by file
// requests, and never lent (a client's own reads there would load the mount past the server's
// bounds).
inline bool local_file_system(int fd) {
  struct ::statfs fs{};
  if (::fstatfs(fd, &fs) != 0) return false;
  switch (static_cast<unsigned long>(fs.f_type)) {
    case 0xEF53:      // ext2/3/4
    case 0x58465342:  // xfs
    case 0x9123683E:  // btrfs
    case 0xF2F52010:  // f2fs
    case 0x2FC12FC1:  // zfs
    case 0xCA451A4E:  // bcachefs
    case 0x01021994:  // tmpfs
    case 0x858458F6:  // ramfs
    case 0x794C7630:  // overlayfs (container roots over the above)
      return true;
    default:
      return false;
  }
}

struct open_file {
  std::shared_ptr<ferry::file> f;  // the io layer's file: requests of the file engine name it
  int fd = -1;
  dev_t dev = 0;
  ino_t ino = 0;
  bool local = false;  // on a local file system (local_file_system): small reads may run on a progress thread
  mapped_file map;  // local files opened for reading: small reads copy from here, no system call
  open_file(std::shared_ptr<ferry::file> fl, const struct ::stat& st, bool mapped)
      : f(std::move(fl)), fd(f->fd()), dev(st.st_dev), ino(st.st_ino), local(local_file_system(fd)) {
    if (mapped && local) map = mapped_file(fd);
  }
};

// A read that names a version (net::file_version of the file its first look found) is served only
// from that file: one replaced since fails the read, naming where, instead of mixing two versions.
inline const std::shared_ptr<open_file>& same_version(const std::shared_ptr<open_file>& f, std::uint64_t version, const std::string& path,
                                               std::uint64_t offset) {
  if (version && net::file_version(f->dev, f->ino) != version)
    fail(errc::io_error, "store.read", fmt::format("{} offset {}", printable(path), offset),
         "the file was replaced since the read began (a read comes from one version of a file); read it again");
  return f;
}

// Open files for reading, reused: a storage server answers many small requests on the same few
// files, and openat2 + fstat + close per 4 KiB read would cost more than the read. A cached file is
// used only while its path still names it (one fstatat per use, compared by device and inode), so a
// deleted or replaced file is never served; entries older than `ttl` are closed at the next miss,
// so a deleted file's descriptor does not keep its space.
class fd_cache {
 public:
  fd_cache(const root_dir& r, std::chrono::nanoseconds ttl) : root_(r), ttl_(ttl) {}
  // `opened` (if given) gets when the file was opened: it is reused until opened + ttl.
  std::shared_ptr<open_file> get(const std::string& path, clk::time_point* opened = nullptr) {
    auto now = clk::now();
    std::shared_ptr<open_file> hit;
    clk::time_point at;
    {
      std::lock_guard l(mu_);
      auto it = map_.find(path);
      if (it != map_.end() && now - it->second.at < ttl_) hit = it->second.f, at = it->second.at;
    }
    if (hit && still_names(path, *hit)) {
      if (opened) *opened = at;
      return hit;
    }
    struct ::stat st{};
    int fd = root_.open_regular(path, O_RDONLY, &st);
    // Read through the page cache (no O_DIRECT descriptor): a server's files are read again, by
    // other clients or the same one, and the page cache is its cache.
    auto f = std::make_shared<open_file>(ferry::file::adopt(fd, printable(path), false, false), st, true);
    if (opened) *opened = now;
    std::lock_guard l(mu_);
    std::erase_if(map_, [&](const auto& kv) { return now - kv.second.at >= ttl_; });
    if (map_.size() >= 256) map_.clear();  // bounded; entries still in use live on in their holders
    map_[path] = {f, now};
    return f;
  }
  // Whether `path` (beneath the root) still names `f`'s file. The lookup is not confined to the
  // root, but only a match with a file opened through it counts.
  bool still_names(const std::string& path, const open_file& f) const {
    struct ::stat st{};
    return ::fstatat(root_.fd(), path.c_str(), &st, 0) == 0 && st.st_dev == f.dev && st.st_ino == f.ino;
  }
  // The cheap check for the small-read path, without a path lookup: a file deleted, or replaced by
  // a rename over its name, has no links left. (A file renamed away under another name keeps its
  // link: it is noticed when the session's entry expires and `get` looks the path up.)
  static bool still_linked(const open_file& f, std::uint64_t* size) {
    struct ::stat st{};
    if (::fstat(f.fd, &st) != 0 || st.st_nlink == 0) return false;
    *size = static_cast<std::uint64_t>(st.st_size);
    return true;
  }

 private:
  struct entry {
    std::shared_ptr<open_file> f;
    clk::time_point at;
  };
  const root_dir& root_;
  std::chrono::nanoseconds ttl_;
  std::mutex mu_;
  std::unordered_map<std::string, entry> map_;
};


}  // namespace ferry::store::detail
