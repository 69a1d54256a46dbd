// Re-replication and moves (cache_daemon/cluster_repair.h) against real processes: etcd and
// three kvtierd with R = 2 (tests/cluster/cluster_fixture.h). Where a unit lives is checked
// by asking each node's own store over the peer protocol (a peer LOOKUP is answered from the
// local store only, never forwarded), with storage keys derived as the daemons derive them.
//   - kill -9 of one node: the survivors copy what it held until every unit is on 2 live
//     nodes, and their under-replicated gauge reads 0;
//   - a 4th node joins: units move to it with no miss for any unit, during and after, and
//     every unit ends on exactly its 2 owners;
//   - `kvtier cluster drain n2`: every unit leaves n2 for 2 other nodes, and status shows it;
//   - repair reads of SSD units do not promote them into the senders' DRAM;
//   - a replica whose copy fails its checksum is rewritten from another owner;
//   - a GET copy on a node that becomes the unit's owner is replaced by a replica, and is
//     never counted as one (a drained node does not drop its replica for it);
//   - a repair copy paced to leave seconds after the scan listed its unit never outlives the
//     unit's TTL.
#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
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
    peers_ = TestPeerClient();
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
  // Every key is held by exactly its 2 owners among nodes 0..n-1 (all of the fixture's size).
  bool OnlyOnOwners(const std::vector<PeerKey>& keys, int n) {
    std::vector<MemberInfo> members;
    std::vector<int> nodes;
    for (int i = 0; i < n; ++i) {
      members.push_back(MemberInfo{.node_id = "n" + std::to_string(i),
                                   .failure_domain = "rack" + std::to_string(i),
                                   .dram_bytes = 16777216,
                                   .ssd_bytes = 268435456});
      nodes.push_back(i);
    }
    auto held = Held(keys, nodes);
    for (size_t k = 0; k < keys.size(); ++k) {
      std::string_view kv(reinterpret_cast<const char*>(keys[k].data()), keys[k].size());
      std::vector<bool> owner(static_cast<size_t>(n), false);
      for (size_t o : PlaceOwners(kv, members, 2)) owner[o] = true;
      for (int i = 0; i < n; ++i) {
        if (held[i][k] != owner[static_cast<size_t>(i)]) return false;
      }
    }
    return true;
  }
  double DramObjects(int n) { return Metric(Metrics(n), "kvtier_tier_objects{tier=\"dram\"}"); }
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
  ASSERT_TRUE(kt::WaitFor([&] { return RepairSettled(0) && RepairSettled(1); }, 10000));
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
  ASSERT_TRUE(kt::WaitFor([&] { return OnlyOnOwners(keys, 4); }, 15000))
      << "units not on exactly their owners";
  ASSERT_TRUE(kt::WaitFor(
      [&] { return RepairSettled(0) && RepairSettled(1) && RepairSettled(2) && RepairSettled(3); },
      10000));
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

// Repair reads do not promote: units put on SSD only (highest tier SSD) are copied to a
// joining node by n0..n2, which only send (a join moves units to the newcomer alone), and
// their DRAM tiers hold no unit before, during or after the move.
TEST_F(ClusterRepairTest, RepairCopiesLeaveSsdUnitsOutOfTheSendersDram) {
  auto c = Connect(0, "tok-alice");
  ASSERT_NE(c, nullptr);
  auto want = PutSession(c.get(), "ssd", daemon::PutOptions{.highest_tier = 2});
  auto keys = StorageKeys(Chain("ssd"));
  for (int i = 0; i < kNodes; ++i) ASSERT_EQ(DramObjects(i), 0) << "node " << i;
  nodes_.push_back(std::make_unique<kt::KvtierdProcess>(dir_ / "n3"));
  peer_ports_.push_back(kt::FreePort());
  ASSERT_TRUE(StartNode(3)) << nodes_[3]->Log();
  ASSERT_TRUE(kt::WaitFor([&] { return OnlyOnOwners(keys, 4); }, 15000))
      << "units not on exactly their owners";
  ASSERT_TRUE(kt::WaitFor(
      [&] { return RepairSettled(0) && RepairSettled(1) && RepairSettled(2) && RepairSettled(3); },
      10000));
  double copied = 0;
  for (int i = 0; i < kNodes; ++i) {
    EXPECT_EQ(DramObjects(i), 0) << "node " << i << " promoted units it only copied";
    copied += Metric(Metrics(i), "kvtier_cluster_repair_units_total");
  }
  EXPECT_GT(copied, 0);
  // The copies are whole: n3 serves every unit it now owns bit-exactly from its own store.
  auto on3 = Held(keys, {3})[3];
  auto chain = Chain("ssd");
  for (size_t k = 0; k < keys.size(); ++k) {
    if (!on3[k]) continue;
    auto got = peers_->Get(Peer(3), std::vector<PeerKey>{keys[k]});
    ASSERT_TRUE(got.ok()) << got.status().message();
    EXPECT_TRUE(got->statuses[0].ok());
    EXPECT_TRUE(std::ranges::equal(got->values[0], want[k])) << "unit " << k;
  }
}

