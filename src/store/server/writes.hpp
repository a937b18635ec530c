#pragma once
// The server's writes (store/server/): the open writes (write transactions) by handle, their data
// as it arrives by message, written by file requests (small pieces on the progress thread), and
// write_mode::keep's copy of a file's current content.
#include "store/auth.hpp"
#include "store/server/core.hpp"

#include <cstring>
#include <optional>

#include <tuple>
#include <unordered_map>

namespace ferry::store::detail {

class write_path {
 public:
  explicit write_path(server_core& c) : core(c) {}

  // The open write `handle` of `path`, or invalid_argument naming why not.
  std::shared_ptr<write_txn> txn(std::uint64_t handle, const std::string& path) {
    std::lock_guard l(txn_mu);
    auto it = txns.find(handle);
    if (it == txns.end() || !handle)
      fail(errc::invalid_argument, "store.write", printable(path),
           handle ? "no open write with this handle (committed, aborted, or its connection closed)"
                  : "a write needs an open write (open_write; protocol 4)");
    if (it->second->path() != path)
      fail(errc::invalid_argument, "store.write", printable(path), fmt::format("the handle belongs to '{}'", printable(it->second->path())));
    return it->second;
  }
  // A session that went: its open writes go with it (their targets stay as they were).
  void drop_owned(const session* s) {
    std::lock_guard l(txn_mu);
    std::erase_if(txns, [&](const auto& kv) { return kv.second->owner == s; });
  }
  std::size_t open_count() {
    std::lock_guard l(txn_mu);
    return txns.size();
  }

  // open_write: a new write transaction, answered with its handle (after write_mode::keep's copy).
  void open(connection& c, session& sn, std::uint64_t rid, const open_write& r, const std::shared_ptr<credit>& cr) {
    if (!core.o.writable) fail(errc::permission_denied, "store.write", r.path, "this server is read-only (started without --writable)");
    std::uint64_t id = 0;
    while (!id) {
      auto nonce = detail::random_nonce();
      std::memcpy(&id, nonce.data(), sizeof id);
    }
    auto t = std::make_shared<write_txn>(core.root, r.path, r.mode, id, std::min(r.size_hint, core.o.max_write_hint));
    t->owner = &sn;
    {
      std::lock_guard l(txn_mu);
      std::size_t mine = 0;
      for (auto& [k, x] : txns) mine += x->owner == &sn;
      if (mine >= max_txns_per_session || txns.size() >= max_txns)
        fail(errc::busy, "store.write", r.path,
             fmt::format("too many open writes ({} on this connection, {} in all); commit or abort some", mine, txns.size()));
      txns[id] = t;
    }
    if (t->keeps()) {
      try {
        return keep(c.shared_from_this(), t, cr, rid);
      } catch (...) {
        std::lock_guard l(txn_mu);
        txns.erase(id);
        throw;
      }
    }
    core.answer(c, *cr, {rid, 0, complete{0, id}});
  }
  // end_write: the transaction committed (put in place) or aborted.
  void end(connection& c, std::uint64_t rid, const end_write& r, const std::shared_ptr<credit>& cr) {
    std::shared_ptr<write_txn> t;
    {
      std::lock_guard l(txn_mu);
      auto it = txns.find(r.handle);
      if (it == txns.end())
        fail(errc::invalid_argument, "store.commit", c.peer(), "no open write with this handle (committed, aborted, or its connection closed)");
      t = std::move(it->second);
      txns.erase(it);
    }
    std::uint64_t n = 0;
    if (r.how != write_end::abort) {
      n = t->commit(r.how == write_end::commit_size ? std::optional<std::uint64_t>(r.size) : std::nullopt);
      log::debug("store", "client {} committed {} ({} bytes)", c.peer(), printable(t->path()), n);
      core.commits++;
    }
    core.answer(c, *cr, {rid, 0, complete{0, n}});
  }

