// DSpark speculative decoding against plain decoding at several concurrencies
// (docs/performance/speculative.md). Greedy generation of --max-new tokens
// after each of --prompts prompts cut from --text (evenly spaced, --prompt-bytes each, bos
// first). At concurrency C the prompts run in groups of C sequences: plain decoding steps all
// live sequences in one Engine::ForwardBatch, speculative settings run
// SpeculativeDecoder::RoundBatch (drafts of all live sequences verified in one ForwardBatch);
// a sequence leaves its group when it has its tokens. Per group every setting runs in turn
// (plain, fixed draft lengths, the load-aware scheduler, whose SPS table is measured per
// concurrency on the first group), so load changes hit all of them alike; the order rotates
// by one setting per group, so that no setting always runs first or last. --plain-control
// adds a second plain arm ("plain again"): its ratio to the first is the comparison's noise
// floor. Decode time only (the prefill is the same for all). Checks that every speculative
// output equals plain greedy's and exits 1 when one differs. verify_ms is the wall time in
// the batched passes, the plain arms' too: an arm's wall time (tokens / tokens/s) less it is
// what the arm does outside its passes.
//
//   kvtier_spec_bench --config C --model M --draft D --text FILE
//                     [--prompts N --prompt-bytes B --max-new N --draft-lens 1,3,5
//                      --concurrency 1,4,16 --threads 1 --plain-control]
#include <time.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "bench/speculative/spec_model.h"
#include "cli/flags.h"
#include "engine/dspark.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "engine/speculative.h"
#include "engine/weights.h"

