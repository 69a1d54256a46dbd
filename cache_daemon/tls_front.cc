#include "cache_daemon/tls_front.h"

#include <openssl/ssl.h>

#include <chrono>
#include <fstream>
#include <sstream>

#include "common/logging.h"

namespace kvtier::daemon {
namespace {

namespace asio = boost::asio;
namespace ssl = boost::asio::ssl;
using Tcp = asio::ip::tcp;
using Local = asio::local::stream_protocol;

bool IsEndOfStream(const boost::system::error_code& ec) {
  return ec == asio::error::eof || ec == ssl::error::stream_truncated;
}

// One TLS connection: handshake, then the plaintext relay (see tls_front.h). Every handler
// runs on the connection's executor (the strand it was accepted on), so the flags below need
// no lock.
class Relay : public std::enable_shared_from_this<Relay> {
 public:
  Relay(std::shared_ptr<TlsFront::State> state, Tcp::socket socket)
      : state_(std::move(state)),
        exec_(socket.get_executor()),
        tls_(std::move(socket), state_->ctx),
        plain_(exec_),
        timer_(exec_),
        stall_timer_(exec_) {}

  ~Relay() {
    if (relaying_) state_->relays_open.fetch_sub(1);
  }

  void Start(std::function<bool()> draining, TlsFront::StartSession start) {
    draining_ = std::move(draining);
    start_ = std::move(start);
    timer_.expires_after(std::chrono::milliseconds(state_->options.handshake_timeout_ms));
    timer_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
      if (ec || self->handshake_done_) return;
      // Counted before the close: a client that sees its connection end sees the failure
      // counted in /metrics too.
      self->EndHandshake(/*ok=*/false);
      boost::system::error_code ignored;
      self->tls_.next_layer().close(ignored);  // the handshake handler sees the error
    });
    tls_.async_handshake(
        ssl::stream_base::server,
        [self = shared_from_this()](boost::system::error_code ec) { self->OnHandshake(ec); });
  }

 private:
  // The handshake's end, counted once (by the timer when it timed out, else here).
  void EndHandshake(bool ok) {
    handshake_done_ = true;
    state_->handshakes_in_progress.fetch_sub(1);
    (ok ? state_->handshakes_ok : state_->handshakes_failed).fetch_add(1);
    timer_.cancel();
  }

  void OnHandshake(boost::system::error_code ec) {
    if (handshake_done_) return Abort();  // timed out: the timer closed and counted it
    EndHandshake(/*ok=*/!ec);
    if (ec) {
      KVTIER_LOG(kDebug) << "TLS handshake failed: " << ec.message();
      return Abort();
    }
    if (draining_ && draining_()) return Abort();
    Local::socket session_end(exec_);
    asio::local::connect_pair(plain_, session_end, ec);
    if (ec) {
      KVTIER_LOG(kWarn) << "TLS relay: socketpair: " << ec.message();
      return Abort();
    }
    relaying_ = true;
    state_->relays_open.fetch_add(1);
    up_.reset(new uint8_t[TlsFront::kRelayChunkBytes]);
    down_.reset(new uint8_t[TlsFront::kRelayChunkBytes]);
    session_hold_ = start_(TlsFront::GenericSocket(std::move(session_end)));
    start_ = nullptr;
    PumpUp();
    PumpDown();
  }

  // Client -> session. A write to the session is not timed: the session has its own limits
  // (idle, slow client) and closes its end, which fails the write.
  void PumpUp() {
    if (closing_) return MaybeCloseNotify();
    up_busy_ = true;
    tls_.async_read_some(asio::buffer(up_.get(), TlsFront::kRelayChunkBytes),
                         [self = shared_from_this()](boost::system::error_code ec, size_t n) {
                           self->up_busy_ = false;
                           if (self->closing_) return self->MaybeCloseNotify();
                           if (ec) {
                             if (!IsEndOfStream(ec)) {
                               KVTIER_LOG(kDebug) << "TLS relay read: " << ec.message();
                               return self->Abort();
                             }
                             // The client ended its stream: the session reads EOF, finishes and
                             // closes, and the down pump then closes the relay (or the stall
                             // timer does, if the client reads no more).
                             boost::system::error_code ignored;
                             self->plain_.shutdown(asio::socket_base::shutdown_send, ignored);
                             return;
                           }
                           self->up_busy_ = true;
                           asio::async_write(self->plain_, asio::buffer(self->up_.get(), n),
                                             [self](boost::system::error_code wec, size_t) {
                                               self->up_busy_ = false;
                                               if (wec) return self->OnSessionGone();
                                               self->PumpUp();
                                             });
                         });
  }

