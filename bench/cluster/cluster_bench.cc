// kvtier_bench_cluster, in one run:
//  1. GET of a unit served by a peer (cross-node) against the same GET served locally. Starts
//     a real etcd and two kvtierd in cluster mode on loopback (R = 1): node A joins alone and
//     takes every unit, then node B joins draining ([cluster] draining: it owns nothing, so no
//     unit moves); the same units read through A are local, read through B each one is
//     fetched from A over the peer protocol.
//  2. Time to restore R after a node loss: three more kvtierd (R = 2, 2 s leases, their own
//     key prefix), units put through the first, kill -9 of the third; the time until every
//     unit is again on two live nodes (each node's own store asked over the peer protocol,
//     every 20 ms), the units and bytes the survivors copied, and the copy rate against
//     repair_bytes_per_s and against the cross-node GET rate of phase 1.
//
//     Phase 1 runs four times: with plain TCP between the nodes, then with [cluster] peer_tls
//     (mutual TLS, certificates made at start in the temporary directory), then plain with
//     GET copies on ([cluster] get_copy_bytes_max on B: its first round fetches and keeps
//     copies, later rounds are served from them; docs/CLUSTER.md "Copies"), then with
//     [cluster] peer_data_transport = "tcp_region" (B reads each unit from A's staging region
//     over rdma::TcpTransport; docs/CLUSTER.md "Bulk data over the region transport").
//
//   kvtier_bench_cluster [MiB per round] [rounds] [restore MiB] [repair bytes/s]
//   (defaults 128 3 64 67108864)
#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "cache_daemon/client.h"
#include "cluster/peer_client.h"
#include "common/key_spec.h"
#include "common/temp_dir.h"
#include "tests/cluster/etcd_process.h"
#include "tests/cluster/peer_pki.h"
#include "tests/e2e/kvtierd_process.h"

namespace kt = kvtier::testing;
using kvtier::daemon::Client;
using kvtier::daemon::ClientOptions;
using kvtier::daemon::PutUnit;
using kvtier::daemon::wire::Key;

namespace {

constexpr size_t kUnitBytes = 57000;
constexpr size_t kBatch = 32;

Key UnitKey(size_t i) {
  std::string s = "cluster-bench-" + std::to_string(i);
  return kvtier::Sha256(
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size()));
}

double Metric(const std::string& page, const std::string& name) {
  size_t at = page.find("\n" + name + " ");
  return at == std::string::npos ? -1 : std::stod(page.substr(at + name.size() + 2));
}

// Puts units 0..units-1 in batches, each a kUnitBytes value drawn from seed; false on an error.
bool PutUnits(Client* c, size_t units, uint32_t seed) {
  std::vector<uint8_t> value(kUnitBytes);
  std::mt19937 rng(seed);
  for (auto& b : value) b = static_cast<uint8_t>(rng());
  for (size_t first = 0; first < units; first += kBatch) {
    std::vector<PutUnit> batch;
    for (size_t i = first; i < std::min(units, first + kBatch); ++i) {
      batch.push_back(PutUnit{.key = UnitKey(i), .value = value});
    }
    if (!c->Put(batch, {}).ok()) return false;
  }
  return true;
}

// Reads every unit once in batches; returns GB/s, or -1 on any miss.
double ReadAll(Client* c, size_t units) {
  auto t0 = std::chrono::steady_clock::now();
  size_t bytes = 0;
  std::vector<Key> keys;
  for (size_t first = 0; first < units; first += kBatch) {
    keys.clear();
    for (size_t i = first; i < std::min(units, first + kBatch); ++i) keys.push_back(UnitKey(i));
    bool ok = true;
    kvtier::Status s = c->Get(keys, [&](size_t, const kvtier::daemon::GetItem& g) {
      if (!g.status.ok()) ok = false;
      bytes += g.value.size();
    });
    if (!s.ok() || !ok) return -1;
  }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return bytes / secs / 1e9;
}

// Copies of each storage key on the given peers (their own stores; a peer LOOKUP is never
// forwarded). Empty on an error.
std::vector<int> Copies(kvtier::cluster::PeerClient* peers, const std::vector<std::string>& eps,
                        const std::vector<kvtier::cluster::PeerKey>& keys) {
  std::vector<int> copies(keys.size(), 0);
  for (const auto& ep : eps) {
    for (size_t first = 0; first < keys.size(); first += 4096) {
      size_t n = std::min<size_t>(4096, keys.size() - first);
      auto tiers =
          peers->Lookup(ep, std::span<const kvtier::cluster::PeerKey>(keys).subspan(first, n));
      if (!tiers.ok()) return {};
      for (size_t i = 0; i < n; ++i) copies[first + i] += (*tiers)[i] != 255 ? 1 : 0;
    }
  }
  return copies;
}

