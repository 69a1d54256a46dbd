// Test helpers: free loopback ports, raw Unix/TCP sockets and a tiny HTTP client.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace kvtier::testing {

// A loopback TCP port that was free a moment ago.
inline uint16_t FreePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

inline int ConnectTcp(uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
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
  std::string resp = RecvFor(fd, 1 << 24, 5000);
  ::close(fd);
  return resp;
}

}  // namespace kvtier::testing
