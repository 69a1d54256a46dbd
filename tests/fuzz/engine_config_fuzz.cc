// libFuzzer target: the model config parser (engine/config.h) on arbitrary text, and the engine
// on whatever small config it accepts. config.json is user input; every config Validate()
// accepts is a promise that the engine can run it.
//
// Invariants, beyond no crash, no out-of-bounds access (ASan) and no undefined behaviour (UBSan):
//   - an accepted config has its derived fields filled (a layer mode per layer, the CED split
//     inside the layers) and gives a parameter list and Engram table sizes without error;
//   - DSpark keys the draft's parser accepts lie within the backbone (block size, noise token,
//     target layers);
//   - when its weights are small (kWeightBytesMax, so the fuzzer stays fast), weights made
//     from it build an engine that runs a prompt longer than its window, one decode step and a
//     two-sequence batch, each OK with finite logits of vocab_size floats.
//
//   cmake --preset fuzz && cmake --build --preset fuzz --target kvtier_engine_config_fuzz
//   build/fuzz/tests/fuzz/kvtier_engine_config_fuzz -dict=tests/fuzz/engine_config.dict \
//     -max_total_time=60 <corpus dir holding deploy/models/*.json>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "engine/config.h"
#include "engine/dspark.h"
#include "engine/model.h"
#include "engine/weights.h"
#include "tests/fuzz/fuzz_require.h"

namespace {

using kvtier::fuzz::Require;

using namespace kvtier::engine;

// Weight bytes above which a config is only parsed, not run (about 400,000 F32 parameters).
constexpr uint64_t kWeightBytesMax = 1'600'000;
// Tokens of the prompt run through an accepted config (more than its window when it allows).
constexpr int64_t kPromptTokensMax = 96;

void RequireLogits(const std::vector<float>& logits, const EngineConfig& c) {
  Require(logits.size() == static_cast<size_t>(c.vocab_size));
  for (float v : logits) Require(std::isfinite(v));
}

void CheckDraftConfig(std::string_view text, const EngineConfig& c) {
  auto d = ParseDSparkConfig(std::string(text), c);
  if (!d.ok()) return;
  Require(d->block_size >= 1 && d->block_size <= kMaxDraftBlock);
  Require(d->noise_token_id >= 0 && d->noise_token_id < c.vocab_size);
  Require(!d->target_layer_ids.empty());
  for (int l : d->target_layer_ids) Require(l >= 0 && l < c.num_hidden_layers);
  Require(d->markov_rank > 0 && d->n_routed_experts > 0 && d->n_blocks > 0);
}

void Run(const EngineConfig& c) {
  auto weights = InitWeights(c, 1);
  Require(weights.ok());
  EngineOptions o;
  o.threads = 1;
  auto engine = Engine::Create(c, std::make_shared<const ModelWeights>(std::move(*weights)), o);
  Require(engine.ok());
  const int64_t n = std::min<int64_t>(kPromptTokensMax, 2 * int64_t{c.sliding_window} + 3);
  std::vector<int32_t> prompt(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) prompt[i] = static_cast<int32_t>(3 + i % (c.vocab_size - 3));
  SequenceState a = (*engine)->NewSequence();
  std::vector<float> logits;
  Require((*engine)->Forward(&a, prompt, false, &logits).ok());
  RequireLogits(logits, c);
  Require((*engine)->Decode(&a, 3, &logits).ok());
  RequireLogits(logits, c);
  SequenceState b = (*engine)->NewSequence();
  SequenceState* states[] = {&a, &b};
  const int32_t next[] = {4};
  const std::span<const int32_t> tokens[] = {next, std::span<const int32_t>(prompt).first(2)};
  std::vector<std::vector<float>> last;
  Require((*engine)->ForwardBatch(states, tokens, &last).ok());
  Require(last.size() == 2);
  for (const auto& l : last) RequireLogits(l, c);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto parsed = ParseEngineConfig(text);
  if (!parsed.ok()) return 0;
  const EngineConfig& c = *parsed;
  Require(c.layer_modes.size() == static_cast<size_t>(c.num_hidden_layers));
  Require(c.kv_source_of_layer.size() == static_cast<size_t>(c.num_hidden_layers));
  Require(c.first_decoder_layer >= 0 && c.first_decoder_layer <= c.num_hidden_layers);
  Require(c.GlobalKvBytesPerToken() >= 0);
  Require(EngramTableRows(c).ok());
  CheckDraftConfig(text, c);
  for (const WeightSpec& s : WeightSpecs(c)) {
    for (int64_t d : s.shape) Require(d > 0);
  }
  if (WeightBytes(c) > kWeightBytesMax) return 0;
  Run(c);
  return 0;
}
