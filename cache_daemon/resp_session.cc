// The RESP (Redis protocol) connection. Commands run in arrival order on the connection's
// strand; replies are written in the same order, so pipelining (redis-benchmark -P) works.
//
// Hot path (docs/performance/daemon.md "## Daemon"): the socket is read straight into the parser's
// buffer and commands are parsed as views into it; every reply of one read's worth of
// pipelined commands is gathered and written with one writev, tried at once on the
// non-blocking socket (asio's async_write only takes over when the socket buffer is full).
// GET values of kScatterMinBytes or more are not copied into the reply text: the buffer the
// store filled is kept as a segment of that writev and recycled afterwards.
#include <sys/socket.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <chrono>
#include <deque>
#include <memory>
#include <span>

#include "cache_daemon/daemon_internal.h"
#include "cache_daemon/resp.h"
#include "cache_daemon/resp_commands.h"
#include "cache_daemon/resp_keyspace.h"
#include "cache_daemon/resp_transaction.h"
#include "common/clock.h"
#include "common/logging.h"

namespace kvtier::daemon::internal {
namespace {

using Tcp = asio::ip::tcp;
using GenericSocket = asio::generic::stream_protocol::socket;
using namespace std::string_view_literals;
constexpr size_t kReadChunkBytes = 256 * 1024;
// Reply bytes (text and GET value segments together) buffered before the connection stops
// parsing and writes them out.
constexpr size_t kMaxPendingReplyBytes = 8u << 20;
// GET values at least this large are written from the store's buffer instead of being copied.
constexpr size_t kScatterMinBytes = 16u << 10;
// Recycled GET buffers kept per connection (sum of capacities).
constexpr size_t kSpareBufferBytesMax = 2u << 20;
constexpr int kMaxAuthFailures = 3;
// SETs of one connection pending at once (durability sync: RespDurableSets). Each also counts
// its stored bytes plus kHoldOverheadBytes against the connection's reply budget.
constexpr size_t kPendingSetsMax = 1024;
constexpr size_t kHoldOverheadBytes = 256;
// No pending SET's reply may be written by its commit (RespSession::direct_id_).
constexpr uint64_t kNoHold = ~uint64_t{0};
constexpr std::string_view kOkReply = "+OK\r\n";

std::string Upper(std::string_view s) {
  std::string u(s);
  for (char& c : u) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return u;
}

bool ParseI64(std::string_view s, int64_t* out) {
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size();
}

// A GET value written from the buffer the store filled: bytes[offset...] follow the reply
// text up to text_end.
struct Body {
  size_t text_end = 0;
  std::vector<uint8_t> bytes;
  size_t offset = 0;
};

// The reply of a SET still pending (RespDurableSets): it goes at text_pos of the reply text,
// and nothing from there on is written before it.
struct Hold {
  uint64_t id = 0;
  size_t text_pos = 0;
  uint64_t charged_bytes = 0;  // counted in pending_bytes() until it resolves
  uint64_t start_us = 0;       // the SET's start, for its latency
  bool via_thread = false;     // handed to the put thread (RespDurableSets::Submit)
  bool done = false;
  Status result;
  size_t sent_bytes = 0;  // of its reply, already written by the commit thread (DirectReply)
};

class RespSession : public Session, public std::enable_shared_from_this<RespSession> {
 public:
  RespSession(Shared* shared, GenericSocket socket)
      : shared_(shared),
        strand_(asio::make_strand(*shared->io)),
        sock_(std::move(socket)),
        timer_(strand_),
        memory_(strand_),
        idle_(strand_, shared->options->idle_timeout_ms),
        parser_(resp::RespLimits{.max_args = shared->options->resp_max_args,
                                 .max_bulk_bytes = shared->options->storage.max_value_bytes,
                                 .max_inline_bytes = 64u << 10,
                                 .max_command_bytes = shared->options->resp_command_bytes_max}),
        max_pending_bytes_(
            std::min<uint64_t>(kMaxPendingReplyBytes, shared->options->reply_queue_bytes_max)),
        txn_(resp::RespTransaction::Limits{.commands_max = shared->options->resp_multi_commands_max,
                                           .bytes_max = shared->options->resp_multi_bytes_max}) {
    tenant_ = shared_->tenants->default_tenant();
    SetCommandLimit();
  }
  ~RespSession() override {
    shared_->ReleaseTenantConnection(tenant_);
    shared_->memory->Adjust(&charged_bytes_, 0);
    shared_->front_open[static_cast<size_t>(Front::kResp)].fetch_sub(1);
    shared_->metrics->connections_open.fetch_sub(1);
  }

  asio::strand<asio::io_context::executor_type>& executor() { return strand_; }
  void Begin() {
    id_ = shared_->Register(shared_from_this());
    boost::system::error_code ec;
    sock_.set_option(Tcp::no_delay(true), ec);
    // Replies are first written with a synchronous write_some (WriteNow), which must not block.
    sock_.non_blocking(true, ec);
    if (ec) return DoClose();
    fd_ = sock_.native_handle();
    idle_.Arm(
        // Not idle: SETs pending, or reads held by the daemon-wide budget.
        IdleWatch::NowMs(), shared_from_this(),
        [this] { return !holds_.empty() || HeldByMemoryGate(); },
        [this] {
          if (closed_) return;
          shared_->metrics->Refuse(Refusal::kIdle);
          DoClose();
        });
    Read();
  }
  void Close() override {
    asio::post(strand_, [self = shared_from_this()] { self->DoClose(); });
  }
  bool Busy() const override { return busy_.load(); }

