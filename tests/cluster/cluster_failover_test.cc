// Failover against real processes (label slow: each case waits out etcd leases): kill -9 of
// a node under a writing load loses no acknowledged unit; a node stopped past its lease
// rejoins without serving units deleted meanwhile.
#include <algorithm>

#include "tests/cluster/cluster_fixture.h"

namespace kvtier::cluster {
namespace {

// Units of `chain` read through `c` that still carry their bytes from `old_values` (stale),
// and units not found at all (missing).
struct StaleCount {
  int stale = 0;
  int missing = 0;
};
StaleCount CountStale(Client* c, const std::vector<Key>& chain,
                      const std::vector<std::vector<uint8_t>>& old_values) {
  std::vector<std::vector<uint8_t>> got;
  std::vector<bool> found;
  StaleCount n;
  EXPECT_TRUE(c->GetCopy(chain, &got, &found).ok());
  if (found.size() != chain.size()) return StaleCount{0, static_cast<int>(chain.size())};
  for (size_t i = 0; i < chain.size(); ++i) {
    if (!found[i]) ++n.missing;
    if (found[i] && got[i] == old_values[i]) ++n.stale;
  }
  return n;
}

// Puts new random bytes (of the old sizes, from `seed`) under every key of `chain`, through
// `writer`; every put must be acknowledged.
void OverwriteSession(Client* writer, const std::vector<Key>& chain,
                      const std::vector<std::vector<uint8_t>>& old_values, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<uint8_t>> new_values(chain.size());
  std::vector<PutUnit> units(chain.size());
  for (size_t i = 0; i < chain.size(); ++i) {
    new_values[i].resize(old_values[i].size());
    for (auto& b : new_values[i]) b = static_cast<uint8_t>(rng());
    units[i].key = chain[i];
    if (i > 0) units[i].parent = chain[i - 1];
    units[i].value = new_values[i];
  }
  auto st = writer->Put(units, {});
  ASSERT_TRUE(st.ok());
  for (const auto& s : *st) ASSERT_TRUE(s.ok()) << s.message();
}

// kill -9 of one node under a writing load, durability sync, R = 2, every owner must
// acknowledge: every acknowledged unit is still read bit-exactly through both survivors.
TEST_F(ClusterE2eTest, KillNineUnderWritesLosesNoAcknowledgedUnit) {
  auto writer = Connect(0, "tok-alice");
  ASSERT_NE(writer, nullptr);
  std::mt19937 rng(7);
  std::vector<std::pair<Key, std::vector<uint8_t>>> acked;
  int failed = 0;
  auto write_one = [&](int i) {
    std::vector<uint8_t> value(2000 + (i % 7) * 5000);
    for (auto& b : value) b = static_cast<uint8_t>(rng());
    PutUnit u;
    u.key = ChainKey("kill", i);
    u.value = value;
    auto st = writer->Put(std::span<const PutUnit>(&u, 1), {});
    if (st.ok() && (*st)[0].ok()) {
      acked.emplace_back(u.key, std::move(value));
    } else {
      ++failed;
    }
  };
  int i = 0;
  for (; i < 60; ++i) write_one(i);
  ASSERT_EQ(acked.size(), 60u) << "puts failed before the kill";
  nodes_[2]->Signal(SIGKILL);
  // Keep writing through the window in which n2 is still listed (its lease runs out).
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(4);
  while (std::chrono::steady_clock::now() < until) write_one(i++);
  ASSERT_TRUE(kt::WaitFor(
      [&] {
        return Metric(Metrics(0), "kvtier_cluster_members") == 2 &&
               Metric(Metrics(1), "kvtier_cluster_members") == 2;
      },
      10000));
  for (int n = 0; n < 20; ++n) write_one(i++);  // after the view changed: all succeed
  EXPECT_GT(acked.size(), 80u);
  for (int node : {0, 1}) {
    auto c = Connect(node, "tok-alice");
    ASSERT_NE(c, nullptr);
    std::vector<Key> keys;
    for (const auto& a : acked) keys.push_back(a.first);
    std::vector<std::vector<uint8_t>> got;
    std::vector<bool> found;
    ASSERT_TRUE(c->GetCopy(keys, &got, &found).ok());
    size_t lost = 0;
    for (size_t k = 0; k < acked.size(); ++k) {
      if (!found[k] || got[k] != acked[k].second) ++lost;
    }
    EXPECT_EQ(lost, 0u) << "node " << node << ": " << lost << " of " << acked.size()
                        << " acknowledged units lost (" << failed << " puts refused)";
  }
}

// A node stopped (SIGSTOP) past its lease is treated as gone; deletes (of units and of a
// whole tenant) made meanwhile reach it through the tombstone log when it is continued: it
// rejoins without serving a deleted unit, and still serves the units that were not deleted.
TEST_F(ClusterE2eTest, StoppedNodeRejoinsWithoutServingDeletedUnits) {
  auto alice0 = Connect(0, "tok-alice");
  auto bob0 = Connect(0, "tok-bob");
  ASSERT_NE(alice0, nullptr);
  ASSERT_NE(bob0, nullptr);
  auto kept = PutSession(alice0.get(), "keep");
  PutSession(alice0.get(), "gone");
  PutSession(bob0.get(), "bob");
  // n2 holds about two thirds of each session (R = 2 of 3 nodes).
  ASSERT_GT(Metric(Metrics(2), "kvtier_cluster_peer_requests_total"), 0);

  nodes_[2]->Signal(SIGSTOP);
  ASSERT_TRUE(
      kt::WaitFor([&] { return Metric(Metrics(0), "kvtier_cluster_members") == 2; }, 10000));
  auto gone = Chain("gone");
  auto deleted = alice0->Delete(gone);
  ASSERT_TRUE(deleted.ok());
  EXPECT_EQ(*deleted, static_cast<uint32_t>(kUnits));
  auto bob1 = Connect(1, "tok-bob");
  ASSERT_TRUE(bob1->DeleteAll().ok());

  nodes_[2]->Signal(SIGCONT);
  ASSERT_TRUE(kt::WaitFor(
      [&] {
        return Metric(Metrics(0), "kvtier_cluster_members") == 3 &&
               Metric(Metrics(2), "kvtier_cluster_registrations_total") >= 2;
      },
      15000));
  EXPECT_GT(Metric(Metrics(2), "kvtier_cluster_tombstones_applied_total"), 0);
  EXPECT_GE(Metric(Metrics(2), "kvtier_cluster_tenant_deletes_applied_total"), 1);
  for (int i = 0; i < kNodes; ++i) {
    auto alice = Connect(i, "tok-alice");
    auto bob = Connect(i, "tok-bob");
    ASSERT_NE(alice, nullptr);
    auto hit = alice->Lookup(gone);
    ASSERT_TRUE(hit.ok());
    EXPECT_EQ(hit->hit_count, 0u) << "node " << i << " serves deleted units";
    std::vector<std::vector<uint8_t>> got;
    std::vector<bool> found;
    ASSERT_TRUE(alice->GetCopy(gone, &got, &found).ok());
    EXPECT_EQ(std::count(found.begin(), found.end(), true), 0) << "node " << i;
    auto bob_hit = bob->Lookup(Chain("bob"));
    ASSERT_TRUE(bob_hit.ok());
    EXPECT_EQ(bob_hit->hit_count, 0u) << "node " << i << " serves a deleted tenant's units";
    ExpectWholeSession(alice.get(), "keep", kept, i);
  }
}

// An owner stopped past its lease misses an overwrite made meanwhile through another node;
// continued and re-registered, no node may serve the old bytes (docs/CLUSTER.md: the PUT
// records a tombstone for the departed owner). Before that rule the rejoined node served 16 of
// 24 units with their old bytes, and the two others 3 each (routed to it as an owner).
TEST_F(ClusterE2eTest, OwnerStoppedPastItsLeaseServesNoOverwrittenBytes) {
  auto writer = Connect(0, "tok-alice");
  ASSERT_NE(writer, nullptr);
  auto old_values = PutSession(writer.get(), "over");
  auto chain = Chain("over");

  nodes_[2]->Signal(SIGSTOP);
  ASSERT_TRUE(
      kt::WaitFor([&] { return Metric(Metrics(0), "kvtier_cluster_members") == 2; }, 10000));
  ASSERT_NO_FATAL_FAILURE(OverwriteSession(writer.get(), chain, old_values, 41));

  nodes_[2]->Signal(SIGCONT);
  ASSERT_TRUE(kt::WaitFor(
      [&] {
        return Metric(Metrics(0), "kvtier_cluster_members") == 3 &&
               Metric(Metrics(2), "kvtier_cluster_registrations_total") >= 2;
      },
      15000));
  for (int node = 0; node < kNodes; ++node) {
    auto c = Connect(node, "tok-alice");
    ASSERT_NE(c, nullptr);
    const int stale = CountStale(c.get(), chain, old_values).stale;
    EXPECT_EQ(stale, 0) << "node " << node << " serves " << stale << " of " << kUnits
                        << " units with their bytes from before the overwrite";
  }
}

// With write_acks below replicas a PUT is acknowledged although an owner missed it. That
// owner, killed and restarted within its lease (so it never left anyone's view), must not
// serve the older version once it is back: the PUT recorded a tombstone naming every member
// but it (docs/CLUSTER.md, "PUT"). Before that rule the restarted node served 16 of 24 units
// with their old bytes.
class ClusterPartialAcksTest : public ClusterE2eTest {
 protected:
  std::string ExtraClusterConfig(int /*i*/) override { return "write_acks = 1\n"; }
  uint32_t LeaseTtlS() const override { return 30; }
};

TEST_F(ClusterPartialAcksTest, AnOwnerThatMissedAnAcknowledgedPutServesNoOlderVersion) {
  auto writer = Connect(0, "tok-alice");
  ASSERT_NE(writer, nullptr);
  auto old_values = PutSession(writer.get(), "over");
  auto chain = Chain("over");

  nodes_[2]->Stop(SIGKILL);
  ASSERT_NO_FATAL_FAILURE(OverwriteSession(writer.get(), chain, old_values, 43));
  // The forwards to n2 failed, and n2 is still listed: the PUTs were acknowledged by the
  // other owner alone.
  EXPECT_EQ(Metric(Metrics(0), "kvtier_cluster_members"), 3);
  EXPECT_GT(Metric(Metrics(0), "kvtier_cluster_overwrite_tombstones_total"), 0);

  ASSERT_TRUE(StartNode(2)) << nodes_[2]->Log();
  ASSERT_TRUE(kt::WaitFor(
      [&] {
        return Metric(Metrics(2), "kvtier_cluster_members") == 3 &&
               Metric(Metrics(2), "kvtier_cluster_registrations_total") >= 1;
      },
      15000));
  for (int node = 0; node < kNodes; ++node) {
    auto c = Connect(node, "tok-alice");
    ASSERT_NE(c, nullptr);
    const auto [stale, missing] = CountStale(c.get(), chain, old_values);
    EXPECT_EQ(stale, 0) << "node " << node << " serves " << stale << " of " << kUnits
                        << " units with their bytes from before the acknowledged overwrite";
    EXPECT_EQ(missing, 0) << "node " << node;
  }
}

// GET copies (docs/CLUSTER.md, "Copies"): a copy holder stopped past its lease misses the
// overwrite made meanwhile (it is in no view, so nobody tells it); continued, it must not
// serve its copies, not even to its local clients before it has re-registered.
class ClusterCopiesFailoverTest : public ClusterE2eTest {
 protected:
  std::string ExtraClusterConfig(int /*i*/) override { return "get_copy_bytes_max = 8388608\n"; }
  // Room for every size class of a session's units: copies are not evicted meanwhile.
  uint64_t DramCapacityBytes(int /*i*/) const override { return 268435456; }
};

TEST_F(ClusterCopiesFailoverTest, CopyHolderStoppedPastItsLeaseServesNoCopy) {
  auto writer = Connect(0, "tok-alice");
  ASSERT_NE(writer, nullptr);
  auto old_values = PutSession(writer.get(), "stop");
  auto reader = Connect(2, "tok-alice");
  ASSERT_NE(reader, nullptr);
  // One GET per unit: the ones n2 fetched from a peer are the ones it now holds as copies.
  auto chain = Chain("stop");
  std::vector<int> copies;
  for (int i = 0; i < kUnits; ++i) {
    const double before = Metric(Metrics(2), "kvtier_cluster_remote_get_hits_total");
    std::vector<std::vector<uint8_t>> got;
    std::vector<bool> found;
    ASSERT_TRUE(reader->GetCopy(std::span<const Key>(&chain[i], 1), &got, &found).ok());
    ASSERT_TRUE(found[0] && got[0] == old_values[i]);
    if (Metric(Metrics(2), "kvtier_cluster_remote_get_hits_total") > before) copies.push_back(i);
  }
  ASSERT_FALSE(copies.empty());
  ASSERT_EQ(Metric(Metrics(2), "kvtier_cluster_copy_units"), copies.size());

  nodes_[2]->Signal(SIGSTOP);
  ASSERT_TRUE(
      kt::WaitFor([&] { return Metric(Metrics(0), "kvtier_cluster_members") == 2; }, 10000));
  // The overwrite: new values for every unit, through n0, while n2 is gone.
  ASSERT_NO_FATAL_FAILURE(OverwriteSession(writer.get(), chain, old_values, 99));

  nodes_[2]->Signal(SIGCONT);
  // At once (before n2 notices its lease is gone), then after it has re-registered.
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1) {
      ASSERT_TRUE(kt::WaitFor(
          [&] { return Metric(Metrics(2), "kvtier_cluster_registrations_total") >= 2; }, 15000));
    }
    for (int i : copies) {
      std::vector<std::vector<uint8_t>> got;
      std::vector<bool> found;
      ASSERT_TRUE(reader->GetCopy(std::span<const Key>(&chain[i], 1), &got, &found).ok());
      EXPECT_FALSE(found[0] && got[0] == old_values[i])
          << "pass " << pass << ": unit " << i << " served from a stale copy";
    }
  }
  EXPECT_GE(Metric(Metrics(2), "kvtier_cluster_copy_drop_alls_total"), 1);
}

}  // namespace
}  // namespace kvtier::cluster
