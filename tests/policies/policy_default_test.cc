// The eviction policy kvtierd runs when its config names none, the default docs/CONFIG.md
// states, the one deploy/kvtierd.toml sets and the one docs/POLICIES.md recommends are the same.
#include <gtest/gtest.h>

#include <fstream>
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

// The policy name (lowercase letters, digits, '-') right after the first `prefix` in `text`, when
// `suffix` follows it; "" otherwise. Plain string search, not std::regex: GCC 12 at -O1 with ASan
// (preset asan) warns maybe-uninitialized inside <regex>, which -Werror turns into a failed build.
std::string NameAfter(const std::string& text, const std::string& prefix,
                      const std::string& suffix) {
  const size_t at = text.find(prefix);
  if (at == std::string::npos) return "";
  const size_t begin = at + prefix.size();
  size_t end = begin;
  while (end < text.size() && ((text[end] >= 'a' && text[end] <= 'z') ||
                               (text[end] >= '0' && text[end] <= '9') || text[end] == '-')) {
    ++end;
  }
  if (end == begin || text.compare(end, suffix.size(), suffix) != 0) return "";
  return text.substr(begin, end - begin);
}

TEST(PolicyDefault, DaemonConfigDocsAndRecommendationAgree) {
  auto options = daemon::ParseConfig("");
  ASSERT_TRUE(options.ok()) << options.status().ToString();
  const std::string actual = options->storage.eviction_policy;
  EXPECT_FALSE(actual.empty());
  EXPECT_EQ(NameAfter(Read("docs/CONFIG.md"), "| `eviction` | `", "` |"), actual);
  EXPECT_EQ(NameAfter(Read("deploy/kvtierd.toml"), "\neviction = \"", "\""), actual);
  EXPECT_EQ(NameAfter(Read("docs/POLICIES.md"), "Default: **", "**"), actual);
}

}  // namespace
}  // namespace kvtier
