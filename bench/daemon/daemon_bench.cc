// kvtier_bench_daemon: kvtierd against its peers, measured in the same run.
//
//  1. RESP: redis-benchmark against kvtierd's RESP port and against redis-server (both on free
//     loopback ports, started here), values of 57,000 bytes (one miniature 256-token unit) and
//     1,024 bytes, SET and GET; prints ops/s of each and the ratio kvtierd / redis-server.
//     With rounds > 1 each value size is measured that many times, kvtierd and redis-server
//     alternating, and the median of each column is printed. Alongside ops/s it prints the
//     CPU time each server spent per request (set+get together, summed over all its threads
//     from /proc/<pid>/task/*/schedstat): throughput on a shared, loaded machine is noisy,
//     CPU per request much less so.
//  2. Native: the client library's PUT and GET throughput over the Unix socket with shared
//     memory and inline (no shared memory), against an in-process memcpy of the same bytes,
//     and the CPU seconds kvtierd (all threads) and this client spent in each phase.
//
// Usage: kvtier_bench_daemon [requests_per_resp_run=20000] [native_mib=512] [rounds=1]
//                            [kvtierd_config_fragment]
// Needs redis-server and redis-benchmark on PATH. Reports only; asserts nothing.
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

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
#include "tests/e2e/kvtierd_process.h"
#include "tests/e2e/redis_server.h"

namespace kt = kvtier::testing;
using namespace kvtier::daemon;

using kvtier::bench::CpuNs;
using kvtier::bench::Median;
using kvtier::bench::PidWithArg;

namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Runs redis-benchmark --csv and returns ops/s per test name ("SET", "GET").
std::map<std::string, double> RedisBenchmark(uint16_t port, size_t value_bytes, int requests) {
  std::string out;
  kt::RunShell("redis-benchmark -p " + std::to_string(port) + " -n " + std::to_string(requests) +
                   " -c 16 -P 16 -d " + std::to_string(value_bytes) + " -t set,get --csv",
               &out);
  std::map<std::string, double> r;
  std::istringstream lines(out);
  std::string line;
  while (std::getline(lines, line)) {
    // "SET","12345.67",...
    if (line.size() < 5 || line[0] != '"') continue;
    size_t q = line.find('"', 1);
    std::string name = line.substr(1, q - 1);
    size_t v0 = line.find('"', q + 1);
    size_t v1 = line.find('"', v0 + 1);
    if (v0 == std::string::npos || v1 == std::string::npos) continue;
    try {
      r[name] = std::stod(line.substr(v0 + 1, v1 - v0 - 1));
    } catch (...) {
    }
  }
  return r;
}

struct NativeResult {
  double put_gbs = 0, get_gbs = 0;
  double put_server_cpu_s = 0, put_client_cpu_s = 0, get_server_cpu_s = 0, get_client_cpu_s = 0;
};

// CPU seconds of this process (the client: the native phases run after redis-benchmark).
double ClientCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

