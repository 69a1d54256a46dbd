// A raw native-protocol connection for hostile-client tests: frames are built and sent by
// hand (pipelined, truncated, out of order), replies read one frame at a time with a deadline.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "cache_daemon/wire.h"
#include "tests/cache_daemon/net_util.h"

namespace kvtier::testing {

struct RawReply {
  daemon::wire::FrameHeader header;
  StatusCode code = StatusCode::kOk;
  std::vector<uint8_t> body;  // the whole body (status prefix included)
  int fd = -1;                // a descriptor that came with the reply (SHM_ATTACH)
};

class RawNative {
 public:
  RawNative() = default;
  explicit RawNative(int fd) : fd_(fd) {}
  RawNative(RawNative&& o) noexcept : fd_(o.fd_), buf_(std::move(o.buf_)) { o.fd_ = -1; }
  RawNative& operator=(RawNative&& o) noexcept {
    Close();
    fd_ = o.fd_;
    buf_ = std::move(o.buf_);
    o.fd_ = -1;
    return *this;
  }
  ~RawNative() { Close(); }

  static RawNative Unix(const std::string& path) { return RawNative(ConnectUnix(path)); }
  // from_ip: the connection's source address (ConnectTcp).
  static RawNative Tcp(uint16_t port, const char* from_ip = nullptr) {
    return RawNative(ConnectTcp(port, 0, from_ip));
  }

  bool ok() const { return fd_ >= 0; }
  int fd() const { return fd_; }
  void Close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  bool Send(std::span<const uint8_t> bytes) { return SendAllRaw(fd_, bytes.data(), bytes.size()); }
  bool SendFrame(daemon::wire::Opcode op, uint64_t id, std::span<const uint8_t> body,
                 uint16_t flags = 0) {
    auto f = daemon::wire::BuildFrame(static_cast<uint8_t>(op), flags, id, body);
    return Send(f);
  }

  // Reads the next reply frame within timeout_ms; nullopt on timeout, close or bad framing.
  std::optional<RawReply> Read(int timeout_ms = 5000) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    RawReply r;
    for (;;) {
      if (buf_.size() >= daemon::wire::kHeaderBytes) {
        std::span<const uint8_t, daemon::wire::kHeaderBytes> head(buf_.data(),
                                                                  daemon::wire::kHeaderBytes);
        auto h = daemon::wire::DecodeHeader(head, uint64_t{1} << 32);
        if (!h.ok()) return std::nullopt;
        size_t total = size_t{h->length} + 4;
        if (buf_.size() >= total) {
          r.header = *h;
          r.body.assign(buf_.begin() + daemon::wire::kHeaderBytes, buf_.begin() + total);
          buf_.erase(buf_.begin(), buf_.begin() + static_cast<ptrdiff_t>(total));
          if (!r.body.empty()) r.code = static_cast<StatusCode>(r.body[0]);
          return r;
        }
      }
      int left = MsLeft(deadline);
      if (left <= 0) return std::nullopt;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, left) <= 0) return std::nullopt;
      uint8_t chunk[65536];
      msghdr msg{};
      iovec iov{chunk, sizeof(chunk)};
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      ssize_t n = ::recvmsg(fd_, &msg, MSG_CMSG_CLOEXEC);
      if (n <= 0) return std::nullopt;
      for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
          std::memcpy(&r.fd, CMSG_DATA(c), sizeof(int));
        }
      }
      buf_.insert(buf_.end(), chunk, chunk + n);
    }
  }

  // True when the daemon closes the connection within timeout_ms (replies are skipped).
  bool ClosedWithin(int timeout_ms) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    for (;;) {
      int left = MsLeft(deadline);
      if (left <= 0) return false;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, left) <= 0) return false;
      char chunk[65536];
      ssize_t n = ::recv(fd_, chunk, sizeof(chunk), 0);
      if (n <= 0) return true;
    }
  }

  // True when the daemon closes the connection within timeout_ms, seen without reading
  // (a read would let a stalled reply move): on a Unix socket the peer's close shows as a
  // hang-up even while replies are still queued to this end. Not for TCP, where the FIN comes
  // after the unread data.
  bool HungUpWithin(int timeout_ms) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    for (;;) {
      int left = MsLeft(deadline);
      if (left <= 0) return false;
      pollfd p{fd_, POLLRDHUP, 0};
      int r = ::poll(&p, 1, left);
      if (r < 0 && errno == EINTR) continue;
      return r == 1 && (p.revents & (POLLRDHUP | POLLHUP)) != 0;
    }
  }

  // HELLO with token; true when answered OK.
  bool Hello(const std::string& token, uint64_t id = 1) {
    daemon::wire::HelloRequest h;
    h.token = token;
    if (!SendFrame(daemon::wire::Opcode::kHello, id, daemon::wire::EncodeHello(h))) return false;
    auto r = Read();
    return r && r->code == StatusCode::kOk;
  }

 private:
  // Milliseconds from now until deadline (0 or less once it has passed).
  static int MsLeft(std::chrono::steady_clock::time_point deadline) {
    return static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                deadline - std::chrono::steady_clock::now())
                                .count());
  }

  int fd_ = -1;
  std::vector<uint8_t> buf_;
};

// A native PUT body of one unit with an inline value (or a shared-memory range).
inline std::vector<uint8_t> PutBody(const daemon::wire::Key& key, std::span<const uint8_t> value,
                                    bool shm = false, uint64_t offset = 0) {
  daemon::wire::PutRequest req;
  daemon::wire::PutUnit u;
  u.key = key;
  u.value = value;
  u.value_offset = offset;
  u.value_bytes = static_cast<uint32_t>(value.size());
  req.units.push_back(u);
  return daemon::wire::EncodePut(req, shm);
}

inline std::vector<uint8_t> GetBody(const daemon::wire::Key& key, bool shm = false,
                                    uint64_t offset = 0, uint64_t capacity = 0) {
  daemon::wire::GetRequest req;
  req.keys = {key};
  req.dst_offset = offset;
  req.dst_capacity = capacity;
  return daemon::wire::EncodeGet(req, shm);
}

}  // namespace kvtier::testing
