// etcd + three kvtierd in cluster mode (tests/cluster/cluster_fixture.h): a unit put through
// one node is found and read bit-exactly through every other; tenants stay apart across nodes;
// deletes reach every copy; with etcd gone the nodes keep serving what they hold and say so.
#include <signal.h>

#include <algorithm>
#include <thread>

#include "tests/cluster/cluster_fixture.h"

namespace kvtier::cluster {
namespace {

TEST_F(ClusterE2eTest, APutThroughOneNodeIsReadBitExactlyThroughEveryOther) {
  auto writer = Connect(0, "tok-alice");
  ASSERT_NE(writer, nullptr);
  auto values = PutSession(writer.get(), "s1");
  for (int i = 0; i < kNodes; ++i) {
    auto alice = Connect(i, "tok-alice");
    ASSERT_NE(alice, nullptr);
    ExpectWholeSession(alice.get(), "s1", values, i);
  }
  // Units are spread over owners, not copied everywhere: some units live off node 0.
  EXPECT_GT(Metric(Metrics(0), "kvtier_cluster_forwarded_puts_total"), 0);
  EXPECT_GT(Metric(Metrics(1), "kvtier_cluster_peer_requests_total") +
                Metric(Metrics(2), "kvtier_cluster_peer_requests_total"),
            0);
}

TEST_F(ClusterE2eTest, TenantsStayApartAcrossNodesAndDeletesReachEveryCopy) {
  auto alice0 = Connect(0, "tok-alice");
  ASSERT_NE(alice0, nullptr);
  auto values = PutSession(alice0.get(), "s2");
  auto chain = Chain("s2");
  for (int i = 0; i < kNodes; ++i) {
    auto bob = Connect(i, "tok-bob");
    ASSERT_NE(bob, nullptr);
    auto hit = bob->Lookup(chain);
    ASSERT_TRUE(hit.ok());
    EXPECT_EQ(hit->hit_count, 0u) << "bob sees alice's units on node " << i;
    std::vector<std::vector<uint8_t>> got;
    std::vector<bool> found;
    ASSERT_TRUE(bob->GetCopy(chain, &got, &found).ok());
    for (int u = 0; u < kUnits; ++u) EXPECT_FALSE(found[u]);
  }
  // Delete through node 1: gone through every node.
  auto alice1 = Connect(1, "tok-alice");
  ASSERT_NE(alice1, nullptr);
  auto deleted = alice1->Delete(std::span<const Key>(chain).subspan(kUnits / 2));
  ASSERT_TRUE(deleted.ok()) << deleted.status().message();
  EXPECT_EQ(*deleted, static_cast<uint32_t>(kUnits - kUnits / 2));
  for (int i = 0; i < kNodes; ++i) {
    auto alice = Connect(i, "tok-alice");
    auto hit = alice->Lookup(chain);
    ASSERT_TRUE(hit.ok());
    EXPECT_EQ(hit->hit_count, static_cast<size_t>(kUnits / 2)) << "node " << i;
  }
  // A tenant delete through node 2 empties alice everywhere.
  auto alice2 = Connect(2, "tok-alice");
  ASSERT_TRUE(alice2->DeleteAll().ok());
  for (int i = 0; i < kNodes; ++i) {
    auto alice = Connect(i, "tok-alice");
    auto hit = alice->Lookup(chain);
    ASSERT_TRUE(hit.ok());
    EXPECT_EQ(hit->hit_count, 0u) << "node " << i;
  }
}

TEST_F(ClusterE2eTest, EtcdDownNodesKeepServingAndSaySo) {
  auto writer = Connect(1, "tok-alice");
  ASSERT_NE(writer, nullptr);
  auto values = PutSession(writer.get(), "s3");
  etcd_->Kill();
  ASSERT_TRUE(kt::WaitFor(
      [&] {
        for (int i = 0; i < kNodes; ++i) {
          if (Metric(Metrics(i), "kvtier_cluster_etcd_reachable") != 0) return false;
        }
        return true;
      },
      10000));
  for (int i = 0; i < kNodes; ++i) {
    std::string ready = kt::HttpRequest(nodes_[i]->http_port(), "GET", "/readyz");
    EXPECT_NE(ready.find("200 OK"), std::string::npos) << ready;
    EXPECT_NE(ready.find("etcd UNREACHABLE"), std::string::npos) << ready;
    auto alice = Connect(i, "tok-alice");
    ASSERT_NE(alice, nullptr);
    ExpectWholeSession(alice.get(), "s3", values, i);
  }
}

// An owner killed and restarted within its lease never left its peers' views: they route to
// it as soon as its peer front listens, before it has caught up on the tombstone log. It must
// not serve them a unit deleted while it was down (docs/CLUSTER.md, "Tombstones": a node
// "deletes what it missed before peers route to it again"). etcd is paused across the restart,
// so the catch-up cannot happen. Found by the cluster judge (cluster_judge_test.cc); before the
// fix the two other nodes served the deleted units that the restarted node owns.
class ClusterRestartWithinLeaseTest : public ClusterE2eTest {
 protected:
  uint32_t LeaseTtlS() const override { return 30; }
  // A session put through n0, then n2 killed (within its lease: still in the views) and the
  // session deleted through n0 (n2 refused: recorded in the tombstone log); *gone: its chain.
  void DeleteWhileN2IsDown(std::vector<Key>* gone) {
    auto writer = Connect(0, "tok-alice");
    ASSERT_NE(writer, nullptr);
    PutSession(writer.get(), "gone");
    *gone = Chain("gone");
    nodes_[2]->Stop(SIGKILL);
    ASSERT_TRUE(writer->Delete(*gone).ok());
  }
};

TEST_F(ClusterRestartWithinLeaseTest, ARestartedOwnerServesPeersNoUnitDeletedWhileItWasDown) {
  std::vector<Key> gone;
  ASSERT_NO_FATAL_FAILURE(DeleteWhileN2IsDown(&gone));

  etcd_->Pause(true);
  ASSERT_TRUE(StartNode(2)) << nodes_[2]->Log();
  for (int i = 0; i < 2; ++i) {
    auto c = Connect(i, "tok-alice");
    ASSERT_NE(c, nullptr);
    std::vector<std::vector<uint8_t>> got;
    std::vector<bool> found;
    ASSERT_TRUE(c->GetCopy(gone, &got, &found).ok());
    EXPECT_EQ(std::count(found.begin(), found.end(), true), 0)
        << "node " << i << " serves units deleted while their owner n2 was down";
  }
  EXPECT_GT(Metric(Metrics(2), "kvtier_cluster_peer_refused_before_catch_up_total"), 0);
  etcd_->Pause(false);
  // Once caught up (and registered) n2 serves its peers again, without the deleted units.
  ASSERT_TRUE(kt::WaitFor(
      [&] { return Metric(Metrics(2), "kvtier_cluster_registrations_total") >= 1; }, 15000));
  auto c = Connect(0, "tok-alice");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->Lookup(gone)->hit_count, 0u);
}

// The same restart seen by the restarted node's own clients: it applies the deletes it missed
// before it accepts them (one catch-up at start), so its socket never serves a deleted unit.
// Before, its clients were accepted while the membership's first catch-up was still running
// (docs/CLUSTER.md, "Not guaranteed" still names that window when etcd does not answer).
TEST_F(ClusterRestartWithinLeaseTest, ARestartedOwnerServesItsOwnClientsNoUnitDeletedMeanwhile) {
  std::vector<Key> gone;
  ASSERT_NO_FATAL_FAILURE(DeleteWhileN2IsDown(&gone));
  ASSERT_TRUE(StartNode(2)) << nodes_[2]->Log();
  // Applied before its socket accepted (StartNode returns once it does).
  EXPECT_GT(Metric(Metrics(2), "kvtier_cluster_tombstones_applied_total"), 0);
  auto c = Connect(2, "tok-alice");
  ASSERT_NE(c, nullptr);
  std::vector<std::vector<uint8_t>> got;
  std::vector<bool> found;
  ASSERT_TRUE(c->GetCopy(gone, &got, &found).ok());
  EXPECT_EQ(std::count(found.begin(), found.end(), true), 0)
      << "n2 serves its clients units deleted while it was down";
}

// The same delete missed by an owner that was stopped (SIGSTOP) rather than killed, and so
// never restarted: a peer's GET sent to it after the delete was acknowledged waits in its
// socket, and when it runs again it used to answer from the store the delete never reached
// (the cluster judge, seed 646). Now a node that did not run for over peer_timeout_ms / 2
// answers no peer read until the deletes that timed out on it are applied
// (cluster/pause_guard.h): the reader asks the key's next owner.
TEST_F(ClusterRestartWithinLeaseTest, AnOwnerContinuedAfterAStopServesPeersNoUnitDeletedMeanwhile) {
  auto writer = Connect(0, "tok-alice");
  ASSERT_NE(writer, nullptr);
  PutSession(writer.get(), "paused");
  const std::vector<Key> chain = Chain("paused");
  nodes_[2]->Signal(SIGSTOP);
  // n0's call to n2 times out (peer_timeout_ms): a tombstone, and the delete is acknowledged.
  ASSERT_TRUE(writer->Delete(chain).ok());
  auto reader = Connect(1, "tok-alice");
  ASSERT_NE(reader, nullptr);
  std::vector<std::vector<uint8_t>> got;
  std::vector<bool> found;
  Status read = Status::Internal("not read");
  // n1 asks n2 for the units n2 owns first; the GET waits in n2's socket until it runs again.
  std::thread get([&] { read = reader->GetCopy(chain, &got, &found); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  nodes_[2]->Signal(SIGCONT);
  get.join();
  ASSERT_TRUE(read.ok()) << read.message();
  EXPECT_EQ(std::count(found.begin(), found.end(), true), 0)
      << "n1 served units deleted while their owner n2 was stopped";
  const std::string m = Metrics(2);
  EXPECT_EQ(Metric(m, "kvtier_cluster_pauses_total"), 1);
  EXPECT_GT(Metric(m, "kvtier_cluster_peer_refused_before_catch_up_total"), 0);
  // Once the hold is over and n2 caught up, it answers its peers again, without those units.
  ASSERT_TRUE(kt::WaitFor(
      [&] { return Metric(Metrics(2), "kvtier_cluster_peer_answers_held") == 0; }, 15000));
  EXPECT_EQ(reader->Lookup(chain)->hit_count, 0u);
}

// The same stop seen by the stopped node's own clients: their GET and LOOKUP, sent while it is
// stopped and read when it runs again, used to be answered from its store until its next
// catch-up (up to a second later). While its pause guard holds, they are asked of the keys'
// other owners instead.
TEST_F(ClusterRestartWithinLeaseTest, AnOwnerContinuedAfterAStopServesItsOwnClientsNoDeletedUnit) {
  auto writer = Connect(0, "tok-alice");
  ASSERT_NE(writer, nullptr);
  PutSession(writer.get(), "paused-local");
  const std::vector<Key> chain = Chain("paused-local");
  auto local = Connect(2, "tok-alice");  // connected before the stop
  ASSERT_NE(local, nullptr);
  nodes_[2]->Signal(SIGSTOP);
  ASSERT_TRUE(writer->Delete(chain).ok());
  std::vector<std::vector<uint8_t>> got;
  std::vector<bool> found;
  Status read = Status::Internal("not read");
  StatusOr<daemon::LookupResult> looked = Status::Internal("not looked up");
  std::thread client([&] {
    read = local->GetCopy(chain, &got, &found);
    looked = local->Lookup(chain);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  nodes_[2]->Signal(SIGCONT);
  client.join();
  ASSERT_TRUE(read.ok()) << read.message();
  EXPECT_EQ(std::count(found.begin(), found.end(), true), 0)
      << "n2 served its own client units deleted while it was stopped";
  ASSERT_TRUE(looked.ok()) << looked.status().message();
  EXPECT_EQ(looked->hit_count, 0u) << "n2 counted units deleted while it was stopped";
  EXPECT_EQ(Metric(Metrics(2), "kvtier_cluster_pauses_total"), 1);
}

}  // namespace
}  // namespace kvtier::cluster