// Phase 2 (see the file comment). get_gbps: phase 1's cross-node GET rate.
int Restore(const std::filesystem::path& root, kt::EtcdProcess& etcd, size_t mib,
            uint64_t repair_bytes_per_s, double get_gbps) {
  size_t units = std::max<size_t>(1, (mib << 20) / kUnitBytes);
  std::vector<std::unique_ptr<kt::KvtierdProcess>> nodes;
  std::vector<std::string> peer_eps;
  for (int i = 0; i < 3; ++i) {
    nodes.push_back(std::make_unique<kt::KvtierdProcess>(root / ("r" + std::to_string(i))));
    peer_eps.push_back("127.0.0.1:" + std::to_string(kt::FreePort()));
    nodes[i]->WriteConfig(
        "[server]\nio_threads = 2\nworker_threads = 2\n"
        "[storage]\ndram_capacity_bytes = 2147483648\nssd_capacity_bytes = 0\n"
        "[auth]\nserver_secret_file = \"" +
        (root / "secret").string() + "\"\n[cluster]\nenabled = true\netcd_endpoints = [\"" +
        etcd.endpoint() + "\"]\nkey_prefix = \"/restore/\"\nnode_id = \"r" + std::to_string(i) +
        "\"\npeer_listen = \"" + peer_eps[i] +
        "\"\nreplicas = 2\nlease_ttl_s = 2\nrepair_bytes_per_s = " +
        std::to_string(repair_bytes_per_s) + "\ncredential_file = \"" +
        (root / "credential").string() + "\"\n");
    if (!nodes[i]->Start()) {
      std::fprintf(stderr, "restore node %d did not start: %s\n", i, nodes[i]->Log().c_str());
      return 1;
    }
  }
  auto metric = [&](int i, const char* name) {
    return Metric(kt::HttpRequest(nodes[i]->http_port(), "GET", "/metrics"), name);
  };
  if (!kt::WaitFor(
          [&] {
            return metric(0, "kvtier_cluster_members") == 3 &&
                   metric(1, "kvtier_cluster_members") == 3 &&
                   metric(2, "kvtier_cluster_members") == 3;
          },
          10000)) {
    std::fprintf(stderr, "restore nodes did not agree\n");
    return 1;
  }
  auto a = Client::Connect(ClientOptions{.socket_path = nodes[0]->socket()});
  if (!a.ok()) return 1;
  if (!PutUnits(a->get(), units, 2)) return 1;
  std::string secret(32, 's');
  kvtier::Digest salt = kvtier::TenantSalt(
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(secret.data()), secret.size()),
      "default");
  std::vector<kvtier::cluster::PeerKey> keys;
  for (size_t i = 0; i < units; ++i) keys.push_back(kvtier::StorageKey(salt, UnitKey(i)));
  kvtier::cluster::PeerClient peers(kvtier::cluster::PeerClientOptions{
      .node_id = "bench", .credential = std::vector<uint8_t>(32, 'c'), .timeout_ms = 5000});
  auto on_two = [&](const std::vector<std::string>& eps) {
    auto c = Copies(&peers, eps, keys);
    return !c.empty() && std::all_of(c.begin(), c.end(), [](int n) { return n == 2; });
  };
  if (!on_two(peer_eps)) {
    std::fprintf(stderr, "units not on two nodes after the puts\n");
    return 1;
  }
  auto lost = Copies(&peers, {peer_eps[2]}, keys);
  size_t on_lost = std::count(lost.begin(), lost.end(), 1);
  double units0 = metric(0, "kvtier_cluster_repair_units_total") +
                  metric(1, "kvtier_cluster_repair_units_total");
  double bytes0 = metric(0, "kvtier_cluster_repair_bytes_total") +
                  metric(1, "kvtier_cluster_repair_bytes_total");
  auto t_kill = std::chrono::steady_clock::now();
  nodes[2]->Signal(SIGKILL);
  auto since_kill = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t_kill).count();
  };
  if (!kt::WaitFor(
          [&] {
            return metric(0, "kvtier_cluster_members") == 2 &&
                   metric(1, "kvtier_cluster_members") == 2;
          },
          10000)) {
    std::fprintf(stderr, "the loss was never noticed\n");
    return 1;
  }
  double t_detect = since_kill();
  std::vector<std::string> survivors = {peer_eps[0], peer_eps[1]};
  if (!kt::WaitFor([&] { return on_two(survivors); }, 600000)) {
    std::fprintf(stderr, "R not restored within 10 minutes\n");
    return 1;
  }
  double t_restored = since_kill();
  double copied_units = metric(0, "kvtier_cluster_repair_units_total") +
                        metric(1, "kvtier_cluster_repair_units_total") - units0;
  double copied_bytes = metric(0, "kvtier_cluster_repair_bytes_total") +
                        metric(1, "kvtier_cluster_repair_bytes_total") - bytes0;
  double repair_s = t_restored - t_detect;
  double rate = copied_bytes / repair_s;
  std::printf("restore: %zu units x %zu bytes, R = 2, 3 nodes, kill -9 of one holding %zu\n", units,
              kUnitBytes, on_lost);
  std::printf("loss noticed (lease expired)  %.2f s after the kill\n", t_detect);
  std::printf("R restored                    %.2f s after the kill (%.2f s of repair)\n",
              t_restored, repair_s);
  std::printf("copied                        %.0f units, %.0f bytes\n", copied_units, copied_bytes);
  std::printf(
      "repair rate                   %.1f MB/s = %.2f x repair_bytes_per_s (%.1f MB/s, "
      "2 senders), %.3f x cross-node GET\n",
      rate / 1e6, rate / static_cast<double>(repair_bytes_per_s), repair_bytes_per_s / 1e6,
      rate / (get_gbps * 1e9));
  return 0;
}

