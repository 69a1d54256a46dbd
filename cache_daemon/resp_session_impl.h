// Private to cache_daemon/: the RESP (Redis protocol) connection, one class over four files
// split by concern:
//   resp_session.cc           lifecycle, reads, the command loop (Process), the frame timer
//   resp_session_write.cc     reply buffering and the writev of ready replies
//   resp_session_sets.cc      SETs completed asynchronously under durability sync
//   resp_session_commands.cc  command dispatch (Execute) and the commands themselves
//
// Commands run in arrival order on the connection's strand; replies are written in the same
// order, so pipelining (redis-benchmark -P) works.
//
// Hot path (docs/performance/daemon.md "## Daemon"): the socket is read straight into the
// parser's buffer and commands are parsed as views into it; every reply of one read's worth of
// pipelined commands is gathered and written with one writev, tried at once on the
// non-blocking socket (asio's async_write only takes over when the socket buffer is full).
// GET values of kScatterMinBytes or more are not copied into the reply text: the buffer the
// store filled is kept as a segment of that writev and recycled afterwards.
//
// Thread safety: every method runs on the connection's strand, except DirectReply (a commit
// thread, under direct_mu_) and Close (any thread; it posts to the strand).
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cache_daemon/daemon_internal.h"
#include "cache_daemon/resp.h"
#include "cache_daemon/resp_commands.h"
#include "cache_daemon/resp_durable_sets.h"
#include "cache_daemon/resp_keyspace.h"
#include "cache_daemon/resp_transaction.h"

namespace kvtier::daemon::internal {

class RespSession : public Session, public std::enable_shared_from_this<RespSession> {
 public:
  using GenericSocket = asio::generic::stream_protocol::socket;

  RespSession(Shared* shared, GenericSocket socket, std::shared_ptr<ConnectionCount> count);
  ~RespSession() override;

  asio::strand<asio::io_context::executor_type>& executor() { return strand_; }
  void Begin();
  void Close() override;
  bool Busy() const override { return busy_.load(); }

 private:
  // ---- Limits ----
  static constexpr size_t kReadChunkBytes = 256 * 1024;
  // Reply bytes (text and GET value segments together) buffered before the connection stops
  // parsing and writes them out.
  static constexpr size_t kMaxPendingReplyBytes = 8u << 20;
  // GET values at least this large are written from the store's buffer instead of being copied.
  static constexpr size_t kScatterMinBytes = 16u << 10;
  // Recycled GET buffers kept per connection (sum of capacities).
  static constexpr size_t kSpareBufferBytesMax = 2u << 20;
  // Reply text buffers (out_, wbuf_) larger than this are freed once drained, before the
  // connection waits for its next read (ReleaseIdleBuffers).
  static constexpr size_t kKeepReplyBufferBytes = 1u << 20;
  static constexpr int kMaxAuthFailures = 3;
  // SETs (and MSETs) of one connection pending at once (durability sync: RespDurableSets). Each
  // also counts its stored bytes plus kHoldOverheadBytes per key against the connection's reply
  // budget.
  static constexpr size_t kPendingSetsMax = 1024;
  static constexpr size_t kHoldOverheadBytes = 256;
  // No pending SET's reply may be written by its commit (direct_id_).
  static constexpr uint64_t kNoHold = ~uint64_t{0};

  // A GET value written from the buffer the store filled: bytes[offset...] follow the reply
  // text up to text_end.
  struct Body {
    size_t text_end = 0;
    std::vector<uint8_t> bytes;
    size_t offset = 0;
  };

  // The reply of a SET, MSET or DEL still pending (RespDurableSets): it goes at text_pos of
  // the reply text, and nothing from there on is written before it.
  struct Hold {
    uint64_t id = 0;
    Op op = Op::kRespSet;  // the command, for its latency
    size_t text_pos = 0;
    uint64_t charged_bytes = 0;  // counted in pending_bytes() until it resolves
    uint64_t start_us = 0;       // the SET's start, for its latency
    bool via_thread = false;     // handed to the put thread (RespDurableSets::Submit)
    bool done = false;
    Status result;
    size_t sent_bytes = 0;  // of its reply, already written by the commit thread (DirectReply)
    // The reply when it succeeds: "+OK\r\n" (SET, MSET) or a DEL's count (":n\r\n"; known when
    // the DEL ran, sent once its removals are durable). Short: no allocation.
    std::string ok_reply;
  };

