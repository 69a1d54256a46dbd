// Client side of TLS for the native protocol over TCP (kvtierd's [tls] native = true), and
// both sides of the cluster's peer TLS ([cluster] peer_tls: mutual TLS, cluster/peer_*.h).
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
// Accept is the server side of the same tunnel for a blocking, thread-per-connection front
// (the cluster's peer front): it requires the client's certificate and verifies it against
// ca_file, so only a holder of a certificate of that CA gets past the handshake.
//
// The certificate, key and CA files are read at each Open / Accept (a tunnel per pooled
// connection, so rotated files take effect on new connections); CheckTlsFiles reads them once
// up front, so a daemon refuses to start with a file it could not use.
//
// Thread safety: Open, Accept and CheckTlsFiles are thread-safe; a TlsTunnel is owned by one
// connection.
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
  // A client certificate chain (leaf first) and its unencrypted key, PEM, for servers that
  // require one (the cluster's peer front); both "" -> none.
  std::string cert_file, key_file;
};

// The server side (TlsTunnel::Accept): our certificate chain and key, and the CA every
// client certificate must chain to. All three are required.
struct TlsAcceptOptions {
  std::string cert_file, key_file, ca_file;
  uint64_t handshake_timeout_ms = 10000;
};

// Loads cert_file + key_file (checking that they match) and ca_file once: InvalidArgument
// naming the file and OpenSSL's reason otherwise. `what` prefixes the message (a config key).
Status CheckTlsFiles(const TlsAcceptOptions& options, const std::string& what);

class TlsTunnel {
 public:
  // Relay buffer per direction.
  static constexpr size_t kChunkBytes = 64 * 1024;

  // Takes ownership of tcp_fd (closed on failure too). PermissionDenied when the daemon's
  // certificate does not verify (with OpenSSL's reason), IOError for a failed or timed-out
  // handshake (e.g. the port does not speak TLS), InvalidArgument for an unreadable ca_file.
  static StatusOr<std::unique_ptr<TlsTunnel>> Open(int tcp_fd, const TlsClientOptions& options);

  // The server side: takes ownership of an accepted tcp_fd (closed on failure too).
  // PermissionDenied when the client sent no certificate or one that does not chain to
  // options.ca_file, IOError for a failed or timed-out handshake, InvalidArgument for an
  // unreadable file.
  static StatusOr<std::unique_ptr<TlsTunnel>> Accept(int tcp_fd, const TlsAcceptOptions& options);

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
