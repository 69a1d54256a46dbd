#include "common/config.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>

namespace kvtier {
namespace {

constexpr const char* kToml = R"(# kvtierd test config
listen = "unix:///run/kvtier.sock"
verbose = true

[dram]
capacity_bytes = 1073741824
policy = "lru"
high_watermark = 0.9
low_watermark = 1

[ssd]
paths = ["/a", "/b"]
durability = "batched"
group_commit_ms = "ten"
mixed = ["/a", 3]
)";

ConfigSection Root() {
  StatusOr<ConfigSection> c = ConfigSection::Parse(kToml, "test.toml");
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return *c;
}

TEST(Config, TypedGettersReturnValuesAndDefaults) {
  const ConfigSection root = Root();
  EXPECT_EQ(*root.String("listen", ""), "unix:///run/kvtier.sock");
  EXPECT_TRUE(*root.Bool("verbose", false));
  EXPECT_EQ(*root.Int("missing", 17), 17);
  EXPECT_EQ(*root.String("missing", "dflt"), "dflt");
  const ConfigSection dram = *root.Section("dram");
  EXPECT_EQ(dram.path(), "dram");
  EXPECT_EQ(*dram.Int("capacity_bytes", 0, 0, INT64_MAX), 1073741824);
  EXPECT_DOUBLE_EQ(*dram.Double("high_watermark", 0), 0.9);
  EXPECT_DOUBLE_EQ(*dram.Double("low_watermark", 0), 1.0);  // integers accepted as numbers
  const ConfigSection ssd = *root.Section("ssd");
  EXPECT_EQ(*ssd.StringList("paths", {}), (std::vector<std::string>{"/a", "/b"}));
  EXPECT_EQ(*ssd.StringList("none", {"x"}), (std::vector<std::string>{"x"}));
  // A missing section is empty: every getter gives its default.
  const ConfigSection absent = *root.Section("rdma");
  EXPECT_EQ(*absent.Int("port", 4791), 4791);
  EXPECT_TRUE(absent.Keys().empty());
  EXPECT_TRUE(absent.CheckKeys({}).ok());
}

TEST(Config, WrongTypesAreErrorsWithFileAndLine) {
  const ConfigSection root = Root();
  const ConfigSection ssd = *root.Section("ssd");
  StatusOr<int64_t> ms = ssd.Int("group_commit_ms", 5);
  ASSERT_TRUE(ms.status().IsInvalidArgument());
  EXPECT_NE(ms.status().message().find("test.toml:14:"), std::string::npos)
      << ms.status().ToString();
  EXPECT_NE(ms.status().message().find("ssd.group_commit_ms"), std::string::npos);
  EXPECT_NE(ms.status().message().find("string"), std::string::npos);
  EXPECT_TRUE(root.Bool("listen", false).status().IsInvalidArgument());
  EXPECT_TRUE(root.String("verbose", "").status().IsInvalidArgument());
  EXPECT_TRUE(root.Double("listen", 0).status().IsInvalidArgument());
  EXPECT_TRUE(ssd.StringList("durability", {}).status().IsInvalidArgument());
  StatusOr<std::vector<std::string>> mixed = ssd.StringList("mixed", {});
  ASSERT_TRUE(mixed.status().IsInvalidArgument());
  EXPECT_NE(mixed.status().message().find("test.toml:15:"), std::string::npos)
      << mixed.status().ToString();
  EXPECT_TRUE(root.Section("listen").status().IsInvalidArgument());
}

TEST(Config, RangeChecks) {
  const ConfigSection dram = *Root().Section("dram");
  StatusOr<int64_t> v = dram.Int("capacity_bytes", 0, 0, 1 << 20);
  ASSERT_TRUE(v.status().IsInvalidArgument());
  EXPECT_NE(v.status().message().find("out of range"), std::string::npos);
  EXPECT_NE(v.status().message().find("test.toml:6:"), std::string::npos) << v.status().ToString();
}

TEST(Config, UnknownKeysAreReportedFirstInDocumentOrder) {
  const ConfigSection root = Root();
  EXPECT_TRUE(root.CheckKeys({"listen", "verbose", "dram", "ssd"}).ok());
  const ConfigSection dram = *root.Section("dram");
  Status s = dram.CheckKeys({"capacity_bytes", "high_watermark"});
  ASSERT_TRUE(s.IsInvalidArgument());
  // "policy" (line 7) comes before "low_watermark" (line 9) in the file.
  EXPECT_NE(s.message().find("unknown key 'dram.policy'"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("test.toml:7:"), std::string::npos) << s.ToString();
  EXPECT_EQ(dram.Keys(), (std::vector<std::string>{"capacity_bytes", "policy", "high_watermark",
                                                   "low_watermark"}));
}

TEST(Config, SyntaxErrorsCarryFileLineAndColumn) {
  StatusOr<ConfigSection> c = ConfigSection::Parse("a = 1\nb = = 2\n", "bad.toml");
  ASSERT_TRUE(c.status().IsInvalidArgument());
  EXPECT_EQ(c.status().message().rfind("bad.toml:2:", 0), 0u) << c.status().ToString();
  EXPECT_TRUE(ConfigSection::Parse("a = 1\na = 2\n", "dup.toml").status().IsInvalidArgument());
  EXPECT_TRUE(ConfigSection::Parse("[t]\nx=1\n[t]\n", "t.toml").status().IsInvalidArgument());
}

TEST(Config, LoadFileReadsAndReportsMissingFiles) {
  const std::string path = ::testing::TempDir() + "/kvtier_config_test.toml";
  {
    std::ofstream out(path);
    out << "[engine]\nunit_tokens = 64\n";
  }
  StatusOr<ConfigSection> c = ConfigSection::LoadFile(path);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(*c->Section("engine")->Int("unit_tokens", 0), 64);
  std::remove(path.c_str());
  EXPECT_TRUE(ConfigSection::LoadFile(path).status().IsIOError());
}

TEST(Config, ReadFileBoundedReadsUpToItsLimitAndRefusesMore) {
  const std::string path = ::testing::TempDir() + "/kvtier_read_bounded_test.bin";
  // Longer than one 64 KiB read, so the limit is checked across reads.
  const std::string bytes(70000, 'k');
  {
    std::ofstream out(path, std::ios::binary);
    out << bytes;
  }
  auto exact = ReadFileBounded(path, bytes.size());
  ASSERT_TRUE(exact.ok()) << exact.status().ToString();
  EXPECT_EQ(*exact, bytes);
  auto over = ReadFileBounded(path, bytes.size() - 1);
  EXPECT_EQ(over.status().code(), StatusCode::kInvalidArgument) << over.status().ToString();
  EXPECT_NE(over.status().message().find("larger than 69999 bytes"), std::string::npos);
  std::remove(path.c_str());
  EXPECT_EQ(ReadFileBounded(path, 10).status().code(), StatusCode::kIOError);
}

TEST(Config, SectionsOutliveTheRootObject) {
  StatusOr<ConfigSection> dram = [] { return Root().Section("dram"); }();
  ASSERT_TRUE(dram.ok());
  EXPECT_EQ(*dram->String("policy", ""), "lru");
}

}  // namespace
}  // namespace kvtier