  // ---- writes: the frame opens the request; data arrives as AM data (rendezvous for large pieces) ----
  void begin_write(connection& c, session& s, std::uint64_t rid, const write_req& r) {
    if (!core.o.writable) fail(errc::permission_denied, "store.write", r.path, "this server is read-only (started without --writable)");
    if (r.length > core.o.max_request)
      fail(errc::out_of_range, "store.write", r.path, fmt::format("request of {} bytes exceeds the limit {}", r.length, core.o.max_request));
    if (s.writes.count(rid)) fail(errc::protocol_error, "store.write", c.peer(), fmt::format("request id {} is already in use", rid));
    auto ws = std::make_shared<write_state>();
    ws->txn = txn(r.handle, r.path);
    ws->f = ws->txn->file();
    ws->path = r.path;
    ws->offset = r.offset;
    ws->length = r.length;
    if (r.length == 0) {
      c.send_frame({rid, 0, complete{0, 0}});
      return;
    }
    s.outstanding++;
    s.writes[rid] = std::move(ws);
  }
  void fail_write(connection& c, session& s, std::uint64_t rid, const error& e) {
    auto it = s.writes.find(rid);
    if (it == s.writes.end() || it->second->failed) return;
    it->second->failed = true;
    s.writes.erase(it);
    s.outstanding--;
    core.reply_error(c, rid, e);
  }
  void* data_sink(connection& c, std::uint64_t rid, std::uint64_t off, std::size_t n) {
    auto s = core.session_of(c);
    if (!s) return nullptr;
    auto it = s->writes.find(rid);
    if (it == s->writes.end()) return nullptr;  // unknown, finished or failed request: dropped
    auto& ws = *it->second;
    if (n == 0 || n > max_data || off > ws.length || n > ws.length - off || ws.announced + n > ws.length) {
      fail_write(c, *s, rid, error(errc::protocol_error, "store.write", ws.path,
                                   fmt::format("data piece [{}, +{}) does not fit the request (length {}, message limit {})", off,
                                               n, ws.length, max_data)));
      return nullptr;
    }
    if (core.write_buffered.fetch_add(n) + n > core.o.max_write_buffer) {
      core.write_buffered -= n;
      fail_write(c, *s, rid, error(errc::busy, "store.write", ws.path,
                                   fmt::format("the server buffers at most {} bytes of write data at once; try again", core.o.max_write_buffer)));
      return nullptr;
    }
    ws.announced += n;
    auto buf = write_buffers.get();
    std::lock_guard l(recv_mu);
    receiving[{&c, rid, off}] = buf;
    return buf.get();
  }
  void data_done(connection& c, std::uint64_t rid, std::uint64_t off, std::size_t n, ucs_status_t st) {
    std::shared_ptr<std::byte[]> buf;
    {
      std::lock_guard l(recv_mu);
      auto node = receiving.extract({&c, rid, off});
      if (node.empty()) return;
      buf = std::move(node.mapped());
    }
    auto s = core.session_of(c);
    std::shared_ptr<write_state> ws;
    if (s) {
      auto it = s->writes.find(rid);
      if (it != s->writes.end()) ws = it->second;
    }
    if (!ws || st != UCS_OK) {
      core.write_buffered -= n;
      if (ws) fail_write(c, *s, rid, error(errc::network_error, "store.write", ws->path, std::string("data receive failed: ") + ucs_status_string(st)));
      return;
    }
    core.bytes_received += n;
    if (n <= core.o.inline_max && ws->f->local) {
      // A small piece is written on this thread, as a small read is read here: the hand-off to the
      // file engine and back would cost more than the write.
      std::optional<error> err;
      try {
        ws->f->f->write_here(buf.get(), n, ws->offset + off);
        ws->txn->wrote(ws->offset + off, n);
      } catch (const error& e) {
        err = e;
      }
      core.write_buffered -= n;
      return piece_written(c, *s, ws, rid, n, err);
    }
    auto self = c.shared_from_this();
    core.file_io(ws->f->f, true, ws->offset + off, buf.get(), n, [this, self, s, ws, rid, n, buf, off](const request_result& r) {
      std::optional<error> err;
      if (r.state == request_state::done) ws->txn->wrote(ws->offset + off, n);
      else err = core.error_of(r);
      core.write_buffered -= n;
      // Completion bookkeeping belongs to the connection's progress thread (it owns the write table).
      self->worker().post([this, self, s, ws, rid, n, err] { piece_written(*self, *s, ws, rid, n, err); });
    });
  }
  // A piece of write `rid` is in the file (or failed): the request is answered once all are. On the
  // connection's progress thread.
  void piece_written(connection& c, session& s, const std::shared_ptr<write_state>& ws, std::uint64_t rid, std::uint64_t n,
                     const std::optional<error>& err) {
    auto it = s.writes.find(rid);
    if (it == s.writes.end() || it->second != ws) return;
    if (err) return fail_write(c, s, rid, *err);
    ws->written += n;
    if (ws->written < ws->length) return;
    s.writes.erase(it);
    s.outstanding--;  // before the answer (see credit)
    try {
      c.send_frame({rid, 0, complete{0, ws->written}});
    } catch (...) {
    }
  }

