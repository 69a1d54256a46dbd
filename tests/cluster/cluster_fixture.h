// Test fixture: a real etcd and three real kvtierd in cluster mode on loopback ports, all
// started and stopped by the fixture, with shared secrets and two tenants (alice, bob).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <memory>
#include <random>
#include <vector>

#include "cache_daemon/client.h"
#include "cluster/peer_client.h"
#include "common/key_spec.h"
#include "tests/cluster/etcd_process.h"
#include "tests/e2e/kvtierd_process.h"

namespace kvtier::cluster {

namespace kt = kvtier::testing;
using daemon::Client;
using daemon::ClientOptions;
using daemon::PutUnit;
using daemon::wire::Key;

constexpr int kNodes = 3;
constexpr int kUnits = 24;

inline Key ChainKey(const std::string& session, int i) {
  std::string s = "cluster-e2e-" + session + "-" + std::to_string(i);
  return Sha256(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size()));
}

// A metric's value from a /metrics page (-1 when absent).
inline double Metric(const std::string& page, const std::string& name) {
  size_t at = page.find("\n" + name + " ");
  if (at == std::string::npos) return -1;
  return std::stod(page.substr(at + name.size() + 2));
}

class ClusterE2eTest : public ::testing::Test {
 protected:
  // The cluster credential every node of the fixture shares (its file `credential`).
  static std::vector<uint8_t> Credential() { return std::vector<uint8_t>(40, 'c'); }
  // A peer client that talks to the nodes as peer "test", with the shared credential.
  static std::unique_ptr<PeerClient> TestPeerClient() {
    return std::make_unique<PeerClient>(
        PeerClientOptions{.node_id = "test", .credential = Credential(), .timeout_ms = 2000});
  }
  void SetUp() override {
    if (!kt::EtcdProcess::Installed()) GTEST_SKIP() << "no /usr/bin/etcd (deploy/install-deps.sh)";
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = info->name();  // "Case/Param" for a parameterized test: one directory
    std::replace(name.begin(), name.end(), '/', '_');
    dir_ = std::filesystem::temp_directory_path() /
           ("kvtier_cluster_" + std::to_string(getpid()) + "_" + name);
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    etcd_ = std::make_unique<kt::EtcdProcess>(dir_ / "etcd");
    etcd_->set_own_process_group(true);  // tests may pause it
    ASSERT_TRUE(etcd_->Start()) << "etcd did not start";
    // Shared by every node: the server secret (tenant salts must agree) and the cluster
    // credential (peer authentication). Both distinct, both 32+ bytes.
    std::ofstream(dir_ / "server_secret", std::ios::binary) << std::string(32, 's');
    const std::vector<uint8_t> credential = Credential();
    std::ofstream(dir_ / "credential", std::ios::binary)
        << std::string(credential.begin(), credential.end());
    std::ofstream(dir_ / "tokens.toml")
        << "[[tenant]]\nname = \"alice\"\nid = 1\n"
        << "token_sha256 = [\"" << TokenSha256Hex("tok-alice") << "\"]\n"
        << "[[tenant]]\nname = \"bob\"\nid = 2\n"
        << "token_sha256 = [\"" << TokenSha256Hex("tok-bob") << "\"]\n";
    for (int i = 0; i < kNodes; ++i) {
      nodes_.push_back(std::make_unique<kt::KvtierdProcess>(dir_ / ("n" + std::to_string(i))));
      nodes_.back()->set_own_process_group(true);  // the failover tests SIGSTOP nodes
      peer_ports_.push_back(kt::FreePort());
      ASSERT_TRUE(StartNode(i)) << nodes_[i]->Log();
    }
    ASSERT_TRUE(kt::WaitFor(
        [&] {
          for (int i = 0; i < kNodes; ++i) {
            if (Metric(Metrics(i), "kvtier_cluster_members") != kNodes) return false;
          }
          return true;
        },
        10000))
        << "members never agreed";
  }
  void TearDown() override {
    if (HasFailure()) {
      for (auto& n : nodes_)
        std::fprintf(stderr, "---- %s ----\n%s\n", n->dir().c_str(), n->Log().c_str());
    }
    nodes_.clear();
    etcd_.reset();
    if (HasFailure() && keep_dir_on_failure_) {
      std::fprintf(stderr, "kept the nodes' data and logs in %s\n", dir_.c_str());
    } else {
      std::filesystem::remove_all(dir_);
    }
  }

  // Node i's SSD capacity (its placement weight with the 16 MiB of DRAM); tests may vary it.
  virtual uint64_t SsdCapacityBytes(int /*i*/) const { return 268435456; }
  // Node i's DRAM tier (4 MiB slab pages: 16 MiB holds units of at most 4 size classes).
  virtual uint64_t DramCapacityBytes(int /*i*/) const { return 16777216; }
  // [cluster] lease_ttl_s: short, so that the failover tests see a stopped node leave soon.
  virtual uint32_t LeaseTtlS() const { return 2; }
  // [cluster] peer_timeout_ms.
  virtual uint64_t PeerTimeoutMs() const { return 2000; }
  // More [cluster] keys for node i ("key = value\n" lines); tests may add them.
  virtual std::string ExtraClusterConfig(int /*i*/) { return ""; }