 private:
  void DoClose() {
    if (closed_) return;
    closed_ = true;
    {
      // No commit writes to the descriptor once it is closed (its number may be reused).
      std::lock_guard<std::mutex> lock(direct_mu_);
      direct_id_ = kNoHold;
    }
    boost::system::error_code ec;
    timer_.cancel();
    memory_.Cancel();
    idle_.Cancel();
    sock_.shutdown(asio::socket_base::shutdown_both, ec);
    sock_.close(ec);
    shared_->Unregister(id_);
  }

  // Before authentication (auth on) a command may be no larger than a pre-auth frame.
  void SetCommandLimit() {
    parser_.set_max_command_bytes(tenant_ == nullptr ? shared_->options->preauth_frame_bytes_max
                                                     : shared_->options->resp_command_bytes_max);
  }

  // Reports what this connection holds to the daemon-wide budget.
  void Account() {
    uint64_t held = parser_.capacity_bytes() + pending_bytes() + wbuf_.size() + spare_bytes_ +
                    txn_.held_bytes() + stalled_bytes_;
    for (const Body& b : wbodies_) held += b.bytes.size();
    shared_->memory->Adjust(&charged_bytes_, held);
  }

  void Read() {
    if (closed_ || reading_) return;
    if (shared_->draining.load() || quit_) {
      // Pending SETs are answered first: their completion runs Process, which comes back.
      if (holds_.empty()) DoClose();
      return;
    }
    Account();
    const bool was_held = HeldByMemoryGate();
    if (!memory_.AllowsRead(shared_, [self = shared_from_this()] { self->Read(); })) return;
    // The watch sees a hold only when its deadline passes: the idle clock starts when the
    // hold ends (as in native_session.cc).
    if (was_held) idle_.Touch(IdleWatch::NowMs());
    reading_ = true;
    // Wait for readability, then read without blocking: after a reply the next request has
    // usually not arrived yet, so asio's speculative recv in async_read_some would mostly
    // fail with EAGAIN, one wasted syscall per round trip.
    sock_.async_wait(
        GenericSocket::wait_read,
        asio::bind_executor(strand_, [self = shared_from_this()](boost::system::error_code ec) {
          self->reading_ = false;
          if (ec || self->closed_) return self->DoClose();
          self->ReadReady();
        }));
  }

  void ReadReady() {
    std::span<uint8_t> dst = parser_.PrepareWrite(kReadChunkBytes);
    boost::system::error_code ec;
    size_t n = sock_.read_some(asio::buffer(dst.data(), dst.size()), ec);
    if (ec == asio::error::would_block || ec == asio::error::try_again) return Read();
    if (ec) return DoClose();  // includes EOF
    shared_->metrics->AddBytes(true, n);
    idle_.Touch(IdleWatch::NowMs());
    parser_.Commit(n);
    Process();
  }

  size_t pending_bytes() const { return out_.size() + body_bytes_ + hold_bytes_; }
  // Reads are paused by the daemon-wide budget while nothing is left for the client to read:
  // the daemon, not the client, is holding the connection up, so it is not idle.
  bool HeldByMemoryGate() const {
    return memory_.paused() && pending_bytes() == 0 && wbuf_.empty();
  }

  // Runs buffered commands until the pending replies reach kMaxPendingReplyBytes (or
  // kPendingSetsMax SETs are pending), writes what is ready (the replies before the first
  // pending SET), and repeats; then reads again. Returns early while an async write is in
  // flight (its completion calls Process again), and while the budget is spent on pending
  // SETs (their completion does).
  void Process() {
    for (;;) {
      if (closed_) return;
      busy_.store(true);
      bool fatal = false;
      clock_us_ = DefaultSteadyClock().NowUs();
      while (pending_bytes() < max_pending_bytes_ && holds_.size() < kPendingSetsMax && !quit_) {
        if (!stalled_.empty()) {  // waits for the pending SETs, then runs first
          if (!holds_.empty()) break;
          RunStalled();
          continue;
        }
        if (txn_.executing()) {  // EXEC runs before any later command of this connection
          RunQueued();
          continue;
        }
        StatusOr<bool> got = parser_.Next(&argv_);
        if (!got.ok()) {
          shared_->metrics->protocol_errors.fetch_add(1);
          if (got.status().IsRejected()) shared_->metrics->Refuse(Refusal::kRespCommand);
          resp::AppendError("ERR " + got.status().message(), &out_);
          fatal = true;
          break;
        }
        if (!*got) break;
        if (argv_.empty()) continue;
        ++commands_;
        Execute(argv_);
        SetCommandLimit();
      }
      if (fatal) quit_ = true;
      if (writing_) return;  // the write's completion comes back here
      if (ready_bytes() > 0) {
        if (!WriteNow()) return;
        continue;
      }
      ArmDirect();
      if (pending_bytes() == 0) {
        busy_.store(false);
        if (quit_) return DoClose();
      }
      // Pending SETs (if any) come back here when they complete; meanwhile later commands
      // are read and run while the budget allows.
      if (pending_bytes() >= max_pending_bytes_ || holds_.size() >= kPendingSetsMax ||
          !stalled_.empty()) {
        return;
      }
      if (parser_.buffered_bytes() > 0) ArmTimer();
      Read();
      return;
    }
  }

