// The round trip of one Engram row batch through the remote chain the engine uses:
// RemoteEngramRowSource -> RowFetcher -> TcpTransport -> loopback -> RowServer and back
// (docs/performance/engram-transport.md, "Round trip of one row batch"). Like a decode step of
// the miniature: each step Request()s one batch of `--rows` random rows per slot (two slots,
// as the model's two Engram layers), computes each `--leads` value in turn (a busy loop for the
// layers before the first Engram layer), Wait()s slot 0, computes `--gap-us`, Wait()s slot 1.
// Per lead it reports the latency from Request to Wait's return when Wait blocked (p50, p90,
// p99), the stalls per wait and the step's CPU time per step (this thread, getrusage).
//
//   kvtier_engram_rtt_bench [--steps 2000 --rows 12 --leads 0,20,40,60,100 --gap-us 40
//                            --slots 2 --server-busy-poll-us 0 --wait-spin-us 200
//                            --hold-requests 1]
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "cli/flags.h"
#include "common/temp_dir.h"
#include "engine/remote_engram.h"
#include "rdma/engram_table.h"
#include "rdma/row_server.h"

namespace kvtier::engine {
namespace {

constexpr uint64_t kStepsMax = 1000000, kRowsMax = 4096, kLeadMax = 100000;
constexpr size_t kLeadsMax = 16;            // --leads items
constexpr uint64_t kTableRows = 12 * 1024;  // the miniature's table size per layer
constexpr uint32_t kRowDim = 32;
using Clock = std::chrono::steady_clock;

int Fail(const Status& s) {
  std::fprintf(stderr, "kvtier_engram_rtt_bench: %s\n", s.ToString().c_str());
  return 1;
}

void Spin(uint64_t us) {
  const auto end = Clock::now() + std::chrono::microseconds(us);
  while (Clock::now() < end) {
  }
}

double ThreadCpuUs() {
  rusage u{};
  getrusage(RUSAGE_THREAD, &u);
  return u.ru_utime.tv_sec * 1e6 + u.ru_utime.tv_usec + u.ru_stime.tv_sec * 1e6 +
         u.ru_stime.tv_usec;
}

double Pct(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

int Main(int argc, char** argv) {
  cli::FlagSet flags("kvtier_engram_rtt_bench", "remote Engram row batch round trips");
  std::string leads = "0,20,40,60,100";
  uint64_t steps = 2000, rows = 12, gap_us = 40, slots = 2, busy_poll_us = 0, spin_us = 200,
           hold = 1;
  flags.Uint("steps", &steps, "steps per lead");
  flags.Uint("rows", &rows, "rows per batch and slot");
  flags.String("leads", &leads, "LIST", "compute before the first wait, us (comma separated)");
  flags.Uint("gap-us", &gap_us, "compute between the two slots' waits, us");
  flags.Uint("slots", &slots, "Engram slots requested per step (1 or 2)");
  flags.Uint("server-busy-poll-us", &busy_poll_us, "the row server's busy polling (0: off)");
  flags.Uint("wait-spin-us", &spin_us, "the fetcher's spin in Wait() before blocking");
  flags.Uint("hold-requests", &hold, "1: a step's requests of both slots leave in one send");
  std::vector<std::string_view> args(argv + 1, argv + argc);
  if (int rc = flags.Parse(args); rc >= 0) return rc;
  if (steps == 0 || steps > kStepsMax || rows == 0 || rows > kRowsMax || gap_us > kLeadMax ||
      slots == 0 || slots > 2 || busy_poll_us > rdma::kRowServerBusyPollMaxUs ||
      spin_us > rdma::kRowFetchWaitSpinMaxUs || hold > 1) {
    std::fprintf(stderr, "kvtier_engram_rtt_bench: a flag is out of range (see --help)\n");
    return 2;
  }
  std::vector<uint64_t> lead_list;
  if (!cli::ParseUintList(leads, 0, kLeadMax, kLeadsMax, &lead_list))
    return Fail(Status::InvalidArgument("--leads: 1 to " + std::to_string(kLeadsMax) +
                                        " comma-separated integers in 0.." +
                                        std::to_string(kLeadMax)));
  TempDir dir("kvtier-engram-rtt-");
  rdma::RowServerOptions so;
  so.busy_poll_us = busy_poll_us;
  rdma::RowServer server(so);
  RemoteEngramConfig rc;
  rc.tenant = "bench";
  for (int layer : {1, 6}) {
    const std::string region = "engram.l" + std::to_string(layer) + ".s0";
    rdma::EngramTableHeader h;
    h.row_dim = kRowDim;
    h.row_begin = 0;
    h.row_count = kTableRows;
    h.row_stride_bytes = rdma::EngramRowBytes(kRowDim);
    h.layer_id = static_cast<uint32_t>(layer);
    const std::string path = dir.File(region + ".engram");
    if (Status s = rdma::GenerateEngramTable(path, h, 7); !s.ok()) return Fail(s);
    if (Status s = server.RegisterTable(region, path); !s.ok()) return Fail(s);
    auto tok = server.IssueGrant(region, "bench", 3600000);
    if (!tok.ok()) return Fail(tok.status());
    rc.tokens[region] = *tok;
    rc.layer_ids.push_back(layer);
  }
  if (Status s = server.Start(); !s.ok()) return Fail(s);
  for (int layer : rc.layer_ids) {
    rc.shard_map_toml += "[[engram.l" + std::to_string(layer) + ".shard]]\nregion = \"engram.l" +
                         std::to_string(layer) +
                         ".s0\"\nendpoint = \"127.0.0.1:" + std::to_string(server.port()) +
                         "\"\nrow_begin = 0\nrow_end = " + std::to_string(kTableRows) + "\n";
  }
  RemoteEngramOptions ro;
  ro.fetcher.hot_cache_bytes = 0;
  ro.hold_step_requests = hold == 1;
  ro.fetcher.wait_spin_us = static_cast<uint32_t>(spin_us);
  auto src = RemoteEngramRowSource::Connect(static_cast<int>(kRowDim), rc, ro);
  if (!src.ok()) return Fail(src.status());
  std::mt19937_64 rng(1);
  std::printf(
      "rows %llu per slot, %llu slots, %llu steps per lead, gap %llu us, server busy poll %llu "
      "us, wait spin %llu us\n",
      (unsigned long long)rows, (unsigned long long)slots, (unsigned long long)steps,
      (unsigned long long)gap_us, (unsigned long long)busy_poll_us, (unsigned long long)spin_us);
  std::printf("%8s %10s %10s %10s %12s %14s %12s\n", "lead_us", "p50_us", "p90_us", "p99_us",
              "stalls/wait", "slot0 stalls", "cpu_us/step");
  for (uint64_t lead : lead_list) {
    std::vector<double> lat;
    uint64_t stalls0 = 0, stalls = 0;
    const double cpu0 = ThreadCpuUs();
    for (uint64_t i = 0; i < steps + 20; ++i) {
      EngramRowBatch b[2];
      for (int s = 0; s < 2; ++s) {
        b[s].slot = s;
        for (uint64_t r = 0; r < rows; ++r)
          b[s].row_ids.push_back(static_cast<int64_t>(rng() % kTableRows));
      }
      const auto t0 = Clock::now();
      (*src)->HoldRequests(true);  // as the engine: a step's slots leave together
      for (int s = 0; s < static_cast<int>(slots); ++s) {
        if (Status st = (*src)->Request(&b[s]); !st.ok()) return Fail(st);
      }
      (*src)->HoldRequests(false);
      Spin(lead);
      for (int s = 0; s < static_cast<int>(slots); ++s) {
        if (s == 1) Spin(gap_us);
        if (Status st = (*src)->Wait(&b[s]); !st.ok()) return Fail(st);
        if (i < 20) continue;  // warm-up
        if (b[s].stalled) {
          ++stalls;
          if (s == 0) {
            ++stalls0;
            lat.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
          }
        }
      }
    }
    const double cpu = (ThreadCpuUs() - cpu0) / static_cast<double>(steps + 20);
    std::printf("%8llu %10.1f %10.1f %10.1f %12.3f %14llu %12.1f\n", (unsigned long long)lead,
                Pct(lat, 0.5), Pct(lat, 0.9), Pct(lat, 0.99),
                static_cast<double>(stalls) / static_cast<double>(slots * steps),
                (unsigned long long)stalls0, cpu);
  }
  server.Stop();
  return 0;
}

}  // namespace
}  // namespace kvtier::engine

int main(int argc, char** argv) { return kvtier::engine::Main(argc, argv); }
