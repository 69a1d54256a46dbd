// The cluster's bulk data path against etcd and three real kvtierd ([cluster]
// peer_data_transport = "tcp_region", docs/CLUSTER.md "Bulk data over the region
// transport"): GETs through a non-owner move remote units through the owners' staging
// regions bit-exactly; with a ring too small for one GET's units, the records overwritten
// before they are read are detected and fetched by plain GET, still bit-exactly; "verbs"
// without an RDMA device is refused at start.
#include "tests/cluster/cluster_fixture.h"

namespace kvtier::cluster {
namespace {

class ClusterStagedTest : public ClusterE2eTest {
 protected:
  std::string ExtraClusterConfig(int i) override {
    if (i == kNodes) return "peer_data_transport = \"verbs\"\n";
    return "peer_data_transport = \"tcp_region\"\npeer_staging_ring_bytes = " +
           std::to_string(RingBytes()) + "\n";
  }
  virtual uint64_t RingBytes() const { return 16 << 20; }
  // Room for every size class of a session's units.
  uint64_t DramCapacityBytes(int /*i*/) const override { return 268435456; }

  // Sum of a metric over the three nodes.
  double Sum(const std::string& name) {
    double sum = 0;
    for (int i = 0; i < kNodes; ++i) sum += Metric(Metrics(i), name);
    return sum;
  }
};

TEST_F(ClusterStagedTest, GetsThroughEveryNodeMoveRemoteUnitsOverTheRegionExactly) {
  auto writer = Connect(0, "tok-alice");
  ASSERT_NE(writer, nullptr);
  auto want = PutSession(writer.get(), "staged");
  for (int i = 0; i < kNodes; ++i) {
    auto reader = Connect(i, "tok-alice");
    ASSERT_NE(reader, nullptr);
    ExpectWholeSession(reader.get(), "staged", want, i);
  }
  // Every remote unit came over the region transport (R = 2 of 3: each node fetched about a
  // third of the session), none by the fallback.
  for (int i = 0; i < kNodes; ++i) {
    const std::string m = Metrics(i);
    const double fetched = Metric(m, "kvtier_cluster_remote_get_hits_total");
    EXPECT_GT(fetched, 0) << "node " << i;
    EXPECT_EQ(Metric(m, "kvtier_cluster_staged_get_units_total"), fetched) << "node " << i;
    EXPECT_EQ(Metric(m, "kvtier_cluster_staged_get_fallback_units_total"), 0) << "node " << i;
  }
  EXPECT_GT(Sum("kvtier_cluster_staging_region_bytes_served_total"), 0);
  EXPECT_GT(Sum("kvtier_cluster_staging_grants_issued_total"), 0);
}

TEST_F(ClusterStagedTest, VerbsWithoutADeviceIsRefusedAtStart) {
  nodes_.push_back(std::make_unique<kt::KvtierdProcess>(dir_ / "n3"));
  peer_ports_.push_back(kt::FreePort());
  // The daemon may bind its socket before the cluster starts: wait for it to exit.
  if (StartNode(kNodes)) {
    EXPECT_NE(nodes_[kNodes]->WaitExit(10000), 0);
  }
  // Refused either way, naming why: no device here, or no verbs in this build (preset nohw).
#if KVTIER_WITH_RDMA
  const char* const why = "no RDMA device";
#else
  const char* const why = "built without libibverbs";
#endif
  EXPECT_NE(nodes_[kNodes]->Log().find(why), std::string::npos) << nodes_[kNodes]->Log();
  nodes_.pop_back();
}

// A 64 KiB ring: one GET's units from one owner (about 570 KB) overwrite each other's records
// before the reader reads them.
class ClusterTinyRingTest : public ClusterStagedTest {
 protected:
  uint64_t RingBytes() const override { return 64 << 10; }
};

TEST_F(ClusterTinyRingTest, ReusedSlotsFallBackToGetAndStayExact) {
  auto writer = Connect(0, "tok-alice");
  ASSERT_NE(writer, nullptr);
  auto want = PutSession(writer.get(), "tiny");
  for (int i = 0; i < kNodes; ++i) {
    auto reader = Connect(i, "tok-alice");
    ASSERT_NE(reader, nullptr);
    ExpectWholeSession(reader.get(), "tiny", want, i);
  }
  EXPECT_GT(Sum("kvtier_cluster_staged_get_reused_total"), 0);
  EXPECT_GE(Sum("kvtier_cluster_staged_get_fallback_units_total"),
            Sum("kvtier_cluster_staged_get_reused_total"));
  EXPECT_GT(Sum("kvtier_cluster_staging_ring_wraps_total"), 0);
}

}  // namespace
}  // namespace kvtier::cluster
