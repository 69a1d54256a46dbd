// The RESP connection's lifecycle, reads and command loop (resp_session_impl.h).
#include <algorithm>
#include <chrono>
#include <memory>

#include "cache_daemon/resp_session_impl.h"
#include "common/clock.h"

namespace kvtier::daemon::internal {

using Tcp = asio::ip::tcp;

RespSession::RespSession(Shared* shared, GenericSocket socket,
                         std::shared_ptr<ConnectionCount> count)
    : shared_(shared),
      count_(std::move(count)),
      strand_(asio::make_strand(*shared->io)),
      sock_(std::move(socket)),
      timer_(strand_),
      memory_(strand_),
      idle_(strand_, shared->options->idle_timeout_ms),
      auth_deadline_(strand_),
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

RespSession::~RespSession() {
  shared_->ReleaseTenantConnection(tenant_);
  shared_->memory->Adjust(&charged_bytes_, 0);
}

void RespSession::Begin() {
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
  // A failed AUTH leaves a RESP connection's tenant as it was (as Redis), so only the first
  // successful one (Authenticate) disarms this.
  if (count_->unauthenticated()) {
    auth_deadline_.Arm(count_->AuthDeadlineMs(), shared_from_this(), [this] {
      if (closed_ || tenant_ != nullptr) return;
      shared_->metrics->Refuse(Refusal::kAuthTimeout);
      DoClose();
    });
  }
  Read();
}

void RespSession::Close() {
  asio::post(strand_, [self = shared_from_this()] { self->DoClose(); });
}

void RespSession::DoClose() {
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
  auth_deadline_.Disarm();
  sock_.shutdown(asio::socket_base::shutdown_both, ec);
  sock_.close(ec);
  shared_->Unregister(id_);
}

void RespSession::SetCommandLimit() {
  parser_.set_max_command_bytes(tenant_ == nullptr ? shared_->options->preauth_frame_bytes_max
                                                   : shared_->options->resp_command_bytes_max);
}

void RespSession::Account() {
  uint64_t held = parser_.capacity_bytes() + out_.capacity() + body_bytes_ + hold_bytes_ +
                  wbuf_.capacity() + raw_.capacity() + spare_bytes_ + txn_.held_bytes() +
                  stalled_bytes_ + mget_keys_bytes_;
  for (const Body& b : wbodies_) held += b.bytes.size();
  shared_->memory->Adjust(&charged_bytes_, held);
}

void RespSession::Read() {
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

void RespSession::ReadReady() {
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

void RespSession::ReleaseIdleBuffers() {
  if (out_.empty() && out_.capacity() > kKeepReplyBufferBytes) std::string().swap(out_);
  if (!writing_ && wbuf_.capacity() > kKeepReplyBufferBytes) std::string().swap(wbuf_);
  if (raw_.capacity() > kSpareBufferBytesMax) std::vector<uint8_t>().swap(raw_);
}

bool RespSession::HeldByMemoryGate() const {
  return memory_.paused() && pending_bytes() == 0 && wbuf_.empty();
}

void RespSession::Process() {
  for (;;) {
    if (closed_) return;
    busy_.store(true);
    bool fatal = false;
    clock_us_ = DefaultSteadyClock().NowUs();
    while (pending_bytes() < max_pending_bytes_ && holds_.size() < kPendingSetsMax && !quit_) {
      if (!mget_keys_.empty()) {  // an MGET's rest runs before anything later
        ContinueMget();
        continue;
      }
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
    ReleaseIdleBuffers();
    if (parser_.buffered_bytes() > 0) ArmTimer();
    Read();
    return;
  }
}

void RespSession::ArmTimer() {
  if (timer_armed_ || closed_) return;
  timer_armed_ = true;
  uint64_t stamp = commands_;
  timer_.expires_after(std::chrono::milliseconds(shared_->options->frame_timeout_ms));
  timer_.async_wait(asio::bind_executor(
      strand_, [self = shared_from_this(), stamp](boost::system::error_code ec) {
        self->timer_armed_ = false;
        if (ec || self->closed_) return;
        // Only while the connection waits for the client's bytes: a command that waits behind
        // the replies before it (an MGET's parts written to a slow reader) is not late.
        if (self->reading_ && self->parser_.buffered_bytes() > 0 && self->commands_ == stamp) {
          self->shared_->metrics->slow_client_disconnects.fetch_add(1);
          return self->DoClose();
        }
        if (self->parser_.buffered_bytes() > 0) self->ArmTimer();
      }));
}

void StartRespSession(Shared* shared, asio::generic::stream_protocol::socket socket,
                      std::shared_ptr<ConnectionCount> count) {
  auto s = std::make_shared<RespSession>(shared, std::move(socket), std::move(count));
  asio::post(s->executor(), [s] { s->Begin(); });
}

}  // namespace kvtier::daemon::internal
