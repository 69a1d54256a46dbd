// Runs the `kvtier` binary: `kvtier layout --json` on the shipped configs (890 and 222.5
// bytes per token) and `kvtier demo` (the issue-2 codec round trip, exit 0).
#include <gtest/gtest.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/common/run_kvtier.h"

namespace {

using Result = kvtier::testing::KvtierResult;
using kvtier::testing::RunKvtier;

std::string Model(const char* file) {
  return std::string(KVTIER_SOURCE_DIR) + "/deploy/models/" + file;
}

TEST(KvtierLayoutCli, ShippedConfigsGive890And222_5BytesPerToken) {
  Result flash = RunKvtier("layout --json --model-config " + Model("deepseek-v4.1-flash.json"));
  ASSERT_EQ(flash.exit_code, 0) << flash.out;
  nlohmann::json j = nlohmann::json::parse(flash.out);
  EXPECT_DOUBLE_EQ(j["bytes_per_token"].get<double>(), 890.0);
  EXPECT_DOUBLE_EQ(j["main_bytes_per_token"].get<double>(), 720.0);
  EXPECT_DOUBLE_EQ(j["index_bytes_per_token"].get<double>(), 170.0);
  EXPECT_EQ(j["unit_tokens"].get<int>(), 64);
  EXPECT_EQ(j["bytes_per_unit"].get<int>(), 56960);
  EXPECT_EQ(j["sources"].size(), 4u);

  Result mini = RunKvtier("layout --json --model-config " + Model("mini-v4.1.json"));
  ASSERT_EQ(mini.exit_code, 0) << mini.out;
  j = nlohmann::json::parse(mini.out);
  EXPECT_DOUBLE_EQ(j["bytes_per_token"].get<double>(), 222.5);
  EXPECT_EQ(j["bytes_per_unit"].get<int>(), 14240);

  Result unit32 =
      RunKvtier("layout --json --unit-tokens 32 --model-config " + Model("mini-v4.1.json"));
  ASSERT_EQ(unit32.exit_code, 0) << unit32.out;
  EXPECT_EQ(nlohmann::json::parse(unit32.out)["bytes_per_unit"].get<int>(), 7120);

  Result human = RunKvtier("layout --model-config mini-v4.1");  // the embedded copy
  ASSERT_EQ(human.exit_code, 0) << human.out;
  EXPECT_NE(human.out.find("222.5"), std::string::npos) << human.out;
}

TEST(KvtierLayoutCli, ErrorsAndUsage) {
  EXPECT_EQ(RunKvtier("layout").exit_code, 2);  // --model-config is required
  EXPECT_EQ(RunKvtier("layout --model-config /nonexistent.json").exit_code, 1);
  Result odd = RunKvtier("layout --unit-tokens 63 --model-config mini-v4.1");
  EXPECT_EQ(odd.exit_code, 1);
  EXPECT_NE(odd.out.find("unit_tokens"), std::string::npos) << odd.out;
}

TEST(KvtierDemoCli, RoundTripsAUnitAndExitsZero) {
  Result demo = RunKvtier("codec-demo");
  ASSERT_EQ(demo.exit_code, 0) << demo.out;
  EXPECT_NE(demo.out.find("890.0 B/token"), std::string::npos) << demo.out;
  EXPECT_NE(demo.out.find("222.5 B/token"), std::string::npos) << demo.out;
  EXPECT_NE(demo.out.find("14368 bytes"), std::string::npos) << demo.out;
  EXPECT_NE(demo.out.find("demo OK"), std::string::npos) << demo.out;
}

// `kvtier demo` end to end on a short session of the trained checkpoint, then its trained-model
// part: the checkpoint loads, writes text, and exact restore agrees bit for bit with the
// uninterrupted session.
TEST(KvtierDemoCli, AgentDemoEndsWithTheTrainedModelsTextAndFidelityLine) {
  Result demo = RunKvtier(std::string("demo --context-tokens 256 --first-turn-tokens 128 ") +
                          "--trained-model " + KVTIER_SOURCE_DIR + "/deploy/models/kvmini-trained");
  ASSERT_EQ(demo.exit_code, 0) << demo.out;
  EXPECT_NE(demo.out.find("== agent resume on the trained miniature"), std::string::npos)
      << demo.out;
  // The trained config's unit layout (mini-v4.1's would store 224.5 B/token).
  EXPECT_NE(demo.out.find("81.5 B/token (payload 79.5 B/token"), std::string::npos) << demo.out;
  EXPECT_NE(demo.out.find("resume vs recompute"), std::string::npos) << demo.out;
  EXPECT_NE(demo.out.find("== the trained miniature"), std::string::npos) << demo.out;
  EXPECT_NE(demo.out.find("continuation: "), std::string::npos) << demo.out;
  EXPECT_NE(demo.out.find("exact restore top-1 1.000 KL 0;"), std::string::npos) << demo.out;
  Result missing = RunKvtier(
      "demo --context-tokens 256 --first-turn-tokens 128 "
      "--trained-model /nonexistent/model");
  EXPECT_EQ(missing.exit_code, 1) << missing.out;
  EXPECT_NE(missing.out.find("trained model"), std::string::npos) << missing.out;
}

}  // namespace
