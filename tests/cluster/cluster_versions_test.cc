// An older version of a unit never replaces, or is served after, a newer PUT that was
// acknowledged (docs/CLUSTER.md, "Versions"). Units carry no version, so every path that
// writes a copy it read earlier, or keeps a replica it no longer owns, is checked against a
// PUT of a newer value that lands in between:
//   - a repair (hand-over) copy paced to arrive after the newer PUT reached the new owner.
// Against real processes: etcd and kvtierd with R = 2 (tests/cluster/cluster_fixture.h). Which
// node holds which version is read from each node's own store over the peer protocol (a peer
// GET is answered from the local store only, never forwarded).
#include <algorithm>
#include <map>
#include <thread>

#include "cluster/peer_client.h"
#include "cluster/placement.h"
#include "tests/cluster/cluster_fixture.h"

namespace kvtier::cluster {
namespace {

// Unit bytes: at the slowest repair pace (1024 B/s) a sender waits 4 s between two copies.
constexpr size_t kUnitBytes = 4096;
constexpr uint64_t kRepairBytesPerS = 1024;

std::vector<uint8_t> Value(int unit, int version) {
  std::vector<uint8_t> v(kUnitBytes);
  for (size_t b = 0; b < v.size(); ++b) v[b] = static_cast<uint8_t>(unit * 31 + version * 7 + b);
  return v;
}

class ClusterVersionsTest : public ClusterE2eTest {
 protected:
  void SetUp() override {
    ClusterE2eTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    peers_ = std::make_unique<PeerClient>(PeerClientOptions{
        .node_id = "test", .credential = std::vector<uint8_t>(40, 'c'), .timeout_ms = 2000});
  }
  // Repair copies paced to one unit per 4 s: a hand-over of a few units takes seconds.
  std::string ExtraClusterConfig(int /*i*/) override {
    return "repair_bytes_per_s = " + std::to_string(kRepairBytesPerS) + "\n";
  }

  std::string Peer(int i) const { return "127.0.0.1:" + std::to_string(peer_ports_[i]); }
  PeerKey StorageKeyOf(const Key& chain) const {
    std::string secret(32, 's');
    Digest salt = TenantSalt(
        std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(secret.data()), secret.size()),
        "alice");
    return StorageKey(salt, chain);
  }
  // Owners (node numbers) of a storage key among nodes 0..n-1, as the daemons place it.
  static std::vector<int> OwnersOf(const PeerKey& key, int n) {
    std::vector<MemberInfo> members;
    for (int i = 0; i < n; ++i) {
      members.push_back(MemberInfo{.node_id = "n" + std::to_string(i),
                                   .failure_domain = "rack" + std::to_string(i),
                                   .dram_bytes = 16777216,
                                   .ssd_bytes = 268435456});
    }
    std::string_view kv(reinterpret_cast<const char*>(key.data()), key.size());
    std::vector<int> owners;
    for (size_t o : PlaceOwners(kv, members, 2)) owners.push_back(static_cast<int>(o));
    std::sort(owners.begin(), owners.end());
    return owners;
  }
  // `count` chain keys whose owners are `before` among 3 nodes and `after` once n3 joined.
  std::vector<Key> KeysMoving(std::vector<int> before, std::vector<int> after, int count) {
    std::sort(before.begin(), before.end());
    std::sort(after.begin(), after.end());
    std::vector<Key> keys;
    for (int i = 0; i < 100000 && static_cast<int>(keys.size()) < count; ++i) {
      Key k = ChainKey("versions", i);
      PeerKey sk = StorageKeyOf(k);
      if (OwnersOf(sk, 3) == before && OwnersOf(sk, 4) == after) keys.push_back(k);
    }
    EXPECT_EQ(static_cast<int>(keys.size()), count);
    return keys;
  }
  void PutAll(int node, const std::vector<Key>& keys, int version) {
    auto c = Connect(node, "tok-alice");
    ASSERT_NE(c, nullptr);
    std::vector<std::vector<uint8_t>> values;
    std::vector<PutUnit> units(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) values.push_back(Value(static_cast<int>(i), version));
    for (size_t i = 0; i < keys.size(); ++i) {
      units[i].key = keys[i];
      units[i].value = values[i];
    }
    auto st = c->Put(units, daemon::PutOptions{});
    ASSERT_TRUE(st.ok()) << st.status().message();
    for (const auto& s : *st) ASSERT_TRUE(s.ok()) << s.message();
  }
  // Version of unit i held by node n's own store: 0 absent, -1 neither version asked about.
  int HeldVersion(int n, const std::vector<Key>& keys, size_t i, int v1, int v2) {
    auto got = peers_->Get(Peer(n), std::vector<PeerKey>{StorageKeyOf(keys[i])});
    if (!got.ok() || !got->statuses[0].ok()) return 0;
    if (got->values[0] == Value(static_cast<int>(i), v2)) return v2;
    if (got->values[0] == Value(static_cast<int>(i), v1)) return v1;
    return -1;
  }
  // A GET through node n: the version each unit was served with (0: a miss).
  std::vector<int> ServedVersions(int n, const std::vector<Key>& keys, int v1, int v2) {
    auto c = Connect(n, "tok-alice");
    std::vector<int> out(keys.size(), -1);
    if (c == nullptr) return out;
    std::vector<std::vector<uint8_t>> got;
    std::vector<bool> found;
    if (!c->GetCopy(keys, &got, &found).ok()) return out;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!found[i]) {
        out[i] = 0;
      } else if (got[i] == Value(static_cast<int>(i), v2)) {
        out[i] = v2;
      } else if (got[i] == Value(static_cast<int>(i), v1)) {
        out[i] = v1;
      }
    }
    return out;
  }
  bool Settled(int n) {
    std::string m = Metrics(n);
    return Metric(m, "kvtier_cluster_repair_active") == 0 &&
           Metric(m, "kvtier_cluster_under_replicated_units") == 0 &&
           Metric(m, "kvtier_cluster_moves_in_progress") == 0;
  }
  bool JoinNodeThree() {
    nodes_.push_back(std::make_unique<kt::KvtierdProcess>(dir_ / "n3"));
    peer_ports_.push_back(kt::FreePort());
    if (!StartNode(3)) return false;
    return kt::WaitFor(
        [&] {
          for (int i = 0; i < 4; ++i) {
            if (Metric(Metrics(i), "kvtier_cluster_members") != 4) return false;
          }
          return true;
        },
        10000);
  }

  std::unique_ptr<PeerClient> peers_;
};

