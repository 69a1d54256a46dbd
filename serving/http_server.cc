#include "serving/http_server.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/beast/core/string.hpp>
#include <boost/beast/http.hpp>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <system_error>

#include "common/logging.h"
#include "serving/openai_api.h"

namespace kvtier::serving {
namespace {

namespace http = boost::beast::http;
using Clock = std::chrono::steady_clock;

constexpr int kPollSliceMs = 200;  // how often blocked loops look at the stop flag
// After refusing a request whose rest is still arriving, how long and how much of it is read
// and dropped before the close: closing with unread bytes makes the kernel answer with a reset,
// which can destroy the refusal before the client reads it.
constexpr int64_t kLingerMs = 2000;
constexpr size_t kLingerBytesMax = 4 << 20;

// Ends the server's side of `fd` and drops what the client still sends, until it closes too,
// kLingerMs pass, kLingerBytesMax arrive or `stop` is set.
void LingerBeforeClose(int fd, const std::atomic<bool>& stop) {
  ::shutdown(fd, SHUT_WR);
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(kLingerMs);
  char sink[16384];
  size_t dropped_bytes = 0;
  while (!stop.load() && dropped_bytes < kLingerBytesMax) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                          until - std::chrono::steady_clock::now())
                          .count();
    if (left <= 0) return;
    pollfd p{fd, POLLIN, 0};
    const int r = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left, kPollSliceMs)));
    if (r < 0 && errno != EINTR) return;
    if (r <= 0) continue;
    const ssize_t n = ::recv(fd, sink, sizeof(sink), 0);
    if (n <= 0) return;
    dropped_bytes += static_cast<size_t>(n);
  }
}

std::string ErrorJson(int status, const std::string& message, const char* code) {
  ApiError e;
  e.status = status;
  e.message = message;
  e.type = status >= 500 ? "server_error" : "invalid_request_error";
  e.code = code;
  return e.ToJson();
}

// Writes all of `data` or fails (timeout without progress, error, or stop).
bool WriteAll(int fd, std::string_view data, uint64_t timeout_ms) {
  while (!data.empty()) {
    pollfd p{fd, POLLOUT, 0};
    int r = ::poll(&p, 1, static_cast<int>(timeout_ms));
    if (r <= 0) return false;
    ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return false;
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

class Connection final : public HttpResponder {
 public:
  Connection(int fd, uint64_t timeout_ms) : fd_(fd), timeout_ms_(timeout_ms) {}
  bool Reply(int status, std::string_view content_type, std::string_view body) override {
    std::string head = Head(status, content_type);
    head += "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n";
    replied_ = true;
    status_ = status;
    return ok_ = ok_ && WriteAll(fd_, head, timeout_ms_) && WriteAll(fd_, body, timeout_ms_);
  }
  bool BeginStream(int status, std::string_view content_type) override {
    std::string head = Head(status, content_type);
    head += "Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n";
    replied_ = true;
    status_ = status;
    return ok_ = ok_ && WriteAll(fd_, head, timeout_ms_);
  }
  bool Chunk(std::string_view data) override {
    if (data.empty()) return ok_;
    char size[32];
    std::snprintf(size, sizeof(size), "%zx\r\n", data.size());
    return ok_ = ok_ && WriteAll(fd_, size, timeout_ms_) && WriteAll(fd_, data, timeout_ms_) &&
                 WriteAll(fd_, "\r\n", timeout_ms_);
  }
  bool EndStream() override { return ok_ = ok_ && WriteAll(fd_, "0\r\n\r\n", timeout_ms_); }
  bool PeerGone() override {
    if (!ok_) return true;
    pollfd p{fd_, POLLRDHUP, 0};
    return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
  }

  bool keep_alive = true;
  bool replied_ = false;
  bool ok_ = true;
  int status_ = 0;

 private:
  std::string Head(int status, std::string_view content_type) const {
    std::string h = "HTTP/1.1 " + std::to_string(status) + " ";
    h += std::string(http::obsolete_reason(static_cast<http::status>(status)));
    h += "\r\nServer: kvtier-engine\r\nContent-Type: ";
    h += content_type;
    h += keep_alive ? "\r\nConnection: keep-alive\r\n" : "\r\nConnection: close\r\n";
    return h;
  }
  int fd_;
  uint64_t timeout_ms_;
};

}  // namespace

StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const HttpOptions& options,
                                                        HttpHandler handler,
                                                        ServingMetrics* metrics) {
  if (options.connections_max == 0 || options.header_bytes_max == 0 ||
      options.body_bytes_max == 0 || options.idle_timeout_ms == 0)
    return Status::InvalidArgument("serve: HTTP limits must be > 0");
  if (options.send_buffer_bytes > kSendBufferBytesMax)
    return Status::InvalidArgument("serve: send_buffer_bytes over 64 MiB");
  addrinfo hints{};
  hints.ai_flags = AI_NUMERICHOST | AI_PASSIVE;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(options.port);
  if (int rc = ::getaddrinfo(options.listen_host.c_str(), port.c_str(), &hints, &res); rc != 0)
    return Status::InvalidArgument("serve: bad listen address '" + options.listen_host +
                                   "': " + ::gai_strerror(rc));
  std::unique_ptr<HttpServer> s(new HttpServer(options, std::move(handler), metrics));
  int fd = ::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (fd < 0 || ::bind(fd, res->ai_addr, res->ai_addrlen) != 0 || ::listen(fd, 128) != 0) {
    const std::string err = std::strerror(errno);
    ::freeaddrinfo(res);
    if (fd >= 0) ::close(fd);
    return Status::IOError("serve: cannot listen on " + options.listen_host + ":" + port + ": " +
                           err);
  }
  ::freeaddrinfo(res);
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  s->port_ = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                              : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  s->listen_fd_ = fd;
  s->acceptor_ = std::thread([p = s.get()] { p->AcceptLoop(); });
  return s;
}

