// The native-protocol connection on its strand: frame splitting, auth, turns, shared memory,
// dispatch to workers, ordered writes, backpressure and the slow-client timer
// (native_session_impl.h). See docs/format/wire.md.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <optional>
#include <unordered_map>
#include <utility>

#include "cache_daemon/native_session_impl.h"
#include "common/clock.h"
#include "common/logging.h"

namespace kvtier::daemon::internal {
namespace native {
namespace {

// After this many failed AUTH attempts a connection is closed.
constexpr int kMaxAuthFailures = 3;
// Reads start with a small buffer (an idle connection holds little) that doubles up to
// kReadChunkBytes while reads fill it.
constexpr size_t kFirstReadBytes = 16 * 1024;
constexpr size_t kReadChunkBytes = 256 * 1024;
// Turn ids (wire::kFlagTurn) a connection remembers, mapped to the request they are for the
// eviction policies; beyond this the oldest is forgotten (its next call begins a new request).
// A remembered turn older than kTurnAgeMsMax also begins anew, so no turn keeps one request
// time forever. Both counted in kvtier_native_turns_restarted_total. docs/format/wire.md.
constexpr size_t kTurnsPerConnectionMax = 1024;
constexpr uint64_t kTurnAgeMsMax = 10 * 60 * 1000;
// At SHM_ATTACH the region's first bytes, up to this many, are allocated (fallocate), so that
// the first GETs on the connection write into pages the kernel has already zeroed: a
// 16K-token resume's values (1.3 MB) into a fresh memfd took 0.43-0.68 ms, into allocated
// pages 0.18-0.29 ms (docs/performance/resume.md, "Resume fetch"). The client places a GET's values
// from the start of the region when nothing else is leased. Bounded so that an idle
// connection holds at most this much.
constexpr uint64_t kShmAllocatedBytesMax = 4ull << 20;

Op ToOp(uint8_t opcode) {
  switch (static_cast<Opcode>(opcode)) {
    case Opcode::kHello:
      return Op::kHello;
    case Opcode::kAuth:
      return Op::kAuth;
    case Opcode::kShmAttach:
      return Op::kShmAttach;
    case Opcode::kLookup:
      return Op::kLookup;
    case Opcode::kPut:
      return Op::kPut;
    case Opcode::kGet:
      return Op::kGet;
    case Opcode::kPrefetch:
      return Op::kPrefetch;
    case Opcode::kPin:
      return Op::kPin;
    case Opcode::kUnpin:
      return Op::kUnpin;
    case Opcode::kDelete:
      return Op::kDelete;
    case Opcode::kStats:
      return Op::kStats;
    case Opcode::kPolicyGet:
      return Op::kPolicyGet;
    case Opcode::kPolicySet:
      return Op::kPolicySet;
    case Opcode::kDrain:
      return Op::kDrain;
    case Opcode::kEngramGrant:
      return Op::kEngramGrant;
    case Opcode::kEngramReport:
      return Op::kEngramReport;
  }
  return Op::kHello;
}

}  // namespace

// Builds a response frame: header, status, then fill(w) when the status is OK.
std::vector<uint8_t> Response(const wire::FrameHeader& req, uint16_t flags, const Status& st,
                              const std::function<void(wire::Writer*)>& fill) {
  wire::Writer w;
  w.buffer().resize(wire::kHeaderBytes);
  wire::EncodeStatus(st, &w);
  if (st.ok() && fill) fill(&w);
  std::vector<uint8_t> out = w.Take();
  auto h = wire::EncodeHeader(req.opcode | wire::kResponseBit, flags, req.request_id,
                              static_cast<uint32_t>(out.size() - wire::kHeaderBytes));
  std::copy(h.begin(), h.end(), out.begin());
  return out;
}

NativeSession::NativeSession(Shared* shared, GenericSocket socket, bool is_unix,
                             std::shared_ptr<ConnectionCount> count)
    : shared_(shared),
      count_(std::move(count)),
      strand_(asio::make_strand(*shared->io)),
      sock_(std::move(socket)),
      is_unix_(is_unix),
      parser_(shared->options->max_frame_bytes),
      timer_(strand_),
      memory_(strand_),
      idle_(strand_, shared->options->idle_timeout_ms),
      auth_deadline_(strand_),
      rbuf_(kFirstReadBytes) {
  tenant_ = shared_->tenants->default_tenant();
  SetFrameLimit();
}

NativeSession::~NativeSession() {
  if (shm_ != nullptr) ::munmap(shm_, shm_bytes_);
  if (shm_fd_ >= 0) ::close(shm_fd_);
  shared_->ReleaseTenantConnection(tenant_);
  shared_->memory->Adjust(&charged_bytes_, 0);
}

void NativeSession::Begin() {
  id_ = shared_->Register(shared_from_this());
  auto self = shared_from_this();
  idle_.Arm(
      // Not idle: requests executing, or reads held by the daemon-wide budget.
      IdleWatch::NowMs(), self, [this] { return inflight_ > 0 || HeldByMemoryGate(); },
      [this] {
        if (closed_) return;
        shared_->metrics->Refuse(Refusal::kIdle);
        KVTIER_LOG(kInfo) << "closing idle native connection (limits.idle_timeout_ms)";
        DoClose();
      });
  if (count_->unauthenticated()) ArmAuthDeadline(count_->AuthDeadlineMs());
  MaybeRead();
}

void NativeSession::ArmAuthDeadline(uint64_t deadline_ms) {
  auth_deadline_.Arm(deadline_ms, shared_from_this(), [this] {
    if (closed_ || !Unauthenticated()) return;
    shared_->metrics->Refuse(Refusal::kAuthTimeout);
    KVTIER_LOG(kInfo) << "closing native connection: not authenticated within "
                      << shared_->options->auth_timeout_ms << " ms (limits.auth_timeout_ms)";
    DoClose();
  });
}

void NativeSession::AfterAuth(const Tenant* before) {
  if (!shared_->tenants->auth_enabled() || (before == nullptr) == (tenant_ == nullptr)) return;
  if (tenant_ != nullptr) {
    count_->Authenticated();
    auth_deadline_.Disarm();
    return;
  }
  if (!count_->Deauthenticated()) {
    close_after_write_ = true;  // refused: the front's unauthenticated places are taken
    return;
  }
  ArmAuthDeadline(IdleWatch::NowMs() + shared_->options->auth_timeout_ms);
}

void NativeSession::DoClose() {
  if (closed_) return;
  closed_ = true;
  boost::system::error_code ec;
  timer_.cancel();
  memory_.Cancel();
  idle_.Cancel();
  auth_deadline_.Disarm();
  sock_.shutdown(asio::socket_base::shutdown_both, ec);
  sock_.close(ec);
  shared_->Unregister(id_);
}

void NativeSession::MaybeRead() {
  if (closed_) return;
  if (reading_ || close_after_write_) {
    // A request finished or a reply was written while a read waits: what the connection
    // holds shrank, and an idle connection must not stay charged for it (its old charge
    // could hold every connection's reads paused until it was closed as idle).
    Account();
    return;
  }
  if (shared_->draining.load()) {
    if (inflight_ == 0 && wq_.empty()) DoClose();
    return;
  }
  // Frames already buffered run first (they arrived before any new read). A reply that is
  // written synchronously (SendWithFd) can call back into MaybeRead from inside
  // ProcessFrames; processing_ keeps that nested call from starting a second read.
  if (processing_) return;
  processing_ = true;
  bool open = ProcessFrames();
  processing_ = false;
  Account();
  if (!open || reading_ || closed_) return;
  if (inflight_ >= shared_->options->max_inflight_per_connection) return;  // backpressure
  if (held_) return;  // a HELLO/AUTH waits for the requests before it
  if (ReplyQueueFull()) {
    // The client is not reading its replies: stop reading its requests (WriteNext resumes).
    if (!reply_paused_) shared_->metrics->Refuse(Refusal::kReplyQueue);
    reply_paused_ = true;
    return;
  }
  reply_paused_ = false;
  const bool was_held = HeldByMemoryGate();
  if (!memory_.AllowsRead(shared_, [self = shared_from_this()] { self->MaybeRead(); })) return;
  // The watch sees a hold only when its deadline passes: without this, a hold that ends
  // just before the deadline closes, as idle, a connection that only the daemon kept
  // waiting (seen with the host's CPUs saturated: a client's HELLO was held 1.49 s of a
  // 1.5 s idle_timeout_ms, then its connection was closed before the read completed).
  if (was_held) idle_.Touch(IdleWatch::NowMs());
  // Before authentication a read takes no more than one frame may hold.
  size_t want = rbuf_.size();
  if (Unauthenticated()) want = std::min<size_t>(want, PreauthFrameBytes());
  reading_ = true;
  sock_.async_read_some(
      asio::buffer(rbuf_.data(), want),
      asio::bind_executor(strand_, [self = shared_from_this()](boost::system::error_code ec,
                                                               size_t n) { self->OnRead(ec, n); }));
}

void NativeSession::OnRead(boost::system::error_code ec, size_t n) {
  reading_ = false;
  if (ec || closed_) {
    if (ec && ec != asio::error::eof && ec != asio::error::operation_aborted) {
      KVTIER_LOG(kInfo) << "native connection read error: " << ec.message();
    }
    DoClose();
    return;
  }
  shared_->metrics->AddBytes(true, n);
  idle_.Touch(IdleWatch::NowMs());
  parser_.Append(std::span<const uint8_t>(rbuf_.data(), n));
  if (n == rbuf_.size() && rbuf_.size() < kReadChunkBytes && !Unauthenticated()) {
    rbuf_.resize(rbuf_.size() * 2);  // a busy connection reads in larger chunks
  }
  MaybeRead();
  ArmFrameTimer();
}

bool NativeSession::Unauthenticated() const { return tenant_ == nullptr; }

void NativeSession::SetFrameLimit() {
  parser_.set_max_frame_bytes(Unauthenticated() ? PreauthFrameBytes()
                                                : shared_->options->max_frame_bytes);
}

bool NativeSession::ReplyQueueFull() const {
  return wq_bytes_.load() >= shared_->options->reply_queue_bytes_max || reply_refused_.load();
}

bool NativeSession::ReserveReply(uint64_t n, Job* job) {
  uint64_t outstanding = wq_bytes_.load() + building_bytes_.load();
  if (outstanding > 0 && outstanding + n > shared_->options->reply_queue_bytes_max) {
    shared_->metrics->Refuse(Refusal::kReplyQueue);
    reply_refused_.store(true);  // take no more frames until the queue drains (WriteNext)
    return false;
  }
  if (outstanding > 0 && shared_->memory->Over()) {
    shared_->metrics->Refuse(Refusal::kMemory);
    reply_refused_.store(true);
    return false;
  }
  building_bytes_.fetch_add(n);
  shared_->memory->Charge(n);
  job->reserved_bytes += n;
  return true;
}

void NativeSession::Account() {
  uint64_t held = rbuf_.capacity() + parser_.capacity_bytes() + wq_bytes_.load() + inflight_bytes_ +
                  (held_ ? held_->body.size() : 0);
  shared_->memory->Adjust(&charged_bytes_, held);
}

void NativeSession::ArmFrameTimer() {
  if (closed_ || timer_armed_ || !parser_.mid_frame()) return;
  timer_armed_ = true;
  uint64_t stamp = frames_completed_;
  timer_.expires_after(std::chrono::milliseconds(shared_->options->frame_timeout_ms));
  timer_.async_wait(asio::bind_executor(
      strand_, [self = shared_from_this(), stamp](boost::system::error_code ec) {
        self->timer_armed_ = false;
        if (ec || self->closed_) return;
        if (self->reading_ && self->parser_.mid_frame() && self->frames_completed_ == stamp) {
          self->shared_->metrics->slow_client_disconnects.fetch_add(1);
          KVTIER_LOG(kInfo) << "closing native connection: frame incomplete after "
                            << self->shared_->options->frame_timeout_ms << " ms";
          self->DoClose();
          return;
        }
        self->ArmFrameTimer();
      }));
}

bool NativeSession::ProcessFrames() {
  while (!closed_ && !close_after_write_ &&
         inflight_ < shared_->options->max_inflight_per_connection && !ReplyQueueFull()) {
    wire::Frame frame;
    if (held_) {
      if (inflight_ > 0) break;
      frame = std::move(*held_);
      held_.reset();
    } else {
      StatusOr<bool> got = parser_.Next(&frame);
      if (!got.ok()) {
        if (Unauthenticated()) shared_->metrics->Refuse(Refusal::kPreauthFrame);
        OnMalformed(got.status());
        return false;
      }
      if (!*got) break;
      ++frames_completed_;
      last_opcode_ = frame.header.opcode;
      if (IsAuthFrame(frame.header) && inflight_ > 0) {
        held_ = std::move(frame);
        break;
      }
    }
    HandleFrame(std::move(frame));
    SetFrameLimit();
  }
  return !closed_ && !close_after_write_;
}

void NativeSession::OnMalformed(const Status& st) {
  shared_->metrics->protocol_errors.fetch_add(1);
  KVTIER_LOG(kInfo) << "closing native connection after " << frames_completed_
                    << " frames (last opcode " << int{last_opcode_} << "): " << st.ToString();
  wire::FrameHeader h;  // opcode 0, request id 0: the reply cannot name the bad request
  Enqueue({Response(h, 0, st), -1});
  close_after_write_ = true;
}

void NativeSession::Enqueue(OutMsg msg) {
  wq_bytes_.fetch_add(msg.bytes.size());
  wq_.push_back(std::move(msg));
  if (!writing_) WriteNext();
}

void NativeSession::WriteNext() {
  if (closed_) return;
  if (wq_.empty()) {
    writing_ = false;
    write_busy_.store(false);
    // Every reply, refused values' included, went through this queue and none is being
    // built: the client has read them all. (Not while requests execute: the small replies
    // of refused values are written while a big one is still being built.)
    if (inflight_ == 0) reply_refused_.store(false);
    if (close_after_write_) {
      DoClose();
      return;
    }
    MaybeRead();
    return;
  }
  writing_ = true;
  write_busy_.store(true);
  if (wq_.front().fd >= 0) {
    SendWithFd();
    return;
  }
  asio::async_write(sock_, asio::buffer(wq_.front().bytes),
                    asio::bind_executor(strand_, [self = shared_from_this()](
                                                     boost::system::error_code ec, size_t n) {
                      self->shared_->metrics->AddBytes(false, n);
                      self->idle_.Touch(IdleWatch::NowMs());
                      self->wq_bytes_.fetch_sub(self->wq_.front().bytes.size());
                      self->shared_->reply_buffers->Give(std::move(self->wq_.front().bytes));
                      self->wq_.pop_front();
                      if (ec) {
                        KVTIER_LOG(kInfo) << "native connection write error: " << ec.message();
                        self->DoClose();
                        return;
                      }
                      self->WriteNext();
                    }));
}

void NativeSession::SendWithFd() {
  OutMsg& m = wq_.front();
  struct msghdr msg {};
  struct iovec iov {
    m.bytes.data(), m.bytes.size()
  };
  alignas(struct cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  struct cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &m.fd, sizeof(int));
  ssize_t n = ::sendmsg(sock_.native_handle(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
    sock_.async_wait(
        asio::socket_base::wait_write,
        asio::bind_executor(strand_, [self = shared_from_this()](boost::system::error_code ec) {
          if (ec) return self->DoClose();
          self->SendWithFd();
        }));
    return;
  }
  if (n < 0) {
    wq_bytes_.fetch_sub(m.bytes.size());
    wq_.pop_front();
    DoClose();
    return;
  }
  shared_->metrics->AddBytes(false, static_cast<uint64_t>(n));
  idle_.Touch(IdleWatch::NowMs());
  // The descriptor went with the first byte; the rest of the frame is ordinary data.
  m.fd = -1;
  m.bytes.erase(m.bytes.begin(), m.bytes.begin() + n);
  wq_bytes_.fetch_sub(static_cast<uint64_t>(n));
  if (m.bytes.empty()) wq_.pop_front();
  WriteNext();
}

void NativeSession::Reply(Op op, uint64_t start_us, std::vector<uint8_t> bytes, StatusCode code) {
  shared_->metrics->RecordRequest(op, code, DefaultSteadyClock().NowUs() - start_us);
  Enqueue({std::move(bytes), -1});
}

void NativeSession::HandleFrame(wire::Frame frame) {
  const wire::FrameHeader& h = frame.header;
  uint64_t start_us = DefaultSteadyClock().NowUs();
  if (!wire::IsKnownOpcode(h.opcode)) {
    shared_->metrics->protocol_errors.fetch_add(1);
    Enqueue({Response(h, 0, Status::InvalidArgument("unknown opcode " + std::to_string(h.opcode))),
             -1});
    return;
  }
  Op op = ToOp(h.opcode);
  auto opcode = static_cast<Opcode>(h.opcode);
  if (opcode == Opcode::kHello || opcode == Opcode::kAuth) {
    const Tenant* const before = tenant_;
    Status st = HandleAuth(frame);
    AfterAuth(before);
    std::vector<uint8_t> out = Response(h, 0, st, [&](wire::Writer* w) {
      if (opcode == Opcode::kAuth) return;
      wire::HelloResponse r;
      r.authenticated = tenant_ != nullptr && shared_->tenants->auth_enabled();
      r.max_frame_bytes = shared_->options->max_frame_bytes;
      r.max_inflight = shared_->options->max_inflight_per_connection;
      r.max_batch_keys = BatchLimit();
      r.tenant_name = tenant_ != nullptr ? tenant_->name : "";
      r.features = wire::kFeatureTurns;
      wire::EncodeHelloResponse(r, w);
    });
    Reply(op, start_us, std::move(out), st.code());
    if (auth_failures_ >= kMaxAuthFailures) close_after_write_ = true;
    return;
  }
  if (tenant_ == nullptr) {
    // Auth is on: a client that sends anything but HELLO/AUTH first is answered once and
    // disconnected, so an unauthenticated peer cannot make the daemon hold its replies.
    shared_->metrics->Refuse(Refusal::kUnauthenticated);
    Reply(op, start_us,
          Response(h, 0, Status::PermissionDenied("authentication required (HELLO/AUTH)")),
          StatusCode::kPermissionDenied);
    close_after_write_ = true;
    return;
  }
  if (opcode == Opcode::kShmAttach) {
    HandleShmAttach(frame, start_us);
    return;
  }
  StatusOr<InflightSlot> slot = AcquireInflight(*tenant_);
  if (!slot.ok()) {
    shared_->metrics->tenant_inflight_rejections.fetch_add(1);
    Reply(op, start_us, Response(h, 0, slot.status()), slot.status().code());
    return;
  }
  ++inflight_;
  const uint64_t frame_bytes = frame.body.size();
  inflight_bytes_ += frame_bytes;
  busy_.fetch_add(1);
  shared_->metrics->inflight.fetch_add(1);
  auto shared_slot = std::make_shared<InflightSlot>(std::move(slot).value());
  const storage::RequestTag request = TurnRequest(frame);
  auto job = std::make_shared<Job>(
      Job{std::move(frame), tenant_, unit_tokens_, shm_, shm_bytes_, shm_fd_, request});
  asio::post(*shared_->workers, [self = shared_from_this(), job = std::move(job), op, start_us,
                                 shared_slot, frame_bytes]() mutable {
    // Queues the reply on the strand: once, from inside Execute (a GET, before its
    // promotions) or after it. The request counts as finished from here (inflight, the
    // tenant's slot); the worker may still be promoting what the GET read.
    Job* const j = job.get();
    j->reply = [&self, j, &shared_slot, op, start_us, frame_bytes](std::vector<uint8_t> out,
                                                                   StatusCode code) {
      j->replied = true;
      const uint64_t reserved = j->reserved_bytes;
      shared_slot.reset();
      asio::post(self->strand_,
                 [self, out = std::move(out), op, start_us, code, frame_bytes, reserved]() mutable {
                   --self->inflight_;
                   self->inflight_bytes_ -= frame_bytes;
                   // The reply moves from "being built" to the write queue.
                   self->building_bytes_.fetch_sub(reserved);
                   self->shared_->memory->Release(reserved);
                   self->shared_->metrics->inflight.fetch_sub(1);
                   self->Reply(op, start_us, std::move(out), code);
                   self->busy_.fetch_sub(1);
                   self->MaybeRead();
                 });
    };
    StatusCode code = StatusCode::kOk;
    std::vector<uint8_t> out = self->Execute(*job, &code);
    if (!j->replied) j->reply(std::move(out), code);
    job.reset();
  });
}

Status NativeSession::HandleAuth(const wire::Frame& frame) {
  std::string token;
  if (static_cast<Opcode>(frame.header.opcode) == Opcode::kHello) {
    StatusOr<wire::HelloRequest> req = wire::DecodeHello(frame.body);
    if (!req.ok()) return req.status();
    unit_tokens_ = req->unit_tokens;
    if (req->token.empty()) return Status::Ok();
    token = req->token;
  } else {
    StatusOr<std::string> tok = wire::DecodeAuth(frame.body);
    if (!tok.ok()) return tok.status();
    token = *tok;
  }
  StatusOr<const Tenant*> t = shared_->tenants->Authenticate(token);
  if (!t.ok()) {
    ++auth_failures_;
    shared_->metrics->auth_failures.fetch_add(1);
    shared_->ReleaseTenantConnection(tenant_);
    if (tenant_ != shared_->tenants->default_tenant()) ForgetTurns();
    tenant_ = shared_->tenants->default_tenant();
    return t.status();
  }
  if (*t != tenant_) {
    if (!shared_->AcquireTenantConnection(*t)) {
      return Status::Rejected("tenant " + (*t)->name +
                              " is at limits.tenant_connections_max connections");
    }
    shared_->ReleaseTenantConnection(tenant_);
    ForgetTurns();  // a turn never spans two tenants
  }
  tenant_ = *t;
  return Status::Ok();
}

storage::RequestTag NativeSession::TurnRequest(const wire::Frame& frame) {
  if ((frame.header.flags & wire::kFlagTurn) == 0) return {};
  std::span<const uint8_t> rest;
  StatusOr<uint64_t> turn = wire::SplitTurn(frame.header.opcode, frame.body, &rest);
  if (!turn.ok()) return {};
  const uint64_t now_ms = DefaultSteadyClock().NowMs();
  auto it = turns_.find(*turn);
  if (it != turns_.end() && now_ms - it->second.started_ms <= kTurnAgeMsMax) {
    return it->second.tag;
  }
  if (it != turns_.end()) {
    shared_->metrics->native_turns_restarted.fetch_add(1);
    turns_.erase(it);  // its entry in turn_order_ is skipped when it comes up
  }
  while (turns_.size() >= kTurnsPerConnectionMax && !turn_order_.empty()) {
    const auto [old, started] = turn_order_.front();
    turn_order_.pop_front();
    auto o = turns_.find(old);
    if (o != turns_.end() && o->second.started_ms == started) {
      turns_.erase(o);
      shared_->metrics->native_turns_restarted.fetch_add(1);
    }
  }
  // Stale entries (erased or restarted turns) are dropped once the order outgrows the table.
  while (turn_order_.size() >= 2 * kTurnsPerConnectionMax) turn_order_.pop_front();
  const storage::RequestTag tag = shared_->service->store()->BeginRequest();
  turns_[*turn] = TurnEntry{tag, now_ms};
  turn_order_.emplace_back(*turn, now_ms);
  return tag;
}

void NativeSession::ForgetTurns() {
  turns_.clear();
  turn_order_.clear();
}

void NativeSession::HandleShmAttach(const wire::Frame& frame, uint64_t start_us) {
  const wire::FrameHeader& h = frame.header;
  StatusOr<uint64_t> want = wire::DecodeShmAttach(frame.body);
  Status st;
  if (!want.ok())
    st = want.status();
  else if (!is_unix_)
    st = Status::InvalidArgument("shared memory needs a Unix socket");
  else if (shm_ != nullptr)
    st = Status::InvalidArgument("shared memory already attached");
  else if (*want == 0)
    st = Status::InvalidArgument("shared memory size 0");
  uint64_t bytes = 0;
  if (st.ok()) {
    bytes = std::min<uint64_t>(*want, shared_->options->shm_max_bytes);
    bytes = (bytes + 4095) & ~uint64_t{4095};
    // Sealed at its size: the client holds the same descriptor, and a region it could
    // shrink would turn the daemon's next access into SIGBUS.
    int fd = ::memfd_create("kvtier-shm", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(bytes)) != 0 ||
        ::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
      if (fd >= 0) ::close(fd);
      st = Status::IOError("memfd_create/ftruncate/F_ADD_SEALS failed");
    } else {
      // Best effort: a region whose pages could not be allocated now gets them on write.
      (void)::fallocate(fd, 0, 0, static_cast<off_t>(std::min(bytes, kShmAllocatedBytesMax)));
      void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (p == MAP_FAILED) {
        ::close(fd);
        st = Status::IOError("mmap of shared memory failed");
      } else {
        shm_ = static_cast<uint8_t*>(p);
        shm_bytes_ = bytes;
        shm_fd_ = fd;
      }
    }
  }
  std::vector<uint8_t> out = Response(h, 0, st, [&](wire::Writer* w) { w->U64(bytes); });
  shared_->metrics->RecordRequest(Op::kShmAttach, st.code(),
                                  DefaultSteadyClock().NowUs() - start_us);
  Enqueue({std::move(out), st.ok() ? shm_fd_ : -1});
}

}  // namespace native

void StartNativeSession(Shared* shared, asio::generic::stream_protocol::socket socket, bool is_unix,
                        std::shared_ptr<ConnectionCount> count) {
  auto s =
      std::make_shared<native::NativeSession>(shared, std::move(socket), is_unix, std::move(count));
  asio::post(s->executor(), [s] { s->Begin(); });
}

}  // namespace kvtier::daemon::internal
