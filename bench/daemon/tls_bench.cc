// kvtier_bench_tls: what TLS on kvtierd's TCP fronts costs, measured in the same run.
//
// Starts two kvtierd processes with the same configuration (4 GiB DRAM tier, no SSD, 2 I/O
// + 2 worker threads), one with [tls] native = resp = true (a throwaway certificate made in a
// temporary directory), one without, and for each round, alternating between them:
//   1. native protocol over TCP through the client library: GET of 57,000-byte units
//      (batches of 32, native_mib MiB per round, put once before the rounds); prints GB/s,
//      kvtierd CPU µs per unit (all its threads, /proc/<pid>/task/*/schedstat) and this
//      process's CPU µs per unit (the client, including its TLS tunnel thread);
//   2. RESP: redis-benchmark -t get -d 57000 -c 16 -P 16 (with --tls --cacert for the TLS
//      daemon), when redis-benchmark is installed and supports --tls.
// Prints the medians and the ratio TLS / plaintext. Reports only; asserts nothing.
//
// Usage: kvtier_bench_tls [native_mib=256] [rounds=3] [resp_requests=10000]
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include "bench/daemon/proc_stats.h"
#include "cache_daemon/client.h"
#include "tests/cache_daemon/net_util.h"
#include "tests/cache_daemon/tls_test_util.h"
#include "tests/e2e/kvtierd_process.h"

namespace kt = kvtier::testing;
using namespace kvtier::daemon;

using kvtier::bench::CpuNs;
using kvtier::bench::Median;
using kvtier::bench::PidWithArg;

namespace {

constexpr size_t kUnitBytes = 57000;
constexpr size_t kBatch = 32;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

uint64_t SelfCpuNs() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto ns = [](const timeval& t) { return uint64_t(t.tv_sec) * 1000000000ull + t.tv_usec * 1000; };
  return ns(u.ru_utime) + ns(u.ru_stime);
}

struct Server {
  std::unique_ptr<kt::KvtierdProcess> proc;
  uint16_t native_port = 0;
  pid_t pid = -1;
  bool tls = false;
};

std::unique_ptr<Client> Connect(const Server& s, const std::string& ca) {
  ClientOptions o;
  o.tcp_host = "127.0.0.1";
  o.tcp_port = s.native_port;
  o.tls = s.tls;
  o.tls_ca_file = ca;
  auto c = Client::Connect(o);
  if (!c.ok()) {
    std::fprintf(stderr, "connect: %s\n", c.status().ToString().c_str());
    return nullptr;
  }
  return std::move(c).value();
}

std::vector<wire::Key> Keys(size_t units) {
  std::vector<wire::Key> keys(units);
  for (size_t i = 0; i < units; ++i) {
    keys[i][0] = 7;
    std::memcpy(keys[i].data() + 1, &i, sizeof(i));
  }
  return keys;
}

struct GetResult {
  double gbs = 0, server_us_per_unit = 0, client_us_per_unit = 0;
};

GetResult GetRound(const Server& s, Client* c, const std::vector<wire::Key>& keys) {
  uint64_t s0 = CpuNs(s.pid), c0 = SelfCpuNs();
  double t0 = Now();
  uint64_t sum = 0, hits = 0;
  for (size_t i = 0; i < keys.size(); i += kBatch) {
    size_t n = std::min(kBatch, keys.size() - i);
    kvtier::Status st =
        c->Get(std::span<const wire::Key>(keys).subspan(i, n), [&](size_t, const GetItem& g) {
          if (!g.status.ok()) return;
          ++hits;
          sum += g.value[g.value.size() / 2];
        });
    if (!st.ok()) std::fprintf(stderr, "get: %s\n", st.ToString().c_str());
  }
  double t1 = Now();
  uint64_t s1 = CpuNs(s.pid), c1 = SelfCpuNs();
  if (hits != keys.size()) std::fprintf(stderr, "only %lu of %zu hit\n", hits, keys.size());
  GetResult r;
  r.gbs = keys.size() * kUnitBytes / (t1 - t0) / 1e9;
  r.server_us_per_unit = (s1 - s0) / 1e3 / keys.size();
  r.client_us_per_unit = (c1 - c0) / 1e3 / keys.size();
  (void)sum;
  return r;
}

