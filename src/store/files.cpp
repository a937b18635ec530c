// ferry:// files for the file API: a file_source per opened URI, a shared client per host:port whose
// own threads start and finish requests (so file_engine::submit never blocks on the network).
#include <ferry/io/file_engine.hpp>
#include <ferry/store/files.hpp>
#include <ferry/store/uri.hpp>

#include "core/logging.hpp"
#include "store/lost_connection.hpp"

#include <fmt/format.h>

#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <thread>

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

using clk = std::chrono::steady_clock;

// One client and the two threads that drive its requests: the starter waits for credits (start_*);
// the reaper ends requests as the client tells they have ended, and gives up those whose batch was
// cancelled or whose deadline passed (looked at every tenth of a second), so that one request
// waiting for its answer holds up no other. Small reads sent together are ended as their answer
// comes, on the client's thread that takes it (its answer hook): the reaper only ends what is over. The client and the queues live in a core the threads
// share, so the endpoint may be destroyed on one of its own threads (a completion that drops the
// last reference to a remote file, and the file the last one to the endpoint): that thread is let go
// and ends by itself once the queues are drained.
class remote_endpoint {
 public:
  struct group;
  struct op {
    bool write = false;
    std::function<client::write_handle()> handle;  // writes: the open write they fill (opened on first use)
    std::string path;
    std::uint64_t offset = 0;
    void* mem = nullptr;
    std::uint64_t bytes = 0;
    clk::time_point until;
    source_deadline deadline;  // the batch's: its cancel ends the request
    file_source::completion done;
    client::ticket t = 0;
    std::uint64_t version = 0;  // reads: the file they must come from (0: any)
    std::shared_ptr<group> grp;  // several small reads of one file sent as one request: the reads it answers
    bool started = false, told = false;  // (the core's mu) its start_* returned / the client told it ended
    std::optional<error> lost;  // a read sent again after its connection was lost (once at most): what that was
  };
  // The reads one request answers. Each is taken once, by whichever comes first: the client's answer
  // hook (its bytes copied into its memory; the reaper completes it once the request has ended), or the
  // reaper (over: its batch cancelled or its deadline passed; or the request failed).
  struct group {
    // What the answer's hook shares with the reaper: a state per read, the bytes an answered one got,
    // and where its bytes go. Not the reads themselves: their completions (holding their batches)
    // live and die with the reaper, never on a thread that happened to take an answer.
    struct claims {
      explicit claims(const std::vector<op>& ms) : state(new std::atomic<int>[ms.size()]), got(ms.size()) {
        for (std::size_t i = 0; i < ms.size(); ++i) {
          state[i].store(open);
          mem.push_back(ms[i].mem);
        }
      }
      std::unique_ptr<std::atomic<int>[]> state;
      std::vector<std::uint64_t> got;  // an answered read's bytes (written before its state says so)
      std::vector<void*> mem;
      bool take(std::size_t i, int how) {
        int o = open;
        return state[i].compare_exchange_strong(o, how, std::memory_order_acq_rel);
      }
      int at(std::size_t i) const { return state[i].load(std::memory_order_acquire); }
    };
    // copying: the hook took it and is filling its memory (then answered); the answer is in either way.
    static constexpr int open = 0, answered = 1, ended = 2, copying = 3;
    explicit group(std::vector<op> m) : members(std::move(m)), c(std::make_shared<claims>(members)) {}
    std::vector<op> members;
    std::shared_ptr<claims> c;
    bool take(std::size_t i, int how) { return c->take(i, how); }
    int at(std::size_t i) const { return c->at(i); }
    bool answer_in(std::size_t i) const { return at(i) == answered || at(i) == copying; }
  };

  remote_endpoint(const uri& u, client_options o) : k_(std::make_shared<core>(u, std::move(o))) {
    // (Named for top, perf and debuggers.)
    starter_ = std::thread([k = k_] {
      ::pthread_setname_np(::pthread_self(), "ferry-r-start");
      start_loop(*k);
    });
    reaper_ = std::thread([k = k_] {
      ::pthread_setname_np(::pthread_self(), "ferry-r-reap");
      reap_loop(*k);
    });
  }
  ~remote_endpoint() {
    {
      std::lock_guard l(k_->mu);
      k_->stop = true;
    }
    k_->start_cv.notify_all();
    // Each drains its queue first; every wait in them has a deadline. Destroyed on one of them, both
    // are let go: the reaper waits for the starter, which cannot end while it runs this.
    const auto me = std::this_thread::get_id();
    if (me == starter_.get_id() || me == reaper_.get_id()) {
      starter_.detach();
      reaper_.detach();
      return;
    }
    starter_.join();
    reaper_.join();
  }
  remote_endpoint(const remote_endpoint&) = delete;
  remote_endpoint& operator=(const remote_endpoint&) = delete;

