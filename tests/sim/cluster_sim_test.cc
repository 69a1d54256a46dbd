// sim/cluster_sim: private vs pooled caches on hand-made traces whose answers are worked out
// by hand in the comments, and the option checks.
#include "sim/cluster_sim.h"

#include <gtest/gtest.h>

#include <string>

#include "sim/trace.h"

namespace kvtier::sim {
namespace {

// A Mooncake trace: one line per request, every block full (512 tokens).
UnitTrace Build(const std::vector<std::vector<int>>& requests) {
  std::string text;
  for (size_t i = 0; i < requests.size(); ++i) {
    std::string ids;
    for (int id : requests[i]) ids += (ids.empty() ? "" : ",") + std::to_string(id);
    text += "{\"timestamp\": " + std::to_string(i) +
            ", \"input_length\": " + std::to_string(512 * requests[i].size()) +
            ", \"output_length\": 1, \"hash_ids\": [" + ids + "]}\n";
  }
  auto trace = ParseTrace(text);
  EXPECT_TRUE(trace.ok()) << trace.status().ToString();
  auto units = BuildUnitTrace(*trace);
  EXPECT_TRUE(units.ok()) << units.status().ToString();
  return *units;
}

ClusterSimResult Simulate(const UnitTrace& t, uint32_t hosts, uint64_t capacity, HostAssignment a,
                          uint32_t affinity_units = 1) {
  auto r = SimulateCluster(t, {.hosts = hosts,
                               .capacity_units = capacity,
                               .assignment = a,
                               .affinity_units = affinity_units});
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return *r;
}

TEST(ClusterSim, RoundRobinSplitsReuseAcrossPrivateCachesButNotThePool) {
  // Four requests for the same two blocks. Round robin over 2 hosts: h0 h1 h0 h1.
  // Private (2 units each): requests 0 and 1 miss, 2 and 3 hit both blocks: 2048 / 4096.
  // Pooled (4 units): only request 0 misses: 3072 / 4096; requests 1 and 3 (host 1) hit
  // blocks that host 0 stored: 2 x 2 blocks moved.
  UnitTrace t = Build({{1, 2}, {1, 2}, {1, 2}, {1, 2}});
  ClusterSimResult r = Simulate(t, 2, 4, HostAssignment::kRoundRobin);
  EXPECT_EQ(r.requests, 4u);
  EXPECT_EQ(r.prompt_tokens, 4096u);
  EXPECT_EQ(r.private_hit_tokens, 2048u);
  EXPECT_EQ(r.pooled_hit_tokens, 3072u);
  EXPECT_EQ(r.pooled_remote_hit_tokens, 2048u);
  EXPECT_EQ(r.bytes_moved, t.size_bytes[0] + t.size_bytes[1] + t.size_bytes[0] + t.size_bytes[1]);
  EXPECT_EQ(r.requests_per_host, (std::vector<uint64_t>{2, 2}));
  EXPECT_DOUBLE_EQ(r.private_hit_ratio(), 0.5);
  EXPECT_DOUBLE_EQ(r.pooled_hit_ratio(), 0.75);
}

TEST(ClusterSim, SessionAffinityKeepsASessionOnOneHost) {
  // Same trace, affinity on the first block: every request on one host, so private hits as
  // much as pooled (3 of 4 requests) and nothing moves.
  UnitTrace t = Build({{1, 2}, {1, 2}, {1, 2}, {1, 2}});
  ClusterSimResult r = Simulate(t, 2, 4, HostAssignment::kSessionAffinity);
  EXPECT_EQ(r.private_hit_tokens, 3072u);
  EXPECT_EQ(r.pooled_hit_tokens, 3072u);
  EXPECT_EQ(r.bytes_moved, 0u);
  EXPECT_TRUE(r.requests_per_host == (std::vector<uint64_t>{4, 0}) ||
              r.requests_per_host == (std::vector<uint64_t>{0, 4}));
}

TEST(ClusterSim, APrefixStopsAtItsFirstMiss) {
  // Capacity 2 over 2 hosts: one unit per private cache. Host 0 stores 1 then 2 and keeps
  // only 2 (LRU), so its second request misses block 1 and gets nothing from block 2.
  // The pool of 2 keeps both: requests 1, 2, 3 hit 1024 tokens each.
  UnitTrace t = Build({{1, 2}, {1, 2}, {1, 2}, {1, 2}});
  ClusterSimResult r = Simulate(t, 2, 2, HostAssignment::kRoundRobin);
  EXPECT_EQ(r.private_hit_tokens, 0u);
  EXPECT_EQ(r.pooled_hit_tokens, 3072u);
}

TEST(ClusterSim, OneHostIsThePool) {
  UnitTrace t = Build({{1, 2, 3}, {1, 2, 4}, {5}, {1, 2, 3}, {5, 6}});
  for (HostAssignment a : {HostAssignment::kRoundRobin, HostAssignment::kSessionAffinity}) {
    ClusterSimResult r = Simulate(t, 1, 3, a);
    EXPECT_EQ(r.private_hit_tokens, r.pooled_hit_tokens);
    EXPECT_EQ(r.bytes_moved, 0u);
  }
}

TEST(ClusterSim, NonsenseOptionsAreRefused) {
  UnitTrace t = Build({{1}});
  EXPECT_TRUE(SimulateCluster(t, {.hosts = 0, .capacity_units = 4}).status().IsInvalidArgument());
  EXPECT_TRUE(SimulateCluster(t, {.hosts = kClusterHostsMax + 1, .capacity_units = 1u << 20})
                  .status()
                  .IsInvalidArgument());
  EXPECT_TRUE(SimulateCluster(t, {.hosts = 4, .capacity_units = 3}).status().IsInvalidArgument());
  EXPECT_TRUE(SimulateCluster(t, {.hosts = 2, .capacity_units = 4, .affinity_units = 0})
                  .status()
                  .IsInvalidArgument());
}

}  // namespace
}  // namespace kvtier::sim
