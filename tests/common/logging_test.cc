#include "common/logging.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>

namespace kvtier {
namespace {

TEST(LoggingTest, FormatsMillisecondsAsRfc3339Utc) {
  EXPECT_EQ(FormatUtcMillis(0), "1970-01-01T00:00:00.000Z");
  EXPECT_EQ(FormatUtcMillis(1709251199999), "2024-02-29T23:59:59.999Z");  // leap day
  EXPECT_EQ(FormatUtcMillis(1709251200000), "2024-03-01T00:00:00.000Z");
  EXPECT_EQ(FormatUtcMillis(253402300799999), "9999-12-31T23:59:59.999Z");
}

TEST(LoggingTest, KeepsTheNumberOutsideTheCalendarRange) {
  EXPECT_EQ(FormatUtcMillis(-1), "-1");
  EXPECT_EQ(FormatUtcMillis(253402300800000), "253402300800000");
}

// A failure loop's warning: the first line goes out, the rest of the interval is held back
// and counted, and the first line after the interval reports how many were held.
TEST(LogThrottleTest, LetsOneLineThroughPerIntervalAndCountsTheRest) {
  LogThrottle t(1000);
  uint64_t held = 99;
  EXPECT_TRUE(t.Allow(5000, &held));
  EXPECT_EQ(held, 0u);
  for (uint64_t ms = 5001; ms < 6000; ms += 10) EXPECT_FALSE(t.Allow(ms, &held)) << ms;
  EXPECT_TRUE(t.Allow(6000, &held));
  EXPECT_EQ(held, 100u);
  EXPECT_FALSE(t.Allow(6999, &held));
  EXPECT_TRUE(t.Allow(8000, &held));
  EXPECT_EQ(held, 1u);
}

// Bytes from a peer cannot forge or split log lines, nor make one huge line.
TEST(LoggingTest, MessagesAreOneLineOfBoundedLength) {
  EXPECT_EQ(SanitizeLogMessage("plain text, tabs\tand UTF-8 \xc3\xa9"),
            "plain text, tabs\tand UTF-8 \xc3\xa9");
  EXPECT_EQ(SanitizeLogMessage(std::string("a\nb\r\x1b[31m\x7f\0z", 12)),
            "a\\x0ab\\x0d\\x1b[31m\\x7f\\x00z");
  const std::string big(kLogMessageBytesMax + 904, 'x');
  EXPECT_EQ(SanitizeLogMessage(big),
            std::string(kLogMessageBytesMax, 'x') + "... (904 more bytes)");
  EXPECT_EQ(SanitizeLogMessage(std::string(kLogMessageBytesMax, 'y')),
            std::string(kLogMessageBytesMax, 'y'));
}

// The same through KVTIER_LOG to stderr: a message with a forged second line is one line.
TEST(LoggingTest, ALogLineWithANewlineInItsMessageStaysOneLine) {
  std::FILE* capture = std::tmpfile();
  ASSERT_NE(capture, nullptr);
  std::fflush(stderr);
  const int saved = ::dup(STDERR_FILENO);
  ASSERT_GE(saved, 0);
  ASSERT_GE(::dup2(::fileno(capture), STDERR_FILENO), 0);
  KVTIER_LOG(kWarn) << "cluster: ignoring member record /kvtier/members/x\n"
                    << "2026-12-04T00:00:00.000Z I forged.cc:1] all is well";
  ::dup2(saved, STDERR_FILENO);
  ::close(saved);
  std::rewind(capture);
  std::string out;
  char buf[1024];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), capture)) > 0;) out.append(buf, n);
  std::fclose(capture);
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;
  EXPECT_NE(out.find("members/x\\x0a2026-12-04T00:00:00.000Z I forged.cc:1]"), std::string::npos)
      << out;
}

}  // namespace
}  // namespace kvtier
