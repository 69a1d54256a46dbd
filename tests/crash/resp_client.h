// A minimal blocking RESP client for the crash driver and the RESP tests: one command at a time
// (or one pipeline) over one TCP connection, binary-safe bulk strings. It reads RESP2 replies and
// the RESP3 types a server sends after HELLO 3 (null, boolean, double, big number, verbatim
// string, blob error, map, set; not push or attribute). The replies it reads are bounded (bulk
// strings of at most kRespBulkBytesMax, aggregates of at most kRespArrayElemsMax elements, nesting
// of at most 2 levels); anything else is a Corruption error.
//
// Errors: IOError when the connection fails, closes or a reply does not arrive within
// timeout_ms; after any error the client is unusable (make a new one).
// Thread safety: none; one client per thread.
#pragma once

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <charconv>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "tests/cache_daemon/net_util.h"

namespace kvtier::crash {

inline constexpr size_t kRespBulkBytesMax = 64u << 20;
inline constexpr size_t kRespArrayElemsMax = 65536;
inline constexpr size_t kRespLineBytesMax = 64u << 10;

struct RespReply {
  // kNil is RESP2's null bulk string or array ("$-1", "*-1"); the RESP3 types follow kArray:
  // kNull "_", kBool "#t"/"#f" (integer 1/0), kDouble "," and kBigNumber "(" (their text in
  // str), kVerbatim "=" (str with its "txt:" prefix), kBlobError "!", kMap "%" (elems holds
  // key, value, key, value...), kSet "~".
  enum class Type {
    kSimple,
    kError,
    kInteger,
    kBulk,
    kNil,
    kArray,
    kNull,
    kBool,
    kDouble,
    kBigNumber,
    kVerbatim,
    kBlobError,
    kMap,
    kSet
  };
  Type type = Type::kNil;
  std::string str;  // simple, error, bulk, double, big number, verbatim, blob error
  int64_t integer = 0;
  std::vector<RespReply> elems;
};

class RespClient {
 public:
  static StatusOr<std::unique_ptr<RespClient>> Connect(uint16_t port, int timeout_ms) {
    int fd = testing::ConnectTcp(port);
    if (fd < 0) return Status::IOError("connect to RESP port failed");
    return std::unique_ptr<RespClient>(new RespClient(fd, timeout_ms));
  }
  ~RespClient() { ::close(fd_); }
  RespClient(const RespClient&) = delete;
  RespClient& operator=(const RespClient&) = delete;

  // Sends one command and reads its reply. With raw non-null, *raw is set to the reply's bytes
  // exactly as they came (its RESP encoding), for a byte-for-byte comparison.
  StatusOr<RespReply> Call(const std::vector<std::string_view>& args, std::string* raw = nullptr) {
    std::string req;
    Encode(args, &req);
    if (!testing::SendAllRaw(fd_, req.data(), req.size())) return Status::IOError("send failed");
    return ReadTopReply(raw);
  }

  // Sends every command in one write (a pipeline), then reads one reply per command. With raw
  // non-null, *raw gets each reply's bytes as they came, one string per command.
  StatusOr<std::vector<RespReply>> Pipeline(const std::vector<std::vector<std::string>>& cmds,
                                            std::vector<std::string>* raw = nullptr) {
    std::string req;
    for (const std::vector<std::string>& c : cmds) {
      Encode(std::vector<std::string_view>(c.begin(), c.end()), &req);
    }
    if (!testing::SendAllRaw(fd_, req.data(), req.size())) return Status::IOError("send failed");
    std::vector<RespReply> replies;
    if (raw != nullptr) raw->assign(cmds.size(), std::string());
    for (size_t i = 0; i < cmds.size(); ++i) {
      StatusOr<RespReply> r = ReadTopReply(raw != nullptr ? &(*raw)[i] : nullptr);
      if (!r.ok()) return r.status();
      replies.push_back(std::move(r).value());
    }
    return replies;
  }

 private:
  static void Encode(const std::vector<std::string_view>& args, std::string* req) {
    *req += "*" + std::to_string(args.size()) + "\r\n";
    for (std::string_view a : args) {
      *req += "$" + std::to_string(a.size()) + "\r\n";
      req->append(a);
      *req += "\r\n";
    }
  }

  RespClient(int fd, int timeout_ms) : fd_(fd), timeout_ms_(timeout_ms) {}

  // One reply; its bytes go to *raw when raw is non-null.
  StatusOr<RespReply> ReadTopReply(std::string* raw) {
    if (raw != nullptr) raw->clear();
    raw_ = raw;
    StatusOr<RespReply> r = ReadReply(0);
    raw_ = nullptr;
    return r;
  }

