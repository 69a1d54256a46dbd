// [cluster] config: parsing, validation (each rule names its key) and the shipped example
// (deploy/kvtierd.toml: it parses, and it and docs/CONFIG.md name every key kvtierd reads).
#include <gtest/gtest.h>

#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "cache_daemon/cluster_node.h"
#include "cache_daemon/config.h"
#include "common/temp_dir.h"

namespace kvtier::daemon {
namespace {

const char* kGood =
    "[auth]\ntokens_file = \"/dev/null\"\n"
    "[cluster]\nenabled = true\netcd_endpoints = [\"127.0.0.1:2379\", \"http://10.0.0.2:2379\"]\n"
    "node_id = \"node-1\"\npeer_listen = \"0.0.0.0:7400\"\npeer_advertise = \"10.0.0.1:7400\"\n"
    "failure_domain = \"rack-a\"\nreplicas = 3\nwrite_acks = 2\n"
    "credential_file = \"/etc/kvtier/cluster.key\"\n";

StatusOr<DaemonOptions> Load(const std::string& text) {
  KVTIER_ASSIGN_OR_RETURN(DaemonOptions o, ParseConfig(text));
  o.data_dir = "/tmp/kvtier-cluster-config-test";
  KVTIER_RETURN_IF_ERROR(Finalize(&o));
  return o;
}

TEST(ClusterConfigTest, AGoodSectionParses) {
  auto o = Load(kGood);
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  const ClusterServeOptions& c = o->cluster;
  EXPECT_TRUE(c.enabled);
  EXPECT_EQ(c.etcd_endpoints.size(), 2u);
  EXPECT_EQ(c.peer_host, "0.0.0.0");
  EXPECT_EQ(c.peer_port, 7400);
  EXPECT_EQ(c.replicas, 3u);
  EXPECT_EQ(c.write_acks, 2u);
  EXPECT_EQ(c.repair_bytes_per_s, 64ull << 20);  // defaults of the repair scan
  EXPECT_EQ(c.repair_retry_ms, 1000u);
  EXPECT_EQ(c.repair_interval_s, 300u);
  EXPECT_EQ(c.peer_probe_interval_ms, 500u);  // suspicion on (docs/CLUSTER.md)
  for (uint64_t ms : {0, 10, 60000}) {        // 0: off
    auto p = Load(std::string(kGood) + "peer_probe_interval_ms = " + std::to_string(ms) + "\n");
    ASSERT_TRUE(p.ok()) << ms << ": " << p.status().ToString();
    EXPECT_EQ(p->cluster.peer_probe_interval_ms, ms);
  }
  EXPECT_EQ(c.clock_sample_interval_ms, 10000u);  // peers' clocks read (cluster/peer_clocks.h)
  for (uint64_t ms : {0, 1000, 3600000}) {        // 0: off
    auto p = Load(std::string(kGood) + "clock_sample_interval_ms = " + std::to_string(ms) + "\n");
    ASSERT_TRUE(p.ok()) << ms << ": " << p.status().ToString();
    EXPECT_EQ(p->cluster.clock_sample_interval_ms, ms);
  }
  // Absent section: off, and nothing else required.
  auto plain = Load("");
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(plain->cluster.enabled);
}

TEST(ClusterConfigTest, BadValuesNameTheirKey) {
  struct Case {
    std::string from, to, key;
  };
  const Case cases[] = {
      {"node_id = \"node-1\"", "node_id = \"no spaces\"", "cluster.node_id"},
      {"node_id = \"node-1\"\n", "", "cluster.node_id"},
      {"replicas = 3", "replicas = 0", "cluster.replicas"},
      {"replicas = 3", "replicas = 17", "cluster.replicas"},
      {"write_acks = 2", "write_acks = 4", "cluster.write_acks"},
      {"\"127.0.0.1:2379\", ", "\"127.0.0.1\", ", "cluster.etcd_endpoints"},
      {"peer_listen = \"0.0.0.0:7400\"", "peer_listen = \"host.example:7400\"",
       "cluster.peer_listen"},
      {"failure_domain = \"rack-a\"", "failure_domain = \"rack a\"", "cluster.failure_domain"},
      {"credential_file = \"/etc/kvtier/cluster.key\"\n", "", "cluster.credential_file"},
      {"replicas = 3", "replicas = 3\nlease_ttl_s = 1", "cluster.lease_ttl_s"},
      {"replicas = 3", "replicas = 3\ntypo = 1", "cluster.typo"},
      {"replicas = 3", "replicas = \"3\"", "cluster.replicas"},
      {"replicas = 3", "replicas = 3\nrepair_bytes_per_s = 1023", "cluster.repair_bytes_per_s"},
      {"replicas = 3", "replicas = 3\nrepair_retry_ms = 5", "cluster.repair_retry_ms"},
      {"replicas = 3", "replicas = 3\nrepair_interval_s = 0", "cluster.repair_interval_s"},
      {"replicas = 3", "replicas = 3\nget_copy_bytes_max = 1099511627777",
       "cluster.get_copy_bytes_max"},
      {"replicas = 3", "replicas = 3\nget_copy_ttl_ms = 999", "cluster.get_copy_ttl_ms"},
      {"replicas = 3", "replicas = 3\nget_copy_ttl_ms = 3600001", "cluster.get_copy_ttl_ms"},
      {"replicas = 3", "replicas = 3\npeer_probe_interval_ms = 9",
       "cluster.peer_probe_interval_ms"},
      {"replicas = 3", "replicas = 3\npeer_probe_interval_ms = 60001",
       "cluster.peer_probe_interval_ms"},
      {"replicas = 3", "replicas = 3\nclock_sample_interval_ms = 999",
       "cluster.clock_sample_interval_ms"},
      {"replicas = 3", "replicas = 3\nclock_sample_interval_ms = 3600001",
       "cluster.clock_sample_interval_ms"},
  };
  for (const auto& c : cases) {
    std::string text = kGood;
    size_t at = text.find(c.from);
    ASSERT_NE(at, std::string::npos) << c.from;
    text.replace(at, c.from.size(), c.to);
    auto o = Load(text);
    ASSERT_FALSE(o.ok()) << c.to;
    EXPECT_NE(o.status().message().find(c.key), std::string::npos)
        << c.to << ": " << o.status().message();
  }
  // Auth off: the peer front must be loopback.
  std::string text = kGood;
  text.replace(0, text.find("[cluster]"), "");
  auto o = Load(text);
  ASSERT_FALSE(o.ok());
  EXPECT_TRUE(o.status().IsPermissionDenied()) << o.status().ToString();
}

std::string ReadSource(const std::string& rel) {
  std::ifstream in(std::string(KVTIER_SOURCE_DIR) + "/" + rel);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// config.h asks for the parser, docs/CONFIG.md and deploy/kvtierd.toml to list the same keys;
// five had gone missing from the example (limits.max_batch_keys, the two malloc keys,
// storage.hbm_objects_max and storage.dram_prefault). "section.key" of every key assignment in
// the example, its comments left out.
TEST(ClusterConfigTest, TheShippedExampleAndConfigDocNameEveryKey) {
  std::set<std::string> in_example;
  std::istringstream toml(ReadSource("deploy/kvtierd.toml"));
  std::string line, section;
  while (std::getline(toml, line)) {
    line = line.substr(0, line.find('#'));
    const size_t first = line.find_first_not_of(' ');
    if (first == std::string::npos) continue;
    if (line[first] == '[') {
      section = line.substr(first + 1, line.find(']') - first - 1);
      continue;
    }
    const size_t eq = line.find('=');
    if (eq == std::string::npos) continue;
    const size_t end = line.find_last_not_of(' ', eq - 1);
    in_example.insert(section + "." + line.substr(first, end - first + 1));
  }
  const std::string doc = ReadSource("docs/CONFIG.md");
  ASSERT_FALSE(doc.empty());
  const std::vector<std::string> keys = ConfigKeyNames();
  ASSERT_GT(keys.size(), 80u);
  for (const std::string& key : keys) {
    EXPECT_TRUE(in_example.count(key)) << key << " is missing from deploy/kvtierd.toml";
    const std::string bare = key.substr(key.find('.') + 1);
    EXPECT_NE(doc.find("`" + bare + "`"), std::string::npos) << key << " is not in docs/CONFIG.md";
  }
}

TEST(ClusterConfigTest, TheShippedExampleParses) {
  std::ifstream in(std::string(KVTIER_SOURCE_DIR) + "/deploy/kvtierd.toml");
  std::stringstream ss;
  ss << in.rdbuf();
  auto o = ParseConfig(ss.str());
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_FALSE(o->cluster.enabled);
  EXPECT_EQ(o->cluster.replicas, 2u);
}

TEST(ClusterConfigTest, CredentialFilesAreCheckedForLength) {
  TempDir dir("kvtier-cred-");
  ASSERT_TRUE(dir.ok());
  std::string short_file = dir.File("short"), good = dir.File("good");
  std::ofstream(short_file) << std::string(31, 'x') << "\n";
  std::ofstream(good) << std::string(32, 'x') << "\n";
  EXPECT_TRUE(ReadCredentialFile(short_file).status().IsInvalidArgument());
  auto c = ReadCredentialFile(good);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->size(), 32u);
  EXPECT_TRUE(ReadCredentialFile(dir.File("absent")).status().IsIOError());
}

}  // namespace
}  // namespace kvtier::daemon
