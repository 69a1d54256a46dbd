#include "rdma/tcp_transport.h"

#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <atomic>
#include <boost/asio.hpp>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "common/clock.h"

namespace kvtier::rdma {
namespace asio = boost::asio;
using asio::ip::tcp;

namespace {

uint64_t NowUs() { return DefaultSteadyClock().NowUs(); }

struct Pending {
  uint64_t request_id = 0;
  wire::FrameType type = wire::FrameType::kRead;
  std::vector<asio::mutable_buffer> dests;  // kRead: where the data lands, in op order
  uint64_t data_bytes = 0;                  // expected data_bytes of an OK reply
  uint32_t ops = 0;
  uint64_t deadline_us = 0;
  ReadCallback done;                                                     // kRead
  std::function<void(const Status&, const wire::OpenReply&)> open_done;  // kOpen
  std::array<uint8_t, wire::kOpenReplyBytes> open_reply{};
};

struct RegionEntry {
  RegionCredentials credentials;
  RegionInfo info;
  uint32_t server_id = 0;
  Status attach_status;  // non-OK when re-attaching after a reconnect failed
};

struct Buffer {
  size_t size_bytes = 0;
  LocalBufferId id = 0;
};

}  // namespace

struct TcpTransport::Impl {
  Impl(TcpEndpoint e, TransportOptions o) : endpoint(std::move(e)), options(o) {}

  TcpEndpoint endpoint;
  TransportOptions options;
  // Declared before every I/O object so that it is destroyed after them.
  asio::io_context io{1};
  asio::executor_work_guard<asio::io_context::executor_type> work{io.get_executor()};
  tcp::socket socket{io};
  asio::steady_timer tick{io};
  asio::steady_timer connect_timer{io};
  std::thread thread;
  std::thread::id io_thread_id;

  std::mutex connect_mu;  // serialises Connect / Reconnect / OpenRegion
  mutable std::mutex mu;  // protects everything below (writes also on the I/O thread)
  // The socket is up (frames of `generation` may be written and replies read).
  bool connected = false;
  // Connected and every open region re-attached on this connection: only then may reads be
  // submitted (a read planned earlier would carry another connection's region ids).
  bool ready = false;
  bool closed = false;
  uint64_t generation = 0;  // bumped at every connect and disconnect
  uint64_t next_request_id = 1;
  // pending and outbox grow together, under one lock: the frame of pending[i] is written
  // before that of pending[i + 1], so replies (answered in request order) match them.
  std::deque<std::unique_ptr<Pending>> pending;  // send order == reply order
  std::vector<std::vector<uint8_t>> outbox;      // frames not yet written (or their unwritten tail)
  // The I/O thread owns writing: a Flush is posted or a write is running. While set, frames
  // wait in the outbox for it (order); while clear, Submit() writes its frame itself.
  bool io_writes = false;
  uint32_t hold_depth = 0;  // HoldWrites() not yet released: frames stay in the outbox
  int fd = -1;              // the connected socket's descriptor (-1 when not connected)
  uint64_t in_flight_ops = 0;
  std::vector<RegionEntry> regions;                // index = client RegionId
  std::map<uintptr_t, Buffer> buffers_by_address;  // start address -> buffer
  std::map<LocalBufferId, uintptr_t> buffers_by_id;
  LocalBufferId next_buffer_id = 1;
  TransportCounters c;

  // I/O-thread only.
  std::vector<std::vector<uint8_t>> write_queue;  // taken from outbox, not yet being written
  std::vector<std::vector<uint8_t>> writing_now;  // frames of the async_write in progress
  std::vector<asio::const_buffer> write_buffers;
  bool writing = false;
  bool connecting = false;

  // Reply reading: the I/O thread when the socket is readable, or a Poll() caller. One reader
  // at a time (read_mu, taken before mu); everything below is guarded by read_mu.
  std::mutex read_mu;
  std::atomic<bool> io_reads_paused{false};  // TEST_PauseIoReads
  enum class Stage { kHeader, kMessage, kData };
  uint64_t read_gen = 0;  // the connection the state below belongs to
  Stage stage = Stage::kHeader;
  size_t stage_got = 0;      // bytes of the current stage's target already read
  Pending* front = nullptr;  // the pending batch the reply being read answers
  std::array<uint8_t, wire::kHeaderBytes> reply_header{};
  wire::ResponseHeader reply;
  std::string reply_message;
  std::vector<uint8_t> staging;  // a multi-op reply, scattered into the destinations
  // Bytes received ahead of the current stage (small replies arrive in one recv).
  std::vector<uint8_t> rx = std::vector<uint8_t>(kRxBytes);
  size_t rx_begin = 0, rx_end = 0;
  static constexpr size_t kRxBytes = 16 << 10;
  // A batch completed by a reader; its callback runs after read_mu is released.
  struct Done {
    std::unique_ptr<Pending> p;
    Status status;
  };
  // Callbacks run in completion order, one at a time, by whichever reader finds none running
  // (a reader that completed batches while another runs callbacks leaves its own to that one).
  std::mutex cb_mu;
  std::deque<Done> cb_queue;  // guarded by cb_mu
  bool cb_running = false;    // guarded by cb_mu