// Phase 1 (see the file comment) with nodes of their own key prefix: plain TCP between the
// nodes, or mutual TLS with certificates from pki (tls). Fills the median local and
// cross-node GB/s; false on an error.
// copies: B keeps GET copies; *first_remote_gbps is its first round's cross-node rate.
bool CrossNodeGet(const std::filesystem::path& root, kt::EtcdProcess& etcd, size_t units,
                  int rounds, const kt::PeerPki* tls, bool copies, double* local_gbps,
                  double* remote_gbps, double* first_remote_gbps = nullptr, bool region = false) {
  const std::string name = tls != nullptr ? "tls" : copies ? "copies" : region ? "region" : "plain";
  std::string tls_keys = copies ? "get_copy_bytes_max = 2147483648\n" : "";
  if (region) tls_keys += "peer_data_transport = \"tcp_region\"\n";
  if (tls != nullptr) {
    tls_keys += "peer_tls = true\npeer_tls_cert_file = \"" + tls->cert_file +
                "\"\npeer_tls_key_file = \"" + tls->key_file + "\"\npeer_tls_ca_file = \"" +
                tls->ca_file + "\"\n";
  }
  std::vector<std::unique_ptr<kt::KvtierdProcess>> nodes;
  for (int i = 0; i < 2; ++i) {
    nodes.push_back(std::make_unique<kt::KvtierdProcess>(root / (name + "-n" + std::to_string(i))));
    nodes[i]->WriteConfig(
        "[server]\nio_threads = 2\nworker_threads = 2\n"
        "[storage]\ndram_capacity_bytes = 4294967296\nssd_capacity_bytes = 0\n"
        "[auth]\nserver_secret_file = \"" +
        (root / "secret").string() +
        "\"\n"
        "[cluster]\nenabled = true\netcd_endpoints = [\"" +
        etcd.endpoint() + "\"]\nkey_prefix = \"/" + name + "/\"\nnode_id = \"n" +
        std::to_string(i) + "\"\npeer_listen = \"127.0.0.1:" + std::to_string(kt::FreePort()) +
        "\"\nreplicas = 1\n" + (i == 1 ? "draining = true\n" : "") + "credential_file = \"" +
        (root / "credential").string() + "\"\n" + tls_keys);
  }
  auto members = [&](int i) {
    return Metric(kt::HttpRequest(nodes[i]->http_port(), "GET", "/metrics"),
                  "kvtier_cluster_members");
  };
  if (!nodes[0]->Start() || !kt::WaitFor([&] { return members(0) == 1; }, 10000)) {
    std::fprintf(stderr, "node A did not start: %s\n", nodes[0]->Log().c_str());
    return false;
  }
  auto a = Client::Connect(ClientOptions{.socket_path = nodes[0]->socket()});
  if (!a.ok()) return false;
  if (!PutUnits(a->get(), units, 1)) return false;
  if (!nodes[1]->Start() ||
      !kt::WaitFor([&] { return members(0) == 2 && members(1) == 2; }, 10000)) {
    std::fprintf(stderr, "node B did not join: %s\n", nodes[1]->Log().c_str());
    return false;
  }
  auto b = Client::Connect(ClientOptions{.socket_path = nodes[1]->socket()});
  if (!b.ok()) return false;
  std::vector<double> local, remote;
  for (int r = 0; r < rounds; ++r) {
    local.push_back(ReadAll(a->get(), units));
    remote.push_back(ReadAll(b->get(), units));
    std::printf("%s round %d: local %.3f GB/s, cross-node %.3f GB/s\n", name.c_str(), r,
                local.back(), remote.back());
  }
  if (first_remote_gbps != nullptr) *first_remote_gbps = remote.front();
  if (copies) {
    const std::string m = kt::HttpRequest(nodes[1]->http_port(), "GET", "/metrics");
    std::printf("copies: B kept %.0f, served %.0f GET hits from them, fetched %.0f\n",
                Metric(m, "kvtier_cluster_copy_kept_total"),
                Metric(m, "kvtier_cluster_copy_hits_total"),
                Metric(m, "kvtier_cluster_remote_get_hits_total"));
    remote.erase(remote.begin());  // the median of the rounds served from the copies
    if (remote.empty()) remote.push_back(-1);
  }
  if (region) {
    const std::string m = kt::HttpRequest(nodes[1]->http_port(), "GET", "/metrics");
    const double staged = Metric(m, "kvtier_cluster_staged_get_units_total");
    const double fallback = Metric(m, "kvtier_cluster_staged_get_fallback_units_total");
    std::printf("region: B read %.0f units over the staging region, %.0f by the GET fallback\n",
                staged, fallback);
    if (staged <= 0 || fallback != 0) return false;
  }
  std::sort(local.begin(), local.end());
  std::sort(remote.begin(), remote.end());
  *local_gbps = local[local.size() / 2];
  *remote_gbps = remote[remote.size() / 2];
  return *local_gbps > 0 && *remote_gbps > 0;
}

}  // namespace

