// Runs the `kvtier` binary: `kvtier sim` and `kvtier sim gen` refuse nonsense on their command
// lines (NaN, infinities, out-of-range numbers, a flag where a value belongs, --param for a
// policy that is not listed) with exit code 2 and a message naming the flag, and accept
// per-policy parameters.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "tests/common/run_kvtier.h"

namespace {

using Result = kvtier::testing::KvtierResult;
using kvtier::testing::RunKvtier;

class SimFlags : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ =
        std::filesystem::temp_directory_path() / ("kvtier_sim_flags_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
    trace_ = (dir_ / "trace.jsonl").string();
    Result gen = RunKvtier("sim gen --sessions 20 --days 1 --out " + trace_);
    ASSERT_EQ(gen.exit_code, 0) << gen.out;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::filesystem::path dir_;
  std::string trace_;
};

TEST_F(SimFlags, GenRejectsNonFiniteAndOutOfRangeNumbers) {
  const std::string out = " --out " + (dir_ / "bad.jsonl").string();
  for (const char* bad : {"--output-tokens nan", "--output-tokens inf", "--output-tokens -1",
                          "--days nan", "--days 0", "--days -inf", "--tool-prob 1.5",
                          "--p-minutes nan", "--sessions 0", "--block-tokens 1"}) {
    Result r = RunKvtier(std::string("sim gen ") + bad + out);
    EXPECT_EQ(r.exit_code, 2) << bad << ": " << r.out;
    std::string flag = std::string(bad).substr(0, std::string(bad).find(' '));
    EXPECT_NE(r.out.find("'" + flag + "'"), std::string::npos) << bad << ": " << r.out;
  }
  EXPECT_FALSE(std::filesystem::exists(dir_ / "bad.jsonl"));
}

TEST_F(SimFlags, SimRejectsCapacityFractionsOutsideZeroToOne) {
  for (const char* bad : {"2", "0", "1.5", "nan", "0.1,inf"}) {
    Result r = RunKvtier("sim --no-progress --trace " + trace_ + " --capacity-fraction " + bad);
    EXPECT_EQ(r.exit_code, 2) << bad << ": " << r.out;
  }
  Result ok = RunKvtier("sim --no-progress --trace " + trace_ + " --capacity-fraction 1");
  EXPECT_EQ(ok.exit_code, 0) << ok.out;
}

// An empty trace is an error, not a table of zeros that reads as a result.
TEST_F(SimFlags, AnEmptyTraceIsAnError) {
  const std::string empty = (dir_ / "empty.jsonl").string();
  std::FILE* f = std::fopen(empty.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fclose(f);
  Result r = RunKvtier("sim --no-progress --trace " + empty);
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("holds no requests"), std::string::npos) << r.out;
}

TEST_F(SimFlags, AFlagIsNotTakenAsAValue) {
  Result r = RunKvtier("sim --no-progress --trace --json");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("'--trace' needs a value"), std::string::npos) << r.out;
}

// A trace whose file name is not UTF-8 (Linux paths are bytes): --json reports it with U+FFFD
// for the bad byte, as the single and cluster reports both do, instead of aborting.
TEST_F(SimFlags, JsonReportNamesATraceWhosePathIsNotUtf8) {
  const std::string odd = (dir_ / "trace\xff.jsonl").string();
  std::filesystem::copy_file(trace_, odd);
  const std::string replaced = "trace\xef\xbf\xbd.jsonl";  // U+FFFD in UTF-8
  Result r = RunKvtier("sim --no-progress --json --capacity-fraction 0.1 --policy lru --trace '" +
                       odd + "'");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find(replaced), std::string::npos) << r.out;
  Result cluster = RunKvtier(
      "sim --no-progress --json --capacity-fraction 0.1 --policy lru "
      "--cluster-hosts 2 --trace '" +
      odd + "'");
  EXPECT_EQ(cluster.exit_code, 0) << cluster.out;
  EXPECT_NE(cluster.out.find(replaced), std::string::npos) << cluster.out;
}

