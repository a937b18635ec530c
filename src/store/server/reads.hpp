#pragma once
// The server's reads (store/server/): small ones on the progress thread (from the file's mapping,
// into the reply or a region the client lent), larger ones as file requests whose data goes by
// messages, into a lent region, or by RMA; writes into lent regions and by RMA come here too.
#include "store/server/core.hpp"
#include "store/server/writes.hpp"

#include <array>
#include <cstring>

#include <optional>

namespace ferry::store::detail {

class read_path {
 public:
  read_path(server_core& c, write_path& w) : core(c), writes(w) {}

  // A read into / write from a region the client lent: a small read on this thread from the file's
  // mapping (as read_inline, but into the client's memory, and only the completion is sent), else
  // one file engine request, then the completion. The request holds the mapping, so a client that
  // leaves or gives the region back meanwhile cannot make it vanish.
  // A read with a notify record (read_into::notify) served at once also writes the record, in
  // a region the client lent, before the completion goes: the client, polling it, is done without
  // receiving a message. (A queued read only sends the completion; the client waits for that.)
  void direct(connection& c, session& sn, std::uint64_t rid, const std::string& path, std::uint64_t offset,
              std::uint64_t length, std::uint64_t addr, bool write, std::uint64_t notify = 0, std::uint64_t handle = 0,
              std::uint64_t version = 0) {
    const char* op = write ? "store.write" : "store.read";
    if (length > core.o.max_request)
      fail(errc::out_of_range, op, path, fmt::format("request of {} bytes exceeds the limit {}", length, core.o.max_request));
    if (sn.lent.empty()) fail(errc::protocol_error, op, c.peer(), "direct request without a mapped region (lend first)");
    auto* at = sn.lent_at(addr, length);
    if (!at) fail(errc::out_of_range, op, c.peer(), fmt::format("[{:#x}, +{}) is outside every region the client lent", addr, length));
    auto t = write ? writes.txn(handle, path) : nullptr;
    if (write && length <= core.o.inline_max && t->file()->local) {  // as a small read below: on this thread
      t->file()->f->write_here((*at)->base + (addr - (*at)->addr), length, offset);
      t->wrote(offset, length);
      core.bytes_received += length;
      core.direct_writes++;
      return c.send_frame({rid, 0, complete{0, length}});
    }
    if (!write && length <= core.o.inline_max) {
      std::uint64_t* record = nullptr;
      if (notify) {
        auto* nm = sn.lent_at(notify, 2 * sizeof(std::uint64_t));
        if (!nm) fail(errc::out_of_range, op, c.peer(), fmt::format("notify record {:#x} is outside every region the client lent", notify));
        record = reinterpret_cast<std::uint64_t*>((*nm)->base + (notify - (*nm)->addr));
      }
      if (read_direct_here(c, sn, rid, path, offset, length, (*at)->base + (addr - (*at)->addr), record, version)) return;
    }
    // The request holds the session and the mapping (a plain reference suffices above, on this
    // thread; taking one costs two atomic operations per request).
    auto s = sn.shared_from_this();
    std::shared_ptr<lent_region> m = *at;
    auto f = write ? t->file() : same_version(core.files.get(path), version, path, offset);
    auto self = c.shared_from_this();
    auto cr = std::make_shared<credit>(s->outstanding);
    core.file_io(f->f, write, offset, m->base + (addr - m->addr), length, [this, self, s, cr, m, t, rid, write, offset](const request_result& r) {
      if (r.state != request_state::done) return core.answer_error(*self, *cr, rid, core.error_of(r));
      if (write) {
        t->wrote(offset, r.bytes_done);
        core.bytes_received += r.bytes_done;
        core.direct_writes++;
      } else {
        core.bytes_sent += r.bytes_done;
        core.direct_reads++;
      }
      core.answer(*self, *cr, {rid, 0, complete{0, r.bytes_done}});
    });
  }