  // Bytes of the pending reply that may be written now: everything before the first pending
  // SET's reply.
  size_t ready_text() const { return holds_.empty() ? out_.size() : holds_.front().text_pos; }
  size_t ready_bodies() const {
    size_t limit = ready_text(), n = 0;
    while (n < bodies_.size() && bodies_[n].text_end <= limit) ++n;
    return n;
  }
  size_t ready_bytes() const {
    size_t n = ready_text();
    for (size_t i = 0, k = ready_bodies(); i < k; ++i)
      n += bodies_[i].bytes.size() - bodies_[i].offset;
    return n;
  }

  // ---- SETs completed asynchronously (durability sync: RespDurableSets) ----
  //
  // Plain SETs run one after another without waiting for each other (they share commits);
  // any other command waits until the SETs before it have completed (Stall), so that it
  // sees their effects (a GET after a SET of this connection reads the new value, a DEL
  // after it deletes it) and its reply follows theirs.

  // Whether this command (upper-case name cmd) would be a SET completed asynchronously.
  bool AsyncSet(const std::string& cmd, const std::vector<std::string_view>& a) const {
    if (shared_->durable_sets == nullptr || tenant_ == nullptr || cmd != "SET"sv || a.size() < 3 ||
        txn_.queuing() || txn_.executing()) {
      return false;
    }
    if (a.size() == 3) return true;
    StatusOr<resp::SetOptions> o =
        resp::ParseSetOptions(std::span<const std::string_view>(a).subspan(3));
    return o.ok() && o->plain();
  }

  // Keeps a copy of the command (argv views into the parser's buffer do not survive reads)
  // to run once no SET is pending; counted in Account().
  void Stall(const std::vector<std::string_view>& a) {
    stalled_bytes_ = 0;
    for (std::string_view v : a) {
      stalled_.emplace_back(v);
      stalled_bytes_ += v.size() + sizeof(std::string);
    }
  }
  void RunStalled() {
    std::vector<std::string> cmd;
    cmd.swap(stalled_);
    stalled_bytes_ = 0;
    std::vector<std::string_view> views(cmd.begin(), cmd.end());
    Execute(views);
    SetCommandLimit();
  }

  // Hands a staged SET over; its reply is held at the current end of the reply text. The SET
  // is put on this thread unless an earlier SET of this connection is still with the put
  // thread (RespDurableSets::Submit keeps one caller's puts in order only then).
  void SubmitSet(std::unique_ptr<RespSetJob> job, uint64_t start_us) {
    Hold h;
    h.id = next_hold_id_++;
    h.text_pos = out_.size();
    h.charged_bytes = job->envelope.size() + job->name.size() + kHoldOverheadBytes;
    h.start_us = start_us;
    hold_bytes_ += h.charged_bytes;
    uint64_t id = h.id;
    holds_.push_back(std::move(h));
    ArmDirect();
    // The tenant's in-flight slot is the SET's until it completes, and is freed before its
    // reply can reach the client (DirectReply): a client that has every reply must not find
    // its requests still counted against the tenant's in-flight limit.
    auto slot = std::make_shared<InflightSlot>(std::move(slot_));
    bool put_here = shared_->durable_sets->Submit(
        std::move(job),
        [self = shared_from_this(), id, slot](const Status& st) -> RespDurableSets::Later {
          *slot = InflightSlot();
          size_t sent = st.ok() ? self->DirectReply(id) : 0;
          // Runs on an I/O thread (with the other SETs of the commit): the strand, when idle,
          // runs SetDone right there.
          return [self, id, st, sent] {
            asio::dispatch(self->strand_, [self, id, st, sent] { self->SetDone(id, st, sent); });
          };
        },
        /*put_here=*/thread_sets_ == 0);
    if (!put_here) {
      // SetDone runs on this strand, so the hold is still the last one.
      holds_.back().via_thread = true;
      ++thread_sets_;
    }
  }

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
  void ArmDirect() {
    if (holds_.empty() || writing_ || closed_ || ready_bytes() != 0) return;
    std::lock_guard<std::mutex> lock(direct_mu_);
    // Armed and not resolved yet (an armed SET that failed is resolved by SetDone).
    if (direct_id_ != kNoHold && direct_id_ >= holds_.front().id) return;
    // Holds up to sent_through_ (still here until their SetDone) were written in full, in
    // order: the first one after them is next on the wire if no reply text precedes it.
    const uint64_t first = holds_.front().id;
    const uint64_t skip = sent_through_ == kNoHold || sent_through_ < first
                              ? 0
                              : std::min<uint64_t>(sent_through_ - first + 1, holds_.size());
    if (skip == holds_.size()) return;
    const Hold& h = holds_[skip];
    if (h.text_pos != 0 || h.id == armed_id_) return;
    armed_id_ = h.id;
    direct_id_ = h.id;
  }

  // On the commit thread, for a SET that succeeded: writes its "+OK" if it is armed (once).
  // Returns the bytes written (0: SetDone writes the reply).
  size_t DirectReply(uint64_t id) {
    std::lock_guard<std::mutex> lock(direct_mu_);
    if (direct_id_ != id) return 0;
    direct_id_ = kNoHold;
    ssize_t n = ::send(fd_, kOkReply.data(), kOkReply.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n == static_cast<ssize_t>(kOkReply.size())) sent_through_ = id;
    return n > 0 ? static_cast<size_t>(n) : 0;
  }