NativeResult NativeRun(const std::string& socket, pid_t kvtierd, bool shm, size_t total_bytes) {
  constexpr size_t kUnit = 57000, kBatch = 32;
  ClientOptions o;
  o.socket_path = socket;
  o.shm_bytes = shm ? (64u << 20) : 0;
  auto c = Client::Connect(o);
  if (!c.ok()) {
    std::fprintf(stderr, "connect: %s\n", c.status().ToString().c_str());
    return {};
  }
  size_t units = total_bytes / kUnit;
  std::vector<uint8_t> value(kUnit, shm ? 0x5a : 0xa5);
  std::vector<wire::Key> keys(units);
  for (size_t i = 0; i < units; ++i) {
    keys[i][0] = shm ? 1 : 2;
    std::memcpy(keys[i].data() + 1, &i, sizeof(i));
  }
  NativeResult r;
  const uint64_t k0 = CpuNs(kvtierd);
  const double c0 = ClientCpuSeconds();
  double t0 = Now();
  for (size_t i = 0; i < units; i += kBatch) {
    std::vector<PutUnit> batch;
    for (size_t j = i; j < std::min(units, i + kBatch); ++j) batch.push_back({keys[j], {}, value});
    auto p = (*c)->Put(batch, PutOptions{});
    if (!p.ok()) std::fprintf(stderr, "put: %s\n", p.status().ToString().c_str());
  }
  double t1 = Now();
  const uint64_t k1 = CpuNs(kvtierd);
  const double c1 = ClientCpuSeconds();
  uint64_t sum = 0;
  for (size_t i = 0; i < units; i += kBatch) {
    size_t n = std::min(kBatch, units - i);
    kvtier::Status st =
        (*c)->Get(std::span<const wire::Key>(keys).subspan(i, n), [&](size_t, const GetItem& g) {
          if (g.status.ok()) sum += g.value[g.value.size() / 2];
        });
    if (!st.ok()) std::fprintf(stderr, "get: %s\n", st.ToString().c_str());
  }
  double t2 = Now();
  r.put_server_cpu_s = static_cast<double>(k1 - k0) * 1e-9;
  r.put_client_cpu_s = c1 - c0;
  r.get_server_cpu_s = static_cast<double>(CpuNs(kvtierd) - k1) * 1e-9;
  r.get_client_cpu_s = ClientCpuSeconds() - c1;
  if (sum == 0) std::fprintf(stderr, "get returned nothing\n");
  r.put_gbs = units * kUnit / (t1 - t0) / 1e9;
  r.get_gbs = units * kUnit / (t2 - t1) / 1e9;
  return r;
}