  bool StartNode(int i) {
    std::string cfg = "[storage]\ndram_capacity_bytes = " + std::to_string(DramCapacityBytes(i)) +
                      "\nssd_capacity_bytes = " + std::to_string(SsdCapacityBytes(i)) +
                      "\n"
                      "ssd_segment_bytes = 16777216\ndurability = \"sync\"\n"
                      "[auth]\ntokens_file = \"" +
                      (dir_ / "tokens.toml").string() + "\"\nserver_secret_file = \"" +
                      (dir_ / "server_secret").string() +
                      "\"\n"
                      "[cluster]\nenabled = true\netcd_endpoints = [\"" +
                      etcd_->endpoint() +
                      "\"]\n"
                      "node_id = \"n" +
                      std::to_string(i) +
                      "\"\n"
                      "peer_listen = \"127.0.0.1:" +
                      std::to_string(peer_ports_[i]) +
                      "\"\n"
                      "failure_domain = \"rack" +
                      std::to_string(i) +
                      "\"\n"
                      "replicas = 2\nlease_ttl_s = " +
                      std::to_string(LeaseTtlS()) + "\netcd_timeout_ms = 500\npeer_timeout_ms = " +
                      std::to_string(PeerTimeoutMs()) +
                      "\n"
                      "credential_file = \"" +
                      (dir_ / "credential").string() + "\"\n" + ExtraClusterConfig(i);
    nodes_[i]->WriteConfig(cfg);
    return nodes_[i]->Start();
  }

  std::string Metrics(int i) { return kt::HttpRequest(nodes_[i]->http_port(), "GET", "/metrics"); }

  // Node i's repair is settled: no scan running, nothing short, nothing left to move. Node i
  // must be running (a stopped node's /metrics never answers).
  bool RepairSettled(int i) {
    std::string m = Metrics(i);
    return Metric(m, "kvtier_cluster_repair_active") == 0 &&
           Metric(m, "kvtier_cluster_under_replicated_units") == 0 &&
           Metric(m, "kvtier_cluster_moves_in_progress") == 0;
  }

  std::unique_ptr<Client> Connect(int i, const std::string& token) {
    auto c = Client::Connect(ClientOptions{.socket_path = nodes_[i]->socket(), .token = token});
    EXPECT_TRUE(c.ok()) << c.status().message();
    return c.ok() ? std::move(*c) : nullptr;
  }

  // kUnits units of distinct sizes and contents; returns their values.
  std::vector<std::vector<uint8_t>> PutSession(Client* c, const std::string& session,
                                               const daemon::PutOptions& options = {}) {
    std::mt19937 rng(42);
    std::vector<std::vector<uint8_t>> values(kUnits);
    std::vector<PutUnit> units(kUnits);
    for (int i = 0; i < kUnits; ++i) {
      values[i].resize(1000 + 3000 * i);
      for (auto& b : values[i]) b = static_cast<uint8_t>(rng());
      units[i].key = ChainKey(session, i);
      if (i > 0) units[i].parent = ChainKey(session, i - 1);
      units[i].value = values[i];
    }
    auto st = c->Put(units, options);
    EXPECT_TRUE(st.ok()) << st.status().message();
    if (st.ok()) {
      for (const auto& s : *st) EXPECT_TRUE(s.ok()) << s.message();
    }
    return values;
  }

  std::vector<Key> Chain(const std::string& session) {
    std::vector<Key> chain;
    for (int i = 0; i < kUnits; ++i) chain.push_back(ChainKey(session, i));
    return chain;
  }

  void ExpectWholeSession(Client* c, const std::string& session,
                          const std::vector<std::vector<uint8_t>>& want, int node) {
    auto chain = Chain(session);
    auto hit = c->Lookup(chain);
    ASSERT_TRUE(hit.ok()) << hit.status().message();
    EXPECT_EQ(hit->hit_count, static_cast<size_t>(kUnits)) << "node " << node;
    std::vector<std::vector<uint8_t>> got;
    std::vector<bool> found;
    ASSERT_TRUE(c->GetCopy(chain, &got, &found).ok());
    for (int i = 0; i < kUnits; ++i) {
      EXPECT_TRUE(found[i]) << "node " << node << " unit " << i;
      EXPECT_TRUE(got[i] == want[i]) << "node " << node << " unit " << i << " differs";
    }
  }

  std::filesystem::path dir_;
  std::unique_ptr<kt::EtcdProcess> etcd_;
  std::vector<std::unique_ptr<kt::KvtierdProcess>> nodes_;
  std::vector<uint16_t> peer_ports_;
  // A failed test leaves dir_ (etcd's and every node's data and logs) in place when set.
  bool keep_dir_on_failure_ = false;
};

}  // namespace kvtier::cluster