  // A pending SET finished (sent_bytes of its reply already written by DirectReply): resolves
  // the replies that are now complete, in order, and lets Process write them (and read on,
  // when the budget was spent on pending SETs).
  void SetDone(uint64_t id, const Status& st, size_t sent_bytes) {
    if (holds_.empty() || id < holds_.front().id) return;
    if (id - holds_.front().id >= holds_.size()) return;
    Hold& h = holds_[id - holds_.front().id];
    h.done = true;
    h.result = st;
    h.sent_bytes = sent_bytes;
    while (!holds_.empty() && holds_.front().done) {
      Hold& f = holds_.front();
      std::string reply;
      StatusCode code = StatusCode::kOk;
      if (f.result.ok()) {
        resp::AppendSimple("OK", &reply);
      } else {
        code = f.result.code();
        StoreErrorText(f.result, &reply);
      }
      if (f.sent_bytes > 0) {
        // Only an armed SET's "+OK" is written by its commit, and the reply text is that.
        reply.erase(0, std::min(f.sent_bytes, reply.size()));
        shared_->metrics->AddBytes(false, f.sent_bytes);
        shared_->metrics->resp_durable_set_direct_replies.fetch_add(1);
        idle_.Touch(IdleWatch::NowMs());
      }
      out_.insert(f.text_pos, reply);
      for (size_t i = 1; i < holds_.size(); ++i) holds_[i].text_pos += reply.size();
      for (Body& b : bodies_) {
        if (b.text_end > f.text_pos) b.text_end += reply.size();
      }
      hold_bytes_ -= f.charged_bytes;
      if (f.via_thread) --thread_sets_;
      shared_->metrics->RecordRequest(Op::kRespSet, code,
                                      DefaultSteadyClock().NowUs() - f.start_us);
      holds_.pop_front();
    }
    if (closed_) return;
    Account();
    if (!writing_) Process();
  }

  // Appends to *iov the reply text and its segments, skipping the first skip bytes.
  static void Gather(std::string_view text, std::span<const Body> bodies, size_t skip,
                     std::vector<asio::const_buffer>* iov) {
    iov->clear();
    auto add = [&](const char* p, size_t n) {
      size_t drop = std::min(skip, n);
      skip -= drop;
      if (n > drop) iov->emplace_back(p + drop, n - drop);
    };
    size_t prev = 0;
    for (const Body& b : bodies) {
      add(text.data() + prev, b.text_end - prev);
      add(reinterpret_cast<const char*>(b.bytes.data()) + b.offset, b.bytes.size() - b.offset);
      prev = b.text_end;
    }
    add(text.data() + prev, text.size() - prev);
  }

  // Takes the first `text` bytes of out_ and the first `nbodies` bodies out of the pending
  // reply into *wtext / *wbodies (appended), re-basing what stays.
  void TakeReady(size_t text, size_t nbodies, std::string* wtext, std::vector<Body>* wbodies) {
    for (size_t i = 0; i < nbodies; ++i) {
      body_bytes_ -= bodies_[i].bytes.size() - bodies_[i].offset;
      wbodies->push_back(std::move(bodies_[i]));
    }
    bodies_.erase(bodies_.begin(), bodies_.begin() + static_cast<ptrdiff_t>(nbodies));
    if (text == out_.size()) {
      wtext->swap(out_);
      out_.clear();
    } else {
      wtext->assign(out_, 0, text);
      out_.erase(0, text);
    }
    for (Body& b : bodies_) b.text_end -= text;
    for (Hold& h : holds_) h.text_pos -= text;
  }

  // Writes the replies that are ready (ready_bytes()): one non-blocking writev, then asio's
  // async_write for whatever the socket did not take. True: all written; false: an async
  // write is in flight or the connection closed.
  bool WriteNow() {
    size_t text = ready_text(), nbodies = ready_bodies();
    size_t total = ready_bytes();
    Gather(std::string_view(out_).substr(0, text), std::span<const Body>(bodies_.data(), nbodies),
           0, &iov_);
    boost::system::error_code ec;
    size_t n = sock_.write_some(iov_, ec);
    if (ec == asio::error::would_block || ec == asio::error::try_again) {
      ec.clear();
      n = 0;
    }
    if (ec) {
      DoClose();
      return false;
    }
    shared_->metrics->AddBytes(false, n);
    if (n > 0) idle_.Touch(IdleWatch::NowMs());
    wbuf_.clear();
    TakeReady(text, nbodies, &wbuf_, &wbodies_);
    if (n == total) {
      wbuf_.clear();
      Recycle(&wbodies_);
      return true;
    }
    Account();
    Gather(wbuf_, wbodies_, n, &iov_);
    writing_ = true;
    asio::async_write(sock_, iov_,
                      asio::bind_executor(strand_, [self = shared_from_this()](
                                                       boost::system::error_code ec, size_t n) {
                        self->writing_ = false;
                        self->shared_->metrics->AddBytes(false, n);
                        self->idle_.Touch(IdleWatch::NowMs());
                        self->wbuf_.clear();
                        self->Recycle(&self->wbodies_);
                        if (ec) return self->DoClose();
                        // Commands may still be buffered (we stopped at the reply limit),
                        // and replies may have become ready meanwhile.
                        self->Process();
                      }));
    return false;
  }

  // Empties *bodies, keeping their buffers for later GETs up to kSpareBufferBytesMax.
  void Recycle(std::vector<Body>* bodies) {
    for (Body& b : *bodies) {
      if (spare_bytes_ + b.bytes.capacity() <= kSpareBufferBytesMax) {
        spare_bytes_ += b.bytes.capacity();
        spare_.push_back(std::move(b.bytes));
      }
    }
    bodies->clear();
  }