double MemcpyGbs(size_t total_bytes) {
  constexpr size_t kUnit = 57000;
  std::vector<uint8_t> src(64u << 20, 1), dst(64u << 20);
  size_t n = 0;
  double t0 = Now();
  while (n < total_bytes) {
    size_t off = n % (src.size() - kUnit);
    std::memcpy(dst.data() + off, src.data() + off, kUnit);
    n += kUnit;
  }
  double t1 = Now();
  volatile uint8_t sink = dst[12345];
  (void)sink;
  return n / (t1 - t0) / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  int requests = argc > 1 ? std::atoi(argv[1]) : 20000;
  size_t native_bytes = (argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 512) << 20;
  int rounds = std::max(1, argc > 3 ? std::atoi(argv[3]) : 1);
  auto dir = std::filesystem::temp_directory_path() / ("kvtier_bench_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  kt::KvtierdProcess d(dir / "kvtierd");
  // A fourth argument is a TOML fragment appended to kvtierd's config, after its [storage]
  // table (an A/B of a setting: storage keys as they are, others under their own table).
  d.WriteConfig(
      std::string("[server]\nio_threads = 2\nworker_threads = 2\n"
                  "[storage]\ndram_capacity_bytes = 4294967296\nssd_capacity_bytes = 0\n") +
      (argc > 4 ? argv[4] : ""));
  if (!d.Start()) {
    std::fprintf(stderr, "kvtierd did not start:\n%s\n", d.Log().c_str());
    return 1;
  }
  uint16_t redis_port = kt::FreePort();
  pid_t redis = kt::StartRedisServer(redis_port, dir.string());
  pid_t kvtierd = PidWithArg(d.socket());
  std::printf(
      "== RESP: redis-benchmark -n %d -c 16 -P 16 -t set,get (one key: every GET hits), "
      "%d round(s), medians ==\n",
      requests, rounds);
  std::printf("%-8s %-4s %14s %14s %8s\n", "value", "op", "kvtierd ops/s", "redis ops/s", "ratio");
  std::vector<std::string> cpu_lines;
  for (size_t bytes : {size_t{57000}, size_t{1024}}) {
    std::map<std::string, std::vector<double>> kv, rv, ratio;
    std::vector<double> kv_cpu, rv_cpu;
    for (int round = 0; round < rounds; ++round) {
      uint64_t k0 = kvtierd > 0 ? CpuNs(kvtierd) : 0;
      auto k = RedisBenchmark(d.resp_port(), bytes, requests);
      uint64_t k1 = kvtierd > 0 ? CpuNs(kvtierd) : 0;
      uint64_t r0 = redis > 0 ? CpuNs(redis) : 0;
      auto r =
          redis > 0 ? RedisBenchmark(redis_port, bytes, requests) : std::map<std::string, double>{};
      uint64_t r1 = redis > 0 ? CpuNs(redis) : 0;
      kv_cpu.push_back((k1 - k0) / 1e3 / (2.0 * requests));
      rv_cpu.push_back((r1 - r0) / 1e3 / (2.0 * requests));
      for (const char* op : {"SET", "GET"}) {
        double a = k.count(op) ? k[op] : 0, b = r.count(op) ? r[op] : 0;
        kv[op].push_back(a);
        rv[op].push_back(b);
        ratio[op].push_back(b > 0 ? a / b : 0.0);
      }
    }
    for (const char* op : {"SET", "GET"}) {
      std::printf("%-8zu %-4s %14.0f %14.0f %8.2f\n", bytes, op, Median(kv[op]), Median(rv[op]),
                  Median(ratio[op]));
    }
    char line[160];
    double kc = Median(kv_cpu), rc = Median(rv_cpu);
    std::snprintf(line, sizeof(line), "%-8zu %18.2f %18.2f %8.2f", bytes, kc, rc,
                  kc > 0 ? rc / kc : 0.0);
    cpu_lines.push_back(line);
  }
  std::printf(
      "\n== RESP server CPU per request (set+get, all threads; ratio = redis / kvtierd) ==\n");
  std::printf("%-8s %18s %18s %8s\n", "value", "kvtierd cpu us/op", "redis cpu us/op", "ratio");
  for (const std::string& l : cpu_lines) std::printf("%s\n", l.c_str());
  if (redis > 0) {
    kt::StopRedisServer(redis);
  }
  std::printf("\n== native client, Unix socket, 57000-byte units, batches of 32, %zu MiB ==\n",
              native_bytes >> 20);
  double mc = MemcpyGbs(native_bytes);
  NativeResult shm = NativeRun(d.socket(), kvtierd, true, native_bytes);
  NativeResult inl = NativeRun(d.socket(), kvtierd, false, native_bytes);
  std::printf("%-22s %10s %10s %14s %14s\n", "path", "put GB/s", "get GB/s", "put/memcpy",
              "get/memcpy");
  std::printf("%-22s %10.2f %10.2f %14s %14s\n", "memcpy (in-process)", mc, mc, "1.00", "1.00");
  std::printf("%-22s %10.2f %10.2f %14.3f %14.3f\n", "shared memory", shm.put_gbs, shm.get_gbs,
              shm.put_gbs / mc, shm.get_gbs / mc);
  std::printf("%-22s %10.2f %10.2f %14.3f %14.3f\n", "inline (no shm)", inl.put_gbs, inl.get_gbs,
              inl.put_gbs / mc, inl.get_gbs / mc);
  std::printf("%-22s %14s %14s %14s %14s\n", "cpu seconds", "put kvtierd", "put client",
              "get kvtierd", "get client");
  for (const auto& [name, n] :
       {std::pair{"shared memory", shm}, std::pair{"inline (no shm)", inl}}) {
    std::printf("%-22s %14.3f %14.3f %14.3f %14.3f\n", name, n.put_server_cpu_s, n.put_client_cpu_s,
                n.get_server_cpu_s, n.get_client_cpu_s);
  }
  int rc = d.Stop();
  std::filesystem::remove_all(dir);
  return rc == 0 ? 0 : 1;
}
