// Private to cache_daemon/: one native-protocol connection (docs/format/wire.md), one class
// over two files split by concern:
//   native_session.cc          the connection on its strand: reads and frame splitting, auth
//                              (HELLO/AUTH), turns, SHM_ATTACH, dispatch to the workers,
//                              ordered writes (SCM_RIGHTS), backpressure, the slow-client timer
//   native_session_execute.cc  one request on a worker thread (Execute): LOOKUP, PUT, GET, ...
// Thread safety: the strand-only state is touched only on the connection's strand; workers
// read a request's Job and the immutable options, and the atomics marked below.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cache_daemon/daemon_internal.h"
#include "cache_daemon/wire.h"

namespace kvtier::daemon::internal::native {

using wire::Opcode;
using GenericSocket = asio::generic::stream_protocol::socket;

// Builds a response frame: header, status, then fill(w) when the status is OK.
std::vector<uint8_t> Response(const wire::FrameHeader& req, uint16_t flags, const Status& st,
                              const std::function<void(wire::Writer*)>& fill = nullptr);

struct OutMsg {
  std::vector<uint8_t> bytes;
  int fd = -1;  // sent with SCM_RIGHTS alongside the bytes (Unix sockets only)
};

// Everything a request needs from its connection, fixed when the frame is accepted: a
// HELLO/AUTH/SHM_ATTACH that follows it on the strand cannot change what it runs as.
struct Job {
  wire::Frame frame;
  const Tenant* tenant = nullptr;  // never null
  uint32_t unit_tokens = 0;
  uint8_t* shm = nullptr;  // the mapping (lives as long as the session); null when none
  uint64_t shm_bytes = 0;
  int shm_fd = -1;  // with shm: the region's memfd (session-owned, open while it lives)
  // The request the call belongs to for the eviction policies: its turn's (kFlagTurn), else
  // id 0 (the store makes the call a request of its own).
  storage::RequestTag request;
  // Set by the worker: value bytes of the reply it built, reserved with ReserveReply.
  uint64_t reserved_bytes = 0;
  // Set by the worker before Execute: queues the reply (once) on the connection's strand. A
  // GET calls it as soon as every value is placed, before the store's promotions into DRAM
  // (Service::Get's `visited`); Execute then returns no bytes and the worker sends nothing.
  std::function<void(std::vector<uint8_t>, StatusCode)> reply;
  bool replied = false;
};

class NativeSession : public Session, public std::enable_shared_from_this<NativeSession> {
 public:
  NativeSession(Shared* shared, GenericSocket socket, bool is_unix,
                std::shared_ptr<ConnectionCount> count);

  ~NativeSession() override;

  void Begin();

  void Close() override {
    asio::post(strand_, [self = shared_from_this()] { self->DoClose(); });
  }
  bool Busy() const override { return busy_.load() > 0 || write_busy_.load(); }
  asio::strand<asio::io_context::executor_type>& executor() { return strand_; }

 private:
  void DoClose();

  void MaybeRead();

  void OnRead(boost::system::error_code ec, size_t n);

  // Reads are paused by the daemon-wide budget while the client has nothing left to read:
  // the daemon, not the client, is holding the connection up, so it is not idle.
  bool HeldByMemoryGate() const { return memory_.paused() && wq_.empty(); }

  // Auth is on and this connection has not authenticated (yet, or after a failed AUTH).
  bool Unauthenticated() const;
  // After a HELLO/AUTH that found the connection as tenant `before`: an authenticated
  // connection gives its unauthenticated place back and its deadline is disarmed; one that
  // lost its tenant takes a place again (closed after the reply when its front has none
  // left) and must authenticate within limits.auth_timeout_ms from now.
  void AfterAuth(const Tenant* before);
  // Closes the connection at deadline_ms unless it has authenticated by then.
  void ArmAuthDeadline(uint64_t deadline_ms);
  uint64_t PreauthFrameBytes() const {
    return std::min(shared_->options->preauth_frame_bytes_max, shared_->options->max_frame_bytes);
  }
  // Before authentication only a small frame is accepted, judged from its header.
  void SetFrameLimit();
  // The client is not reading its replies: the queue is at its limit, or a worker answered a
  // value `retry` (ReserveReply: the connection's reply budget or the daemon-wide one) since
  // the queue last drained. The second matters because the retry answers are small: the queue
  // would stay under its limit while every further GET still read its values from the store,
  // for nothing.
  bool ReplyQueueFull() const;

  // Called on a worker before it copies n value bytes into an inline reply. A connection
  // with no reply bytes queued or being built always gets its first value; beyond that the
  // value must fit in reply_queue_bytes_max and the daemon-wide budget must not be spent.
  // False: the value is answered `retry` (as when it would not fit in a frame), so a client
  // that does not read its replies cannot make the workers build more of them.
  bool ReserveReply(uint64_t n, Job* job);

  // Reports what this connection holds to the daemon-wide budget.
  void Account();

  // Starts the slow-client timer when a frame is incomplete.
  void ArmFrameTimer();

  static bool IsAuthFrame(const wire::FrameHeader& h) {
    return h.opcode == static_cast<uint8_t>(Opcode::kHello) ||
           h.opcode == static_cast<uint8_t>(Opcode::kAuth);
  }

