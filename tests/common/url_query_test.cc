#include "common/url_query.h"

#include <gtest/gtest.h>

#include <string>

namespace kvtier {
namespace {

TEST(PercentDecodeTest, DecodesEscapesAndPlusAndKeepsEverythingElse) {
  EXPECT_EQ(PercentDecode(""), "");
  EXPECT_EQ(PercentDecode("user:42"), "user:42");
  EXPECT_EQ(PercentDecode("a+b%20c"), "a b c");
  EXPECT_EQ(PercentDecode("%2B%2b"), "++") << "hex digits of either case";
  EXPECT_EQ(PercentDecode("%25"), "%");
  EXPECT_EQ(PercentDecode("%00%FF"), std::string("\0\xff", 2)) << "any byte, NUL included";
  EXPECT_EQ(PercentDecode("=&"), "=&") << "separators are the caller's to split on";
}

TEST(PercentDecodeTest, RefusesAnEscapeWithoutTwoHexDigits) {
  for (const char* bad : {"%", "a%", "%2", "a%2", "%g0", "%0g", "%%41", "x%2 "}) {
    EXPECT_FALSE(PercentDecode(bad).has_value()) << bad;
  }
}

TEST(PercentEncodeTest, EscapesAllButUnreservedAndDecodesBack) {
  EXPECT_EQ(PercentEncode("user:42 a+b/~x_y-z.0"), "user%3A42%20a%2Bb%2F~x_y-z.0");
  std::string every_byte;
  for (int b = 0; b < 256; ++b) every_byte.push_back(static_cast<char>(b));
  const std::string encoded = PercentEncode(every_byte);
  EXPECT_EQ(encoded.find_first_of("+&=?# "), std::string::npos) << encoded;
  EXPECT_EQ(PercentDecode(encoded), every_byte);
}

}  // namespace
}  // namespace kvtier