HttpServer::~HttpServer() { Stop(); }

void HttpServer::Stop() {
  stop_.store(true);
  if (acceptor_.joinable()) acceptor_.join();
  std::unique_lock l(mu_);
  for (int fd : open_) ::shutdown(fd, SHUT_RDWR);  // wakes blocked polls; Serve closes
  cv_.wait(l, [&] { return open_.empty(); });
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    listen_fd_ = -1;
  }
}

void HttpServer::AcceptLoop() {
  while (!stop_.load()) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (::poll(&p, 1, kPollSliceMs) <= 0) continue;
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      // No descriptor or memory left: wait instead of spinning (common/accept_backoff.h).
      const auto wait = accept_backoff_.Failed(errno);
      if (wait.count() > 0) {
        metrics_->AcceptWait();
        std::this_thread::sleep_for(wait);
      }
      continue;
    }
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (options_.send_buffer_bytes > 0) {
      const int bytes = static_cast<int>(options_.send_buffer_bytes);
      ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
    }
    // A connection not served: a 503 in OpenAI's error shape, then closed.
    auto refuse = [&](const char* message, const char* limit) {
      metrics_->HttpRejected(limit);
      Connection c(fd, 100);
      c.keep_alive = false;
      c.Reply(503, "application/json", ErrorJson(503, message, limit));
      ::close(fd);
    };
    {
      std::lock_guard l(mu_);
      if (open_.size() >= options_.connections_max) {
        refuse("too many connections", "connections_max");
        continue;
      }
      open_.insert(fd);
      metrics_->ConnectionsOpen(static_cast<int64_t>(open_.size()));
    }
    try {
      std::thread([this, fd] { Serve(fd); }).detach();
    } catch (const std::system_error& e) {
      // No thread for it (memory or the thread limit ran out): refused, and accepts pause as
      // after EMFILE; an exception here used to end the process.
      {
        std::lock_guard l(mu_);
        open_.erase(fd);
        metrics_->ConnectionsOpen(static_cast<int64_t>(open_.size()));
      }
      refuse("the server cannot start a connection thread now", "threads");
      metrics_->AcceptWait();
      std::this_thread::sleep_for(
          accept_backoff_.Pause(e.code().value(), "starting a connection thread"));
      continue;
    }
    accept_backoff_.Succeeded();
  }
}

