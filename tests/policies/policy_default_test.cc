// The eviction policy kvtierd runs when its config names none, the default docs/CONFIG.md
// states, the one deploy/kvtierd.toml sets and the one docs/POLICIES.md recommends are the same.
#include <gtest/gtest.h>

#include <fstream>
#include <regex>
#include <sstream>
#include <string>

#include "cache_daemon/config.h"

namespace kvtier {
namespace {

std::string Read(const std::string& relative) {
  std::ifstream in(std::string(KVTIER_SOURCE_DIR) + "/" + relative);
  EXPECT_TRUE(in.good()) << relative;
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string FirstMatch(const std::string& text, const std::string& pattern) {
  std::smatch m;
  if (!std::regex_search(text, m, std::regex(pattern))) return "";
  return m[1];
}

TEST(PolicyDefault, DaemonConfigDocsAndRecommendationAgree) {
  auto options = daemon::ParseConfig("");
  ASSERT_TRUE(options.ok()) << options.status().ToString();
  const std::string actual = options->storage.eviction_policy;
  EXPECT_FALSE(actual.empty());
  EXPECT_EQ(FirstMatch(Read("docs/CONFIG.md"), R"(\| `eviction` \| `([a-z0-9-]+)` \|)"), actual);
  EXPECT_EQ(FirstMatch(Read("deploy/kvtierd.toml"), R"re(\neviction = "([a-z0-9-]+)")re"), actual);
  EXPECT_EQ(FirstMatch(Read("docs/POLICIES.md"), R"(Default: \*\*([a-z0-9-]+)\*\*)"), actual);
}

}  // namespace
}  // namespace kvtier
