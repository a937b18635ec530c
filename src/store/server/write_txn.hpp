#pragma once
// A write transaction of the server (store/server/): the new version of a file, filled by write
// pieces and put in place by its commit.
#include "store/server/open_files.hpp"

#include <map>
#include <optional>

namespace ferry::store::detail {

using net::max_data;
using net::write_mode;

// A write in progress (protocol 4): a new file in the target's directory -- unnamed (O_TMPFILE)
// where the file system allows it, else under a hidden name -- that write pieces fill and commit()
// renames over the target in one step: readers see the old file or the new one, never a mix, and
// a writer that goes away leaves the target untouched. Unless committed, the new file goes with
// its descriptor (a hidden one is unlinked).
class write_txn {
 public:
  write_txn(const root_dir& root, const std::string& path, write_mode mode, std::uint64_t id, std::uint64_t size_hint)
      : path_(path), id_(id) {
    root_dir::check(path);
    res_ = fmt::format("'{}' under {}", printable(path), root.path());
    auto slash = path.rfind('/');
    name_ = slash == std::string::npos ? path : path.substr(slash + 1);
    if (name_.empty() || name_ == "." || name_ == "..") fail(errc::invalid_argument, "store.write", res_, "names no file");
    dir_ = root.open(slash == std::string::npos ? "." : path.substr(0, slash), O_PATH | O_DIRECTORY);
    // The target, if there is one, must be a regular file: its permissions carry over, and `keep`
    // starts from its content.
    struct ::stat ts{};
    bool exists = ::fstatat(dir_, name_.c_str(), &ts, AT_SYMLINK_NOFOLLOW) == 0;
    if (exists && !S_ISREG(ts.st_mode)) {
      ::close(dir_);
      fail(errc::invalid_argument, "store.write", res_, fmt::format("is a {}; only regular files are written", root_dir::kind_of(ts)));
    }
    mode_t perm = exists ? (ts.st_mode & 07777) : 0644;
    hidden_ = fmt::format(".ferry-{:016x}", id);
    int fd = ::openat(dir_, ".", O_TMPFILE | O_RDWR | O_CLOEXEC, perm);
    if (fd < 0 && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL)) {
      fd = ::openat(dir_, hidden_.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC | O_NOFOLLOW, perm);
      named_ = fd >= 0;
    }
    if (fd < 0) {
      int e = errno;
      ::close(dir_);
      fail_errno(e, "store.write", res_, "cannot create its new version beside it");
    }
    struct ::stat st{};
    ::fstat(fd, &st);
    if (exists) ::fchmod(fd, perm);  // not narrowed by the umask
    // Written through the page cache, as a pwrite would (no O_DIRECT descriptor): the data is read
    // back right after the commit, and the commit does not wait for the disk.
    try {
      f_ = std::make_shared<open_file>(ferry::file::adopt(fd, printable(path), true, false), st, false);
    } catch (...) {
      ::close(dir_);
      throw;
    }
    keep_ = mode == write_mode::keep && exists;
    // Pieces arrive out of order on several lanes; writes inside the file's size do not extend it.
    if (size_hint && static_cast<std::uint64_t>(st.st_size) < size_hint) ::ftruncate(fd, static_cast<off_t>(size_hint));
  }
  ~write_txn() {
    if (named_ && !committed_) ::unlinkat(dir_, hidden_.c_str(), 0);
    ::close(dir_);
    if (replaced_ >= 0) ::close(replaced_);  // the old version's pages and blocks are freed here
  }
  write_txn(const write_txn&) = delete;
  write_txn& operator=(const write_txn&) = delete;

  const std::string& path() const noexcept { return path_; }
  std::uint64_t id() const noexcept { return id_; }
  const std::shared_ptr<open_file>& file() const noexcept { return f_; }
  // write_mode::keep of an existing file: its content is copied in first (write_path::keep).
  bool keeps() const noexcept { return keep_; }
  void* owner = nullptr;  // the session that opened it (dropped with it)