  client& c() { return k_->c; }
  std::chrono::nanoseconds timeout() const { return k_->timeout; }

  // Queues requests for the starter, which takes what is queued in one go (and may send small reads
  // of one file as one request). Never throws: one that could not be queued is completed with the error.
  void submit(std::span<op> os) noexcept {
    bool wake = false;
    std::size_t queued = 0;
    try {
      std::lock_guard l(k_->mu);
      wake = k_->to_start.empty();  // else the starter has yet to take the queue, and will see these
      for (; queued < os.size(); ++queued) k_->to_start.push_back(std::move(os[queued]));
    } catch (const std::exception& e) {
      error err(errc::out_of_memory, "store.read", k_->c.peer(), e.what());
      for (std::size_t i = queued; i < os.size(); ++i) os[i].done(0, &err);
    }
    if (wake) k_->start_cv.notify_one();
  }

 private:
  struct core {
    core(const uri& u, client_options o) : timeout(o.timeout), spin(o.spin), c(u.host, u.port, std::move(o)) {}
    std::chrono::nanoseconds timeout, spin;
    // Declared before the client, so destroyed after it: the client's last notices (requests it ends
    // as it shuts down) still find them.
    std::mutex mu;
    std::condition_variable start_cv, reap_cv;  // the starter's and the reaper's: each wakes only its thread
    std::deque<op> to_start;
    std::map<std::uint64_t, op> running;  // started (or being started), by the id below
    std::vector<std::uint64_t> ended;     // running requests the client told have ended
    std::uint64_t next_id = 1;
    std::atomic<bool> told_any{false};  // a notice came (stops the reaper's driving)
    bool reaper_idle = false, started_any = false;  // the reaper sleeps / was woken by a start
    bool stop = false, starter_done = false;
    std::set<std::string> one_by_one;  // paths whose server refused ranges in one request (mu)
    client c;
  };

