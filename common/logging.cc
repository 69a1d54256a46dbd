#include "common/logging.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>

namespace kvtier {
namespace {

LogLevel InitialLevel() {
  const char* env = std::getenv("KVTIER_LOG_LEVEL");
  LogLevel level = LogLevel::kInfo;
  if (env != nullptr) (void)ParseLogLevel(env, &level);
  return level;
}

std::atomic<int>& LevelVar() {
  static std::atomic<int> level{static_cast<int>(InitialLevel())};
  return level;
}

const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return "D";
    case LogLevel::kInfo:
      return "I";
    case LogLevel::kWarn:
      return "W";
    case LogLevel::kError:
      return "E";
    case LogLevel::kOff:
      return "-";
  }
  return "?";
}

}  // namespace

void SetLogLevel(LogLevel level) { LevelVar().store(static_cast<int>(level)); }
LogLevel GetLogLevel() { return static_cast<LogLevel>(LevelVar().load(std::memory_order_relaxed)); }

bool ParseLogLevel(std::string_view text, LogLevel* out) {
  if (text == "debug")
    *out = LogLevel::kDebug;
  else if (text == "info")
    *out = LogLevel::kInfo;
  else if (text == "warn")
    *out = LogLevel::kWarn;
  else if (text == "error")
    *out = LogLevel::kError;
  else if (text == "off")
    *out = LogLevel::kOff;
  else
    return false;
  return true;
}

std::string FormatUtcMillis(int64_t unix_ms) {
  constexpr int64_t kMaxMs = 253402300799999;  // 9999-12-31T23:59:59.999Z
  if (unix_ms < 0 || unix_ms > kMaxMs) return std::to_string(unix_ms);
  const time_t secs = static_cast<time_t>(unix_ms / 1000);
  struct tm tm {};
  if (::gmtime_r(&secs, &tm) == nullptr) return std::to_string(unix_ms);
  char buf[96];  // room for any int fields, which the compiler cannot bound
  std::snprintf(buf, sizeof(buf), "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900,
                tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
                static_cast<int>(unix_ms % 1000));
  return buf;
}

std::string SanitizeLogMessage(std::string_view message) {
  const std::string_view kept = message.substr(0, kLogMessageBytesMax);
  std::string out;
  out.reserve(kept.size());
  for (const char ch : kept) {
    const auto c = static_cast<unsigned char>(ch);
    if ((c < 0x20 && c != '\t') || c == 0x7f) {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += ch;
    }
  }
  if (message.size() > kept.size()) {
    out += "... (" + std::to_string(message.size() - kept.size()) + " more bytes)";
  }
  return out;
}

namespace internal {

LogLine::LogLine(LogLevel level, const char* file, int line) : level_(level) {
  const auto now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count();
  const char* base = std::strrchr(file, '/');
  stream_ << FormatUtcMillis(now_ms) << ' ' << LevelName(level_) << ' ' << (base ? base + 1 : file)
          << ':' << line << "] ";
  prefix_bytes_ = static_cast<size_t>(stream_.tellp());
}

LogLine::~LogLine() {
  const std::string line = stream_.str();
  std::string text = line.substr(0, prefix_bytes_);
  text += SanitizeLogMessage(std::string_view(line).substr(prefix_bytes_));
  text += '\n';
  ssize_t rc = ::write(STDERR_FILENO, text.data(), text.size());
  (void)rc;
}

}  // namespace internal
}  // namespace kvtier