  // [offset, offset + n) of the new version holds data that arrived (or, for `keep`, was copied in).
  void wrote(std::uint64_t offset, std::uint64_t n) {
    if (!n) return;
    std::lock_guard l(cover_mu_);
    std::uint64_t b = offset, e = offset + n;
    auto it = covered_.upper_bound(b);
    if (it != covered_.begin() && std::prev(it)->second >= b) --it;
    while (it != covered_.end() && it->first <= e) {  // merge what touches or overlaps
      b = std::min(b, it->first);
      e = std::max(e, it->second);
      it = covered_.erase(it);
    }
    covered_.emplace(b, e);
  }

  // Puts it in place. What is committed is what arrived: the writes must cover [0, size) with no gap
  // (`size` given: exactly that; else the file ends where the data ends), or nothing replaces the
  // target. Returns its size.
  std::uint64_t commit(std::optional<std::uint64_t> size) {
    int fd = f_->fd;
    std::uint64_t end = 0;
    {
      std::lock_guard l(cover_mu_);
      if (covered_.size() > 1 || (!covered_.empty() && covered_.begin()->first != 0)) {
        std::uint64_t gap = covered_.begin()->first == 0 ? covered_.begin()->second : 0;
        std::uint64_t next = covered_.begin()->first == 0 ? std::next(covered_.begin())->first : covered_.begin()->first;
        fail(errc::invalid_argument, "store.commit", res_,
             fmt::format("the writes leave a gap at [{}, {}) ({} written ranges); nothing was replaced", gap, next, covered_.size()));
      }
      end = covered_.empty() ? 0 : covered_.begin()->second;
    }
    if (size && *size != end)
      fail(errc::invalid_argument, "store.commit", res_,
           fmt::format("a commit of {} bytes, but the writes cover [0, {}); nothing was replaced", *size, end));
    if (::ftruncate(fd, static_cast<off_t>(end)) != 0) fail_errno(errno, "store.commit", res_, "cannot set its size");
    if (!named_) {
      // linkat cannot replace a name: the new file gets its hidden name first, then the rename.
      if (::linkat(fd, "", dir_, hidden_.c_str(), AT_EMPTY_PATH) != 0) {
        std::string self = fmt::format("/proc/self/fd/{}", fd);
        if (::linkat(AT_FDCWD, self.c_str(), dir_, hidden_.c_str(), AT_SYMLINK_FOLLOW) != 0)
          fail_errno(errno, "store.commit", res_, "cannot link the new version into the directory");
      }
      named_ = true;
    }
    // The version it replaces stays open until this transaction goes, after the commit was
    // answered: freeing a large file's page cache and blocks is not the client's wait. It is
    // exchanged with the new one (one atomic step, as a rename) and then unlinked: a rename over an
    // existing file makes ext4 start writing the new file's data back before it returns
    // (auto_da_alloc), which costs the commit the time to submit all of it to the disk.
    replaced_ = ::openat(dir_, name_.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    bool exchanged = replaced_ >= 0 && ::renameat2(dir_, hidden_.c_str(), dir_, name_.c_str(), RENAME_EXCHANGE) == 0;
    if (exchanged) {
      ::unlinkat(dir_, hidden_.c_str(), 0);
    } else if (::renameat(dir_, hidden_.c_str(), dir_, name_.c_str()) != 0) {
      fail_errno(errno, "store.commit", res_, "cannot put the new version in place");
    }
    committed_ = true;
    struct ::stat st{};
    ::fstat(fd, &st);
    return static_cast<std::uint64_t>(st.st_size);
  }

 private:
  std::string path_, res_, name_, hidden_;
  std::uint64_t id_;
  int dir_ = -1, replaced_ = -1;
  bool named_ = false, committed_ = false, keep_ = false;
  std::shared_ptr<open_file> f_;
  std::mutex cover_mu_;
  std::map<std::uint64_t, std::uint64_t> covered_;  // begin -> end of each written range, merged
};


}  // namespace ferry::store::detail
