// Client side of TLS for the native protocol over TCP (kvtierd's [tls] native = true).
//
// TlsTunnel takes a connected TCP socket, completes the TLS handshake (verifying the
// daemon's certificate chain against ca_file, and that the certificate names server_name
// unless verify_hostname is off), then relays plaintext between that connection and one end
// of an AF_UNIX socketpair on its own thread. The client library talks to the other end
// exactly as to a plain TCP socket (client.cc is otherwise unchanged), and a single thread
// owns the OpenSSL connection, as OpenSSL requires.
//
// End of the tunnel: when the client shuts its end down, the relay sends close_notify and
// stops; when the daemon ends the TLS stream (or it fails), the relay flushes what it read
// and shuts the client's end down, so the client sees end-of-stream (its calls fail with
// IOError). SIGPIPE is never raised (blocked around OpenSSL's writes on the relay's thread
// and during the handshake, and consumed if pending, as libpq does).
//
// Thread safety: Open is thread-safe; a TlsTunnel is owned by one Client.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"

namespace kvtier::daemon {

struct TlsClientOptions {
  std::string ca_file;          // PEM CA bundle; "" -> OpenSSL's default trust store
  std::string server_name;      // certificate name to check and SNI (DNS name or IP address)
  bool verify_hostname = true;  // false: check the chain only (tests, pinned private CAs)
  uint64_t handshake_timeout_ms = 30000;
};

class TlsTunnel {
 public:
  // Relay buffer per direction.
  static constexpr size_t kChunkBytes = 64 * 1024;

  // Takes ownership of tcp_fd (closed on failure too). PermissionDenied when the daemon's
  // certificate does not verify (with OpenSSL's reason), IOError for a failed or timed-out
  // handshake (e.g. the port does not speak TLS), InvalidArgument for an unreadable ca_file.
  static StatusOr<std::unique_ptr<TlsTunnel>> Open(int tcp_fd, const TlsClientOptions& options);

  // Stops the relay and joins its thread; closes the TCP connection and the relay's end.
  ~TlsTunnel();

  // The client's end of the socketpair (a blocking AF_UNIX stream socket). Call once: the
  // caller owns it from then on and closes it; closing (or shutting down) it ends the tunnel.
  int TakeClientFd();

  class Impl;

 private:
  explicit TlsTunnel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvtier::daemon