// Overwrites, in every file under dir, the first occurrence of needle with its complement;
// true when one was found.
bool CorruptFirstOccurrence(const std::filesystem::path& dir, std::span<const uint8_t> needle) {
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    std::ifstream in(e.path(), std::ios::binary);
    std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), {});
    auto at = std::search(bytes.begin(), bytes.end(), needle.begin(), needle.end());
    if (at == bytes.end()) continue;
    std::vector<uint8_t> flipped(needle.begin(), needle.end());
    for (auto& b : flipped) b = static_cast<uint8_t>(~b);
    std::fstream out(e.path(), std::ios::binary | std::ios::in | std::ios::out);
    out.seekp(at - bytes.begin());
    out.write(reinterpret_cast<const char*>(flipped.data()),
              static_cast<std::streamsize>(flipped.size()));
    return out.good();
  }
  return false;
}

// A replica that serves a checksum failure is repaired from another: n0's SSD copy of a
// unit is corrupted on disk; a read through n0 gets the right bytes (from the other owner),
// and n0's store holds a correct copy again soon after (rewritten from the other owner, not
// left to the next full repair scan, which is minutes away).
TEST_F(ClusterRepairTest, AReplicaThatFailsItsChecksumIsRewrittenFromAnother) {
  auto c = Connect(0, "tok-alice");
  ASSERT_NE(c, nullptr);
  auto want = PutSession(c.get(), "bad", daemon::PutOptions{.highest_tier = 2});
  auto chain = Chain("bad");
  auto keys = StorageKeys(chain);
  auto on0 = Held(keys, {0})[0];
  // The largest unit n0 holds (its value is most surely in a segment file by itself).
  int victim = -1;
  for (int k = 0; k < kUnits; ++k) {
    if (on0[k]) victim = k;
  }
  ASSERT_GE(victim, 0) << "n0 owns no unit";
  ASSERT_EQ(Metric(Metrics(0), "kvtier_cluster_checksum_refetches_total"), 0);
  std::span<const uint8_t> needle(want[victim].data() + want[victim].size() / 2, 64);
  ASSERT_TRUE(CorruptFirstOccurrence(nodes_[0]->dir() / "data", needle))
      << "unit " << victim << " not found in n0's files";

  std::vector<std::vector<uint8_t>> got;
  std::vector<bool> found;
  ASSERT_TRUE(c->GetCopy(chain, &got, &found).ok());
  for (int k = 0; k < kUnits; ++k) {
    EXPECT_TRUE(found[k]) << "unit " << k;
    EXPECT_TRUE(got[k] == want[k]) << "unit " << k << " differs";
  }
  EXPECT_GE(Metric(Metrics(0), "kvtier_checksum_failures_total"), 1);
  ASSERT_TRUE(kt::WaitFor(
      [&] { return Metric(Metrics(0), "kvtier_cluster_checksum_refetches_total") >= 1; }, 5000))
      << "n0 did not rewrite its quarantined copy";
  auto again = peers_->Get(Peer(0), std::vector<PeerKey>{keys[victim]});
  ASSERT_TRUE(again.ok()) << again.status().message();
  ASSERT_TRUE(again->statuses[0].ok()) << "n0's own store does not hold the unit again";
  EXPECT_TRUE(std::ranges::equal(again->values[0], want[victim])) << "n0's rewritten copy differs";
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
  ASSERT_TRUE(
      kt::WaitFor([&] { return RepairSettled(0) && RepairSettled(1) && RepairSettled(2); }, 10000));
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

// Nodes that keep GET copies ([cluster] get_copy_bytes_max), with copies that expire soon.
class ClusterRepairCopiesTest : public ClusterRepairTest {
 protected:
  static constexpr uint64_t kCopyTtlMs = 3000;
  std::string ExtraClusterConfig(int /*i*/) override {
    return "get_copy_bytes_max = 8388608\nget_copy_ttl_ms = " + std::to_string(kCopyTtlMs) + "\n";
  }
  // Copies are served only while the lease is confirmed within 2/3 of its TTL: 6 s leaves
  // room for a stalled keepalive (as in ClusterCopiesTest).
  uint32_t LeaseTtlS() const override { return 6; }
  uint64_t DramCapacityBytes(int /*i*/) const override { return 268435456; }
};

// A node that becomes an owner of units it holds only as GET copies (DRAM only, expiring)
// gets real replicas: a peer LOOKUP does not count a copy as held. It used to: n1 read every
// unit (keeping copies of those n0 and n2 owned), n2 was drained so that n1 became their
// owner, and n2 then saw both owners "hold" them, dropped its replica, and nobody sent n1 a
// replica: once the copies expired those units had one replica left (and a node that keeps
// no copies of its own loses them for good).
TEST_F(ClusterRepairCopiesTest, AGetCopyOnANewOwnerDoesNotStandInForAReplica) {
  auto c = Connect(0, "tok-alice");
  ASSERT_NE(c, nullptr);
  auto want = PutSession(c.get(), "copyowner");
  auto chain = Chain("copyowner");
  auto keys = StorageKeys(chain);
  // n1 reads the whole session: it keeps a copy of each unit it does not own.
  auto r1 = Connect(1, "tok-alice");
  ASSERT_NE(r1, nullptr);
  std::vector<std::vector<uint8_t>> got;
  std::vector<bool> found;
  ASSERT_TRUE(r1->GetCopy(chain, &got, &found).ok());
  for (int k = 0; k < kUnits; ++k) ASSERT_TRUE(found[k] && got[k] == want[k]) << "unit " << k;
  ASSERT_GT(Metric(Metrics(1), "kvtier_cluster_copy_units"), 0) << "n1 kept no copy";

  // Drain n2: n0 and n1 own every unit now, n1 holding some of them only as copies.
  std::string out;
  ASSERT_EQ(Kvtier("cluster drain n2 --etcd http://" + etcd_->endpoint(), &out), 0) << out;
  ASSERT_TRUE(kt::WaitFor(
      [&] {
        auto on2 = Held(keys, {2})[2];
        return std::none_of(on2.begin(), on2.end(), [](bool b) { return b; }) &&
               EveryKeyOn(keys, {0, 1}, 2);
      },
      15000))
      << "units left on the draining node, or not on both owners";
  ASSERT_TRUE(
      kt::WaitFor([&] { return RepairSettled(0) && RepairSettled(1) && RepairSettled(2); }, 10000));
  // n1's copies became replicas (a repair copy replaces a GET copy).
  EXPECT_EQ(Metric(Metrics(1), "kvtier_cluster_copy_units"), 0)
      << "n1 still holds copies of units it owns";
  // Past the copies' TTL every unit is still on both owners, and read whole through each.
  std::this_thread::sleep_for(std::chrono::milliseconds(kCopyTtlMs + 500));
  EXPECT_TRUE(EveryKeyOn(keys, {0, 1}, 2)) << "units on one owner only after the copies expired";
  auto c1 = Connect(1, "tok-alice");
  ASSERT_NE(c1, nullptr);
  ExpectWholeSession(c1.get(), "copyowner", want, 1);
}

// Repair copies paced to one 4 KiB unit per second per sender: a hand-over of a dozen units
// takes seconds.
class ClusterRepairPacedTest : public ClusterRepairTest {
 protected:
  static constexpr size_t kPacedUnitBytes = 4096;
  std::string ExtraClusterConfig(int /*i*/) override {
    return "repair_bytes_per_s = " + std::to_string(kPacedUnitBytes) + "\n";
  }
};

// A repair copy never outlives its unit. 24 units with a TTL of 4 s are put, and n3 joins at
// once: its share (about half the units) is copied to it paced, one unit per second per
// sender, so the last copies leave seconds after the scan listed them, some after the units
// expired. From the TTL on, counted from the PUT's reply (every owner took the unit before
// it), plus 50 ms for the clocks' granularity (as the cluster judge allows), no node's own
// store may hold any of them. A copy used to carry the TTL its unit had left when the scan
// listed it, not when it was sent: each copy outlived its unit by its wait for the pace (n3
// held units for seconds past their TTL); then the TTL left when it was sent, counted by n3
// from its arrival: it outlived its unit by its transit (300 ms were allowed here).
TEST_F(ClusterRepairPacedTest, ARepairCopyNeverOutlivesItsUnit) {
  constexpr uint64_t kTtlMs = 4000;
  constexpr int kPacedUnits = 24;
  auto c = Connect(0, "tok-alice");
  ASSERT_NE(c, nullptr);
  std::vector<Key> chain;
  std::vector<std::vector<uint8_t>> values(kPacedUnits);
  std::vector<PutUnit> units(kPacedUnits);
  for (int i = 0; i < kPacedUnits; ++i) {
    chain.push_back(ChainKey("ttl", i));
    values[i].assign(kPacedUnitBytes, static_cast<uint8_t>(i));
    units[i].key = chain[i];
    units[i].value = values[i];
  }
  const auto put_sent = std::chrono::steady_clock::now();
  auto st = c->Put(units, daemon::PutOptions{.ttl_ms = kTtlMs});
  const auto put_answered = std::chrono::steady_clock::now();
  ASSERT_TRUE(st.ok()) << st.status().message();
  for (const auto& s : *st) ASSERT_TRUE(s.ok()) << s.message();
  const auto expired = put_answered + std::chrono::milliseconds(kTtlMs + 50);
  const auto keys = StorageKeys(chain);

  nodes_.push_back(std::make_unique<kt::KvtierdProcess>(dir_ / "n3"));
  peer_ports_.push_back(kt::FreePort());
  ASSERT_TRUE(StartNode(3)) << nodes_[3]->Log();
  ASSERT_LT(std::chrono::steady_clock::now(), put_sent + std::chrono::milliseconds(kTtlMs / 2))
      << "n3 started too late for the test to mean anything (a loaded machine?)";
  // Every node's store, until every scan is settled and at least 4 s past the TTL.
  std::this_thread::sleep_until(expired);
  int held_after_ttl = 0;
  for (int round = 0; round < 40; ++round) {
    for (const auto& [n, h] : Held(keys, {0, 1, 2, 3})) {
      for (size_t k = 0; k < keys.size(); ++k) {
        if (h[k]) {
          ++held_after_ttl;
          ADD_FAILURE() << "n" << n << " holds unit " << k << " "
                        << std::chrono::duration_cast<std::chrono::milliseconds>(
                               std::chrono::steady_clock::now() - put_answered)
                               .count()
                        << " ms after its PUT's reply, its TTL " << kTtlMs << " ms";
        }
      }
    }
    if (held_after_ttl > 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_GT(Metric(Metrics(0), "kvtier_cluster_members"), 3) << "n3 never joined";
  double copied = 0;
  for (int n = 0; n < 4; ++n) copied += Metric(Metrics(n), "kvtier_cluster_repair_units_total");
  EXPECT_GT(copied, 0) << "no unit copied to n3 before its TTL: the test checked nothing";
}

}  // namespace
}  // namespace kvtier::cluster