  Status Fill() {
    if (pos_ > 0 && pos_ == buf_.size()) {
      buf_.clear();
      pos_ = 0;
    }
    pollfd p{fd_, POLLIN, 0};
    int r = ::poll(&p, 1, timeout_ms_);
    if (r == 0) return Status::IOError("reply timed out");
    if (r < 0) return Status::IOError("poll failed");
    char tmp[65536];
    ssize_t n = ::recv(fd_, tmp, sizeof(tmp), 0);
    if (n <= 0) return Status::IOError(n == 0 ? "connection closed" : "recv failed");
    buf_.append(tmp, static_cast<size_t>(n));
    return Status::Ok();
  }

  StatusOr<std::string> ReadLine() {
    for (;;) {
      size_t eol = buf_.find("\r\n", pos_);
      if (eol != std::string::npos) {
        std::string line = buf_.substr(pos_, eol - pos_);
        if (raw_ != nullptr) raw_->append(buf_, pos_, eol + 2 - pos_);
        pos_ = eol + 2;
        return line;
      }
      if (buf_.size() - pos_ > kRespLineBytesMax) return Status::Corruption("RESP line too long");
      KVTIER_RETURN_IF_ERROR(Fill());
    }
  }

  static bool ParseI64(std::string_view s, int64_t* out) {
    auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
    return ec == std::errc() && p == s.data() + s.size();
  }

  StatusOr<RespReply> ReadReply(int depth) {
    KVTIER_ASSIGN_OR_RETURN(std::string line, ReadLine());
    if (line.empty()) return Status::Corruption("empty RESP line");
    RespReply r;
    std::string_view rest = std::string_view(line).substr(1);
    switch (line[0]) {
      case '+':
        r.type = RespReply::Type::kSimple;
        r.str = rest;
        return r;
      case '-':
        r.type = RespReply::Type::kError;
        r.str = rest;
        return r;
      case ':':
        r.type = RespReply::Type::kInteger;
        if (!ParseI64(rest, &r.integer)) return Status::Corruption("bad RESP integer");
        return r;
      case '$':
      case '=':
      case '!': {
        int64_t n = 0;
        if (!ParseI64(rest, &n) || n < -1 || n > static_cast<int64_t>(kRespBulkBytesMax) ||
            (n == -1 && line[0] != '$'))
          return Status::Corruption("bad RESP bulk length");
        if (n == -1) return r;  // kNil
        r.type = line[0] == '$'   ? RespReply::Type::kBulk
                 : line[0] == '=' ? RespReply::Type::kVerbatim
                                  : RespReply::Type::kBlobError;
        size_t need = static_cast<size_t>(n) + 2;
        while (buf_.size() - pos_ < need) KVTIER_RETURN_IF_ERROR(Fill());
        if (buf_.compare(pos_ + static_cast<size_t>(n), 2, "\r\n") != 0)
          return Status::Corruption("RESP bulk not terminated");
        r.str = buf_.substr(pos_, static_cast<size_t>(n));
        if (raw_ != nullptr) raw_->append(buf_, pos_, need);
        pos_ += need;
        return r;
      }
      case '_':
        if (!rest.empty()) return Status::Corruption("bad RESP3 null");
        r.type = RespReply::Type::kNull;
        return r;
      case '#':
        if (rest != "t" && rest != "f") return Status::Corruption("bad RESP3 boolean");
        r.type = RespReply::Type::kBool;
        r.integer = rest == "t" ? 1 : 0;
        return r;
      case ',':
      case '(':
        r.type = line[0] == ',' ? RespReply::Type::kDouble : RespReply::Type::kBigNumber;
        r.str = rest;
        return r;
      case '*':
      case '~':
      case '%': {
        int64_t n = 0;
        if (!ParseI64(rest, &n) || n < -1 || n > static_cast<int64_t>(kRespArrayElemsMax) ||
            (n == -1 && line[0] != '*'))
          return Status::Corruption("bad RESP array length");
        if (n == -1) return r;
        if (depth >= 2) return Status::Corruption("RESP arrays nested too deep");
        r.type = line[0] == '*'   ? RespReply::Type::kArray
                 : line[0] == '~' ? RespReply::Type::kSet
                                  : RespReply::Type::kMap;
        if (line[0] == '%') n *= 2;  // a map's n pairs
        for (int64_t i = 0; i < n; ++i) {
          KVTIER_ASSIGN_OR_RETURN(RespReply e, ReadReply(depth + 1));
          r.elems.push_back(std::move(e));
        }
        return r;
      }
      default:
        return Status::Corruption("unknown RESP reply type");
    }
  }

  int fd_;
  int timeout_ms_;
  std::string buf_;
  size_t pos_ = 0;
  std::string* raw_ = nullptr;  // where the reply being read copies its bytes, if anywhere
};

}  // namespace kvtier::crash
