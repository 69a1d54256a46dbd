// DSpark speculative decoding against plain decoding, concurrency 1 (docs/PERFORMANCE.md,
// "Speculative decoding"). Greedy generation of --max-new tokens after each of --prompts
// prompts cut from --text (evenly spaced, --prompt-bytes each, bos first); per prompt every
// setting runs in turn (plain, fixed draft lengths, the scheduler), so load changes hit all of
// them alike. Decode time only (the prefill is the same Forward for all). Checks that every
// speculative output equals plain greedy's and exits 1 when one differs.
//
//   kvtier_spec_bench --config C --model M --draft D --text FILE
//                     [--prompts N --prompt-bytes B --max-new N --draft-lens 1,3,5]
#include <time.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "cli/flags.h"
#include "engine/dspark.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "engine/speculative.h"
#include "engine/weights.h"

namespace kvtier::engine {
namespace {

constexpr uint64_t kPromptsMax = 1000, kMaxNewMax = 4096, kPromptBytesMax = 4096;
constexpr size_t kTextBytesMax = 64u << 20;

// CPU time of this thread (the engine runs on the caller's thread with threads = 1): on a shared
// machine the wall clock also counts the time other processes hold the cores.
double CpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

struct Row {
  std::string name;
  int draft_len = 0;  // -1: scheduler; -2: plain
  double seconds = 0, cpu_seconds = 0;
  uint64_t tokens = 0, mismatches = 0;
  SpeculativeStats stats;
};

int Fail(const Status& s) {
  std::fprintf(stderr, "kvtier_spec_bench: %s\n", s.ToString().c_str());
  return 1;
}

int Main(int argc, char** argv) {
  cli::FlagSet flags("kvtier_spec_bench", "DSpark speculative decoding vs plain greedy decoding");
  std::string config, model, draft_path, text_path, lens = "1,3,5";
  uint64_t prompts = 16, prompt_bytes = 96, max_new = 96;
  flags.String("config", &config, "FILE", "model config.json", true);
  flags.String("model", &model, "FILE", "backbone weights", true);
  flags.String("draft", &draft_path, "FILE", "DSpark weights", true);
  flags.String("text", &text_path, "FILE", "text to cut prompts from (e.g. build/corpus/val.txt)",
               true);
  flags.Uint("prompts", &prompts, "prompts");
  flags.Uint("prompt-bytes", &prompt_bytes, "bytes per prompt");
  flags.Uint("max-new", &max_new, "tokens generated per prompt and setting");
  flags.String("draft-lens", &lens, "LIST", "fixed draft lengths to compare (comma separated)");
  std::vector<std::string_view> args(argv + 1, argv + argc);
  if (int rc = flags.Parse(args); rc >= 0) return rc;
  if (prompts == 0 || prompts > kPromptsMax || max_new == 0 || max_new > kMaxNewMax ||
      prompt_bytes == 0 || prompt_bytes > kPromptBytesMax) {
    std::fprintf(stderr,
                 "kvtier_spec_bench: --prompts 1..%llu, --max-new 1..%llu, "
                 "--prompt-bytes 1..%llu\n",
                 (unsigned long long)kPromptsMax, (unsigned long long)kMaxNewMax,
                 (unsigned long long)kPromptBytesMax);
    return 2;
  }
  auto cfg = LoadEngineConfig(config);
  if (!cfg.ok()) return Fail(cfg.status());
  auto dc = LoadDSparkConfig(config, *cfg);
  if (!dc.ok()) return Fail(dc.status());
  auto w = LoadWeights(*cfg, model);
  if (!w.ok()) return Fail(w.status());
  auto weights = std::make_shared<const ModelWeights>(std::move(*w));
  auto draft = DSpark::Load(*cfg, *dc, weights, draft_path);
  if (!draft.ok()) return Fail(draft.status());
  auto eng = Engine::Create(*cfg, weights, EngineOptions{});
  if (!eng.ok()) return Fail(eng.status());
  Engine& e = **eng;
  std::ifstream in(text_path, std::ios::binary);
  if (!in) return Fail(Status::IOError("cannot open " + text_path));
  std::string text(kTextBytesMax, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  if (text.size() < prompt_bytes * prompts) return Fail(Status::InvalidArgument("text too short"));

  std::vector<Row> rows = {{"plain", -2}};
  std::stringstream ls(lens);
  for (std::string item; std::getline(ls, item, ',');) {
    const int k = std::atoi(item.c_str());
    if (k < 0 || k > dc->block_size) return Fail(Status::InvalidArgument("bad --draft-lens"));
    rows.push_back({"fixed " + std::to_string(k), k});
  }
  rows.push_back({"scheduler", -1});
  DraftScheduler scheduler(dc->block_size + 1);
  bool measured = false;
  using Clock = std::chrono::steady_clock;
  const size_t stride = text.size() / prompts;
  for (uint64_t p = 0; p < prompts; ++p) {
    std::vector<int32_t> prompt = {0};
    for (size_t i = 0; i < prompt_bytes; ++i)
      prompt.push_back(3 + static_cast<unsigned char>(text[p * stride + i]));
    std::vector<int32_t> want;
    for (Row& r : rows) {
      SequenceState st = e.NewSequence();
      std::vector<int32_t> out;
      Sampler sampler(0, 1, 0);
      if (r.draft_len == -2) {
        std::vector<float> logits;
        Status s = e.Forward(&st, prompt, false, &logits);
        if (!s.ok()) return Fail(s);
        const auto t0 = Clock::now();
        const double c0 = CpuSeconds();
        for (uint64_t i = 0; i < max_new; ++i) {
          out.push_back(sampler.Sample(logits));
          if (i + 1 < max_new && !(s = e.Decode(&st, out.back(), &logits)).ok()) return Fail(s);
        }
        r.seconds += std::chrono::duration<double>(Clock::now() - t0).count();
        r.cpu_seconds += CpuSeconds() - c0;
        want = out;
      } else {
        SpeculativeOptions o;
        o.scheduler = r.draft_len < 0;
        o.draft_len = std::max(0, r.draft_len);
        SpeculativeDecoder dec(&e, draft->get(), weights.get(), &scheduler, o, &sampler);
        int32_t first = -1;
        Status s = dec.Start(&st, prompt, &first);
        if (!s.ok()) return Fail(s);
        if (o.scheduler && !measured) {
          if (!(s = MeasureSps(&e, st, 5, &scheduler)).ok()) return Fail(s);
          measured = true;
        }
        out.push_back(first);
        const auto t0 = Clock::now();
        const double c0 = CpuSeconds();
        while (out.size() < max_new) {
          if (!(s = dec.Round(&st, &out)).ok()) return Fail(s);
        }
        r.seconds += std::chrono::duration<double>(Clock::now() - t0).count();
        r.cpu_seconds += CpuSeconds() - c0;
        out.resize(max_new);
        const SpeculativeStats& ds = dec.stats();
        r.stats.rounds += ds.rounds;
        r.stats.drafted += ds.drafted;
        r.stats.accepted += ds.accepted;
        r.stats.emitted += ds.emitted;
        r.stats.draft_us += ds.draft_us;
        r.stats.verify_us += ds.verify_us;
        r.stats.rollback_us += ds.rollback_us;
        r.stats.chosen_b.resize(ds.chosen_b.size());
        for (size_t b = 0; b < ds.chosen_b.size(); ++b) r.stats.chosen_b[b] += ds.chosen_b[b];
        r.mismatches += out != want ? 1 : 0;
      }
      r.tokens += max_new;
    }
  }
  const double plain_tps = rows[0].tokens / rows[0].seconds;
  const double plain_cpu_tps = rows[0].tokens / rows[0].cpu_seconds;
  std::printf("%-10s %9s %7s %9s %7s %12s %10s %9s %9s %9s %s\n", "setting", "tokens/s", "speedup",
              "cpu_tok/s", "cpu_x", "accepted/ver", "tokens/ver", "draft_ms", "verify_ms",
              "rollbk_ms", "B chosen");
  bool ok = true;
  for (const Row& r : rows) {
    const double tps = r.tokens / r.seconds, ctps = r.tokens / r.cpu_seconds;
    if (r.draft_len == -2) {
      std::printf("%-10s %9.1f %7.2f %9.1f %7.2f %12s %10s\n", r.name.c_str(), tps, 1.0, ctps, 1.0,
                  "-", "-");
      continue;
    }
    const double n = static_cast<double>(std::max<uint64_t>(1, r.stats.rounds));
    std::string chosen;
    for (size_t b = 0; b < r.stats.chosen_b.size(); ++b)
      chosen += (b ? "," : "") + std::to_string(r.stats.chosen_b[b]);
    std::printf("%-10s %9.1f %7.2f %9.1f %7.2f %12.2f %10.2f %9.1f %9.1f %9.1f [%s]%s\n",
                r.name.c_str(), tps, tps / plain_tps, ctps, ctps / plain_cpu_tps,
                r.stats.accepted / n, r.stats.emitted / n, r.stats.draft_us / 1e3,
                r.stats.verify_us / 1e3, r.stats.rollback_us / 1e3, chosen.c_str(),
                r.mismatches ? "  OUTPUT DIFFERS FROM PLAIN" : "");
    ok = ok && r.mismatches == 0;
  }
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace kvtier::engine

int main(int argc, char** argv) { return kvtier::engine::Main(argc, argv); }
