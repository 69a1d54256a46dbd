// NodeFixture: one node's Service, router, GET copies and store, in process, as kvtierd
// wires them, with a real etcd and two in-memory peers (HookPeer) behind real peer servers.
// Node "y" is the node under test (it has no peer front: nobody calls it); "a" and "b" are
// the peers; R = 2. Tests drive exact interleavings through the peers' hooks instead of
// timing real processes (tests/cluster/cluster_versions_test.cc,
// tests/cluster/cluster_repair_wait_test.cc).
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cache_daemon/cluster_copies.h"
#include "cache_daemon/metrics.h"
#include "cache_daemon/service.h"
#include "cache_daemon/tenants.h"
#include "cluster/membership.h"
#include "cluster/peer_client.h"
#include "cluster/peer_server.h"
#include "cluster/placement.h"
#include "cluster/recent_deletes.h"
#include "cluster/router.h"
#include "common/clock.h"
#include "common/temp_dir.h"
#include "storage/block_device.h"
#include "storage/tier_manager.h"
#include "tests/cluster/cluster_fixture.h"

namespace kvtier::cluster {

// An in-memory peer. Its next GET runs a hook after reading the value and before answering
// with it (what a PUT landing between a fetch's read and its reply looks like to the reader).
// It can refuse repair copies for a while (what a node that deleted the unit moments ago
// answers) and counts the LOOKUPs and repair copies it was sent.
class HookPeer : public PeerHandler {
 public:
  // Repair PUTs before steady-clock time until_ms are refused with Retry.
  void RefuseRepairUntil(uint64_t until_ms) {
    std::lock_guard lock(mu_);
    refuse_repair_until_ms_ = until_ms;
  }
  uint64_t lookups() {
    std::lock_guard lock(mu_);
    return lookups_;
  }
  uint64_t repair_puts() {
    std::lock_guard lock(mu_);
    return repair_puts_;
  }
  // Holds v under k; GETs report ttl_left_ms as it is (no clock runs here; 0: none).
  void Set(const PeerKey& k, std::vector<uint8_t> v, uint64_t ttl_left_ms = 0) {
    std::lock_guard lock(mu_);
    map_[k] = std::move(v);
    ttls_[k] = ttl_left_ms;
  }
  std::vector<uint8_t> Held(const PeerKey& k) {
    std::lock_guard lock(mu_);
    auto it = map_.find(k);
    return it == map_.end() ? std::vector<uint8_t>() : it->second;
  }
  void BeforeNextGetAnswers(std::function<void()> hook) {
    std::lock_guard lock(mu_);
    hook_ = std::move(hook);
  }
  // Runs hook (once) just before this peer's next LOOKUP answers.
  void BeforeNextLookupAnswers(std::function<void()> hook) {
    std::lock_guard lock(mu_);
    lookup_hook_ = std::move(hook);
  }
  std::vector<uint8_t> Lookup(std::span<const PeerKey> keys) override {
    std::function<void()> hook;
    {
      std::lock_guard lock(mu_);
      hook.swap(lookup_hook_);
    }
    if (hook) hook();  // without mu_, as Get's
    std::lock_guard lock(mu_);
    ++lookups_;
    std::vector<uint8_t> out;
    for (const auto& k : keys) out.push_back(map_.contains(k) ? 1 : kPeerTierAbsent);
    return out;
  }
  Status Get(const PeerKey& key, std::vector<uint8_t>* value) override {
    std::function<void()> hook;
    {
      std::lock_guard lock(mu_);
      auto it = map_.find(key);
      if (it == map_.end()) return Status::NotFound("absent");
      *value = it->second;
      hook.swap(hook_);
    }
    if (hook) hook();  // without mu_: the hook's PUT reaches this peer too
    return Status::Ok();
  }
  Status GetWithTtl(const PeerKey& key, std::vector<uint8_t>* value,
                    uint64_t* ttl_left_ms) override {
    {
      std::lock_guard lock(mu_);
      auto it = ttls_.find(key);
      *ttl_left_ms = it == ttls_.end() ? 0 : it->second;
    }
    return Get(key, value);
  }
  // The TTL and expiry of the last repair copy this peer's handler was given (after its
  // server counted the TTL from the expiry: peer_wire.h, kPeerFlagExpiresAt).
  std::pair<uint64_t, uint64_t> last_repair_ttl_and_expiry() {
    std::lock_guard lock(mu_);
    return {last_repair_ttl_ms_, last_repair_expires_at_unix_ms_};
  }
  Status Put(const PeerPut& put, bool* held) override {
    std::lock_guard lock(mu_);
    if (put.repair) {
      ++repair_puts_;
      last_repair_ttl_ms_ = put.ttl_ms;
      last_repair_expires_at_unix_ms_ = put.expires_at_unix_ms;
    }
    if (put.repair && DefaultSteadyClock().NowMs() < refuse_repair_until_ms_) {
      return Status::Retry("repair copy of a unit deleted here moments ago");
    }
    if (put.repair && map_.contains(put.key)) {
      *held = true;
      return Status::Ok();
    }
    map_[put.key].assign(put.value.begin(), put.value.end());
    ttls_[put.key] = put.ttl_ms;
    return Status::Ok();
  }
  StatusOr<std::vector<uint8_t>> Delete(std::span<const PeerKey> keys) override {
    std::lock_guard lock(mu_);
    std::vector<uint8_t> existed;
    for (const auto& k : keys) existed.push_back(static_cast<uint8_t>(map_.erase(k)));
    return existed;
  }
  Status DeleteTenant(std::string_view) override { return Status::Ok(); }

