// Test helpers: free loopback ports, raw Unix/TCP sockets and a tiny HTTP client.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <string>
#include <string_view>
#include <vector>

namespace kvtier::testing {

// True when a loopback TCP port can be bound now (without SO_REUSEADDR: a port still in
// TIME_WAIT counts as taken).
inline bool PortBindable(uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

// Holds a loopback TCP port: a socket bound (without SO_REUSEADDR) and listening on it, so that
// a server starting on that port fails with "Address already in use". -1 when the port could
// not be bound; close() the descriptor to free the port.
inline int ListenTcp(uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || ::listen(fd, 1) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Lowest port FreePort() hands out (below it: well-known and registered services).
inline constexpr uint16_t kFreePortLow = 10000;
// Random candidates FreePort() tries before falling back to a kernel-chosen port.
inline constexpr int kFreePortTriesMax = 1000;
// FreePort() never repeats one of the last this-many ports it handed out in this process
// (a window, not all of them: a long --gtest_repeat run would exhaust the range).
inline constexpr size_t kFreePortRecentMax = 1024;

// A loopback TCP port that was free a moment ago, for a server the caller starts next.
// Never one of the last kFreePortRecentMax this process got (so a fixture's ports are
// distinct), and chosen at
// random below the kernel's ephemeral range (net.ipv4.ip_local_port_range): a port from
// bind(0) is one the kernel hands out again to any outgoing connection or bind(0) on the
// host, so on a busy host (parallel ctest) another process took it before the server bound
// it ("Address already in use", or a client reaching the wrong server). A port outside the
// range is taken only by a process that names it, such as another test that picked the
// same one: fixtures that must not fail then retry their start (AddressInUse()). Falls back
// to bind(0) when the range leaves no room below it. Thread-safe.
inline uint16_t FreePort() {
  static std::mutex mu;
  static std::deque<uint16_t> recent;  // the last handed out, oldest first; protected by mu
  static std::mt19937 rng(std::random_device{}() ^ static_cast<uint32_t>(::getpid()));
  std::lock_guard<std::mutex> lock(mu);
  auto given = [&](uint16_t port) {
    return std::find(recent.begin(), recent.end(), port) != recent.end();
  };
  auto hand_out = [&](uint16_t port) {
    recent.push_back(port);
    if (recent.size() > kFreePortRecentMax) recent.pop_front();
    return port;
  };
  unsigned ephemeral_low = 32768, ephemeral_high = 60999;
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    if (std::fscanf(f, "%u %u", &ephemeral_low, &ephemeral_high) != 2) ephemeral_low = 32768;
    std::fclose(f);
  }
  if (ephemeral_low > kFreePortLow + 1000u) {
    std::uniform_int_distribution<unsigned> pick(kFreePortLow, ephemeral_low - 1);
    for (int i = 0; i < kFreePortTriesMax; ++i) {
      const auto port = static_cast<uint16_t>(pick(rng));
      if (!given(port) && PortBindable(port)) return hand_out(port);
    }
  }
  for (int i = 0; i < kFreePortTriesMax; ++i) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    socklen_t len = sizeof(a);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    ::close(fd);
    const uint16_t port = ntohs(a.sin_port);
    if (!given(port)) return hand_out(port);
  }
  return 0;
}

// Times a fixture picks new ports and starts its server again when one of its FreePort()
// ports was bound by another process first.
inline constexpr int kAddressInUseAttemptsMax = 5;

// True when a start failed because a port was taken (the daemon's "bind ...: Address
// already in use"): the fixture should retry with new ports.
inline bool AddressInUse(std::string_view message) {
  return message.find("Address already in use") != std::string_view::npos;
}

// A TCP connection to 127.0.0.1:port, or -1. rcvbuf_bytes > 0 sets SO_RCVBUF before the
// connect (so the window the peer sees stays that small). from_ip (an IPv4 address of this
// host, e.g. 127.0.0.2: all of 127/8 is loopback on Linux) is the connection's source address
// (nullptr: the kernel's choice, 127.0.0.1).
inline int ConnectTcp(uint16_t port, int rcvbuf_bytes = 0, const char* from_ip = nullptr) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (rcvbuf_bytes > 0)
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf_bytes, sizeof(rcvbuf_bytes));
  if (from_ip != nullptr) {
    sockaddr_in from{};
    from.sin_family = AF_INET;
    if (::inet_pton(AF_INET, from_ip, &from.sin_addr) != 1 ||
        ::bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof(from)) != 0) {
      ::close(fd);
      return -1;
    }
  }
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// A Unix stream socket bound to `path` (an old file there removed first) and listening with
// `backlog`; -1 on failure.
inline int ListenUnix(const std::string& path, int backlog) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::snprintf(a.sun_path, sizeof(a.sun_path), "%s", path.c_str());
  ::unlink(path.c_str());
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || ::listen(fd, backlog) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

