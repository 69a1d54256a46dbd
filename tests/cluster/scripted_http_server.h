// ScriptedHttpServer: an HTTP server on a free loopback port that answers each request with the
// next response of a fixed list (round robin), byte for byte as given (malformed on purpose, if
// the test wants), then closes the connection; a request whose text holds every one of
// `special_needles` gets `special_response` instead. For the etcd client's tests: etcd, a proxy
// in front of it, or something else that answers at an etcd endpoint.
#pragma once

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <charconv>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "tests/cache_daemon/net_util.h"

namespace kvtier::testing {

// A 200 response carrying body with a Content-Length.
inline std::string HttpOk(const std::string& body) {
  return "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: " +
         std::to_string(body.size()) + "\r\n\r\n" + body;
}

// A 200 response whose chunked body is `line` and a newline (one message of a watch stream).
inline std::string HttpOkChunkedLine(const std::string& line) {
  char size[32];
  std::snprintf(size, sizeof(size), "%zx\r\n", line.size() + 1);
  return "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + std::string(size) + line +
         "\n\r\n0\r\n\r\n";
}

class ScriptedHttpServer {
 public:
  explicit ScriptedHttpServer(std::vector<std::string> responses,
                              std::vector<std::string> special_needles = {},
                              std::string special_response = {})
      : responses_(std::move(responses)),
        special_needles_(std::move(special_needles)),
        special_response_(std::move(special_response)) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    socklen_t len = sizeof(a);
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    EXPECT_EQ(::listen(listen_fd_, 64), 0);
    thread_ = std::thread([this] { Serve(); });
  }
  explicit ScriptedHttpServer(std::string response)
      : ScriptedHttpServer(std::vector<std::string>{std::move(response)}) {}
  ~ScriptedHttpServer() {
    stop_.store(true);
    thread_.join();
    ::close(listen_fd_);
  }
  ScriptedHttpServer(const ScriptedHttpServer&) = delete;
  ScriptedHttpServer& operator=(const ScriptedHttpServer&) = delete;

  std::string endpoint() const { return "127.0.0.1:" + std::to_string(port_); }
  uint64_t served() const { return served_.load(); }

 private:
  void Serve() {
    while (!stop_.load()) {
      pollfd p{listen_fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) != 1) continue;
      int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      const std::string request = ReadRequest(fd);
      bool special = !special_needles_.empty();
      for (const std::string& needle : special_needles_) {
        special = special && request.find(needle) != std::string::npos;
      }
      const std::string& r =
          special ? special_response_ : responses_[served_.load() % responses_.size()];
      SendAllRaw(fd, r.data(), r.size());
      served_.fetch_add(1);
      ::shutdown(fd, SHUT_RDWR);
      ::close(fd);
    }
  }
  // The request's head and its Content-Length bytes of body (each wait at most 1 s; the body at
  // most kRequestBytesMax).
  static std::string ReadRequest(int fd) {
    constexpr size_t kRequestBytesMax = 1 << 20;
    std::string in;
    size_t want = std::string::npos;
    char buf[4096];
    while ((want == std::string::npos || in.size() < want) && in.size() < kRequestBytesMax) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 1000) != 1) return in;
      ssize_t k = ::recv(fd, buf, sizeof(buf), 0);
      if (k <= 0) return in;
      in.append(buf, static_cast<size_t>(k));
      const size_t head_end = in.find("\r\n\r\n");
      if (want == std::string::npos && head_end != std::string::npos) {
        size_t length = 0;
        if (const size_t cl = in.find("Content-Length: ");
            cl != std::string::npos && cl < head_end) {
          std::from_chars(in.data() + cl + 16, in.data() + head_end, length);
        }
        want = head_end + 4 + length;
      }
    }
    return in;
  }

  std::vector<std::string> responses_;
  std::vector<std::string> special_needles_;
  std::string special_response_;
  int listen_fd_ = -1;
  uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> served_{0};
  std::thread thread_;
};

}  // namespace kvtier::testing
