// The tombstone log (cluster/tombstones.h) against a real etcd: a backlog larger than one
// etcd reply is read page by page, at one revision, and a node does not register in the
// membership until its catch-up succeeded.
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <set>

#include "cluster/etcd_client.h"
#include "cluster/membership.h"
#include "cluster/tombstones.h"
#include "common/temp_dir.h"
#include "tests/cluster/etcd_process.h"

namespace kvtier::cluster {
namespace {

using testing::EtcdProcess;
using testing::WaitFor;

// The reply limit of the reading node's etcd client: 300 tombstones (about 250 bytes each in
// etcd's JSON) are far over it, a page of 16 well within it.
constexpr uint64_t kSmallReplyBytes = 8192;
constexpr int kTombstones = 300;
constexpr int64_t kPageKeys = 16;

PeerKey K(int i) {
  PeerKey k{};
  k[0] = static_cast<uint8_t>(i);
  k[1] = static_cast<uint8_t>(i >> 8);
  k[31] = 0x5a;
  return k;
}

class TombstoneLogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!EtcdProcess::Installed()) GTEST_SKIP() << "no /usr/bin/etcd (deploy/install-deps.sh)";
    ASSERT_TRUE(dir_.ok());
    etcd_ = std::make_unique<EtcdProcess>(dir_.path());
    ASSERT_TRUE(etcd_->Start()) << "etcd did not start";
  }
  EtcdOptions Options(uint64_t response_bytes_max = 16ull << 20) const {
    EtcdOptions o;
    o.endpoints = {etcd_->endpoint()};
    o.request_timeout_ms = 2000;
    o.response_bytes_max = response_bytes_max;
    return o;
  }
  // kTombstones deletes recorded by node "w" (applied by w only), and one tenant delete.
  void RecordBacklog() {
    EtcdClient etcd(Options());
    TombstoneLog writer(
        &etcd, TombstoneOptions{.key_prefix = "/t/", .node_id = "w", .ttl_s = 600},
        [](std::span<const PeerKey>) {}, [](std::string_view) {});
    std::vector<PeerKey> keys;
    for (int i = 0; i < kTombstones; ++i) keys.push_back(K(i));
    ASSERT_TRUE(writer.RecordKeys(keys, {"w"}).ok());
    ASSERT_TRUE(writer.RecordTenant("bob", {"w"}).ok());
  }

  TempDir dir_{"kvtier-tombstones-"};
  std::unique_ptr<EtcdProcess> etcd_;
};

// A delete recorded without this node is applied at once, not at the next poll: node "r"
// polls every 60 s, and after its first catch-up "w" records a delete only w applied, then a
// delete that names r too, then a tenant delete without r. r applies the first and the tenant
// delete within seconds (the watch wakes its poll), and the one naming r wakes nothing. Before
// the watch, r applied them only at its next poll, a second later by default.
TEST_F(TombstoneLogTest, ADeleteRecordedWithoutThisNodeIsAppliedAtOnce) {
  EtcdClient etcd(Options());
  std::mutex mu;
  std::set<PeerKey> applied;
  std::set<std::string> tenants;
  TombstoneLog reader(
      &etcd, TombstoneOptions{.key_prefix = "/t/", .node_id = "r", .ttl_s = 600, .poll_ms = 60000},
      [&](std::span<const PeerKey> keys) {
        std::lock_guard lock(mu);
        applied.insert(keys.begin(), keys.end());
      },
      [&](std::string_view tenant) {
        std::lock_guard lock(mu);
        tenants.insert(std::string(tenant));
      });
  reader.StartPolling();
  ASSERT_TRUE(WaitFor([&] { return reader.caught_up(); }, 10000));
  TombstoneLog writer(
      &etcd, TombstoneOptions{.key_prefix = "/t/", .node_id = "w", .ttl_s = 600},
      [](std::span<const PeerKey>) {}, [](std::string_view) {});
  const std::vector<PeerKey> missed = {K(1)}, acknowledged = {K(2)};
  ASSERT_TRUE(writer.RecordKeys(acknowledged, {"w", "r"}).ok());
  ASSERT_TRUE(writer.RecordKeys(missed, {"w"}).ok());
  ASSERT_TRUE(writer.RecordTenant("bob", {"w"}).ok());
  EXPECT_TRUE(WaitFor(
      [&] {
        std::lock_guard lock(mu);
        return applied.contains(K(1)) && tenants.contains("bob");
      },
      5000))
      << "the missed deletes waited for the poll";
  {
    std::lock_guard lock(mu);
    EXPECT_FALSE(applied.contains(K(2))) << "a delete r acknowledged was applied again";
  }
  EXPECT_GE(reader.stats().watch_wakeups, 1u);
  reader.Stop();
}

