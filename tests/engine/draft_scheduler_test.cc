// The load-aware DraftScheduler (engine/draft_scheduler.h): its choice of B, when drafting
// pays, its probes, the calibration of survivals, its cost table and clocks, MeasureSps, and
// that speculative rounds time their passes with the scheduler's clock.
// Part of kvtier_engine_speculative_test (speculative_test_util.h).
#include "engine/draft_scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <thread>
#include <vector>

#include "engine/sampler.h"
#include "engine/speculative.h"
#include "tests/engine/speculative_test_util.h"

namespace kvtier::engine {
namespace {

using testing_spec::Bytes;
using testing_spec::MakeEngine;
using testing_spec::Model;
using testing_spec::PlainGreedy;
using testing_spec::Texts;
using testing_spec::Trained;

TEST(DraftScheduler, MaximisesExpectedTokensTimesRate) {
  DraftScheduler s(6);
  for (int t = 1; t <= 6; ++t) s.Record(t, 0.001);  // flat: every pass costs the same
  EXPECT_EQ(s.Choose({{0.9f, 0.9f, 0.9f, 0.9f, 0.9f}})[0], 5);
  // Steeply rising cost: one draft token at most pays.
  DraftScheduler t(6);
  for (int k = 1; k <= 6; ++k) t.Record(k, 0.001 * k * k);
  EXPECT_EQ(t.Choose({{0.9f, 0.9f, 0.9f, 0.9f, 0.9f}})[0], 0);
  // Low confidence: nothing is drafted when passes cost more with tokens.
  DraftScheduler u(6);
  for (int k = 1; k <= 6; ++k) u.Record(k, 0.001 * (1 + 0.2 * k));
  EXPECT_EQ(u.Choose({{0.05f, 0.05f, 0.05f, 0.05f, 0.05f}})[0], 0);
  EXPECT_EQ(u.Choose({{0.99f, 0.99f, 0.1f, 0.1f, 0.1f}})[0], 2);
  // Two requests: candidates by descending survival across both.
  std::vector<int> two = s.Choose({{0.9f, 0.9f, 0.1f}, {0.95f, 0.2f, 0.1f}});
  EXPECT_EQ(two[0] + two[1], 4);  // the table ends at 6 tokens: 2 pending + 4
  EXPECT_GE(two[0], 2);
}

// Rounds of R sequences pay R draft passes and compare with a plain step of R sequences.
TEST(DraftScheduler, BatchOfRequestsCountsEveryDraftPass) {
  // Verify cost flat up to 8 tokens; a draft pass costs 0.4 of a verify pass.
  DraftScheduler s(8);
  for (int t = 1; t <= 8; ++t) s.Record(t, 0.001);
  s.RecordDraft(0.0004, {0.5f, 0.5f, 0.5f});
  // One request: k = 3 gives 1.875 tokens per 1.4 ms > 1 per 1 ms.
  EXPECT_TRUE(s.ShouldDraft(1));
  // Four requests: at most k = 1 fits the table (8 tokens): 4 x 1.5 tokens per 2.6 ms < 4 per
  // 1 ms, so drafting does not pay (counting one draft pass instead of four, it would).
  EXPECT_FALSE(s.ShouldDraft(4));
  // Choose over four requests: all the draft costs are paid already, so it verifies as many as
  // fit the flat table (8 - 4 = 4), the most confident first.
  const std::vector<int> four =
      s.Choose({{0.9f, 0.9f, 0.9f}, {0.1f, 0.1f, 0.1f}, {0.8f, 0.1f, 0.1f}, {0.2f, 0.2f, 0.2f}});
  EXPECT_EQ(four, (std::vector<int>{3, 0, 1, 0}));
  // A request without a draft (a probe drafts for one) gets none.
  const std::vector<int> probe = s.Choose({{}, {0.9f, 0.9f, 0.9f}, {}, {}});
  EXPECT_EQ(probe, (std::vector<int>{0, 3, 0, 0}));
}

// Choose weighs every option with the draft passes of the requests that drafted (a paid,
// fixed cost): counting none or every request instead changes its choice.
TEST(DraftScheduler, ChooseCountsTheDraftPassesOfTheRequestsThatDrafted) {
  DraftScheduler s(4);
  for (int t = 1; t <= 4; ++t) s.Record(t, 0.001 * t);  // verify cost linear in tokens
  s.RecordDraft(0.001, {0.6f});                         // a draft pass costs one decode step
  // One request that drafted: B = 0 gives 1 token per 2 ms, B = 1 gives 1.6 per 3 ms (more).
  // Without its draft pass counted it would be 1 per 1 ms against 1.6 per 2 ms (fewer).
  EXPECT_EQ(s.Choose({{0.6f}}), (std::vector<int>{1}));
  // Two requests, one drafted: B = 0 gives 2 tokens per 3 ms, B = 1 gives 2.6 per 4 ms (fewer).
  // Counting a draft pass for both it would be 2 per 4 ms against 2.6 per 5 ms (more).
  EXPECT_EQ(s.Choose({{0.6f}, {}}), (std::vector<int>{0, 0}));
}

TEST(DraftScheduler, StopsDraftingWhenItDoesNotPayAndProbes) {
  DraftScheduler s(6);
  EXPECT_TRUE(s.ShouldDraft());                         // no estimates yet
  for (int t = 1; t <= 6; ++t) s.Record(t, 0.001 * t);  // verify cost linear in tokens
  // A draft as costly as a decode step, with 50% survival: never pays.
  s.RecordDraft(0.001, {0.5f, 0.5f, 0.5f, 0.5f, 0.5f});
  // Probes after 32, then 64, 128, ... rounds (each probe's draft is recorded as above).
  int drafted = 0;
  for (int i = 0; i < 32 + 64 + 128 + 3; ++i) {
    if (s.ShouldDraft()) {
      ++drafted;
      s.RecordDraft(0.001, {0.5f, 0.5f, 0.5f, 0.5f, 0.5f});
    }
  }
  EXPECT_EQ(drafted, 3);
  // A flat verify cost and a cheap draft with high survival: drafts every round.
  DraftScheduler f(6);
  for (int t = 1; t <= 6; ++t) f.Record(t, 0.001);
  f.RecordDraft(0.0001, {0.9f, 0.9f, 0.9f, 0.9f, 0.9f});
  for (int i = 0; i < DraftScheduler::kProbeRounds; ++i) EXPECT_TRUE(f.ShouldDraft());
  EXPECT_EQ(f.Choose({{0.9f, 0.9f, 0.9f, 0.9f, 0.9f}})[0], 5);
}

// While drafting pays, plain probes re-measure the plain step: one undrafted round after 32,
// then 64, 128, ... drafted rounds, each timed whatever the one-in-16 timing of undrafted
// passes says; once drafting stops paying, the interval starts again at 32.
TEST(DraftScheduler, WhileDraftingPaysItProbesPlainSteps) {
  DraftScheduler f(6);
  for (int t = 1; t <= 6; ++t) f.Record(t, 0.001);
  f.RecordDraft(0.0001, {0.9f, 0.9f, 0.9f, 0.9f, 0.9f});
  EXPECT_TRUE(f.TimeUndrafted());  // the first undrafted pass is timed
  EXPECT_FALSE(f.TimeUndrafted());
  std::vector<int> plain;
  for (int i = 1; i <= 32 + 1 + 64 + 1 + 128 + 1; ++i) {
    if (f.ShouldDraft()) continue;
    plain.push_back(i);
    EXPECT_TRUE(f.TimeUndrafted()) << "round " << i;  // a plain probe is always timed
    EXPECT_FALSE(f.TimeUndrafted());
  }
  EXPECT_EQ(plain, (std::vector<int>{33, 98, 227}));
  // Drafting stops paying (verify cost rising steeply): no drafting but the draft probes, and
  // when it pays again the first plain probe comes after 32 drafted rounds again.
  for (int t = 1; t <= 6; ++t) {
    for (int i = 0; i < 40; ++i) f.Record(t, 0.001 * t * t);
  }
  int drafted = 0;
  for (int i = 0; i < 33; ++i) drafted += f.ShouldDraft() ? 1 : 0;
  EXPECT_EQ(drafted, 1);  // the 33rd: a probe
  for (int t = 1; t <= 6; ++t) {
    for (int i = 0; i < 40; ++i) f.Record(t, 0.001);
  }
  plain.clear();
  for (int i = 1; i <= 40; ++i) {
    if (!f.ShouldDraft()) plain.push_back(i);
  }
  EXPECT_EQ(plain, (std::vector<int>{33}));
}

// MeasureSps records each size's median pass: a first repetition 1000x slower (a clock that
// advances 1 s per reading during it, 1 ms otherwise) does not set the table.
TEST(Speculative, MeasureSpsRecordsEachSizesMedian) {
  auto e = MakeEngine();
  SequenceState base = e->NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(e->Forward(&base, Bytes(Texts()[1]), false, &logits).ok());
  constexpr int kMax = 6;
  int reads = 0;
  double now = 0;
  DraftScheduler s(kMax, [&] {
    ++reads;  // reads 1-2: the warm-up pass; 3 .. 2 + 2 kMax: the first repetition
    return now += reads > 2 && reads <= 2 + 2 * kMax ? 1.0 : 0.001;
  });
  ASSERT_TRUE(MeasureSps(e.get(), base, 3, &s).ok());
  EXPECT_EQ(reads, 2 + 3 * 2 * kMax);
  for (int t = 1; t <= kMax; ++t) EXPECT_NEAR(s.Sps(t), 1000, 1e-6) << t;
}

// MeasureSpsBatch over R bases fills every size of the table: passes of R .. max tokens over
// all R, and plain steps of the first 1 .. R - 1 (a clock that advances 1 ms per reading times
// every pass at 1 ms). Then the rounds left when sequences of the batch finish have a measured
// plain step (no round of them runs as a new batch size).
TEST(Speculative, MeasureSpsBatchTimesPlainStepsOfFewerSequences) {
  auto e = MakeEngine();
  std::vector<SequenceState> bases;
  std::vector<float> logits;
  for (int i = 0; i < 3; ++i) {
    bases.push_back(e->NewSequence());
    ASSERT_TRUE(e->Forward(&bases.back(), Bytes(Texts()[i]), false, &logits).ok());
  }
  double now = 0;
  DraftScheduler s(8, [&] { return now += 0.001; });
  ASSERT_TRUE(MeasureSpsBatch(e.get(), bases, 2, &s).ok());
  for (int t = 1; t <= 8; ++t) EXPECT_NEAR(s.Sps(t), 1000, 1e-6) << t;
  s.RecordDraft(0.0001, {0.9f});
  s.ShouldDraft(1);
  s.ShouldDraft(2);
  EXPECT_EQ(s.decisions().new_size, 0u);
}

// A batch size whose plain step was never timed (the table holds other sizes, as after
// MeasureSpsBatch of a larger batch): its round runs undrafted and timed, and once that pass is
// recorded the scheduler weighs drafts as for any size. Drafting instead never timed it, so
// every round of that many sequences drafted for all of them.
TEST(DraftScheduler, TimesAPlainStepOfANewBatchSizeBeforeDrafting) {
  DraftScheduler s(12);
  for (int t = 3; t <= 12; ++t) s.Record(t, 0.001);  // a flat verify cost: drafting pays
  s.RecordDraft(0.0001, {0.9f, 0.9f, 0.9f, 0.9f, 0.9f});
  EXPECT_TRUE(s.TimeUndrafted());  // the first undrafted pass (always timed)
  EXPECT_TRUE(s.ShouldDraft(3));
  EXPECT_FALSE(s.ShouldDraft(2));  // c(2) never measured: a plain step, timed
  EXPECT_FALSE(s.probing());
  EXPECT_TRUE(s.TimeUndrafted());
  EXPECT_FALSE(s.ShouldDraft(2));  // still unmeasured (its sample was not recorded)
  s.Record(2, 0.001);
  EXPECT_TRUE(s.ShouldDraft(2));
}

// Survivals are calibrated by what verification measured: a head that claims 0.95 per
// position but whose drafts are never accepted stops being believed, by ShouldDraft and
// Choose alike; a head whose claims verification confirms keeps its word.
TEST(DraftScheduler, CalibratesSurvivalsByWhatVerificationMeasured) {
  const std::vector<float> conf = {0.93f, 0.93f, 0.93f, 0.93f, 0.93f};
  auto make = [&] {
    auto s = std::make_unique<DraftScheduler>(6);
    for (int t = 1; t <= 6; ++t) s->Record(t, 0.001 * (1 + 0.25 * (t - 1)));
    s->RecordDraft(0.0002, conf);
    return s;
  };
  // The head's word alone: 5 tokens of 0.93, 0.86, ... pay (about 5.0 tokens per 2.45 ms).
  auto believed = make();
  EXPECT_TRUE(believed->ShouldDraft(1));
  EXPECT_EQ(believed->Choose({conf})[0], 5);
  EXPECT_DOUBLE_EQ(believed->Calibrated(0.93), 0.93);  // no verification yet: the prior
  // Verified 5 tokens 40 times, none accepted: the calibrated survival of those bins falls to
  // 4 x a / 44 (the prior's weight), so neither ShouldDraft nor Choose drafts any more.
  auto refuted = make();
  for (int i = 0; i < 40; ++i) refuted->RecordVerified(conf, 5, 0);
  EXPECT_NEAR(refuted->Calibrated(0.93), 0.93 * 4 / 44, 1e-12);
  EXPECT_EQ(refuted->Choose({conf})[0], 0);
  for (int i = 0; i < 24; ++i) refuted->RecordDraft(0.0002, conf);  // the running mean follows
  EXPECT_FALSE(refuted->ShouldDraft(1));
  // A probe chooses with the head's own survivals (what it verifies is measured).
  EXPECT_EQ(refuted->Choose({conf}, true)[0], 5);
  // Every claim confirmed: nothing changes.
  auto confirmed = make();
  for (int i = 0; i < 40; ++i) confirmed->RecordVerified(conf, 5, 5);
  EXPECT_GT(confirmed->Calibrated(0.93), 0.93);
  EXPECT_TRUE(confirmed->ShouldDraft(1));
  EXPECT_EQ(confirmed->Choose({conf})[0], 5);
  // Position k counts as survived only below `accepted`; nonsense is ignored.
  auto partial = make();
  const double a2 = 0.93 * 0.93;
  for (int i = 0; i < 40; ++i) partial->RecordVerified(conf, 2, 1);  // a_1 survived, a_2 not
  EXPECT_NEAR(partial->Calibrated(0.93), (40 + 4 * 0.93) / 44, 1e-12);
  EXPECT_NEAR(partial->Calibrated(a2), 4 * a2 / 44, 1e-12);
  partial->RecordVerified(conf, 6, 0);   // more verified than drafted
  partial->RecordVerified(conf, 2, 3);   // more accepted than verified
  partial->RecordVerified(conf, 2, -1);  // negative
  EXPECT_NEAR(partial->Calibrated(0.93), (40 + 4 * 0.93) / 44, 1e-12);
  // Bins keep at most kCalibrationWindow verifications: the counts halve, the rate stays.
  auto window = make();
  for (int i = 0; i < 4000; ++i) window->RecordVerified(conf, 1, i % 2);
  EXPECT_NEAR(window->Calibrated(0.93), 0.5, 0.01);
}

// The probe intervals are per batch size: rounds of one sequence where drafting pays (the last
// sequence of a group) leave the backoff of rounds of four, where it does not, alone; with one
// interval for all, each such round reset it (to 32 rounds, counted from that round).
TEST(DraftScheduler, ProbesBackOffPerBatchSize) {
  // Verify passes flat up to 6 tokens, then steeply rising: one sequence drafting 5 pays,
  // four sequences drafting one each (8 tokens) do not.
  DraftScheduler s(24);
  for (int t = 1; t <= 24; ++t) s.Record(t, t <= 6 ? 0.001 : 0.001 * t);
  s.RecordDraft(0.0001, {0.9f, 0.9f, 0.9f, 0.9f, 0.9f});
  std::vector<int> probes;
  for (int i = 1; i <= 32 + 1 + 64 + 1 + 128 + 1 + 20; ++i) {
    if (i % 10 == 0) {
      EXPECT_TRUE(s.ShouldDraft(1)) << i;  // the tail of a group: drafting pays
      EXPECT_FALSE(s.probing());
    }
    if (s.ShouldDraft(4)) {
      EXPECT_TRUE(s.probing());
      probes.push_back(i);
      s.RecordDraft(0.0001, {0.9f, 0.9f, 0.9f, 0.9f, 0.9f});
    }
  }
  EXPECT_EQ(probes, (std::vector<int>{33, 98, 227}));
  EXPECT_EQ(s.decisions().probes, 3u);
  EXPECT_EQ(s.decisions().pays, 24u);
  EXPECT_EQ(s.decisions().no, 32u + 64 + 128 + 20);
}

// MayDraftWithin(R, k) is exact while the estimates stay as they are: false only when none of
// the next k ShouldDraft(R) calls says yes, true in the k calls before each probe (and always
// while drafting pays); never with no room in the table.
TEST(DraftScheduler, MayDraftWithinPredictsTheNextProbe) {
  constexpr int kLead = 17;
  DraftScheduler s(6);
  for (int t = 1; t <= 6; ++t) s.Record(t, 0.001 * t);   // verify cost linear in tokens
  s.RecordDraft(0.001, {0.5f, 0.5f, 0.5f, 0.5f, 0.5f});  // never pays
  std::vector<bool> may, yes;
  for (int i = 0; i < 32 + 1 + 64 + 1 + 128 + 1 + 40; ++i) {
    may.push_back(s.MayDraftWithin(1, kLead));
    yes.push_back(s.ShouldDraft(1));
    if (yes.back()) s.RecordDraft(0.001, {0.5f, 0.5f, 0.5f, 0.5f, 0.5f});
  }
  int probes = 0;
  for (size_t i = 0; i < may.size(); ++i) {
    probes += yes[i] ? 1 : 0;
    bool soon = false;  // a yes among calls i .. i + kLead - 1
    for (size_t j = i; j < std::min(may.size(), i + kLead); ++j) soon = soon || yes[j];
    if (i + kLead <= may.size()) {
      EXPECT_EQ(may[i], soon) << i;
    }
  }
  EXPECT_EQ(probes, 3);
  EXPECT_FALSE(s.MayDraftWithin(6, kLead));  // R >= max_tokens: never drafts
  DraftScheduler f(6);
  for (int t = 1; t <= 6; ++t) f.Record(t, 0.001);
  f.RecordDraft(0.0001, {0.9f, 0.9f, 0.9f, 0.9f, 0.9f});  // pays
  for (int i = 0; i < 100; ++i) {
    EXPECT_TRUE(f.MayDraftWithin(1, 1)) << i;
    f.ShouldDraft(1);
  }
}

// Before any survival was measured the first round drafts, as a probe (one sequence of a
// batch drafts, not all).
TEST(DraftScheduler, FirstDraftIsAProbe) {
  DraftScheduler s(24);
  EXPECT_TRUE(s.ShouldDraft(4));
  EXPECT_TRUE(s.probing());
  EXPECT_EQ(s.decisions().first, 1u);
  EXPECT_FALSE(s.ShouldDraft(24));  // no room
  EXPECT_EQ(s.decisions().full, 1u);
}

// Drafting must beat a plain step by kPaysMargin: a predicted gain of 3 % is within what the
// estimates of single CPU-timed passes are off by, 7 % is not.
TEST(DraftScheduler, DraftsOnlyWhenThePredictedGainExceedsTheMargin) {
  for (const auto& [survival, drafts] : {std::pair{0.545f, false}, std::pair{0.6f, true}}) {
    DraftScheduler s(2);
    s.Record(1, 0.001);
    s.Record(2, 0.0015);  // one draft token: (1 + a) per 1.5 ms against 1 per 1 ms
    s.RecordDraft(0, {survival});
    EXPECT_EQ(s.ShouldDraft(1), drafts) << survival;
  }
}

// With as many requests as the table holds tokens there is no room for a draft token.
TEST(DraftScheduler, NeverDraftsWithoutRoomInTheTable) {
  DraftScheduler s(4);
  EXPECT_TRUE(s.ShouldDraft(3));  // no estimates yet: drafts
  EXPECT_FALSE(s.ShouldDraft(4));
  EXPECT_FALSE(s.ShouldDraft(40));
  EXPECT_FALSE(s.probing());
}

// One sample moves a cost estimate by at most a factor 2^(1/8) either way, however far off
// it is; a lasting change is followed; samples that are not a positive finite time are
// ignored.
TEST(DraftScheduler, OneSampleMovesAnEstimateByAtMostAnEighthOfADoubling) {
  const double step = std::pow(2.0, 1.0 / 8.0);
  DraftScheduler s(4);
  EXPECT_EQ(s.Sps(2), 0);  // never measured
  s.Record(2, 0.001);      // the first sample sets it
  EXPECT_DOUBLE_EQ(s.Sps(2), 1000);
  s.Record(2, 1.0);  // a pass timed 1000x slower (descheduled, as a wall clock shows)
  EXPECT_NEAR(s.Sps(2), 1000 / step, 1e-9);
  s.Record(2, 1e-9);  // and a million times faster
  EXPECT_NEAR(s.Sps(2), 1000, 1e-9);
  for (double bad : {0.0, -1.0, std::nan(""), HUGE_VAL}) s.Record(2, bad);
  EXPECT_NEAR(s.Sps(2), 1000, 1e-9);
  EXPECT_EQ(s.Sps(1), 0);  // other sizes untouched
  // A lasting doubling of the cost: 2^((7/8)^n) off after n samples (40: within 0.5 %).
  for (int i = 0; i < 40; ++i) s.Record(2, 0.002);
  EXPECT_NEAR(s.Sps(2), 500, 2.5);
  EXPECT_LT(s.Sps(2), 500 * 1.001 * std::pow(2.0, std::pow(7.0 / 8.0, 40)));
  // The draft pass's cost: the same rule.
  s.RecordDraft(0.001, {0.5f});
  EXPECT_DOUBLE_EQ(s.draft_seconds(), 0.001);
  s.RecordDraft(5.0, {0.5f});
  EXPECT_NEAR(s.draft_seconds(), 0.001 * step, 1e-12);
  s.RecordDraft(0, {0.5f});
  EXPECT_NEAR(s.draft_seconds(), 0.001 * step, 1e-12);
}

// A plain step moves the whole table by the factor its own entry moved (the verify sizes drift
// with it), once its size has kTableMoveSamples samples; a verify pass moves its own entry only;
// the first samples of a size move it alone.
// Without the common move, plain steps that grew 27 % over a run (more load, longer contexts)
// left the verify sizes at the start's costs, and rounds of 4 drafted where it did not pay.
TEST(DraftScheduler, APlainStepMovesTheWholeTable) {
  const double step = std::pow(2.0, 1.0 / 8.0);
  DraftScheduler s(8);
  for (int t = 4; t <= 8; ++t) s.Record(t, 0.001 * t);
  for (int i = 1; i < DraftScheduler::kTableMoveSamples; ++i) {
    s.RecordUndrafted(4, 0.004);  // samples at the estimate: nothing moves
    EXPECT_NEAR(s.Sps(5), 200, 1e-9);
  }
  s.RecordUndrafted(4, 0.008);  // twice the estimate: every entry up by one step
  for (int t = 4; t <= 8; ++t) EXPECT_NEAR(s.Sps(t), 1000 / (t * step), 1e-9) << t;
  EXPECT_EQ(s.Sps(2), 0);       // never measured: stays so
  s.RecordUndrafted(2, 0.001);  // a new size: its entry set, the rest unchanged
  EXPECT_NEAR(s.Sps(2), 1000, 1e-9);
  EXPECT_NEAR(s.Sps(5), 1000 / (5 * step), 1e-9);
  s.RecordUndrafted(2, 0.002);  // its second sample moves it alone
  EXPECT_NEAR(s.Sps(2), 1000 / step, 1e-9);
  EXPECT_NEAR(s.Sps(5), 1000 / (5 * step), 1e-9);
  s.Record(6, 0.001);  // a verify pass: its own entry only
  EXPECT_NEAR(s.Sps(6), 1000 / (6 * step) * step, 1e-9);
  EXPECT_NEAR(s.Sps(5), 1000 / (5 * step), 1e-9);
  for (double bad : {0.0, -1.0, std::nan("")}) s.RecordUndrafted(4, bad);  // ignored
  s.RecordUndrafted(0, 0.001);
  s.RecordUndrafted(9, 0.001);
  EXPECT_NEAR(s.Sps(5), 1000 / (5 * step), 1e-9);
  // Drifting together: after 40 plain steps at twice the cost, a verify size no pass ran is
  // at twice its cost too, and drafting is weighed against the same drift.
  for (int i = 0; i < 40; ++i) s.RecordUndrafted(4, 0.016);
  EXPECT_NEAR(s.Sps(8) / s.Sps(4), 0.5, 1e-9);
  EXPECT_NEAR(s.Sps(4), 1000.0 / 16, 1000.0 / 16 * 0.01);
}

// Undrafted passes are timed at the first call and one in kUndraftedTimedEvery after it; one in
// kUndraftedTimedEveryEarly while their size's entry has fewer than kTableMoveSamples samples.
TEST(DraftScheduler, TimesOneUndraftedPassIn128) {
  DraftScheduler s(4);
  for (int i = 0; i < DraftScheduler::kTableMoveSamples; ++i) s.Record(2, 0.001);
  std::vector<int> timed, early;
  for (int i = 0; i < 4 * DraftScheduler::kUndraftedTimedEvery; ++i) {
    if (s.TimeUndrafted(2)) timed.push_back(i);
  }
  EXPECT_EQ(timed, (std::vector<int>{0, 128, 256, 384}));
  s.Record(3, 0.001);  // one sample only
  for (int i = 0; i < 64; ++i) {
    if (s.TimeUndrafted(3)) early.push_back(i);
  }
  EXPECT_EQ(early, (std::vector<int>{0, 16, 32, 48}));
}

// The CPU clocks do not advance while the thread sleeps (a wall clock would: 200 ms), and do
// while it computes; the engine's cost clock is one of them, with one thread and with two.
TEST(DraftScheduler, CpuCostClocksIgnoreTimeOffTheCpu) {
  auto e1 = MakeEngine();
  EngineOptions two;
  two.threads = 2;
  auto e2 = Engine::Create(Model().config, Model().weights, two);
  ASSERT_TRUE(e2.ok());
  for (const CostClock& clock : {CostClock(ThreadCpuSeconds), CostClock(ProcessCpuSeconds),
                                 CpuCostClock(*e1), CpuCostClock(**e2)}) {
    const double c0 = clock();
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    EXPECT_LT(clock() - c0, 0.05);
    const double c1 = clock();
    volatile double x = 0;
    while (clock() - c1 < 0.01) x = x + 1;  // ends only if the clock counts computing
  }
}

// MeasureSps and RoundBatch (undrafted and drafted rounds) time their passes, and the draft
// pass, with the scheduler's clock, not the wall clock: with a fake clock that advances by
// `step` at every reading, every timed interval is `step`, whatever the passes really took.
// The scheduler's decision then follows that clock alone: verify passes cost the same at every
// size and a draft pass as much as a verify pass, so with 6 sequences drafting never pays
// (at most 6 tokens per sequence for the cost of 7 plain steps): it drafts in the first round
// (no estimates yet) and in its probes only, and greedy output stays plain greedy's.
TEST(Speculative, SchedulerTimesPassesWithItsClock) {
  const Trained& m = Model();
  auto e = MakeEngine();
  constexpr int kBatch = 6, kRounds = 100;
  const int K = m.dconfig.block_size;
  double now = 0, step = 0.001;
  DraftScheduler sched(kBatch * (K + 1), [&] { return now += step; });
  SequenceState base = e->NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(e->Forward(&base, Bytes(Texts()[0]), false, &logits).ok());
  ASSERT_TRUE(MeasureSps(e.get(), base, 2, &sched).ok());
  for (int t = 1; t <= sched.max_tokens(); ++t) EXPECT_NEAR(sched.Sps(t), 1000, 1e-6) << t;
  EXPECT_EQ(sched.draft_seconds(), 0);

  SpeculativeOptions o;
  o.scheduler = true;
  std::vector<Sampler> samplers(kBatch, Sampler(0, 1, 0));
  std::vector<std::unique_ptr<SpeculativeDecoder>> decs;
  std::vector<SpeculativeDecoder*> ptrs;
  std::vector<SequenceState> st(kBatch);
  std::vector<SequenceState*> sptrs;
  std::vector<std::vector<int32_t>> got(kBatch), want(kBatch);
  for (int i = 0; i < kBatch; ++i) {
    decs.push_back(std::make_unique<SpeculativeDecoder>(e.get(), m.draft.get(), m.weights.get(),
                                                        &sched, o, &samplers[i]));
    ptrs.push_back(decs.back().get());
    st[i] = e->NewSequence();
    sptrs.push_back(&st[i]);
    int32_t first = -1;
    ASSERT_TRUE(decs[i]->Start(&st[i], Bytes(Texts()[i]), &first).ok());
    got[i] = {first};
  }
  // An undrafted round timed at 2 ms: SPS(6) moves down by 2^(1/8), the rest stays (its size
  // has fewer than kTableMoveSamples samples: APlainStepMovesTheWholeTable).
  step = 0.002;
  std::vector<std::vector<int32_t>> outs(kBatch);
  ASSERT_TRUE(SpeculativeDecoder::RoundBatch(ptrs, sptrs, &outs, false).ok());
  EXPECT_NEAR(sched.Sps(kBatch), 1000 / std::pow(2.0, 1.0 / 8.0), 1e-6);
  EXPECT_NEAR(sched.Sps(kBatch + 1), 1000, 1e-6);
  for (int i = 0; i < kBatch; ++i) got[i].insert(got[i].end(), outs[i].begin(), outs[i].end());
  // Undrafted passes of a size with few samples are timed one in kUndraftedTimedEveryEarly: the
  // next ones leave SPS(6) alone.
  for (int r = 1; r < DraftScheduler::kUndraftedTimedEveryEarly; ++r) {
    std::vector<std::vector<int32_t>> o1(kBatch);
    ASSERT_TRUE(SpeculativeDecoder::RoundBatch(ptrs, sptrs, &o1, false).ok());
    for (int i = 0; i < kBatch; ++i) got[i].insert(got[i].end(), o1[i].begin(), o1[i].end());
  }
  EXPECT_NEAR(sched.Sps(kBatch), 1000 / std::pow(2.0, 1.0 / 8.0), 1e-6);
  step = 0.001;
  // The load-aware rounds: the first (no survival measured yet) and the probes draft, for one
  // sequence each.
  for (int r = 0; r < kRounds; ++r) {
    std::vector<std::vector<int32_t>> o2(kBatch);
    ASSERT_TRUE(SpeculativeDecoder::RoundBatch(ptrs, sptrs, &o2).ok());
    for (int i = 0; i < kBatch; ++i) got[i].insert(got[i].end(), o2[i].begin(), o2[i].end());
  }
  // A draft's cost: the round's time outside its verify pass, before it and after it, one
  // `step` each.
  EXPECT_NEAR(sched.draft_seconds(), 2 * step, 1e-9);
  uint64_t drafts = 0;
  for (const auto& d : decs) drafts += d->stats().drafts;
  // Round 1 (no estimates): one draft pass; probes after 32 and then 64 undrafted rounds.
  EXPECT_EQ(drafts, 1u + 2u);
  EXPECT_EQ(sched.decisions().first, 1u);
  EXPECT_EQ(sched.decisions().probes, 2u);
  for (int i = 0; i < kBatch; ++i) {
    std::vector<SequenceState> plain;
    PlainGreedy(e.get(), Bytes(Texts()[i]), static_cast<int>(got[i].size()), &want[i], &plain);
    want[i].resize(got[i].size());
    EXPECT_EQ(got[i], want[i]) << "sequence " << i;
  }
}

}  // namespace
}  // namespace kvtier::engine
