#include "cache_daemon/resp.h"

#include <charconv>

namespace kvtier::daemon::resp {
namespace {

// Parses a decimal integer (optionally negative) filling the whole view.
bool ParseInt(std::string_view s, int64_t* out) {
  if (s.empty()) return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size();
}

Status ProtocolError(std::string_view what) {
  return Status::InvalidArgument("Protocol error: " + std::string(what));
}

}  // namespace

void RespParser::Append(std::span<const uint8_t> bytes) {
  if (consumed_ > 0 && (consumed_ == buffer_.size() || consumed_ > (1u << 20))) {
    buffer_.erase(0, consumed_);
    consumed_ = 0;
  }
  buffer_.append(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

size_t RespParser::FindLineEnd(size_t pos) const {
  size_t limit = std::min(buffer_.size(), pos + limits_.max_inline_bytes + 2);
  for (size_t i = pos; i + 1 < limit; ++i) {
    if (buffer_[i] == '\r' && buffer_[i + 1] == '\n') return i;
  }
  return std::string::npos;
}

StatusOr<bool> RespParser::Next(std::vector<std::string>* argv) {
  if (!failed_.ok()) return failed_;
  argv->clear();
  if (consumed_ >= buffer_.size()) return false;
  StatusOr<size_t> used = buffer_[consumed_] == '*' ? ParseMultibulk(argv) : ParseInline(argv);
  if (!used.ok()) {
    failed_ = used.status();
    return failed_;
  }
  if (*used == 0) {
    argv->clear();
    return false;
  }
  consumed_ += *used;
  return true;
}

StatusOr<size_t> RespParser::ParseMultibulk(std::vector<std::string>* argv) {
  size_t pos = consumed_;
  size_t eol = FindLineEnd(pos);
  if (eol == std::string::npos) {
    if (buffer_.size() - pos > limits_.max_inline_bytes) {
      return ProtocolError("too big mbulk count string");
    }
    return size_t{0};
  }
  int64_t count = 0;
  if (!ParseInt(std::string_view(buffer_).substr(pos + 1, eol - pos - 1), &count)) {
    return ProtocolError("invalid multibulk length");
  }
  if (count > static_cast<int64_t>(limits_.max_args)) {
    return ProtocolError("invalid multibulk length");
  }
  pos = eol + 2;
  if (count <= 0) return pos - consumed_;  // "*0" / "*-1": an empty command, skipped
  argv->reserve(static_cast<size_t>(std::min<int64_t>(count, 1024)));
  for (int64_t i = 0; i < count; ++i) {
    if (pos >= buffer_.size()) return size_t{0};
    if (buffer_[pos] != '$') {
      return ProtocolError(std::string("expected '$', got '") + buffer_[pos] + "'");
    }
    eol = FindLineEnd(pos);
    if (eol == std::string::npos) {
      if (buffer_.size() - pos > limits_.max_inline_bytes) {
        return ProtocolError("too big bulk count string");
      }
      return size_t{0};
    }
    int64_t len = 0;
    if (!ParseInt(std::string_view(buffer_).substr(pos + 1, eol - pos - 1), &len) || len < 0 ||
        static_cast<uint64_t>(len) > limits_.max_bulk_bytes) {
      return ProtocolError("invalid bulk length");
    }
    pos = eol + 2;
    size_t n = static_cast<size_t>(len);
    if (buffer_.size() - pos < n + 2) return size_t{0};
    if (buffer_[pos + n] != '\r' || buffer_[pos + n + 1] != '\n') {
      return ProtocolError("bulk string not terminated by CRLF");
    }
    argv->emplace_back(buffer_, pos, n);
    pos += n + 2;
  }
  return pos - consumed_;
}

StatusOr<size_t> RespParser::ParseInline(std::vector<std::string>* argv) {
  size_t pos = consumed_;
  size_t limit = std::min(buffer_.size(), pos + limits_.max_inline_bytes + 1);
  size_t nl = buffer_.find('\n', pos);
  if (nl == std::string::npos || nl >= limit) {
    if (buffer_.size() - pos > limits_.max_inline_bytes) {
      return ProtocolError("too big inline request");
    }
    return size_t{0};
  }
  size_t end = (nl > pos && buffer_[nl - 1] == '\r') ? nl - 1 : nl;
  std::string_view line(buffer_.data() + pos, end - pos);
  size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
    if (i >= line.size()) break;
    size_t start = i;
    while (i < line.size() && line[i] != ' ' && line[i] != '\t') ++i;
    if (argv->size() >= limits_.max_args) return ProtocolError("too many inline arguments");
    argv->emplace_back(line.substr(start, i - start));
  }
  return nl + 1 - consumed_;
}

void AppendSimple(std::string_view s, std::string* out) {
  out->push_back('+');
  out->append(s);
  out->append("\r\n");
}

void AppendError(std::string_view s, std::string* out) {
  out->push_back('-');
  for (char c : s) out->push_back(c == '\r' || c == '\n' ? ' ' : c);
  out->append("\r\n");
}

void AppendInteger(int64_t v, std::string* out) {
  out->push_back(':');
  out->append(std::to_string(v));
  out->append("\r\n");
}

void AppendBulk(std::string_view s, std::string* out) {
  out->push_back('$');
  out->append(std::to_string(s.size()));
  out->append("\r\n");
  out->append(s);
  out->append("\r\n");
}

void AppendNull(std::string* out) { out->append("$-1\r\n"); }

void AppendArrayHeader(size_t n, std::string* out) {
  out->push_back('*');
  out->append(std::to_string(n));
  out->append("\r\n");
}

}  // namespace kvtier::daemon::resp