  // Takes the whole queue at each wake-up: one lock and one hand-over per batch of requests, not per
  // request (a GPU cache's misses come hundreds at a time).
  static void start_loop(core& k) {
    std::deque<op> batch;
    for (;;) {
      {
        std::unique_lock l(k.mu);
        k.start_cv.wait(l, [&] { return k.stop || !k.to_start.empty(); });
        if (k.to_start.empty()) {
          k.starter_done = true;  // the reaper ends once it has nothing left either
          l.unlock();
          k.reap_cv.notify_all();
          return;
        }
        batch.swap(k.to_start);
      }
      for (std::size_t i = 0; i < batch.size();) {
        // Small reads of one file queued together go as one request, answered in one message: a
        // request of its own each costs this side's sending and completing per 4 KiB page. They may
        // come from different batches (a GPU cache's misses come a few per batch, many batches at
        // once): the queue grows while the server is busy, so the busier it is the larger the groups.
        std::size_t j = i + 1;
        if (small_read(k, batch[i]) && together(k, batch[i].path)) {
          std::uint64_t bytes = batch[i].bytes;
          while (j < batch.size() && j - i < together_most && bytes + batch[j].bytes <= together_bytes && batch[j].path == batch[i].path &&
                 batch[j].version == batch[i].version && small_read(k, batch[j]))
            bytes += batch[j++].bytes;
        }
        if (j - i >= 2 && start_together(k, batch, i, j)) {
          i = j;
          continue;
        }
        start_one(k, batch[i++]);
      }
      batch.clear();
    }
  }
  // Reads sent as one request: at most 64, 256 KiB in all, so that a batch of hundreds of misses still
  // goes as several requests, spread over the lanes (and the server's workers) instead of one.
  static constexpr std::size_t together_most = 64;
  static constexpr std::uint64_t together_bytes = 256u << 10;
  static bool together(core& k, const std::string& path) {
    std::lock_guard l(k.mu);
    return !k.one_by_one.contains(path);
  }
  // A read that may go with others: small, into host memory (the answer is copied on by the CPU).
  static bool small_read(core& k, const op& o) {
    // (A read sent again goes alone: a group the server refuses would leave it nothing to fall back on.)
    if (o.write || o.lost || o.bytes == 0 || o.bytes > net::max_read_range || o.deadline.cancelled()) return false;
    try {
      return k.c.host_memory(o.mem, o.bytes);
    } catch (const std::exception&) {
      return false;  // (its own start says what is wrong with its memory)
    }
  }
  // Starts `o` with `start(o, ended)` (a client's start_*, returning its ticket), as a running request
  // that the client's `ended` notice hands to the reaper. Registered before it starts: the notice may
  // come before start_* returns. A start that throws hands the request back (false, `err` set).
  template <typename Start>
  static bool run(core& k, op o, Start&& start, std::optional<error>& err, op& failed) {
    std::uint64_t id;
    op* r;
    {
      std::lock_guard l(k.mu);
      id = k.next_id++;
      r = &k.running.emplace(id, std::move(o)).first->second;  // (the reaper leaves it alone until started)
    }
    client::ended_fn told = [&k, id] {
      bool wake = false;
      {
        std::lock_guard l(k.mu);
        auto it = k.running.find(id);
        if (it == k.running.end()) return;
        it->second.told = true;
        if (it->second.started) {
          wake = k.ended.empty();
          k.ended.push_back(id);
          k.told_any.store(true, std::memory_order_release);
        }
      }
      if (wake) k.reap_cv.notify_one();
    };
    client::ticket t = 0;
    try {
      t = start(*r, std::move(told));
    } catch (const error& e) {
      err = e;
    } catch (const std::exception& e) {  // (out of memory, say: the request fails, the thread goes on)
      err = error(errc::internal, r->write ? "store.write" : "store.read", k.c.peer(), e.what());
    }
    if (err) {
      std::lock_guard l(k.mu);
      auto nh = k.running.extract(id);
      failed = std::move(nh.mapped());
      return false;
    }
    bool wake = false;
    {
      std::lock_guard l(k.mu);
      r->t = t;
      r->started = true;
      if (r->told) {
        wake = k.ended.empty();
        k.ended.push_back(id);
        k.told_any.store(true, std::memory_order_release);
      } else if (k.reaper_idle && !k.started_any) {
        wake = k.started_any = true;
      }
    }
    if (wake) k.reap_cv.notify_one();
    return true;
  }
  // Reads [i, j) of the batch as one request; false (nothing started) where the client refuses it
  // (invalid_argument): then each goes on its own.
  static bool start_together(core& k, std::deque<op>& batch, std::size_t i, std::size_t j) {
    op g;
    g.path = batch[i].path;
    g.version = batch[i].version;
    g.until = batch[i].until;  // the latest member's: each member ends at its own (the reaper)
    for (std::size_t x = i; x < j; ++x) g.until = std::max(g.until, batch[x].until);
    g.grp = std::make_shared<group>(std::vector<op>(std::make_move_iterator(batch.begin() + static_cast<std::ptrdiff_t>(i)),
                                                    std::make_move_iterator(batch.begin() + static_cast<std::ptrdiff_t>(j))));
    std::optional<error> err;
    op back;
    const bool ok = run(k, std::move(g), [&](op& r, client::ended_fn told) {
      std::vector<net::read_range> ranges;
      ranges.reserve(r.grp->members.size());
      for (const op& m : r.grp->members) ranges.push_back({m.offset, m.bytes});
      // Each read's bytes go into its memory as the answer comes, on the thread that takes it (unless
      // the reaper ended the read first); its completion is the reaper's (finish_group), as every
      // completion of this endpoint is: the thread that takes an answer may be any that drives the
      // client's lanes, a caller's in a synchronous call too.
      auto answer = [c = r.grp->c](std::size_t x, const std::byte* data, std::uint64_t n) {
        if (!c->take(x, group::copying)) return;
        std::memcpy(c->mem[x], data, n);
        c->got[x] = n;
        c->state[x].store(group::answered, std::memory_order_release);
      };
      return k.c.start_reads(r.path, ranges, std::move(answer), r.until, r.version, std::move(told));
    }, err, back);
    if (ok) return true;
    if (err->code() == errc::invalid_argument) {  // each on its own, then
      std::move(back.grp->members.begin(), back.grp->members.end(), batch.begin() + static_cast<std::ptrdiff_t>(i));
      return false;
    }
    for (op& m : back.grp->members) complete_after_error(k, m, *err);
    return true;
  }
  static void start_one(core& k, op& o) {
    if (o.deadline.cancelled()) {
      error e(errc::cancelled, o.write ? "store.write" : "store.read", fmt::format("{} {}", k.c.peer(), printable(o.path)),
              "the batch was cancelled before the request was sent");
      o.handle = nullptr;
      o.done(0, &e);
      return;
    }
    std::optional<error> err;
    op back;
    if (run(k, std::move(o), [&](op& r, client::ended_fn told) {
          client::ticket t = r.write ? k.c.start_write(r.handle(), r.offset, r.mem, r.bytes, r.until, std::move(told))
                                     : k.c.start_read(r.path, r.offset, r.mem, r.bytes, r.until, r.version, std::move(told));
          r.handle = nullptr;  // used: only the completion holds the file now (see remote_file::start)
          return t;
        }, err, back))
      return;
    back.handle = nullptr;
    complete_after_error(k, back, *err);
  }

