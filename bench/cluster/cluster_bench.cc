// kvtier_bench_cluster: GET of a unit served by a peer (cross-node) against the same GET
// served locally, in one run. Starts a real etcd and two kvtierd in cluster mode on loopback
// (R = 1): node A joins alone and takes every unit, then node B joins; the same units read
// through A are local, read through B each one is fetched from A over the peer protocol.
//
//   kvtier_bench_cluster [MiB per round] [rounds]     (defaults 128 3)
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "cache_daemon/client.h"
#include "common/key_spec.h"
#include "common/temp_dir.h"
#include "tests/cluster/etcd_process.h"
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

}  // namespace

int main(int argc, char** argv) {
  size_t mib = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 128;
  int rounds = argc > 2 ? std::atoi(argv[2]) : 3;
  size_t units = std::max<size_t>(1, (mib << 20) / kUnitBytes);
  if (!kt::EtcdProcess::Installed()) {
    std::fprintf(stderr, "no /usr/bin/etcd\n");
    return 1;
  }
  kvtier::TempDir dir("kvtier-cluster-bench-");
  std::filesystem::path root = dir.path();
  std::ofstream(root / "secret", std::ios::binary) << std::string(32, 's');
  std::ofstream(root / "credential", std::ios::binary) << std::string(32, 'c');
  kt::EtcdProcess etcd(root / "etcd");
  if (!etcd.Start()) {
    std::fprintf(stderr, "etcd did not start\n");
    return 1;
  }
  std::vector<std::unique_ptr<kt::KvtierdProcess>> nodes;
  for (int i = 0; i < 2; ++i) {
    nodes.push_back(std::make_unique<kt::KvtierdProcess>(root / ("n" + std::to_string(i))));
    nodes[i]->WriteConfig(
        "[server]\nio_threads = 2\nworker_threads = 2\n"
        "[storage]\ndram_capacity_bytes = 4294967296\nssd_capacity_bytes = 0\n"
        "[auth]\nserver_secret_file = \"" +
        (root / "secret").string() +
        "\"\n"
        "[cluster]\nenabled = true\netcd_endpoints = [\"" +
        etcd.endpoint() +
        "\"]\n"
        "node_id = \"n" +
        std::to_string(i) + "\"\npeer_listen = \"127.0.0.1:" + std::to_string(kt::FreePort()) +
        "\"\nreplicas = 1\n"
        "credential_file = \"" +
        (root / "credential").string() + "\"\n");
  }
  auto members = [&](int i) {
    return Metric(kt::HttpRequest(nodes[i]->http_port(), "GET", "/metrics"),
                  "kvtier_cluster_members");
  };
  if (!nodes[0]->Start() || !kt::WaitFor([&] { return members(0) == 1; }, 10000)) {
    std::fprintf(stderr, "node A did not start: %s\n", nodes[0]->Log().c_str());
    return 1;
  }
  auto a = Client::Connect(ClientOptions{.socket_path = nodes[0]->socket()});
  if (!a.ok()) return 1;
  std::vector<uint8_t> value(kUnitBytes);
  std::mt19937 rng(1);
  for (auto& b : value) b = static_cast<uint8_t>(rng());
  for (size_t first = 0; first < units; first += kBatch) {
    std::vector<PutUnit> batch;
    for (size_t i = first; i < std::min(units, first + kBatch); ++i) {
      batch.push_back(PutUnit{.key = UnitKey(i), .value = value});
    }
    auto st = (*a)->Put(batch, {});
    if (!st.ok()) return 1;
  }
  if (!nodes[1]->Start() ||
      !kt::WaitFor([&] { return members(0) == 2 && members(1) == 2; }, 10000)) {
    std::fprintf(stderr, "node B did not join\n");
    return 1;
  }
  auto b = Client::Connect(ClientOptions{.socket_path = nodes[1]->socket()});
  if (!b.ok()) return 1;
  std::vector<double> local, remote;
  for (int r = 0; r < rounds; ++r) {
    local.push_back(ReadAll(a->get(), units));
    remote.push_back(ReadAll(b->get(), units));
    std::printf("round %d: local %.3f GB/s, cross-node %.3f GB/s\n", r, local.back(),
                remote.back());
  }
  std::sort(local.begin(), local.end());
  std::sort(remote.begin(), remote.end());
  double l = local[local.size() / 2], x = remote[remote.size() / 2];
  std::printf("units %zu x %zu bytes, batches of %zu, median of %d rounds\n", units, kUnitBytes,
              kBatch, rounds);
  std::printf("local GET      %.3f GB/s\ncross-node GET %.3f GB/s\nratio          %.2f\n", l, x,
              x / l);
  return l > 0 && x > 0 ? 0 : 1;
}