  // Returns false when the connection is being closed. A HELLO/AUTH that arrives while
  // requests are executing is held (and nothing after it is taken) until they finish, so each
  // request runs as the tenant it was sent under (docs/format/wire.md "Authentication").
  bool ProcessFrames();

  // Framing is lost: answer once (request id taken from the bad header when possible) and
  // close after the write.
  void OnMalformed(const Status& st);

  void Enqueue(OutMsg msg);

  void WriteNext();

  // sendmsg with SCM_RIGHTS on the native descriptor; retries when the socket is full.
  void SendWithFd();

  void Reply(Op op, uint64_t start_us, std::vector<uint8_t> bytes, StatusCode code);

  void HandleFrame(wire::Frame frame);

  Status HandleAuth(const wire::Frame& frame);

  // On the strand, when a frame is taken: the request of its turn (wire::kFlagTurn), begun at
  // the turn's first call; id 0 for a call without a valid turn (ExecuteInto rejects a bad
  // one). The id is the store's own (TierManager::BeginRequest), never the client's number,
  // which only names an entry of this connection's table: no value a client sends can join
  // its calls to another connection's or another tenant's request.
  storage::RequestTag TurnRequest(const wire::Frame& frame);
  void ForgetTurns();

  void HandleShmAttach(const wire::Frame& frame, uint64_t start_us);

  // ---- On a worker thread (native_session_execute.cc) ----

  // The advertised and enforced key limit of one batch (limits.max_batch_keys).
  uint32_t BatchLimit() const;
  // A batch over the limit is answered invalid_argument. The frame it came in was already
  // consumed whole by the parser, so the connection stays framed and open.
  Status CheckBatch(size_t keys) const;

  // Bounds check of a client-supplied shared-memory range (overflow-safe).
  static bool InShm(const Job& job, uint64_t offset, uint64_t bytes);

  // Runs on a worker thread. Reads only the job and immutable session state (options), never
  // the strand's tenant_/unit_tokens_/shm_.
  // Empty when the reply was already sent (job.replied).
  std::vector<uint8_t> Execute(Job& job, StatusCode* code);

  // Execute's body: the opcode's work, its reply frame into *out; an error status is
  // answered by Execute as a bare status frame.
  Status ExecuteInto(Job& job, StatusCode* code, std::vector<uint8_t>* out);

  // ---- State ----

  Shared* shared_;
  std::shared_ptr<ConnectionCount> count_;  // released when the session is destroyed
  // Every handler of this connection runs on strand_ (bound explicitly, not inherited from
  // the socket), so the strand-only state below is never touched by two threads at once.
  asio::strand<asio::io_context::executor_type> strand_;
  GenericSocket sock_;
  bool is_unix_;
  wire::FrameParser parser_;
  asio::steady_timer timer_;
  MemoryGate memory_;  // reads paused by the daemon-wide budget
  IdleWatch idle_;
  AuthDeadline auth_deadline_;  // armed while unauthenticated with auth on
  std::vector<uint8_t> rbuf_;
  uint64_t id_ = 0;
  // Strand-only state.
  const Tenant* tenant_ = nullptr;
  uint32_t unit_tokens_ = 0;
  uint32_t inflight_ = 0;
  // Turns of this connection (TurnRequest): turn id -> its request and the steady ms it began;
  // turn_order_ lists (turn, began) oldest first, with stale pairs skipped.
  struct TurnEntry {
    storage::RequestTag tag;
    uint64_t started_ms = 0;
  };
  std::unordered_map<uint64_t, TurnEntry> turns_;
  std::deque<std::pair<uint64_t, uint64_t>> turn_order_;
  int auth_failures_ = 0;
  bool reading_ = false, writing_ = false, closed_ = false, close_after_write_ = false;
  bool timer_armed_ = false;
  bool processing_ = false;  // inside ProcessFrames (re-entrancy guard)
  uint64_t frames_completed_ = 0;
  uint8_t last_opcode_ = 0;
  std::deque<OutMsg> wq_;
  // Bytes of wq_ (limits.reply_queue_bytes_max); written on the strand, read by workers.
  std::atomic<uint64_t> wq_bytes_{0};
  // Value bytes reserved by workers for replies not yet queued (ReserveReply).
  std::atomic<uint64_t> building_bytes_{0};
  // A value was answered `retry` by ReserveReply (set by a worker); cleared on the strand when
  // the write queue is empty and no request executes. ReplyQueueFull() while set.
  std::atomic<bool> reply_refused_{false};
  uint64_t inflight_bytes_ = 0;      // frame bodies executing on workers
  uint64_t charged_bytes_ = 0;       // what this connection counts in shared_->memory
  bool reply_paused_ = false;        // counted once per pause
  std::optional<wire::Frame> held_;  // a HELLO/AUTH waiting for inflight_ == 0
  std::atomic<int> busy_{0};
  std::atomic<bool> write_busy_{false};  // mirrors writing_ for Busy() from other threads
  // Shared memory: set once on the strand before any worker can use it.
  uint8_t* shm_ = nullptr;
  uint64_t shm_bytes_ = 0;
  int shm_fd_ = -1;
};

}  // namespace kvtier::daemon::internal::native