inline int ConnectUnix(const std::string& path) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::strncpy(a.sun_path, path.c_str(), sizeof(a.sun_path) - 1);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

inline bool SendAllRaw(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

// Reads until `want` bytes, EOF or timeout. Returns what arrived; *eof set on orderly close.
inline std::string RecvFor(int fd, size_t want, int timeout_ms, bool* eof = nullptr) {
  std::string out;
  if (eof) *eof = false;
  while (out.size() < want) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, timeout_ms) <= 0) break;
    char buf[65536];
    ssize_t k = ::recv(fd, buf, sizeof(buf), 0);
    if (k <= 0) {
      if (eof) *eof = true;
      break;
    }
    out.append(buf, static_cast<size_t>(k));
  }
  return out;
}

// One HTTP/1.1 request with Connection: close; returns the whole response text.
inline std::string HttpRequest(uint16_t port, const std::string& method, const std::string& path,
                               const std::string& body = "", const std::string& headers = "") {
  int fd = ConnectTcp(port);
  if (fd < 0) return "";
  std::string req = method + " " + path + " HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n" +
                    headers + "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  SendAllRaw(fd, req.data(), req.size());
  // Up to 30 s of silence: a request queued behind others (serve's admission) gets no byte
  // until it runs, seconds later in a sanitizer build.
  std::string resp = RecvFor(fd, 1 << 24, 30000);
  ::close(fd);
  return resp;
}

// Clients that have each sent one request and wait for its reply, some perhaps still in a
// server's listen backlog (a full descriptor table). Closes them all when destroyed.
class WaitingClients {
 public:
  // `fds`: connected sockets, each with its request sent; a reply must start with
  // `reply_prefix`.
  WaitingClients(std::vector<int> fds, std::string reply_prefix)
      : fds_(std::move(fds)), answered_(fds_.size(), false), prefix_(std::move(reply_prefix)) {}
  ~WaitingClients() {
    for (int fd : fds_) {
      if (fd >= 0) ::close(fd);
    }
  }
  WaitingClients(const WaitingClients&) = delete;
  WaitingClients& operator=(const WaitingClients&) = delete;

  // Reads the replies that arrive until none has for `quiet_ms`; returns how many clients
  // have been answered so far.
  size_t Collect(int quiet_ms) {
    for (;;) {
      std::vector<pollfd> polls;
      for (size_t i = 0; i < fds_.size(); ++i) {
        if (!answered_[i] && fds_[i] >= 0) polls.push_back({fds_[i], POLLIN, 0});
      }
      if (polls.empty() || ::poll(polls.data(), polls.size(), quiet_ms) <= 0) break;
      for (const pollfd& p : polls) {
        if (p.revents == 0) continue;
        const auto i =
            static_cast<size_t>(std::find(fds_.begin(), fds_.end(), p.fd) - fds_.begin());
        const std::string reply = RecvFor(p.fd, prefix_.size(), 5000);  // may read more
        if (reply.compare(0, prefix_.size(), prefix_) != 0) ++wrong_replies_;
        answered_[i] = true;
      }
    }
    return static_cast<size_t>(std::count(answered_.begin(), answered_.end(), true));
  }
  // Closes the answered clients (freeing the server's descriptors for the waiting ones).
  void CloseAnswered() {
    for (size_t i = 0; i < fds_.size(); ++i) {
      if (answered_[i] && fds_[i] >= 0) {
        ::close(fds_[i]);
        fds_[i] = -1;
      }
    }
  }
  // Collects and closes the answered clients in rounds until every client was answered or
  // a round of `quiet_ms` brought nothing new; returns how many were answered.
  size_t CollectAllByClosing(int quiet_ms) {
    size_t answered = Collect(quiet_ms);
    for (size_t before = 0; answered < fds_.size() && answered > before;) {
      before = answered;
      CloseAnswered();
      answered = Collect(quiet_ms);
    }
    return answered;
  }
  // Replies that did not start with the prefix (or were cut short).
  size_t wrong_replies() const { return wrong_replies_; }
  size_t size() const { return fds_.size(); }

 private:
  std::vector<int> fds_;
  std::vector<bool> answered_;
  std::string prefix_;
  size_t wrong_replies_ = 0;
};

}  // namespace kvtier::testing