int main(int argc, char** argv) {
  size_t mib = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 128;
  int rounds = argc > 2 ? std::atoi(argv[2]) : 3;
  size_t restore_mib = argc > 3 ? std::strtoul(argv[3], nullptr, 10) : 64;
  uint64_t repair_bytes_per_s = argc > 4 ? std::strtoull(argv[4], nullptr, 10) : 64ull << 20;
  size_t units = std::max<size_t>(1, (mib << 20) / kUnitBytes);
  if (!kt::EtcdProcess::Installed()) {
    std::fprintf(stderr, "no /usr/bin/etcd\n");
    return 1;
  }
  kvtier::TempDir dir("kvtier-cluster-bench-");
  std::filesystem::path root = dir.path();
  std::ofstream(root / "secret", std::ios::binary) << std::string(32, 's');
  std::ofstream(root / "credential", std::ios::binary) << std::string(32, 'c');
  kt::PeerPki pki;
  if (!kt::MakePeerPki(root / "pki", &pki)) {
    std::fprintf(stderr, "cannot make the test certificates\n");
    return 1;
  }
  kt::EtcdProcess etcd(root / "etcd");
  if (!etcd.Start()) {
    std::fprintf(stderr, "etcd did not start\n");
    return 1;
  }
  double l = 0, x = 0, lt = 0, xt = 0, lc = 0, xc = 0, xc0 = 0, lr = 0, xr = 0;
  if (!CrossNodeGet(root, etcd, units, rounds, nullptr, false, &l, &x)) return 1;
  if (!CrossNodeGet(root, etcd, units, rounds, &pki, false, &lt, &xt)) return 1;
  if (!CrossNodeGet(root, etcd, units, std::max(rounds, 2), nullptr, true, &lc, &xc, &xc0)) {
    return 1;
  }
  if (!CrossNodeGet(root, etcd, units, rounds, nullptr, false, &lr, &xr, nullptr, true)) return 1;
  std::printf("units %zu x %zu bytes, batches of %zu, median of %d rounds\n", units, kUnitBytes,
              kBatch, rounds);
  std::printf(
      "local GET                %.3f GB/s\ncross-node GET           %.3f GB/s\n"
      "ratio                    %.2f\n",
      l, x, x / l);
  std::printf(
      "local GET (TLS nodes)    %.3f GB/s\ncross-node GET over TLS  %.3f GB/s\n"
      "ratio                    %.2f\nTLS / plain cross-node   %.2f\n",
      lt, xt, xt / lt, xt / x);
  std::printf(
      "local GET (copy nodes)   %.3f GB/s\nthrough B, first round   %.3f GB/s (fetch + keep)\n"
      "through B, from copies   %.3f GB/s (median of the later rounds)\n"
      "copies / local           %.2f\ncopies / plain cross-node %.2f\n",
      lc, xc0, xc, xc / lc, xc / x);
  std::printf(
      "local GET (region nodes) %.3f GB/s\ncross-node GET, region   %.3f GB/s (tcp_region)\n"
      "ratio                    %.2f\nregion / plain cross-node %.2f\n",
      lr, xr, xr / lr, xr / x);
  return Restore(root, etcd, restore_mib, repair_bytes_per_s, x);
}