  // write_mode::keep of an existing file: its current content is copied into the new version first,
  // a chunk at a time through a data buffer (a file request to read, one to write, each started by
  // the completion of the one before); the open is answered when the copy is done.
  struct keeping {
    std::shared_ptr<connection> c;
    std::shared_ptr<credit> cr;
    std::shared_ptr<write_txn> t;
    std::shared_ptr<ferry::file> from;
    std::uint64_t rid = 0, done = 0;
    std::byte* buf = nullptr;
  };
  void keep(std::shared_ptr<connection> c, const std::shared_ptr<write_txn>& t, const std::shared_ptr<credit>& cr, std::uint64_t rid) {
    auto k = std::make_shared<keeping>();
    k->c = std::move(c), k->cr = cr, k->t = t, k->rid = rid;
    k->from = ferry::file::adopt(core.root.open_regular(t->path(), O_RDONLY), printable(t->path()), false);
    core.buffers.take([this, k](std::byte* b) {
      k->buf = b;
      keep_step(k);
    });
  }
  void keep_step(const std::shared_ptr<keeping>& k) {
    auto fail_keep = [this, k](const error& e) {
      core.buffers.give_back(std::exchange(k->buf, nullptr));
      {
        std::lock_guard l(txn_mu);
        txns.erase(k->t->id());
      }
      core.answer_error(*k->c, *k->cr, k->rid,
                   error(error_info{e.code(), "store.write", printable(k->t->path()), "cannot copy its current content (write_mode::keep)",
                                    e.what(), e.sys_errno(), 0}));
    };
    if (!k->c->alive() || core.stopping_now()) return fail_keep(error(errc::cancelled, "store.write", k->c->peer(), "connection gone"));
    core.file_io(k->from, false, k->done, k->buf, core.buffers.bytes(), [this, k, fail_keep](const request_result& r) {
      if (r.state != request_state::done) return fail_keep(core.error_of(r));
      std::uint64_t got = r.bytes_done;
      if (got == 0) {
        core.buffers.give_back(std::exchange(k->buf, nullptr));
        return core.answer(*k->c, *k->cr, {k->rid, 0, complete{0, k->t->id()}});
      }
      core.file_io(k->t->file()->f, true, k->done, k->buf, got, [this, k, fail_keep, got](const request_result& w) {
        if (w.state != request_state::done) return fail_keep(core.error_of(w));
        k->t->wrote(k->done, got);
        k->done += got;
        keep_step(k);
      });
    });
  }

 private:
  server_core& core;
  // Write data buffers UCX is receiving into, by (connection, request, offset); the server's
  // workers are made after this (and so stopped before it goes).
  buffer_pool write_buffers;  // before `receiving`: its buffers return here
  std::mutex recv_mu;
  std::map<std::tuple<connection*, std::uint64_t, std::uint64_t>, std::shared_ptr<std::byte[]>> receiving;
  // Open writes by handle; any of a client's lanes may fill one (the handle is the capability),
  // the session that opened it owns it.
  std::mutex txn_mu;
  std::unordered_map<std::uint64_t, std::shared_ptr<write_txn>> txns;
  static constexpr std::size_t max_txns_per_session = 256, max_txns = 16384;
};

}  // namespace ferry::store::detail
