// Re-replication and moves (cache_daemon/cluster_repair.h) against real processes: etcd and
// three kvtierd with R = 2 (tests/cluster/cluster_fixture.h). Where a unit lives is checked
// by asking each node's own store over the peer protocol (a peer LOOKUP is answered from the
// local store only, never forwarded), with storage keys derived as the daemons derive them.
//   - kill -9 of one node: the survivors copy what it held until every unit is on 2 live
//     nodes, and their under-replicated gauge reads 0;
//   - a 4th node joins: units move to it with no miss for any unit, during and after, and
//     every unit ends on exactly its 2 owners;
//   - `kvtier cluster drain n2`: every unit leaves n2 for 2 other nodes, and status shows it.
#include <atomic>
#include <nlohmann/json.hpp>
#include <thread>

#include "cluster/peer_client.h"
#include "cluster/placement.h"
#include "tests/cluster/cluster_fixture.h"

namespace kvtier::cluster {
namespace {

class ClusterRepairTest : public ClusterE2eTest {
 protected:
  void SetUp() override {
    ClusterE2eTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    peers_ = std::make_unique<PeerClient>(PeerClientOptions{
        .node_id = "test", .credential = std::vector<uint8_t>(40, 'c'), .timeout_ms = 2000});
  }

  std::string Peer(int i) const { return "127.0.0.1:" + std::to_string(peer_ports_[i]); }

  // The storage keys alice's chain keys are stored under (tenant salt from the shared secret).
  std::vector<PeerKey> StorageKeys(const std::vector<Key>& chain) const {
    std::string secret(32, 's');
    Digest salt = TenantSalt(
        std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(secret.data()), secret.size()),
        "alice");
    std::vector<PeerKey> keys;
    for (const Key& k : chain) keys.push_back(StorageKey(salt, k));
    return keys;
  }

  // held[n][k]: node n's own store holds key k (nodes listed in `nodes` only).
  std::map<int, std::vector<bool>> Held(const std::vector<PeerKey>& keys,
                                        const std::vector<int>& nodes) {
    std::map<int, std::vector<bool>> held;
    for (int n : nodes) {
      auto tiers = peers_->Lookup(Peer(n), keys);
      std::vector<bool>& h = held[n];
      h.assign(keys.size(), false);
      if (!tiers.ok()) continue;
      for (size_t k = 0; k < keys.size(); ++k) h[k] = (*tiers)[k] != kPeerTierAbsent;
    }
    return held;
  }
  // How many of `nodes` hold each key.
  std::vector<int> Copies(const std::vector<PeerKey>& keys, const std::vector<int>& nodes) {
    auto held = Held(keys, nodes);
    std::vector<int> copies(keys.size(), 0);
    for (const auto& [n, h] : held) {
      for (size_t k = 0; k < keys.size(); ++k) copies[k] += h[k] ? 1 : 0;
    }
    return copies;
  }
  bool EveryKeyOn(const std::vector<PeerKey>& keys, const std::vector<int>& nodes, int want) {
    auto copies = Copies(keys, nodes);
    return std::all_of(copies.begin(), copies.end(), [&](int c) { return c == want; });
  }
  // A node's repair is settled: no scan running, nothing short, nothing left to move.
  bool Settled(int n) {
    std::string m = Metrics(n);
    return Metric(m, "kvtier_cluster_repair_active") == 0 &&
           Metric(m, "kvtier_cluster_under_replicated_units") == 0 &&
           Metric(m, "kvtier_cluster_moves_in_progress") == 0;
  }
  int Kvtier(const std::string& args, std::string* out) {
    return kt::RunShell(std::string(KVTIER_PATH) + " " + args, out);
  }

