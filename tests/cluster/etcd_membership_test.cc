// Against a real etcd (started here on free loopback ports): the client's calls, lease expiry,
// watches, and Membership's register / keepalive / leave / rejoin / etcd-down behaviour.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "cluster/etcd_client.h"
#include "cluster/membership.h"
#include "common/temp_dir.h"
#include "tests/cluster/etcd_process.h"

namespace kvtier::cluster {
namespace {

using testing::EtcdProcess;
using testing::WaitFor;

class EtcdTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!EtcdProcess::Installed()) GTEST_SKIP() << "no /usr/bin/etcd (deploy/install-deps.sh)";
    ASSERT_TRUE(dir_.ok());
    etcd_ = std::make_unique<EtcdProcess>(dir_.path());
    etcd_->set_own_process_group(true);  // AFailedKeepaliveIsRetriedSoon pauses it
    ASSERT_TRUE(etcd_->Start()) << "etcd did not start";
  }
  EtcdOptions Options() const {
    EtcdOptions o;
    o.endpoints = {etcd_->endpoint()};
    o.request_timeout_ms = 1000;
    return o;
  }
  MembershipOptions Node(const std::string& id, const std::string& prefix = "/t/") const {
    MembershipOptions o;
    o.etcd = Options();
    o.key_prefix = prefix;
    o.self.node_id = id;
    o.self.peer_endpoint = "127.0.0.1:7001";
    o.self.dram_bytes = 1ull << 30;
    o.lease_ttl_s = 2;
    o.retry_ms = 50;
    return o;
  }
  static bool Has(const Membership& m, const std::string& id) { return m.View()->Find(id) >= 0; }

  TempDir dir_{"kvtier-etcd-"};
  std::unique_ptr<EtcdProcess> etcd_;
};

TEST_F(EtcdTest, PutRangeDeleteAndBinaryKeys) {
  EtcdClient c(Options());
  std::string binary("k\0\xff", 3);
  ASSERT_TRUE(c.Put("/p/a", "1").ok());
  ASSERT_TRUE(c.Put("/p/" + binary, std::string("\0v", 2)).ok());
  ASSERT_TRUE(c.Put("/q/x", "2").ok());
  auto r = c.RangePrefix("/p/");
  ASSERT_TRUE(r.ok()) << r.status().message();
  ASSERT_EQ(r->kvs.size(), 2u);
  EXPECT_EQ(r->kvs[0].key, "/p/a");
  EXPECT_EQ(r->kvs[1].key, "/p/" + binary);
  EXPECT_EQ(r->kvs[1].value, std::string("\0v", 2));
  EXPECT_GE(r->revision, 3);
  EXPECT_TRUE(c.Get("/p/none").status().IsNotFound());
  auto deleted = c.Delete("/p/", PrefixRangeEnd("/p/"));
  ASSERT_TRUE(deleted.ok());
  EXPECT_EQ(*deleted, 2);
  EXPECT_TRUE(c.Get("/p/a").status().IsNotFound());
  EXPECT_TRUE(c.Get("/q/x").ok());
}

TEST_F(EtcdTest, LeaseKeysVanishWhenTheLeaseExpires) {
  EtcdClient c(Options());
  auto lease = c.LeaseGrant(2);
  ASSERT_TRUE(lease.ok()) << lease.status().message();
  ASSERT_TRUE(c.Put("/l/k", "v", lease->id).ok());
  auto ttl = c.LeaseKeepAlive(lease->id);
  ASSERT_TRUE(ttl.ok()) << ttl.status().message();
  EXPECT_GT(*ttl, 0);
  EXPECT_TRUE(c.Get("/l/k").ok());
  // No more keepalives: gone within TTL (+ etcd's lease check granularity).
  EXPECT_TRUE(WaitFor([&] { return c.Get("/l/k").status().IsNotFound(); }, 6000));
  EXPECT_TRUE(c.LeaseKeepAlive(lease->id).status().IsNotFound());
  EXPECT_TRUE(c.Put("/l/k", "v", lease->id).IsNotFound());
}