 private:
  std::mutex mu_;
  std::map<PeerKey, std::vector<uint8_t>> map_;
  std::map<PeerKey, uint64_t> ttls_;  // as given, never counted down
  std::function<void()> hook_, lookup_hook_;
  uint64_t refuse_repair_until_ms_ = 0;
  uint64_t lookups_ = 0, repair_puts_ = 0;
  uint64_t last_repair_ttl_ms_ = 0, last_repair_expires_at_unix_ms_ = 0;
};

inline std::vector<uint8_t> Bytes(uint8_t fill) { return std::vector<uint8_t>(3000, fill); }

// A store that runs a hook (once) just before its next Put, or before the nth listing from
// now that starts a scan (ListUnits with a fresh cursor), and is otherwise `inner`: what a
// membership change landing between a PUT's ownership decision and its local write looks
// like, or a delete landing between a repair scan's two passes.
class HookedStore final : public storage::TierManager {
 public:
  explicit HookedStore(storage::TierManager* inner) : inner_(inner) {}
  void BeforeNextPut(std::function<void()> hook) {
    std::lock_guard lock(mu_);
    hook_ = std::move(hook);
  }
  void BeforeFreshListing(int nth, std::function<void()> hook) {
    std::lock_guard lock(mu_);
    listing_hook_ = std::move(hook);
    listings_left_ = nth;
  }
  Status Put(const storage::Key& key, std::span<const uint8_t> value,
             const storage::PutOptions& o) override {
    std::function<void()> hook;
    {
      std::lock_guard lock(mu_);
      hook.swap(hook_);
    }
    if (hook) hook();
    return inner_->Put(key, value, o);
  }
  void ListUnits(storage::UnitCursor* cursor, size_t units_max,
                 std::vector<storage::UnitInfo>* out) override {
    std::function<void()> hook;
    if (cursor->bucket == 0 && cursor->buckets == 0 && !cursor->done) {
      std::lock_guard lock(mu_);
      if (listing_hook_ && --listings_left_ == 0) hook.swap(listing_hook_);
    }
    if (hook) hook();
    inner_->ListUnits(cursor, units_max, out);
  }
  Status Peek(const storage::Key& k, std::vector<uint8_t>* out, storage::UnitInfo* info) override {
    return inner_->Peek(k, out, info);
  }
  storage::LookupResult Probe(std::span<const storage::Key> chain) override {
    return inner_->Probe(chain);
  }
  Status Get(const storage::Key& k, std::vector<uint8_t>* out, storage::Tier* from) override {
    return inner_->Get(k, out, from);
  }
  Status GetWithTtl(const storage::Key& k, std::vector<uint8_t>* out, uint64_t* ttl) override {
    return inner_->GetWithTtl(k, out, ttl);
  }
  void GetBatch(std::span<const storage::Key> keys, std::vector<std::vector<uint8_t>>* outs,
                std::vector<storage::Tier>* froms, std::vector<Status>* results,
                const storage::RequestTag& request) override {
    inner_->GetBatch(keys, outs, froms, results, request);
  }
  storage::LookupResult Lookup(std::span<const storage::Key> chain) override {
    return inner_->Lookup(chain);
  }
  storage::RequestTag BeginRequest() override { return inner_->BeginRequest(); }
  Status Prefetch(std::span<const storage::Key> k) override { return inner_->Prefetch(k); }
  Status Pin(std::span<const storage::Key> k, uint64_t ms) override { return inner_->Pin(k, ms); }
  Status Unpin(std::span<const storage::Key> k) override { return inner_->Unpin(k); }
  Status Delete(const storage::Key& k) override { return inner_->Delete(k); }
  Status DeleteTenant(storage::TenantId t) override { return inner_->DeleteTenant(t); }
  void SetTenantQuota(storage::TenantId t, uint64_t q) override { inner_->SetTenantQuota(t, q); }
  Status SetPolicy(const std::string& e, const std::string& a,
                   const policies::PolicyParams& p) override {
    return inner_->SetPolicy(e, a, p);
  }
  storage::Stats GetStats() const override { return inner_->GetStats(); }
  Status Flush() override { return inner_->Flush(); }

