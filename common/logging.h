// Minimal leveled logging to stderr.
//
//   KVTIER_LOG(kInfo) << "opened " << n << " segments";
//
// A line is formatted as "<UTC time> <level> <file>:<line>] <message>\n", the time as RFC 3339
// with milliseconds ("2026-12-01T16:10:00.123Z"), and written
// with one write(2), so lines from concurrent threads never interleave. A message is one line
// whatever it holds: its control bytes are written as \xNN and it is cut at
// kLogMessageBytesMax (SanitizeLogMessage), so bytes from a peer (an etcd key, a request
// target) can neither forge log lines nor flood the log with one. Messages below the
// process-wide level (SetLogLevel, default kInfo; env KVTIER_LOG_LEVEL=debug|info|warn|error)
// cost one comparison. Never log secrets: auth tokens, tenant salts, RDMA keys.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>

namespace kvtier {

enum class LogLevel : int { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3, kOff = 4 };

void SetLogLevel(LogLevel level);
LogLevel GetLogLevel();
// Parses "debug", "info", "warn", "error", "off"; returns false for anything else.
bool ParseLogLevel(std::string_view text, LogLevel* out);
// "YYYY-MM-DDTHH:MM:SS.mmmZ" for milliseconds since the Unix epoch (UTC, years 1970..9999;
// outside that range the number itself, so a line is never lost).
std::string FormatUtcMillis(int64_t unix_ms);

// The most bytes of one message a log line carries.
inline constexpr size_t kLogMessageBytesMax = 4096;
// A message as its log line writes it: at most kLogMessageBytesMax of its bytes, then
// "... (N more bytes)"; every control byte (0x00-0x1f but tab, and 0x7f) as \xNN.
std::string SanitizeLogMessage(std::string_view message);

// Lets at most one line through per interval, counting those it holds back: for a warning
// that a failure loop would otherwise repeat many times a second.
//
//   uint64_t held = 0;
//   if (throttle_.Allow(now_ms, &held)) KVTIER_LOG(kWarn) << "..." << " (" << held << " more)";
//
// Not thread-safe: one per call site, used under that site's lock.
class LogThrottle {
 public:
  explicit LogThrottle(uint64_t interval_ms) : interval_ms_(interval_ms) {}
  // True when a line may go out at `now_ms` (any monotonic milliseconds); *held is then the
  // lines held back since the last one let through.
  bool Allow(uint64_t now_ms, uint64_t* held) {
    if (passed_any_ && now_ms - last_ms_ < interval_ms_) {
      ++held_;
      return false;
    }
    *held = held_;
    held_ = 0;
    passed_any_ = true;
    last_ms_ = now_ms;
    return true;
  }

 private:
  uint64_t interval_ms_;
  bool passed_any_ = false;
  uint64_t last_ms_ = 0;
  uint64_t held_ = 0;
};

namespace internal {
class LogLine {
 public:
  LogLine(LogLevel level, const char* file, int line);
  ~LogLine();
  LogLine(const LogLine&) = delete;
  LogLine& operator=(const LogLine&) = delete;
  std::ostream& stream() { return stream_; }

 private:
  LogLevel level_;
  std::ostringstream stream_;
  size_t prefix_bytes_ = 0;  // time, level and source: the rest is the message
};
}  // namespace internal

}  // namespace kvtier

#define KVTIER_LOG(level)                                    \
  if (::kvtier::LogLevel::level < ::kvtier::GetLogLevel()) { \
  } else                                                     \
    ::kvtier::internal::LogLine(::kvtier::LogLevel::level, __FILE__, __LINE__).stream()