  // Queues completed batches for their callbacks; called under read_mu, so in wire order.
  void QueueCallbacks(std::vector<Done>* done) {
    if (done->empty()) return;
    std::lock_guard<std::mutex> lock(cb_mu);
    for (Done& d : *done) cb_queue.push_back(std::move(d));
    done->clear();
  }

  // Runs queued callbacks unless another thread is running them (then it runs these too).
  // Called under no transport lock (callbacks may Submit(), which may reconnect).
  void RunCallbacks() {
    std::unique_lock<std::mutex> lock(cb_mu);
    if (cb_running) return;
    cb_running = true;
    while (!cb_queue.empty()) {
      Done d = std::move(cb_queue.front());
      cb_queue.pop_front();
      lock.unlock();
      Finish(*d.p, d.status);
      lock.lock();
    }
    cb_running = false;
  }

  bool OnIoThread() const { return std::this_thread::get_id() == io_thread_id; }

  // Runs `fn` on the I/O thread and waits for it (runs inline when already there).
  void RunOnIo(const std::function<void()>& fn) {
    if (OnIoThread()) return fn();
    std::promise<void> done;
    asio::post(io, [&] {
      fn();
      done.set_value();
    });
    done.get_future().wait();
  }

  // ---- I/O thread ----------------------------------------------------------------
  void FailAll(const Status& status) {
    std::vector<Done> failed;
    {
      // No reader is inside the socket while it closes (a Poll() caller reads its fd).
      std::lock_guard<std::mutex> read_lock(read_mu);
      ResetReadLocked();
      std::lock_guard<std::mutex> lock(mu);
      if (connected) ++c.disconnects;
      connected = false;
      ready = false;
      ++generation;
      for (auto& p : pending) failed.push_back(Done{std::move(p), status});
      pending.clear();
      outbox.clear();
      io_writes = false;
      fd = -1;
      in_flight_ops = 0;
      c.batches_failed += failed.size();
      c.reads_in_flight = 0;
      // Closed under read_mu: a reader that took the lock after this sees !connected.
      boost::system::error_code ec;
      socket.shutdown(tcp::socket::shutdown_both, ec);
      socket.close(ec);
      QueueCallbacks(&failed);  // after the batches already completed, still under read_mu
    }
    write_queue.clear();
    writing_now.clear();
    writing = false;
    RunCallbacks();
  }

  static void Finish(Pending& p, const Status& status) {
    if (p.type == wire::FrameType::kRead) {
      if (p.done) p.done(status);
    } else if (p.open_done) {
      wire::OpenReply reply;
      Status st = status;
      if (st.ok()) st = wire::DecodeOpenReply(p.open_reply, &reply);
      p.open_done(st, reply);
    }
  }

  // Appends a request under `mu` (the caller holds it): its Pending and its frame go in
  // together, so frames leave in the order of `pending` whichever thread submits. Then, when
  // the I/O thread is not writing, the calling thread writes the outbox itself (no hand-off:
  // a thread wake-up costs tens of microseconds on a loaded or virtualised host). Returns
  // true when the I/O thread must be asked to write the rest (Kick(gen) after unlocking).
  // A read frame stays in the outbox while writes are held (HoldWrites); an open frame never
  // does (a reconnect inside a held Submit waits for its reply), taking held frames with it.
  bool AppendLocked(std::unique_ptr<Pending> p, std::vector<uint8_t> frame) {
    const bool may_hold = p->type == wire::FrameType::kRead;
    pending.push_back(std::move(p));
    outbox.push_back(std::move(frame));
    if (io_writes) return false;                   // it takes the outbox when its write completes
    if (hold_depth > 0 && may_hold) return false;  // ReleaseWrites() sends it
    if (WriteOutboxLocked()) return false;
    io_writes = true;
    return true;
  }

