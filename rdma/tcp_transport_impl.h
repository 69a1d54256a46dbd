// Private to rdma/: TcpTransport::Impl, the state of a TcpTransport (tcp_transport.h), one
// struct over four files split by concern:
//   tcp_transport.cc          the Transport interface: Create, Connect, Reconnect, OpenRegion,
//                             local buffers, Submit (and Plan, its batch check), hold/release,
//                             Poll, Close, counters
//   tcp_transport_connect.cc  the connection: connecting the socket, opening regions on the
//                             wire, (re)connecting with every region re-attached; dropping the
//                             connection (FailAll) and the request deadline (Tick)
//   tcp_transport_write.cc    writing frames: the outbox, the caller's inline send, the I/O
//                             thread's gathered writes
//   tcp_transport_read.cc     reading replies (the I/O thread or a Poll() caller) and running
//                             their callbacks in completion order
#pragma once

#include <array>
#include <atomic>
#include <boost/asio.hpp>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/clock.h"
#include "rdma/tcp_transport.h"
#include "rdma/wire.h"

namespace kvtier::rdma {
namespace asio = boost::asio;
using asio::ip::tcp;

// Private to the TcpTransport files. Not `internal`: the verbs transport's (verbs_transport_impl.h)
// has a RegionEntry and a NowUs of its own.
namespace tcp_internal {

inline uint64_t NowUs() { return DefaultSteadyClock().NowUs(); }

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

}  // namespace tcp_internal

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
  std::deque<std::unique_ptr<tcp_internal::Pending>> pending;  // send order == reply order
  std::vector<std::vector<uint8_t>> outbox;  // frames not yet written (or their unwritten tail)
  // The I/O thread owns writing: a Flush is posted or a write is running. While set, frames
  // wait in the outbox for it (order); while clear, Submit() writes its frame itself.
  bool io_writes = false;
  uint32_t hold_depth = 0;  // HoldWrites() not yet released: frames stay in the outbox
  int fd = -1;              // the connected socket's descriptor (-1 when not connected)
  uint64_t in_flight_ops = 0;
  std::vector<tcp_internal::RegionEntry> regions;                // index = client RegionId
  std::map<uintptr_t, tcp_internal::Buffer> buffers_by_address;  // start address -> buffer
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
  size_t stage_got = 0;                    // bytes of the current stage's target already read
  tcp_internal::Pending* front = nullptr;  // the pending batch the reply being read answers
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
    std::unique_ptr<tcp_internal::Pending> p;
    Status status;
  };
  // Callbacks run in completion order, one at a time, by whichever reader finds none running
  // (a reader that completed batches while another runs callbacks leaves its own to that one).
  std::mutex cb_mu;
  std::deque<Done> cb_queue;  // guarded by cb_mu
  bool cb_running = false;    // guarded by cb_mu

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

  bool Current(uint64_t gen) {
    std::lock_guard<std::mutex> lock(mu);
    return gen == generation && connected;
  }

  // ---- the connection (tcp_transport_connect.cc) ---------------------------------
  // I/O thread: closes the socket and fails every batch in flight with `status`.
  void FailAll(const Status& status);

  // I/O thread: every request_timeout_ms / 4 (at least 10 ms), drops the connection when
  // its oldest batch is past its deadline.
  void Tick();

  // ---- caller threads --------------------------------------------------------------
  // Connects the socket (not the regions). Caller holds connect_mu.
  Status ConnectSocket();

  // Sends an open request and waits for its reply. Caller holds connect_mu.
  StatusOr<wire::OpenReply> OpenOnWire(const RegionCredentials& cred);

  // Connects and re-attaches every region; the connection is `ready` (reads may be
  // submitted) only after the last re-attach. Any failure on the way drops the connection,
  // so that the next attempt starts over. Caller holds connect_mu.
  Status EnsureConnected();

  Status ConnectAndReattach();

  // ---- writing (tcp_transport_write.cc) ---------------------------------------------
  // Appends a request under `mu` (the caller holds it): its Pending and its frame go in
  // together, so frames leave in the order of `pending` whichever thread submits. Then, when
  // the I/O thread is not writing, the calling thread writes the outbox itself (no hand-off:
  // a thread wake-up costs tens of microseconds on a loaded or virtualised host). Returns
  // true when the I/O thread must be asked to write the rest (Kick(gen) after unlocking).
  // A read frame stays in the outbox while writes are held (HoldWrites); an open frame never
  // does (a reconnect inside a held Submit waits for its reply), taking held frames with it.
  bool AppendLocked(std::unique_ptr<tcp_internal::Pending> p, std::vector<uint8_t> frame);

  // One non-blocking gathered send of the outbox on the caller's thread; what was written
  // leaves the outbox. True when all of it was written. Caller holds mu; connected.
  bool WriteOutboxLocked();

  // Asks the I/O thread to write what is in the outbox.
  void Kick(uint64_t gen);

  void Flush(uint64_t gen);

  // Moves the outbox to the write queue; when nothing is left to write, hands writing back
  // to the submitting threads (io_writes = false) and returns false.
  bool TakeOutbox(uint64_t gen);

  // Writes every queued frame with one gathered write (in queue order), then the next lot.
  void WriteNext(uint64_t gen);

  // ---- reply reading (the I/O thread, or a Poll() caller; tcp_transport_read.cc) -----
  // Queues completed batches for their callbacks; called under read_mu, so in wire order.
  void QueueCallbacks(std::vector<Done>* done);

  // Runs queued callbacks unless another thread is running them (then it runs these too).
  // Called under no transport lock (callbacks may Submit(), which may reconnect).
  void RunCallbacks();

  static void Finish(tcp_internal::Pending& p, const Status& status);

  void ResetReadLocked();

  // The current stage's destination and its size.
  std::pair<uint8_t*, size_t> StageTarget();

  // The current stage's target is complete: move on. Completed batches go to *done. An error
  // means the connection must be dropped. Caller holds read_mu.
  Status AdvanceLocked(std::vector<Done>* done);

  Status CompleteLocked(const Status& status, std::vector<Done>* done);

  // Reads replies until the socket has nothing more (never blocks) and completes them into
  // *done. *gen_out: the connection read. With `until_idle` (a Poll() caller) it stops once no
  // request is outstanding instead of reading on to EAGAIN (one syscall less per wait; the
  // I/O thread, reading on readiness, also sees an idle connection's end). Caller holds
  // read_mu.
  Status DrainLocked(uint64_t* gen_out, std::vector<Done>* done, bool until_idle);

  // Drains on the I/O thread; false when the connection was dropped.
  bool DrainOnIo(uint64_t gen);

  // Waits (on the I/O thread) for the socket to become readable, drains it and waits again.
  void ArmRead(uint64_t gen);

  // ---- planning a batch (tcp_transport.cc, for Submit) -------------------------------
  // Validates ops and builds the frame's op list. Caller holds mu.
  Status Plan(std::span<const ReadOp> ops, std::vector<wire::ReadOpWire>* wire_ops,
              tcp_internal::Pending* p) const;
};

}  // namespace kvtier::rdma
