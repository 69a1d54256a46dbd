// The flag parser itself (cli/flags.h): non-finite and out-of-range numbers are refused with
// exit code 2 and leave the target untouched; `kvtier sim`'s use of it is tested end to end in
// tests/common/cli_sim_flags_test.cc.
#include "cli/flags.h"

#include <gtest/gtest.h>

#include <string>
#include <string_view>
#include <vector>

namespace kvtier::cli {
namespace {

TEST(ParseFiniteDouble, RejectsNonFiniteMalformedAndOutOfRange) {
  double v = 7;
  for (const char* bad : {"nan", "NaN", "-nan", "inf", "-inf", "infinity", "1e400", "", "0.5x", "x",
                          "1,5", "2", "-0.1"}) {
    EXPECT_FALSE(ParseFiniteDouble(bad, 0, 1, &v)) << bad;
    EXPECT_EQ(v, 7) << bad;
  }
  EXPECT_TRUE(ParseFiniteDouble("0.25", 0, 1, &v));
  EXPECT_EQ(v, 0.25);
  EXPECT_TRUE(ParseFiniteDouble("1", 0, 1, &v));  // bounds are inclusive
  EXPECT_EQ(v, 1.0);
}

TEST(ParseUintList, TakesBoundedItemsAndRefusesEverythingElse) {
  std::vector<uint64_t> v;
  EXPECT_TRUE(ParseUintList("0,20,100", 0, 100, 3, &v));
  EXPECT_EQ(v, (std::vector<uint64_t>{0, 20, 100}));
  EXPECT_TRUE(ParseUintList("7", 1, 7, 1, &v));
  EXPECT_EQ(v, std::vector<uint64_t>{7});
  for (const char* bad : {"", ",", "1,", ",1", "1,,2", "abc", "1,x", "-1", "+1", " 1", "1 ", "101",
                          "0x10", "1,2,3,4", "18446744073709551616"}) {
    EXPECT_FALSE(ParseUintList(bad, 0, 100, 3, &v)) << bad;
  }
  EXPECT_FALSE(ParseUintList("0", 1, 5, 3, &v));  // below min
}

// Runs `flags` on argv-style words; returns Parse's result.
int ParseArgs(FlagSet& flags, std::vector<std::string_view> args) { return flags.Parse(args); }

TEST(FlagSet, NumbersOutsideTheirRangeAreErrors) {
  for (const char* bad : {"nan", "inf", "-inf", "2", "-1", "1e999"}) {
    FlagSet flags("test", "t");
    double fraction = 0.5;
    flags.Double("fraction", &fraction, "f", false, 0.001, 1);
    EXPECT_EQ(ParseArgs(flags, {"--fraction", bad}), 2) << bad;
    EXPECT_EQ(fraction, 0.5) << bad;
  }
  for (const char* bad : {"-1", "0", "11", "1.5", "18446744073709551616", "nan"}) {
    FlagSet flags("test", "t");
    uint64_t n = 3;
    flags.Uint("n", &n, "n", false, 1, 10);
    EXPECT_EQ(ParseArgs(flags, {"--n", bad}), 2) << bad;
    EXPECT_EQ(n, 3u) << bad;
  }
  FlagSet flags("test", "t");
  double fraction = 0.5;
  uint64_t n = 3;
  flags.Double("fraction", &fraction, "f", false, 0.001, 1);
  flags.Uint("n", &n, "n", false, 1, 10);
  EXPECT_EQ(ParseArgs(flags, {"--fraction=0.25", "--n", "10"}), -1);
  EXPECT_EQ(fraction, 0.25);
  EXPECT_EQ(n, 10u);
}

// A value that looks like a flag is not taken as the previous flag's value.
TEST(FlagSet, AFlagIsNotAValue) {
  FlagSet flags("test", "t");
  std::string trace;
  bool json = false;
  flags.String("trace", &trace, "FILE", "trace");
  flags.Bool("json", &json, "json");
  EXPECT_EQ(ParseArgs(flags, {"--trace", "--json"}), 2);
  FlagSet ok("test", "t");
  ok.String("trace", &trace, "FILE", "trace");
  EXPECT_EQ(ParseArgs(ok, {"--trace=--json"}), -1);
  EXPECT_EQ(trace, "--json");
}

}  // namespace
}  // namespace kvtier::cli
