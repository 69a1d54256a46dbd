// Shared fixtures of kvtier_engine_speculative_test (engine_speculative_test.cc,
// draft_scheduler_test.cc, dspark_draft_test.cc; defined once, in speculative_test_util.cc):
// the trained miniature and its DSpark draft (deploy/models/kvmini-trained*, loaded once), an
// engine on it, the byte tokens of the prompts, and plain decoding's states to compare with.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/dspark.h"
#include "engine/model.h"

namespace kvtier::engine::testing_spec {

// The path of `rel` in the source tree (KVTIER_SOURCE_DIR).
std::string Src(const std::string& rel);

struct Trained {
  EngineConfig config;
  DSparkConfig dconfig;
  std::shared_ptr<const ModelWeights> weights;
  std::unique_ptr<DSpark> draft;
};

// The trained miniature and its draft, loaded at the first call (aborts the test binary when
// they do not load).
const Trained& Model();
// An engine on Model() with default options.
std::unique_ptr<Engine> MakeEngine();
// The byte tokens of `s` after bos.
std::vector<int32_t> Bytes(const std::string& s);
// The prompts.
const std::vector<std::string>& Texts();

// Every field of two states, bit for bit; names the first difference.
::testing::AssertionResult SameState(const SequenceState& a, const SequenceState& b);

// Plain greedy decoding of `prompt`: the tokens and the state after prompt + tokens[0..i] for
// every i.
void PlainGreedy(Engine* e, const std::vector<int32_t>& prompt, int count,
                 std::vector<int32_t>* tokens, std::vector<SequenceState>* states);

}  // namespace kvtier::engine::testing_spec
