#include "common/logging.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace kvtier