  // Session -> client, one async_write_some at a time so that every piece written counts as
  // progress for the stall timer.
  void PumpDown() {
    plain_.async_read_some(asio::buffer(down_.get(), TlsFront::kRelayChunkBytes),
                           [self = shared_from_this()](boost::system::error_code ec, size_t n) {
                             // (closing_: the relay closed the session's end after this read
                             // completed.)
                             if (ec || self->closing_) return self->OnSessionGone();
                             self->WriteDown(0, n);
                           });
  }

  void WriteDown(size_t done, size_t n) {
    if (aborted_) return;
    if (done == n) {
      down_busy_ = false;
      return PumpDown();
    }
    down_busy_ = true;
    down_progress_ms_ = NowMs();
    ArmStallTimer();
    tls_.async_write_some(
        asio::buffer(down_.get() + done, n - done),
        [self = shared_from_this(), done, n](boost::system::error_code ec, size_t written) {
          if (ec) return self->Abort();  // the client is gone
          self->WriteDown(done + written, n);
        });
  }

  // A write to the client that makes no progress for the front's idle timeout closes the
  // relay: a client that stopped reading would otherwise hold it (and its session's
  // descriptors) forever, since no read of either side completes while the write waits.
  void ArmStallTimer() {
    if (stall_armed_) return;
    stall_armed_ = true;
    const uint64_t now = NowMs();
    const uint64_t due = down_progress_ms_ + state_->write_stall_ms;
    stall_timer_.expires_after(std::chrono::milliseconds(due > now ? due - now : 0));
    stall_timer_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
      self->stall_armed_ = false;
      if (ec || self->aborted_ || !self->down_busy_) return;
      if (NowMs() >= self->down_progress_ms_ + self->state_->write_stall_ms) {
        KVTIER_LOG(kInfo) << "closing TLS connection: the client read nothing for "
                          << self->state_->write_stall_ms << " ms (limits.idle_timeout_ms)";
        self->state_->relays_stalled.fetch_add(1);
        return self->Abort();
      }
      self->ArmStallTimer();
    });
  }

  // The session closed its end (a read or write of it failed). With a write to the client
  // in progress the down pump still owns the TLS stream: it reads the session's EOF once the
  // write ends (or the stall timer closes the relay); else the relay closes now.
  void OnSessionGone() {
    if (down_busy_) return;
    BeginClose();
  }

  // The session is done: stop reading from the client, then send close_notify.
  void BeginClose() {
    if (closing_) return;
    closing_ = true;
    boost::system::error_code ignored;
    plain_.close(ignored);
    if (up_busy_) {
      tls_.next_layer().cancel(ignored);  // the up handler continues in MaybeCloseNotify
      return;
    }
    MaybeCloseNotify();
  }

  void MaybeCloseNotify() {
    if (up_busy_ || notify_started_ || aborted_) return;
    notify_started_ = true;
    timer_.expires_after(std::chrono::milliseconds(TlsFront::kCloseNotifyWaitMs));
    timer_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
      if (!ec) self->Abort();
    });
    tls_.async_shutdown([self = shared_from_this()](boost::system::error_code) {
      self->timer_.cancel();
      self->Abort();
    });
  }

  // Closes both sides at once; the handlers still pending complete with errors and release
  // the relay, and with it session_hold_.
  void Abort() {
    if (aborted_) return;
    aborted_ = true;
    boost::system::error_code ignored;
    timer_.cancel();
    stall_timer_.cancel();
    plain_.close(ignored);
    tls_.next_layer().shutdown(asio::socket_base::shutdown_both, ignored);
    tls_.next_layer().close(ignored);
  }

  static uint64_t NowMs() {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                     std::chrono::steady_clock::now().time_since_epoch())
                                     .count());
  }

  std::shared_ptr<TlsFront::State> state_;
  Tcp::socket::executor_type exec_;
  ssl::stream<Tcp::socket> tls_;
  Local::socket plain_;             // the relay's end of the socketpair
  asio::steady_timer timer_;        // handshake timeout, then the close_notify wait
  asio::steady_timer stall_timer_;  // a write to the client that makes no progress
  std::function<bool()> draining_;
  TlsFront::StartSession start_;
  std::shared_ptr<void> session_hold_;    // from start_: kept until the relay is destroyed
  std::unique_ptr<uint8_t[]> up_, down_;  // kRelayChunkBytes each, allocated after handshake
  uint64_t down_progress_ms_ = 0;         // when a write to the client last progressed
  bool handshake_done_ = false, relaying_ = false, up_busy_ = false, down_busy_ = false;
  bool stall_armed_ = false, closing_ = false, notify_started_ = false, aborted_ = false;
};

Status CheckReadable(const std::string& key, const std::string& path) {
  if (path.empty()) return Status::InvalidArgument("config key " + key + ": required for TLS");
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::InvalidArgument("config key " + key + ": cannot open " + path);
  return Status::Ok();
}

}  // namespace

