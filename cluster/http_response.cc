#include "cluster/http_response.h"

#include <algorithm>
#include <cctype>
#include <charconv>

namespace kvtier::cluster {
namespace {

// ASCII case-insensitive equality (Beast's iequals takes boost::string_view in Boost 1.74).
bool IEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) !=
        std::tolower(static_cast<unsigned char>(b[i]))) {
      return false;
    }
  }
  return true;
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// The whole of text as an unsigned number in base; false for anything else (an empty text, a
// sign, spaces, a value over 64 bits).
bool ParseWhole(std::string_view text, int base, uint64_t* value) {
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), *value, base);
  return !text.empty() && ec == std::errc() && p == text.data() + text.size();
}

}  // namespace

Status HttpResponseParser::Fail(Status s) {
  error_ = s;
  return s;
}

Status HttpResponseParser::ParseHead() {
  if (!error_.ok()) return error_;
  if (head_parsed_) return Status::Ok();
  const size_t head_end = buf_.find("\r\n\r\n", head_scan_from_);
  if (head_end == std::string::npos) {
    // No head within the limit can end in bytes still to come.
    if (buf_.size() >= head_bytes_max_ + 4) {
      return Fail(
          Status::Rejected("response head over " + std::to_string(head_bytes_max_) + " bytes"));
    }
    head_scan_from_ = buf_.size() < 3 ? 0 : buf_.size() - 3;
    return Status::Retry("response head incomplete");
  }
  if (head_end > head_bytes_max_) {
    return Fail(
        Status::Rejected("response head over " + std::to_string(head_bytes_max_) + " bytes"));
  }
  Status s = ParseHeaders(std::string_view(buf_.data(), head_end));
  if (!s.ok()) return Fail(s);
  buf_.erase(0, head_end + 4);
  head_parsed_ = true;
  return Status::Ok();
}

Status HttpResponseParser::ParseHeaders(std::string_view head) {
  size_t eol = head.find("\r\n");
  const std::string_view status_line = head.substr(0, eol);
  // "HTTP/1.x NNN" and, when there is more, a space and the reason phrase.
  if (!status_line.starts_with("HTTP/1.") || status_line.size() < 12 || status_line[8] != ' ' ||
      (status_line.size() > 12 && status_line[12] != ' ')) {
    return Status::Corruption("bad status line");
  }
  uint64_t code = 0;
  if (!ParseWhole(status_line.substr(9, 3), 10, &code) || code < 200 || code > 599) {
    return Status::Corruption("bad status code");
  }
  status_ = static_cast<int>(code);
  uint64_t length = 0;
  while (eol != std::string_view::npos) {
    head.remove_prefix(eol + 2);
    eol = head.find("\r\n");
    const std::string_view line = head.substr(0, eol);
    const size_t colon = line.find(':');
    if (colon == std::string_view::npos) return Status::Corruption("bad header line");
    const std::string_view name = line.substr(0, colon), value = Trim(line.substr(colon + 1));
    if (IEquals(name, "Transfer-Encoding")) {
      if (!IEquals(value, "chunked")) return Status::Corruption("unsupported transfer coding");
      chunked_ = true;
    } else if (IEquals(name, "Content-Length")) {
      uint64_t v = 0;
      if (!ParseWhole(value, 10, &v)) return Status::Corruption("bad Content-Length");
      if (have_length_ && v != length) return Status::Corruption("two Content-Lengths");
      length = v;
      have_length_ = true;
    }
  }
  if (chunked_ && have_length_) return Status::Corruption("both chunked and Content-Length");
  until_eof_ = !chunked_ && !have_length_;
  remaining_ = have_length_ ? length : 0;
  done_ = have_length_ && length == 0;
  return Status::Ok();
}

Status HttpResponseParser::TakeBody(std::string* out) {
  if (!error_.ok()) return error_;
  if (!head_parsed_) return Status::InvalidArgument("TakeBody before the head was parsed");
  if (done_) return Status::Ok();  // whatever follows the body is not read
  size_t pos = 0;
  if (until_eof_) {
    pos = buf_.size();
    out->append(buf_);
  } else if (!chunked_) {
    pos = static_cast<size_t>(std::min<uint64_t>(remaining_, buf_.size()));
    out->append(buf_, 0, pos);
    remaining_ -= pos;
    done_ = remaining_ == 0;
  } else {
    Status s = TakeChunked(out, &pos);
    if (!s.ok()) return Fail(s);
  }
  buf_.erase(0, pos);
  return Status::Ok();
}

Status HttpResponseParser::TakeChunked(std::string* out, size_t* pos) {
  size_t& p = *pos;
  while (!done_) {
    const size_t avail = buf_.size() - p;
    if (in_chunk_) {
      const size_t take = static_cast<size_t>(std::min<uint64_t>(remaining_, avail));
      out->append(buf_, p, take);
      p += take;
      remaining_ -= take;
      if (remaining_ > 0 || buf_.size() - p < 2) return Status::Ok();  // needs more bytes
      if (buf_.compare(p, 2, "\r\n") != 0) return Status::Corruption("bad chunk end");
      p += 2;
      in_chunk_ = false;
      continue;
    }
    const size_t eol = buf_.find("\r\n", p);
    if (eol == std::string::npos) {
      // A size line within the limit would have ended within these bytes.
      if (avail >= kChunkLineBytesMax + 2) return Status::Corruption("chunk size line too long");
      return Status::Ok();
    }
    if (eol - p > kChunkLineBytesMax) return Status::Corruption("chunk size line too long");
    std::string_view line(buf_.data() + p, eol - p);
    line = line.substr(0, line.find(';'));  // chunk extensions are ignored
    uint64_t size = 0;
    if (!ParseWhole(line, 16, &size)) return Status::Corruption("bad chunk size");
    if (size > chunk_bytes_max_) {
      return Status::Rejected("chunk over " + std::to_string(chunk_bytes_max_) + " bytes");
    }
    p = eol + 2;
    if (size == 0) {
      done_ = true;  // the last chunk; trailers are not read
    } else {
      remaining_ = size;
      in_chunk_ = true;
    }
  }
  return Status::Ok();
}

Status HttpResponseParser::Closed() {
  if (!error_.ok()) return error_;
  if (!head_parsed_) return Status::IOError("connection closed before the response head");
  if (until_eof_) done_ = true;
  if (done_) return Status::NotFound("body ended");
  return Status::IOError("connection closed in the middle of the body");
}

}  // namespace kvtier::cluster
