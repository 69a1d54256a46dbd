// Resume vs recompute, and the fidelity of bounded replay (docs/PERFORMANCE.md ## Resume).
//
//   kvtier_resume_bench speed    [--tokens 4096,16384] [--threads 2] [--model PREFIX]
//   kvtier_resume_bench fidelity [--lengths 128,512,2048] [--prompts 3] [--steps 64]
//                                [--model PREFIX]
//
// --model: the trained miniature by default (deploy/models/kvmini-trained.{json,safetensors});
// "random" runs mini-v4.1 with deterministic random weights (seed 1), the model of the figures
// measured before the trained checkpoint existed. Sessions are agent-like text (tool output,
// code, user turns) in the byte tokenizer's ids.
//
// speed: for each length N, a CED prefill of N tokens (the peer: what a resume without the
// cache costs), a save of its units (put to the SSD tier, promoted to DRAM by the first GET)
// and hot state to a real kvtierd, then three resumes with fresh session stores: the first
// with the hot state (exact, no replay), the second with bounded replay (units now in DRAM),
// and one after a graceful daemon restart (SSD, bounded replay). Prints each resume's time,
// the tiers its units came from, and the ratio recompute / resume.
// fidelity: (c) bounded replay against (a) the uninterrupted session, in process (the daemon
// path is bit-identical to it, tests/resume): per prompt, CED prefill + 64 greedy steps is
// (a); units exported and imported into a fresh state + ReplayTail, teacher-forced with (a)'s
// tokens, is (c). Reports top-1 agreement and KL(a || c) of the next-token distributions.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "cache_daemon/client.h"
#include "cli/flags.h"
#include "engine/agent_text.h"
#include "engine/config.h"
#include "engine/fidelity.h"
#include "engine/model.h"
#include "engine/session.h"
#include "engine/state_io.h"
#include "engine/weights.h"
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

std::vector<uint64_t> ParseList(const std::string& s) {
  std::vector<uint64_t> out;
  for (const std::string& part : cli::SplitComma(s)) out.push_back(std::stoull(part));
  return out;
}

// The engine of --model: a checkpoint prefix, or "random" (mini-v4.1, random weights).
StatusOr<std::unique_ptr<Engine>> MakeEngine(const std::string& model, int threads,
                                             std::shared_ptr<const ModelWeights>* w) {
  const bool random = model == "random";
  KVTIER_ASSIGN_OR_RETURN(EngineConfig cfg,
                          LoadEngineConfig(random ? KVTIER_MINI_CONFIG : model + ".json"));
  StatusOr<ModelWeights> mw =
      random ? InitWeights(cfg, 1) : LoadWeights(cfg, model + ".safetensors");
  if (!mw.ok()) return mw.status();
  *w = std::make_shared<const ModelWeights>(std::move(*mw));
  EngineOptions o;
  o.threads = threads;
  return Engine::Create(cfg, *w, o);
}

int Speed(std::span<const std::string_view> args) {
  cli::FlagSet flags("kvtier_resume_bench speed", "resume (DRAM, SSD) vs recompute");
  std::string lengths = "4096,16384";
  uint64_t threads = 2;
  std::string model = KVTIER_TRAINED_MODEL;
  flags.String("tokens", &lengths, "N,N", "session lengths (multiples of 64)");
  flags.Uint("threads", &threads, "engine threads");
  flags.String("model", &model, "PREFIX", "checkpoint prefix, or 'random' (mini-v4.1)");
  if (int rc = flags.Parse(args); rc >= 0) return rc;
  std::shared_ptr<const ModelWeights> w;
  auto e = MakeEngine(model, static_cast<int>(threads), &w);
  if (!e.ok()) return std::fprintf(stderr, "%s\n", e.status().ToString().c_str()), 1;
  const auto dir =
      std::filesystem::temp_directory_path() / ("kvtier_resume_bench_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  testing::KvtierdProcess d(dir);
  d.WriteConfig(
      "[storage]\ndram_capacity_bytes = 268435456\nssd_capacity_bytes = 1073741824\n"
      "ssd_segment_bytes = 67108864\n"
      "durability = \"batched\"\n");
  if (!d.Start()) return std::fprintf(stderr, "kvtierd did not start\n"), 1;
  SessionOptions so;
  so.guard = GuardMode::kAlwaysFetch;
  auto fp = EngineModelFingerprint((*e)->config(), *w, so.unit_tokens);
  if (!fp.ok()) return 1;
  std::printf("%-7s %-28s %10s %10s %9s\n", "tokens", "path", "seconds", "recompute", "ratio");
  for (uint64_t n : ParseList(lengths)) {
    const std::vector<int32_t> tokens = engine::AgentText(static_cast<uint32_t>(n), n);
    daemon::ClientOptions co;
    co.socket_path = d.socket();
    auto c = daemon::Client::Connect(co);
    if (!c.ok()) return 1;
    auto store = SessionStore::Create(e->get(), c->get(), *fp, so);
    if (!store.ok()) return 1;
    SequenceState st = (*e)->NewSequence();
    std::vector<float> logits;
    const auto t0 = Clock::now();
    if (!(*store)->Prefill(&st, tokens, &logits).ok()) return 1;
    const double recompute_s = Since(t0);
    SaveCursor cursor;
    if (!(*store)->Save(st, logits, &cursor).ok()) return 1;
    auto resume = [&](const char* label, bool hot, daemon::Client* client) {
      SessionOptions o = so;
      o.use_hot_state = hot;
      auto s = SessionStore::Create(e->get(), client, *fp, o);
      SequenceState r;
      std::vector<float> rl;
      auto rep = (*s)->Resume(tokens, &r, &rl);
      if (!rep.ok()) {
        std::fprintf(stderr, "%s\n", rep.status().ToString().c_str());
        return;
      }
      std::printf("%-7llu %-28s %10.4f %10.3f %8.1fx   (units dram %lld ssd %lld, replay %lld)\n",
                  static_cast<unsigned long long>(n), label, rep->total_s, recompute_s,
                  recompute_s / rep->total_s, static_cast<long long>(rep->units_by_tier[1]),
                  static_cast<long long>(rep->units_by_tier[2]),
                  static_cast<long long>(rep->replay_tokens));
      std::fflush(stdout);
    };
    resume("1st resume, hot state (exact)", true, c->get());
    resume("2nd resume, bounded replay", false, c->get());
    c->reset();
    if (d.Stop() != 0 || !d.Start()) return std::fprintf(stderr, "restart failed\n"), 1;
    auto c2 = daemon::Client::Connect(co);
    if (!c2.ok()) return 1;
    resume("after restart, bounded replay", true, c2->get());
  }
  d.Stop();
  std::filesystem::remove_all(dir);
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
  std::shared_ptr<const ModelWeights> w;
  auto e = MakeEngine(model, static_cast<int>(threads), &w);
  if (!e.ok()) return std::fprintf(stderr, "%s\n", e.status().ToString().c_str()), 1;
  Engine& eng = **e;
  auto layout = EngineKvLayout(eng.config());
  if (!layout.ok()) return 1;
  const UnitPayloadLayout pl = UnitPayloadLayout::For(*layout);
  std::printf("%-7s %-7s %8s %12s %12s %10s\n", "length", "prompts", "top1", "kl_mean", "kl_max",
              "exact");
  for (uint64_t n : ParseList(lengths)) {
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