  // One non-blocking gathered send of the outbox on the caller's thread; what was written
  // leaves the outbox. True when all of it was written. Caller holds mu; connected.
  bool WriteOutboxLocked() {
    if (fd < 0) return false;
    constexpr size_t kIovMax = 64;
    while (!outbox.empty()) {
      iovec iov[kIovMax];
      size_t n = 0;
      for (; n < outbox.size() && n < kIovMax; ++n) {
        iov[n].iov_base = outbox[n].data();
        iov[n].iov_len = outbox[n].size();
      }
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = n;
      const ssize_t sent = ::sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
      ++c.sends;
      if (sent < 0 && errno == EINTR) continue;
      if (sent <= 0) return false;  // full (EAGAIN) or broken: the I/O thread's write decides
      size_t left = static_cast<size_t>(sent), done = 0;
      while (done < outbox.size() && left >= outbox[done].size()) left -= outbox[done++].size();
      outbox.erase(outbox.begin(), outbox.begin() + static_cast<std::ptrdiff_t>(done));
      if (left > 0) {  // a frame went out in part: keep its tail
        outbox.front().erase(outbox.front().begin(),
                             outbox.front().begin() + static_cast<std::ptrdiff_t>(left));
        return false;
      }
    }
    return true;
  }

  // Asks the I/O thread to write what is in the outbox.
  void Kick(uint64_t gen) {
    asio::post(io, [this, gen] { Flush(gen); });
  }

  void Flush(uint64_t gen) {
    if (!TakeOutbox(gen)) return;
    WriteNext(gen);
  }

  // Moves the outbox to the write queue; when nothing is left to write, hands writing back
  // to the submitting threads (io_writes = false) and returns false.
  bool TakeOutbox(uint64_t gen) {
    std::lock_guard<std::mutex> lock(mu);
    if (gen != generation || !connected) return false;  // those frames' batches already failed
    for (auto& f : outbox) write_queue.push_back(std::move(f));
    outbox.clear();
    if (write_queue.empty() && !writing) {
      io_writes = false;
      return false;
    }
    if (!writing) ++c.sends;  // WriteNext writes them
    return true;
  }

  // Writes every queued frame with one gathered write (in queue order), then the next lot.
  void WriteNext(uint64_t gen) {
    if (writing || write_queue.empty()) return;
    writing = true;
    writing_now.swap(write_queue);
    write_buffers.clear();
    for (const auto& f : writing_now) write_buffers.emplace_back(asio::buffer(f));
    asio::async_write(socket, write_buffers,
                      [this, gen](const boost::system::error_code& ec, size_t) {
                        if (!Current(gen)) return;
                        writing = false;
                        if (ec)
                          return FailAll(Status::IOError("row server write: " + ec.message()));
                        writing_now.clear();
                        if (TakeOutbox(gen)) WriteNext(gen);
                      });
  }

  bool Current(uint64_t gen) {
    std::lock_guard<std::mutex> lock(mu);
    return gen == generation && connected;
  }

  // ---- reply reading (the I/O thread, or a Poll() caller) ----------------------------
  void ResetReadLocked() {
    stage = Stage::kHeader;
    stage_got = 0;
    front = nullptr;
    rx_begin = rx_end = 0;
  }

  // The current stage's destination and its size.
  std::pair<uint8_t*, size_t> StageTarget() {
    switch (stage) {
      case Stage::kHeader:
        return {reply_header.data(), reply_header.size()};
      case Stage::kMessage:
        return {reinterpret_cast<uint8_t*>(reply_message.data()), reply_message.size()};
      case Stage::kData:
        if (front->type == wire::FrameType::kOpen)
          return {front->open_reply.data(), front->open_reply.size()};
        if (front->dests.size() == 1)
          return {static_cast<uint8_t*>(front->dests.front().data()), front->dests.front().size()};
        // A multi-op reply is read into one staging buffer, then scattered.
        return {staging.data(), staging.size()};
    }
    return {nullptr, 0};
  }