// Path: a hand-over copy read before a newer PUT and sent after it. n0 and n1 own the units;
// n3 joins and takes n1's share, so n0 (the only current owner holding them) sends each unit
// to n3, one every 4 s. Once the first copy is acknowledged n0 has read the second unit's
// old value and waits for its pace; a PUT of a newer value through n2 then reaches n0 and n3
// and is acknowledged, and n0's late copy of the old value arrives at n3 afterwards. It used
// to replace the newer value there (a peer PUT was a plain store put), and n1 then dropped
// its replica: n3 served the old value as a hit. Now n3 keeps what it holds (the copy is put
// only if absent) and counts the copy as superseded.
TEST_F(ClusterVersionsTest, AHandOverCopyReadBeforeANewerPutNeverReplacesIt) {
  auto keys = KeysMoving({0, 1}, {0, 3}, 3);
  ASSERT_EQ(keys.size(), 3u);
  PutAll(2, keys, 1);
  ASSERT_TRUE(JoinNodeThree()) << nodes_[3]->Log();
  // The first copy is acknowledged; n0 then reads the next unit and waits 4 s to send it.
  ASSERT_TRUE(kt::WaitFor(
      [&] { return Metric(Metrics(0), "kvtier_cluster_repair_units_total") >= 1; }, 10000));
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  PutAll(2, keys, 2);  // acknowledged by both current owners, n0 and n3
  ASSERT_TRUE(
      kt::WaitFor([&] { return Settled(0) && Settled(1) && Settled(2) && Settled(3); }, 30000));
  for (size_t i = 0; i < keys.size(); ++i) {
    for (int n = 0; n < 4; ++n) {
      int held = HeldVersion(n, keys, i, 1, 2);
      EXPECT_TRUE(held == 0 || held == 2) << "node n" << n << " holds version " << held
                                          << " of unit " << i << " after version 2 was put";
    }
  }
  for (int n = 0; n < 4; ++n) {
    std::vector<int> served = ServedVersions(n, keys, 1, 2);
    for (size_t i = 0; i < keys.size(); ++i) {
      EXPECT_EQ(served[i], 2) << "a GET through n" << n << " of unit " << i;
    }
  }
  EXPECT_GE(Metric(Metrics(3), "kvtier_cluster_repair_copies_superseded_total"), 1)
      << "no late copy reached n3 (the interleaving did not happen)";
}

}  // namespace
}  // namespace kvtier::cluster
