// Remote Engram rows during speculative decoding (docs/performance/speculative.md,
// "Remote Engram lead time with speculation"; the Engram lead-time goal). The trained miniature and
// its DSpark draft decode greedily, once with the engine's local Engram table and once with
// RemoteEngramRowSource reading the same rows from a RowServer over loopback (ExportEngramTables of
// the same weights; transport MakeTransport kAuto: TCP without an RDMA device). Settings: plain
// decoding (one Decode per token) and SpeculativeDecoder rounds with fixed draft lengths, whose
// drafted tokens' rows are requested as soon as the draft exists (Engine::PrefetchEngram).
//
// Per prompt every setting runs its arms (local, remote, and with --local-control a second local
// run, "local again") back to back, in an order that rotates by one per prompt and setting, so
// neither load changes nor running first favour an arm. "local again" against "local" is the
// noise floor of the overhead column. Reports per setting the decode time's remote-vs-local
// overhead (wall), the same in the engine's CPU time (`CpuCostClock`: the thread's own with
// --threads 1; the transport's work on the engine thread and any slowdown of its compute show
// there, time blocked or descheduled does not) and the remote engine's Engram waits, stalls and
// prefetches (decode phase only); exits 1 when a remote run emits other tokens than the local.
//
// The shipped miniature's Engram tables are small (engram_vocab_size 1024: 12 primes above it
// per layer), so the fetcher's hot-row cache would serve nearly every row after the first
// prompt; --hot-cache-kib (default 0) therefore keeps it off and every row crosses loopback.
//
//   kvtier_spec_engram_bench --config C --model M --draft D --text FILE
//       [--prompts N --prompt-bytes B --max-new N --draft-lens 1,3,5 --threads 1
//        --hot-cache-kib 0 --server-busy-poll-us 20000 --wait-spin-us 200 --share-connections 1
//        --hold-requests 1 --local-control 0 --server-cpu C --engine-cpu C]
//
// --server-cpu / --engine-cpu pin the row server's threads and the engine side's (the engine,
// its pool, the row fetcher's I/O thread) to one CPU each: threads take their creator's
// affinity, so the main thread pins itself to the server's CPU before starting the server and
// to the engine's before creating the rest. With the loopback device's receive steering (RPS:
// /sys/class/net/lo/queues/rx-0/rps_cpus) set to the server's CPU, the receiving sockets'
// protocol processing runs there instead of inside the sender's system call, as a remote row
// server's host and a NIC interrupt steered off the engine's core would do it
// (docs/performance/speculative.md, "Remote Engram with the peer's protocol work on its own
// core").
#include <pthread.h>
#include <sched.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "bench/speculative/spec_model.h"
#include "cli/flags.h"
#include "common/temp_dir.h"
#include "engine/dspark.h"
#include "engine/engram_export.h"
#include "engine/model.h"
#include "engine/remote_engram.h"
#include "engine/sampler.h"
#include "engine/speculative.h"
#include "engine/weights.h"
#include "rdma/row_server.h"

