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

}  // namespace
}  // namespace kvtier