  // The current stage's target is complete: move on. Completed batches go to *done. An error
  // means the connection must be dropped. Caller holds read_mu.
  Status AdvanceLocked(std::vector<Done>* done) {
    switch (stage) {
      case Stage::kHeader: {
        if (Status st = wire::DecodeResponseHeader(reply_header.data(), &reply); !st.ok())
          return Status::IOError("bad reply from row server: " + st.message());
        {
          std::lock_guard<std::mutex> lock(mu);
          front = pending.empty() ? nullptr : pending.front().get();
        }
        if (front == nullptr || front->request_id != reply.request_id ||
            front->type != reply.type) {
          return Status::IOError("row server reply does not match the oldest request");
        }
        if (reply.code == StatusCode::kOk && reply.data_bytes != front->data_bytes)
          return Status::IOError("row server reply has the wrong data length");
        reply_message.resize(reply.message_bytes);
        stage = Stage::kMessage;
        return Status::Ok();
      }
      case Stage::kMessage:
        if (reply.code != StatusCode::kOk)
          return CompleteLocked(Status(reply.code, reply_message), done);
        if (front->type == wire::FrameType::kRead && front->dests.size() != 1)
          staging.resize(front->data_bytes);
        stage = Stage::kData;
        return Status::Ok();
      case Stage::kData:
        if (front->type == wire::FrameType::kRead && front->dests.size() != 1)
          asio::buffer_copy(front->dests, asio::buffer(staging));
        return CompleteLocked(Status::Ok(), done);
    }
    return Status::Ok();
  }

  Status CompleteLocked(const Status& status, std::vector<Done>* done) {
    Done d;
    {
      std::lock_guard<std::mutex> lock(mu);
      d.p = std::move(pending.front());
      pending.pop_front();
      in_flight_ops -= d.p->ops;
      c.reads_in_flight = in_flight_ops;
      if (status.ok()) {
        if (d.p->type == wire::FrameType::kRead) c.bytes_read += d.p->data_bytes;
      } else {
        ++c.batches_failed;
      }
    }
    const bool retry = status.IsRetry() && d.p->type == wire::FrameType::kRead;
    d.status = status;
    done->push_back(std::move(d));
    stage = Stage::kHeader;
    front = nullptr;
    if (retry) {
      // The server does not know a region id sent on this connection (docs/format/wire.md):
      // its view of the connection and ours differ. Drop it; the next Submit() reconnects
      // and re-opens every region, and the batch's owner retries (RowFetcher does).
      return Status::IOError("row server has not opened a region of this connection");
    }
    return Status::Ok();
  }