namespace kvtier::engine {
namespace {

constexpr uint64_t kPromptsMax = 1000, kMaxNewMax = 4096, kPromptBytesMax = 4096;
constexpr uint64_t kThreadsMax = 64, kHotCacheKibMax = 1 << 20;
constexpr size_t kListMax = 16;

// Pins the calling thread to `cpu` (none: leaves it as it is); threads it creates later inherit
// the mask.
Status PinThisThread(std::optional<uint64_t> cpu) {
  if (!cpu.has_value()) return Status::Ok();
  if (*cpu >= CPU_SETSIZE) return Status::InvalidArgument("cpu out of range");
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(static_cast<int>(*cpu), &set);
  const int rc = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  if (rc != 0) {
    return Status::InvalidArgument("cpu " + std::to_string(*cpu) + ": " + std::strerror(rc));
  }
  return Status::Ok();
}
using Clock = std::chrono::steady_clock;

int Fail(const Status& s) {
  std::fprintf(stderr, "kvtier_spec_engram_bench: %s\n", s.ToString().c_str());
  return 1;
}

// The arms of a setting, in the order of Setting's arrays.
enum Arm { kLocal = 0, kRemote = 1, kLocalAgain = 2, kArms = 3 };

// What one arm of a setting measured, summed over the prompts' decode phases.
struct ArmTotals {
  double wall_s = 0, cpu_s = 0;  // cpu_s: the engine's CostClock
  EngineStats stats;             // the Engram counters' deltas
  uint64_t rounds = 0, accepted = 0;
};

struct Setting {
  std::string name;
  int draft_len = -1;  // -1: plain decoding
  ArmTotals arm[kArms];
  uint64_t mismatches = 0;  // prompts whose remote tokens differ from the local ones
};

void AddDelta(const EngineStats& a, const EngineStats& b, EngineStats* to) {
  to->engram_waits += b.engram_waits - a.engram_waits;
  to->engram_stalls += b.engram_stalls - a.engram_stalls;
  to->engram_stall_us += b.engram_stall_us - a.engram_stall_us;
  to->engram_prefetches_issued += b.engram_prefetches_issued - a.engram_prefetches_issued;
  to->engram_prefetches_consumed += b.engram_prefetches_consumed - a.engram_prefetches_consumed;
  to->engram_prefetches_discarded += b.engram_prefetches_discarded - a.engram_prefetches_discarded;
}

// Greedy decoding of max_new tokens after `prompt` on `e` (plain when draft_len < 0); adds the
// decode phase's wall and CPU time, the engine's counters around it and the rounds to *to.
Status Run(Engine* e, const DSpark& draft, const ModelWeights& w,
           const std::vector<int32_t>& prompt, uint64_t max_new, int draft_len, ArmTotals* to,
           std::vector<int32_t>* out) {
  SequenceState st = e->NewSequence();
  Sampler sampler(0, 1, 0);
  const CostClock cpu = CpuCostClock(*e);
  if (draft_len < 0) {
    std::vector<float> logits;
    KVTIER_RETURN_IF_ERROR(e->Forward(&st, prompt, false, &logits));
    const EngineStats before = e->stats();
    const double c0 = cpu();
    const auto t0 = Clock::now();
    for (uint64_t i = 0; i < max_new; ++i) {
      out->push_back(sampler.Sample(logits));
      if (i + 1 < max_new) KVTIER_RETURN_IF_ERROR(e->Decode(&st, out->back(), &logits));
    }
    to->wall_s += std::chrono::duration<double>(Clock::now() - t0).count();
    to->cpu_s += cpu() - c0;
    AddDelta(before, e->stats(), &to->stats);
    return Status::Ok();
  }
  SpeculativeOptions o;
  o.draft_len = draft_len;
  SpeculativeDecoder dec(e, &draft, &w, nullptr, o, &sampler);
  int32_t first = -1;
  KVTIER_RETURN_IF_ERROR(dec.Start(&st, prompt, &first));
  out->push_back(first);
  const EngineStats before = e->stats();
  const double c0 = cpu();
  const auto t0 = Clock::now();
  while (out->size() < max_new) KVTIER_RETURN_IF_ERROR(dec.Round(&st, out));
  to->wall_s += std::chrono::duration<double>(Clock::now() - t0).count();
  to->cpu_s += cpu() - c0;
  AddDelta(before, e->stats(), &to->stats);
  out->resize(max_new);
  to->rounds += dec.stats().rounds;
  to->accepted += dec.stats().accepted;
  return Status::Ok();
}

int Main(int argc, char** argv) {
  cli::FlagSet flags("kvtier_spec_engram_bench",
                     "remote vs local Engram rows, plain and speculative decoding");
  SpecPaths paths;
  std::string lens = "1,3,5";
  uint64_t prompts = 8, prompt_bytes = 96, max_new = 96, threads = 1, hot_kib = 0;
  // The row server's busy-polling window outlasts a local run (~10 ms): a shorter one lets it
  // sleep during the local run, and the next remote run's first request waits for its wake-up.
  uint64_t busy_poll_us = 20000, spin_us = 200, share = 1, hold = 1, control = 0;
  std::optional<uint64_t> server_cpu, engine_cpu;
  std::string only;
  AddSpecPathFlags(&flags, &paths);
  flags.Uint("prompts", &prompts, "prompts");
  flags.Uint("prompt-bytes", &prompt_bytes, "bytes per prompt");
  flags.Uint("max-new", &max_new, "tokens generated per prompt and setting");
  flags.String("draft-lens", &lens, "LIST", "fixed draft lengths (comma separated)");
  flags.Uint("threads", &threads, "engine threads");
  flags.Uint("hot-cache-kib", &hot_kib, "the row fetcher's hot-row cache (0: off)");
  flags.Uint("server-busy-poll-us", &busy_poll_us, "the row server's busy polling (0: off)");
  flags.Uint("wait-spin-us", &spin_us, "the row fetcher's spin in Wait() before it blocks");
  flags.Uint("share-connections", &share, "1: one connection per row server for all slots");
  flags.Uint("hold-requests", &hold,
             "1 (the engine's default): a step's requests of all slots leave in "
             "one send; 0: one send per slot");
  flags.Uint("local-control", &control, "1: a second local arm (the overhead's noise floor)");
  flags.OptionalUint("server-cpu", &server_cpu, "pin the row server's threads to this CPU",
                     "not pinned", 0, CPU_SETSIZE - 1);
  flags.OptionalUint("engine-cpu", &engine_cpu,
                     "pin the engine, its pool and the row fetcher's threads to this CPU",
                     "not pinned", 0, CPU_SETSIZE - 1);
  flags.String("only", &only, "ARM",
               "run one arm, local or remote, and report its rates alone (for a profiler)");
  std::vector<std::string_view> args(argv + 1, argv + argc);
  if (int rc = flags.Parse(args); rc >= 0) return rc;
  if (prompts == 0 || prompts > kPromptsMax || max_new == 0 || max_new > kMaxNewMax ||
      prompt_bytes == 0 || prompt_bytes > kPromptBytesMax || threads == 0 ||
      threads > kThreadsMax || hot_kib > kHotCacheKibMax ||
      busy_poll_us > rdma::kRowServerBusyPollMaxUs || spin_us > rdma::kRowFetchWaitSpinMaxUs ||
      share > 1 || hold > 1 || control > 1 ||
      (!only.empty() && only != "local" && only != "remote")) {
    std::fprintf(stderr, "kvtier_spec_engram_bench: a flag is out of range (see --help)\n");
    return 2;
  }
  auto m = LoadSpecModel(paths);
  if (!m.ok()) return Fail(m.status());
  const SpecModel& sm = *m;
  std::vector<Setting> sets = {{"plain", -1}};
  std::vector<uint64_t> ks;
  if (!cli::ParseUintList(lens, 0, static_cast<uint64_t>(sm.dconfig.block_size), kListMax, &ks))
    return Fail(Status::InvalidArgument("bad --draft-lens"));
  for (uint64_t k : ks) sets.push_back({"fixed " + std::to_string(k), static_cast<int>(k)});
  auto read = ReadSpecText(paths.text);
  if (!read.ok()) return Fail(read.status());
  const std::string& text = *read;
  if (text.size() < prompt_bytes * prompts) return Fail(Status::InvalidArgument("text too short"));

  // The row server with the tables of these weights.
  TempDir dir("kvtier-spec-engram-");
  rdma::RowServerOptions so;
  so.busy_poll_us = busy_poll_us;
  rdma::RowServer server(so);
  if (Status s = PinThisThread(server_cpu); !s.ok()) return Fail(s);
  if (Status s = server.Start(); !s.ok()) return Fail(s);
  if (Status s = PinThisThread(engine_cpu); !s.ok()) return Fail(s);
  EngramExportOptions eo;
  eo.out_dir = dir.path() + "/tables";
  eo.endpoints = {"127.0.0.1:" + std::to_string(server.port())};
  auto ex = ExportEngramTables(sm.config, *sm.weights, eo);
  if (!ex.ok()) return Fail(ex.status());
  RemoteEngramConfig rc;
  rc.shard_map_toml = ex->shard_map_toml;
  rc.layer_ids = sm.config.engram_layer_ids;
  rc.tenant = "bench";
  for (const auto& file : ex->files) {
    if (Status s = server.RegisterTable(file.region, file.path); !s.ok()) return Fail(s);
    auto tok = server.IssueGrant(file.region, "bench", 3600000);
    if (!tok.ok()) return Fail(tok.status());
    rc.tokens[file.region] = *tok;
  }
  RemoteEngramOptions ro;
  ro.fetcher.hot_cache_bytes = hot_kib << 10;
  ro.fetcher.wait_spin_us = static_cast<uint32_t>(spin_us);
  ro.share_connections = share == 1;
  ro.hold_step_requests = hold == 1;
  auto remote = RemoteEngramRowSource::Connect(sm.config.engram_head_dim, rc, ro);
  if (!remote.ok()) return Fail(remote.status());
  EngineOptions lo;
  lo.threads = static_cast<int>(threads);
  auto local_engine = Engine::Create(sm.config, sm.weights, lo);
  if (!local_engine.ok()) return Fail(local_engine.status());
  EngineOptions reo = lo;
  reo.engram_rows = remote->get();
  auto remote_engine = Engine::Create(sm.config, sm.weights, reo);
  if (!remote_engine.ok()) return Fail(remote_engine.status());

  const size_t stride = text.size() / prompts;
  const int arms = !only.empty() ? 1 : control == 1 ? 3 : 2;
  Engine* engines[kArms] = {local_engine->get(), remote_engine->get(), local_engine->get()};
  for (uint64_t p = 0; p < prompts; ++p) {
    std::vector<int32_t> prompt = {0};
    for (size_t i = 0; i < prompt_bytes; ++i)
      prompt.push_back(3 + static_cast<unsigned char>(text[p * stride + i]));
    for (size_t si = 0; si < sets.size(); ++si) {
      Setting& set = sets[si];
      std::vector<int32_t> out[kArms];
      for (int j = 0; j < arms; ++j) {
        const int arm = !only.empty()
                            ? (only == "remote" ? kRemote : kLocal)
                            : static_cast<int>((p + si + static_cast<uint64_t>(j)) % arms);
        Status s = Run(engines[arm], *sm.draft, *sm.weights, prompt, max_new, set.draft_len,
                       &set.arm[arm], &out[arm]);
        if (!s.ok()) return Fail(s);
      }
      if (only.empty()) set.mismatches += out[kLocal] != out[kRemote] ? 1 : 0;
    }
  }
  server.Stop();
  std::printf(
      "transport %s, threads %llu, hot cache %llu KiB, server busy poll %llu us, wait spin %llu "
      "us, shared connections %llu, hold requests %llu, %llu prompts x %llu tokens, arms "
      "rotated%s%s\n",
      (*remote)->transport_name(), (unsigned long long)threads, (unsigned long long)hot_kib,
      (unsigned long long)busy_poll_us, (unsigned long long)spin_us, (unsigned long long)share,
      (unsigned long long)hold, (unsigned long long)prompts, (unsigned long long)max_new,
      arms == 3 ? ", local control" : "",
      !server_cpu && !engine_cpu
          ? ""
          : (", server on cpu " + (server_cpu ? std::to_string(*server_cpu) : "any") +
             ", engine on cpu " + (engine_cpu ? std::to_string(*engine_cpu) : "any"))
                .c_str());
  const double tokens = static_cast<double>(prompts * max_new);
  if (!only.empty()) {
    const int arm = only == "remote" ? kRemote : kLocal;
    std::printf("%-9s %10s %11s (%s arm only)\n", "setting", "tok/s", "cpu_us/tok", only.c_str());
    for (const Setting& set : sets)
      std::printf("%-9s %10.1f %11.2f\n", set.name.c_str(), tokens / set.arm[arm].wall_s,
                  set.arm[arm].cpu_s / tokens * 1e6);
    return 0;
  }
  std::printf("%-9s %11s %12s %9s %9s %9s %7s %7s %9s %9s %11s %10s %s\n", "setting", "local_tok/s",
              "remote_tok/s", "overhead", "cpu_ovh", "again_ovh", "waits", "stalls", "stall_ms",
              "pf_issued", "pf_consumed", "pf_discard", "accepted/ver");
  bool ok = true;
  for (const Setting& set : sets) {
    const ArmTotals &local = set.arm[kLocal], &remote_arm = set.arm[kRemote];
    const EngineStats& r = remote_arm.stats;
    char acc[32] = "-", again[32] = "-";
    if (set.draft_len >= 0)
      std::snprintf(acc, sizeof(acc), "%.2f",
                    static_cast<double>(local.accepted) /
                        static_cast<double>(std::max<uint64_t>(1, local.rounds)));
    if (arms == 3)
      std::snprintf(again, sizeof(again), "%.3f", set.arm[kLocalAgain].wall_s / local.wall_s - 1.0);
    std::printf("%-9s %11.1f %12.1f %9.3f %9.3f %9s %7llu %7llu %9.1f %9llu %11llu %10llu %s%s\n",
                set.name.c_str(), tokens / local.wall_s, tokens / remote_arm.wall_s,
                remote_arm.wall_s / local.wall_s - 1.0, remote_arm.cpu_s / local.cpu_s - 1.0, again,
                (unsigned long long)r.engram_waits, (unsigned long long)r.engram_stalls,
                r.engram_stall_us / 1e3, (unsigned long long)r.engram_prefetches_issued,
                (unsigned long long)r.engram_prefetches_consumed,
                (unsigned long long)r.engram_prefetches_discarded, acc,
                set.mismatches ? "  REMOTE TOKENS DIFFER" : "");
    ok = ok && set.mismatches == 0;
  }
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace kvtier::engine

int main(int argc, char** argv) { return kvtier::engine::Main(argc, argv); }