void HttpServer::Serve(int fd) {
  std::string buf;
  char tmp[16384];
  bool open = true;
  while (open && !stop_.load()) {
    http::request_parser<http::string_body> parser;
    parser.header_limit(static_cast<std::uint32_t>(options_.header_bytes_max));
    parser.body_limit(options_.body_bytes_max);
    parser.eager(true);
    const char* refused = nullptr;  // limit name when the request is refused
    int refused_status = 0;
    bool continue_sent = false;
    auto deadline = Clock::now() + std::chrono::milliseconds(options_.idle_timeout_ms);
    while (!parser.is_done()) {
      if (!buf.empty()) {
        boost::beast::error_code ec;
        size_t used = parser.put(boost::asio::buffer(buf.data(), buf.size()), ec);
        buf.erase(0, used);
        if (ec == http::error::need_more) {
          if (used > 0) continue;
          // The parser holds back a chunk-size line or a trailer until its end arrives, with
          // no limit of its own: bytes it cannot consume are bounded here as a header is.
          if (buf.size() > options_.header_bytes_max) {
            refused = "header_bytes_max", refused_status = 400;
            break;
          }
        } else if (ec == http::error::header_limit) {
          refused = "header_bytes_max", refused_status = 431;
          break;
        } else if (ec == http::error::body_limit) {
          refused = "body_bytes_max", refused_status = 413;
          break;
        } else if (ec) {
          refused = "malformed", refused_status = 400;
          break;
        } else {
          continue;
        }
      }
      // A client that sent "Expect: 100-continue" (curl does for bodies over 1 KiB) waits for
      // this before sending the body; the body limit was already checked against its length.
      if (!continue_sent && parser.is_header_done() &&
          boost::beast::iequals(parser.get()[http::field::expect], "100-continue")) {
        continue_sent = true;
        if (!WriteAll(fd, "HTTP/1.1 100 Continue\r\n\r\n", options_.idle_timeout_ms)) {
          open = false;
          break;
        }
      }
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0 || stop_.load()) {
        if (!buf.empty() || parser.got_some()) metrics_->HttpRejected("idle_timeout_ms");
        open = false;
        break;
      }
      pollfd p{fd, POLLIN, 0};
      int r = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), kPollSliceMs)));
      if (r < 0 && errno != EINTR) {
        open = false;
        break;
      }
      if (r <= 0) continue;
      ssize_t n = ::recv(fd, tmp, sizeof(tmp), 0);
      if (n <= 0) {
        open = false;
        break;
      }
      buf.append(tmp, static_cast<size_t>(n));
    }
    if (!open) break;
    Connection c(fd, options_.idle_timeout_ms);
    if (refused != nullptr) {
      metrics_->HttpRejected(refused);
      c.keep_alive = false;
      const std::string msg = refused_status == 431   ? "request header too large"
                              : refused_status == 413 ? "request body too large"
                              : std::string_view(refused) == "header_bytes_max"
                                  ? "chunk-size line or trailer longer than the header limit"
                                  : "malformed HTTP request";
      c.Reply(refused_status, "application/json", ErrorJson(refused_status, msg, refused));
      metrics_->HttpRequest(refused_status);
      LingerBeforeClose(fd, stop_);
      break;
    }
    auto& msg = parser.get();
    HttpRequest req;
    req.method = std::string(msg.method_string());
    req.target = std::string(msg.target());
    if (size_t q = req.target.find('?'); q != std::string::npos) req.target.resize(q);
    if (auto it = msg.find(http::field::authorization); it != msg.end())
      req.authorization = std::string(it->value());
    req.body = std::move(msg.body());
    c.keep_alive = msg.keep_alive();
    handler_(req, &c);
    if (!c.replied_) {
      c.Reply(500, "application/json", ErrorJson(500, "no response", "internal"));
    }
    metrics_->HttpRequest(c.status_);
    open = c.ok_ && c.keep_alive;
  }
  std::lock_guard l(mu_);
  open_.erase(fd);  // before close: Stop() must never shut down a reused descriptor
  ::close(fd);
  metrics_->ConnectionsOpen(static_cast<int64_t>(open_.size()));
  cv_.notify_all();
}

}  // namespace kvtier::serving