  // Reads replies until the socket has nothing more (never blocks) and completes them into
  // *done. *gen_out: the connection read. With `until_idle` (a Poll() caller) it stops once no
  // request is outstanding instead of reading on to EAGAIN (one syscall less per wait; the
  // I/O thread, reading on readiness, also sees an idle connection's end). Caller holds
  // read_mu.
  Status DrainLocked(uint64_t* gen_out, std::vector<Done>* done, bool until_idle) {
    int sock = -1;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!connected || fd < 0) return Status::Ok();
      if (until_idle && pending.empty()) return Status::Ok();
      sock = fd;
      *gen_out = generation;
    }
    if (read_gen != *gen_out) {
      ResetReadLocked();
      read_gen = *gen_out;
    }
    while (true) {
      auto [target, size] = StageTarget();
      while (stage_got < size && rx_begin < rx_end) {
        const size_t n = std::min(size - stage_got, rx_end - rx_begin);
        std::memcpy(target + stage_got, rx.data() + rx_begin, n);
        stage_got += n;
        rx_begin += n;
      }
      if (stage_got == size) {
        stage_got = 0;
        KVTIER_RETURN_IF_ERROR(AdvanceLocked(done));
        if (until_idle && stage == Stage::kHeader && rx_begin == rx_end) {
          std::lock_guard<std::mutex> lock(mu);
          if (pending.empty()) return Status::Ok();
        }
        continue;
      }
      // Need bytes: a large remainder goes straight to its target, else through rx.
      const bool direct = size - stage_got >= rx.size();
      uint8_t* into = direct ? target + stage_got : rx.data();
      const size_t want = direct ? size - stage_got : rx.size();
      const ssize_t got = ::recv(sock, into, want, MSG_DONTWAIT);
      if (got < 0 && errno == EINTR) continue;
      if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return Status::Ok();
      if (got < 0)
        return Status::IOError(std::string("connection to row server lost: ") +
                               std::strerror(errno));
      if (got == 0) return Status::IOError("connection to row server lost: end of stream");
      if (direct) {
        stage_got += static_cast<size_t>(got);
      } else {
        rx_begin = 0;
        rx_end = static_cast<size_t>(got);
      }
    }
  }

  // Drains on the I/O thread; false when the connection was dropped.
  bool DrainOnIo(uint64_t gen) {
    if (io_reads_paused.load()) return Current(gen);
    std::vector<Done> done;
    Status st;
    uint64_t read = gen;
    {
      std::lock_guard<std::mutex> read_lock(read_mu);
      st = DrainLocked(&read, &done, false);
      QueueCallbacks(&done);
    }
    RunCallbacks();
    if (!st.ok()) {
      if (Current(read)) FailAll(st);
      return false;
    }
    return Current(gen);
  }

  // Waits (on the I/O thread) for the socket to become readable, drains it and waits again.
  void ArmRead(uint64_t gen) {
    socket.async_wait(tcp::socket::wait_read, [this, gen](const boost::system::error_code& ec) {
      if (!Current(gen)) return;
      if (ec) return FailAll(Status::IOError("connection to row server lost: " + ec.message()));
      if (!DrainOnIo(gen)) return;
      ArmRead(gen);
      // Bytes that arrived after that drain but before the wait was armed raised their
      // (edge-triggered) event with nothing waiting: read once more now that it is armed.
      DrainOnIo(gen);
    });
  }

  void Tick() {
    const uint32_t period_ms = std::max<uint32_t>(10, options.request_timeout_ms / 4);
    tick.expires_after(std::chrono::milliseconds(period_ms));
    tick.async_wait([this](const boost::system::error_code& ec) {
      if (ec) return;
      bool expired = false;
      {
        std::lock_guard<std::mutex> lock(mu);
        if (closed) return;
        expired = connected && !pending.empty() && pending.front()->deadline_us < NowUs();
      }
      if (expired) {
        FailAll(Status::IOError("row server did not answer within request_timeout_ms"));
      }
      Tick();
    });
  }

  // ---- caller threads --------------------------------------------------------------
  // Connects the socket (not the regions). Caller holds connect_mu.
  Status ConnectSocket() {
    std::promise<boost::system::error_code> result;
    asio::post(io, [&] {
      boost::system::error_code ec;
      socket.close(ec);
      tcp::resolver resolver(io);
      auto endpoints = resolver.resolve(endpoint.host, std::to_string(endpoint.port), ec);
      if (ec) return result.set_value(ec);
      connecting = true;
      connect_timer.expires_after(std::chrono::milliseconds(options.connect_timeout_ms));
      connect_timer.async_wait([this](const boost::system::error_code& tec) {
        if (!tec && connecting) {
          boost::system::error_code ignored;
          socket.close(ignored);  // aborts the connect
        }
      });
      asio::async_connect(
          socket, endpoints,
          [this, &result](const boost::system::error_code& cec, const tcp::endpoint&) {
            connect_timer.cancel();
            connecting = false;
            if (!cec) {
              boost::system::error_code ignored;
              socket.set_option(tcp::no_delay(true), ignored);
              uint64_t gen = 0;
              {
                std::lock_guard<std::mutex> lock(mu);
                connected = true;
                fd = socket.native_handle();
                io_writes = false;
                gen = ++generation;
              }
              ArmRead(gen);
              DrainOnIo(gen);
            }
            result.set_value(cec);
          });
    });
    const boost::system::error_code ec = result.get_future().get();
    if (ec) {
      return Status::IOError("cannot connect to row server " + endpoint.host + ":" +
                             std::to_string(endpoint.port) + ": " + ec.message());
    }
    return Status::Ok();
  }

  // Sends an open request and waits for its reply. Caller holds connect_mu.
  StatusOr<wire::OpenReply> OpenOnWire(const RegionCredentials& cred) {
    auto p = std::make_unique<Pending>();
    std::promise<StatusOr<wire::OpenReply>> result;
    p->type = wire::FrameType::kOpen;
    p->data_bytes = wire::kOpenReplyBytes;
    p->open_done = [&result](const Status& st, const wire::OpenReply& r) {
      if (st.ok()) {
        result.set_value(r);
      } else {
        result.set_value(st);
      }
    };
    uint64_t gen = 0;
    bool kick = false;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!connected) return Status::IOError("not connected to row server");
      p->request_id = next_request_id++;
      p->deadline_us = NowUs() + uint64_t{options.request_timeout_ms} * 1000;
      std::vector<uint8_t> frame = wire::BuildOpenRequest(
          p->request_id, wire::OpenRequest{cred.token, cred.region_name, cred.tenant});
      gen = generation;
      kick = AppendLocked(std::move(p), std::move(frame));
    }
    if (kick) Kick(gen);
    return result.get_future().get();
  }

  // Connects and re-attaches every region; the connection is `ready` (reads may be
  // submitted) only after the last re-attach. Any failure on the way drops the connection,
  // so that the next attempt starts over. Caller holds connect_mu.
  Status EnsureConnected() {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (closed) return Status::Unavailable("transport closed");
      if (ready) return Status::Ok();
    }
    if (Status st = ConnectAndReattach(); !st.ok()) {
      RunOnIo([this] { FailAll(Status::IOError("connecting to row server failed")); });
      return st;
    }
    return Status::Ok();
  }

  Status ConnectAndReattach() {
    // A connection left half-made (socket up, regions not re-attached) is started afresh.
    RunOnIo([this] { FailAll(Status::IOError("reconnecting")); });
    KVTIER_RETURN_IF_ERROR(ConnectSocket());
    std::vector<RegionCredentials> creds;
    uint64_t gen = 0;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (const RegionEntry& r : regions) creds.push_back(r.credentials);
      gen = generation;
    }
    std::vector<StatusOr<wire::OpenReply>> replies;
    for (const RegionCredentials& cred : creds) {
      StatusOr<wire::OpenReply> reply = OpenOnWire(cred);
      // A lost connection, or a server that no longer knows what it just answered: start
      // over on the next attempt (Retry and IOError are what RowFetcher retries).
      if (!reply.ok() && (reply.status().IsIOError() || reply.status().IsRetry())) {
        return reply.status().WithContext("re-attaching region after reconnect");
      }
      replies.push_back(std::move(reply));
    }
    std::lock_guard<std::mutex> lock(mu);
    if (closed) return Status::Unavailable("transport closed");
    if (!connected || generation != gen) {
      return Status::IOError("connection to row server lost while re-attaching regions");
    }
    for (size_t i = 0; i < replies.size(); ++i) {
      RegionEntry& r = regions[i];
      const StatusOr<wire::OpenReply>& reply = replies[i];
      if (!reply.ok()) {
        r.attach_status = reply.status().WithContext("re-attaching region after reconnect");
      } else if (reply->size_bytes != r.info.size_bytes ||
                 reply->row_stride_bytes != r.info.row_stride_bytes ||
                 reply->row_begin != r.info.row_begin) {
        r.attach_status = Status::Corruption("region changed shape across a reconnect");
      } else {
        r.server_id = reply->region_id;
        r.attach_status = Status::Ok();
      }
    }
    ready = true;
    ++c.connects;
    return Status::Ok();
  }

  // Validates ops and builds the frame's op list. Caller holds mu.
  Status Plan(std::span<const ReadOp> ops, std::vector<wire::ReadOpWire>* wire_ops,
              Pending* p) const {
    if (ops.empty()) return Status::InvalidArgument("empty batch");
    if (ops.size() > options.batch_ops_max)
      return Status::InvalidArgument("batch over batch_ops_max");
    wire_ops->reserve(ops.size());
    p->dests.reserve(ops.size());
    for (const ReadOp& op : ops) {
      if (op.region >= regions.size()) return Status::InvalidArgument("unknown region");
      const RegionEntry& r = regions[op.region];
      if (!r.attach_status.ok()) return r.attach_status;
      if (op.length_bytes == 0 || op.length_bytes > options.read_bytes_max) {
        return Status::InvalidArgument("op length_bytes out of range");
      }
      if (op.offset_bytes > r.info.size_bytes ||
          r.info.size_bytes - op.offset_bytes < op.length_bytes) {
        return Status::InvalidArgument("read outside region");
      }
      const auto dest = reinterpret_cast<uintptr_t>(op.dest);
      auto it = buffers_by_address.upper_bound(dest);
      if (op.dest == nullptr || it == buffers_by_address.begin() ||
          dest + op.length_bytes > std::prev(it)->first + std::prev(it)->second.size_bytes) {
        return Status::InvalidArgument("destination outside registered buffers");
      }
      wire_ops->push_back(wire::ReadOpWire{r.server_id, op.length_bytes, op.offset_bytes});
      p->dests.emplace_back(op.dest, op.length_bytes);
      p->data_bytes += op.length_bytes;
    }
    p->ops = static_cast<uint32_t>(ops.size());
    return Status::Ok();
  }
};

