// TLS termination for kvtierd's TCP fronts (native TCP, RESP, HTTP admin), in-process.
//
// The sessions (native_session.cc, resp_session.cc, http_admin.cc) know nothing of TLS. For
// a front with [tls] on, the accepted TCP connection is handed to TlsFront::Accept, which
// completes the TLS handshake (bounded by handshake_timeout_ms; at most handshakes_max at
// once, more are closed at once) and then relays plaintext between the TLS connection and
// one end of an AF_UNIX socketpair; the other end is given to the front's unchanged session
// as its socket. The relay runs on the connection's strand of the daemon's I/O threads, one
// read and one write outstanding per direction (bounded memory: two kRelayChunkBytes buffers),
// and forwards backpressure both ways: it reads the next chunk only once the previous one
// has been written. The Unix-socket / shared-memory path never goes through it.
//
// Close: when the client ends the TLS stream the session's socket is shut down for writing
// (the session reads EOF and closes); when the session closes its socket, the relay first
// writes to the client what the session wrote before closing, then cancels its TLS read,
// sends close_notify (waiting at most kCloseNotifyWaitMs for the peer's) and closes the TCP
// connection. A write to the client that makes no progress for write_stall_ms (the daemon's
// limits.idle_timeout_ms) closes both sides at once: a client that stops reading cannot hold
// a relay after its session has ended. A read or write error on the TLS side closes both
// sides at once too.
//
// Connection count: StartSession returns a handle that the relay keeps until it is destroyed
// (the daemon keeps the connection counted against its limits until both the session and the
// relay are gone).
//
// Certificate and key are PEM files read once at Create (a certificate chain file: leaf
// first). TLS 1.2 is the minimum version. Client certificates are not requested.
//
// Thread safety: Accept and the counters may be used from any thread.
#pragma once

// Boost 1.74's asio/awaitable.hpp uses std::exchange without including <utility>.
#include <utility>
// (must precede boost/asio.hpp)
#include <atomic>
#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "cache_daemon/config.h"
#include "common/status.h"

namespace kvtier::daemon {

class TlsFront {
 public:
  using GenericSocket = boost::asio::generic::stream_protocol::socket;
  // Receives the plaintext end for the front's session. Runs on the connection's strand.
  // Returns a handle the relay holds until it is destroyed (may be null).
  using StartSession = std::function<std::shared_ptr<void>(GenericSocket)>;

  // Relay buffer per direction and connection.
  static constexpr size_t kRelayChunkBytes = 64 * 1024;
  // How long a closing relay waits for the client's close_notify.
  static constexpr uint64_t kCloseNotifyWaitMs = 1000;

  // Loads and checks the certificate and key: InvalidArgument naming the file and OpenSSL's
  // reason for an unreadable or malformed file, or a key that does not match the certificate.
  // Uses cert_file, key_file, handshake_timeout_ms and handshakes_max. A relay whose write to
  // the client makes no progress for write_stall_ms is closed.
  static StatusOr<std::unique_ptr<TlsFront>> Create(const TlsServeOptions& options,
                                                    uint64_t write_stall_ms);

  // Takes an accepted TCP connection (its executor should be a strand). After a successful
  // handshake, start(plaintext socket) is called unless draining() is true by then; on a
  // failed or timed-out handshake the connection is closed and counted.
  void Accept(boost::asio::ip::tcp::socket socket, std::function<bool()> draining,
              StartSession start);

  // Counters (monotonic) and the handshakes in progress.
  struct Counters {
    uint64_t handshakes_ok = 0;
    uint64_t handshakes_failed = 0;    // bad or plaintext client hello, timeout, reset
    uint64_t handshakes_rejected = 0;  // over handshakes_max
    uint64_t handshakes_in_progress = 0;
    uint64_t relays_open = 0;
    uint64_t relays_stalled = 0;  // closed: a write to the client stalled for write_stall_ms
  };
  Counters counters() const;
  // Prometheus text of the counters (kvtier_tls_* families), appended to /metrics.
  std::string RenderPrometheus() const;

  // For the relay (tls_front.cc).
  struct State {
    TlsServeOptions options;
    uint64_t write_stall_ms = 0;
    boost::asio::ssl::context ctx{boost::asio::ssl::context::tls_server};
    std::atomic<uint64_t> handshakes_ok{0}, handshakes_failed{0}, handshakes_rejected{0};
    std::atomic<uint64_t> handshakes_in_progress{0}, relays_open{0}, relays_stalled{0};
  };

 private:
  TlsFront() = default;
  // Shared with live relays, which may outlive the TlsFront while the I/O threads stop.
  std::shared_ptr<State> state_ = std::make_shared<State>();
};

}  // namespace kvtier::daemon