namespace kvtier::engine {
namespace {

constexpr uint64_t kPromptsMax = 1000, kMaxNewMax = 4096, kPromptBytesMax = 4096;
constexpr uint64_t kConcurrencyMax = 64;  // sequences per group
constexpr uint64_t kThreadsMax = 64;

// CPU time of the engine: this thread's with --threads 1 (the engine runs on the caller's
// thread), the process's with more (the pool's workers too). On a shared machine the wall clock
// also counts the time other processes hold the cores.
double CpuSeconds(bool one_thread) {
  timespec ts{};
  clock_gettime(one_thread ? CLOCK_THREAD_CPUTIME_ID : CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

struct Row {
  std::string name;
  int draft_len = 0;  // -1: scheduler; -2: plain; -3: plain again (--plain-control)
  double seconds = 0, cpu_seconds = 0;
  uint64_t tokens = 0, mismatches = 0;
  SpeculativeStats stats;
};

int Fail(const Status& s) {
  std::fprintf(stderr, "kvtier_spec_bench: %s\n", s.ToString().c_str());
  return 1;
}

// Comma-separated integers in [lo, hi], at most kListMax of them.
constexpr size_t kListMax = 16;
bool ParseList(const std::string& text, int lo, int hi, std::vector<int>* out) {
  std::vector<uint64_t> v;
  if (lo < 0 ||
      !cli::ParseUintList(text, static_cast<uint64_t>(lo), static_cast<uint64_t>(hi), kListMax, &v))
    return false;
  out->assign(v.begin(), v.end());
  return true;
}

void Add(const SpeculativeStats& ds, SpeculativeStats* to) {
  to->rounds += ds.rounds;
  to->drafted += ds.drafted;
  to->accepted += ds.accepted;
  to->emitted += ds.emitted;
  to->draft_us += ds.draft_us;
  to->verify_us += ds.verify_us;
  to->rollback_us += ds.rollback_us;
  to->chosen_b.resize(std::max(to->chosen_b.size(), ds.chosen_b.size()));
  for (size_t b = 0; b < ds.chosen_b.size(); ++b) to->chosen_b[b] += ds.chosen_b[b];
}

int Main(int argc, char** argv) {
  cli::FlagSet flags("kvtier_spec_bench", "DSpark speculative decoding vs plain greedy decoding");
  SpecPaths paths;
  std::string lens = "1,3,5", conc = "1,4,16";
  uint64_t prompts = 16, prompt_bytes = 96, max_new = 96, threads = 1;
  bool plain_control = false;
  AddSpecPathFlags(&flags, &paths);
  flags.Uint("prompts", &prompts, "prompts");
  flags.Uint("prompt-bytes", &prompt_bytes, "bytes per prompt");
  flags.Uint("max-new", &max_new, "tokens generated per prompt and setting");
  flags.String("draft-lens", &lens, "LIST", "fixed draft lengths to compare (comma separated)");
  flags.String("concurrency", &conc, "LIST",
               "sequences decoded together (comma separated, each dividing --prompts)");
  flags.Uint("threads", &threads, "engine threads (the caller's included)");
  flags.Bool("plain-control", &plain_control,
             "also run plain decoding a second time, as a setting of its own (the noise floor)");
  std::vector<std::string_view> args(argv + 1, argv + argc);
  if (int rc = flags.Parse(args); rc >= 0) return rc;
  if (prompts == 0 || prompts > kPromptsMax || max_new == 0 || max_new > kMaxNewMax ||
      prompt_bytes == 0 || prompt_bytes > kPromptBytesMax || threads == 0 ||
      threads > kThreadsMax) {
    std::fprintf(stderr,
                 "kvtier_spec_bench: --prompts 1..%llu, --max-new 1..%llu, "
                 "--prompt-bytes 1..%llu, --threads 1..%llu\n",
                 (unsigned long long)kPromptsMax, (unsigned long long)kMaxNewMax,
                 (unsigned long long)kPromptBytesMax, (unsigned long long)kThreadsMax);
    return 2;
  }
  std::vector<int> concurrencies;
  if (!ParseList(conc, 1, static_cast<int>(kConcurrencyMax), &concurrencies)) {
    std::fprintf(stderr, "kvtier_spec_bench: --concurrency: up to %zu values in 1..%llu\n",
                 kListMax, (unsigned long long)kConcurrencyMax);
    return 2;
  }
  for (int c : concurrencies) {
    if (prompts % static_cast<uint64_t>(c) != 0) {
      std::fprintf(stderr, "kvtier_spec_bench: --concurrency %d does not divide --prompts\n", c);
      return 2;
    }
  }
  auto m = LoadSpecModel(paths);
  if (!m.ok()) return Fail(m.status());
  const SpecModel& sm = *m;
  std::vector<int> draft_lens;
  if (!ParseList(lens, 0, sm.dconfig.block_size, &draft_lens))
    return Fail(Status::InvalidArgument("bad --draft-lens"));
  EngineOptions eo;
  eo.threads = static_cast<int>(threads);
  auto eng = Engine::Create(sm.config, sm.weights, eo);
  if (!eng.ok()) return Fail(eng.status());
  Engine& e = **eng;
  auto read = ReadSpecText(paths.text);
  if (!read.ok()) return Fail(read.status());
  const std::string& text = *read;
  if (text.size() < prompt_bytes * prompts) return Fail(Status::InvalidArgument("text too short"));
  const size_t stride = text.size() / prompts;
  auto prompt_of = [&](uint64_t p) {
    std::vector<int32_t> prompt = {0};
    for (size_t i = 0; i < prompt_bytes; ++i)
      prompt.push_back(3 + static_cast<unsigned char>(text[p * stride + i]));
    return prompt;
  };
  using Clock = std::chrono::steady_clock;
  bool ok = true;
  for (const int C : concurrencies) {
    std::vector<Row> rows = {{"plain", -2}};
    for (int k : draft_lens) rows.push_back({"fixed " + std::to_string(k), k});
    rows.push_back({"scheduler", -1});
    if (plain_control) rows.push_back({"plain again", -3});
    DraftScheduler scheduler(C * (sm.dconfig.block_size + 1), CpuCostClock(e));
    bool measured = false;
    for (uint64_t g = 0; g < prompts / C; ++g) {
      std::vector<std::vector<std::vector<int32_t>>> outs(rows.size());  // per row, per sequence
      for (size_t q = 0; q < rows.size(); ++q) {
        const size_t ri = (q + g) % rows.size();
        Row& r = rows[ri];
        std::vector<SequenceState> st;
        std::vector<std::vector<int32_t>> out(C);
        std::vector<Sampler> samplers(C, Sampler(0, 1, 0));
        std::vector<float> logits;
        Status s;
        if (r.draft_len <= -2) {
          std::vector<std::vector<float>> last(C);
          for (int i = 0; i < C; ++i) {
            st.push_back(e.NewSequence());
            if (!(s = e.Forward(&st[i], prompt_of(g * C + i), false, &last[i])).ok())
              return Fail(s);
          }
          const auto t0 = Clock::now();
          const double c0 = CpuSeconds(threads == 1);
          for (uint64_t n = 0; n < max_new; ++n) {
            std::vector<int32_t> next(C);
            std::vector<SequenceState*> ptrs;
            std::vector<std::span<const int32_t>> spans;
            for (int i = 0; i < C; ++i) {
              out[i].push_back(samplers[i].Sample(last[i]));
              next[i] = out[i].back();
              ptrs.push_back(&st[i]);
              spans.emplace_back(&next[i], 1);
            }
            if (n + 1 == max_new) continue;
            // Timed as the decoder times its own pass (verify_ms), so that what each arm does
            // outside its passes can be compared.
            const auto p0 = Clock::now();
            if (!(s = e.ForwardBatch(ptrs, spans, &last)).ok()) return Fail(s);
            r.stats.verify_us +=
                static_cast<uint64_t>(C) *
                static_cast<uint64_t>(
                    std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - p0)
                        .count());
          }
          r.seconds += std::chrono::duration<double>(Clock::now() - t0).count();
          r.cpu_seconds += CpuSeconds(threads == 1) - c0;
        } else {
          SpeculativeOptions o;
          o.scheduler = r.draft_len < 0;
          o.draft_len = std::max(0, r.draft_len);
          std::vector<std::unique_ptr<SpeculativeDecoder>> decs;
          for (int i = 0; i < C; ++i) {
            decs.push_back(std::make_unique<SpeculativeDecoder>(
                &e, sm.draft.get(), sm.weights.get(), &scheduler, o, &samplers[i]));
            st.push_back(e.NewSequence());
            int32_t first = -1;
            if (!(s = decs[i]->Start(&st[i], prompt_of(g * C + i), &first)).ok()) return Fail(s);
            out[i].push_back(first);
          }
          if (o.scheduler && !measured) {
            if (!(s = MeasureSpsBatch(&e, st, 3, &scheduler)).ok()) return Fail(s);
            measured = true;
          }
          const auto t0 = Clock::now();
          const double c0 = CpuSeconds(threads == 1);
          for (;;) {
            std::vector<SpeculativeDecoder*> live;
            std::vector<SequenceState*> ptrs;
            std::vector<int> idx;
            for (int i = 0; i < C; ++i) {
              if (out[i].size() >= max_new) continue;
              live.push_back(decs[i].get());
              ptrs.push_back(&st[i]);
              idx.push_back(i);
            }
            if (live.empty()) break;
            std::vector<std::vector<int32_t>> got(live.size());
            if (!(s = SpeculativeDecoder::RoundBatch(live, ptrs, &got)).ok()) return Fail(s);
            for (size_t j = 0; j < live.size(); ++j)
              out[idx[j]].insert(out[idx[j]].end(), got[j].begin(), got[j].end());
          }
          r.seconds += std::chrono::duration<double>(Clock::now() - t0).count();
          r.cpu_seconds += CpuSeconds(threads == 1) - c0;
          for (int i = 0; i < C; ++i) {
            out[i].resize(max_new);
            Add(decs[i]->stats(), &r.stats);
          }
        }
        r.tokens += static_cast<uint64_t>(C) * max_new;
        outs[ri] = std::move(out);
      }
      for (size_t ri = 1; ri < rows.size(); ++ri) {  // rows[0] is plain
        for (int i = 0; i < C; ++i) rows[ri].mismatches += outs[ri][i] != outs[0][i] ? 1 : 0;
      }
    }
    const double plain_tps = rows[0].tokens / rows[0].seconds;
    const double plain_cpu_tps = rows[0].tokens / rows[0].cpu_seconds;
    std::printf("concurrency %d (%llu prompts, %llu new tokens each)\n", C,
                (unsigned long long)prompts, (unsigned long long)max_new);
    std::printf("%-11s %9s %7s %9s %7s %12s %10s %9s %9s %9s %s\n", "setting", "tokens/s",
                "speedup", "cpu_tok/s", "cpu_x", "accepted/ver", "tokens/ver", "draft_ms",
                "verify_ms", "rollbk_ms", "B chosen (sequence-rounds at B = 0..K)");
    for (const Row& r : rows) {
      const double tps = r.tokens / r.seconds, ctps = r.tokens / r.cpu_seconds;
      if (r.draft_len <= -2) {
        std::printf("%-11s %9.1f %7.2f %9.1f %7.2f %12s %10s %9s %9.1f%s\n", r.name.c_str(), tps,
                    tps / plain_tps, ctps, ctps / plain_cpu_tps, "-", "-", "-",
                    r.stats.verify_us / 1e3 / C, r.mismatches ? "  OUTPUT DIFFERS FROM PLAIN" : "");
        ok = ok && r.mismatches == 0;
        continue;
      }
      // Per sequence-round: a batched round counts once per sequence in it.
      const double n = static_cast<double>(std::max<uint64_t>(1, r.stats.rounds));
      std::string chosen;
      for (size_t b = 0; b < r.stats.chosen_b.size(); ++b)
        chosen += (b ? "," : "") + std::to_string(r.stats.chosen_b[b]);
      std::printf("%-11s %9.1f %7.2f %9.1f %7.2f %12.2f %10.2f %9.1f %9.1f %9.1f [%s]%s\n",
                  r.name.c_str(), tps, tps / plain_tps, ctps, ctps / plain_cpu_tps,
                  r.stats.accepted / n, r.stats.emitted / n, r.stats.draft_us / 1e3,
                  r.stats.verify_us / 1e3 / C, r.stats.rollback_us / 1e3, chosen.c_str(),
                  r.mismatches ? "  OUTPUT DIFFERS FROM PLAIN" : "");
      ok = ok && r.mismatches == 0;
    }
    // Why the scheduler drafted or not (DraftScheduler::Decisions, one per round of the live
    // sequences of a group).
    const DraftScheduler::Decisions& dd = scheduler.decisions();
    std::printf(
        "scheduler rounds: drafting pays %llu, probes %llu (+%llu first), no %llu, plain probes "
        "%llu, new batch sizes %llu, no room %llu\n",
        (unsigned long long)dd.pays, (unsigned long long)dd.probes, (unsigned long long)dd.first,
        (unsigned long long)dd.no, (unsigned long long)dd.plain_probes,
        (unsigned long long)dd.new_size, (unsigned long long)dd.full);
    std::fflush(stdout);
  }
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace kvtier::engine

int main(int argc, char** argv) { return kvtier::engine::Main(argc, argv); }