  // ---- Connection: lifecycle, reads, the command loop (resp_session.cc) ----

  void DoClose();

  // Before authentication (auth on) a command may be no larger than a pre-auth frame.
  void SetCommandLimit();

  // Reports what this connection holds to the daemon-wide budget: the capacities of its
  // buffers, not only the bytes in them.
  void Account();

  // Frees drained buffers a large command or reply grew (above kKeepReplyBufferBytes; raw_
  // above kSpareBufferBytesMax), so that an idle connection holds little.
  void ReleaseIdleBuffers();

  void Read();

  void ReadReady();

  size_t pending_bytes() const { return out_.size() + body_bytes_ + hold_bytes_; }
  // Reads are paused by the daemon-wide budget while nothing is left for the client to read:
  // the daemon, not the client, is holding the connection up, so it is not idle.
  bool HeldByMemoryGate() const;

  // Runs buffered commands until the pending replies reach kMaxPendingReplyBytes (or
  // kPendingSetsMax SETs are pending), writes what is ready (the replies before the first
  // pending SET), and repeats; then reads again. Returns early while an async write is in
  // flight (its completion calls Process again), and while the budget is spent on pending
  // SETs (their completion does).
  void Process();

  // Closes a connection whose buffered partial command has not completed within
  // options.frame_timeout_ms (a slow client), checked while bytes stay buffered and the
  // connection waits to read more.
  void ArmTimer();

  // ---- Replies (resp_session_write.cc) ----

  // Bytes of the pending reply that may be written now: everything before the first pending
  // SET's reply; the GET segments inside them, and all their bytes.
  size_t ready_text() const { return holds_.empty() ? out_.size() : holds_.front().text_pos; }
  size_t ready_bodies() const;
  size_t ready_bytes() const;

  // Appends to *iov the reply text and its segments, skipping the first skip bytes.
  static void Gather(std::string_view text, std::span<const Body> bodies, size_t skip,
                     std::vector<asio::const_buffer>* iov);

  // Takes the first `text` bytes of out_ and the first `nbodies` bodies out of the pending
  // reply into *wtext / *wbodies (appended), re-basing what stays.
  void TakeReady(size_t text, size_t nbodies, std::string* wtext, std::vector<Body>* wbodies);

  // Writes the replies that are ready (ready_bytes()): one non-blocking writev, then asio's
  // async_write for whatever the socket did not take. True: all written; false: an async
  // write is in flight or the connection closed.
  bool WriteNow();

  // Empties *bodies, keeping their buffers for later GETs up to kSpareBufferBytesMax.
  void Recycle(std::vector<Body>* bodies);

  // Appends a bulk reply whose payload v lies inside raw_: small payloads are copied into
  // the reply text, large ones become a segment (raw_ moves into it and is replaced by a
  // spare buffer).
  void AppendValue(std::span<const uint8_t> v);

  // ---- Writes completed asynchronously (durability sync: RespDurableSets; resp_session_sets.cc)
  //
  // Plain SETs, MSETs and DELs run one after another without waiting for each other (they
  // share commits; an MSET's keys are one group that one commit completes; a DEL's removals are
  // made when it runs and only their commit is waited for); any other command waits until the
  // writes before it have completed (Stall), so that it sees their effects (a GET after a SET
  // of this connection reads the new value) and its reply follows theirs. A DEL runs ahead of
  // pending SETs only when none of them is still with the put thread (thread_sets_ == 0): its
  // removals are made on this thread, so every earlier SET must have been put already.

  // Whether this command (upper-case name cmd) would be a SET, MSET or DEL/UNLINK completed
  // asynchronously.
  bool AsyncWrite(const std::string& cmd, const std::vector<std::string_view>& a) const;
  // This session's writes may complete asynchronously (durability sync, a tenant, no MULTI
  // queuing or EXEC): AsyncWrite's part that does not depend on the command.
  bool AsyncWritable() const;

  // Keeps a copy of the command (argv views into the parser's buffer do not survive reads)
  // to run once no SET is pending; counted in Account().
  void Stall(const std::vector<std::string_view>& a);
  void RunStalled();

