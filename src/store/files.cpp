// ferry:// files for the file API: a file_source per opened URI, a shared client per host:port that
// queues requests and completes them on its lanes' threads (so file_engine::submit never blocks on
// the network).
#include <ferry/io/file_engine.hpp>
#include <ferry/store/files.hpp>
#include <ferry/store/uri.hpp>

#include "core/logging.hpp"

#include <fmt/format.h>

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <charconv>
#include <memory>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <vector>

namespace ferry::store {

uri parse_uri(const std::string& text) {
  std::string_view s = text;
  auto bad = [&](std::string_view why) { fail(errc::invalid_argument, "uri", text, std::string(why) + " (expected ferry://host:port/path)"); };
  if (!s.starts_with("ferry://")) bad("not a ferry:// URI");
  s.remove_prefix(8);
  auto slash = s.find('/');
  if (slash == std::string_view::npos) bad("no path");
  std::string_view hostport = s.substr(0, slash);
  uri r;
  r.path = std::string(s.substr(slash + 1));
  std::string_view port;
  if (hostport.starts_with("[")) {
    auto close = hostport.find(']');
    if (close == std::string_view::npos || close + 1 >= hostport.size() || hostport[close + 1] != ':') bad("bad [IPv6]:port");
    r.host = std::string(hostport.substr(1, close - 1));
    port = hostport.substr(close + 2);
  } else {
    auto colon = hostport.rfind(':');
    if (colon == std::string_view::npos) bad("no port");
    r.host = std::string(hostport.substr(0, colon));
    port = hostport.substr(colon + 1);
  }
  unsigned p = 0;
  auto [ptr, ec] = std::from_chars(port.data(), port.data() + port.size(), p);
  if (ec != std::errc() || ptr != port.data() + port.size() || p == 0 || p > 65535) bad("bad port");
  r.port = static_cast<std::uint16_t>(p);
  // An empty path names the root: `ferry ls ferry://host:port/` lists it (reads of it are refused
  // by the server, naming the path).
  return r;
}

namespace {

// One client per host:port, shared by the files opened there. It has no thread of its own, nor does
// this adapter: requests go to the client's queue (client::submit) and their completions run where
// the client ends them -- its lanes' progress threads, mostly.
class remote_endpoint {
 public:
  remote_endpoint(const uri& u, client_options o) : timeout_(o.timeout), c_(u.host, u.port, std::move(o)) {}
  remote_endpoint(const remote_endpoint&) = delete;
  remote_endpoint& operator=(const remote_endpoint&) = delete;
  client& c() { return c_; }
  std::chrono::nanoseconds timeout() const { return timeout_; }

 private:
  std::chrono::nanoseconds timeout_;
  client c_;
};

// Requests of one batch on their way to the client: the batch's deadline and the callers'
// completions in one record, which each request's functions point at (a pointer and an index,
// which std::function holds without an allocation per request); the last completion frees it. The
// client calls neither `moved` nor `cancelled` of a request after its `done`.
struct request_run {
  source_deadline until;
  std::vector<file_source::completion> dones;
  std::atomic<std::size_t> left{0};