TEST_F(EtcdTest, WatchDeliversPutsAndDeletesInOrder) {
  EtcdClient c(Options());
  auto start = c.RangePrefix("/w/");
  ASSERT_TRUE(start.ok());
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::vector<std::string> seen;
  Status watch_status;
  std::thread watcher([&] {
    watch_status = c.Watch(
        "/w/", start->revision + 1,
        [&](const std::vector<EtcdEvent>& events, int64_t) {
          std::lock_guard lock(mu);
          for (const auto& e : events) {
            seen.push_back((e.type == EtcdEvent::Type::kPut ? "put " : "del ") + e.kv.key + "=" +
                           e.kv.value);
          }
        },
        &stop, 50);
  });
  ASSERT_TRUE(c.Put("/w/a", "1").ok());
  ASSERT_TRUE(c.Put("/other", "x").ok());
  ASSERT_TRUE(c.Put("/w/b", "2").ok());
  ASSERT_TRUE(c.Delete("/w/a").ok());
  bool all = WaitFor(
      [&] {
        std::lock_guard lock(mu);
        return seen.size() >= 3;
      },
      5000);
  stop = true;
  watcher.join();
  ASSERT_TRUE(all);
  EXPECT_TRUE(watch_status.ok()) << watch_status.message();
  std::vector<std::string> want = {"put /w/a=1", "put /w/b=2", "del /w/a="};
  EXPECT_EQ(seen, want);
}

TEST_F(EtcdTest, MembersSeeJoinsGracefulLeavesAndCrashes) {
  auto a = Membership::Start(Node("a"));
  ASSERT_TRUE(a.ok()) << a.status().message();
  auto b = Membership::Start(Node("b"));
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(WaitFor([&] { return Has(**a, "a") && Has(**a, "b") && Has(**b, "a"); }, 5000));
  EXPECT_TRUE((*a)->etcd_reachable());
  EXPECT_TRUE((*a)->Stats().registered);
  const MemberView& view = *(*a)->View();
  ASSERT_EQ(view.members.size(), 2u);
  EXPECT_EQ(view.members[1].peer_endpoint, "127.0.0.1:7001");

  // Graceful leave revokes the lease: gone at once (well within the 2 s TTL).
  (*b)->Stop(/*revoke=*/true);
  EXPECT_TRUE(WaitFor([&] { return !Has(**a, "b"); }, 1500));

  // A crash (no revoke, no keepalive) is noticed when the lease expires.
  auto c = Membership::Start(Node("c"));
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(WaitFor([&] { return Has(**a, "c"); }, 5000));
  (*c)->Stop(/*revoke=*/false);
  EXPECT_TRUE(Has(**a, "c"));
  EXPECT_TRUE(WaitFor([&] { return !Has(**a, "c"); }, 8000));
  // Another cluster's prefix is invisible.
  auto other = Membership::Start(Node("x", "/other-cluster/"));
  ASSERT_TRUE(other.ok());
  ASSERT_TRUE(WaitFor([&] { return Has(**other, "x"); }, 5000));
  EXPECT_FALSE(Has(**a, "x"));
}

TEST_F(EtcdTest, ANodeWhoseLeaseWasLostRegistersAgain) {
  auto a = Membership::Start(Node("a"));
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(WaitFor([&] { return Has(**a, "a"); }, 5000));
  // Someone revokes a's lease behind its back (what etcd does when a's keepalives stop
  // arriving, e.g. a SIGSTOP past the TTL): the record vanishes, then a puts it back.
  EtcdClient c(Options());
  auto kv = c.Get("/t/members/a");
  ASSERT_TRUE(kv.ok());
  ASSERT_TRUE(c.LeaseRevoke(kv->lease).ok());
  EXPECT_TRUE(WaitFor([&] { return (*a)->Stats().registrations >= 2 && Has(**a, "a"); }, 8000));
  auto again = c.Get("/t/members/a");
  ASSERT_TRUE(again.ok());
  EXPECT_NE(again->lease, kv->lease);
}