  // Hands a staged SET over; its reply is held at the current end of the reply text. The SET
  // is put on this thread unless an earlier SET of this connection is still with the put
  // thread (RespDurableSets::Submit keeps one caller's puts in order only then).
  void SubmitSet(std::unique_ptr<RespSetJob> job, uint64_t start_us);
  // The same for the staged SETs of one MSET (in order), with one reply held for all of them.
  void SubmitMset(std::vector<std::unique_ptr<RespSetJob>> jobs, uint64_t start_us);
  // Removes the keys of a DEL/UNLINK (a[1..]) now and, when a commit must make that durable,
  // holds its count until it is (RespDurableSets::SubmitRemovals); otherwise answers at once.
  StatusCode SubmitDel(const std::string& cmd, const std::vector<std::string_view>& a);
  // SubmitSet's parts: a new hold at the current end of the reply text (its id), whose reply
  // is ok_reply when it succeeds, and the done that resolves it (taking the running command's
  // in-flight slot).
  uint64_t AddHold(uint64_t charged_bytes, uint64_t start_us, Op op, std::string_view ok_reply);
  RespDurableSets::Done HoldDone(uint64_t id, std::string_view ok_reply);
  // After a Submit: whether it went to the put thread (the hold is still the last one).
  void SubmittedVia(bool put_here);

  // ---- A lone pending SET's reply, written by its commit (the way back without a hand-off) ----
  //
  // When a pending SET's reply is the next thing this connection writes (nothing before it
  // unwritten, no write in flight), the strand arms it (direct_id_); the commit thread that
  // completes it writes "+OK" to the socket itself (DirectReply), without waiting for this
  // strand, and SetDone then only does the bookkeeping. Order holds because the strand writes
  // nothing past a pending SET (ready_bytes()), at most one SET is armed at a time, and the
  // SETs before an armed one are either none or SETs whose "+OK" DirectReply wrote in full
  // (sent_through_; their SetDone may not have run yet, as when a client's next SET arrives
  // before it). An error reply, or a write the socket does not take, goes the usual way (the
  // bytes written are skipped).

  // On the strand: arms the first pending SET not yet answered on the wire when its reply is
  // next there.
  void ArmDirect();

  // On the commit thread, for a write that succeeded: writes its reply (the hold's ok_reply)
  // if it is armed (once). Returns the bytes written (0: SetDone writes the reply).
  size_t DirectReply(uint64_t id, std::string_view reply);

  // A pending SET finished (sent_bytes of its reply already written by DirectReply): resolves
  // the replies that are now complete, in order, and lets Process write them (and read on,
  // when the budget was spent on pending SETs).
  void SetDone(uint64_t id, const Status& st, size_t sent_bytes);

  // ---- Commands (resp_session_commands.cc) ----

  // Runs one command (argv[0] its name, any case), appending its reply; a command other than
  // a plain SET, MSET or DEL waits (Stall) while writes of this connection are pending.
  void Execute(const std::vector<std::string_view>& argv);

  // ---- MULTI / EXEC / DISCARD (resp_transaction.h) ----

  // A command other than AUTH, HELLO and QUIT before authentication (auth on): refused, after
  // the checks Redis makes first, in its order (the name, its argument count, a subcommand's
  // name and count), so every error a client sees before AUTH is Redis's.
  StatusCode Unauthenticated(const std::string& cmd, const std::vector<std::string_view>& a);
  StatusCode Transaction(const std::string& cmd, const std::vector<std::string_view>& a);

  // A command after MULTI: checked like Redis does at queue time (known command, argument
  // count) and queued; an error flags the transaction (EXEC answers EXECABORT).
  StatusCode QueueCommand(const std::string& cmd, const std::vector<std::string_view>& a);

  // Runs the next command of the EXEC in progress (its reply is one element of EXEC's array).
  void RunQueued();

  StatusCode UnknownCommand(const std::vector<std::string_view>& a);

  void Null();

  internal::RespKeyspaceContext Keyspace();

  // CLIENT and CONFIG (resp::HasSubcommands): the subcommand named by a[1], or Redis's
  // refusal of it.
  StatusCode Subcommand(const std::string& cmd, const std::vector<std::string_view>& a);

  StatusCode WrongArgs(const std::string& cmd);

  StatusCode StoreError(const Status& st);
  static void StoreErrorText(const Status& st, std::string* out);

  StatusCode Authenticate(std::string_view token);

  StatusCode AuthError(StatusCode c);

  StatusCode Connection(const std::string& cmd, const std::vector<std::string_view>& a);

  // SET key value [options]: a plain SET (or one with only EX/PX) is written at once; NX, XX,
  // GET and KEEPTTL need the current value (resp_keyspace.h).
  StatusCode Set(const std::vector<std::string_view>& a);

