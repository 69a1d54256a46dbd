// Client side of TLS for the native protocol over TCP (kvtierd's [tls] native = true)
// (TlsTunnel), and both sides of the cluster's peer TLS ([cluster] peer_tls: mutual TLS,
// cluster/peer_*.h) (TlsConnection).
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
// IOError). SIGPIPE is never raised: OpenSSL reads and writes through a socket BIO of ours
// that sends with MSG_NOSIGNAL, and the relay sends to its end with MSG_NOSIGNAL too.
//
// TlsConnection is the same TLS connection (the same handshake, verification and options)
// without the relay: the thread using it calls Read and Write itself, for a connection used by
// one thread at a time (the cluster's peer connections), sparing the relay's two extra copies
// and thread hand-offs of every byte (docs/performance/daemon.md, "Peer TLS without the
// relay"). Its Accept is the server side, for a thread-per-connection front (the cluster's
// peer front): it requires the client's certificate and verifies it against ca_file, so only
// a holder of a certificate of that CA gets past the handshake.
//
// The certificate, key and CA files are read at each Open / Connect / Accept (a context per
// connection, so rotated files take effect on new connections); CheckTlsFiles reads them once
// up front, so a daemon refuses to start with a file it could not use.
//
// Thread safety: Open, Accept, Connect and CheckTlsFiles are thread-safe; a TlsTunnel is
// owned by one connection; a TlsConnection is used by one thread at a time.
#pragma once

#include <sys/types.h>

#include <cstddef>
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

// The server side (TlsConnection::Accept): our certificate chain and key, and the CA every
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

// A TLS connection its user drives (see the file comment). Its socket is non-blocking: Read
// and Write never wait, they say what to wait for. SIGPIPE is never raised by them.
class TlsConnection {
 public:
  // As TlsTunnel::Open (the same errors), without the relay.
  static StatusOr<std::unique_ptr<TlsConnection>> Connect(int tcp_fd,
                                                          const TlsClientOptions& options);
  // The server side: takes ownership of an accepted tcp_fd (closed on failure too).
  // PermissionDenied when the client sent no certificate or one that does not chain to
  // options.ca_file, IOError for a failed or timed-out handshake, InvalidArgument for an
  // unreadable file.
  static StatusOr<std::unique_ptr<TlsConnection>> Accept(int tcp_fd,
                                                         const TlsAcceptOptions& options);
  // Sends close_notify when it can without waiting, then closes the socket.
  ~TlsConnection();
  TlsConnection(const TlsConnection&) = delete;
  TlsConnection& operator=(const TlsConnection&) = delete;

  // As recv(2) and send(2) on a non-blocking socket: > 0 bytes read or written (a Write may
  // write part of data: call again with the rest); Read 0 at the end of the stream
  // (close_notify, or the TCP connection closed; a Write then fails with EPIPE); -1 with
  // errno EAGAIN when nothing can be done without waiting: poll fd() for *wait (POLLIN or
  // POLLOUT; TLS may need either way) and call again with the same arguments; -1 with another
  // errno when the connection failed (ECONNRESET, EPIPE, or EPROTO for a TLS error).
  ssize_t Read(void* out, size_t n, short* wait);
  ssize_t Write(const void* data, size_t n, short* wait);
  // Bytes already read from the socket and waiting in the connection (decrypted, or records
  // read ahead, perhaps only part of one): Read may return data without the socket being
  // readable, or, for part of a record, ask to wait.
  bool Buffered() const;
  int fd() const;

 private:
  explicit TlsConnection(std::unique_ptr<TlsTunnel::Impl> impl);
  std::unique_ptr<TlsTunnel::Impl> impl_;
};

}  // namespace kvtier::daemon
