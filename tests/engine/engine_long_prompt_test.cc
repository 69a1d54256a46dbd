// Calls of more than EngineOptions::prompt_piece_tokens tokens (kMaxTokensPerCall by default):
// PrefillCed, ExtendCed and Forward without all_logits run them in pieces, with the results of
// one call bit for bit; the calls whose memory grows with their tokens (Forward with
// all_logits) and everything past kMaxPromptTokens are refused with the state unchanged. On the
// tiny config (W = 16) with pieces of 1,000 tokens against engines that take the same prompts
// in one piece (a 70,000-token prompt at the default piece costs minutes here; the resume e2e
// test, tests/resume/resume_cli_e2e.sh, runs one through the real binary).
#include <gtest/gtest.h>

#include <memory>
#include <span>
#include <vector>

#include "engine/model.h"
#include "tests/engine/engine_test_util.h"

namespace kvtier::engine {
namespace {

using testutil::BitEqual;
using testutil::Prompt;
using testutil::TinyConfig;

constexpr int kPiece = 1000;
constexpr int kLong = 3 * kPiece + 500;  // four pieces: 500, then 1,000 at a time

// piece_tokens 0: the default (kMaxTokensPerCall), so every prompt here is one piece.
std::unique_ptr<Engine> TinyEngine(int piece_tokens = 0) {
  static std::shared_ptr<const ModelWeights> weights = [] {
    auto w = InitWeights(TinyConfig(), 5);
    EXPECT_TRUE(w.ok()) << w.status().ToString();
    return std::make_shared<const ModelWeights>(std::move(*w));
  }();
  EngineOptions o;
  o.threads = 2;
  if (piece_tokens != 0) o.prompt_piece_tokens = piece_tokens;
  auto e = Engine::Create(TinyConfig(), weights, o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return std::move(*e);
}

// `steps` greedy decode steps from (state, logits): every step's logits, concatenated.
std::vector<float> Continue(Engine* e, SequenceState* st, std::vector<float> logits, int steps) {
  std::vector<float> all;
  const int V = e->config().vocab_size;
  for (int i = 0; i < steps; ++i) {
    all.insert(all.end(), logits.begin(), logits.end());
    const int32_t next = testutil::Argmax(logits.data(), V);
    EXPECT_TRUE(e->Decode(st, next, &logits).ok());
  }
  return all;
}

void ExpectSameState(Engine* e, SequenceState* a, const std::vector<float>& la, SequenceState* b,
                     const std::vector<float>& lb) {
  ASSERT_EQ(a->tokens, b->tokens);
  ASSERT_EQ(la.size(), lb.size());
  EXPECT_TRUE(BitEqual(la.data(), lb.data(), la.size()));
  const std::vector<float> ca = Continue(e, a, la, 4), cb = Continue(e, b, lb, 4);
  ASSERT_EQ(ca.size(), cb.size());
  EXPECT_TRUE(BitEqual(ca.data(), cb.data(), ca.size()));
}

TEST(EngineLongPrompt, PrefillCedInPiecesIsOneCedPrefill) {
  auto pieces = TinyEngine(kPiece), whole = TinyEngine();
  const std::vector<int32_t> tokens = Prompt(kLong, 3);
  SequenceState a = pieces->NewSequence(), b = whole->NewSequence();
  std::vector<float> la, lb;
  ASSERT_TRUE(pieces->PrefillCed(&a, tokens, &la).ok());
  ASSERT_TRUE(whole->PrefillCed(&b, tokens, &lb).ok());
  ExpectSameState(whole.get(), &a, la, &b, lb);
}

TEST(EngineLongPrompt, ExtendCedInPiecesIsOneExtension) {
  auto pieces = TinyEngine(kPiece), whole = TinyEngine();
  const std::vector<int32_t> head = Prompt(100, 4), turn = Prompt(kLong, 6);
  SequenceState a = pieces->NewSequence(), b = whole->NewSequence();
  std::vector<float> la, lb;
  ASSERT_TRUE(pieces->Forward(&a, head, false, &la).ok());
  ASSERT_TRUE(pieces->ExtendCed(&a, turn, &la).ok());
  ASSERT_TRUE(whole->Forward(&b, head, false, &lb).ok());
  ASSERT_TRUE(whole->ExtendCed(&b, turn, &lb).ok());
  ExpectSameState(whole.get(), &a, la, &b, lb);
}

TEST(EngineLongPrompt, ForwardInPiecesIsOneForward) {
  auto pieces = TinyEngine(kPiece), whole = TinyEngine();
  const std::vector<int32_t> tokens = Prompt(kLong, 8);
  SequenceState a = pieces->NewSequence(), b = whole->NewSequence();
  std::vector<float> la, lb;
  ASSERT_TRUE(pieces->Forward(&a, tokens, false, &la).ok());
  ASSERT_TRUE(whole->Forward(&b, tokens, false, &lb).ok());
  ExpectSameState(whole.get(), &a, la, &b, lb);
}

TEST(EngineLongPrompt, PieceTokensMustExceedTheWindow) {
  for (int piece : {0, TinyConfig().sliding_window, static_cast<int>(kMaxTokensPerCall) + 1}) {
    EngineOptions o;
    o.prompt_piece_tokens = piece;
    auto w = InitWeights(TinyConfig(), 5);
    ASSERT_TRUE(w.ok());
    auto e = Engine::Create(TinyConfig(), std::make_shared<const ModelWeights>(std::move(*w)), o);
    EXPECT_TRUE(e.status().IsInvalidArgument()) << piece;
  }
}

TEST(EngineLongPrompt, RefusesWhatGrowsWithTheCallAndPastThePromptLimit) {
  auto e = TinyEngine();
  SequenceState st = e->NewSequence();
  std::vector<float> logits;
  const std::vector<int32_t> over_call = Prompt(static_cast<int>(kMaxTokensPerCall) + 1, 9);
  Status s = e->Forward(&st, over_call, /*all_logits=*/true, &logits);
  EXPECT_TRUE(s.IsInvalidArgument()) << s.ToString();
  EXPECT_TRUE(st.tokens.empty());
  const std::vector<int32_t> over_prompt(kMaxPromptTokens + 1, 5);
  for (int which = 0; which < 3; ++which) {
    s = which == 0   ? e->PrefillCed(&st, over_prompt, &logits)
        : which == 1 ? e->ExtendCed(&st, over_prompt, &logits)
                     : e->Forward(&st, over_prompt, false, &logits);
    EXPECT_TRUE(s.IsInvalidArgument()) << which << ": " << s.ToString();
    EXPECT_TRUE(st.tokens.empty()) << which;
  }
  // An id outside the vocabulary in a later piece is refused before the first piece runs.
  auto pieces = TinyEngine(kPiece);
  std::vector<int32_t> bad = Prompt(kLong, 10);
  bad.back() = TinyConfig().vocab_size;
  s = pieces->PrefillCed(&st, bad, &logits);
  EXPECT_TRUE(s.IsInvalidArgument()) << s.ToString();
  EXPECT_TRUE(st.tokens.empty());
}

}  // namespace
}  // namespace kvtier::engine
