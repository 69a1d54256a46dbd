// cache_daemon/cluster_json: /v1/cluster without [cluster], and the generic reading of the
// kvtier_cluster_* series (a family the parser has never heard of appears with its type).
#include "cache_daemon/cluster_json.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

namespace kvtier::daemon {
namespace {

TEST(ClusterJson, SingleNodeSaysNotClustered) {
  EXPECT_EQ(nlohmann::json::parse(ClusterJson(nullptr)), nlohmann::json({{"clustered", false}}));
}

TEST(ClusterJson, EveryClusterSeriesIsReadGenerically) {
  const char* page =
      "# HELP kvtier_cluster_members Live members.\n"
      "# TYPE kvtier_cluster_members gauge\n"
      "kvtier_cluster_members 3\n"
      "# TYPE kvtier_cluster_future_thing_total counter\n"
      "kvtier_cluster_future_thing_total{peer=\"n2\",reason=\"x y\"} 17\n"
      "# TYPE kvtier_dram_used_bytes gauge\n"
      "kvtier_dram_used_bytes 99\n"
      "kvtier_cluster_untyped 1.5\n"
      "kvtier_cluster_garbage not-a-number\n";
  nlohmann::json j = nlohmann::json::parse(ClusterMetricsJson(page));
  EXPECT_EQ(j.size(), 3u) << j.dump();
  EXPECT_EQ(j["kvtier_cluster_members"]["type"], "gauge");
  EXPECT_EQ(j["kvtier_cluster_members"]["value"], 3.0);
  const auto& f = j["kvtier_cluster_future_thing_total{peer=\"n2\",reason=\"x y\"}"];
  EXPECT_EQ(f["type"], "counter");
  EXPECT_EQ(f["value"], 17.0);
  EXPECT_EQ(j["kvtier_cluster_untyped"]["type"], "untyped");
  EXPECT_FALSE(j.contains("kvtier_dram_used_bytes"));
}

TEST(ClusterJson, SamplesAreBounded) {
  std::string page;
  for (size_t i = 0; i < kClusterJsonSamplesMax + 10; ++i) {
    page += "kvtier_cluster_x{i=\"" + std::to_string(i) + "\"} 1\n";
  }
  EXPECT_EQ(nlohmann::json::parse(ClusterMetricsJson(page)).size(), kClusterJsonSamplesMax);
}

}  // namespace
}  // namespace kvtier::daemon