  // Appends a bulk reply whose payload v lies inside raw_: small payloads are copied into
  // the reply text, large ones become a segment (raw_ moves into it and is replaced by a
  // spare buffer).
  void AppendValue(std::span<const uint8_t> v) {
    if (v.size() < kScatterMinBytes) {
      resp::AppendBulk(std::string_view(reinterpret_cast<const char*>(v.data()), v.size()), &out_);
      return;
    }
    resp::AppendBulkHeader(v.size(), &out_);
    size_t offset = static_cast<size_t>(v.data() - raw_.data());
    bodies_.push_back(Body{out_.size(), std::move(raw_), offset});
    body_bytes_ += v.size();
    raw_.clear();
    if (!spare_.empty()) {
      raw_ = std::move(spare_.back());
      spare_.pop_back();
      spare_bytes_ -= raw_.capacity();
    }
    out_.append("\r\n");
  }

  void ArmTimer() {
    if (timer_armed_ || closed_) return;
    timer_armed_ = true;
    uint64_t stamp = commands_;
    timer_.expires_after(std::chrono::milliseconds(shared_->options->frame_timeout_ms));
    timer_.async_wait(asio::bind_executor(
        strand_, [self = shared_from_this(), stamp](boost::system::error_code ec) {
          self->timer_armed_ = false;
          if (ec || self->closed_) return;
          if (self->parser_.buffered_bytes() > 0 && self->commands_ == stamp) {
            self->shared_->metrics->slow_client_disconnects.fetch_add(1);
            return self->DoClose();
          }
          if (self->parser_.buffered_bytes() > 0) self->ArmTimer();
        }));
  }

  void Execute(const std::vector<std::string_view>& argv) {
    std::string cmd = Upper(argv[0]);
    if (!holds_.empty() && !AsyncSet(cmd, argv)) return Stall(argv);
    // One clock read per command: a command's latency runs from the end of the previous one
    // in the same batch (which adds only this command's parse time), or from the batch start.
    uint64_t start_us = clock_us_;
    Op op = Op::kRespOther;
    StatusCode code = StatusCode::kOk;
    if (cmd == "GET"sv)
      op = Op::kRespGet;
    else if (cmd == "SET"sv)
      op = Op::kRespSet;
    else if (cmd == "MGET"sv)
      op = Op::kRespMget;
    else if (cmd == "MSET"sv)
      op = Op::kRespMset;
    else if (cmd == "DEL"sv)
      op = Op::kRespDel;
    else if (cmd == "EXISTS"sv)
      op = Op::kRespExists;
    else if (cmd == "EXPIRE"sv || cmd == "PEXPIRE"sv)
      op = Op::kRespExpire;
    else if (cmd == "TTL"sv || cmd == "PTTL"sv)
      op = Op::kRespTtl;
    if (cmd == "MULTI"sv || cmd == "EXEC"sv || cmd == "DISCARD"sv) {
      code = Transaction(cmd, argv);
    } else if (txn_.queuing() && cmd != "QUIT"sv) {
      op = Op::kRespOther;  // counted under its own op when EXEC runs it
      code = QueueCommand(cmd, argv);
    } else if (cmd == "PING"sv || cmd == "QUIT"sv || cmd == "AUTH"sv || cmd == "HELLO"sv) {
      code = Connection(cmd, argv);
    } else if (tenant_ == nullptr) {
      resp::AppendError("NOAUTH Authentication required.", &out_);
      code = StatusCode::kPermissionDenied;
    } else {
      StatusOr<InflightSlot> slot = AcquireInflight(*tenant_);
      if (!slot.ok()) {
        shared_->metrics->tenant_inflight_rejections.fetch_add(1);
        resp::AppendError("ERR tenant in-flight request limit reached", &out_);
        code = StatusCode::kRejected;
      } else {
        slot_ = std::move(slot).value();  // a SET completed asynchronously keeps it
        set_start_us_ = start_us;
        code = Data(cmd, argv);
        slot_ = InflightSlot();
      }
    }
    clock_us_ = DefaultSteadyClock().NowUs();
    if (deferred_) {
      deferred_ = false;  // recorded when it completes (SetDone)
      return;
    }
    shared_->metrics->RecordRequest(op, code, clock_us_ - start_us);
  }

  // ---- MULTI / EXEC / DISCARD (resp_transaction.h) ----

  StatusCode Transaction(const std::string& cmd, const std::vector<std::string_view>& a) {
    if (tenant_ == nullptr) {
      resp::AppendError("NOAUTH Authentication required.", &out_);
      return StatusCode::kPermissionDenied;
    }
    if (a.size() != 1) return WrongArgs(cmd);
    if (cmd == "MULTI"sv) {
      if (txn_.queuing()) {
        resp::AppendError("ERR MULTI calls can not be nested", &out_);
        return StatusCode::kInvalidArgument;
      }
      txn_.Begin();
      resp::AppendSimple("OK", &out_);
      return StatusCode::kOk;
    }
    if (!txn_.queuing()) {
      resp::AppendError("ERR " + cmd + " without MULTI", &out_);
      return StatusCode::kInvalidArgument;
    }
    if (cmd == "DISCARD"sv) {
      txn_.Finish();
      resp::AppendSimple("OK", &out_);
      return StatusCode::kOk;
    }
    bool aborted = false;
    size_t n = txn_.StartExec(&aborted);
    if (aborted) {
      resp::AppendError("EXECABORT Transaction discarded because of previous errors.", &out_);
      return StatusCode::kInvalidArgument;
    }
    resp::AppendArrayHeader(n, &out_);
    exec_next_ = 0;
    if (n == 0) txn_.Finish();
    return StatusCode::kOk;
  }