  // A read into / write from registered client memory by RMA (NVMe-oF style): the file a chunk at a
  // time through a data buffer -- a file request, then a put to the client (or a get from the
  // client, then a file request) -- each step started by the completion of the one before; the
  // completion goes after a fence, so it cannot overtake the data. The rkey is unpacked here, on
  // the progress thread. RMA that makes no progress for `rma_timeout` closes the connection (the
  // janitor), which fails what is in flight.
  struct rma_op {
    std::shared_ptr<connection> c;
    std::shared_ptr<session> s;
    std::shared_ptr<credit> cr;
    std::shared_ptr<remote_key> key;
    std::shared_ptr<write_txn> t;
    std::shared_ptr<open_file> f;
    std::string path;
    std::uint64_t rid = 0, offset = 0, length = 0, addr = 0, done = 0;
    bool write = false;
    std::byte* buf = nullptr;
  };
  void rma(connection& c, const std::shared_ptr<session>& s, std::uint64_t rid, const std::string& path, std::uint64_t offset,
           std::uint64_t length, std::uint64_t addr, const std::vector<std::uint8_t>& rkey, bool write, std::uint64_t handle,
           std::uint64_t version = 0) {
    const char* op = write ? "store.write" : "store.read";
    if (length > core.o.max_request)
      fail(errc::out_of_range, op, path, fmt::format("request of {} bytes exceeds the limit {}", length, core.o.max_request));
    if (s->rma_transports.empty())
      fail(errc::not_supported, op, c.peer(), fmt::format("RMA needs a lane with remote memory access (verbs); this one has {}", c.transports()));
    auto key = c.unpack_rkey(std::as_bytes(std::span(rkey.data(), rkey.size())));
    if (!key) fail(errc::protocol_error, op, c.peer(), "the client's rkey cannot be unpacked on this endpoint");
    auto r = std::make_shared<rma_op>();
    r->t = write ? writes.txn(handle, path) : nullptr;
    r->f = write ? r->t->file() : same_version(core.files.get(path), version, path, offset);
    r->c = c.shared_from_this();
    r->s = s;
    r->cr = std::make_shared<credit>(s->outstanding);
    r->key = std::move(key);
    r->path = path;
    r->rid = rid, r->offset = offset, r->length = length, r->addr = addr, r->write = write;
    core.buffers.take([this, r](std::byte* b) {
      r->buf = b;
      rma_step(r);
    });
  }
  void rma_step(const std::shared_ptr<rma_op>& r) {
    if (r->done >= r->length) return rma_end(r, nullptr);
    std::uint64_t n = std::min<std::uint64_t>(core.buffers.bytes(), r->length - r->done);
    if (r->write) {
      return rma_move(r, true, n, [this, r, n] {
        core.file_io(r->f->f, true, r->offset + r->done, r->buf, n, [this, r, n](const request_result& x) {
          if (x.state != request_state::done) return rma_end(r, &core.error_of(x));
          r->done += n;
          rma_step(r);
        });
      });
    }
    core.file_io(r->f->f, false, r->offset + r->done, r->buf, n, [this, r, n](const request_result& x) {
      if (x.state != request_state::done) return rma_end(r, &core.error_of(x));
      std::uint64_t got = x.bytes_done;
      if (got == 0) return rma_end(r, nullptr);  // end of file
      rma_move(r, false, got, [this, r, n, got] {
        r->done += got;
        if (got < n) return rma_end(r, nullptr);  // end of file
        rma_step(r);
      });
    });
  }
  // One RMA operation between the data buffer and the client's memory at the current offset.
  void rma_move(const std::shared_ptr<rma_op>& r, bool get, std::uint64_t n, std::function<void()> next) {
    auto& s = *r->s;
    if (s.rma_running++ == 0) s.rma_progress = coarse_now().time_since_epoch().count();
    try {
      r->c->rma(get, r->buf, n, r->addr + r->done, r->key, [this, r, get, next = std::move(next)](ucs_status_t st) {
        r->s->rma_running--;
        r->s->rma_progress = coarse_now().time_since_epoch().count();
        if (st != UCS_OK) {
          error e(errc::network_error, get ? "store.write" : "store.read", fmt::format("{} {}", r->c->peer(), printable(r->path)),
                  std::string(get ? "RMA get" : "RMA put") + " failed: " + ucs_status_string(st));
          return rma_end(r, &e);
        }
        next();
      });
    } catch (const error& e) {
      s.rma_running--;
      rma_end(r, &e);
    }
  }
  void rma_end(const std::shared_ptr<rma_op>& r, const error* e) {
    core.buffers.give_back(std::exchange(r->buf, nullptr));
    if (e) return core.answer_error(*r->c, *r->cr, r->rid, *e);
    if (r->write) {
      r->t->wrote(r->offset, r->done);
      core.bytes_received += r->done;
      core.rma_gets++;
    } else {
      core.bytes_sent += r->done;
      core.rma_puts++;
    }
    r->cr->give_back();
    try {
      r->c->send_frame_fenced({r->rid, 0, complete{0, r->done}});
    } catch (...) {
    }
  }

