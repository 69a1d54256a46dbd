// Every command's --help tells the truth about defaults: no unset sentinel (an all-ones
// integer) is ever shown as a default, and kvtierd's port flags name the config key they
// override and its real default.
#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "cache_daemon/config.h"
#include "tests/common/run_kvtier.h"

namespace kvtier {
namespace {

using testing::KvtierResult;
using testing::RunBuilt;

// The decimal spellings of the usual "unset" sentinels.
const std::vector<std::string> kSentinels = {"18446744073709551615", "4294967295", "2147483647",
                                             "9223372036854775807"};

void ExpectNoSentinel(const std::string& binary, const std::string& args) {
  KvtierResult r = RunBuilt(binary, args + " --help");
  ASSERT_EQ(r.exit_code, 0) << binary << " " << args << ": " << r.out;
  ASSERT_NE(r.out.find("usage:"), std::string::npos) << r.out;
  for (const std::string& s : kSentinels) {
    EXPECT_EQ(r.out.find(s), std::string::npos) << binary << " " << args << " shows " << s;
  }
}

// The commands a binary's top-level --help lists ("  name   summary" lines), so a new command
// is covered without editing this test.
std::vector<std::string> ListedCommands(const std::string& binary) {
  KvtierResult r = RunBuilt(binary, "--help");
  std::vector<std::string> out;
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) {
    if (line.size() < 3 || line[0] != ' ' || line[1] != ' ' || line[2] == ' ' || line[2] == '-')
      continue;
    out.push_back(line.substr(2, line.find(' ', 2) - 2));
  }
  return out;
}

TEST(CliHelpTest, NoCommandShowsASentinelAsItsDefault) {
  ExpectNoSentinel("cache_daemon/kvtierd", "");
  const std::vector<std::string> kvtier = ListedCommands("cli/kvtier");
  const std::vector<std::string> engine = ListedCommands("engine/kvtier-engine");
  EXPECT_GE(kvtier.size(), 10u);
  EXPECT_GE(engine.size(), 4u);
  for (const std::string& c : kvtier) {
    if (c == "bench" || c == "engram" || c == "sim" || c == "cluster")
      continue;  // their subcommands below
    ExpectNoSentinel("cli/kvtier", c);
  }
  for (const char* c : {"bench storage", "bench engram", "engram build", "engram grant", "sim",
                        "sim gen", "cluster status", "cluster drain", "cluster where"}) {
    ExpectNoSentinel("cli/kvtier", c);
  }
  for (const std::string& c : engine) ExpectNoSentinel("engine/kvtier-engine", c);
}

TEST(CliHelpTest, KvtierdPortFlagsNameTheirConfigKeyAndRealDefault) {
  const daemon::DaemonOptions embedded;
  KvtierResult r = RunBuilt("cache_daemon/kvtierd", "--help");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("server.resp_port of the config, " + std::to_string(embedded.resp_port) +
                       " when unset"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("server.http_port of the config, " + std::to_string(embedded.http_port) +
                       " when unset"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("server.native_port of the config, " + std::to_string(embedded.native_port) +
                       " when unset"),
            std::string::npos)
      << r.out;
}

TEST(CliHelpTest, KvtierdRejectsAPortOutsideItsRangeBeforeStarting) {
  for (const char* flag : {"--resp-port", "--http-port", "--native-port"}) {
    KvtierResult r = RunBuilt("cache_daemon/kvtierd", std::string(flag) + " 65536");
    EXPECT_EQ(r.exit_code, 2) << flag << ": " << r.out;
    EXPECT_NE(r.out.find("0..65535"), std::string::npos) << r.out;
  }
}

}  // namespace
}  // namespace kvtier
