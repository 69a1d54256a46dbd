// A peer that stops answering while it is still in every view (SIGSTOP, lease 30 s): with GET
// copies on every node, each PUT through another node calls it, as an owner or to drop its
// copy. Only the first of those calls waits peer_timeout_ms; the node then suspects the peer
// and fails the others at once (cluster/peer_health.h), handling each as it handles a timeout
// (a tombstone of the key, no acknowledgement from the stopped peer). Before, each of the
// sequential PUTs below waited 2 s. Once the peer runs again a probe clears the suspicion, its
// catch-up applies the tombstones, and every node serves the new bytes.
#include <signal.h>

#include <chrono>
#include <random>
#include <thread>

#include "tests/cluster/cluster_fixture.h"

namespace kvtier::cluster {
namespace {

class ClusterStoppedPeerTest : public ClusterE2eTest {
 protected:
  // write_acks 1: a PUT whose other owner is the stopped node is still acknowledged.
  std::string ExtraClusterConfig(int /*i*/) override {
    return "get_copy_bytes_max = 8388608\nwrite_acks = 1\npeer_probe_interval_ms = 500\n";
  }
  // Long enough that the stopped node stays in every view for the whole test.
  uint32_t LeaseTtlS() const override { return 30; }
  // Room for every size class of a session's units: copies are not evicted meanwhile.
  uint64_t DramCapacityBytes(int /*i*/) const override { return 268435456; }
};

TEST_F(ClusterStoppedPeerTest, OneTimeoutThenCallsToTheStoppedPeerFailAtOnce) {
  auto writer = Connect(0, "tok-alice");
  ASSERT_NE(writer, nullptr);
  auto old_values = PutSession(writer.get(), "stopped");
  const std::vector<Key> chain = Chain("stopped");
  {
    // n2 reads the session: it keeps copies of the units it does not own.
    auto reader = Connect(2, "tok-alice");
    ASSERT_NE(reader, nullptr);
    for (const Key& k : chain) {
      std::vector<std::vector<uint8_t>> got;
      std::vector<bool> found;
      ASSERT_TRUE(reader->GetCopy(std::span<const Key>(&k, 1), &got, &found).ok());
    }
    ASSERT_GT(Metric(Metrics(2), "kvtier_cluster_copy_units"), 0);
  }

  nodes_[2]->Signal(SIGSTOP);
  // One PUT at a time, each of one unit: each makes exactly one call to n2 (a PUT where n2
  // owns the key, a DROP_COPIES where it keeps a copy).
  std::mt19937 rng(7);
  std::vector<std::vector<uint8_t>> new_values(chain.size());
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < chain.size(); ++i) {
    new_values[i].resize(old_values[i].size());
    for (auto& b : new_values[i]) b = static_cast<uint8_t>(rng());
    PutUnit unit{.key = chain[i], .value = new_values[i]};
    auto st = writer->Put(std::span<const PutUnit>(&unit, 1), {});
    ASSERT_TRUE(st.ok()) << st.status().message();
    ASSERT_TRUE((*st)[0].ok()) << "unit " << i << ": " << (*st)[0].message();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%zu sequential PUTs with n2 stopped: %.2f s\n", chain.size(), seconds);
  std::string m = Metrics(0);
  EXPECT_EQ(Metric(m, "kvtier_cluster_members"), kNodes);  // n2 is still in the view
  EXPECT_EQ(Metric(m, "kvtier_cluster_peer_suspicions_total"), 1);
  EXPECT_EQ(Metric(m, "kvtier_cluster_peer_suspects"), 1);
  // Every PUT after the first found n2 suspect (repair scans may add calls of their own).
  EXPECT_GE(Metric(m, "kvtier_cluster_peer_calls_failed_fast_total"),
            static_cast<double>(chain.size() - 1));
  // Each unanswered call left a tombstone naming every member but n2.
  EXPECT_GE(Metric(m, "kvtier_cluster_overwrite_tombstones_total"),
            static_cast<double>(chain.size()));

  nodes_[2]->Signal(SIGCONT);
  ASSERT_TRUE(kt::WaitFor(
      [&] {
        m = Metrics(0);
        return Metric(m, "kvtier_cluster_peer_suspects") == 0 &&
               Metric(m, "kvtier_cluster_peer_recoveries_total") >= 1;
      },
      15000))
      << "n0 still suspects n2 after it was continued";
  // Calls to n2 are made again: a PUT through n0 of a key n2 owns or keeps a copy of is
  // acknowledged by it, failing nothing fast.
  const double fast_before = Metric(Metrics(0), "kvtier_cluster_peer_calls_failed_fast_total");
  PutUnit unit{.key = chain[0], .value = new_values[0]};
  auto st = writer->Put(std::span<const PutUnit>(&unit, 1), {});
  ASSERT_TRUE(st.ok() && (*st)[0].ok());
  EXPECT_EQ(Metric(Metrics(0), "kvtier_cluster_peer_calls_failed_fast_total"), fast_before);

  // n2 drops what the tombstones name at its catch-up (until then, after its pause, it reads
  // nothing from its store: docs/CLUSTER.md, "Tombstones"); every node serves the new bytes
  // of every unit.
  auto read_all = [&](int node, int* stale, int* wrong) {
    auto c = Connect(node, "tok-alice");
    if (c == nullptr) return false;
    std::vector<std::vector<uint8_t>> got;
    std::vector<bool> found;
    if (!c->GetCopy(chain, &got, &found).ok()) return false;
    *stale = *wrong = 0;
    for (size_t i = 0; i < chain.size(); ++i) {
      if (found[i] && got[i] == old_values[i]) ++*stale;
      if (!found[i] || got[i] != new_values[i]) ++*wrong;
    }
    return true;
  };
  int stale = 0, wrong = 0;
  ASSERT_TRUE(kt::WaitFor([&] { return read_all(2, &stale, &wrong) && stale == 0; }, 15000))
      << stale << " units still served from stale copies through n2";
  for (int node = 0; node < kNodes; ++node) {
    ASSERT_TRUE(read_all(node, &stale, &wrong));
    EXPECT_EQ(stale, 0) << "node " << node;
    EXPECT_EQ(wrong, 0) << "node " << node;
  }
}

// A copy keeper continued while a writer still suspects it: the writer's probes come every
// peer_probe_interval_ms (3 s here, longer than peer_timeout_ms), so for up to 3 s after the
// keeper runs again its PUTs fail their calls to it at once and leave tombstones instead. The
// keeper holds its store's answers after the pause until then (peer_probe_interval_ms +
// etcd_timeout_ms; peer_timeout_ms + etcd_timeout_ms, 1 s here, would end the hold first and
// its clients would read the copies those PUTs replaced until its next catch-up).
class ClusterSuspectKeeperTest : public ClusterStoppedPeerTest {
 protected:
  std::string ExtraClusterConfig(int /*i*/) override {
    return "get_copy_bytes_max = 8388608\nwrite_acks = 1\npeer_probe_interval_ms = 3000\n";
  }
  uint64_t PeerTimeoutMs() const override { return 500; }
};

TEST_F(ClusterSuspectKeeperTest, AKeeperContinuedWhileSuspectServesItsClientsNoReplacedCopy) {
  auto writer = Connect(0, "tok-alice");
  ASSERT_NE(writer, nullptr);
  auto old_values = PutSession(writer.get(), "keeper");
  const std::vector<Key> chain = Chain("keeper");
  ASSERT_GE(chain.size(), 4u);
  {
    auto reader = Connect(2, "tok-alice");
    ASSERT_NE(reader, nullptr);
    std::vector<std::vector<uint8_t>> got;
    std::vector<bool> found;
    ASSERT_TRUE(reader->GetCopy(chain, &got, &found).ok());
    ASSERT_GT(Metric(Metrics(2), "kvtier_cluster_copy_units"), 0);
  }
  std::mt19937 rng(11);
  auto put_new = [&](size_t i, std::vector<uint8_t>* value) {
    value->resize(old_values[i].size());
    for (auto& b : *value) b = static_cast<uint8_t>(rng());
    PutUnit unit{.key = chain[i], .value = *value};
    auto st = writer->Put(std::span<const PutUnit>(&unit, 1), {});
    return st.ok() && (*st)[0].ok();
  };
  std::vector<std::vector<uint8_t>> new_values(chain.size());
  nodes_[2]->Signal(SIGSTOP);
  // The first PUT's call to n2 times out: n0 suspects n2 and probes it at once; that probe
  // times out too, and the next comes 3 s later.
  ASSERT_TRUE(put_new(0, &new_values[0]));
  ASSERT_TRUE(kt::WaitFor(
      [&] { return Metric(Metrics(0), "kvtier_cluster_peer_probes_failed_total") >= 1; }, 5000));
  nodes_[2]->Signal(SIGCONT);
  // Past the hold that peer_timeout_ms + etcd_timeout_ms would give (and its catch-up).
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  auto own = Connect(2, "tok-alice");
  ASSERT_NE(own, nullptr);
  int fast = 0, stale = 0;
  for (size_t i = 1; i < chain.size(); ++i) {
    const double before = Metric(Metrics(0), "kvtier_cluster_peer_calls_failed_fast_total");
    ASSERT_TRUE(put_new(i, &new_values[i])) << "unit " << i;
    if (Metric(Metrics(0), "kvtier_cluster_peer_calls_failed_fast_total") == before) break;
    ++fast;  // n2 never heard of this PUT: only a tombstone names the key
    std::vector<std::vector<uint8_t>> got;
    std::vector<bool> found;
    ASSERT_TRUE(own->GetCopy(std::span<const Key>(&chain[i], 1), &got, &found).ok());
    if (found[0] && got[0] == old_values[i]) ++stale;
  }
  EXPECT_GE(fast, 2) << "the PUTs after the continue did not find n2 suspect";
  EXPECT_EQ(stale, 0) << "of " << fast << " units overwritten while n0 suspected n2, n2 served "
                      << stale << " from the copies the overwrites replaced";
  // Once the probe reaches n2 and n2 caught up, every node serves the new bytes.
  for (size_t i = 0; i < chain.size(); ++i) {
    if (new_values[i].empty()) {
      ASSERT_TRUE(put_new(i, &new_values[i]));
    }
  }
  ASSERT_TRUE(
      kt::WaitFor([&] { return Metric(Metrics(0), "kvtier_cluster_peer_suspects") == 0; }, 15000));
  for (int node = 0; node < kNodes; ++node) {
    auto c = Connect(node, "tok-alice");
    ASSERT_NE(c, nullptr);
    ASSERT_TRUE(kt::WaitFor(
        [&] {
          std::vector<std::vector<uint8_t>> got;
          std::vector<bool> found;
          if (!c->GetCopy(chain, &got, &found).ok()) return false;
          for (size_t i = 0; i < chain.size(); ++i) {
            if (!found[i] || got[i] != new_values[i]) return false;
          }
          return true;
        },
        15000))
        << "node " << node << " does not serve the new bytes";
  }
}

// With the prober off ([cluster] peer_probe_interval_ms = 0) nothing is suspected: each call
// waits its own timeout (a short timeout here keeps the case short).
class ClusterNoProbeTest : public ClusterStoppedPeerTest {
 protected:
  std::string ExtraClusterConfig(int /*i*/) override {
    return "get_copy_bytes_max = 8388608\nwrite_acks = 1\npeer_probe_interval_ms = 0\n";
  }
  uint64_t PeerTimeoutMs() const override { return 600; }
};

TEST_F(ClusterNoProbeTest, OffMeansEveryCallWaitsItsTimeout) {
  auto writer = Connect(0, "tok-alice");
  ASSERT_NE(writer, nullptr);
  (void)PutSession(writer.get(), "off");
  const std::vector<Key> chain = Chain("off");
  nodes_[2]->Signal(SIGSTOP);
  constexpr int kPuts = 4;
  std::vector<uint8_t> value(100, 'x');
  for (int i = 0; i < kPuts; ++i) {
    PutUnit unit{.key = chain[static_cast<size_t>(i)], .value = value};
    auto st = writer->Put(std::span<const PutUnit>(&unit, 1), {});
    ASSERT_TRUE(st.ok());
  }
  const std::string m = Metrics(0);
  EXPECT_EQ(Metric(m, "kvtier_cluster_peer_suspicions_total"), 0);
  EXPECT_EQ(Metric(m, "kvtier_cluster_peer_calls_failed_fast_total"), 0);
  // Each PUT's call to n2 timed out and left a tombstone.
  EXPECT_GE(Metric(m, "kvtier_cluster_overwrite_tombstones_total"), kPuts);
  nodes_[2]->Signal(SIGCONT);
}

}  // namespace
}  // namespace kvtier::cluster
