// Mutual TLS on peer traffic ([cluster] peer_tls) against real processes: etcd and three
// kvtierd whose peer fronts and peer calls all use TLS, with certificates made at test time
// (tests/cluster/peer_pki.h):
//   - a unit put through one node is read bit-exactly through every other, over TLS;
//   - a fourth node holding the credential but a certificate of another CA is refused by
//     every peer: it reads nothing through them, and they count the refusals.
#include "tests/cluster/cluster_fixture.h"
#include "tests/cluster/peer_pki.h"

namespace kvtier::cluster {
namespace {

class ClusterTlsTest : public ClusterE2eTest {
 protected:
  std::string ExtraClusterConfig(int i) override {
    if (pki_.ca_file.empty()) {
      EXPECT_TRUE(kt::MakePeerPki(dir_ / "pki", &pki_));
      // The outsider trusts both CAs: only the cluster's own check of its certificate keeps
      // it out.
      std::ofstream both(dir_ / "pki" / "both-cas.pem");
      both << std::ifstream(pki_.other_ca_file).rdbuf() << std::ifstream(pki_.ca_file).rdbuf();
    }
    bool other = i == kOtherCaNode;
    return "peer_tls = true\npeer_tls_cert_file = \"" +
           (other ? pki_.other_cert_file : pki_.cert_file) + "\"\npeer_tls_key_file = \"" +
           (other ? pki_.other_key_file : pki_.key_file) + "\"\npeer_tls_ca_file = \"" +
           (other ? (dir_ / "pki" / "both-cas.pem").string() : pki_.ca_file) + "\"\n";
  }
  double SumOverNodes(const std::string& metric, int nodes) {
    double sum = 0;
    for (int i = 0; i < nodes; ++i) sum += Metric(Metrics(i), metric);
    return sum;
  }
  static constexpr int kOtherCaNode = 3;
  kt::PeerPki pki_;
};

TEST_F(ClusterTlsTest, AUnitPutThroughOneNodeIsReadThroughEveryOther) {
  auto c0 = Connect(0, "tok-alice");
  ASSERT_NE(c0, nullptr);
  auto want = PutSession(c0.get(), "tls");
  for (int i = 1; i < kNodes; ++i) {
    auto c = Connect(i, "tok-alice");
    ASSERT_NE(c, nullptr);
    ExpectWholeSession(c.get(), "tls", want, i);
  }
  EXPECT_GT(SumOverNodes("kvtier_cluster_remote_get_hits_total", kNodes), 0);
  EXPECT_EQ(SumOverNodes("kvtier_cluster_peer_tls_failures_total", kNodes), 0);
  EXPECT_EQ(SumOverNodes("kvtier_cluster_peer_auth_failures_total", kNodes), 0);
}

TEST_F(ClusterTlsTest, APeerWithACertificateOfAnotherCaIsRefused) {
  auto c0 = Connect(0, "tok-alice");
  ASSERT_NE(c0, nullptr);
  auto want = PutSession(c0.get(), "other-ca");
  // n3 has the credential, the secrets and etcd, but its certificate is of another CA (it
  // trusts both CAs, so it would accept the cluster's nodes: they must refuse it).
  nodes_.push_back(std::make_unique<kt::KvtierdProcess>(dir_ / "n3"));
  peer_ports_.push_back(kt::FreePort());
  ASSERT_TRUE(StartNode(kOtherCaNode)) << nodes_[kOtherCaNode]->Log();
  ASSERT_TRUE(kt::WaitFor(
      [&] { return Metric(Metrics(kOtherCaNode), "kvtier_cluster_members") == 4; }, 10000));
  auto c3 = Connect(kOtherCaNode, "tok-alice");
  ASSERT_NE(c3, nullptr);
  auto chain = Chain("other-ca");
  auto hit = c3->Lookup(chain);
  ASSERT_TRUE(hit.ok()) << hit.status().message();
  EXPECT_EQ(hit->hit_count, 0u) << "n3 read through a peer that should have refused it";
  std::vector<std::vector<uint8_t>> got;
  std::vector<bool> found;
  ASSERT_TRUE(c3->GetCopy(chain, &got, &found).ok());
  EXPECT_EQ(std::count(found.begin(), found.end(), true), 0);
  EXPECT_TRUE(kt::WaitFor(
      [&] { return SumOverNodes("kvtier_cluster_peer_tls_failures_total", kNodes) > 0; }, 5000))
      << "the cluster's nodes never refused n3's certificate";
  EXPECT_GT(Metric(Metrics(kOtherCaNode), "kvtier_cluster_peer_errors_total"), 0);
  // The rest of the cluster still serves every unit (units do not move to n3: its copies fail).
  auto c1 = Connect(1, "tok-alice");
  ASSERT_NE(c1, nullptr);
  ExpectWholeSession(c1.get(), "other-ca", want, 1);
}

}  // namespace
}  // namespace kvtier::cluster
