// HttpResponseParser: one HTTP/1.1 response, read from the bytes a connection delivers in
// whatever pieces they arrive: the head (status line and headers), then the body framed by
// Content-Length, by the chunked transfer coding, or by the end of the connection. No socket
// here: HttpStream (http_client.h) feeds it; tests/cluster/http_response_test.cc and
// tests/fuzz/http_response_fuzz.cc drive it directly.
//
// Contract:
//   - The outcome (status code, body bytes, error) is the same however the response is split
//     into Append calls.
//   - Every length is bounded: the head (status line and headers, without the blank line) by
//     head_bytes_max (Rejected), one chunk by chunk_bytes_max (Rejected), one chunk-size line by
//     kChunkLineBytesMax (Corruption). The whole body is the caller's to bound (TakeBody hands
//     over what it has decoded, and keeps no decoded bytes).
//   - Corruption for anything malformed: a status line that is not "HTTP/1.x NNN", a header
//     line without a colon, a transfer coding other than chunked, a Content-Length that is not
//     a number or that two headers give differently, both framings at once, a chunk size that
//     is not hex, a chunk not followed by CRLF. Errors are sticky: once a call failed, every
//     later one returns the same Status.
//   - Not supported (Corruption or ignored, as said): 1xx responses, trailers (ignored), obs-fold.
//
// Thread safety: one owner.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

namespace kvtier::cluster {

class HttpResponseParser {
 public:
  static constexpr size_t kChunkLineBytesMax = 1024;  // hex size and extensions

  HttpResponseParser(uint64_t head_bytes_max, uint64_t chunk_bytes_max)
      : head_bytes_max_(head_bytes_max), chunk_bytes_max_(chunk_bytes_max) {}

  // Bytes received from the connection, in order.
  void Append(std::string_view bytes) { buf_.append(bytes); }

  // Parses the head once it is complete. Ok once parsed (then status() is valid; later calls
  // return Ok), Retry while more bytes are needed, Rejected / Corruption as above.
  Status ParseHead();
  int status() const { return status_; }

  // Appends to *out the body bytes decodable from what was appended so far (possibly none).
  // Requires a parsed head. Ok, or Rejected / Corruption.
  Status TakeBody(std::string* out);
  // True once the body has ended (its length reached, its last chunk, or Closed at EOF).
  bool done() const { return done_; }

  // The connection ended: no more bytes. NotFound when the body ended (a body framed by the
  // connection's end ends here; call TakeBody first); IOError when the head or the body was cut
  // short.
  Status Closed();

 private:
  Status Fail(Status s);
  Status ParseHeaders(std::string_view head);
  Status TakeChunked(std::string* out, size_t* pos);

  const uint64_t head_bytes_max_;
  const uint64_t chunk_bytes_max_;
  std::string buf_;            // received, not yet consumed
  size_t head_scan_from_ = 0;  // where the search for the blank line resumes
  Status error_ = Status::Ok();
  bool head_parsed_ = false;
  int status_ = 0;
  bool chunked_ = false;
  bool until_eof_ = false;
  bool have_length_ = false;
  uint64_t remaining_ = 0;  // body bytes left (Content-Length) or in the current chunk
  bool in_chunk_ = false;   // chunked: inside a chunk's data
  bool done_ = false;
};

}  // namespace kvtier::cluster
