#include "cache_daemon/resp.h"

#include <algorithm>
#include <charconv>
#include <cstring>

namespace kvtier::daemon::resp {
namespace {

// Parses a decimal integer (optionally negative) filling the whole view.
bool ParseInt(std::string_view s, int64_t* out) {
  if (s.empty()) return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size();
}

void AppendDecimal(int64_t v, std::string* out) {
  char digits[24];
  auto [end, ec] = std::to_chars(digits, digits + sizeof(digits), v);
  out->append(digits, static_cast<size_t>(end - digits));
}

Status ProtocolError(std::string_view what) {
  return Status::InvalidArgument("Protocol error: " + std::string(what));
}

Status CommandTooBig(size_t limit) {
  return Status::Rejected("Protocol error: command longer than " + std::to_string(limit) +
                          " bytes");
}

}  // namespace

std::span<uint8_t> RespParser::PrepareWrite(size_t min_bytes) {
  if (consumed_ == end_) {  // drained: reuse from the start, or free an oversized buffer
    consumed_ = end_ = 0;
    if (capacity_ > kKeepBufferBytes && min_bytes <= kKeepBufferBytes) {
      buf_.reset();
      capacity_ = 0;
    }
  }
  if (capacity_ - end_ < min_bytes) {
    size_t live = end_ - consumed_;
    if (capacity_ - live >= min_bytes && consumed_ > 0) {
      std::memmove(buf_.get(), buf_.get() + consumed_, live);  // compact in place
    } else {
      size_t cap = std::max(live + min_bytes, capacity_ * 2);
      std::unique_ptr<char[]> grown(new char[cap]);
      if (live > 0) std::memcpy(grown.get(), buf_.get() + consumed_, live);
      buf_ = std::move(grown);
      capacity_ = cap;
    }
    consumed_ = 0;
    end_ = live;
  }
  return std::span<uint8_t>(reinterpret_cast<uint8_t*>(buf_.get()) + end_, capacity_ - end_);
}

void RespParser::Append(std::span<const uint8_t> bytes) {
  if (bytes.empty()) return;
  std::span<uint8_t> dst = PrepareWrite(bytes.size());
  std::memcpy(dst.data(), bytes.data(), bytes.size());
  Commit(bytes.size());
}

size_t RespParser::FindLineEnd(size_t pos, bool newline_only) {
  if (pos - consumed_ != line_at_) {
    line_at_ = pos - consumed_;
    line_searched_ = 0;
  }
  const size_t limit = std::min(end_, pos + limits_.max_inline_bytes + (newline_only ? 1 : 2));
  const char* base = buf_.get();
  const size_t from = pos + line_searched_;
  size_t found = std::string::npos;
  size_t i = from;
  if (newline_only) {
    const void* nl = i < limit ? std::memchr(base + i, '\n', limit - i) : nullptr;
    if (nl != nullptr) found = static_cast<size_t>(static_cast<const char*>(nl) - base);
  } else {
    while (i + 1 < limit) {
      const void* cr = std::memchr(base + i, '\r', limit - 1 - i);
      if (cr == nullptr) break;
      i = static_cast<size_t>(static_cast<const char*>(cr) - base);
      if (base[i + 1] == '\n') {
        found = i;
        break;
      }
      ++i;
    }
  }
  if (found != std::string::npos) {
    parse_steps_ += found + 1 - from;
    return found;
  }
  // Nothing before clear_end ends the line (with "\r\n", the last byte may start an end).
  const size_t clear_end = newline_only ? limit : std::max(limit, pos + 1) - 1;
  parse_steps_ += limit > from ? limit - from : 0;
  line_searched_ = std::max(clear_end, from) - pos;
  return std::string::npos;
}

void RespParser::ForgetPartial() {
  partial_ = Partial{};
  line_at_ = kNoLine;
  line_searched_ = 0;
}

StatusOr<bool> RespParser::Next(std::vector<std::string>* argv) {
  std::vector<std::string_view> views;
  StatusOr<bool> got = Next(&views);
  argv->assign(views.begin(), views.end());
  return got;
}

StatusOr<bool> RespParser::Next(std::vector<std::string_view>* argv) {
  if (!failed_.ok()) return failed_;
  argv->clear();
  if (consumed_ >= end_) return false;
  StatusOr<size_t> used = buf_[consumed_] == '*' ? ParseMultibulk(argv) : ParseInline(argv);
  if (!used.ok()) {
    failed_ = used.status();
    argv->clear();
    return failed_;
  }
  if (*used == 0) {
    argv->clear();
    return false;
  }
  consumed_ += *used;
  ForgetPartial();
  return true;
}

StatusOr<size_t> RespParser::ParseMultibulk(std::vector<std::string_view>* argv) {
  const std::string_view in = data();
  const size_t max_command = limits_.max_command_bytes;
  if (partial_.count == 0) {  // the "*N" line
    const size_t pos = consumed_;
    const size_t eol = FindLineEnd(pos);
    if (eol == std::string::npos) {
      if (in.size() - pos > limits_.max_inline_bytes) {
        return ProtocolError("too big mbulk count string");
      }
      if (in.size() - pos > max_command) return CommandTooBig(max_command);
      return size_t{0};
    }
    int64_t count = 0;
    if (!ParseInt(in.substr(pos + 1, eol - pos - 1), &count)) {
      return ProtocolError("invalid multibulk length");
    }
    if (count > static_cast<int64_t>(limits_.max_args)) {
      return ProtocolError("invalid multibulk length");
    }
    const size_t first = eol + 2 - consumed_;
    if (count <= 0) return first;  // "*0" / "*-1": an empty command, skipped
    partial_ = Partial{.count = count, .first = first, .pos = first};
  }
  // Resumes at the first argument not yet complete: those before it were checked already.
  // A command parsed in one go (the usual case) hands out its views on the way; one resumed
  // collects them at the end (CollectArguments).
  const bool in_one_go = partial_.done == 0 && partial_.arg_bytes < 0;
  if (in_one_go) argv->reserve(static_cast<size_t>(std::min<int64_t>(partial_.count, 1024)));
  while (partial_.done < partial_.count) {
    if (partial_.arg_bytes < 0) {  // its "$N" line
      const size_t pos = consumed_ + partial_.pos;
      if (pos >= in.size()) return size_t{0};
      if (in[pos] != '$') {
        return ProtocolError(std::string("expected '$', got '") + in[pos] + "'");
      }
      const size_t eol = FindLineEnd(pos);
      if (eol == std::string::npos) {
        if (in.size() - pos > limits_.max_inline_bytes) {
          return ProtocolError("too big bulk count string");
        }
        if (in.size() - consumed_ > max_command) return CommandTooBig(max_command);
        return size_t{0};
      }
      int64_t len = 0;
      if (!ParseInt(in.substr(pos + 1, eol - pos - 1), &len) || len < 0 ||
          static_cast<uint64_t>(len) > limits_.max_bulk_bytes) {
        return ProtocolError("invalid bulk length");
      }
      ++parse_steps_;
      const size_t at = eol + 2 - consumed_;
      const size_t n = static_cast<size_t>(len);
      // Judged from the header: the argument's bytes need not arrive to be refused.
      if (at > max_command || n + 2 > max_command - at) return CommandTooBig(max_command);
      partial_.arg_bytes = len;
      partial_.arg_at = at;
    }
    const size_t at = consumed_ + partial_.arg_at;
    const size_t n = static_cast<size_t>(partial_.arg_bytes);
    if (in.size() - at < n + 2) return size_t{0};
    if (in[at + n] != '\r' || in[at + n + 1] != '\n') {
      return ProtocolError("bulk string not terminated by CRLF");
    }
    if (in_one_go) argv->push_back(in.substr(at, n));
    ++partial_.done;
    partial_.pos = at + n + 2 - consumed_;
    partial_.arg_bytes = -1;
  }
  if (!in_one_go) CollectArguments(argv);
  return partial_.pos;
}

void RespParser::CollectArguments(std::vector<std::string_view>* argv) {
  const std::string_view in = data();
  argv->reserve(static_cast<size_t>(std::min<int64_t>(partial_.count, 1024)));
  size_t pos = consumed_ + partial_.first;
  for (int64_t i = 0; i < partial_.count; ++i) {
    // "$<digits>\r\n", checked when it was read: its first '\r' ends it.
    const size_t eol = in.find('\r', pos + 1);
    size_t n = 0;
    std::from_chars(in.data() + pos + 1, in.data() + eol, n);
    parse_steps_ += eol - pos + 1;
    argv->push_back(in.substr(eol + 2, n));
    pos = eol + 2 + n + 2;
  }
}

StatusOr<size_t> RespParser::ParseInline(std::vector<std::string_view>* argv) {
  const std::string_view in = data();
  const size_t pos = consumed_;
  const size_t nl = FindLineEnd(pos, /*newline_only=*/true);
  if (nl == std::string::npos) {
    if (in.size() - pos > limits_.max_inline_bytes) {
      return ProtocolError("too big inline request");
    }
    if (in.size() - pos > limits_.max_command_bytes) {
      return CommandTooBig(limits_.max_command_bytes);
    }
    return size_t{0};
  }
  if (nl + 1 - pos > limits_.max_command_bytes) return CommandTooBig(limits_.max_command_bytes);
  size_t end = (nl > pos && in[nl - 1] == '\r') ? nl - 1 : nl;
  std::string_view line(in.data() + pos, end - pos);
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
  AppendDecimal(v, out);
  out->append("\r\n");
}

void AppendBulkHeader(size_t n, std::string* out) {
  out->push_back('$');
  AppendDecimal(static_cast<int64_t>(n), out);
  out->append("\r\n");
}

void AppendBulk(std::string_view s, std::string* out) {
  AppendBulkHeader(s.size(), out);
  out->append(s);
  out->append("\r\n");
}

void AppendNull(std::string* out) { out->append("$-1\r\n"); }

void AppendArrayHeader(size_t n, std::string* out) {
  out->push_back('*');
  AppendDecimal(static_cast<int64_t>(n), out);
  out->append("\r\n");
}

void AppendMapHeader(size_t n, std::string* out) {
  out->push_back('%');
  AppendDecimal(static_cast<int64_t>(n), out);
  out->append("\r\n");
}

void AppendNull3(std::string* out) { out->append("_\r\n"); }

}  // namespace kvtier::daemon::resp