StatusOr<std::unique_ptr<TcpTransport>> TcpTransport::Create(TcpEndpoint endpoint,
                                                             TransportOptions options) {
  if (endpoint.port == 0 || endpoint.host.empty()) {
    return Status::InvalidArgument("row server endpoint needs a host and a port");
  }
  if (options.batch_ops_max == 0 || options.batch_ops_max > wire::kBatchOpsMax ||
      options.read_bytes_max == 0 || options.read_bytes_max > wire::kReadBytesMax ||
      options.reads_in_flight_max == 0 || options.request_timeout_ms == 0 ||
      uint64_t{options.batch_ops_max} * options.read_bytes_max > wire::kResponseDataBytesMax) {
    return Status::InvalidArgument("transport limits out of range");
  }
  auto impl = std::make_unique<Impl>(std::move(endpoint), options);
  Impl* raw = impl.get();
  std::promise<void> started;
  raw->thread = std::thread([raw, &started] {
    raw->io_thread_id = std::this_thread::get_id();
    started.set_value();
    raw->io.run();
  });
  started.get_future().wait();
  asio::post(raw->io, [raw] { raw->Tick(); });
  return std::unique_ptr<TcpTransport>(new TcpTransport(std::move(impl)));
}

TcpTransport::TcpTransport(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

TcpTransport::~TcpTransport() { Close(); }

Status TcpTransport::Connect() {
  if (impl_->OnIoThread()) return Status::IOError("cannot connect from a transport callback");
  std::lock_guard<std::mutex> lock(impl_->connect_mu);
  return impl_->EnsureConnected();
}

Status TcpTransport::Reconnect() {
  if (impl_->OnIoThread()) return Status::IOError("cannot reconnect from a transport callback");
  std::lock_guard<std::mutex> lock(impl_->connect_mu);
  {
    std::lock_guard<std::mutex> state_lock(impl_->mu);
    if (impl_->closed) return Status::Unavailable("transport closed");
  }
  impl_->RunOnIo([this] { impl_->FailAll(Status::IOError("reconnecting")); });
  return impl_->EnsureConnected();
}

StatusOr<RegionInfo> TcpTransport::OpenRegion(const RegionCredentials& credentials) {
  if (impl_->OnIoThread()) return Status::IOError("cannot open a region from a callback");
  if (credentials.region_name.empty() || credentials.region_name.size() > wire::kNameBytesMax ||
      credentials.tenant.empty() || credentials.tenant.size() > wire::kNameBytesMax) {
    return Status::InvalidArgument("region name and tenant must be 1..256 bytes");
  }
  std::lock_guard<std::mutex> lock(impl_->connect_mu);
  KVTIER_RETURN_IF_ERROR(impl_->EnsureConnected());
  KVTIER_ASSIGN_OR_RETURN(wire::OpenReply reply, impl_->OpenOnWire(credentials));
  std::lock_guard<std::mutex> state_lock(impl_->mu);
  RegionEntry entry;
  entry.credentials = credentials;
  entry.server_id = reply.region_id;
  entry.info = RegionInfo{static_cast<RegionId>(impl_->regions.size()),
                          reply.size_bytes,
                          reply.row_stride_bytes,
                          reply.row_dim,
                          reply.row_begin,
                          reply.row_count};
  impl_->regions.push_back(entry);
  return entry.info;
}

StatusOr<LocalBufferId> TcpTransport::RegisterLocalBuffer(uint8_t* data, size_t size_bytes) {
  if (data == nullptr || size_bytes == 0) return Status::InvalidArgument("empty buffer");
  std::lock_guard<std::mutex> lock(impl_->mu);
  const auto start = reinterpret_cast<uintptr_t>(data);
  auto next = impl_->buffers_by_address.lower_bound(start);
  if ((next != impl_->buffers_by_address.end() && next->first < start + size_bytes) ||
      (next != impl_->buffers_by_address.begin() &&
       std::prev(next)->first + std::prev(next)->second.size_bytes > start)) {
    return Status::InvalidArgument("buffer overlaps a registered buffer");
  }
  const LocalBufferId id = impl_->next_buffer_id++;
  impl_->buffers_by_address[start] = Buffer{size_bytes, id};
  impl_->buffers_by_id[id] = start;
  return id;
}

Status TcpTransport::UnregisterLocalBuffer(LocalBufferId id) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->buffers_by_id.find(id);
  if (it == impl_->buffers_by_id.end()) return Status::NotFound("no such buffer");
  impl_->buffers_by_address.erase(it->second);
  impl_->buffers_by_id.erase(it);
  return Status::Ok();
}