  // False: the file is not read on this thread (read_small); the request goes to the file engine.
  bool read_inline(connection& c, session& s, std::uint64_t rid, const read_req& r) {
    // The file data is read straight into the worker's reply space, which the reply is sent from:
    // nothing allocated, one copy before UCX's.
    std::byte* buf = c.reply_space(r.length);
    auto got = read_small(s, r.path, buf, r.length, r.offset, r.version);
    if (!got) return false;
    s.counts->bytes_sent.add(*got);
    s.counts->inline_replies.add();
    c.send_reply_space({rid, 0, complete{0, *got}}, *got);
    return true;
  }
  // Several small ranges of one file in one request (see net::read_many): answered in one message
  // from the worker's reply space, or -- `into` -- written into the client's lent memory (the same
  // layout) with only the completion sent; every store there is guarded, as the client may truncate
  // its region under it. The first range is read as read_inline's (it finds the file and checks its
  // version); the others come from the same file's mapping where they lie in it, with one fstat after
  // all the copies instead of one per range (it costs as much as a 4 KiB copy): a range from the
  // mapping counts only the bytes the file still had then, as read_small's do. A file deleted or
  // replaced meanwhile: every range is read again, each as read_small. False when the file is not on
  // a local file system (nothing sent): the client then asks for the ranges one by one.
  bool read_many(connection& c, session& s, std::uint64_t rid, const net::read_many& r) {
    const std::uint64_t total = net::read_many_answer_bytes(r.ranges);
    const std::size_t n = r.ranges.size();
    std::byte* buf = nullptr;
    if (r.into) {
      if (s.lent.empty()) fail(errc::protocol_error, "store.read", c.peer(), "ranges into lent memory without a mapped region (lend first)");
      auto* at = s.lent_at(r.into, total);
      if (!at) fail(errc::out_of_range, "store.read", c.peer(), fmt::format("[{:#x}, +{}) is outside every region the client lent", r.into, total));
      buf = (*at)->base + (r.into - (*at)->addr);
    } else {
      buf = c.reply_space(total);
    }
    auto gone = [&] {
      fail(errc::bad_address, "store.read", fmt::format("{} {}", c.peer(), printable(r.path)),
           fmt::format("the client's memory at {:#x} went away under the answer (its region was truncated)", r.into));
    };
    static const std::array<std::byte, net::max_read_range> zeros{};
    constexpr std::uint64_t from_map = ~std::uint64_t{0};  // a range's count until the fstat says what it is
    std::array<std::uint64_t, net::max_read_ranges> counts;
    std::uint64_t size = 0;
    for (bool one_look = true;; one_look = false) {
      std::byte* data = buf + 8 * n;
      std::uint64_t version = r.version;
      bool mapped_any = false;
      for (std::size_t i = 0; i < n; ++i) {
        const auto& g = r.ranges[i];
        if (one_look && i > 0 && s.last_file->map.read(data, g.length, g.offset)) {
          mapped_any = true;
          counts[i] = from_map;
        } else {
          auto got = read_small(s, r.path, data, g.length, g.offset, version);
          if (!got) return false;
          if (!version) version = net::file_version(s.last_file->dev, s.last_file->ino);
          counts[i] = *got;
        }
        data += g.length;
      }
      if (!mapped_any || fd_cache::still_linked(*s.last_file, &size)) break;
    }
    // Counts, and past a short count zeros (the space holds earlier answers, to other clients too).
    std::array<std::byte, 8 * net::max_read_ranges> head;
    std::uint64_t sent = 0;
    std::byte* data = buf + 8 * n;
    for (std::size_t i = 0; i < n; ++i) {
      const auto& g = r.ranges[i];
      if (counts[i] == from_map) {
        counts[i] = size <= g.offset ? 0 : std::min(g.length, size - g.offset);
        s.counts->mapped_reads.add();
      }
      if (counts[i] < g.length && !guarded_copy(data + counts[i], zeros.data(), g.length - counts[i])) gone();
      for (int k = 0; k < 8; ++k) head[8 * i + k] = static_cast<std::byte>((counts[i] >> (8 * k)) & 0xff);
      sent += counts[i];
      data += g.length;
    }
    if (!guarded_copy(buf, head.data(), 8 * n)) gone();
    s.counts->bytes_sent.add(sent);
    if (r.into) {
      s.counts->direct_reads.add();
      c.send_frame({rid, 0, complete{0, total}});
    } else {
      s.counts->inline_replies.add();
      c.send_reply_space({rid, 0, complete{0, total}}, total);
    }
    return true;
  }
  // A small read straight into the client's lent memory: only the completion travels. False as
  // read_inline.
  bool read_direct_here(connection& c, session& s, std::uint64_t rid, const std::string& path, std::uint64_t offset,
                        std::uint64_t length, std::byte* dst, std::uint64_t* record, std::uint64_t version) {
    auto opt = read_small(s, path, dst, length, offset, version);
    if (!opt) return false;
    std::uint64_t got = *opt;
    // A client that truncated its region under the record is told by the completion alone.
    if (record) {
      guarded_publish(record, rid, got);
      s.counts->notify_records.add();
    }
    s.counts->bytes_sent.add(got);
    s.counts->direct_reads.add();
    c.send_frame({rid, 0, complete{0, got}});
    return true;
  }
  // Reads a small range on the worker's thread. The session's last file first: a client reading
  // one file in small pieces costs no lock and no lookup in the shared cache per request. From the
  // file's mapping when the range lies in it (a pread would cost a third of the whole request);
  // past the mapped size (the file grew, or the read ends at EOF) or after the file shrank under
  // the mapping -- or the client's region under the destination -- pread says what is there now.
  // Either way the file must still be linked (a deleted or replaced file is never served; one
  // fstat, no path lookup), and a read from the mapping counts only the bytes the file still has
  // after the copy: a page of the mapping past a shrunken file's end reads as zeros, not data.
  // Nothing (and nothing read) for a file that is not on a local file system: it may never answer,
  // and this thread serves other clients too.
  std::optional<std::uint64_t> read_small(session& s, const std::string& path, std::byte* dst, std::uint64_t length,
                                          std::uint64_t offset, std::uint64_t version) {
    auto reopen = [&] {
      clk::time_point opened;
      s.last_file.reset();
      s.last_path.clear();
      s.last_file = core.files.get(path, &opened);
      s.last_path = path;
      s.last_until = opened + core.o.fd_cache_ttl - coarse_slack;
    };
    std::uint64_t size = 0;
    if (s.last_path != path || coarse_now() >= s.last_until) reopen();
    if (!s.last_file->local) return std::nullopt;
    same_version(s.last_file, version, path, offset);
    if (s.last_file->map.read(dst, length, offset)) {
      if (fd_cache::still_linked(*s.last_file, &size)) {
        s.counts->mapped_reads.add();
        return size <= offset ? 0 : std::min(length, size - offset);
      }
      reopen();  // replaced or deleted
    } else if (!fd_cache::still_linked(*s.last_file, &size)) {
      reopen();
    }
    if (!s.last_file->local) return std::nullopt;
    return same_version(s.last_file, version, path, offset)->f->read_here(dst, length, offset);
  }