TEST_F(SimFlags, ParamsCanBeScopedToOnePolicy) {
  const std::string base = "sim --no-progress --json --trace " + trace_ +
                           " --capacity-fraction 0.1 --policy lru,long-tail";
  // Unscoped: reaches long-tail, which takes decay, and skips lru, which takes none.
  Result unscoped = RunKvtier(base + " --param decay=0.8");
  EXPECT_EQ(unscoped.exit_code, 0) << unscoped.out;
  Result unscoped_bad = RunKvtier(base + " --param decay=nan");
  EXPECT_EQ(unscoped_bad.exit_code, 2) << unscoped_bad.out;
  Result nobody = RunKvtier(base + " --param no_such_key=1");
  EXPECT_EQ(nobody.exit_code, 2) << nobody.out;
  EXPECT_NE(nobody.out.find("no policy in --policy takes parameter 'no_such_key'"),
            std::string::npos)
      << nobody.out;
  Result scoped_unknown = RunKvtier(base + " --param lru:decay=0.8");
  EXPECT_EQ(scoped_unknown.exit_code, 2) << scoped_unknown.out;
  Result scoped = RunKvtier(base + " --param long-tail:decay=0.8");
  EXPECT_EQ(scoped.exit_code, 0) << scoped.out;
  Result unlisted = RunKvtier(base + " --param arc:decay=0.8");
  EXPECT_EQ(unlisted.exit_code, 2) << unlisted.out;
  EXPECT_NE(unlisted.out.find("not list"), std::string::npos) << unlisted.out;
  Result out_of_range = RunKvtier(base + " --param long-tail:decay=nan");
  EXPECT_EQ(out_of_range.exit_code, 2) << out_of_range.out;
}

TEST_F(SimFlags, StructureIsPlainOrPrefix) {
  const std::string base =
      "sim --no-progress --trace " + trace_ + " --capacity-fraction 0.1 --policy lru";
  Result both = RunKvtier(base + " --structure plain,prefix");
  EXPECT_EQ(both.exit_code, 0) << both.out;
  EXPECT_NE(both.out.find("lru+prefix"), std::string::npos) << both.out;
  Result bad = RunKvtier(base + " --structure radix");
  EXPECT_EQ(bad.exit_code, 2) << bad.out;
  EXPECT_NE(bad.out.find("'--structure' wants plain or prefix"), std::string::npos) << bad.out;
}

// Cluster mode (sim/cluster_sim.h): runs with its own flags, refuses nonsense and the flags of
// the policy sweep it does not simulate.
TEST_F(SimFlags, ClusterModeRunsAndRefusesNonsense) {
  const std::string base = "sim --no-progress --trace " + trace_ + " --capacity-fraction 0.1";
  Result ok = RunKvtier(base + " --cluster-hosts 4");
  EXPECT_EQ(ok.exit_code, 0) << ok.out;
  EXPECT_NE(ok.out.find("round-robin"), std::string::npos) << ok.out;
  EXPECT_NE(ok.out.find("session-affinity"), std::string::npos) << ok.out;
  for (const char* bad :
       {"--cluster-hosts 4 --cluster-assign random", "--cluster-hosts 5000", "--cluster-hosts -1",
        "--cluster-hosts 4 --cluster-affinity-units 0", "--cluster-hosts 4 --policy arc",
        "--cluster-hosts 4 --structure prefix", "--cluster-hosts 4 --ssd-capacity-fraction 0.5",
        "--cluster-hosts 100000000"}) {
    Result r = RunKvtier(base + " " + bad);
    EXPECT_EQ(r.exit_code, 2) << bad << ": " << r.out;
  }
  // Fewer units than hosts.
  Result tiny =
      RunKvtier("sim --no-progress --trace " + trace_ + " --capacity-units 3 --cluster-hosts 4");
  EXPECT_EQ(tiny.exit_code, 2) << tiny.out;
  EXPECT_NE(tiny.out.find("less than one unit per host"), std::string::npos) << tiny.out;
}

}  // namespace