Status TcpTransport::Submit(std::span<const ReadOp> ops, ReadCallback done) {
  Impl& d = *impl_;
  bool need_connect = false;
  {
    std::lock_guard<std::mutex> lock(d.mu);
    if (d.closed) return Status::Unavailable("transport closed");
    need_connect = !d.ready;
  }
  if (need_connect) {
    if (!d.options.reconnect_on_submit || d.OnIoThread()) {
      return Status::IOError("not connected to row server");
    }
    std::lock_guard<std::mutex> lock(d.connect_mu);
    KVTIER_RETURN_IF_ERROR(d.EnsureConnected());
  }
  auto p = std::make_unique<Pending>();
  std::vector<wire::ReadOpWire> wire_ops;
  uint64_t gen = 0;
  bool kick = false;
  std::vector<uint8_t> frame;
  {
    std::lock_guard<std::mutex> lock(d.mu);
    if (d.closed) return Status::Unavailable("transport closed");
    if (!d.ready) return Status::IOError("connection to row server lost");
    KVTIER_RETURN_IF_ERROR(d.Plan(ops, &wire_ops, p.get()));
    if (d.in_flight_ops + ops.size() > d.options.reads_in_flight_max) {
      return Status::Rejected("reads_in_flight_max reached");
    }
    p->type = wire::FrameType::kRead;
    p->request_id = d.next_request_id++;
    p->deadline_us = NowUs() + uint64_t{d.options.request_timeout_ms} * 1000;
    p->done = std::move(done);
    frame = wire::BuildReadRequest(p->request_id, wire_ops);
    d.in_flight_ops += p->ops;
    d.c.reads_in_flight = d.in_flight_ops;
    ++d.c.batches_submitted;
    const size_t outbox_before = d.outbox.size();
    d.c.ops_submitted += p->ops;
    gen = d.generation;
    kick = d.AppendLocked(std::move(p), std::move(frame));
    if (outbox_before == 0 && d.outbox.empty()) ++d.c.batches_sent_inline;
  }
  if (kick) d.Kick(gen);
  return Status::Ok();
}

