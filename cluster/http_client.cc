#include "cluster/http_client.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "common/host_port.h"

namespace kvtier::cluster {
namespace {

using Clock = std::chrono::steady_clock;

int64_t MsLeft(Clock::time_point deadline) {
  auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left < 0 ? 0 : left;
}

// Connects a non-blocking socket to endpoint before deadline.
StatusOr<int> Connect(const HttpEndpoint& ep, Clock::time_point deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  std::string port = std::to_string(ep.port);
  int rc = ::getaddrinfo(ep.host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0) return Status::IOError("resolve " + ep.host + ": " + ::gai_strerror(rc));
  Status last = Status::IOError("no address for " + ep.host);
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
      last = Status::IOError("connect " + ep.ToString() + ": " + std::strerror(errno));
      ::close(fd);
      continue;
    }
    pollfd p{fd, POLLOUT, 0};
    int n = ::poll(&p, 1, static_cast<int>(MsLeft(deadline)));
    int err = 0;
    socklen_t len = sizeof(err);
    if (n == 1 && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0) {
      ::freeaddrinfo(res);
      return fd;
    }
    last = n == 0 ? Status::Retry("connect " + ep.ToString() + ": timed out")
                  : Status::IOError("connect " + ep.ToString() + ": " + std::strerror(err));
    ::close(fd);
  }
  ::freeaddrinfo(res);
  return last;
}

Status SendAll(int fd, std::string_view data, Clock::time_point deadline) {
  while (!data.empty()) {
    ssize_t k = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (k > 0) {
      data.remove_prefix(static_cast<size_t>(k));
      continue;
    }
    if (k < 0 && errno != EAGAIN && errno != EINTR) {
      return Status::IOError(std::string("send: ") + std::strerror(errno));
    }
    pollfd p{fd, POLLOUT, 0};
    if (::poll(&p, 1, static_cast<int>(MsLeft(deadline))) == 0) {
      return Status::Retry("send: timed out");
    }
  }
  return Status::Ok();
}

}  // namespace

std::string HttpEndpoint::ToString() const { return host + ":" + std::to_string(port); }

StatusOr<HttpEndpoint> ParseHttpEndpoint(std::string_view text) {
  std::string_view s = text;
  if (s.starts_with("http://")) s.remove_prefix(7);
  if (s.ends_with("/")) s.remove_suffix(1);
  StatusOr<HostPort> hp = ParseHostPort(s);
  if (!hp.ok()) {
    return Status::InvalidArgument("endpoint '" + std::string(text) +
                                   "': want host:port or http://host:port (" +
                                   hp.status().message() + ")");
  }
  return HttpEndpoint{std::move(hp->host), hp->port};
}

HttpStream::~HttpStream() {
  if (fd_ >= 0) ::close(fd_);
}

Status HttpStream::Fill(uint64_t wait_ms) {
  pollfd p{fd_, POLLIN, 0};
  int n = ::poll(&p, 1, static_cast<int>(wait_ms));
  if (n == 0) return Status::Retry("no data within " + std::to_string(wait_ms) + " ms");
  if (n < 0 && errno != EINTR) return Status::IOError(std::string("poll: ") + strerror(errno));
  char tmp[65536];
  ssize_t k = ::recv(fd_, tmp, sizeof(tmp), 0);
  if (k == 0) return Status::NotFound("connection closed");
  if (k < 0) {
    if (errno == EAGAIN || errno == EINTR) return Status::Retry("no data yet");
    return Status::IOError(std::string("recv: ") + std::strerror(errno));
  }
  parser_->Append(std::string_view(tmp, static_cast<size_t>(k)));
  return Status::Ok();
}

Status CheckBearerToken(std::string_view token) {
  for (char c : token) {
    if (c < 0x21 || c > 0x7e) {
      return Status::InvalidArgument("bearer token: a byte outside printable ASCII");
    }
  }
  return Status::Ok();
}

