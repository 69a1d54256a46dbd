// HttpServer: the HTTP/1.1 front of `kvtier-engine serve` (docs/SERVING.md, "Limits").
//
// One thread per connection, at most connections_max at once (one more is answered 503 and
// closed). Requests are parsed by Boost.Beast from bytes this class reads itself, under
// header_bytes_max (431 over it) and body_bytes_max (413 over it); a chunked body's
// chunk-size line or trailer is bounded by header_bytes_max too (400 over it); malformed
// requests get 400 and the connection is closed (after a refusal the rest of the request is
// read and dropped for up to 2 s, so the refusal is not lost to a reset). A connection whose next
// request has not arrived in full idle_timeout_ms after the server began waiting for it is closed,
// however steadily its bytes trickle in (a slow sender cannot hold a slot); a write that makes no
// progress for idle_timeout_ms closes it too. Keep-alive and pipelined requests are served in
// order. Every refusal is counted in ServingMetrics (kvtier_serve_http_rejected_total{limit=...}).
//
// Thread safety: Stop() may be called from any thread; the handler runs on connection
// threads, several at once.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <thread>

#include "common/accept_backoff.h"
#include "common/status.h"
#include "serving/metrics.h"

namespace kvtier::serving {

// Upper bound on HttpOptions::send_buffer_bytes.
inline constexpr uint64_t kSendBufferBytesMax = 64ull << 20;

struct HttpOptions {
  std::string listen_host = "127.0.0.1";  // numeric address
  uint16_t port = 0;                      // 0 = any free port (see HttpServer::port())
  uint64_t connections_max = 64;
  uint64_t header_bytes_max = 16 << 10;
  uint64_t body_bytes_max = 1 << 20;
  uint64_t idle_timeout_ms = 30000;
  // The kernel's send buffer of each connection (SO_SNDBUF; the kernel doubles it for its
  // bookkeeping), bounding the reply bytes a client that reads nothing leaves queued in the
  // kernel per connection. 0 = the kernel's default, which grows with the connection up to
  // net.ipv4.tcp_wmem's maximum (4 MiB by default: 256 MiB over 64 stalled connections).
  uint64_t send_buffer_bytes = 256 << 10;
};

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string target;  // path, query string removed
  std::string authorization;
  std::string body;
};

// How a handler answers: either Reply once, or BeginStream, Chunk*, EndStream. Each returns
// false when the connection failed (the handler should stop and return).
class HttpResponder {
 public:
  virtual ~HttpResponder() = default;
  virtual bool Reply(int status, std::string_view content_type, std::string_view body) = 0;
  virtual bool BeginStream(int status, std::string_view content_type) = 0;
  virtual bool Chunk(std::string_view data) = 0;
  virtual bool EndStream() = 0;
  // True when the client closed its side or the connection broke. Reads nothing.
  virtual bool PeerGone() = 0;
};

using HttpHandler = std::function<void(const HttpRequest&, HttpResponder*)>;

class HttpServer {
 public:
  // Binds and starts accepting. IOError when the address cannot be bound.
  static StatusOr<std::unique_ptr<HttpServer>> Start(const HttpOptions& options,
                                                     HttpHandler handler, ServingMetrics* metrics);
  ~HttpServer();  // Stop()
  uint16_t port() const { return port_; }
  // Stops accepting, shuts every connection down and waits for their threads.
  void Stop();

 private:
  HttpServer(const HttpOptions& options, HttpHandler handler, ServingMetrics* metrics)
      : options_(options), handler_(std::move(handler)), metrics_(metrics) {}
  void AcceptLoop();
  void Serve(int fd);

  HttpOptions options_;
  HttpHandler handler_;
  ServingMetrics* metrics_;
  int listen_fd_ = -1;
  uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  AcceptBackoff accept_backoff_{"serve HTTP front"};  // AcceptLoop's only
  std::thread acceptor_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::set<int> open_;  // connection fds being served
};

}  // namespace kvtier::serving