// A whole-backlog read used to be one unpaginated range: past EtcdOptions::response_bytes_max
// (16 MiB: about 60 000 tombstones) the reply was refused and every catch-up failed. Here the
// limit is small instead of the backlog large.
TEST_F(TombstoneLogTest, ABacklogLargerThanOneReplyIsAppliedPageByPage) {
  RecordBacklog();
  EtcdClient etcd(Options(kSmallReplyBytes));
  std::set<PeerKey> applied;
  std::vector<std::string> tenants;
  TombstoneLog reader(
      &etcd, TombstoneOptions{.key_prefix = "/t/", .node_id = "r", .page_keys = kPageKeys},
      [&](std::span<const PeerKey> keys) { applied.insert(keys.begin(), keys.end()); },
      [&](std::string_view t) { tenants.emplace_back(t); });
  Status s = reader.CatchUp();
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_EQ(applied.size(), static_cast<size_t>(kTombstones));
  for (int i = 0; i < kTombstones; ++i) EXPECT_TRUE(applied.contains(K(i))) << i;
  EXPECT_EQ(tenants, std::vector<std::string>{"bob"});
  EXPECT_EQ(reader.stats().applied, static_cast<uint64_t>(kTombstones));
  EXPECT_GT(reader.stats().applied_revision, 0);
  // Nothing new: the next catch-up reads from the revision after the last one applied.
  applied.clear();
  ASSERT_TRUE(reader.CatchUp().ok());
  EXPECT_TRUE(applied.empty());
}

// Every page of one read is at the revision of the first: a key written under the prefix
// between two pages (after the reader's position) is not in this read, so the revision the
// read returns is a consistent point to continue from.
TEST_F(TombstoneLogTest, PagesAreReadAtOneRevision) {
  EtcdClient etcd(Options());
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(etcd.Put("/p/k" + std::to_string(i), "v").ok());
  std::vector<std::string> seen;
  int pages = 0;
  auto revision = etcd.RangePrefixPaged("/p/", 3, 0, 0, [&](const std::vector<EtcdKeyValue>& page) {
    if (++pages == 1) {
      Status put = etcd.Put("/p/k99", "late");  // after the reader's position
      if (!put.ok()) return put;
    }
    for (const auto& kv : page) seen.push_back(kv.key);
    return Status::Ok();
  });
  ASSERT_TRUE(revision.ok()) << revision.status().message();
  EXPECT_EQ(pages, 4);
  ASSERT_EQ(seen.size(), 10u);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(seen[static_cast<size_t>(i)], "/p/k" + std::to_string(i));
  auto now = etcd.RangePrefix("/p/");
  ASSERT_TRUE(now.ok());
  EXPECT_EQ(now->kvs.size(), 11u);
  EXPECT_LT(*revision, now->revision);
}

// A node whose catch-up fails does not register (it would own units with deletes it has not
// applied): it used to log the failure and register anyway. It registers once the catch-up
// succeeds, with the whole backlog applied before its record appears in etcd.
TEST_F(TombstoneLogTest, ANodeRegistersOnlyAfterItsCatchUpSucceeded) {
  RecordBacklog();
  EtcdClient etcd(Options(kSmallReplyBytes));
  EtcdClient observer(Options());
  const std::string member_key = "/t/members/r";
  std::mutex mu;
  std::set<PeerKey> applied;
  bool applied_while_registered = false;
  TombstoneLog reader(
      &etcd, TombstoneOptions{.key_prefix = "/t/", .node_id = "r", .page_keys = kPageKeys},
      [&](std::span<const PeerKey> keys) {
        const bool registered = observer.Get(member_key).ok();
        std::lock_guard lock(mu);
        applied.insert(keys.begin(), keys.end());
        applied_while_registered = applied_while_registered || registered;
      },
      [](std::string_view) {});
  std::atomic<bool> etcd_refuses{true};  // the catch-up's reads fail while set
  MembershipOptions o;
  o.etcd = Options();
  o.key_prefix = "/t/";
  o.self.node_id = "r";
  o.self.peer_endpoint = "127.0.0.1:7001";
  o.self.dram_bytes = 1ull << 30;
  o.lease_ttl_s = 2;
  o.retry_ms = 50;
  o.before_register = [&]() -> Status {
    if (etcd_refuses.load()) return Status::Unavailable("tombstone catch-up: etcd refused (test)");
    return reader.CatchUp();
  };
  auto m = Membership::Start(o);
  ASSERT_TRUE(m.ok()) << m.status().message();
  // Failed twice (50 ms, then 100 ms apart): still not registered.
  ASSERT_TRUE(WaitFor([&] { return (*m)->Stats().registrations_held_back >= 2; }, 10000));
  EXPECT_FALSE((*m)->Stats().registered);
  EXPECT_EQ((*m)->Stats().registrations, 0u);
  EXPECT_TRUE(observer.Get(member_key).status().IsNotFound()) << "registered without catch-up";

  etcd_refuses = false;
  ASSERT_TRUE(WaitFor([&] { return (*m)->Stats().registered; }, 10000));
  EXPECT_TRUE(observer.Get(member_key).ok());
  std::lock_guard lock(mu);
  EXPECT_EQ(applied.size(), static_cast<size_t>(kTombstones));
  EXPECT_FALSE(applied_while_registered) << "a tombstone was applied after registering";
  (*m)->Stop(/*revoke=*/true);
}

}  // namespace
}  // namespace kvtier::cluster