  // A read answered by data messages: a chunk at a time into a data buffer by a file request, then
  // sent; the next chunk's request starts when the last one's data is on its way. The completion
  // frame may overtake the data: the client waits for both.
  struct streamed {
    std::shared_ptr<connection> c;
    std::shared_ptr<session> s;
    std::shared_ptr<credit> cr;
    std::shared_ptr<open_file> f;
    std::uint64_t rid = 0, offset = 0, length = 0, done = 0;
  };
  void stream(connection& c, const std::shared_ptr<session>& sp, std::uint64_t rid, const read_req& r, const std::shared_ptr<credit>& cr) {
    auto st = std::make_shared<streamed>();
    st->c = c.shared_from_this();
    st->s = sp;
    st->cr = cr;
    st->f = same_version(core.files.get(r.path), r.version, r.path, r.offset);
    st->rid = rid, st->offset = r.offset, st->length = r.length;
    stream(st);
  }
  void stream(const std::shared_ptr<streamed>& st) {
    std::uint64_t want = std::min<std::uint64_t>(core.buffers.bytes(), st->length - st->done);
    if (want == 0 || !st->c->alive() || core.stopping_now()) {
      if (st->c->alive()) core.answer(*st->c, *st->cr, {st->rid, 0, complete{0, st->done}});
      return;
    }
    core.buffers.take([this, st, want](std::byte* b) {
      core.file_io(st->f->f, false, st->offset + st->done, b, want, [this, st, want, b](const request_result& r) {
        std::uint64_t got = r.bytes_done;
        if (r.state != request_state::done || got == 0) {
          core.buffers.give_back(b);
          if (r.state != request_state::done) return core.answer_error(*st->c, *st->cr, st->rid, core.error_of(r));
          return core.answer(*st->c, *st->cr, {st->rid, 0, complete{0, st->done}});
        }
        try {
          st->c->send_data(st->rid, st->done, b, static_cast<std::size_t>(got), [this, b](ucs_status_t) { core.buffers.give_back(b); });
        } catch (const error& e) {
          core.buffers.give_back(b);
          return core.answer_error(*st->c, *st->cr, st->rid, e);
        }
        st->done += got;
        core.bytes_sent += got;
        if (got < want) st->length = st->done;  // end of file
        stream(st);
      });
    });
  }


 private:
  server_core& core;
  write_path& writes;
};

}  // namespace ferry::store::detail
