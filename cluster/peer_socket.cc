#include "cluster/peer_socket.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <utility>

namespace kvtier::cluster {

PeerSocket::PeerSocket(PeerSocket&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), tls_(std::move(other.tls_)) {}

PeerSocket& PeerSocket::operator=(PeerSocket&& other) noexcept {
  if (this != &other) {
    Close();
    fd_ = std::exchange(other.fd_, -1);
    tls_ = std::move(other.tls_);
  }
  return *this;
}

void PeerSocket::Close() {
  if (tls_ != nullptr) {
    tls_.reset();  // closes fd_
  } else if (fd_ >= 0) {
    ::close(fd_);
  }
  fd_ = -1;
}

int PeerSocket::Release() {
  if (tls_ != nullptr) return -1;
  return std::exchange(fd_, -1);
}

ssize_t PeerSocket::Read(void* out, size_t n, short* wait) {
  if (tls_ != nullptr) return tls_->Read(out, n, wait);
  *wait = POLLIN;
  return ::recv(fd_, out, n, MSG_DONTWAIT);
}

ssize_t PeerSocket::Write(const void* data, size_t n, short* wait) {
  if (tls_ != nullptr) return tls_->Write(data, n, wait);
  *wait = POLLOUT;
  return ::send(fd_, data, n, MSG_DONTWAIT | MSG_NOSIGNAL);
}

}  // namespace kvtier::cluster