  // Ends what the client told has ended, and every tenth of a second gives up what no one wants any
  // more (every member's batch cancelled) or what ran past its deadline. A finish here never waits
  // for an answer: the request has ended, or it is given up at once.
  static void reap_loop(core& k) {
    auto looked = clk::now();
    std::vector<op> now;
    std::vector<std::pair<std::shared_ptr<group>, std::size_t>> left;  // members over (cancelled, past their deadline), ended below
    for (;;) {
      now.clear();
      left.clear();
      {
        std::unique_lock l(k.mu);
        if (k.ended.empty() && !k.running.empty()) {
          // Answers expected: taken on this thread for a while (as a waiting caller would), which
          // costs less than waking the connections' threads and then this one for each.
          k.told_any.store(false, std::memory_order_relaxed);
          l.unlock();
          k.c.progress(k.spin, [&k] { return k.told_any.load(std::memory_order_acquire); });
          l.lock();
        }
        k.reaper_idle = true;  // a start wakes it (to drive the connections for its answer)
        k.reap_cv.wait_for(l, std::chrono::milliseconds(100),
                           [&] { return !k.ended.empty() || k.started_any || (k.starter_done && k.running.empty()); });
        k.reaper_idle = k.started_any = false;
        if (k.ended.empty() && k.starter_done && k.running.empty()) return;
        for (std::uint64_t id : k.ended) {
          auto nh = k.running.extract(id);
          if (!nh.empty()) now.push_back(std::move(nh.mapped()));
        }
        k.ended.clear();
        const auto t = clk::now();
        if (t - looked >= std::chrono::milliseconds(100)) {
          looked = t;
          for (auto it = k.running.begin(); it != k.running.end();) {
            op& o = it->second;
            // (A group ends by its members' states alone: its answer may be in, its hook under way.)
            bool give_up = o.started && !o.grp && t >= o.until;
            if (o.started && !give_up) {
              if (!o.grp) {
                give_up = o.deadline.cancelled();
              } else {
                // Members over end now (unless their answer came). Once none is left open and none was
                // answered, the request is given up; one answered means the answer is in, and its
                // notice comes.
                bool open = false, answered = false;
                for (std::size_t i = 0; i < o.grp->members.size(); ++i) {
                  if (o.grp->at(i) == group::open && over(o.grp->members[i], t) && o.grp->take(i, group::ended)) left.push_back({o.grp, i});
                  open = open || o.grp->at(i) == group::open;
                  answered = answered || o.grp->answer_in(i);
                }
                give_up = !open && !answered;
              }
            }
            if (!give_up) {
              ++it;
              continue;
            }
            now.push_back(std::move(o));
            it = k.running.erase(it);
          }
        }
      }
      for (auto& [g, i] : left) end_member(k, g->members[i]);
      for (op& o : now) {
        if (o.grp) {
          finish_group(k, o);
          continue;
        }
        const std::function<bool()> cancelled = [&o] { return o.deadline.cancelled(); };
        std::optional<error> failed;
        std::uint64_t n = 0;
        try {
          n = k.c.finish(o.t, cancelled);
        } catch (const error& e) {
          failed = e;
        } catch (const std::exception& e) {
          failed = error(errc::internal, o.write ? "store.write" : "store.read", k.c.peer(), e.what());
        }
        if (failed) complete_after_error(k, o, *failed);
        else o.done(n, nullptr);
      }
    }
  }
  // A member of a group whose batch was cancelled, or whose own deadline passed, while the others
  // still want the answer.
  static bool over(const op& m, clk::time_point t) { return m.deadline.cancelled() || t >= m.until; }
  // Ends such a member at once, as a request of its own would end; its memory is then left alone (the
  // answer is not copied there).
  static void end_member(core& k, op& m) {
    const bool cancelled = m.deadline.cancelled();
    error e(cancelled ? errc::cancelled : errc::timeout, "store.read", fmt::format("{} {} offset {}", k.c.peer(), printable(m.path), m.offset),
            cancelled ? "the batch was cancelled while the read was under way" : "no answer before the deadline");
    m.done(0, &e);
  }
  // The members of a group may come from several batches: the request is given up only once no
  // member is left open, none answered. (Members are only taken in the client's check, which runs
  // under its lock; they end after it.) Answered members were ended by the hook; those the request's
  // failure leaves open end here, read again one by one where the failure allows.
  static void finish_group(core& k, op& o) {
    group& g = *o.grp;
    std::vector<std::size_t> over_now;
    const std::function<bool()> cancelled = [&] {
      const auto t = clk::now();
      bool open = false;
      for (std::size_t i = 0; i < g.members.size(); ++i) {
        if (g.answer_in(i)) return false;  // the answer is in
        if (g.at(i) == group::open && over(g.members[i], t) && g.take(i, group::ended)) over_now.push_back(i);
        open = open || g.at(i) == group::open;
      }
      return !open;
    };
    std::optional<error> failed;
    try {
      (void)k.c.finish_reads(o.t, cancelled);
    } catch (const error& e) {
      failed = e;
    } catch (const std::exception& e) {
      failed = error(errc::internal, "store.read", k.c.peer(), e.what());
    }
    for (std::size_t i : over_now) end_member(k, g.members[i]);
    if (failed && failed->code() == errc::not_supported) {
      std::lock_guard l(k.mu);
      k.one_by_one.insert(o.path);
    }
    // Answered: its bytes are in its memory. Still open: the request failed before its range was
    // handed over (read again on its own where the failure allows), or -- never, on success -- the
    // answer lacked it.
    for (std::size_t i = 0; i < g.members.size(); ++i) {
      // (A hook still copying -- only where finish_reads gave up waiting while the answer was being
      // handed over -- is a memcpy away from answered.)
      while (g.at(i) == group::copying) std::this_thread::yield();
      if (g.at(i) == group::answered) {
        g.members[i].done(g.c->got[i], nullptr);
      } else if (g.take(i, group::ended)) {
        if (failed) {
          complete_after_error(k, g.members[i], *failed, true);
        } else {
          error e(errc::internal, "store.read", fmt::format("{} {} offset {}", k.c.peer(), printable(g.members[i].path), g.members[i].offset),
                  "the answer did not hand this range over");
          g.members[i].done(0, &e);
        }
      }
    }
  }
  // A read whose connection was lost (server restarted) is sent again once, within its deadline: back
  // to the starter's queue, started (alone) and ended as any request, not read here: this runs on the
  // starter and the reaper, and the reaper's ending of other requests must not wait on it. A write is
  // not: its open write went with the connection (the file's commit then fails, and the target stays
  // as it was). Other errors are final. Once the starter has gone (the endpoint stopping), the error is.
  static void complete_after_error(core& k, op& o, const error& e, bool grouped = false) {
    if (o.deadline.cancelled() && e.code() != errc::cancelled) {
      // Its batch was cancelled (another request's cancel closed the lane under it): not retried.
      error c(errc::cancelled, o.write ? "store.write" : "store.read", fmt::format("{} {}", k.c.peer(), printable(o.path)),
              std::string("the batch was cancelled: ") + e.what());
      o.done(0, &c);
      return;
    }
    auto left = o.until - clk::now();
    // (Grouped reads refused as not_supported: a server that serves ranges in one request only from
    // local file systems.)
    if (!o.write && !o.lost && (e.code() == errc::network_error || (grouped && e.code() == errc::not_supported)) &&
        left > std::chrono::milliseconds(1)) {
      bool queued = false;
      {
        std::lock_guard l(k.mu);
        if (!k.starter_done) {
          try {
            o.lost = e;
            o.grp.reset();
            o.t = 0;
            o.started = o.told = false;
            k.to_start.push_back(std::move(o));  // (strong guarantee: on failure `o` is as it was)
            queued = true;
          } catch (const std::exception&) {
            o.lost.reset();  // (out of memory: it fails with the error it has)
          }
        }
      }
      if (queued) {
        k.start_cv.notify_one();
        return;
      }
    }
    if (o.lost && o.lost->code() == errc::network_error && e.op() == "store.connect") {
      // Sent again and the server not back: the error says both.
      const error both = detail::lost_and_unreachable(*o.lost, e);
      o.done(0, &both);
      return;
    }
    o.done(0, &e);
  }

