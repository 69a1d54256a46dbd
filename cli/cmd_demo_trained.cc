// `kvtier demo`, last part: the trained miniature (deploy/models/kvmini-trained.*) writes a
// few lines of text from a prompt, and bounded replay is measured against the uninterrupted
// session on a fixed text (engine/fidelity.h), at the default replay length.
#include "cli/cmd_demo_trained.h"

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "common/config.h"
#include "engine/config.h"
#include "engine/fidelity.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "engine/session.h"
#include "engine/tokenizer.h"
#include "engine/weights.h"

namespace kvtier::cli {
namespace {

// The prompt the model continues (sampled at temperature 0.7, top-p 0.9, seed 1: deterministic).
constexpr char kPrompt[] = "The system administrator opened the log file and found that";
constexpr size_t kGenerateTokens = 240;

// Teacher-forced text for the fidelity line: 128 tokens of history, 64 evaluated after it.
constexpr char kFidelityText[] =
    "When a long session is resumed, the cache returns the compressed keys and values of every "
    "earlier turn, and the engine rebuilds only its sliding window by replaying the last few "
    "tokens. The question is whether the next words it predicts are the ones it would have "
    "predicted had the session never left memory. This demo measures it on this very text.";

// A model config is a few KB; anything past this is not one.
constexpr size_t kMaxConfigBytes = 1 << 20;

}  // namespace

StatusOr<DemoModel> LoadDemoModel(const std::string& prefix) {
  KVTIER_ASSIGN_OR_RETURN(std::string config_json,
                          ReadFileBounded(prefix + ".json", kMaxConfigBytes));
  KVTIER_ASSIGN_OR_RETURN(engine::EngineConfig cfg, engine::ParseEngineConfig(config_json));
  KVTIER_ASSIGN_OR_RETURN(engine::ModelWeights w,
                          engine::LoadWeights(cfg, prefix + ".safetensors"));
  return DemoModel{std::move(cfg), std::make_shared<const engine::ModelWeights>(std::move(w))};
}

Status RunTrainedModelDemo(const DemoModel& m, const std::string& prefix, int threads) {
  const engine::EngineConfig& cfg = m.config;
  const std::shared_ptr<const engine::ModelWeights>& weights = m.weights;
  engine::EngineOptions eo;
  eo.threads = threads;
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<engine::Engine> e,
                          engine::Engine::Create(cfg, weights, eo));
  KVTIER_ASSIGN_OR_RETURN(engine::ByteTokenizer tok,
                          engine::ByteTokenizer::Create(cfg.vocab_size, cfg.engram_pad_token_id,
                                                        cfg.dspark_noise_token_id));

  std::printf("\n== the trained miniature (%s.safetensors) ==\n", prefix.c_str());
  std::vector<int32_t> prompt = {engine::ByteTokenizer::kBos};
  for (int32_t t : tok.Encode(kPrompt)) prompt.push_back(t);
  engine::SequenceState st = e->NewSequence();
  std::vector<float> logits;
  KVTIER_RETURN_IF_ERROR(e->PrefillCed(&st, prompt, &logits));
  engine::Sampler sampler(0.7, 0.9, 1);
  std::vector<int32_t> out;
  for (size_t i = 0; i < kGenerateTokens; ++i) {
    const int32_t next = sampler.Sample(logits);
    if (next == engine::ByteTokenizer::kEos) break;
    out.push_back(next);
    KVTIER_RETURN_IF_ERROR(e->Decode(&st, next, &logits));
  }
  std::printf("prompt: %s\ncontinuation: %s\n", kPrompt, tok.Decode(out).c_str());

  std::vector<int32_t> text = {engine::ByteTokenizer::kBos};
  for (int32_t t : tok.Encode(kFidelityText)) text.push_back(t);
  const int64_t replay = engine::kDefaultReplayWindows * cfg.sliding_window;
  engine::FidelityOptions fo;
  fo.histories = {128};
  fo.replay_tokens = {replay};
  fo.eval_tokens = 64;
  fo.unit_tokens = 64;
  KVTIER_ASSIGN_OR_RETURN(engine::FidelityReport rep,
                          engine::MeasureFidelity(e.get(), *weights, text, fo));
  const engine::FidelityHistory& h = rep.histories.front();
  const engine::FidelityScore& r = h.replay.front();
  std::printf(
      "fidelity (history %lld, %lld positions, teacher-forced): exact restore top-1 %.3f KL "
      "%.2g; bounded replay of %lld tokens top-1 %.3f KL mean %.2g nats\n",
      static_cast<long long>(h.history), static_cast<long long>(h.positions),
      h.exact.top1_agreement, h.exact.kl_mean, static_cast<long long>(replay), r.top1_agreement,
      r.kl_mean);
  return Status::Ok();
}

}  // namespace kvtier::cli