void TcpTransport::HoldWrites() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  ++impl_->hold_depth;
}

void TcpTransport::ReleaseWrites() {
  Impl& d = *impl_;
  uint64_t gen = 0;
  {
    std::lock_guard<std::mutex> lock(d.mu);
    if (d.hold_depth == 0 || --d.hold_depth > 0) return;
    if (d.outbox.empty() || d.io_writes || !d.connected) return;
    if (d.WriteOutboxLocked()) return;
    d.io_writes = true;
    gen = d.generation;
  }
  d.Kick(gen);
}

void TcpTransport::TEST_PauseIoReads(bool paused) {
  impl_->io_reads_paused.store(paused);
  // A drain already running on the I/O thread finishes before this returns.
  if (paused) impl_->RunOnIo([] {});
  if (!paused) {
    // Replies that arrived while paused raised their edge already: read them now.
    impl_->RunOnIo([this] {
      uint64_t gen = 0;
      {
        std::lock_guard<std::mutex> lock(impl_->mu);
        gen = impl_->generation;
      }
      impl_->DrainOnIo(gen);
    });
  }
}

size_t TcpTransport::TEST_ReadableBytes() {
  std::lock_guard<std::mutex> read_lock(impl_->read_mu);
  std::lock_guard<std::mutex> lock(impl_->mu);
  int n = 0;
  if (impl_->fd < 0 || ::ioctl(impl_->fd, FIONREAD, &n) != 0) return 0;
  return static_cast<size_t>(n);
}

uint32_t TcpTransport::Poll() {
  Impl& d = *impl_;
  std::vector<Impl::Done> done;
  size_t completed = 0;
  Status st;
  uint64_t gen = 0;
  {
    // The I/O thread is reading: it completes what arrived.
    std::unique_lock<std::mutex> read_lock(d.read_mu, std::try_to_lock);
    if (!read_lock.owns_lock()) return 0;
    st = d.DrainLocked(&gen, &done, true);
    completed = done.size();
    d.QueueCallbacks(&done);
  }
  d.RunCallbacks();
  if (!st.ok()) {
    asio::post(d.io, [&d, gen, st] {
      if (d.Current(gen)) d.FailAll(st);
    });
  }
  return static_cast<uint32_t>(completed);
}

void TcpTransport::Close() {
  Impl& d = *impl_;
  {
    std::lock_guard<std::mutex> lock(d.mu);
    if (d.closed) return;
    d.closed = true;
  }
  // Fail what is in flight (this also ends a connect or re-attach in progress), then wait
  // for that caller to leave: it still needs the I/O thread (its own RunOnIo calls).
  d.RunOnIo([&d] { d.FailAll(Status::Unavailable("transport closed")); });
  std::lock_guard<std::mutex> connect_lock(d.connect_mu);
  d.RunOnIo([&d] {
    d.FailAll(Status::Unavailable("transport closed"));
    d.tick.cancel();
    d.connect_timer.cancel();
  });
  d.work.reset();
  d.io.stop();
  if (d.thread.joinable()) d.thread.join();
}

TransportCounters TcpTransport::counters() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->c;
}

}  // namespace kvtier::rdma