Status HttpStream::Open(const HttpEndpoint& endpoint, std::string_view path, std::string_view body,
                        const HttpLimits& limits, std::string_view method,
                        std::string_view bearer_token) {
  KVTIER_RETURN_IF_ERROR(CheckBearerToken(bearer_token));
  auto deadline = Clock::now() + std::chrono::milliseconds(limits.timeout_ms);
  parser_.emplace(limits.head_bytes_max, limits.chunk_bytes_max);
  KVTIER_ASSIGN_OR_RETURN(fd_, Connect(endpoint, deadline));
  const bool get = method == "GET";
  if (get) body = {};
  std::string req =
      std::string(get ? "GET " : "POST ") + std::string(path) +
      " HTTP/1.1\r\nHost: " + endpoint.ToString() + "\r\nConnection: close\r\n" +
      (bearer_token.empty() ? std::string()
                            : "Authorization: Bearer " + std::string(bearer_token) + "\r\n") +
      (get ? "" : "Content-Type: application/json\r\n") +
      "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n";
  req.append(body);
  KVTIER_RETURN_IF_ERROR(SendAll(fd_, req, deadline));

  for (;;) {
    Status head = parser_->ParseHead();
    if (head.ok()) break;
    if (!head.IsRetry()) return head;
    if (MsLeft(deadline) == 0) return Status::Retry("response head: timed out");
    Status s = Fill(static_cast<uint64_t>(MsLeft(deadline)));
    if (s.IsNotFound()) return parser_->Closed();
    if (!s.ok() && !s.IsRetry()) return s;
  }
  status_ = parser_->status();
  return Status::Ok();
}

Status HttpStream::Read(uint64_t wait_ms, std::string* out) {
  if (!parser_.has_value()) return Status::InvalidArgument("HttpStream::Read before Open");
  auto deadline = Clock::now() + std::chrono::milliseconds(wait_ms);
  for (;;) {
    const size_t before = out->size();
    KVTIER_RETURN_IF_ERROR(parser_->TakeBody(out));
    if (out->size() > before) return Status::Ok();
    if (parser_->done()) return Status::NotFound("body ended");
    Status s = Fill(static_cast<uint64_t>(MsLeft(deadline)));
    if (s.IsNotFound()) return parser_->Closed();
    if (!s.ok()) return s;
  }
}

namespace {

StatusOr<HttpResponse> HttpCall(const HttpEndpoint& endpoint, std::string_view method,
                                std::string_view path, std::string_view body,
                                const HttpLimits& limits, std::string_view bearer_token = {}) {
  auto deadline = Clock::now() + std::chrono::milliseconds(limits.timeout_ms);
  HttpStream stream;
  KVTIER_RETURN_IF_ERROR(stream.Open(endpoint, path, body, limits, method, bearer_token));
  HttpResponse response;
  response.status = stream.status();
  for (;;) {
    uint64_t left = static_cast<uint64_t>(MsLeft(deadline));
    if (left == 0) return Status::Retry("response body: timed out");
    Status s = stream.Read(left, &response.body);
    if (s.IsNotFound()) break;
    if (!s.ok()) return s;
    if (response.body.size() > limits.body_bytes_max) {
      return Status::Rejected("response body over " + std::to_string(limits.body_bytes_max) +
                              " bytes");
    }
  }
  return response;
}

}  // namespace

StatusOr<HttpResponse> HttpPost(const HttpEndpoint& endpoint, std::string_view path,
                                std::string_view body, const HttpLimits& limits) {
  return HttpCall(endpoint, "POST", path, body, limits);
}

StatusOr<HttpResponse> HttpGet(const HttpEndpoint& endpoint, std::string_view path,
                               const HttpLimits& limits, std::string_view bearer_token) {
  return HttpCall(endpoint, "GET", path, {}, limits, bearer_token);
}

}  // namespace kvtier::cluster
