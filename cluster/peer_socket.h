// PeerSocket: the byte stream of one peer connection (cluster/peer_client.h, peer_server.h),
// plain TCP or TLS ([cluster] peer_tls) driven by the thread that uses the connection
// (daemon::TlsConnection: no relay thread, no socket pair), behind one non-blocking contract,
// so that the peer protocol's code is the same for both.
//
//   PeerSocket s(fd);                        // or PeerSocket(std::move(tls_connection))
//   short wait = 0;
//   ssize_t n = s.Read(buf, sizeof(buf), &wait);
//   if (n < 0 && errno == EAGAIN) { pollfd p{s.fd(), wait, 0}; poll(&p, 1, ms); }
//
// Thread safety: used by one thread at a time.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <memory>

#include "cache_daemon/tls_client.h"

namespace kvtier::cluster {

class PeerSocket {
 public:
  PeerSocket() = default;
  explicit PeerSocket(int tcp_fd) : fd_(tcp_fd) {}  // owns it
  explicit PeerSocket(std::unique_ptr<daemon::TlsConnection> tls)
      : fd_(tls->fd()), tls_(std::move(tls)) {}
  ~PeerSocket() { Close(); }
  PeerSocket(PeerSocket&& other) noexcept;
  PeerSocket& operator=(PeerSocket&& other) noexcept;
  PeerSocket(const PeerSocket&) = delete;
  PeerSocket& operator=(const PeerSocket&) = delete;

  int fd() const { return fd_; }

  // recv(2) / send(2) on a non-blocking socket, never raising SIGPIPE (TlsConnection::Read
  // and Write's contract): > 0 bytes; Read 0 at the end of the stream; -1 with errno EAGAIN:
  // poll fd() for *wait and call again with the same arguments; -1 with another errno: the
  // connection failed.
  ssize_t Read(void* out, size_t n, short* wait);
  ssize_t Write(const void* data, size_t n, short* wait);
  // Bytes already read from the socket (TLS records read ahead, perhaps part of one only):
  // Read may return data without the socket being readable, so poll before a Read only
  // when this is false or the last Read would have blocked.
  bool Buffered() const { return tls_ != nullptr && tls_->Buffered(); }

  // Closes the connection (with TLS, close_notify first when it can be sent without waiting).
  void Close();
  // A plain socket's descriptor, no longer owned (for a TLS handshake to take); -1 when none
  // or when it is TLS already.
  int Release();

 private:
  int fd_ = -1;
  std::unique_ptr<daemon::TlsConnection> tls_;  // owns fd_ when set
};

}  // namespace kvtier::cluster
