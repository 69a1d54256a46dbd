// The router when its peer call pool refuses a call (cluster/peer_call_pool.h full): the call
// is not made, fails like an unreachable peer and is counted; a GET falls back to the key's
// next owner, a LOOKUP answers from the peers it could ask. Against a real etcd (membership)
// and two in-process peer fronts whose LOOKUPs can be held to keep the pool busy.
#include <gtest/gtest.h>

#include <algorithm>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include "cluster/membership.h"
#include "cluster/peer_client.h"
#include "cluster/peer_server.h"
#include "cluster/router.h"
#include "common/temp_dir.h"
#include "tests/cluster/etcd_process.h"

namespace kvtier::cluster {
namespace {

using testing::EtcdProcess;
using testing::WaitFor;

// An in-memory peer whose next `hold` LOOKUPs wait until Release.
class HoldingHandler : public PeerHandler {
 public:
  void Set(const PeerKey& k, std::vector<uint8_t> v) {
    std::lock_guard lock(mu_);
    map_[k] = std::move(v);
  }
  void HoldNextLookups(int n) {
    std::lock_guard lock(mu_);
    hold_ = n;
  }
  int held() {
    std::lock_guard lock(mu_);
    return held_;
  }
  void Release() {
    {
      std::lock_guard lock(mu_);
      released_ = true;
    }
    cv_.notify_all();
  }
  std::vector<uint8_t> Lookup(std::span<const PeerKey> keys) override {
    std::unique_lock lock(mu_);
    if (hold_ > 0) {
      --hold_;
      ++held_;
      cv_.wait(lock, [&] { return released_; });
    }
    std::vector<uint8_t> out;
    for (const auto& k : keys) out.push_back(map_.contains(k) ? 0 : kPeerTierAbsent);
    return out;
  }
  Status Get(const PeerKey& key, std::vector<uint8_t>* value) override {
    std::lock_guard lock(mu_);
    auto it = map_.find(key);
    if (it == map_.end()) return Status::NotFound("absent");
    *value = it->second;
    return Status::Ok();
  }
  Status Put(const PeerPut&, bool*) override { return Status::Rejected("not in this test"); }
  StatusOr<std::vector<uint8_t>> Delete(std::span<const PeerKey> keys) override {
    return std::vector<uint8_t>(keys.size(), 0);
  }
  Status DeleteTenant(std::string_view) override { return Status::Ok(); }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<PeerKey, std::vector<uint8_t>> map_;
  int hold_ = 0, held_ = 0;
  bool released_ = false;
};

TEST(RouterRefusalTest, RefusedPeerCallFailsLikeAnUnreachablePeerAndIsCounted) {
  if (!EtcdProcess::Installed()) GTEST_SKIP() << "no /usr/bin/etcd (deploy/install-deps.sh)";
  TempDir dir("kvtier-router-refusal-");
  ASSERT_TRUE(dir.ok());
  EtcdProcess etcd(dir.path());
  ASSERT_TRUE(etcd.Start()) << "etcd did not start";
  const std::vector<uint8_t> credential(32, 7);

  // Peers b and c: in-process peer fronts; a: the router's node.
  HoldingHandler handler_b, handler_c;
  std::map<std::string, HoldingHandler*> handlers;
  std::vector<std::unique_ptr<PeerServer>> servers;
  std::vector<std::unique_ptr<Membership>> members;
  auto member = [&](const std::string& id, const std::string& endpoint) {
    MembershipOptions o;
    o.etcd.endpoints = {etcd.endpoint()};
    o.etcd.request_timeout_ms = 1000;
    o.key_prefix = "/r/";
    o.self.node_id = id;
    o.self.peer_endpoint = endpoint;
    o.self.dram_bytes = 1ull << 30;
    o.lease_ttl_s = 10;
    o.retry_ms = 50;
    auto m = Membership::Start(o);
    EXPECT_TRUE(m.ok());
    return m.ok() ? std::move(*m) : nullptr;
  };
  for (auto [id, h] : {std::pair{"b", &handler_b}, std::pair{"c", &handler_c}}) {
    PeerServerOptions so;
    so.credential = credential;
    auto s = PeerServer::Start(so, h);
    ASSERT_TRUE(s.ok()) << s.status().message();
    std::string ep = "127.0.0.1:" + std::to_string((*s)->port());
    handlers[ep] = h;
    servers.push_back(std::move(*s));
    members.push_back(member(id, ep));
  }
  members.push_back(member("a", "127.0.0.1:1"));
  Membership* self = members.back().get();
  ASSERT_TRUE(WaitFor([&] { return self->View()->members.size() == 3; }, 10000));

  PeerClient client(
      PeerClientOptions{.node_id = "a", .credential = credential, .timeout_ms = 5000});
  // One call thread, no queue: one call in flight, the next refused.
  Router router(self, &client,
                RouterOptions{.replicas = 2, .peer_call_threads = 1, .peer_call_queue_max = 0});
  auto view = router.View();
  // Keys both peers own (a does not): for each, b and c in rendezvous order.
  const std::string first_ep = handlers.begin()->first;  // the fan-out's pooled call
  std::vector<PeerKey> first_at_first, first_at_last;
  for (int i = 1; i < 256 && (first_at_first.size() < 3 || first_at_last.size() < 2); ++i) {
    PeerKey k{};
    k.fill(static_cast<uint8_t>(i));
    std::vector<size_t> owners = router.Owners(k, *view);
    bool self_owns = false;
    for (size_t o : owners) self_owns = self_owns || view->members[o].node_id == "a";
    if (self_owns) continue;
    (view->members[owners[0]].peer_endpoint == first_ep ? first_at_first : first_at_last)
        .push_back(k);
  }
  ASSERT_GE(first_at_first.size(), 3u);
  ASSERT_GE(first_at_last.size(), 2u);
  std::vector<PeerKey> keys = {first_at_first[0], first_at_last[0], first_at_first[1],
                               first_at_last[1]};
  auto value = [](const PeerKey& k) { return std::vector<uint8_t>(100 + k[0], k[0]); };
  for (const auto& k : keys) {
    handler_b.Set(k, value(k));
    handler_c.Set(k, value(k));
  }

  // Keep the pool's only thread busy: a LOOKUP to both peers, held at both (one call on the
  // pool thread, one on the caller's).
  handler_b.HoldNextLookups(1);
  handler_c.HoldNextLookups(1);
  std::thread busy([&] {
    std::vector<uint8_t> tiers(keys.size(), kPeerTierAbsent);
    router.LookupRemote(keys, &tiers);
  });
  ASSERT_TRUE(WaitFor([&] { return handler_b.held() + handler_c.held() == 2; }, 5000));

  // GET: the first round asks both peers, the call to first_ep is refused; the keys it had
  // are asked of their next owner in the next round (one peer: on the caller's thread).
  std::vector<Status> statuses(keys.size(), Status::NotFound("not asked"));
  std::vector<std::span<const uint8_t>> values(keys.size());
  std::vector<PeerBytes> held;
  router.GetRemote(keys, std::vector<bool>(keys.size(), true), &statuses, &values, &held);
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(statuses[i].ok()) << "key " << i << ": " << statuses[i].message();
    EXPECT_TRUE(std::ranges::equal(values[i], value(keys[i]))) << "key " << i;
  }
  EXPECT_EQ(router.stats().peer_calls_refused, 1u);
  EXPECT_EQ(router.stats().peer_errors, 1u);  // counted as a failed peer call

  // LOOKUP of a unit only first_ep holds: its call is refused, so it answers absent (as for
  // an unreachable peer); a unit the other peer holds too is found through it.
  const PeerKey only_first = first_at_first[2];
  handlers[first_ep]->Set(only_first, {1});
  std::vector<PeerKey> ask = {keys[0], only_first};
  std::vector<uint8_t> tiers(ask.size(), kPeerTierAbsent);
  router.LookupRemote(ask, &tiers);
  EXPECT_NE(tiers[0], kPeerTierAbsent);
  EXPECT_EQ(tiers[1], kPeerTierAbsent) << "the refused call was made";
  EXPECT_EQ(router.stats().peer_calls_refused, 2u);

  handler_b.Release();
  handler_c.Release();
  busy.join();
  // With the pool free again (its thread finishes the held call just after the caller got
  // its result) both peers are asked.
  EXPECT_TRUE(WaitFor(
      [&] {
        tiers.assign(ask.size(), kPeerTierAbsent);
        router.LookupRemote(ask, &tiers);
        return tiers[1] != kPeerTierAbsent;
      },
      5000));
  for (auto& m : members) m->Stop(/*revoke=*/true);
}

}  // namespace
}  // namespace kvtier::cluster
