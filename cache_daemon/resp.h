// RESP2 (the Redis serialization protocol): an incremental request parser and reply
// encoders for kvtierd's Redis-compatible front end.
//
// Requests are either multibulk arrays of bulk strings ("*2\r\n$3\r\nGET\r\n$1\r\nk\r\n") or
// inline commands ("PING\r\n"), as real Redis accepts. Every size is bounded by RespLimits;
// input beyond a limit, or bytes that are not RESP, is a protocol error: the server answers
// "-ERR Protocol error: ..." and closes the connection (as Redis does).
//
// The parser owns one growable buffer: a connection reads straight into it (PrepareWrite /
// Commit, no intermediate copy) and Next() hands out string_views into it, so a SET value is
// not copied between the socket and the store's envelope. Views stay valid until the next
// Append / PrepareWrite call; the buffer never holds more than one incomplete command plus one
// read (the session stops reading while replies are pending), and is released when it drains
// if it grew beyond kKeepBufferBytes. An incomplete command's parse resumes where it stopped
// (the arguments already complete, the bytes of a line already searched), so the work is
// linear in the input however it is split into reads.
//
// Thread safety: a RespParser belongs to one connection and is not thread-safe. The encoders
// are pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
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
  // Most bytes of one whole command (headers and arguments), judged from each "$N" header
  // before its bytes arrive: a command announcing more fails at once with Rejected (the
  // session's limits.resp_command_bytes_max, or preauth_frame_bytes_max before AUTH).
  size_t max_command_bytes = (64ull << 20) + (1ull << 20);
};

class RespParser {
 public:
  // A drained buffer larger than this is freed rather than kept for the next command.
  static constexpr size_t kKeepBufferBytes = 4u << 20;

  explicit RespParser(RespLimits limits = {}) : limits_(limits) {}
  // Changes the command limit for commands not yet complete.
  void set_max_command_bytes(size_t n) { limits_.max_command_bytes = n; }

  // Copies bytes in (tests, and callers that do not read into PrepareWrite()).
  void Append(std::span<const uint8_t> bytes);
  void Append(std::string_view bytes) {
    Append(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
  }
  // Returns at least min_bytes of writable space at the end of the buffer (compacting or
  // growing it); the caller fills a prefix and calls Commit with its length. Invalidates views.
  std::span<uint8_t> PrepareWrite(size_t min_bytes);
  void Commit(size_t n) { end_ += n; }

  // true: *argv holds the next command (possibly empty for a blank inline line, which the
  // caller skips); the views point into the parser's buffer and stay valid until the next
  // Append / PrepareWrite. false: more bytes are needed. InvalidArgument: protocol error;
  // Rejected: a command over max_command_bytes. Either way the parser stays failed.
  StatusOr<bool> Next(std::vector<std::string_view>* argv);
  // As above, copying the arguments out (tests and cold paths).
  StatusOr<bool> Next(std::vector<std::string>* argv);
  size_t buffered_bytes() const { return end_ - consumed_; }
  // Bytes allocated for the buffer (what the connection holds while idle).
  size_t capacity_bytes() const { return capacity_; }
  // The parser's work so far, for tests: bytes searched for line ends, plus one per argument
  // header read and one per argument handed out. Linear in the input bytes however they are
  // split into Append calls.
  uint64_t parse_steps() const { return parse_steps_; }

 private:
  // A multibulk command not yet complete (count > 0): its parse resumes at pos.
  struct Partial {
    int64_t count = 0;       // its argument count
    int64_t done = 0;        // arguments complete
    size_t first = 0;        // where the first argument's header starts, relative to consumed_
    size_t pos = 0;          // where the next argument's header starts, relative to consumed_
    int64_t arg_bytes = -1;  // the next argument's length once its header is read, else -1
    size_t arg_at = 0;       // where its bytes start, relative to consumed_
  };
  static constexpr size_t kNoLine = static_cast<size_t>(-1);

  std::string_view data() const { return std::string_view(buf_.get(), end_); }
  // Parses at data()[consumed_...]; returns bytes used (0: incomplete) or an error.
  StatusOr<size_t> ParseMultibulk(std::vector<std::string_view>* argv);
  StatusOr<size_t> ParseInline(std::vector<std::string_view>* argv);
  // Views of a resumed multibulk command's arguments, once it is complete (their headers
  // were checked as they arrived).
  void CollectArguments(std::vector<std::string_view>* argv);
  // Finds `terminator` ("\r\n", or "\n" alone) from pos within max_inline_bytes (+2 for
  // "\r\n"); npos when absent. A search that fails remembers how far it got, and the next
  // search of the same line resumes there.
  size_t FindLineEnd(size_t pos, bool newline_only = false);
  // A command was taken: the next one starts afresh.
  void ForgetPartial();

  RespLimits limits_;
  std::unique_ptr<char[]> buf_;  // [0, end_) holds data; [consumed_, end_) is unparsed
  size_t capacity_ = 0;
  size_t end_ = 0;
  size_t consumed_ = 0;
  Status failed_;
  Partial partial_;
  size_t line_at_ = kNoLine;  // the line last searched, relative to consumed_
  size_t line_searched_ = 0;  // its bytes known to hold no line end (from its start)
  uint64_t parse_steps_ = 0;
};

// ---- reply encoders (append to *out) ----
void AppendSimple(std::string_view s, std::string* out);  // +OK
void AppendError(std::string_view s, std::string* out);   // -ERR ... (CR/LF stripped)
void AppendInteger(int64_t v, std::string* out);          // :1
void AppendBulk(std::string_view s, std::string* out);    // $n ...
void AppendBulkHeader(size_t n, std::string* out);        // $n\r\n (the caller adds body + CRLF)
void AppendNull(std::string* out);                        // $-1
void AppendArrayHeader(size_t n, std::string* out);       // *n
// RESP3 (after HELLO 3).
void AppendMapHeader(size_t n, std::string* out);  // %n: n key/value pairs follow
void AppendNull3(std::string* out);                // _ (RESP3's one null)

}  // namespace kvtier::daemon::resp
