// Fidelity of session restore (engine/fidelity.h) on a random-weight model: exact restore
// through units + hot state equals the uninterrupted session bit for bit (KL exactly 0: every
// path computes each logit with the same operations in the same order, ops.h), a replay of the
// whole history equals it too, a replay of W tokens does not (the measurement discriminates),
// and bad options are refused. Also ReplayTail's replay_tokens argument and its default.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "engine/fidelity.h"
#include "engine/session.h"
#include "engine/state_io.h"
#include "tests/engine/engine_test_util.h"

namespace kvtier::engine {
namespace {

using testutil::Prompt;
using testutil::TinyConfig;

std::shared_ptr<const ModelWeights> TinyWeights() {
  static std::shared_ptr<const ModelWeights> w = [] {
    auto r = InitWeights(TinyConfig(), 11);
    EXPECT_TRUE(r.ok());
    return std::make_shared<const ModelWeights>(std::move(*r));
  }();
  return w;
}

std::unique_ptr<Engine> TinyEngine() {
  EngineOptions o;
  o.threads = 2;
  auto e = Engine::Create(TinyConfig(), TinyWeights(), o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return std::move(*e);
}

TEST(Fidelity, ExactRestoreAndFullReplayEqualUninterruptedShortReplayDoesNot) {
  auto e = TinyEngine();
  const int W = TinyConfig().sliding_window;
  const std::vector<int32_t> tokens = Prompt(128 + 24, 5);
  FidelityOptions o;
  o.histories = {64, 128};
  o.replay_tokens = {W, 128, 4096};  // W; the whole history at h = 128; more than any history
  o.eval_tokens = 24;
  auto rep = MeasureFidelity(e.get(), *TinyWeights(), tokens, o);
  ASSERT_TRUE(rep.ok()) << rep.status().ToString();
  ASSERT_EQ(rep->histories.size(), 2u);
  EXPECT_EQ(rep->sliding_window, W);
  EXPECT_EQ(rep->eval_tokens, 24);
  for (const FidelityHistory& h : rep->histories) {
    SCOPED_TRACE(h.history);
    // (b): bit-identical, so agreement 1 and KL exactly 0 (no tolerance needed).
    EXPECT_EQ(h.exact.top1_agreement, 1.0);
    EXPECT_EQ(h.exact.kl_max, 0.0);
    EXPECT_EQ(h.exact.bits_per_byte, h.uninterrupted_bits_per_byte);
    ASSERT_EQ(h.replay.size(), 3u);
    // (c) at R = W: the rings are rebuilt from W tokens only; on random weights the
    // distributions move (0.42-0.59 agreement measured on the mini).
    EXPECT_EQ(h.replay[0].replay_tokens, W);
    EXPECT_LT(h.replay[0].top1_agreement, 1.0);
    EXPECT_GT(h.replay[0].kl_mean, 1e-4);
    // (c) with R >= h replays from position 0: the full forward, bit for bit.
    for (size_t i = 1; i < 3; ++i) {
      if (h.replay[i].replay_tokens < h.history) continue;
      EXPECT_EQ(h.replay[i].top1_agreement, 1.0);
      EXPECT_EQ(h.replay[i].kl_max, 0.0);
    }
  }
  // h = 64 < R = 128 counts too; h = 128 with R = 128 and 4096.
  EXPECT_EQ(rep->histories[0].replay[1].kl_max, 0.0);
  // The restores went through the real import path: (b) and three (c) per history.
  EXPECT_EQ(rep->units_imported, 4 * (1 + 2));
  EXPECT_EQ(rep->hot_states_imported, 2);
  EXPECT_EQ(rep->replayed_tokens, (W + 64 + 64) + (W + 128 + 128));
}

// K samples: K independent sessions cut from the text, pooled over K x N positions; equal to
// pooling the K single-sample measurements by hand.
TEST(Fidelity, SamplesArePooledOverIndependentSessions) {
  auto e = TinyEngine();
  const int W = TinyConfig().sliding_window;
  FidelityOptions o;
  o.histories = {64};
  o.replay_tokens = {W};
  o.eval_tokens = 16;
  const int64_t L = FidelitySampleTokens(o);
  ASSERT_EQ(L, 80);
  const std::vector<int32_t> tokens = Prompt(2 * 80 + 3, 8);
  std::vector<FidelityScore> single;
  for (int s = 0; s < 2; ++s) {
    auto r = MeasureFidelity(e.get(), *TinyWeights(), std::span(tokens).subspan(s * L, L), o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    single.push_back(r->histories[0].replay[0]);
  }
  o.samples = 2;
  auto pooled = MeasureFidelity(e.get(), *TinyWeights(), tokens, o);
  ASSERT_TRUE(pooled.ok()) << pooled.status().ToString();
  EXPECT_EQ(pooled->samples, 2);
  const FidelityHistory& h = pooled->histories[0];
  EXPECT_EQ(h.positions, 32);
  EXPECT_EQ(h.exact.top1_agreement, 1.0);
  EXPECT_EQ(h.exact.kl_max, 0.0);
  EXPECT_DOUBLE_EQ(h.replay[0].top1_agreement,
                   (single[0].top1_agreement + single[1].top1_agreement) / 2);
  EXPECT_NEAR(h.replay[0].kl_mean, (single[0].kl_mean + single[1].kl_mean) / 2, 1e-12);
  EXPECT_EQ(h.replay[0].kl_max, std::max(single[0].kl_max, single[1].kl_max));
  EXPECT_EQ(pooled->units_imported, 2 * 2);
  // Three samples need 240 tokens.
  o.samples = 3;
  auto short_text = MeasureFidelity(e.get(), *TinyWeights(), tokens, o);
  EXPECT_TRUE(short_text.status().IsInvalidArgument());
  EXPECT_NE(short_text.status().message().find("need 240"), std::string::npos);
}

TEST(Fidelity, RefusesBadOptionsWithAMessage) {
  auto e = TinyEngine();
  const int W = TinyConfig().sliding_window;
  const std::vector<int32_t> tokens = Prompt(200, 6);
  auto base = [&] {
    FidelityOptions o;
    o.histories = {128};
    o.replay_tokens = {W};
    o.eval_tokens = 16;
    return o;
  };
  struct Case {
    std::string what, expect;
    FidelityOptions o;
  };
  std::vector<Case> cases;
  {
    Case c{"text too short", "need 272", base()};
    c.o.histories = {128, 256};
    cases.push_back(c);
  }
  {
    Case c{"history not a multiple of the unit", "multiple", base()};
    c.o.histories = {100};
    cases.push_back(c);
  }
  {
    Case c{"replay below W", "replay length", base()};
    c.o.replay_tokens = {W - 1};
    cases.push_back(c);
  }
  {
    Case c{"no histories", "histories", base()};
    c.o.histories.clear();
    cases.push_back(c);
  }
  {
    Case c{"zero eval tokens", "eval_tokens", base()};
    c.o.eval_tokens = 0;
    cases.push_back(c);
  }
  {
    Case c{"too many eval tokens", "eval_tokens", base()};
    c.o.eval_tokens = kMaxFidelityEvalTokens + 1;
    cases.push_back(c);
  }
  {
    Case c{"zero samples", "samples", base()};
    c.o.samples = 0;
    cases.push_back(c);
  }
  {
    Case c{"odd unit", "unit_tokens", base()};
    c.o.unit_tokens = 63;
    cases.push_back(c);
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    auto rep = MeasureFidelity(e.get(), *TinyWeights(), tokens, c.o);
    ASSERT_FALSE(rep.ok());
    EXPECT_TRUE(rep.status().IsInvalidArgument());
    EXPECT_NE(rep.status().message().find(c.expect), std::string::npos) << rep.status().ToString();
  }
  // The same check without an engine (what the command line runs before loading weights).
  EXPECT_TRUE(CheckFidelityOptions(TinyConfig(), 200, base()).ok());
  EXPECT_TRUE(CheckFidelityOptions(TinyConfig(), 143, base()).IsInvalidArgument());
}

TEST(Fidelity, KlIsZeroForEqualAndPositiveForDifferentLogits) {
  const std::vector<float> p = {1.0f, 2.0f, 3.0f}, q = {3.0f, 2.0f, 1.0f};
  EXPECT_EQ(KlDivergence(p, p), 0.0);
  // softmax(p) = (0.0900, 0.2447, 0.6652); KL(p||q) = sum p (log p - log q) = 2 * (0.6652 -
  // 0.0900) = 1.1504 nats (the log-ratio is +-2 at the ends, 0 in the middle).
  EXPECT_NEAR(KlDivergence(p, q), 1.1504, 1e-3);
  const std::vector<float> shifted = {101.0f, 102.0f, 103.0f};  // softmax is shift-invariant
  EXPECT_NEAR(KlDivergence(p, shifted), 0.0, 1e-12);
}

// ReplayTail(R): R < W refused (state untouched); R replays min(R, n) tokens; the default and
// the session option resolve as documented.
TEST(ReplayTokens, ReplayTailTakesTheReplayLength) {
  auto e = TinyEngine();
  const int W = TinyConfig().sliding_window;
  const std::vector<int32_t> tokens = Prompt(128, 7);
  SequenceState a = e->NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(e->Forward(&a, tokens, false, &logits).ok());
  auto kv = EngineKvLayout(TinyConfig(), 64);
  ASSERT_TRUE(kv.ok());
  const UnitPayloadLayout layout = UnitPayloadLayout::For(*kv);
  auto imported = [&] {
    SequenceState st = e->NewSequence();
    for (int64_t page = 0; page < 2; ++page) {
      auto p = ExportUnitPayload(layout, a, page);
      EXPECT_TRUE(p.ok());
      EXPECT_TRUE(
          ImportUnitPayload(layout, *p, std::span(tokens).subspan(page * 64, 64), &st).ok());
    }
    return st;
  };
  SequenceState st = imported();
  std::vector<float> r;
  EXPECT_TRUE(e->ReplayTail(&st, W - 1, &r).IsInvalidArgument());
  EXPECT_TRUE(e->PrefetchEngramReplay(tokens, W - 1).IsInvalidArgument());
  // The two-argument form is R = W.
  std::vector<float> r_default, r_w;
  ASSERT_TRUE(e->ReplayTail(&st, &r_default).ok());
  SequenceState st2 = imported();
  ASSERT_TRUE(e->ReplayTail(&st2, W, &r_w).ok());
  EXPECT_TRUE(testutil::BitEqual(r_default.data(), r_w.data(), r_w.size()));
  // R = 4W reaches further back: other logits; the ring still holds the last W positions.
  SequenceState st4 = imported();
  std::vector<float> r4;
  ASSERT_TRUE(e->ReplayTail(&st4, 4 * W, &r4).ok());
  EXPECT_FALSE(testutil::BitEqual(r4.data(), r_w.data(), r_w.size()));
  for (const SwaRing& ring : st4.swa) {
    EXPECT_EQ(ring.valid_from, 128 - 4 * W);
    EXPECT_EQ(ring.end, 128);
  }
  // R >= n: the full forward's logits exactly.
  SequenceState all = imported();
  std::vector<float> r_all;
  ASSERT_TRUE(e->ReplayTail(&all, 1000, &r_all).ok());
  EXPECT_TRUE(testutil::BitEqual(r_all.data(), logits.data(), logits.size()));

  EXPECT_EQ(*ResolveReplayTokens(TinyConfig(), 0), kDefaultReplayWindows * W);
  EXPECT_EQ(*ResolveReplayTokens(TinyConfig(), 2 * W), 2 * W);
  auto low = ResolveReplayTokens(TinyConfig(), W - 1);
  EXPECT_TRUE(low.status().IsInvalidArgument());
  EXPECT_NE(low.status().message().find("sliding window"), std::string::npos);
  EXPECT_TRUE(
      ResolveReplayTokens(TinyConfig(), kMaxTokensPerCall + 1).status().IsInvalidArgument());
}

}  // namespace
}  // namespace kvtier::engine