  std::shared_ptr<core> k_;
  std::thread starter_, reaper_;
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
  }
  ~remote_file() override {
    if (opened_by() != ::getpid()) {  // a forked child's copy: the connection and its threads are the parent's
      new std::shared_ptr<remote_endpoint>(std::move(ep_));
      return;
    }
    try {
      sync();
    } catch (const error& e) {
      log::warn("store", "{}: closing {} without committing its writes: {}", ep_->c().peer(), printable(path_), e.what());
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
    std::optional<client::write_handle> h;
    std::optional<error> failed;
    {
      std::lock_guard l(mu_);
      h = std::exchange(h_, std::nullopt);
      failed = std::exchange(failed_, std::nullopt);
    }
    if (!h) {
      if (failed) throw *failed;
      return;
    }
    if (failed) {
      ep_->c().abort(*h);
      throw *failed;
    }
    ep_->c().commit(*h, std::nullopt, ep_->timeout());
  }
  // A ferry:// request's deadline is fixed when it starts (the client's waits take a time point).
  void start(bool write, std::uint64_t offset, void* mem, std::uint64_t bytes, const source_deadline& until, completion done) override {
    std::function<client::write_handle()> h;
    if (write) {
      // Runs on the endpoint's starter thread: file_engine::submit never waits for the network. The
      // write holds its file until it is done (the caller may let go of the file first; the file
      // commits what was written when it goes).
      auto self = shared_from_this();
      h = [self] { return self->handle(); };
      done = [self, d = std::move(done)](std::uint64_t n, const error* e) mutable {
        if (e) {
          std::lock_guard l(self->mu_);
          if (!self->failed_) self->failed_ = *e;
        }
        // Let go of the file before the write is reported done: a caller who already closed it sees
        // it committed by then (its last holder commits), as when it closes it after the write.
        self.reset();
        d(n, e);
      };
    }
    remote_endpoint::op o{write, std::move(h), path_, offset, mem, bytes, until.at(), until, std::move(done), 0, write ? 0 : version_, {},
                          false, false, std::nullopt};
    ep_->submit({&o, 1});
  }
  // Reads of one batch go to the endpoint's queue together; writes one by one (as start).
  void start_many(std::span<request> rs, const source_deadline& until) override {
    std::vector<remote_endpoint::op> reads;
    try {
      reads.reserve(rs.size());
    } catch (const std::exception&) {
      file_source::start_many(rs, until);  // one by one
      return;
    }
    for (auto& r : rs) {
      if (r.write) {
        file_source::start_many({&r, 1}, until);
        continue;
      }
      reads.push_back({false, {}, path_, r.offset, r.mem, r.bytes, until.at(), until, std::move(r.done), 0, version_, {}, false, false, std::nullopt});
    }
    if (!reads.empty()) ep_->submit(reads);
  }

 private:
  client::write_handle handle() {
    std::lock_guard l(mu_);
    if (!h_) h_ = ep_->c().open_write(path_, mode_ == open_mode::create && !created_ ? net::write_mode::replace : net::write_mode::keep, ep_->timeout());
    created_ = true;
    return *h_;
  }
  std::shared_ptr<remote_endpoint> ep_;
  std::string path_;
  open_mode mode_;
  std::uint64_t version_ = 0;
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
