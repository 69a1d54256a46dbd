// An older version of a unit never replaces, or is served after, a newer PUT that was
// acknowledged (docs/CLUSTER.md, "Versions"). Units carry no version, so every path that
// writes a copy it read earlier, or keeps a replica it no longer owns, is checked against a
// PUT of a newer value that lands in between:
//   - a repair (hand-over) copy paced to arrive after the newer PUT reached the new owner;
//   - a node that lost ownership to a joining node while still holding its replica, read
//     through that node after the newer PUT went to the current owners only;
//   - a GET copy fetched by an owner (or a non-owner) while a newer PUT reached it;
//   - a checksum refetch fetched while a newer PUT reached the refetching owner;
//   - a GET through a node that holds a replica of a key it no longer owns.
// The first against real processes: etcd and kvtierd with R = 2
// (tests/cluster/cluster_fixture.h); which node holds which version is read from each node's
// own store over the peer protocol (a peer GET is answered from the local store only). The
// others in process (NodeVersionsTest): a real etcd, a Service with its router, copies and
// store as kvtierd wires them, and two in-process peers whose GET runs the newer PUT (through
// the node under test) just before it answers with the older value: the interleaving is
// exact, not timed.
#include <algorithm>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "cache_daemon/cluster_copies.h"
#include "cache_daemon/cluster_refetch.h"
#include "cache_daemon/metrics.h"
#include "cache_daemon/service.h"
#include "cache_daemon/tenants.h"
#include "cluster/membership.h"
#include "cluster/peer_client.h"
#include "cluster/peer_server.h"
#include "cluster/placement.h"
#include "cluster/recent_deletes.h"
#include "cluster/router.h"
#include "common/temp_dir.h"
#include "storage/block_device.h"
#include "storage/tier_manager.h"
#include "tests/cluster/cluster_fixture.h"
#include "tests/cluster/node_fixture.h"

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
    peers_ = TestPeerClient();
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
    std::vector<size_t> all;
    for (size_t i = 0; i < keys.size(); ++i) all.push_back(i);
    PutSome(node, keys, all, version);
  }
  // Units `which` of keys (unit i's value is Value(i, version)) through node.
  void PutSome(int node, const std::vector<Key>& keys, const std::vector<size_t>& which,
               int version) {
    auto c = Connect(node, "tok-alice");
    ASSERT_NE(c, nullptr);
    std::vector<std::vector<uint8_t>> values;
    std::vector<PutUnit> units(which.size());
    for (size_t i : which) values.push_back(Value(static_cast<int>(i), version));
    for (size_t u = 0; u < which.size(); ++u) {
      units[u].key = keys[which[u]];
      units[u].value = values[u];
    }
    auto st = c->Put(units, daemon::PutOptions{});
    ASSERT_TRUE(st.ok()) << st.status().message();
    for (const auto& s : *st) ASSERT_TRUE(s.ok()) << s.message();
  }
  // Version of unit i held by node n's own store: 0 absent, -1 neither version asked about.
  int HeldVersion(int n, const std::vector<Key>& keys, size_t i, int v1, int v2) {
    auto got = peers_->Get(Peer(n), std::vector<PeerKey>{StorageKeyOf(keys[i])});
    if (!got.ok() || !got->statuses[0].ok()) return 0;
    if (std::ranges::equal(got->values[0], Value(static_cast<int>(i), v2))) return v2;
    if (std::ranges::equal(got->values[0], Value(static_cast<int>(i), v1))) return v1;
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
  ASSERT_TRUE(kt::WaitFor(
      [&] { return RepairSettled(0) && RepairSettled(1) && RepairSettled(2) && RepairSettled(3); },
      30000));
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

// Path: a node that lost ownership keeps serving its old replica. n0 and n1 own the units; n3
// joins and takes n1's share, and n1 keeps its replicas until they are handed over (n0 sends
// one unit per 4 s here). A PUT of new values goes to the current owners only (n0, n3): a
// GET through n1 found its old replica and served it. Now the PUT drops the older version at
// the previous owners that own the key no longer (DROP_OLDER; half the units are put
// through n2), and a node that is not an owner deletes its own when a PUT goes through it
// (the other half through n1). Once the hand-over is done, GETs check ownership no more
// (kvtier_cluster_unowned_check_active is 0 on every node: no cost in a steady state).
TEST_F(ClusterVersionsTest, APreviousOwnerNeverServesItsReplicaAfterANewerPut) {
  auto keys = KeysMoving({0, 1}, {0, 3}, 4);
  ASSERT_EQ(keys.size(), 4u);
  PutAll(2, keys, 1);
  ASSERT_TRUE(JoinNodeThree()) << nodes_[3]->Log();
  int still_on_n1 = 0;
  for (size_t i = 0; i < keys.size(); ++i) still_on_n1 += HeldVersion(1, keys, i, 1, 2) == 1;
  ASSERT_GE(still_on_n1, 2) << "n1 handed its units over before the PUT (the case did not arise)";
  PutSome(2, keys, {0, 1}, 2);
  PutSome(1, keys, {2, 3}, 2);
  for (size_t i = 0; i < keys.size(); ++i) {
    EXPECT_NE(HeldVersion(1, keys, i, 1, 2), 1)
        << "n1 still holds the old version of unit " << i << " after the PUT";
  }
  for (int n = 0; n < 4; ++n) {
    std::vector<int> served = ServedVersions(n, keys, 1, 2);
    for (size_t i = 0; i < keys.size(); ++i) {
      EXPECT_EQ(served[i], 2) << "a GET through n" << n << " of unit " << i;
    }
  }
  EXPECT_GE(Metric(Metrics(2), "kvtier_cluster_previous_owner_drops_total"), 2);
  // Once the hand-over is done no node asks the owners first any more: the check costs
  // nothing in a steady state.
  ASSERT_TRUE(kt::WaitFor(
      [&] {
        for (int n = 0; n < 4; ++n) {
          if (!RepairSettled(n) || Metric(Metrics(n), "kvtier_cluster_unowned_check_active") != 0) {
            return false;
          }
        }
        return true;
      },
      30000))
      << "a node still checks ownership on GET after the hand-over";
  for (int n = 0; n < 4; ++n) {
    std::vector<int> served = ServedVersions(n, keys, 1, 2);
    for (size_t i = 0; i < keys.size(); ++i) {
      EXPECT_EQ(served[i], 2) << "after the hand-over, a GET through n" << n << " of unit " << i;
    }
  }
}

// ---- In process: one node's Service, router, copies and store; two peers ----

class NodeVersionsTest : public NodeFixture {};

// Path: a GET copy on an owner. y owns the key but lacks it (a new owner before its repair
// copy, or after a checksum quarantine); a GET through y fetches the old value from the other
// owner, and a PUT of the new value through y (y, then the other owner) lands before that
// fetch answers. y used to keep the fetched value as a GET copy, replacing the new value in
// its own store, and served it from then on. Now an owner keeps no copy (it gets its replica
// from repair, and its store takes the key's PUTs), and a copy is put only if absent.
TEST_F(NodeVersionsTest, AnOwnerKeepsNoGetCopyAndAFetchBeforeAPutNeverReplacesIt) {
  std::vector<HookPeer*> others;
  // An owner that lacks a unit serves it from the other owner and keeps no copy.
  Key plain = ChainOwnedByY(true, 0, &others);
  ASSERT_EQ(others.size(), 1u);
  others[0]->Set(service_->Bind(*tenant_, plain), Bytes(1));
  EXPECT_EQ(GetThroughY(plain), Bytes(1));
  EXPECT_TRUE(HeldByY(plain).empty()) << "an owner kept a GET copy";
  EXPECT_EQ(copies_->stats().kept, 0u);

  // A fetch that read the old value before a PUT through y landed.
  Key chain = ChainOwnedByY(true, 1, &others);
  ASSERT_EQ(others.size(), 1u);
  const PeerKey key = service_->Bind(*tenant_, chain);
  others[0]->Set(key, Bytes(1));
  others[0]->BeforeNextGetAnswers([&] { PutThroughY(chain, Bytes(2)); });
  (void)GetThroughY(chain);  // concurrent with the PUT: either value is a right answer
  EXPECT_EQ(others[0]->Held(key), Bytes(2));
  EXPECT_EQ(HeldByY(chain), Bytes(2)) << "y's own store lost the acknowledged PUT";
  EXPECT_EQ(GetThroughY(chain), Bytes(2)) << "a GET after the PUT returned the old value";
  EXPECT_FALSE(copies_->IsCopy(key)) << "an owner kept a GET copy";
}

// A GET copy on a non-owner is put only if absent: y does not own the key; while its fetch
// is in flight a unit of the key is written into y's store (a peer PUT from a writer whose
// view still takes y for an owner). The fetched value used to replace it.
TEST_F(NodeVersionsTest, AGetCopyNeverReplacesAUnitWrittenWhileItWasFetched) {
  std::vector<HookPeer*> others;
  Key chain = ChainOwnedByY(false, 0, &others);
  ASSERT_EQ(others.size(), 2u);
  const PeerKey key = service_->Bind(*tenant_, chain);
  for (HookPeer* p : others) p->Set(key, Bytes(1));
  for (HookPeer* p : others) {
    p->BeforeNextGetAnswers([&] {
      storage::PutOptions po;
      po.tenant = tenant_->id;
      ASSERT_TRUE(store_->Put(key, Bytes(2), po).ok());
      copies_->Forget(key);  // what the peer PUT handler does
    });
  }
  (void)GetThroughY(chain);
  EXPECT_EQ(HeldByY(chain), Bytes(2)) << "a GET copy replaced a unit written meanwhile";
  EXPECT_FALSE(copies_->IsCopy(key));
  EXPECT_EQ(copies_->stats().fenced, 1u);
}

// Path: a checksum refetch. y owns the key and its replica was quarantined; the refetch
// fetches the old value from the other owner while a PUT of the new value through y lands.
// The refetch used to put the old value back over the new one; now it is put only if absent
// and counted as superseded.
TEST_F(NodeVersionsTest, ARefetchFetchedBeforeAPutNeverReplacesIt) {
  std::vector<HookPeer*> others;
  Key chain = ChainOwnedByY(true, 0, &others);
  ASSERT_EQ(others.size(), 1u);
  const PeerKey key = service_->Bind(*tenant_, chain);
  others[0]->Set(key, Bytes(1));
  others[0]->BeforeNextGetAnswers([&] { PutThroughY(chain, Bytes(2)); });
  daemon::ClusterRefetch refetch(store_.get(), tenants_.get(), router_.get(), &recent_,
                                 daemon::RefetchOptions{});
  refetch.Start();
  refetch.Report(storage::UnitInfo{.key = key, .tenant = tenant_->id, .tier = storage::Tier::kSsd});
  ASSERT_TRUE(kt::WaitFor(
      [&] {
        daemon::RefetchStats s = refetch.stats();
        return s.refetched + s.failed + s.skipped + s.superseded > 0;
      },
      5000));
  refetch.Stop();
  EXPECT_EQ(HeldByY(chain), Bytes(2)) << "the refetch put the old value back over the PUT";
  EXPECT_EQ(GetThroughY(chain), Bytes(2));
  EXPECT_EQ(refetch.stats().superseded, 1u);
  EXPECT_EQ(refetch.stats().refetched + refetch.stats().failed, 0u);
}

// Not a version, but the same path: the rewrite carries the TTL the lost record had left when
// the store reported it, less the time the refetch took, so it never outlives the unit it
// replaces; a unit that expired meanwhile is not put back. It used to carry the TTL left at
// the report: here 1,500 ms after a fetch that took 600 ms.
TEST_F(NodeVersionsTest, ARefetchedUnitNeverOutlivesTheRecordItReplaces) {
  std::vector<HookPeer*> others;
  Key chain = ChainOwnedByY(true, 0, &others);
  ASSERT_EQ(others.size(), 1u);
  const PeerKey key = service_->Bind(*tenant_, chain);
  others[0]->Set(key, Bytes(1));
  constexpr uint64_t kTtlLeftMs = 1500, kFetchMs = 600;
  others[0]->BeforeNextGetAnswers(
      [&] { std::this_thread::sleep_for(std::chrono::milliseconds(kFetchMs)); });
  daemon::ClusterRefetch refetch(store_.get(), tenants_.get(), router_.get(), &recent_,
                                 daemon::RefetchOptions{});
  refetch.Start();
  refetch.Report(storage::UnitInfo{
      .key = key, .tenant = tenant_->id, .ttl_left_ms = kTtlLeftMs, .tier = storage::Tier::kSsd});
  ASSERT_TRUE(kt::WaitFor([&] { return refetch.stats().refetched == 1; }, 5000));
  std::vector<uint8_t> held;
  uint64_t ttl_left_ms = 0;
  ASSERT_TRUE(store_->GetWithTtl(key, &held, &ttl_left_ms).ok());
  EXPECT_EQ(held, Bytes(1));
  EXPECT_GT(ttl_left_ms, 0u) << "the rewrite lost its TTL";
  EXPECT_LE(ttl_left_ms, kTtlLeftMs - kFetchMs) << "the rewrite outlives the lost record";

  // A fetch slower than the TTL left: nothing is put back.
  ASSERT_TRUE(store_->Delete(key).ok());
  others[0]->BeforeNextGetAnswers(
      [&] { std::this_thread::sleep_for(std::chrono::milliseconds(kFetchMs)); });
  refetch.Report(storage::UnitInfo{
      .key = key, .tenant = tenant_->id, .ttl_left_ms = kFetchMs / 2, .tier = storage::Tier::kSsd});
  ASSERT_TRUE(kt::WaitFor([&] { return refetch.stats().skipped == 1; }, 5000));
  refetch.Stop();
  EXPECT_TRUE(HeldByY(chain).empty()) << "an expired unit was put back";
  EXPECT_EQ(refetch.stats().refetched, 1u);
}

// The same path, with a newer version at the other owner: the lost record (v1) had no TTL and
// the other owner holds v2, put since with a TTL. The rewrite of v2 used to carry v1's "no
// expiry" and outlived v2 for good (found reading the code after the repair scan's copy of
// the same kind, RepairExpiryTest.ACopyCarriesTheTtlOfTheVersionItCopiesNotTheListings).
TEST_F(NodeVersionsTest, ARefetchedNewerVersionKeepsItsOwnTtl) {
  std::vector<HookPeer*> others;
  Key chain = ChainOwnedByY(true, 0, &others);
  ASSERT_EQ(others.size(), 1u);
  const PeerKey key = service_->Bind(*tenant_, chain);
  constexpr uint64_t kTtlMs = 20000;
  others[0]->Set(key, Bytes(2), kTtlMs);
  daemon::ClusterRefetch refetch(store_.get(), tenants_.get(), router_.get(), &recent_,
                                 daemon::RefetchOptions{});
  refetch.Start();
  refetch.Report(storage::UnitInfo{.key = key, .tenant = tenant_->id, .tier = storage::Tier::kSsd});
  ASSERT_TRUE(kt::WaitFor([&] { return refetch.stats().refetched == 1; }, 5000));
  refetch.Stop();
  std::vector<uint8_t> held;
  uint64_t ttl_left_ms = 0;
  ASSERT_TRUE(store_->GetWithTtl(key, &held, &ttl_left_ms).ok());
  EXPECT_EQ(held, Bytes(2));
  EXPECT_GT(ttl_left_ms, 0u) << "the rewrite of v2 never expires";
  EXPECT_LE(ttl_left_ms, kTtlMs);
}

// Path: a node that no longer owns a unit serves its old replica. y holds a replica of a key
// it does not own (its hand-over to the owners is still to come) and the owners hold a newer
// value that y was not told about (a writer whose previous view did not have y as an owner,
// e.g. one restarted since the membership change, or a delete that did not reach y): a GET
// through y used to serve its own old replica. Now, while y may hold units it does not own,
// it asks the owners first; a unit they do not hold yet is still served from y.
TEST_F(NodeVersionsTest, ANonOwnerAsksTheOwnersBeforeServingAReplicaItNoLongerOwns) {
  ASSERT_TRUE(router_->MayHoldUnowned()) << "a node that just started may hold anything";
  std::vector<HookPeer*> others;
  Key moved = ChainOwnedByY(false, 0, &others);
  ASSERT_EQ(others.size(), 2u);
  storage::PutOptions po;
  po.tenant = tenant_->id;
  ASSERT_TRUE(store_->Put(service_->Bind(*tenant_, moved), Bytes(1), po).ok());
  for (HookPeer* p : others) p->Set(service_->Bind(*tenant_, moved), Bytes(2));
  EXPECT_EQ(GetThroughY(moved), Bytes(2)) << "y served its old replica over the owners' value";
  Key pending = ChainOwnedByY(false, 1, &others);
  ASSERT_TRUE(store_->Put(service_->Bind(*tenant_, pending), Bytes(3), po).ok());
  EXPECT_EQ(GetThroughY(pending), Bytes(3)) << "a unit not handed over yet was missed";

  // The repair scan's report: a whole scan left no unit y does not own. A view change or a
  // peer's write of a key y does not own makes the check necessary again.
  router_->NoteNoUnownedSince(router_->UnownedEpoch());
  EXPECT_FALSE(router_->MayHoldUnowned());
  const uint64_t epoch = router_->UnownedEpoch();
  router_->NoteUnownedWrite();
  EXPECT_TRUE(router_->MayHoldUnowned());
  router_->NoteNoUnownedSince(epoch);  // a scan that began before that write
  EXPECT_TRUE(router_->MayHoldUnowned());
}

// Path: a PUT through an owner whose local write lands after a membership change took the
// key from it. y owns the key when its PUT decides to write it locally; before the write
// lands, node c joins (y's view sees it: the owners are c and another) and a repair scan
// under the new view finds no unit y does not own (the write has not landed) and clears
// MayHoldUnowned. The write then lands: y holds a replica it does not own, unnoticed. A newer
// PUT through y (not an owner now) went to the owners and did not delete y's version (the flag
// said there was none), and a GET through y served y's older value as a local hit without
// asking the owners (found by the cluster judge, seed 12: v295 served after v296 and v297,
// all put through the node that had owned the key until a rejoin moments before). Now a PUT
// that wrote locally notes an unowned write when the view after the write no longer makes
// this node an owner, so the next scan (and a GET meanwhile) takes the unit into account.
TEST_F(NodeVersionsTest, AnOwnersWriteThatLandsAfterAJoinTookTheKeyIsNotLeftUnnoticed) {
  HookPeer peer_c;
  PeerServerOptions so;
  so.credential = credential_;
  auto server = PeerServer::Start(so, &peer_c);
  ASSERT_TRUE(server.ok()) << server.status().message();
  const std::string c_endpoint = "127.0.0.1:" + std::to_string((*server)->port());
  servers_.push_back(std::move(*server));
  // A key y owns among a, b, y and does not once c joins.
  auto view = router_->View();
  std::vector<MemberInfo> with_c = view->members;
  MemberInfo c = with_c.front();
  c.node_id = "c";
  c.peer_endpoint = c_endpoint;
  with_c.push_back(c);
  Key chain{};
  bool found = false;
  for (int i = 0; i < 10000 && !found; ++i) {
    chain = ChainKey("unowned-race", i);
    const PeerKey k = service_->Bind(*tenant_, chain);
    bool owns_now = false, owns_after = false;
    for (size_t o : router_->Owners(k, *view)) owns_now |= view->members[o].node_id == "y";
    std::string_view kv(reinterpret_cast<const char*>(k.data()), k.size());
    for (size_t o : PlaceOwners(kv, with_c, 2)) owns_after |= with_c[o].node_id == "y";
    found = owns_now && !owns_after;
  }
  ASSERT_TRUE(found) << "no key moving away from y";
  const PeerKey key = service_->Bind(*tenant_, chain);

  HookedStore hooked(store_.get());
  service_ = std::make_unique<daemon::Service>(&hooked, tenants_.get(), &metrics_, nullptr,
                                               daemon::PolicySettings{});
  service_->SetRouter(router_.get());
  service_->SetClusterCopies(copies_.get());
  hooked.BeforeNextPut([&] {
    members_.push_back(Member("c", c_endpoint));
    ASSERT_TRUE(kt::WaitFor([&] { return router_->View()->members.size() == 4; }, 10000));
    ASSERT_FALSE(router_->OwnsLocally(key));
    // The repair scan under the new view: it lists no unit here that y does not own.
    router_->NoteNoUnownedSince(router_->UnownedEpoch());
  });
  PutThroughY(chain, Bytes(1));
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_EQ(HeldByY(chain), Bytes(1)) << "the test meant y's write to land";
  EXPECT_TRUE(router_->MayHoldUnowned()) << "y holds a unit it does not own, unnoticed";
  PutThroughY(chain, Bytes(2));
  EXPECT_TRUE(HeldByY(chain).empty()) << "y kept its version after a newer PUT through it";
  EXPECT_EQ(GetThroughY(chain), Bytes(2)) << "y served its older value";
  EXPECT_EQ(peer_c.Held(key), Bytes(2));
  service_.reset();  // before `hooked`
}

}  // namespace
}  // namespace kvtier::cluster