// A keepalive that failed (etcd did not answer in time) is retried after retry_ms, not a
// renewal period (TTL/3) later: otherwise one slow etcd answer leaves the lease unconfirmed
// past 2/3 of the TTL (every GET copy dropped) and, with a short TTL, lets it expire.
TEST_F(EtcdTest, AFailedKeepaliveIsRetriedSoon) {
  MembershipOptions o = Node("a");
  o.lease_ttl_s = 12;  // renewals every 4 s
  o.etcd.request_timeout_ms = 300;
  auto a = Membership::Start(o);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(WaitFor([&] { return Has(**a, "a") && (*a)->Stats().lease_renewals >= 1; }, 10000));
  // Right after a renewal: the next keepalive (4 s later) finds etcd stopped and fails.
  const uint64_t renewed = (*a)->Stats().lease_renewals;
  ASSERT_TRUE(WaitFor([&] { return (*a)->Stats().lease_renewals > renewed; }, 10000));
  etcd_->Pause(true);
  const bool failed = WaitFor([&] { return !(*a)->etcd_reachable(); }, 8000);
  etcd_->Pause(false);
  ASSERT_TRUE(failed) << "no keepalive failed while etcd was stopped";
  const uint64_t before = (*a)->Stats().lease_renewals;
  // The retry comes retry_ms (50 ms) after the failure; a renewal period would be 4 s.
  EXPECT_TRUE(WaitFor([&] { return (*a)->Stats().lease_renewals > before; }, 2000))
      << "the failed keepalive waited for the next renewal period";
  EXPECT_EQ((*a)->Stats().registrations, 1u);
}

// A watch silent for watch_silence_ms_max is renewed from the revision it reached: no join or
// leave is missed across renewals, and a renewal is not counted as an etcd error. With etcd
// stopped (its connections open but silent) the view is kept; continued, it catches up.
TEST_F(EtcdTest, SilentWatchesAreRenewedWithoutMissingChanges) {
  MembershipOptions o = Node("a");
  o.etcd.watch_silence_ms_max = 150;
  auto a = Membership::Start(o);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(WaitFor([&] { return Has(**a, "a"); }, 5000));
  std::this_thread::sleep_for(std::chrono::milliseconds(600));  // several renewals
  auto b = Membership::Start(Node("b"));
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(WaitFor([&] { return Has(**a, "b"); }, 5000));
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  (*b)->Stop(/*revoke=*/true);
  EXPECT_TRUE(WaitFor([&] { return !Has(**a, "b"); }, 1500));
  EXPECT_EQ((*a)->Stats().etcd_errors, 0u);
  EXPECT_GE((*a)->Stats().watch_renewals, 2u);  // the silences were renewals
  etcd_->Pause(true);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  etcd_->Pause(false);
  auto c = Membership::Start(Node("c"));
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(WaitFor([&] { return Has(**a, "c") && Has(**a, "a"); }, 8000));
}

TEST_F(EtcdTest, EtcdDownKeepsTheLastViewAndSaysSo) {
  auto a = Membership::Start(Node("a"));
  ASSERT_TRUE(a.ok());
  auto b = Membership::Start(Node("b"));
  ASSERT_TRUE(b.ok());
  // Both records in a's view before the kill: b's put can reach a's watch before a's own put
  // has gone out (a loaded machine), and a view without "a" is then kept for good.
  ASSERT_TRUE(
      WaitFor([&] { return Has(**a, "a") && Has(**a, "b") && (*a)->etcd_reachable(); }, 5000));
  etcd_->Kill();
  EXPECT_TRUE(WaitFor([&] { return !(*a)->etcd_reachable(); }, 5000));
  EXPECT_TRUE(Has(**a, "a"));
  EXPECT_TRUE(Has(**a, "b"));
  EXPECT_GT((*a)->Stats().etcd_errors, 0u);
}

TEST_F(EtcdTest, HostileMemberRecordsAreIgnoredAndCounted) {
  auto a = Membership::Start(Node("a"));
  ASSERT_TRUE(a.ok());
  EtcdClient c(Options());
  ASSERT_TRUE(c.Put("/t/members/evil", "{not json").ok());
  ASSERT_TRUE(c.Put("/t/members/liar", EncodeMember((*a)->options().self)).ok());  // id "a"
  ASSERT_TRUE(WaitFor([&] { return (*a)->Stats().bad_records >= 2; }, 5000));
  auto view = (*a)->View();
  EXPECT_EQ(view->Find("evil"), -1);
  EXPECT_EQ(view->Find("liar"), -1);
}

}  // namespace
}  // namespace kvtier::cluster