// redis-benchmark GET ops/s (after its own SET of the key), or 0.
double RespGet(uint16_t port, bool tls, const std::string& ca, int requests) {
  std::string out;
  kt::RunShell("redis-benchmark -h 127.0.0.1 -p " + std::to_string(port) +
                   (tls ? " --tls --cacert " + ca : std::string()) + " -n " +
                   std::to_string(requests) + " -c 16 -P 16 -d 57000 -t set,get --csv",
               &out);
  std::istringstream lines(out);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind("\"GET\",\"", 0) != 0) continue;
    try {
      return std::stod(line.substr(7));
    } catch (...) {
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  size_t native_bytes = (argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 256) << 20;
  int rounds = std::max(1, argc > 2 ? std::atoi(argv[2]) : 3);
  int resp_requests = argc > 3 ? std::atoi(argv[3]) : 10000;
  auto dir =
      std::filesystem::temp_directory_path() / ("kvtier_tls_bench_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  kt::TestPki pki;
  if (!kt::MakeTestPki(dir / "pki", &pki)) {
    std::fprintf(stderr, "cannot make a test certificate\n");
    return 1;
  }
  const std::string base =
      "[storage]\ndram_capacity_bytes = 4294967296\nssd_capacity_bytes = 0\n"
      "[server]\nio_threads = 2\nworker_threads = 2\n";
  Server servers[2];  // 0 plaintext, 1 TLS
  for (int i = 0; i < 2; ++i) {
    Server& s = servers[i];
    s.tls = i == 1;
    s.proc = std::make_unique<kt::KvtierdProcess>(dir / (s.tls ? "tls" : "plain"));
    s.native_port = kt::FreePort();
    s.proc->WriteConfig(base +
                        (s.tls ? "[tls]\ncert_file = \"" + pki.cert_file + "\"\nkey_file = \"" +
                                     pki.key_file + "\"\nnative = true\nresp = true\n"
                               : std::string()));
    if (!s.proc->Start({"--native-port", std::to_string(s.native_port)})) {
      std::fprintf(stderr, "kvtierd did not start:\n%s\n", s.proc->Log().c_str());
      return 1;
    }
    s.pid = PidWithArg(s.proc->socket());
  }
  const size_t units = native_bytes / kUnitBytes;
  const std::vector<wire::Key> keys = Keys(units);
  std::vector<uint8_t> value(kUnitBytes, 0x5a);
  std::unique_ptr<Client> clients[2];
  for (int i = 0; i < 2; ++i) {
    // Give the TCP listeners a moment after the Unix socket answered.
    for (int t = 0; t < 100 && clients[i] == nullptr; ++t) {
      clients[i] = Connect(servers[i], pki.ca_file);
      if (clients[i] == nullptr) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (clients[i] == nullptr) return 1;
    for (size_t k = 0; k < units; k += kBatch) {
      std::vector<PutUnit> batch;
      for (size_t j = k; j < std::min(units, k + kBatch); ++j)
        batch.push_back({keys[j], {}, value});
      auto p = clients[i]->Put(batch, PutOptions{});
      if (!p.ok()) std::fprintf(stderr, "put: %s\n", p.status().ToString().c_str());
    }
  }
  std::vector<double> gbs[2], srv[2], cli[2], resp[2];
  bool have_resp = kt::RunShell("redis-benchmark --help 2>&1 | grep -q -- --tls") == 0;
  for (int round = 0; round < rounds; ++round) {
    for (int i = 0; i < 2; ++i) {
      GetResult r = GetRound(servers[i], clients[i].get(), keys);
      gbs[i].push_back(r.gbs);
      srv[i].push_back(r.server_us_per_unit);
      cli[i].push_back(r.client_us_per_unit);
      if (have_resp) {
        resp[i].push_back(
            RespGet(servers[i].proc->resp_port(), servers[i].tls, pki.ca_file, resp_requests));
      }
    }
  }
  std::printf(
      "== native protocol over TCP, GET of 57000-byte units, batches of 32, %zu MiB per "
      "round, %d round(s), medians ==\n",
      native_bytes >> 20, rounds);
  std::printf("%-10s %10s %22s %22s\n", "transport", "GET GB/s", "kvtierd CPU us/unit",
              "client CPU us/unit");
  const char* names[2] = {"plaintext", "TLS"};
  for (int i = 0; i < 2; ++i) {
    std::printf("%-10s %10.3f %22.2f %22.2f\n", names[i], Median(gbs[i]), Median(srv[i]),
                Median(cli[i]));
  }
  std::printf("ratio TLS / plaintext: GET throughput %.2f, kvtierd CPU %.2f, client CPU %.2f\n",
              Median(gbs[1]) / Median(gbs[0]), Median(srv[1]) / Median(srv[0]),
              Median(cli[1]) / Median(cli[0]));
  if (have_resp) {
    std::printf(
        "\n== RESP: redis-benchmark -n %d -c 16 -P 16 -d 57000 -t set,get, GET ops/s, "
        "medians ==\n",
        resp_requests);
    std::printf("plaintext %.0f  TLS %.0f  ratio %.2f\n", Median(resp[0]), Median(resp[1]),
                Median(resp[0]) > 0 ? Median(resp[1]) / Median(resp[0]) : 0.0);
  } else {
    std::printf("\n(redis-benchmark with --tls not installed: RESP not measured)\n");
  }
  clients[0].reset();
  clients[1].reset();
  int rc = servers[0].proc->Stop() | servers[1].proc->Stop();
  std::filesystem::remove_all(dir);
  return rc == 0 ? 0 : 1;
}