  StatusCode Data(const std::string& cmd, const std::vector<std::string_view>& a);

  // ---- MGET under the reply budget ----
  //
  // An MGET answers its keys while the pending replies stay under max_pending_bytes_; the
  // keys left then are copied (mget_keys_) and answered by ContinueMget, which Process runs
  // before anything else of this connection once the replies before them are written. So
  // one MGET's reply holds at most the budget and one value however many keys it names (an
  // MGET of one 1 MiB key 65,535 times used to build 64 GiB in one go).

  // Appends the reply element of one key (its value, or a null).
  void MgetOne(std::string_view key);
  // Answers the MGET's next keys while the budget allows; records the request when done.
  void ContinueMget();

  // ---- State ----

  Shared* shared_;
  std::shared_ptr<ConnectionCount> count_;  // released when the session is destroyed
  // Every handler runs on strand_ (bound explicitly).
  asio::strand<asio::io_context::executor_type> strand_;
  GenericSocket sock_;  // TCP, or the plaintext end of a TLS relay (no_delay fails there)
  asio::steady_timer timer_;
  MemoryGate memory_;  // reads paused by the daemon-wide budget
  IdleWatch idle_;
  AuthDeadline auth_deadline_;  // armed while unauthenticated with auth on
  resp::RespParser parser_;
  const size_t max_pending_bytes_;  // replies buffered before parsing stops and they are written
  uint64_t charged_bytes_ = 0;      // what this connection counts in shared_->memory
  std::vector<std::string_view> argv_;  // views into parser_'s buffer
  // Pending replies: out_ is the text; each Body is a GET value written after
  // out_[previous text_end, text_end). wbuf_ / wbodies_ are the ones an async write holds.
  std::string out_, wbuf_;
  std::vector<Body> bodies_, wbodies_;
  size_t body_bytes_ = 0;             // payload bytes in bodies_
  std::deque<Hold> holds_;            // pending SETs' replies, in request order
  size_t thread_sets_ = 0;            // holds_ with via_thread
  uint64_t armed_id_ = kNoHold;       // the hold ArmDirect last armed (strand's copy)
  std::mutex direct_mu_;              // guards direct_id_, sent_through_, DirectReply's writes
  uint64_t direct_id_ = kNoHold;      // the hold whose reply its commit may write
  uint64_t sent_through_ = kNoHold;   // the last hold whose reply DirectReply wrote in full
  int fd_ = -1;                       // sock_'s descriptor (DirectReply)
  uint64_t next_hold_id_ = 0;         // id of the next Hold
  size_t hold_bytes_ = 0;             // sum of holds_' charged_bytes
  InflightSlot slot_;                 // the running command's tenant in-flight slot
  uint64_t set_start_us_ = 0;         // the running command's start
  bool deferred_ = false;             // the running command completes asynchronously
  std::vector<std::string> stalled_;  // a command waiting for the pending SETs (Stall)
  size_t stalled_bytes_ = 0;
  std::vector<std::string> mget_keys_;       // an MGET's keys ContinueMget answers (empty: none)
  size_t mget_next_ = 0;                     // the next of them
  size_t mget_keys_bytes_ = 0;               // their bytes, counted in Account()
  uint64_t mget_start_us_ = 0;               // the MGET's start, for its latency
  InflightSlot mget_slot_;                   // its tenant in-flight slot, held until it is done
  std::vector<std::vector<uint8_t>> spare_;  // recycled GET buffers
  size_t spare_bytes_ = 0;                   // sum of spare_ capacities
  std::vector<uint8_t> raw_;                 // the buffer the next GET is read into
  std::vector<asio::const_buffer> iov_;
  RespKeyCache keys_;
  resp::RespTransaction txn_;                // MULTI ... EXEC
  size_t exec_next_ = 0;                     // the next queued command EXEC runs
  std::vector<std::string_view> exec_argv_;  // views into txn_
  int proto_ = 2;                            // RESP version (HELLO 2 / HELLO 3)
  const Tenant* tenant_ = nullptr;
  uint64_t id_ = 0;
  uint64_t commands_ = 0;
  uint64_t clock_us_ = 0;  // steady clock at the end of the last command (or batch start)
  int auth_failures_ = 0;
  bool reading_ = false, writing_ = false, closed_ = false, quit_ = false, timer_armed_ = false;
  std::atomic<bool> busy_{false};
};

}  // namespace kvtier::daemon::internal
