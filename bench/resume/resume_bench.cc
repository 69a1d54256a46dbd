// Resume vs recompute, and the fidelity of bounded replay (docs/performance/resume.md).
//
//   kvtier_resume_bench speed    [--tokens 4096,16384] [--threads 2] [--recompute-runs 1]
//                                [--restarts 3] [--fio-loops 20] [--dir DIR] [--model PREFIX]
//                                [--layer-device cpu|cuda|host-twin]
//   kvtier_resume_bench fidelity [--lengths 128,512,2048] [--prompts 3] [--steps 64]
//                                [--model PREFIX]
//
// --model: the trained miniature by default (deploy/models/kvmini-trained.{json,safetensors});
// "random" runs mini-v4.1 with deterministic random weights (seed 1), the model of the figures
// measured before the trained checkpoint existed. Sessions are agent-like text (tool output,
// code, user turns) in the byte tokenizer's ids.
//
// speed: for each length N (a whole number of 64-token pages below the 65,536-token context,
// so at most 65,472), --recompute-runs CED prefills of N tokens (the peer: what a resume
// without the cache costs; the fastest counts), a save of its units (put to the SSD tier,
// promoted to DRAM by the first GET) and hot state to a real kvtierd in --dir, then resumes
// with fresh session stores: the first with the hot state (exact, no replay), the second with
// bounded replay (units now in DRAM), and --restarts after a graceful daemon restart each
// (SSD, bounded replay; median). Prints each resume's phases (lookup, fetch + import, replay,
// suffix), the tiers its units came from, and the ratio recompute / resume. Then the fetch
// phase alone: --restarts times, a restarted daemon (cold DRAM) serves the GETs of every unit
// as the resume issues them (batches of max_units_per_call), timed without the import;
// against fio random reads (cli/fio.h, io_uring + O_DIRECT, in --dir) of as many aligned
// records at the same queue depth, over --fio-loops passes; prints fio's time per pass over
// the fetch's median (goal >= 0.8). Last, the import alone: ImportUnit of every unit from
// memory into a fresh state, and its share of the after-restart resume.
// fidelity: (c) bounded replay against (a) the uninterrupted session, in process (the daemon
// path is bit-identical to it, tests/resume): per prompt, CED prefill + 64 greedy steps is
// (a); units exported and imported into a fresh state + ReplayTail, teacher-forced with (a)'s
// tokens, is (c). Reports top-1 agreement and KL(a || c) of the next-token distributions.
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "cache_daemon/client.h"
#include "cli/fio.h"
#include "cli/flags.h"
#include "engine/agent_text.h"
#include "engine/config.h"
#include "engine/fidelity.h"
#include "engine/model.h"
#include "engine/session.h"
#include "engine/state_io.h"
#include "engine/weights.h"
#include "storage/block_device.h"
#include "storage/ssd_format.h"
#include "tests/e2e/kvtierd_process.h"

