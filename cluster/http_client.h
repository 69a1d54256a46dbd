// A minimal HTTP/1.1 client over plain TCP for talking to etcd's v3 JSON gateway: one POST per
// connection (Connection: close), every wait bounded by a deadline, every length from the
// peer bounded by a named limit. Two shapes:
//   - HttpPost: send a request, read the whole response (Content-Length, chunked or to EOF);
//   - HttpStream: send a request, then read the response body piece by piece as it arrives
//     (etcd's /v3/watch answers a never-ending chunked body of JSON lines).
//
// Not a general client: no TLS, no redirects, no keep-alive, no 1xx responses. The response
// is read by HttpResponseParser (http_response.h), which holds the framing rules.
//
// Thread safety: HttpPost is thread-safe (no shared state). An HttpStream is owned by one
// thread.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "cluster/http_response.h"
#include "common/status.h"

namespace kvtier::cluster {

// "host:port" or "http://host:port" (a trailing "/" is accepted). host is an IPv4 address,
// "[IPv6]" or a name getaddrinfo resolves.
struct HttpEndpoint {
  std::string host;
  uint16_t port = 0;
  std::string ToString() const;
};
// InvalidArgument for anything else (https://, a path, port 0 or over 65535, empty host).
StatusOr<HttpEndpoint> ParseHttpEndpoint(std::string_view text);

struct HttpLimits {
  uint64_t timeout_ms = 2000;              // connect + send + whole response (HttpPost)
  uint64_t head_bytes_max = 16u << 10;     // status line + headers
  uint64_t body_bytes_max = 16ull << 20;   // whole body (HttpPost)
  uint64_t chunk_bytes_max = 16ull << 20;  // one chunk of a chunked body
};

struct HttpResponse {
  int status = 0;    // 200, 404, ...
  std::string body;  // decoded (chunked encoding removed)
};

// POSTs body (Content-Type: application/json) to path. IOError when the connection fails or
// drops early, Retry when the deadline passes, Corruption for a malformed response,
// Rejected when a limit is exceeded. A non-2xx status is not an error here.
StatusOr<HttpResponse> HttpPost(const HttpEndpoint& endpoint, std::string_view path,
                                std::string_view body, const HttpLimits& limits);

// GET path, otherwise as HttpPost (used for a member's /readyz, /metrics and /v1/unit). A
// non-empty bearer_token is sent as "Authorization: Bearer <token>"; InvalidArgument (nothing
// sent) for a token with a byte outside printable ASCII, which could end the header.
StatusOr<HttpResponse> HttpGet(const HttpEndpoint& endpoint, std::string_view path,
                               const HttpLimits& limits, std::string_view bearer_token = {});
// The check HttpGet makes of a bearer token: InvalidArgument for a byte outside printable
// ASCII (for a caller that wants to refuse a flag before any connection).
Status CheckBearerToken(std::string_view token);

// A POST whose response body is read as it arrives.
class HttpStream {
 public:
  HttpStream() = default;
  ~HttpStream();
  HttpStream(const HttpStream&) = delete;
  HttpStream& operator=(const HttpStream&) = delete;

  // Connects, sends the request and reads the response head (within limits.timeout_ms).
  // Errors as HttpPost; a non-2xx status is reported in status() and Read returns the body.
  // method: "POST" (a JSON body) or "GET" (body ignored); bearer_token as HttpGet's.
  Status Open(const HttpEndpoint& endpoint, std::string_view path, std::string_view body,
              const HttpLimits& limits, std::string_view method = "POST",
              std::string_view bearer_token = {});
  int status() const { return status_; }

  // Appends body bytes that arrive within wait_ms to *out (possibly none: Retry when nothing
  // arrived in time). NotFound when the body has ended (then the stream is done); IOError /
  // Corruption / Rejected as HttpPost.
  Status Read(uint64_t wait_ms, std::string* out);

 private:
  Status Fill(uint64_t wait_ms);  // reads more bytes into the parser
  int fd_ = -1;
  int status_ = 0;
  std::optional<HttpResponseParser> parser_;  // set by Open
};

}  // namespace kvtier::cluster
