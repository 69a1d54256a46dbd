// RESP2 (the Redis serialization protocol): an incremental request parser and reply
// encoders for kvtierd's Redis-compatible front end.
//
// Requests are either multibulk arrays of bulk strings ("*2\r\n$3\r\nGET\r\n$1\r\nk\r\n") or
// inline commands ("PING\r\n"), as real Redis accepts. Every size is bounded by RespLimits;
// input beyond a limit, or bytes that are not RESP, is a protocol error: the server answers
// "-ERR Protocol error: ..." and closes the connection (as Redis does).
//
// Thread safety: a RespParser belongs to one connection and is not thread-safe. The encoders
// are pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace kvtier::daemon::resp {

struct RespLimits {
  // Most arguments in one command (MSET/MGET/DEL key counts follow from this).
  size_t max_args = 65536;
  // Largest bulk string (a value); matches storage max_value_bytes by default.
  size_t max_bulk_bytes = 64ull << 20;
  // Longest inline command line and longest "*N"/"$N" header line.
  size_t max_inline_bytes = 64ull << 10;
};

class RespParser {
 public:
  explicit RespParser(RespLimits limits = {}) : limits_(limits) {}

  void Append(std::span<const uint8_t> bytes);
  void Append(std::string_view bytes) {
    Append(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
  }
  // true: *argv holds the next command (possibly empty for a blank inline line, which the
  // caller skips). false: more bytes are needed. InvalidArgument: protocol error; the parser
  // stays failed.
  StatusOr<bool> Next(std::vector<std::string>* argv);
  size_t buffered_bytes() const { return buffer_.size() - consumed_; }

 private:
  // Parses at buffer_[consumed_...]; returns bytes used (0: incomplete) or an error.
  StatusOr<size_t> ParseMultibulk(std::vector<std::string>* argv);
  StatusOr<size_t> ParseInline(std::vector<std::string>* argv);
  // Finds "\r\n" from pos within max_inline_bytes; npos when absent.
  size_t FindLineEnd(size_t pos) const;

  RespLimits limits_;
  std::string buffer_;
  size_t consumed_ = 0;
  Status failed_;
};

// ---- reply encoders (append to *out) ----
void AppendSimple(std::string_view s, std::string* out);  // +OK
void AppendError(std::string_view s, std::string* out);   // -ERR ... (CR/LF stripped)
void AppendInteger(int64_t v, std::string* out);          // :1
void AppendBulk(std::string_view s, std::string* out);    // $n ...
void AppendNull(std::string* out);                        // $-1
void AppendArrayHeader(size_t n, std::string* out);       // *n

}  // namespace kvtier::daemon::resp