  // A record for `n` requests, each completion to be set with request().
  static std::unique_ptr<request_run> make(const source_deadline& until, std::size_t n) {
    auto run = std::make_unique<request_run>();
    run->until = until;
    run->dones.reserve(n);
    return run;
  }
  // The next request of the run: [offset, offset+bytes) of `path`, `done` told as it ends.
  client::request request(const std::string& path, std::uint64_t offset, void* mem, std::uint64_t bytes, file_source::completion done) {
    const std::size_t i = dones.size();
    dones.push_back(std::move(done));
    left.fetch_add(1, std::memory_order_relaxed);
    client::request r;
    r.path = path;
    r.offset = offset;
    r.mem = mem;
    r.length = bytes;
    if (until.idle().count() > 0) {
      r.idle = until.idle();
      r.moved = [this] { until.moved(); };
    } else {
      r.until = until.at();
    }
    r.cancelled = [this] { return until.cancelled(); };
    r.done = [this, i](std::uint64_t n, const error* e) {
      auto d = std::move(dones[i]);
      if (left.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
      d(n, e);
    };
    return r;
  }
};

// A remote file. Writes are atomic per file (the server's open writes): they fill a new version,
// opened on the first write (a copy of the current file for read_write, empty for create), which
// sync() -- or closing the file -- commits in one step; until then readers see the file as it was.
// A write that failed makes the next sync() fail (and nothing is committed).
class remote_file final : public file_source, public std::enable_shared_from_this<remote_file> {
 public:
  // `version`: a file opened for reading reads only the file it found when opened (a file replaced
  // since fails its reads; one opened for writing reads its own commits).
  remote_file(std::shared_ptr<remote_endpoint> ep, std::string path, open_mode mode, std::uint64_t version)
      : ep_(std::move(ep)), path_(std::move(path)), mode_(mode), version_(mode == open_mode::read ? version : 0) {
    if (mode_ == open_mode::create) handle();  // the file is created (empty) even if nothing is written
    // A server on this host lends a file opened for reading: read like a local file from then on.
    if (mode_ == open_mode::read) lent_ = ep_->c().lent_file(path_, version_, ep_->timeout());
  }
  int take_descriptor() override { return std::exchange(lent_, -1); }
  ~remote_file() override {
    if (lent_ >= 0) ::close(lent_);
    if (opened_by() != ::getpid()) {  // a forked child's copy: the connection and its threads are the parent's
      new std::shared_ptr<remote_endpoint>(std::move(ep_));
      return;
    }
    auto [h, failed] = take_writes();
    if (h && !ep_->c().may_wait()) {
      // Let go last in a completion on a lane's thread (its caller let go of the file meanwhile):
      // the commit waits for the server's answer, which that thread must not, so the lanes' idle
      // look makes it.
      auto later = [ep = ep_, path = path_, h, failed]() mutable {
        close_writes(*ep, path, h, failed);
        keep_if_last(std::move(ep));
      };
      if (!ep_->c().defer(std::move(later)))
        log::warn("store", "{}: closing {} without committing its writes: the client is closing", ep_->c().peer(), printable(path_));
    } else {
      close_writes(*ep_, path_, h, failed);
    }
    keep_if_last(std::move(ep_));
  }
  // The open write and the first failure of a write into it, taken (an opening under way is taken
  // with the writes before it).
  std::pair<std::optional<client::write_handle>, std::optional<error>> take_writes() {
    std::lock_guard o(open_mu_);
    std::lock_guard l(mu_);
    return {std::exchange(h_, std::nullopt), std::exchange(failed_, std::nullopt)};
  }
  // Commits the writes taken, or aborts them and throws the failure.
  static void end_writes(remote_endpoint& ep, const std::optional<client::write_handle>& h, const std::optional<error>& failed) {
    if (failed) {
      if (h) ep.c().abort(*h);
      throw *failed;
    }
    if (h) ep.c().commit(*h, std::nullopt, ep.timeout());
  }
  // A closing file's end_writes, saying so when it fails.
  static void close_writes(remote_endpoint& ep, const std::string& path, const std::optional<client::write_handle>& h,
                           const std::optional<error>& failed) {
    try {
      end_writes(ep, h, failed);
    } catch (const error& e) {
      log::warn("store", "{}: closing {} without committing its writes: {}", ep.c().peer(), printable(path), e.what());
    }
  }
  static void keep_if_last(std::shared_ptr<remote_endpoint> ep) {
    if (ep.use_count() == 1 && ep->c().own_thread()) {
      // The endpoint's last holder on one of its client's own threads (a completion, after the
      // runtime that registered ferry:// went): the client cannot end there, so it is left for the
      // process's exit.
      log::debug("store", "{}: a client let go on its own thread is kept until the process exits", ep->c().peer());
      new std::shared_ptr<remote_endpoint>(std::move(ep));
    }
  }
  std::uint64_t size() override { return ep_->c().stat(path_, ep_->timeout()).size; }
  // The shared client's: its transports, how the data came (landing region, RMA, messages) and
  // whether it was copied on from where it landed (by the transfer engine, or a memcpy for small host
  // pieces); and the requests it sent (small reads go many to a request).
  std::string describe() override {
    auto st = ep_->c().stats();
    return fmt::format("UCX [{}], {} request{} sent, data by {}{}", st.transports, st.requests, st.requests == 1 ? "" : "s",
                       data_route(st), st.staged_bytes ? " -> copied on from where it landed" : "");
  }
  void sync() override {
    auto [h, failed] = take_writes();
    end_writes(*ep_, h, failed);
  }
  // Never waits for the network: a write whose file has no open write yet opens it on the client's
  // lane thread (defer), where waiting is allowed.
  void start(bool write, std::uint64_t offset, void* mem, std::uint64_t bytes, const source_deadline& until, completion done) override {
    auto run = request_run::make(until, 1);
    if (!write) {
      auto r = run->request(path_, offset, mem, bytes, std::move(done));
      r.version = version_;
      run.release();  // (its request's completion frees it)
      ep_->c().submit({&r, 1});
      return;
    }
    // The write holds its file until it is done (the caller may let go of the file first; the file
    // commits what was written when it goes).
    auto self = shared_from_this();
    done = [self, d = std::move(done)](std::uint64_t n, const error* e) mutable {
      if (e) {
        std::lock_guard l(self->mu_);
        if (!self->failed_) self->failed_ = *e;
      }
      // Let go of the file before the write is reported done: a caller who already closed it sees
      // it committed by then (its last holder commits) -- on a lane's thread, where the commit may
      // wait for its answer, when this is the last holder.
      auto& c = self->ep_->c();
      if (self.use_count() == 1) {
        std::optional<error> copy;
        if (e) copy = *e;
        auto last = [self = std::move(self), d, n, copy]() mutable {
          self.reset();
          d(n, copy ? &*copy : nullptr);
        };
        if (c.defer(last)) return;
        last();
        return;
      }
      self.reset();
      d(n, e);
    };
    auto r = run->request(path_, offset, mem, bytes, std::move(done));
    run.release();
    std::optional<client::write_handle> h;
    {
      std::lock_guard l(mu_);
      h = h_;
    }
    if (h) {
      r.write = h->id;
      ep_->c().submit({&r, 1});
      return;
    }
    auto open_then_submit = [self, r = std::make_shared<client::request>(std::move(r))]() mutable {
      try {
        r->write = self->handle().id;
      } catch (const error& e) {
        return r->done(0, &e);
      }
      self->ep_->c().submit({r.get(), 1});
    };
    if (!ep_->c().defer(open_then_submit)) {
      error e(errc::cancelled, "store.write", fmt::format("{} {}", ep_->c().peer(), printable(path_)), "the client is closing");
      r.done(0, &e);
    }
  }
  // Reads of one batch go to the client together (small ones may go as one request); writes one by
  // one (as start).
  void start_many(std::span<request> rs, const source_deadline& until) override {
    std::vector<client::request> reads;
    std::unique_ptr<request_run> run;
    try {
      reads.reserve(rs.size());
      run = request_run::make(until, rs.size());
    } catch (const std::exception&) {
      file_source::start_many(rs, until);  // one by one
      return;
    }
    for (auto& r : rs) {
      if (r.write) {
        file_source::start_many({&r, 1}, until);
        continue;
      }
      reads.push_back(run->request(path_, r.offset, r.mem, r.bytes, std::move(r.done)));
      reads.back().version = version_;
    }
    if (reads.empty()) return;
    run.release();  // (the last of its requests' completions frees it)
    ep_->c().submit(reads);
  }

