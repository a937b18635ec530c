#pragma once
// Files that live elsewhere, named by a URI ("ferry://host:port/path"). The io layer knows them only
// through this interface: the layer that implements a scheme (store, for ferry://) registers an
// opener, and from then on file::open, file_engine batches and the synchronous helpers treat such
// a file like a local one -- same requests, same per-request results, deadlines and errors.
#include <ferry/core/error.hpp>
#include <ferry/core/export.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>

namespace ferry {

enum class open_mode;

// A request's deadline as its source sees it: the deadline of the batch it belongs to. at() is when
// it fails. A batch whose deadline follows progress (no fixed transfer_options::until: the default)
// moves it on whenever bytes of any of its requests move (a source says so with moved()), so a
// large request fails only when nothing of the batch has moved for the window (idle()), never
// because it takes longer than one; a fixed one never moves (idle() is 0). Copies share the batch's
// (cheap: a reference). Once the batch is cancelled, at() is past (the clock's epoch) and
// cancelled() true: a source that watches at() ends its requests under way then.
class FERRY_API source_deadline {
 public:
  using clock = std::chrono::steady_clock;
  source_deadline() = default;
  explicit source_deadline(clock::time_point fixed) : fixed_(fixed) {}
  // `ticks`: the batch's deadline (clock ticks since the epoch), moved on by `idle` from now.
  // `cancelled`: the batch's flag, when it may be cancelled.
  source_deadline(std::shared_ptr<std::atomic<clock::rep>> ticks, std::chrono::nanoseconds idle,
                  std::shared_ptr<const std::atomic<bool>> cancelled = nullptr)
      : moving_(std::move(ticks)), idle_(idle), cancelled_(std::move(cancelled)) {}
  clock::time_point at() const noexcept {
    if (cancelled()) return clock::time_point{};
    return moving_ ? clock::time_point(clock::duration(moving_->load(std::memory_order_relaxed))) : fixed_;
  }
  bool cancelled() const noexcept { return cancelled_ && cancelled_->load(std::memory_order_relaxed); }
  // The window a moving deadline keeps ahead of the last progress; 0 for a fixed one.
  std::chrono::nanoseconds idle() const noexcept { return moving_ ? idle_ : std::chrono::nanoseconds(0); }
  void moved() const noexcept {
    if (!moving_ || idle_.count() == 0) return;
    const clock::rep t = (clock::now() + idle_).time_since_epoch().count();
    clock::rep cur = moving_->load(std::memory_order_relaxed);
    while (cur < t && !moving_->compare_exchange_weak(cur, t, std::memory_order_relaxed)) {
    }
  }

 private:
  clock::time_point fixed_{};
  std::shared_ptr<std::atomic<clock::rep>> moving_;
  std::chrono::nanoseconds idle_{0};
  std::shared_ptr<const std::atomic<bool>> cancelled_;
};

class FERRY_API file_source {
 public:
  file_source();
  virtual ~file_source();
  // The process that opened it: its connections and threads stay with that process, so a process
  // forked from it cannot use the file (the file engine refuses, naming the file) -- it opens it again.
  long opened_by() const noexcept { return pid_; }
  // Throws invalid_argument (operation `op`, naming `resource`) in a process other than that one.
  void check_process(const char* op, const std::string& resource) const;
  virtual std::uint64_t size() = 0;
  virtual void sync() {}
  // A read-only descriptor of the file itself, where this process may read it directly (a ferry://
  // server on this host lent it): file::open then reads it as a local file and lets the source go.
  // Handed over once (the taker owns it); -1: none, the source moves the data.
  virtual int take_descriptor() { return -1; }
  // How its data has been moving, for a person to read (a summary line): the transport and the route.
  virtual std::string describe() { return {}; }
  // Starts moving [offset, offset+bytes) from the file into `mem` (or from `mem` into the file when
  // `write`); `mem` may be any memory ferry knows. `done(bytes, err)` runs exactly once, on any
  // thread, with the bytes moved (short at end of file) or the error; it runs no later than shortly
  // after `until.at()` (the source's own deadline handling), so a batch can always be waited for. A
  // source that moves a request in parts says so as they land (`until.moved()`).
  using completion = std::function<void(std::uint64_t bytes, const error* err)>;
  virtual void start(bool write, std::uint64_t offset, void* mem, std::uint64_t bytes, const source_deadline& until,
                     completion done) = 0;
  // Requests of one batch (one deadline) together: a source may serve several at once (a GPU cache's
  // misses come hundreds at a time). Each `done` runs exactly once, as for start(); nothing throws.
  // By default each is start()ed, one that throws completed with its error.
  struct request {
    bool write = false;
    std::uint64_t offset = 0;
    void* mem = nullptr;
    std::uint64_t bytes = 0;
    completion done;
  };
  virtual void start_many(std::span<request> requests, const source_deadline& until);

 private:
  long pid_;
};

using file_opener = std::function<std::shared_ptr<file_source>(const std::string& uri, open_mode mode)>;

// Keeps an opener registered; unregisters it when destroyed.
class FERRY_API scheme_registration {
 public:
  scheme_registration() = default;
  scheme_registration(scheme_registration&& o) noexcept : id_(std::exchange(o.id_, 0)) {}
  scheme_registration& operator=(scheme_registration&& o) noexcept;
  ~scheme_registration();

 private:
  friend FERRY_API scheme_registration register_file_scheme(const std::string&, file_opener);
  std::uint64_t id_ = 0;
};

// Opens "scheme://..." paths with `open` while the handle lives. When a scheme is registered twice
// (two runtimes), the newest live registration serves it.
FERRY_API scheme_registration register_file_scheme(const std::string& scheme, file_opener open);

// A URI as messages show it: without user:password@ and with its query cut ("?..."), since either
// may carry a secret (a password, a signature).
FERRY_API std::string uri_for_messages(const std::string& uri);

// The opener for `path` ("scheme://..."), or null when the path has no scheme; throws not_supported
// naming the path when the scheme is not registered.
FERRY_API file_opener find_file_scheme(const std::string& path);

}  // namespace ferry
