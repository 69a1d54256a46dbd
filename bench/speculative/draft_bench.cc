// The DSpark draft pass alone, against the backbone decode step it has to beat
// (docs/performance/speculative.md, "The draft pass"). For each of --prompts prompts cut from
// --text, the backbone runs prompt + --rounds x --accept tokens of the text once, capturing
// the draft's target layers; then, as speculative decoding does each round, the draft context
// observes --accept more positions and one draft pass runs after them (`last` = the text's
// token there). Reported: microseconds per Observe and per Draft, the same for one backbone
// decode step on the same thread (the peer: a round pays off only when the draft costs a
// small part of a step), their ratio, and a digest of every drafted token, confidence and
// logit (bit for bit; equal digests = the same draft).
//
//   kvtier_bench_draft --config C --model M --draft D --text FILE
//                      [--prompts 16 --prompt-bytes 96 --rounds 24 --accept 4 --repeat 3
//                       --no-peer]
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "bench/speculative/spec_model.h"
#include "cli/flags.h"
#include "engine/dspark.h"
#include "engine/model.h"
#include "engine/weights.h"

namespace kvtier::engine {
namespace {

constexpr uint64_t kPromptsMax = 1000, kRoundsMax = 1000, kAcceptMax = 16, kRepeatMax = 100;
constexpr uint64_t kPromptBytesMax = 4096;

int Fail(const Status& s) {
  std::fprintf(stderr, "kvtier_bench_draft: %s\n", s.ToString().c_str());
  return 1;
}

// FNV-1a over bytes.
void Mix(uint64_t* h, const void* p, size_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) *h = (*h ^ b[i]) * 1099511628211ull;
}

int Main(int argc, char** argv) {
  SpecPaths paths;
  uint64_t prompts = 16, prompt_bytes = 96, rounds = 24, accept = 4, repeat = 3;
  bool no_peer = false;
  cli::FlagSet flags("kvtier_bench_draft", "the DSpark draft pass against a backbone decode step");
  AddSpecPathFlags(&flags, &paths);
  flags.Uint("prompts", &prompts, "prompts");
  flags.Uint("prompt-bytes", &prompt_bytes, "bytes per prompt");
  flags.Uint("rounds", &rounds, "draft passes per prompt");
  flags.Uint("accept", &accept, "positions observed before each draft pass");
  flags.Uint("repeat", &repeat, "times the whole measurement runs (the fastest is reported)");
  flags.Bool("no-peer", &no_peer, "skip the backbone decode steps (for a profiler)");
  std::vector<std::string_view> args(argv + 1, argv + argc);
  if (int rc = flags.Parse(args); rc >= 0) return rc;
  if (prompts == 0 || prompts > kPromptsMax || rounds == 0 || rounds > kRoundsMax || accept == 0 ||
      accept > kAcceptMax || repeat == 0 || repeat > kRepeatMax || prompt_bytes == 0 ||
      prompt_bytes > kPromptBytesMax) {
    std::fprintf(stderr,
                 "kvtier_bench_draft: --prompts 1..%llu, --rounds 1..%llu, --accept 1..%llu, "
                 "--repeat 1..%llu, --prompt-bytes 1..%llu\n",
                 (unsigned long long)kPromptsMax, (unsigned long long)kRoundsMax,
                 (unsigned long long)kAcceptMax, (unsigned long long)kRepeatMax,
                 (unsigned long long)kPromptBytesMax);
    return 2;
  }
  auto m = LoadSpecModel(paths);
  if (!m.ok()) return Fail(m.status());
  const EngineConfig* cfg = &m->config;
  const DSpark* draft = m->draft.get();
  EngineOptions eo;
  eo.threads = 1;
  auto eng = Engine::Create(*cfg, m->weights, eo);
  if (!eng.ok()) return Fail(eng.status());
  Engine& e = **eng;
  auto read = ReadSpecText(paths.text);
  if (!read.ok()) return Fail(read.status());
  const std::string& text = *read;
  const uint64_t len = prompt_bytes + rounds * accept + 1;
  if (text.size() < len * prompts) return Fail(Status::InvalidArgument("text too short"));
  const size_t stride = text.size() / prompts;
  const int64_t W = cfg->sliding_window;

  // The captures of every prompt's whole text (the backbone's part, not timed).
  std::vector<std::vector<int32_t>> toks(prompts);
  std::vector<AttnInputCapture> caps(prompts);
  for (uint64_t p = 0; p < prompts; ++p) {
    toks[p] = {0};
    for (size_t i = 0; i < len; ++i)
      toks[p].push_back(3 + static_cast<unsigned char>(text[p * stride + i]));
    caps[p].layers = draft->target_layers();
    caps[p].record_normed = false;
    SequenceState st = e.NewSequence();
    std::vector<float> logits;
    e.set_attn_capture(&caps[p]);
    Status s = e.Forward(&st, toks[p], false, &logits);
    e.set_attn_capture(nullptr);
    if (!s.ok()) return Fail(s);
  }

  using Clock = std::chrono::steady_clock;
  auto us = [](Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double, std::micro>(b - a).count();
  };
  double best_observe = 1e300, best_draft = 1e300, best_decode = 1e300;
  uint64_t digest = 0;
  for (uint64_t rep = 0; rep < repeat; ++rep) {
    double observe_us = 0, draft_us = 0, decode_us = 0;
    uint64_t h = 1469598103934665603ull;
    for (uint64_t p = 0; p < prompts; ++p) {
      const int64_t n0 = static_cast<int64_t>(prompt_bytes) + 1;
      DraftContext ctx;
      Status s = draft->Observe(caps[p], n0 - W, W, &ctx);
      if (!s.ok()) return Fail(s);
      DraftResult r;
      for (uint64_t k = 0; k < rounds; ++k) {
        const int64_t from = n0 + static_cast<int64_t>(k * accept);
        const auto t0 = Clock::now();
        s = draft->Observe(caps[p], from, static_cast<int64_t>(accept), &ctx);
        const auto t1 = Clock::now();
        if (!s.ok()) return Fail(s);
        s = draft->Draft(ctx, toks[p][static_cast<size_t>(ctx.end())], 0, {}, &r);
        const auto t2 = Clock::now();
        if (!s.ok()) return Fail(s);
        observe_us += us(t0, t1);
        draft_us += us(t1, t2);
        Mix(&h, r.tokens.data(), r.tokens.size() * 4);
        Mix(&h, r.confidence.data(), r.confidence.size() * 4);
        for (const std::vector<float>& l : r.logits) Mix(&h, l.data(), l.size() * 4);
      }
      // The peer: backbone decode steps over the same text after the prompt.
      if (no_peer) continue;
      SequenceState st = e.NewSequence();
      std::vector<float> logits;
      s = e.Forward(&st, std::span<const int32_t>(toks[p].data(), static_cast<size_t>(n0)), false,
                    &logits);
      if (!s.ok()) return Fail(s);
      const auto t0 = Clock::now();
      for (uint64_t k = 0; k < rounds; ++k) {
        s = e.Decode(&st, toks[p][static_cast<size_t>(n0) + k], &logits);
        if (!s.ok()) return Fail(s);
      }
      decode_us += us(t0, Clock::now());
    }
    const double passes = static_cast<double>(prompts * rounds);
    best_observe = std::min(best_observe, observe_us / passes);
    best_draft = std::min(best_draft, draft_us / passes);
    best_decode = std::min(best_decode, decode_us / passes);
    if (rep > 0 && h != digest) return Fail(Status::Internal("the draft differs between runs"));
    digest = h;
  }
  std::printf("draft passes      %llu x %llu (observing %llu positions before each)\n",
              (unsigned long long)prompts, (unsigned long long)rounds, (unsigned long long)accept);
  std::printf("observe us/pass   %.2f\n", best_observe);
  std::printf("draft us/pass     %.2f\n", best_draft);
  std::printf("decode us/step    %.2f   (backbone, 1 thread; the peer)\n", best_decode);
  std::printf("draft+observe / decode  %.3f\n", (best_observe + best_draft) / best_decode);
  std::printf("digest            %016llx\n", (unsigned long long)digest);
  return 0;
}

}  // namespace
}  // namespace kvtier::engine

int main(int argc, char** argv) { return kvtier::engine::Main(argc, argv); }