  // A command after MULTI: checked like Redis does at queue time (known command, argument
  // count) and queued; an error flags the transaction (EXEC answers EXECABORT).
  StatusCode QueueCommand(const std::string& cmd, const std::vector<std::string_view>& a) {
    int arity = resp::CommandArity(cmd);
    if (arity == 0) {
      txn_.Flag();
      return UnknownCommand(a);
    }
    if (!resp::ArityAllows(arity, a.size())) {
      txn_.Flag();
      return WrongArgs(cmd);
    }
    if (cmd == "AUTH"sv || cmd == "HELLO"sv) {
      txn_.Flag();
      resp::AppendError("ERR Command not allowed inside a transaction", &out_);
      return StatusCode::kInvalidArgument;
    }
    Status st = txn_.Queue(a);
    if (!st.ok()) {
      shared_->metrics->Refuse(Refusal::kRespMulti);
      resp::AppendError("ERR " + st.message(), &out_);
      return st.code();
    }
    resp::AppendSimple("QUEUED", &out_);
    return StatusCode::kOk;
  }

  // Runs the next command of the EXEC in progress (its reply is one element of EXEC's array).
  void RunQueued() {
    txn_.Command(exec_next_++, &exec_argv_);
    Execute(exec_argv_);
    if (exec_next_ == txn_.size()) txn_.Finish();
  }

  StatusCode UnknownCommand(const std::vector<std::string_view>& a) {
    std::string shown(a[0].substr(0, 128));
    resp::AppendError("ERR unknown command '" + shown + "', with args beginning with: ", &out_);
    return StatusCode::kInvalidArgument;
  }

  void Null() {
    if (proto_ == 3)
      resp::AppendNull3(&out_);
    else
      resp::AppendNull(&out_);
  }

  internal::RespKeyspaceContext Keyspace() {
    return {shared_->service, tenant_, shared_->options, shared_->metrics, proto_, &out_};
  }

  StatusCode WrongArgs(const std::string& cmd) {
    std::string lower = cmd;
    for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    resp::AppendError("ERR wrong number of arguments for '" + lower + "' command", &out_);
    return StatusCode::kInvalidArgument;
  }

  StatusCode StoreError(const Status& st) {
    StoreErrorText(st, &out_);
    return st.code();
  }
  static void StoreErrorText(const Status& st, std::string* out) {
    if (st.IsRejected()) {
      resp::AppendError("OOM command not allowed: " + st.message(), out);
    } else {
      resp::AppendError("ERR " + st.ToString(), out);
    }
  }

  StatusCode Authenticate(std::string_view token) {
    StatusOr<const Tenant*> t = shared_->tenants->Authenticate(token);
    if (!t.ok()) {
      shared_->metrics->auth_failures.fetch_add(1);
      if (++auth_failures_ >= kMaxAuthFailures) quit_ = true;
      return StatusCode::kPermissionDenied;
    }
    if (*t != tenant_) {
      if (!shared_->AcquireTenantConnection(*t)) return StatusCode::kRejected;
      shared_->ReleaseTenantConnection(tenant_);
    }
    tenant_ = *t;
    return StatusCode::kOk;
  }

  StatusCode AuthError(StatusCode c) {
    if (c == StatusCode::kRejected) {
      resp::AppendError("ERR max number of clients reached (limits.tenant_connections_max)", &out_);
    } else {
      resp::AppendError("WRONGPASS invalid username-password pair or user is disabled.", &out_);
    }
    return c;
  }

