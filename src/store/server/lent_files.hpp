#pragma once
// The files a server lends its same-host clients (FERRY_SERVE_LEND_FILES; docs/design/storage-service.md,
// "Same-host files are lent for reading"): a read-only descriptor of a file beneath the root, passed
// on the lending socket, which the client then reads itself.
#include <ferry/store/root.hpp>

#include "store/lending.hpp"
#include "store/server/open_files.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <utility>

namespace ferry::store::detail {

class file_lender {
 public:
  explicit file_lender(const root_dir& root) : root_(root) {}
  // Opens `path` as a read of it would be opened (a regular file, no way out of the root), read-only,
  // and answers with its descriptor or why not. Only files on a local file system are lent: one on
  // a network or FUSE file system is read through the server, whose workers bound how it is read.
  // Nor, to a process of another user than the server's and the file's owner, is a file writable by
  // group or others: a descriptor can be opened again through /proc/self/fd with whatever access the
  // file's mode gives that user, without the search permission of the directories above it that
  // reaching the file by its path needs (the server's own user and the owner gain nothing by it).
  // `uid`: the asking process's user, -1 if unknown. The open runs on a thread of its own that holds
  // nothing of the server's (a copy of the root's descriptor, the shared counts): an open may wait on
  // a hung mount for good, and neither the lending socket, the janitor nor the server's stop may wait
  // for it. At most `max_opening` at once; past them the client reads through the server.
  void open(const std::string& path, std::int64_t uid, lending_socket::answer_fn answer) {
    if (counts_->opening.fetch_add(1) >= max_opening) {
      counts_->opening--;
      return answer(-1, "the server is opening too many files at once; read through it");
    }
    int dir = ::fcntl(root_.fd(), F_DUPFD_CLOEXEC, 0);
    if (dir < 0) {
      counts_->opening--;
      return answer(-1, fmt::format("dup of the root's descriptor: {}", std::strerror(errno)));
    }
    try {
      std::thread([dir, root = root_.path(), path, uid, answer, counts = counts_] {
        int fd = -1, other = -1;
        std::string why;
        try {
          root_dir r(dir, root);
          fd = r.open_regular(path, O_RDONLY);
          struct ::stat st{};
          if (!local_file_system(fd))
            why = "not on a local file system (a network or FUSE mount is read through the server)";
          else if (::fstat(fd, &st) != 0)
            why = fmt::format("fstat: {} (read through the server)", std::strerror(errno));
          else if ((st.st_mode & (S_IWGRP | S_IWOTH)) && uid != std::int64_t{::geteuid()} && uid != std::int64_t{st.st_uid})
            why = "writable by group or others, and neither the server's user nor the file's owner asks (read through the server)";
          if (!why.empty()) {
            std::swap(fd, other);
          } else {
            counts->lent++;
          }
        } catch (const std::exception& e) {
          why = e.what();
        }
        try {
          answer(fd, why);  // (which closes the descriptor, sent or not)
        } catch (const std::exception&) {
        }
        if (other >= 0) ::close(other);  // after the answer: closing a file on a mount that hangs may wait
        counts->opening--;
      }).detach();
    } catch (const std::exception& e) {
      ::close(dir);
      counts_->opening--;
      answer(-1, e.what());
    }
  }
  std::uint64_t lent() const noexcept { return counts_->lent.load(); }

 private:
  struct counts {
    std::atomic<std::uint64_t> lent{0};
    std::atomic<int> opening{0};
  };
  static constexpr int max_opening = 8;
  const root_dir& root_;
  std::shared_ptr<counts> counts_ = std::make_shared<counts>();
};

}  // namespace ferry::store::detail