 private:
  // The open write, opened by the first write that needs it. Opening waits for the server under
  // open_mu_ only: a write's completion that records a failure (mu_, on a lane's thread) never waits
  // behind the network, nor holds up the answer the opening waits for.
  client::write_handle handle() {
    std::lock_guard o(open_mu_);
    bool create = false;
    {
      std::lock_guard l(mu_);
      if (h_) return *h_;
      create = mode_ == open_mode::create && !created_;
    }
    auto h = ep_->c().open_write(path_, create ? net::write_mode::replace : net::write_mode::keep, ep_->timeout());
    std::lock_guard l(mu_);
    h_ = h;
    created_ = true;
    return h;
  }
  std::shared_ptr<remote_endpoint> ep_;
  std::string path_;
  open_mode mode_;
  std::uint64_t version_ = 0;
  int lent_ = -1;  // the descriptor the server lent, until taken
  std::mutex open_mu_;  // held while the open write is being opened (handle) or taken (take_writes)
  std::mutex mu_;
  std::optional<client::write_handle> h_;
  std::optional<error> failed_;
  bool created_ = false;
};

struct registry {
  std::function<client_options()> options;
  std::mutex mu;
  std::map<std::pair<std::string, std::uint16_t>, std::shared_ptr<remote_endpoint>> eps;

  std::shared_ptr<file_source> open(const std::string& text, open_mode mode) {
    uri u = parse_uri(text);
    std::shared_ptr<remote_endpoint> ep;
    {
      std::lock_guard l(mu);
      auto& slot = eps[{u.host, u.port}];
      if (!slot) {
        try {
          slot = std::make_shared<remote_endpoint>(u, options());
        } catch (...) {
          eps.erase({u.host, u.port});
          throw;
        }
      }
      ep = slot;
    }
    if (mode != open_mode::read && !ep->c().writable())
      fail(errc::permission_denied, "file.open", text, "the server is read-only (ferry serve without --writable)");
    std::uint64_t version = 0;
    try {
      auto st = ep->c().stat(u.path, ep->timeout());
      if ((st.mode & S_IFMT) == S_IFDIR) fail(errc::invalid_argument, "file.open", text, "is a directory");
      version = st.version;
    } catch (const error& e) {
      if (!(mode != open_mode::read && e.code() == errc::not_found)) throw;
    }
    return std::make_shared<remote_file>(ep, u.path, mode, version);
  }
};

}  // namespace

scheme_registration register_ferry_files(std::function<client_options()> options) {
  auto reg = std::make_shared<registry>();
  reg->options = std::move(options);
  // The opener owns the registry (and so the clients): they go when the registration does.
  return register_file_scheme("ferry", [reg](const std::string& text, open_mode mode) { return reg->open(text, mode); });
}

}  // namespace ferry::store