  StatusCode Connection(const std::string& cmd, const std::vector<std::string_view>& a) {
    if (cmd == "PING"sv) {
      if (a.size() > 2) return WrongArgs(cmd);
      if (a.size() == 2)
        resp::AppendBulk(a[1], &out_);
      else
        resp::AppendSimple("PONG", &out_);
      return StatusCode::kOk;
    }
    if (cmd == "QUIT"sv) {
      resp::AppendSimple("OK", &out_);
      quit_ = true;
      return StatusCode::kOk;
    }
    if (cmd == "AUTH"sv) {
      if (a.size() != 2 && a.size() != 3) return WrongArgs(cmd);
      if (!shared_->tenants->auth_enabled()) {
        resp::AppendError(
            "ERR AUTH <password> called without any password configured for the default user. "
            "Are you sure your configuration is correct?",
            &out_);
        return StatusCode::kInvalidArgument;
      }
      StatusCode c = Authenticate(a.back());
      if (c != StatusCode::kOk) return AuthError(c);
      resp::AppendSimple("OK", &out_);
      return StatusCode::kOk;
    }
    // HELLO [protover [AUTH username password] [SETNAME clientname]]
    size_t i = 1;
    int proto = proto_;
    if (a.size() > 1) {
      int64_t ver = 0;
      if (!ParseI64(a[1], &ver)) {
        resp::AppendError("ERR Protocol version is not an integer or out of range", &out_);
        return StatusCode::kInvalidArgument;
      }
      if (ver != 2 && ver != 3) {
        resp::AppendError("NOPROTO unsupported protocol version", &out_);
        return StatusCode::kInvalidArgument;
      }
      proto = static_cast<int>(ver);
      i = 2;
    }
    for (; i < a.size(); ++i) {
      std::string opt = Upper(a[i]);
      if (opt == "AUTH"sv && i + 2 < a.size()) {
        if (shared_->tenants->auth_enabled()) {
          StatusCode c = Authenticate(a[i + 2]);
          if (c != StatusCode::kOk) return AuthError(c);
        }
        i += 2;
      } else if (opt == "SETNAME"sv && i + 1 < a.size()) {
        i += 1;
      } else {
        resp::AppendError("ERR Syntax error in HELLO option '" + std::string(a[i]) + "'", &out_);
        return StatusCode::kInvalidArgument;
      }
    }
    if (tenant_ == nullptr) {
      resp::AppendError(
          "NOAUTH HELLO must be called with the client already authenticated, "
          "otherwise the HELLO <proto> AUTH <user> <pass> option can be used",
          &out_);
      return StatusCode::kPermissionDenied;
    }
    proto_ = proto;  // only once the HELLO succeeded, as Redis
    if (proto_ == 3)
      resp::AppendMapHeader(7, &out_);
    else
      resp::AppendArrayHeader(14, &out_);
    const std::pair<const char*, std::string> fields[] = {
        {"server", "kvtier"},   {"version", "7.0.0"}, {"proto", ""},  {"id", ""},
        {"mode", "standalone"}, {"role", "master"},   {"modules", ""}};
    for (const auto& [k, v] : fields) {
      resp::AppendBulk(k, &out_);
      if (std::string_view(k) == "proto")
        resp::AppendInteger(proto_, &out_);
      else if (std::string_view(k) == "id")
        resp::AppendInteger(static_cast<int64_t>(id_), &out_);
      else if (std::string_view(k) == "modules")
        resp::AppendArrayHeader(0, &out_);
      else
        resp::AppendBulk(v, &out_);
    }
    return StatusCode::kOk;
  }

  // SET key value [options]: a plain SET (or one with only EX/PX) is written at once; NX, XX,
  // GET and KEEPTTL need the current value (resp_keyspace.h).
  StatusCode Set(const std::vector<std::string_view>& a) {
    uint64_t ttl_ms = 0;
    if (a.size() > 3) {
      StatusOr<resp::SetOptions> o =
          resp::ParseSetOptions(std::span<const std::string_view>(a).subspan(3));
      if (!o.ok()) {
        resp::AppendError(o.status().message(), &out_);
        return StatusCode::kInvalidArgument;
      }
      if (!o->plain()) return internal::RunRespConditionalSet(Keyspace(), a, *o);
      ttl_ms = o->ttl_ms;
    }
    // Under sync the SET completes asynchronously (sharing commits with every SET pending),
    // except inside EXEC, whose reply array is built in one go.
    if (AsyncSet("SET", a)) {
      auto job = std::make_unique<RespSetJob>();
      Status st = shared_->service->RespSetStage(*tenant_, a[1], a[2], ttl_ms, &keys_, job.get());
      if (!st.ok()) return StoreError(st);
      SubmitSet(std::move(job), set_start_us_);
      deferred_ = true;
      return StatusCode::kOk;
    }
    Status st = shared_->service->RespSet(*tenant_, a[1], a[2], ttl_ms, &keys_);
    if (!st.ok()) return StoreError(st);
    resp::AppendSimple("OK", &out_);
    return StatusCode::kOk;
  }

