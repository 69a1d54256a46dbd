// End-to-end: the `kvtier` client subcommands against the real kvtierd.
#include <gtest/gtest.h>

#include "tests/e2e/kvtierd_process.h"
#include "tests/e2e/kvtierd_test.h"

namespace kvtier::daemon {
namespace {

namespace kt = kvtier::testing;

class E2eTest : public kt::KvtierdTest {
 protected:
  E2eTest() : KvtierdTest("kvtier_cli_e2e") {}
  void SetUp() override { KvtierdTest::SetUp(); }
};

std::string Config() {
  return "[storage]\ndram_capacity_bytes = 16777216\nssd_capacity_bytes = 268435456\n"
         "ssd_segment_bytes = 16777216\n";
}

TEST_F(E2eTest, CliSmokeTest) {
  d_->WriteConfig(Config());
  ASSERT_TRUE(d_->Start());
  std::string kv = std::string(KVTIER_CLI_PATH) + " ";
  std::string sock = " --socket " + d_->socket();
  std::vector<uint8_t> file(300000);
  for (size_t i = 0; i < file.size(); ++i) file[i] = static_cast<uint8_t>(i * 7 + (i >> 9));
  std::ofstream(dir_ / "in.bin", std::ios::binary)
      .write(reinterpret_cast<const char*>(file.data()), static_cast<std::streamsize>(file.size()));
  std::string out;
  ASSERT_EQ(kt::RunShell(kv + "put-file --file " + (dir_ / "in.bin").string() +
                             " --name smoke --tier ssd --json" + sock,
                         &out),
            0)
      << out;
  EXPECT_NE(out.find("\"units\":6"), std::string::npos) << out;
  ASSERT_EQ(kt::RunShell(kv + "lookup --name smoke --json" + sock, &out), 0) << out;
  EXPECT_NE(out.find("\"hit_count\":6"), std::string::npos) << out;
  ASSERT_EQ(
      kt::RunShell(kv + "get-file --name smoke --out " + (dir_ / "out.bin").string() + sock, &out),
      0)
      << out;
  EXPECT_EQ(kt::RunShell("cmp " + (dir_ / "in.bin").string() + " " + (dir_ / "out.bin").string()),
            0);
  ASSERT_EQ(kt::RunShell(kv + "stats" + sock, &out), 0) << out;
  EXPECT_NE(out.find("dram"), std::string::npos);
  ASSERT_EQ(kt::RunShell(kv + "policy set --eviction fifo" + sock, &out), 0) << out;
  ASSERT_EQ(kt::RunShell(kv + "policy get --json" + sock, &out), 0) << out;
  EXPECT_NE(out.find("\"eviction\":\"fifo\""), std::string::npos) << out;
  // Bytes that are not UTF-8 cannot go into the JSON body: a clear refusal, not an abort.
  EXPECT_EQ(kt::RunShell(kv + "policy set --eviction \"$(printf '\\377')\"" + sock, &out), 1)
      << out;
  EXPECT_NE(out.find("must be UTF-8"), std::string::npos) << out;
  ASSERT_EQ(kt::RunShell(kv + "policy get" + sock, &out), 0) << out;
  EXPECT_NE(out.find("eviction=fifo"), std::string::npos) << out;
  EXPECT_NE(kt::RunShell(kv + "get-file --name nothing" + sock, &out), 0);
  ASSERT_EQ(kt::RunShell(kv + "drain --shutdown" + sock, &out), 0) << out;
  EXPECT_EQ(d_->WaitExit(30000), 0);
}

}  // namespace
}  // namespace kvtier::daemon