 private:
  storage::TierManager* inner_;
  std::mutex mu_;
  std::function<void()> hook_, listing_hook_;  // guarded by mu_
  int listings_left_ = 0;                      // guarded by mu_
};

// Node "y" (no peer front: nobody calls it here) and peers "a", "b", R = 2, in one etcd.
class NodeFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!kt::EtcdProcess::Installed()) GTEST_SKIP() << "no /usr/bin/etcd (deploy/install-deps.sh)";
    ASSERT_TRUE(dir_.ok());
    etcd_ = std::make_unique<kt::EtcdProcess>(dir_.path());
    ASSERT_TRUE(etcd_->Start()) << "etcd did not start";
    for (auto [id, h] : {std::pair{"a", &peer_a_}, std::pair{"b", &peer_b_}}) {
      PeerServerOptions so;
      so.credential = credential_;
      so.unix_clock = peer_unix_clock_;
      auto s = PeerServer::Start(so, h);
      ASSERT_TRUE(s.ok()) << s.status().message();
      std::string ep = "127.0.0.1:" + std::to_string((*s)->port());
      by_node_[id] = h;
      servers_.push_back(std::move(*s));
      members_.push_back(Member(id, ep));
    }
    members_.push_back(Member("y", "127.0.0.1:1"));
    self_ = members_.back().get();
    ASSERT_TRUE(kt::WaitFor(
        [&] { return self_->View()->members.size() == 3 && self_->lease_confirmed_ms() != 0; },
        10000));
    storage::TierManagerOptions so;  // DRAM and an SSD tier (on a memory device)
    so.dram_capacity_bytes = 64ull << 20;
    so.ssd_capacity_bytes = 64ull << 20;
    so.ssd_segment_bytes = 4ull << 20;
    so.data_dir = dir_.path();  // the index (RocksDB) is on disk
    so.ssd_env = env_.get();
    auto store = storage::TierManager::Open(so);
    ASSERT_TRUE(store.ok()) << store.status().message();
    store_ = std::move(*store);
    tenants_ = daemon::TenantRegistry::Open(std::vector<uint8_t>(32, 7), 1024);
    tenant_ = tenants_->default_tenant();
    client_ = std::make_unique<PeerClient>(
        PeerClientOptions{.node_id = "y", .credential = credential_, .timeout_ms = 5000});
    router_ = std::make_unique<Router>(self_, client_.get(),
                                       RouterOptions{.replicas = 2, .recent_deletes = &recent_});
    service_ = std::make_unique<daemon::Service>(store_.get(), tenants_.get(), &metrics_, nullptr,
                                                 daemon::PolicySettings{});
    service_->SetRouter(router_.get());
    copies_ = std::make_unique<daemon::ClusterCopies>(store_.get(), self_, &recent_,
                                                      daemon::CopyOptions{.bytes_max = 1ull << 20});
    service_->SetClusterCopies(copies_.get());
  }
  void TearDown() override {
    // Members first: the router listens to y's membership until it is stopped.
    for (auto& m : members_) {
      if (m != nullptr) m->Stop(/*revoke=*/true);
    }
    service_.reset();
    router_.reset();
  }
  std::unique_ptr<Membership> Member(const std::string& id, const std::string& endpoint) {
    MembershipOptions o;
    o.etcd.endpoints = {etcd_->endpoint()};
    o.etcd.request_timeout_ms = 1000;
    o.key_prefix = "/v/";
    o.self.node_id = id;
    o.self.peer_endpoint = endpoint;
    o.self.dram_bytes = 1ull << 30;
    o.self.keeps_copies = true;
    o.lease_ttl_s = 10;
    o.retry_ms = 50;
    auto m = Membership::Start(o);
    EXPECT_TRUE(m.ok());
    return m.ok() ? std::move(*m) : nullptr;
  }
  // The nth chain key that node y owns (or does not), and its other owner(s).
  Key ChainOwnedByY(bool y_owns, int nth, std::vector<HookPeer*>* others) {
    auto view = router_->View();
    for (int i = 0; i < 10000; ++i) {
      Key chain = ChainKey("node-versions", i);
      std::vector<HookPeer*> peers;
      bool owns = false;
      for (size_t o : router_->Owners(service_->Bind(*tenant_, chain), *view)) {
        const std::string& id = view->members[o].node_id;
        if (id == "y") {
          owns = true;
        } else {
          peers.push_back(by_node_[id]);
        }
      }
      if (owns == y_owns && nth-- == 0) {
        *others = peers;
        return chain;
      }
    }
    ADD_FAILURE() << "no such key";
    return Key{};
  }
  // A chain key y owns with exactly one other owner: the chain, its key as bound, that peer.
  struct OwnedWithOne {
    Key chain;
    PeerKey key;
    HookPeer* other = nullptr;  // null (and a failure added) when there is not exactly one
  };
  OwnedWithOne OwnedByYAndOnePeer() {
    std::vector<HookPeer*> others;
    OwnedWithOne o;
    o.chain = ChainOwnedByY(true, 0, &others);
    o.key = service_->Bind(*tenant_, o.chain);
    EXPECT_EQ(others.size(), 1u);
    if (others.size() == 1) o.other = others[0];
    return o;
  }
  void PutThroughY(const Key& chain, const std::vector<uint8_t>& value) {
    daemon::PutItem item{.chain = chain, .value = value};
    auto codes = service_->Put(*tenant_, daemon::wire::PutRequest{},
                               std::span<const daemon::PutItem>(&item, 1), 0);
    ASSERT_EQ(codes.size(), 1u);
    ASSERT_EQ(codes[0], StatusCode::kOk);
  }
  // What a GET through y returns (empty: a miss).
  std::vector<uint8_t> GetThroughY(const Key& chain) {
    std::vector<uint8_t> out;
    service_->Get(*tenant_, std::span<const Key>(&chain, 1), 0,
                  [&](size_t, const Status& st, storage::Tier, std::span<const uint8_t> v) {
                    if (st.ok()) out.assign(v.begin(), v.end());
                  });
    return out;
  }
  // What y's own store holds (empty: nothing).
  std::vector<uint8_t> HeldByY(const Key& chain) {
    std::vector<uint8_t> out;
    if (!store_->Get(service_->Bind(*tenant_, chain), &out).ok()) out.clear();
    return out;
  }

  TempDir dir_{"kvtier-node-"};
  std::unique_ptr<kt::EtcdProcess> etcd_;
  const std::vector<uint8_t> credential_ = std::vector<uint8_t>(32, 7);
  HookPeer peer_a_, peer_b_;
  const Clock* peer_unix_clock_ = nullptr;  // a and b's Unix clock (null: the system's)
  std::map<std::string, HookPeer*> by_node_;
  std::vector<std::unique_ptr<PeerServer>> servers_;
  std::vector<std::unique_ptr<Membership>> members_;
  Membership* self_ = nullptr;
  RecentDeletes recent_{RecentDeletesOptions{}};
  std::unique_ptr<storage::DeviceEnv> env_ = storage::NewMemEnv();
  std::unique_ptr<storage::TierManager> store_;
  std::unique_ptr<daemon::TenantRegistry> tenants_;
  const daemon::Tenant* tenant_ = nullptr;
  daemon::DaemonMetrics metrics_;
  std::unique_ptr<PeerClient> client_;
  std::unique_ptr<Router> router_;
  std::unique_ptr<daemon::Service> service_;
  std::unique_ptr<daemon::ClusterCopies> copies_;
};

}  // namespace kvtier::cluster