  StatusCode Data(const std::string& cmd, const std::vector<std::string_view>& a) {
    Service* svc = shared_->service;
    const Tenant& t = *tenant_;
    if (cmd == "GET"sv) {
      if (a.size() != 2) return WrongArgs(cmd);
      std::span<const uint8_t> v;
      Status st = svc->RespGetRaw(t, a[1], &raw_, &v, &keys_);
      if (st.IsNotFound()) {
        Null();
        return StatusCode::kNotFound;
      }
      if (!st.ok()) return StoreError(st);
      AppendValue(v);
      return StatusCode::kOk;
    }
    if (cmd == "SET"sv) {
      if (a.size() < 3) return WrongArgs(cmd);
      return Set(a);
    }
    if (cmd == "MGET"sv) {
      if (a.size() < 2) return WrongArgs(cmd);
      resp::AppendArrayHeader(a.size() - 1, &out_);
      std::span<const uint8_t> v;
      for (size_t i = 1; i < a.size(); ++i) {
        if (svc->RespGetRaw(t, a[i], &raw_, &v, &keys_).ok())
          AppendValue(v);
        else
          Null();
      }
      return StatusCode::kOk;
    }
    if (cmd == "MSET"sv) {
      if (a.size() < 3 || a.size() % 2 == 0) return WrongArgs(cmd);
      for (size_t i = 1; i + 1 < a.size(); i += 2) {
        Status st = svc->RespSet(t, a[i], a[i + 1], 0, &keys_);
        if (!st.ok()) return StoreError(st);
      }
      resp::AppendSimple("OK", &out_);
      return StatusCode::kOk;
    }
    if (cmd == "EXISTS"sv || cmd == "DEL"sv || cmd == "UNLINK"sv) {
      if (a.size() < 2) return WrongArgs(cmd);
      int64_t n = 0;
      for (size_t i = 1; i < a.size(); ++i) {
        if (cmd == "EXISTS"sv) {
          n += svc->RespExists(t, a[i]) ? 1 : 0;
          continue;
        }
        // A delete whose commit failed (sync) is an error, never a silent 0.
        Status st = svc->RespDel(t, a[i]);
        if (!st.ok() && !st.IsNotFound()) return StoreError(st);
        n += st.ok() ? 1 : 0;
      }
      resp::AppendInteger(n, &out_);
      return StatusCode::kOk;
    }
    if (cmd == "EXPIRE"sv || cmd == "PEXPIRE"sv) {
      if (a.size() != 3) return WrongArgs(cmd);
      int64_t v = 0;
      if (!ParseI64(a[2], &v)) {
        resp::AppendError("ERR value is not an integer or out of range", &out_);
        return StatusCode::kInvalidArgument;
      }
      if (v <= 0) {  // Redis: a non-positive expiry deletes the key
        Status st = svc->RespDel(t, a[1]);
        if (!st.ok() && !st.IsNotFound()) return StoreError(st);
        resp::AppendInteger(st.ok() ? 1 : 0, &out_);
        return StatusCode::kOk;
      }
      uint64_t ms = cmd == "EXPIRE"sv ? static_cast<uint64_t>(v) * 1000 : static_cast<uint64_t>(v);
      Status st = svc->RespExpire(t, a[1], ms);
      if (!st.ok() && !st.IsNotFound()) return StoreError(st);
      resp::AppendInteger(st.ok() ? 1 : 0, &out_);
      return StatusCode::kOk;
    }
    if (cmd == "TTL"sv || cmd == "PTTL"sv) {
      if (a.size() != 2) return WrongArgs(cmd);
      int64_t ms = svc->RespTtlMs(t, a[1]);
      if (ms < 0 || cmd == "PTTL"sv)
        resp::AppendInteger(ms, &out_);
      else
        resp::AppendInteger((ms + 999) / 1000, &out_);
      return StatusCode::kOk;
    }
    if (cmd == "DBSIZE"sv) {
      if (a.size() != 1) return WrongArgs(cmd);
      resp::AppendInteger(static_cast<int64_t>(svc->RespDbSize(t)), &out_);
      return StatusCode::kOk;
    }
    if (cmd == "FLUSHDB"sv || cmd == "FLUSHALL"sv) {
      Status st = svc->RespFlush(t);
      if (!st.ok()) return StoreError(st);
      resp::AppendSimple("OK", &out_);
      return StatusCode::kOk;
    }
    if (cmd == "INFO"sv) {
      std::string info =
          "# Server\r\nredis_version:7.0.0\r\nkvtier_version:0.1.0\r\n"
          "redis_mode:standalone\r\nuptime_in_seconds:" +
          std::to_string((DefaultSteadyClock().NowUs() - shared_->start_us) / 1000000) +
          "\r\n# Clients\r\nconnected_clients:" +
          std::to_string(shared_->metrics->connections_open.load()) +
          "\r\n# Persistence\r\nloading:0\r\n# Keyspace\r\ndb0:keys=" +
          std::to_string(svc->RespDbSize(t)) + ",expires=0,avg_ttl=0\r\n";
      resp::AppendBulk(info, &out_);
      return StatusCode::kOk;
    }
    if (cmd == "SELECT"sv) {
      if (a.size() != 2) return WrongArgs(cmd);
      if (a[1] != "0") {
        resp::AppendError("ERR DB index is out of range", &out_);
        return StatusCode::kInvalidArgument;
      }
      resp::AppendSimple("OK", &out_);
      return StatusCode::kOk;
    }
    if (cmd == "CONFIG"sv && a.size() >= 2 && Upper(a[1]) == "GET"sv) {
      // redis-benchmark reads "save" and "appendonly"; kvtier has no such settings.
      if (proto_ == 3)
        resp::AppendMapHeader(a.size() - 2, &out_);
      else
        resp::AppendArrayHeader(2 * (a.size() - 2), &out_);
      for (size_t i = 2; i < a.size(); ++i) {
        resp::AppendBulk(a[i], &out_);
        resp::AppendBulk("", &out_);
      }
      return StatusCode::kOk;
    }
    if (cmd == "CLIENT"sv && a.size() >= 2 && Upper(a[1]) == "SETNAME"sv) {
      resp::AppendSimple("OK", &out_);
      return StatusCode::kOk;
    }
    if (cmd == "ECHO"sv) {
      if (a.size() != 2) return WrongArgs(cmd);
      resp::AppendBulk(a[1], &out_);
      return StatusCode::kOk;
    }
    if (std::optional<StatusCode> c = internal::RunRespKeyspaceCommand(Keyspace(), cmd, a)) {
      return *c;
    }
    return UnknownCommand(a);
  }

  Shared* shared_;
  // Every handler runs on strand_ (bound explicitly).
  asio::strand<asio::io_context::executor_type> strand_;
  GenericSocket sock_;  // TCP, or the plaintext end of a TLS relay (no_delay fails there)
  asio::steady_timer timer_;
  MemoryGate memory_;  // reads paused by the daemon-wide budget
  IdleWatch idle_;
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

}  // namespace

void StartRespSession(Shared* shared, GenericSocket socket) {
  shared->metrics->connections_open.fetch_add(1);
  shared->metrics->connections_total.fetch_add(1);
  auto s = std::make_shared<RespSession>(shared, std::move(socket));
  asio::post(s->executor(), [s] { s->Begin(); });
}

}  // namespace kvtier::daemon::internal