StatusOr<std::unique_ptr<TlsFront>> TlsFront::Create(const TlsServeOptions& options,
                                                     uint64_t write_stall_ms) {
  KVTIER_RETURN_IF_ERROR(CheckReadable("tls.cert_file", options.cert_file));
  KVTIER_RETURN_IF_ERROR(CheckReadable("tls.key_file", options.key_file));
  std::unique_ptr<TlsFront> f(new TlsFront());
  f->state_->options = options;
  f->state_->write_stall_ms = write_stall_ms;
  ssl::context& ctx = f->state_->ctx;
  boost::system::error_code ec;
  ctx.set_options(ssl::context::default_workarounds | ssl::context::no_sslv2 |
                      ssl::context::no_sslv3 | ssl::context::no_tlsv1 | ssl::context::no_tlsv1_1 |
                      ssl::context::single_dh_use,
                  ec);
  if (ec) return Status::Internal("TLS context options: " + ec.message());
  if (SSL_CTX_set_min_proto_version(ctx.native_handle(), TLS1_2_VERSION) != 1) {
    return Status::Internal("TLS context: cannot set the minimum version");
  }
  // An encrypted key would make OpenSSL prompt on the terminal: answer with no passphrase.
  ctx.set_password_callback([](size_t, ssl::context::password_purpose) { return std::string(); },
                            ec);
  ctx.use_certificate_chain_file(options.cert_file, ec);
  if (ec) {
    return Status::InvalidArgument("config key tls.cert_file: " + options.cert_file +
                                   ": not a PEM certificate chain (" + ec.message() + ")");
  }
  ctx.use_private_key_file(options.key_file, ssl::context::pem, ec);
  if (ec) {
    return Status::InvalidArgument("config key tls.key_file: " + options.key_file +
                                   ": not an unencrypted PEM private key of the certificate in " +
                                   options.cert_file + " (" + ec.message() + ")");
  }
  if (SSL_CTX_check_private_key(ctx.native_handle()) != 1) {
    return Status::InvalidArgument("config key tls.key_file: " + options.key_file +
                                   " does not match the certificate in " + options.cert_file);
  }
  return f;
}

void TlsFront::Accept(Tcp::socket socket, std::function<bool()> draining, StartSession start) {
  uint64_t in_progress = state_->handshakes_in_progress.fetch_add(1);
  if (in_progress >= state_->options.handshakes_max) {
    state_->handshakes_in_progress.fetch_sub(1);
    state_->handshakes_rejected.fetch_add(1);
    boost::system::error_code ignored;
    socket.close(ignored);
    return;
  }
  boost::system::error_code ignored;
  socket.set_option(Tcp::no_delay(true), ignored);
  auto relay = std::make_shared<Relay>(state_, std::move(socket));
  relay->Start(std::move(draining), std::move(start));
}

TlsFront::Counters TlsFront::counters() const {
  Counters c;
  c.handshakes_ok = state_->handshakes_ok.load();
  c.handshakes_failed = state_->handshakes_failed.load();
  c.handshakes_rejected = state_->handshakes_rejected.load();
  c.handshakes_in_progress = state_->handshakes_in_progress.load();
  c.relays_open = state_->relays_open.load();
  c.relays_stalled = state_->relays_stalled.load();
  return c;
}

std::string TlsFront::RenderPrometheus() const {
  Counters c = counters();
  std::ostringstream os;
  os << "# HELP kvtier_tls_handshakes_total TLS handshakes on the TCP fronts by result "
        "(failed: bad or plaintext client hello, timeout, reset; rejected: over "
        "tls.handshakes_max).\n"
     << "# TYPE kvtier_tls_handshakes_total counter\n"
     << "kvtier_tls_handshakes_total{result=\"ok\"} " << c.handshakes_ok << "\n"
     << "kvtier_tls_handshakes_total{result=\"failed\"} " << c.handshakes_failed << "\n"
     << "kvtier_tls_handshakes_total{result=\"rejected\"} " << c.handshakes_rejected << "\n"
     << "# HELP kvtier_tls_handshakes_in_progress TLS handshakes in progress now.\n"
     << "# TYPE kvtier_tls_handshakes_in_progress gauge\n"
     << "kvtier_tls_handshakes_in_progress " << c.handshakes_in_progress << "\n"
     << "# HELP kvtier_tls_connections_open TLS connections relaying to a session now.\n"
     << "# TYPE kvtier_tls_connections_open gauge\n"
     << "kvtier_tls_connections_open " << c.relays_open << "\n"
     << "# HELP kvtier_tls_write_stalls_total TLS connections closed because the client read "
        "nothing of a reply for limits.idle_timeout_ms.\n"
     << "# TYPE kvtier_tls_write_stalls_total counter\n"
     << "kvtier_tls_write_stalls_total " << c.relays_stalled << "\n";
  return os.str();
}

}  // namespace kvtier::daemon