  std::unique_ptr<PeerClient> peers_;
};

TEST_F(ClusterRepairTest, KillNineRestoresTwoCopiesOnTheSurvivors) {
  auto c = Connect(0, "tok-alice");
  ASSERT_NE(c, nullptr);
  auto want = PutSession(c.get(), "repair");
  auto keys = StorageKeys(Chain("repair"));
  ASSERT_TRUE(EveryKeyOn(keys, {0, 1, 2}, 2)) << "a put did not reach both owners";
  auto copies_on_n2 = Held(keys, {2})[2];
  ASSERT_GT(std::count(copies_on_n2.begin(), copies_on_n2.end(), true), 0);

  nodes_[2]->Signal(SIGKILL);
  ASSERT_TRUE(kt::WaitFor(
      [&] {
        return Metric(Metrics(0), "kvtier_cluster_members") == 2 &&
               Metric(Metrics(1), "kvtier_cluster_members") == 2;
      },
      10000));
  // R restored within a bounded time: every unit on both survivors, their gauges at 0.
  ASSERT_TRUE(kt::WaitFor(
      [&] {
        return EveryKeyOn(keys, {0, 1}, 2);
      },
      15000))
      << "units still on one node only";
  ASSERT_TRUE(kt::WaitFor([&] { return Settled(0) && Settled(1); }, 10000));
  double copied = Metric(Metrics(0), "kvtier_cluster_repair_units_total") +
                  Metric(Metrics(1), "kvtier_cluster_repair_units_total");
  EXPECT_GE(copied, static_cast<double>(std::count(copies_on_n2.begin(), copies_on_n2.end(), true)))
      << "every unit n2 held was one of two copies: each needed a new one";
  EXPECT_GT(Metric(Metrics(0), "kvtier_cluster_repair_bytes_total") +
                Metric(Metrics(1), "kvtier_cluster_repair_bytes_total"),
            0);
  auto c1 = Connect(1, "tok-alice");
  ASSERT_NE(c1, nullptr);
  ExpectWholeSession(c1.get(), "repair", want, 1);
}

TEST_F(ClusterRepairTest, JoiningNodeTakesItsShareWithNoMiss) {
  auto c = Connect(0, "tok-alice");
  ASSERT_NE(c, nullptr);
  auto want = PutSession(c.get(), "join");
  auto chain = Chain("join");
  auto keys = StorageKeys(chain);

  // A reader through n1 for the whole move: every unit found and bit-exact, every time.
  std::atomic<bool> stop{false};
  std::atomic<int> reads{0}, misses{0};
  std::thread reader([&] {
    auto r = Connect(1, "tok-alice");
    if (r == nullptr) return;
    while (!stop.load()) {
      std::vector<std::vector<uint8_t>> got;
      std::vector<bool> found;
      if (!r->GetCopy(chain, &got, &found).ok()) {
        ++misses;
        continue;
      }
      for (int i = 0; i < kUnits; ++i) {
        if (!found[i] || got[i] != want[i]) ++misses;
      }
      ++reads;
    }
  });
  // Joined on every path (a failed ASSERT returns early; a joinable thread would terminate).
  struct Joiner {
    std::atomic<bool>* stop;
    std::thread* t;
    ~Joiner() {
      stop->store(true);
      if (t->joinable()) t->join();
    }
  } joiner{&stop, &reader};

  nodes_.push_back(std::make_unique<kt::KvtierdProcess>(dir_ / "n3"));
  peer_ports_.push_back(kt::FreePort());
  ASSERT_TRUE(StartNode(3)) << nodes_[3]->Log();
  ASSERT_TRUE(kt::WaitFor(
      [&] {
        for (int i = 0; i < 4; ++i) {
          if (Metric(Metrics(i), "kvtier_cluster_members") != 4) return false;
        }
        return true;
      },
      10000));
  // Every unit ends on exactly its 2 owners (the old non-owner dropped it after n3 confirmed).
  std::vector<MemberInfo> members;
  for (int i = 0; i < 4; ++i) {
    members.push_back(MemberInfo{.node_id = "n" + std::to_string(i),
                                 .failure_domain = "rack" + std::to_string(i),
                                 .dram_bytes = 16777216,
                                 .ssd_bytes = 268435456});
  }
  auto on_owners_only = [&] {
    auto held = Held(keys, {0, 1, 2, 3});
    for (size_t k = 0; k < keys.size(); ++k) {
      std::string_view kv(reinterpret_cast<const char*>(keys[k].data()), keys[k].size());
      std::vector<bool> owner(4, false);
      for (size_t o : PlaceOwners(kv, members, 2)) owner[o] = true;
      for (int n = 0; n < 4; ++n) {
        if (held[n][k] != owner[n]) return false;
      }
    }
    return true;
  };
  ASSERT_TRUE(kt::WaitFor(on_owners_only, 15000)) << "units not on exactly their owners";
  ASSERT_TRUE(
      kt::WaitFor([&] { return Settled(0) && Settled(1) && Settled(2) && Settled(3); }, 10000));
  auto n3 = Held(keys, {3})[3];
  EXPECT_GT(std::count(n3.begin(), n3.end(), true), 0) << "n3 took no share";
  // Keep reading a little after the move, then stop.
  int after = reads.load();
  ASSERT_TRUE(kt::WaitFor([&] { return reads.load() >= after + 3; }, 10000));
  stop = true;
  reader.join();
  EXPECT_GT(reads.load(), 3);
  EXPECT_EQ(misses.load(), 0) << "a unit present before the join was missed during the move";
  auto c3 = Connect(3, "tok-alice");
  ASSERT_NE(c3, nullptr);
  ExpectWholeSession(c3.get(), "join", want, 3);
}

TEST_F(ClusterRepairTest, DrainMovesEveryUnitOffTheNode) {
  auto c = Connect(0, "tok-alice");
  ASSERT_NE(c, nullptr);
  auto want = PutSession(c.get(), "drain");
  auto keys = StorageKeys(Chain("drain"));
  auto before = Held(keys, {2})[2];
  ASSERT_GT(std::count(before.begin(), before.end(), true), 0);

  const std::string etcd = "--etcd http://" + etcd_->endpoint();
  std::string out;
  ASSERT_EQ(Kvtier("cluster drain n2 " + etcd, &out), 0) << out;
  EXPECT_NE(out.find("n2 draining"), std::string::npos) << out;
  ASSERT_EQ(Kvtier("cluster drain n2 " + etcd, &out), 0) << out;
  EXPECT_NE(out.find("already draining"), std::string::npos) << out;

  ASSERT_TRUE(kt::WaitFor(
      [&] {
        auto on2 = Held(keys, {2})[2];
        return std::none_of(on2.begin(), on2.end(), [](bool b) { return b; }) &&
               EveryKeyOn(keys, {0, 1}, 2);
      },
      15000))
      << "units left on the draining node, or not on both others";
  ASSERT_TRUE(kt::WaitFor([&] { return Settled(0) && Settled(1) && Settled(2); }, 10000));
  EXPECT_GT(Metric(Metrics(2), "kvtier_cluster_repair_dropped_units_total"), 0);
  // The draining node still answers reads (from its peers now), and status says draining.
  auto c2 = Connect(2, "tok-alice");
  ASSERT_NE(c2, nullptr);
  ExpectWholeSession(c2.get(), "drain", want, 2);
  ASSERT_EQ(Kvtier("cluster status --json " + etcd, &out), 0) << out;
  auto j = nlohmann::json::parse(out);
  bool draining = false;
  for (const auto& m : j["members"]) {
    if (m["node_id"] == "n2") draining = m["draining"].get<bool>();
  }
  EXPECT_TRUE(draining) << out;
  // A node that is not a member is an error; --undo clears the flag.
  EXPECT_EQ(Kvtier("cluster drain n9 " + etcd, &out), 1) << out;
  ASSERT_EQ(Kvtier("cluster drain n2 --undo " + etcd, &out), 0) << out;
  EXPECT_NE(out.find("no longer draining"), std::string::npos) << out;
}

}  // namespace
}  // namespace kvtier::cluster