namespace kvtier::engine {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

int32_t Argmax(const std::vector<float>& v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

// The engine of --model: a checkpoint prefix, or "random" (mini-v4.1, random weights).
StatusOr<std::unique_ptr<Engine>> MakeEngine(const std::string& model, int threads,
                                             std::shared_ptr<const ModelWeights>* w,
                                             LayerDevice layer_device = LayerDevice::kCpu) {
  const bool random = model == "random";
  KVTIER_ASSIGN_OR_RETURN(EngineConfig cfg,
                          LoadEngineConfig(random ? KVTIER_MINI_CONFIG : model + ".json"));
  StatusOr<ModelWeights> mw =
      random ? InitWeights(cfg, 1) : LoadWeights(cfg, model + ".safetensors");
  if (!mw.ok()) return mw.status();
  *w = std::make_shared<const ModelWeights>(std::move(*mw));
  EngineOptions o;
  o.threads = threads;
  o.layer_device = layer_device;
  return Engine::Create(cfg, *w, o);
}

// The context the resumed sessions must fit: a recompute is one PrefillCed call, at most
// kMaxTokensPerCall (65,536) tokens, and a resumed session decodes its next token at position
// N, so a history is at most 65,536 - 64 = 65,472 tokens (the largest whole-page one).
constexpr uint64_t kContextTokens = kMaxTokensPerCall;
// Bounds on the repeat flags (the recompute of a 64K session takes minutes on 2 cores).
constexpr uint64_t kMaxRecomputeRuns = 5;
constexpr uint64_t kMaxRestarts = 10;
constexpr uint64_t kMaxFioLoops = 1000;

// Parses a list flag of session lengths (`flag`: its name in messages): whole-page histories
// below the context, comma-separated. False, with a message on stderr, for anything else.
bool ParseLengths(const char* flag, const std::string& s, uint32_t unit_tokens,
                  std::vector<uint64_t>* out) {
  for (const std::string& part : cli::SplitComma(s)) {
    uint64_t n = 0;
    const auto [end, ec] = std::from_chars(part.data(), part.data() + part.size(), n);
    if (ec != std::errc() || end != part.data() + part.size() || n == 0 || n % unit_tokens != 0 ||
        n >= kContextTokens) {
      std::fprintf(stderr,
                   "kvtier_resume_bench: --%s '%s': each length must be a multiple of %u below "
                   "the context of %llu tokens (the resumed session decodes at position N); the "
                   "largest is %llu\n",
                   flag, part.c_str(), unit_tokens, static_cast<unsigned long long>(kContextTokens),
                   static_cast<unsigned long long>(kContextTokens - unit_tokens));
      return false;
    }
    out->push_back(n);
  }
  if (out->empty()) {
    std::fprintf(stderr, "kvtier_resume_bench: --%s is empty\n", flag);
    return false;
  }
  return true;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty()      ? 0
         : v.size() % 2 ? v[v.size() / 2]
                        : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

// The resume's fetch alone: GETs of `keys` in batches of `per_call`, as SessionStore::Resume
// issues them, touching every value (no import). OK only when every unit arrives.
struct FetchRun {
  double seconds = 0;
  uint64_t bytes = 0;
  std::array<int64_t, 3> by_tier{};  // hbm, dram, ssd
  uint64_t last_bytes = 0;           // sum of each value's last byte: every value is read
};
StatusOr<FetchRun> TimedFetch(daemon::Client* c, std::span<const daemon::wire::Key> keys,
                              uint32_t per_call) {
  FetchRun run;
  Status missing;
  const auto t0 = Clock::now();
  for (size_t first = 0; first < keys.size(); first += per_call) {
    const size_t count = std::min<size_t>(keys.size() - first, per_call);
    KVTIER_RETURN_IF_ERROR(
        c->Get(keys.subspan(first, count), [&](size_t, const daemon::GetItem& g) {
          if (!g.status.ok()) {
            missing = g.status;
            return;
          }
          run.bytes += g.value.size();
          run.last_bytes += g.value.empty() ? 0 : g.value.back();
          if (g.tier < 3) ++run.by_tier[g.tier];
        }));
  }
  run.seconds = Since(t0);
  if (!missing.ok()) return Status::NotFound("fetch: a unit is missing: " + missing.ToString());
  return run;
}

// What a process spent: CPU and run-queue-wait seconds summed over its threads
// (/proc/PID/task/*/schedstat) and its minor page faults (/proc/PID/stat, field 10). Zeros
// for what cannot be read. Says whether the daemon's part of a fetch computed or waited.
struct ProcUsage {
  double cpu_s = 0, runq_s = 0;
  uint64_t minor_faults = 0;
};
ProcUsage ReadProcUsage(pid_t pid) {
  ProcUsage u;
  const std::filesystem::path proc = "/proc/" + std::to_string(pid);
  std::error_code ec;
  for (const auto& t : std::filesystem::directory_iterator(proc / "task", ec)) {
    std::ifstream in(t.path() / "schedstat");
    double cpu_ns = 0, runq_ns = 0;
    if (in >> cpu_ns >> runq_ns) {
      u.cpu_s += cpu_ns / 1e9;
      u.runq_s += runq_ns / 1e9;
    }
  }
  std::ifstream stat(proc / "stat");
  std::string line;
  std::getline(stat, line);
  const size_t comm_end = line.rfind(')');  // the command name may hold spaces
  if (comm_end != std::string::npos && comm_end + 2 <= line.size()) {
    std::istringstream fields(line.substr(comm_end + 2));
    std::string f;
    for (int field = 3; field <= 10 && fields >> f; ++field) {
      if (field == 10) u.minor_faults = std::strtoull(f.c_str(), nullptr, 10);
    }
  }
  return u;
}

int Fail(const char* what, const Status& s) {
  std::fprintf(stderr, "kvtier_resume_bench: %s: %s\n", what, s.ToString().c_str());
  return 1;
}

int Speed(std::span<const std::string_view> args) {
  cli::FlagSet flags("kvtier_resume_bench speed", "resume (DRAM, SSD) vs recompute");
  std::string lengths = "4096,16384";
  uint64_t threads = 2, recompute_runs = 1, restarts = 3, fio_loops = 20;
  std::string model = KVTIER_TRAINED_MODEL;
  std::string dir_flag = std::filesystem::temp_directory_path().string();
  std::string layer_device = "cpu";
  flags.String("tokens", &lengths, "N,N",
               "session lengths (multiples of 64, below the 65,536-token context: at most 65472)");
  flags.Uint("threads", &threads, "engine threads", false, 1, 64);
  flags.Uint("recompute-runs", &recompute_runs,
             "CED prefills (recomputes) per length; the fastest is the peer", false, 1,
             kMaxRecomputeRuns);
  flags.Uint("restarts", &restarts,
             "daemon restarts per length for each of: the fetch phase alone (cold DRAM) and the "
             "resume after a restart; medians are reported",
             false, 1, kMaxRestarts);
  flags.Uint("fio-loops", &fio_loops,
             "passes fio makes over the fetch's bytes (its runtime resolution is 1 ms)", false, 1,
             kMaxFioLoops);
  flags.String("dir", &dir_flag, "DIR",
               "scratch directory: kvtierd's data and fio's file (the file system measured)");
  flags.String("model", &model, "PREFIX", "checkpoint prefix, or 'random' (mini-v4.1)");
  flags.String("layer-device", &layer_device, "DEVICE",
               "where the engine's dense layers run (recompute and replay alike): cpu, cuda or "
               "host-twin");
  if (int rc = flags.Parse(args); rc >= 0) return rc;
  LayerDevice device = LayerDevice::kCpu;
  if (!ParseLayerDevice(layer_device, &device)) {
    std::fprintf(stderr, "kvtier_resume_bench speed: --layer-device is cpu, cuda or host-twin\n");
    return 2;
  }
  SessionOptions so;
  so.guard = GuardMode::kAlwaysFetch;
  std::vector<uint64_t> ns;
  if (!ParseLengths("tokens", lengths, so.unit_tokens, &ns)) return 2;
  if (!std::filesystem::is_directory(dir_flag) || dir_flag.find(':') != std::string::npos) {
    std::fprintf(stderr, "kvtier_resume_bench speed: --dir %s is not a directory (or has a ':')\n",
                 dir_flag.c_str());
    return 2;
  }
  std::shared_ptr<const ModelWeights> w;
  auto e = MakeEngine(model, static_cast<int>(threads), &w, device);
  if (!e.ok()) return Fail("engine", e.status());
  const auto dir =
      std::filesystem::path(dir_flag) / ("kvtier_resume_bench_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  // Removed on every return, after `d` (declared below, destroyed first) has killed kvtierd.
  struct RemoveOnExit {
    std::filesystem::path path;
    ~RemoveOnExit() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  } scratch{dir};
  testing::KvtierdProcess d(dir);
  d.WriteConfig(
      "[storage]\ndram_capacity_bytes = 268435456\nssd_capacity_bytes = 1073741824\n"
      "ssd_segment_bytes = 67108864\n"
      "durability = \"batched\"\n");
  if (!d.Start()) return std::fprintf(stderr, "kvtierd did not start\n"), 1;
  auto fp = EngineModelFingerprint((*e)->config(), *w, so.unit_tokens);
  if (!fp.ok()) return Fail("fingerprint", fp.status());
  daemon::ClientOptions co;
  co.socket_path = d.socket();
  auto restart = [&]() -> std::unique_ptr<daemon::Client> {
    if (d.Stop() != 0 || !d.Start()) return nullptr;
    auto c = daemon::Client::Connect(co);
    return c.ok() ? std::move(*c) : nullptr;
  };
  std::printf("model %s, %llu engine threads, layers on %s, scratch %s\n", model.c_str(),
              static_cast<unsigned long long>(threads), LayerDeviceName(device), dir.c_str());
  for (uint64_t n : ns) {
    const std::vector<int32_t> tokens = engine::AgentText(static_cast<uint32_t>(n), n);
    const uint32_t P = so.unit_tokens;
    const int64_t units = static_cast<int64_t>(n / P);
    std::printf("\n== %llu tokens (%lld units) ==\n", static_cast<unsigned long long>(n),
                static_cast<long long>(units));
    // The peer: a CED prefill of every token, the fastest of --recompute-runs. No connection
    // is open meanwhile (a 64K recompute outlasts the daemon's idle_timeout_ms).
    SequenceState st;
    std::vector<float> logits;
    double recompute_s = 0;
    for (uint64_t run = 0; run < recompute_runs; ++run) {
      st = (*e)->NewSequence();
      const auto t0 = Clock::now();
      if (Status ps = (*e)->PrefillCed(&st, tokens, &logits); !ps.ok())
        return Fail("recompute", ps);
      const double s = Since(t0);
      std::printf("recompute (CED prefill) run %llu: %.3f s\n",
                  static_cast<unsigned long long>(run + 1), s);
      std::fflush(stdout);
      recompute_s = run == 0 ? s : std::min(recompute_s, s);
    }
    auto c = daemon::Client::Connect(co);
    if (!c.ok()) return Fail("connect", c.status());
    auto store = SessionStore::Create(e->get(), c->get(), *fp, so);
    if (!store.ok()) return Fail("session store", store.status());
    SaveCursor cursor;
    if (Status ss = (*store)->Save(st, logits, &cursor); !ss.ok()) return Fail("save", ss);
    std::printf("units of %llu B saved\n", static_cast<unsigned long long>((*store)->unit_bytes()));
    std::printf("%-34s %9s %9s %9s %9s %9s %10s %9s\n", "resume path", "lookup", "fetch+imp",
                "replay", "suffix", "total s", "recompute", "ratio");
    auto resume = [&](const std::string& label, bool hot,
                      daemon::Client* client) -> StatusOr<ResumeReport> {
      SessionOptions o = so;
      o.use_hot_state = hot;
      auto s = SessionStore::Create(e->get(), client, *fp, o);
      if (!s.ok()) return s.status();
      SequenceState r;
      std::vector<float> rl;
      auto rep = (*s)->Resume(tokens, &r, &rl);
      if (!rep.ok()) return rep.status();
      std::printf(
          "%-34s %9.4f %9.4f %9.4f %9.4f %9.4f %10.3f %8.1fx  units dram %lld ssd %lld, "
          "replay %lld\n",
          label.c_str(), rep->lookup_s, rep->fetch_s, rep->replay_s, rep->suffix_s, rep->total_s,
          recompute_s, recompute_s / rep->total_s, static_cast<long long>(rep->units_by_tier[1]),
          static_cast<long long>(rep->units_by_tier[2]),
          static_cast<long long>(rep->replay_tokens));
      std::fflush(stdout);
      return rep;
    };
    if (auto r1 = resume("1st resume, hot state (exact)", true, c->get()); !r1.ok())
      return Fail("resume", r1.status());
    if (auto r2 = resume("2nd resume, bounded replay", false, c->get()); !r2.ok())
      return Fail("resume", r2.status());
    const UnitPayloadLayout layout = (*store)->payload_layout();
    const uint64_t unit_bytes = (*store)->unit_bytes();
    store->reset();
    c->reset();
    // After a graceful restart: units from SSD, no hot state (bounded replay).
    std::vector<double> restart_totals, restart_fetches;
    for (uint64_t k = 0; k < restarts; ++k) {
      auto c2 = restart();
      if (c2 == nullptr) return std::fprintf(stderr, "restart failed\n"), 1;
      auto rep = resume("after restart " + std::to_string(k + 1) + ", replay", true, c2.get());
      if (!rep.ok()) return Fail("resume after restart", rep.status());
      restart_totals.push_back(rep->total_s);
      restart_fetches.push_back(rep->fetch_s);
    }
    const double restart_total = Median(restart_totals);
    std::printf("after restart, median of %llu: %.4f s (fetch+import %.4f s) = %.1fx recompute\n",
                static_cast<unsigned long long>(restarts), restart_total, Median(restart_fetches),
                recompute_s / restart_total);
    // The fetch phase alone, each time from a freshly restarted daemon (cold DRAM: every unit
    // is read from SSD), against fio random reads of the same number of aligned records at
    // the same queue depth on the same file system.
    const std::vector<Digest> chain = SessionChainKeys(*fp, tokens, P);
    const std::vector<daemon::wire::Key> keys(chain.begin(), chain.end());
    std::vector<double> fetch_s, daemon_cpu_s, daemon_runq_s, daemon_faults;
    uint64_t fetched_bytes = 0;
    for (uint64_t k = 0; k < restarts; ++k) {
      auto c3 = restart();
      if (c3 == nullptr) return std::fprintf(stderr, "restart failed\n"), 1;
      const ProcUsage u0 = ReadProcUsage(d.pid());
      auto run = TimedFetch(c3.get(), keys, so.max_units_per_call);
      const ProcUsage u1 = ReadProcUsage(d.pid());
      daemon_cpu_s.push_back(u1.cpu_s - u0.cpu_s);
      daemon_runq_s.push_back(u1.runq_s - u0.runq_s);
      daemon_faults.push_back(u1.minor_faults >= u0.minor_faults
                                  ? static_cast<double>(u1.minor_faults - u0.minor_faults)
                                  : 0);
      if (!run.ok()) return Fail("fetch", run.status());
      if (run->by_tier[2] != units) {
        std::fprintf(stderr, "fetch: %lld of %lld units came from SSD (DRAM not cold?)\n",
                     static_cast<long long>(run->by_tier[2]), static_cast<long long>(units));
        return 1;
      }
      fetch_s.push_back(run->seconds);
      fetched_bytes = run->bytes;
    }
    if (fetched_bytes != static_cast<uint64_t>(units) * unit_bytes) {
      std::fprintf(stderr, "fetch: %llu bytes, expected %lld units of %llu\n",
                   static_cast<unsigned long long>(fetched_bytes), static_cast<long long>(units),
                   static_cast<unsigned long long>(unit_bytes));
      return 1;
    }
    // fio reads whole aligned records, as `kvtier bench storage` compares (cli/cmd_bench.cc):
    // the SSD tier reads each record's 4 KiB-aligned span (records are packed at 8 bytes, so
    // a span is this block or one block more).
    const uint64_t record_block = storage::ssd::AlignUp(
        unit_bytes + storage::ssd::kRecordHeaderBytes, storage::ssd::kBlockBytes);
    const uint64_t qd =
        std::min<uint64_t>(so.max_units_per_call, storage::DirEnvOptions{}.queue_depth);
    const uint64_t fio_bytes = static_cast<uint64_t>(units) * record_block;
    std::filesystem::create_directories(dir / "fio");
    std::string err;
    const double fio_bps = cli::RunFio(
        "--name=fetch --rw=randread --bs=" + std::to_string(record_block) +
            " --size=" + std::to_string(fio_bytes) + " --iodepth=" + std::to_string(qd) +
            " --loops=" + std::to_string(fio_loops) + cli::FioDirectArgs((dir / "fio").string()),
        "read", &err);
    std::filesystem::remove_all(dir / "fio");
    const double fetch_med = Median(fetch_s);
    if (fio_bps <= 0) {
      std::printf("fetch alone (cold DRAM, SSD): median %.4f s; fio: %s\n", fetch_med, err.c_str());
    } else {
      const double fio_s = static_cast<double>(fio_bytes) / fio_bps;
      std::printf(
          "fetch alone (cold DRAM, %lld units from SSD, GETs of %u, qd %llu): median of %llu "
          "%.4f s (%.0f units/s)\nfio randread bs=%llu iodepth=%llu size=%llu (%llu loops): "
          "%.4f s per pass (%.0f reads/s)\nfetch vs fio: %.2fx\n",
          static_cast<long long>(units), so.max_units_per_call, static_cast<unsigned long long>(qd),
          static_cast<unsigned long long>(restarts), fetch_med, units / fetch_med,
          static_cast<unsigned long long>(record_block), static_cast<unsigned long long>(qd),
          static_cast<unsigned long long>(fio_bytes), static_cast<unsigned long long>(fio_loops),
          fio_s, units / fio_s, fio_s / fetch_med);
    }
    std::printf(
        "kvtierd during the fetch (medians, all its threads): cpu %.4f s, run-queue wait "
        "%.4f s, %.1f minor page faults per unit\n",
        Median(daemon_cpu_s), Median(daemon_runq_s), Median(daemon_faults) / units);
    // The import alone: the units (now in the daemon's DRAM) copied out, then ImportUnit of
    // every one into a fresh state, as the resume does inside its GET; fastest of 3.
    {
      auto c4 = daemon::Client::Connect(co);
      if (!c4.ok()) return Fail("connect", c4.status());
      std::vector<std::vector<uint8_t>> values;
      std::vector<bool> found;
      if (!(*c4)->GetCopy(keys, &values, &found).ok() ||
          std::count(found.begin(), found.end(), true) != units)
        return std::fprintf(stderr, "import: units missing\n"), 1;
      UnitDecodeOptions dopts;
      dopts.expected_model_fingerprint = *fp;
      double import_s = 0;
      for (int run = 0; run < 3; ++run) {
        SequenceState fresh = (*e)->NewSequence();
        const auto t0 = Clock::now();
        for (int64_t i = 0; i < units; ++i) {
          dopts.expected_key = chain[i];
          Status is = ImportUnit(layout, values[i], dopts,
                                 std::span<const int32_t>(tokens).subspan(i * P, P), &fresh);
          if (!is.ok()) return Fail("import", is);
        }
        const double s = Since(t0);
        import_s = run == 0 ? s : std::min(import_s, s);
      }
      std::printf(
          "import alone (ImportUnit of %lld units, fastest of 3): %.4f s (%.1f us/unit, "
          "%.1f%% of the median after-restart resume)\n",
          static_cast<long long>(units), import_s, 1e6 * import_s / units,
          100 * import_s / restart_total);
    }
    std::fflush(stdout);
  }
  d.Stop();
  return 0;
}

int Fidelity(std::span<const std::string_view> args) {
  cli::FlagSet flags("kvtier_resume_bench fidelity", "bounded replay (c) vs uninterrupted (a)");
  std::string lengths = "128,512,2048";
  uint64_t prompts = 3, steps = 64, threads = 2;
  std::string model = KVTIER_TRAINED_MODEL;
  flags.String("lengths", &lengths, "N,N", "history lengths (multiples of 64)");
  flags.Uint("prompts", &prompts, "prompts per length");
  flags.Uint("steps", &steps, "generated tokens compared");
  flags.Uint("threads", &threads, "engine threads");
  flags.String("model", &model, "PREFIX", "checkpoint prefix, or 'random' (mini-v4.1)");
  if (int rc = flags.Parse(args); rc >= 0) return rc;
  std::vector<uint64_t> ns;
  if (!ParseLengths("lengths", lengths, kDefaultUnitTokens, &ns)) return 2;
  std::shared_ptr<const ModelWeights> w;
  auto e = MakeEngine(model, static_cast<int>(threads), &w);
  if (!e.ok()) return Fail("engine", e.status());
  Engine& eng = **e;
  auto layout = EngineKvLayout(eng.config());
  if (!layout.ok()) return 1;
  const UnitPayloadLayout pl = UnitPayloadLayout::For(*layout);
  std::printf("%-7s %-7s %8s %12s %12s %10s\n", "length", "prompts", "top1", "kl_mean", "kl_max",
              "exact");
  for (uint64_t n : ns) {
    double agree = 0, kl_sum = 0, kl_max = 0;
    uint64_t count = 0, exact = 0;
    for (uint64_t p = 0; p < prompts; ++p) {
      const auto tokens = engine::AgentText(static_cast<uint32_t>(1000 * n + p), n);
      SequenceState a = eng.NewSequence();
      std::vector<float> la;
      if (!eng.PrefillCed(&a, tokens, &la).ok()) return 1;
      SequenceState c = eng.NewSequence();
      for (int64_t page = 0; page < ExportablePages(pl, a); ++page) {
        auto payload = ExportUnitPayload(pl, a, page);
        if (!payload.ok()) return 1;
        std::span<const int32_t> toks(tokens.data() + page * 64, 64);
        if (!ImportUnitPayload(pl, *payload, toks, &c).ok()) return 1;
      }
      std::vector<float> lc;
      if (!eng.ReplayTail(&c, &lc).ok()) return 1;
      bool all_exact = true;
      for (uint64_t k = 0; k < steps; ++k) {
        agree += Argmax(la) == Argmax(lc);
        const double kl = engine::KlDivergence(la, lc);
        kl_sum += kl;
        kl_max = std::max(kl_max, kl);
        all_exact = all_exact && la == lc;
        ++count;
        const int32_t next = Argmax(la);  // teacher-forced with (a)'s tokens
        if (k + 1 < steps && (!eng.Decode(&a, next, &la).ok() || !eng.Decode(&c, next, &lc).ok()))
          return 1;
      }
      exact += all_exact;
    }
    std::printf("%-7llu %-7llu %8.4f %12.3e %12.3e %7llu/%llu\n",
                static_cast<unsigned long long>(n), static_cast<unsigned long long>(prompts),
                agree / count, kl_sum / count, kl_max, static_cast<unsigned long long>(exact),
                static_cast<unsigned long long>(prompts));
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace kvtier::engine

int main(int argc, char** argv) {
  std::vector<std::string_view> args(argv + 1, argv + argc);
  if (args.empty() || (args[0] != "speed" && args[0] != "fidelity")) {
    std::fprintf(stderr, "usage: kvtier_resume_bench speed|fidelity [flags]\n");
    return 2;
  }
  std::span<const std::string_view> rest(args.data() + 1, args.size() - 1);
  return args[0] == "speed" ? kvtier::engine::Speed(rest) : kvtier::engine::Fidelity(rest);
}
