// Placement is a pure function of (key, membership, R): determinism, distinct owners,
// stability under join and leave, weight proportionality, failure domains.
#include "cluster/placement.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace kvtier::cluster {
namespace {

MemberInfo Node(const std::string& id, uint64_t gib = 8, const std::string& domain = "") {
  MemberInfo m;
  m.node_id = id;
  m.peer_endpoint = "127.0.0.1:7000";
  m.failure_domain = domain;
  m.dram_bytes = gib << 30;
  return m;
}

std::string Key(int i) { return "storage-key-" + std::to_string(i); }

std::set<std::string> OwnerIds(const std::string& key, const std::vector<MemberInfo>& members,
                               uint32_t r) {
  std::set<std::string> ids;
  for (size_t i : PlaceOwners(key, members, r)) ids.insert(members[i].node_id);
  return ids;
}

TEST(PlacementTest, DeterministicDistinctAndIndependentOfOrder) {
  std::vector<MemberInfo> a;
  for (int i = 0; i < 7; ++i) a.push_back(Node("n" + std::to_string(i)));
  std::vector<MemberInfo> b(a.rbegin(), a.rend());
  for (int k = 0; k < 2000; ++k) {
    auto owners = PlaceOwners(Key(k), a, 3);
    ASSERT_EQ(owners.size(), 3u);
    std::set<size_t> distinct(owners.begin(), owners.end());
    EXPECT_EQ(distinct.size(), 3u);
    EXPECT_EQ(OwnerIds(Key(k), a, 3), OwnerIds(Key(k), b, 3));
    // The first owner of R=3 is the owner of R=1.
    EXPECT_EQ(a[owners[0]].node_id, a[PlaceOwners(Key(k), a, 1)[0]].node_id);
  }
}

TEST(PlacementTest, FewerMembersThanReplicasAndDrainingNodes) {
  std::vector<MemberInfo> m = {Node("a"), Node("b")};
  EXPECT_EQ(PlaceOwners("k", m, 3).size(), 2u);
  EXPECT_TRUE(PlaceOwners("k", {}, 2).empty());
  m[1].draining = true;
  for (int k = 0; k < 200; ++k) {
    auto owners = PlaceOwners(Key(k), m, 2);
    ASSERT_EQ(owners.size(), 1u);
    EXPECT_EQ(m[owners[0]].node_id, "a");
  }
}

// A join only moves keys to the new node; a leave only moves the leaver's keys.
TEST(PlacementTest, StableUnderJoinAndLeave) {
  std::vector<MemberInfo> before;
  for (int i = 0; i < 10; ++i) before.push_back(Node("n" + std::to_string(i), 4 + i));
  std::vector<MemberInfo> joined = before;
  joined.push_back(Node("new", 9));
  std::vector<MemberInfo> left = before;
  left.erase(left.begin() + 3);
  int moved_to_new = 0;
  const int keys = 20000;
  for (int k = 0; k < keys; ++k) {
    auto old_owners = OwnerIds(Key(k), before, 2);
    auto join_owners = OwnerIds(Key(k), joined, 2);
    if (join_owners.contains("new")) {
      ++moved_to_new;
      // The new node displaced at most one old owner.
      std::set<std::string> kept;
      std::set_intersection(old_owners.begin(), old_owners.end(), join_owners.begin(),
                            join_owners.end(), std::inserter(kept, kept.end()));
      EXPECT_EQ(kept.size(), 1u);
    } else {
      EXPECT_EQ(join_owners, old_owners) << Key(k);
    }
    auto leave_owners = OwnerIds(Key(k), left, 2);
    if (!old_owners.contains("n3")) {
      EXPECT_EQ(leave_owners, old_owners) << Key(k);
    } else {
      EXPECT_FALSE(leave_owners.contains("n3"));
      EXPECT_TRUE(leave_owners.contains(*std::find_if(
          old_owners.begin(), old_owners.end(), [](const std::string& s) { return s != "n3"; })));
    }
  }
  // The newcomer holds 9 of 94 GiB: about 2 * 9/94 of the owner slots (at most one per key).
  double share = static_cast<double>(moved_to_new) / keys;
  EXPECT_GT(share, 0.12);
  EXPECT_LT(share, 0.26);
}

TEST(PlacementTest, SharesFollowWeights) {
  std::vector<MemberInfo> m = {Node("w1", 1), Node("w2", 2), Node("w3", 3), Node("w4", 4)};
  std::map<std::string, int> count;
  const int keys = 100000;
  for (int k = 0; k < keys; ++k) ++count[m[PlaceOwners(Key(k), m, 1)[0]].node_id];
  for (int w = 1; w <= 4; ++w) {
    double share = static_cast<double>(count["w" + std::to_string(w)]) / keys;
    EXPECT_NEAR(share, w / 10.0, 0.01) << "w" << w;
  }
}

TEST(PlacementTest, OwnersSpanFailureDomainsWhereLabelsAllow) {
  std::vector<MemberInfo> m;
  for (int i = 0; i < 6; ++i)
    m.push_back(Node("n" + std::to_string(i), 8, "rack" + std::to_string(i % 3)));
  for (int k = 0; k < 5000; ++k) {
    auto owners = PlaceOwners(Key(k), m, 3);
    ASSERT_EQ(owners.size(), 3u);
    std::set<std::string> domains;
    for (size_t i : owners) domains.insert(m[i].failure_domain);
    EXPECT_EQ(domains.size(), 3u) << Key(k);
    // Four owners over three racks: all racks used, four distinct nodes.
    auto four = PlaceOwners(Key(k), m, 4);
    std::set<size_t> nodes(four.begin(), four.end());
    domains.clear();
    for (size_t i : four) domains.insert(m[i].failure_domain);
    EXPECT_EQ(nodes.size(), 4u);
    EXPECT_EQ(domains.size(), 3u);
  }
}

TEST(MemberTest, RecordsRoundTripAndHostileOnesAreRefused) {
  MemberInfo m = Node("node-1", 3, "zone.a");
  m.ssd_bytes = 100;
  auto back = DecodeMember(EncodeMember(m));
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(*back, m);
  EXPECT_TRUE(DecodeMember("not json").status().IsCorruption());
  EXPECT_TRUE(DecodeMember(R"({"node_id":"a b","peer_endpoint":"127.0.0.1:1","failure_domain":"",
      "dram_bytes":1,"ssd_bytes":0})")
                  .status()
                  .IsCorruption());
  EXPECT_TRUE(DecodeMember(R"({"node_id":"a","peer_endpoint":"127.0.0.1:0","failure_domain":"",
      "dram_bytes":1,"ssd_bytes":0})")
                  .status()
                  .IsCorruption());
  EXPECT_TRUE(DecodeMember(R"({"node_id":"a","peer_endpoint":"127.0.0.1:1","failure_domain":"",
      "dram_bytes":-1,"ssd_bytes":0})")
                  .status()
                  .IsCorruption());
  EXPECT_TRUE(DecodeMember(std::string(5000, ' ')).status().IsCorruption());
  // admin_endpoint: optional (an older node's record has none), round-trips, checked.
  m.admin_endpoint = "127.0.0.1:9180";
  back = DecodeMember(EncodeMember(m));
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(back->admin_endpoint, "127.0.0.1:9180");
  auto old = DecodeMember(R"({"node_id":"a","peer_endpoint":"127.0.0.1:1","failure_domain":"",
      "dram_bytes":1,"ssd_bytes":0,"draining":true})");
  ASSERT_TRUE(old.ok()) << old.status().message();
  EXPECT_EQ(old->admin_endpoint, "");
  EXPECT_TRUE(old->draining);
  // keeps_copies: optional (false when absent), round-trips, must be a boolean.
  EXPECT_FALSE(old->keeps_copies);
  m.keeps_copies = true;
  back = DecodeMember(EncodeMember(m));
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_TRUE(back->keeps_copies);
  EXPECT_TRUE(DecodeMember(R"({"node_id":"a","peer_endpoint":"127.0.0.1:1","failure_domain":"",
      "dram_bytes":1,"ssd_bytes":0,"keeps_copies":1})")
                  .status()
                  .IsCorruption());
  for (const char* bad : {R"("admin_endpoint":7)", R"("admin_endpoint":"127.0.0.1:0")",
                          R"("admin_endpoint":"https://x:1")"}) {
    EXPECT_TRUE(DecodeMember(std::string(R"({"node_id":"a","peer_endpoint":"127.0.0.1:1",)") +
                             R"("failure_domain":"","dram_bytes":1,"ssd_bytes":0,)" + bad + "}")
                    .status()
                    .IsCorruption())
        << bad;
  }
}

}  // namespace
}  // namespace kvtier::cluster
