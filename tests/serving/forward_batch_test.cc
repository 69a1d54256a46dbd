// Engine::ForwardBatch (continuous batching) is bit-identical to running each sequence alone:
// prompts of different lengths (inside one sliding window, across compress groups, past the
// candidate pool's blocks), decode tokens of several sequences packed into one pass, a prefill
// chunk sharing a pass with decode tokens, and the argument checks.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "engine/model.h"
#include "tests/engine/engine_test_util.h"

namespace kvtier::engine {
namespace {

using testutil::Argmax;
using testutil::MakeEngine;
using testutil::Prompt;

bool Same(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The greedy run of one sequence alone: prompt prefill (Forward), then `steps` decodes.
// Returns the logits after the prompt and after every decode.
std::vector<std::vector<float>> Alone(Engine* e, const std::vector<int32_t>& prompt, int steps) {
  SequenceState st = e->NewSequence();
  std::vector<float> logits;
  EXPECT_TRUE(e->Forward(&st, prompt, false, &logits).ok());
  std::vector<std::vector<float>> rows = {logits};
  for (int k = 0; k < steps; ++k) {
    EXPECT_TRUE(
        e->Decode(&st, Argmax(logits.data(), static_cast<int>(logits.size())), &logits).ok());
    rows.push_back(logits);
  }
  return rows;
}

TEST(ForwardBatch, GreedyDecodingIsBitIdenticalToRunningAlone) {
  auto e = MakeEngine(2);
  const std::vector<int> lengths = {1, 16, 33, 130, 200};
  constexpr int kSteps = 8;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::vector<std::vector<float>>> alone;
  for (size_t i = 0; i < lengths.size(); ++i) {
    prompts.push_back(Prompt(lengths[i], 40 + static_cast<uint32_t>(i)));
    alone.push_back(Alone(e.get(), prompts.back(), kSteps));
  }
  // Batched: every prompt in one ForwardBatch (chunks of different lengths), then the decode
  // tokens of all sequences packed into one pass per step.
  const size_t k = prompts.size();
  std::vector<SequenceState> st(k);
  std::vector<SequenceState*> ptrs;
  for (auto& s : st) {
    s = e->NewSequence();
    ptrs.push_back(&s);
  }
  std::vector<std::span<const int32_t>> spans(prompts.begin(), prompts.end());
  std::vector<std::vector<float>> logits;
  ASSERT_TRUE(e->ForwardBatch(ptrs, spans, &logits).ok());
  for (int step = 0; step <= kSteps; ++step) {
    ASSERT_EQ(logits.size(), k);
    std::vector<int32_t> next(k);
    for (size_t i = 0; i < k; ++i) {
      ASSERT_TRUE(Same(logits[i], alone[i][step])) << "sequence " << i << " step " << step;
      next[i] = Argmax(logits[i].data(), static_cast<int>(logits[i].size()));
    }
    if (step == kSteps) break;
    std::vector<std::span<const int32_t>> one;
    for (size_t i = 0; i < k; ++i) one.emplace_back(&next[i], 1);
    ASSERT_TRUE(e->ForwardBatch(ptrs, one, &logits).ok());
  }
}

// A prefill chunk of a new sequence shares a pass with decode tokens of running ones.
TEST(ForwardBatch, PrefillChunkBesideDecodeTokens) {
  auto e = MakeEngine(1);
  const auto a = Prompt(90, 5), b = Prompt(150, 6);
  const auto alone_a = Alone(e.get(), a, 3), alone_b = Alone(e.get(), b, 0);
  SequenceState sa = e->NewSequence(), sb = e->NewSequence();
  std::vector<float> la, lb;
  ASSERT_TRUE(e->Forward(&sa, a, false, &la).ok());
  // b arrives in two chunks while a decodes.
  std::vector<std::span<const int32_t>> chunks = {std::span(b).first(100),
                                                  std::span(b).subspan(100)};
  for (int k = 0; k < 2; ++k) {
    const int32_t t = Argmax(la.data(), static_cast<int>(la.size()));
    std::vector<SequenceState*> ptrs = {&sb, &sa};
    std::vector<std::span<const int32_t>> spans = {chunks[k], std::span<const int32_t>(&t, 1)};
    std::vector<std::vector<float>> out;
    ASSERT_TRUE(e->ForwardBatch(ptrs, spans, &out).ok());
    EXPECT_TRUE(Same(out[1], alone_a[k + 1])) << "decode " << k;
    la = out[1];
    lb = out[0];
  }
  EXPECT_TRUE(Same(lb, alone_b[0]));
}

TEST(ForwardBatch, RejectsBadArgumentsWithoutTouchingStates) {
  auto e = MakeEngine(1);
  SequenceState a = e->NewSequence(), b = e->NewSequence();
  const std::vector<int32_t> ok = {5, 6}, bad = {-1}, empty;
  const std::vector<int32_t> big(300, 7);  // over prefill_chunk_tokens (256)
  std::vector<std::vector<float>> out;
  auto call = [&](std::vector<SequenceState*> s, std::vector<std::span<const int32_t>> t) {
    return e->ForwardBatch(s, t, &out);
  };
  EXPECT_TRUE(call({}, {}).IsInvalidArgument());
  EXPECT_TRUE(call({&a, &b}, {ok}).IsInvalidArgument());
  EXPECT_TRUE(call({&a, &a}, {ok, ok}).IsInvalidArgument());
  EXPECT_TRUE(call({&a, &b}, {ok, bad}).IsInvalidArgument());
  EXPECT_TRUE(call({&a, &b}, {ok, empty}).IsInvalidArgument());
  EXPECT_TRUE(call({&a, &b}, {ok, big}).IsInvalidArgument());
  EXPECT_TRUE(a.tokens.empty());
  EXPECT_TRUE(b.tokens.empty());
  EXPECT_TRUE(call({&a, &b}, {ok, ok}).ok());
  EXPECT_EQ(a.tokens.size(), 2u);
}

}  // namespace
}  // namespace kvtier::engine
