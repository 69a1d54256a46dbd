// Speculative decoding on the trained miniature (deploy/models/kvmini-trained*):
//   - RollbackTo leaves exactly the state plain decoding makes (every field, bit for bit);
//   - greedy speculative decoding emits plain greedy's tokens, and its state after every round
//     (rejections included) equals plain decoding's;
//   - with sampling, the first emitted token is distributed as the target's (chi-square).
// One binary, kvtier_engine_speculative_test, with draft_scheduler_test.cc (the scheduler) and
// dspark_draft_test.cc (the draft); shared fixtures in speculative_test_util.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
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
using testing_spec::SameState;
using testing_spec::Texts;
using testing_spec::Trained;

// ---- rollback ----------------------------------------------------------------------------------

// For every prompt parity (the ratio-2 compressor's partial group) and every kept length, a
// verify pass of 6 tokens rolled back equals plain decoding of the kept tokens.
TEST(Rollback, EqualsPlainDecoding) {
  const Trained& m = Model();
  auto e = MakeEngine();
  AttnInputCapture cap;
  cap.layers = CaptureLayers(m.config, m.dconfig);
  for (int len : {17, 18, 30, 31}) {
    const std::vector<int32_t> text = Bytes(Texts()[0]);
    ASSERT_GT(text.size(), 31u);
    const std::vector<int32_t> prompt(text.begin(), text.begin() + len);
    SequenceState base = e->NewSequence();
    std::vector<float> logits;
    ASSERT_TRUE(e->Forward(&base, prompt, false, &logits).ok());
    const std::vector<int32_t> verify = {3 + 'a', 3 + 'b', 3 + 'c', 3 + ' ', 3 + 'x', 3 + '\n'};
    for (int keep = 0; keep <= static_cast<int>(verify.size()); ++keep) {
      SequenceState spec = base;
      VerifyCheckpoint cp;
      SaveCheckpoint(spec, &cp);
      e->set_attn_capture(&cap);
      ASSERT_TRUE(e->Forward(&spec, verify, true, &logits).ok());
      e->set_attn_capture(nullptr);
      ASSERT_TRUE(RollbackTo(m.config, *m.weights, cp, cap, cp.tokens + keep, &spec).ok());
      SequenceState plain = base;
      for (int k = 0; k < keep; ++k) ASSERT_TRUE(e->Decode(&plain, verify[k], &logits).ok());
      EXPECT_TRUE(SameState(spec, plain)) << "prompt " << len << " keep " << keep;
      // And decoding on from the rolled-back state gives plain's logits bit for bit.
      std::vector<float> a, b;
      ASSERT_TRUE(e->Decode(&spec, 3 + 'q', &a).ok());
      ASSERT_TRUE(e->Decode(&plain, 3 + 'q', &b).ok());
      EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4));
    }
  }
}

TEST(Rollback, RejectsBadArguments) {
  const Trained& m = Model();
  auto e = MakeEngine();
  SequenceState st = e->NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(e->Forward(&st, Bytes("abc"), false, &logits).ok());
  VerifyCheckpoint cp;
  SaveCheckpoint(st, &cp);
  AttnInputCapture empty;
  ASSERT_TRUE(e->Forward(&st, Bytes("defgh"), true, &logits).ok());
  const SequenceState before = st;
  EXPECT_FALSE(RollbackTo(m.config, *m.weights, cp, empty, cp.tokens - 1, &st).ok());
  EXPECT_FALSE(RollbackTo(m.config, *m.weights, cp, empty, cp.tokens + 100, &st).ok());
  // Rolling back into the ratio-2 partial group needs the captured rows.
  EXPECT_FALSE(RollbackTo(m.config, *m.weights, cp, empty, cp.tokens + 2, &st).ok());
  EXPECT_TRUE(SameState(st, before));
}

// ---- speculative decoding ----------------------------------------------------------------------

TEST(Speculative, GreedyEqualsPlainGreedyAndStateAfterEveryRound) {
  const Trained& m = Model();
  auto e = MakeEngine();
  constexpr int kNew = 40;
  uint64_t rejections = 0, accepted = 0, rounds = 0;
  for (int draft_len : {5, 2}) {
    for (const std::string& text : Texts()) {
      const std::vector<int32_t> prompt = Bytes(text);
      // Plain greedy.
      Sampler greedy(0, 1, 0);
      SequenceState plain = e->NewSequence();
      std::vector<float> logits;
      ASSERT_TRUE(e->Forward(&plain, prompt, false, &logits).ok());
      std::vector<int32_t> want;
      std::vector<SequenceState> states;  // plain state after prompt + want[0..i)
      for (int i = 0; i < kNew + 6; ++i) {
        want.push_back(greedy.Sample(logits));
        ASSERT_TRUE(e->Decode(&plain, want.back(), &logits).ok());
        states.push_back(plain);
      }
      // Speculative greedy.
      Sampler sg(0, 1, 0);
      SpeculativeOptions o;
      o.draft_len = draft_len;
      SpeculativeDecoder dec(e.get(), m.draft.get(), m.weights.get(), nullptr, o, &sg);
      SequenceState st = e->NewSequence();
      int32_t first = -1;
      ASSERT_TRUE(dec.Start(&st, prompt, &first).ok());
      std::vector<int32_t> got = {first};
      while (static_cast<int>(got.size()) < kNew) {
        ASSERT_TRUE(dec.Round(&st, &got).ok());
        // The state holds prompt + got[0 .. size-1): plain's after size-1 decoded tokens.
        const size_t done = got.size() - 1;
        ASSERT_LT(done - 1, states.size());
        ASSERT_TRUE(SameState(st, states[done - 1])) << text << " after " << done;
      }
      got.resize(kNew);
      EXPECT_EQ(got, std::vector<int32_t>(want.begin(), want.begin() + kNew)) << text;
      rejections += dec.stats().rejections;
      accepted += dec.stats().accepted;
      rounds += dec.stats().rounds;
    }
  }
  // The test must have exercised both outcomes.
  EXPECT_GT(rejections, 10u);
  EXPECT_GT(accepted, rounds);
}

// A decoder attached to a state prefilled elsewhere (as the server does) decodes plain greedy's
// tokens, and TruncateRound to any kept length of a round leaves exactly plain decoding's state
// and logits at that length (the server's cut for a request ending inside a round).
TEST(Speculative, AttachAndTruncateRoundEqualPlainDecoding) {
  const Trained& m = Model();
  auto e = MakeEngine();
  constexpr int kNew = 30;
  uint64_t cuts = 0;
  for (size_t t = 0; t < 4; ++t) {
    const std::vector<int32_t> prompt = Bytes(Texts()[t]);
    const int64_t p = static_cast<int64_t>(prompt.size());
    Sampler greedy(0, 1, 0);
    SequenceState plain = e->NewSequence();
    std::vector<float> logits;
    ASSERT_TRUE(e->Forward(&plain, prompt, false, &logits).ok());
    const std::vector<float> prefill_logits = logits;
    std::vector<int32_t> want;
    std::vector<SequenceState> states;             // after prompt + want[0..i]
    std::vector<std::vector<float>> plain_logits;  // the logits of those states
    for (int i = 0; i < kNew + 6; ++i) {
      want.push_back(greedy.Sample(logits));
      ASSERT_TRUE(e->Decode(&plain, want.back(), &logits).ok());
      states.push_back(plain);
      plain_logits.push_back(logits);
    }
    // Prefilled without a capture: the decoder starts with an empty draft context.
    SequenceState st = e->NewSequence();
    std::vector<float> l0;
    ASSERT_TRUE(e->Forward(&st, prompt, false, &l0).ok());
    Sampler sg(0, 1, 0);
    SpeculativeOptions o;
    o.draft_len = 5;
    SpeculativeDecoder dec(e.get(), m.draft.get(), m.weights.get(), nullptr, o, &sg);
    std::vector<float> lg;
    EXPECT_FALSE(dec.TruncateRound(&st, p, &lg).ok()) << "no round yet";
    EXPECT_FALSE(dec.Attach(-1, DraftContext{}).ok());
    const int32_t first = sg.Sample(l0);
    ASSERT_TRUE(dec.Attach(first, DraftContext{}).ok());
    std::vector<int32_t> got = {first};
    while (static_cast<int>(got.size()) < kNew) {
      const int64_t n = static_cast<int64_t>(st.tokens.size());
      ASSERT_TRUE(dec.Round(&st, &got).ok());
      const int64_t end = static_cast<int64_t>(st.tokens.size());
      for (int64_t keep = n + 1; keep <= end; ++keep) {
        SpeculativeDecoder d2 = dec;
        SequenceState s2 = st;
        ASSERT_TRUE(d2.TruncateRound(&s2, keep, &lg).ok());
        const size_t i = static_cast<size_t>(keep - p - 1);
        ASSERT_LT(i, states.size());
        ASSERT_TRUE(SameState(s2, states[i])) << t << " keep " << keep << " of " << end;
        EXPECT_EQ(lg, plain_logits[i]) << t << " keep " << keep;
        EXPECT_FALSE(d2.Round(&s2, &got).ok()) << "a truncated decoder must be attached again";
        cuts += keep < end;
      }
      EXPECT_FALSE(dec.RoundLogits(n, &lg).ok());
      EXPECT_FALSE(dec.RoundLogits(end + 1, &lg).ok());
    }
    got.resize(kNew);
    EXPECT_EQ(got, std::vector<int32_t>(want.begin(), want.begin() + kNew)) << t;
  }
  EXPECT_GT(cuts, 4u) << "no round accepted enough draft tokens to cut inside it";
}

// ForwardBatch's all-rows logits and per-sequence captures equal Forward's of each sequence
// alone, bit for bit.
TEST(ForwardBatchVerify, AllLogitsAndCapturesEqualForward) {
  const Trained& m = Model();
  auto e = MakeEngine();
  const int V = m.config.vocab_size;
  std::vector<SequenceState> base;
  for (int i = 0; i < 3; ++i) {
    base.push_back(e->NewSequence());
    std::vector<float> logits;
    ASSERT_TRUE(e->Forward(&base.back(), Bytes(Texts()[i]), false, &logits).ok());
  }
  const std::vector<std::vector<int32_t>> verify = {
      Bytes("abc"), {3 + 'x'}, Bytes("long one\n")};  // bos first: any ids will do
  std::vector<SequenceState> batched = base;
  std::vector<SequenceState*> ptrs;
  std::vector<std::span<const int32_t>> spans;
  std::vector<AttnInputCapture> caps(3);
  std::vector<AttnInputCapture*> cap_ptrs;
  for (int i = 0; i < 3; ++i) {
    ptrs.push_back(&batched[i]);
    spans.emplace_back(verify[i]);
    caps[i].layers = CaptureLayers(m.config, m.dconfig);
    cap_ptrs.push_back(&caps[i]);
  }
  std::vector<std::vector<float>> last, all;
  ASSERT_TRUE(e->ForwardBatch(ptrs, spans, &last, &all, cap_ptrs).ok());
  ASSERT_EQ(all.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    SequenceState alone = base[i];
    AttnInputCapture cap;
    cap.layers = CaptureLayers(m.config, m.dconfig);
    std::vector<float> logits;
    e->set_attn_capture(&cap);
    ASSERT_TRUE(e->Forward(&alone, verify[i], true, &logits).ok());
    e->set_attn_capture(nullptr);
    ASSERT_EQ(all[i].size(), verify[i].size() * V);
    EXPECT_EQ(0, std::memcmp(all[i].data(), logits.data(), logits.size() * 4)) << i;
    EXPECT_EQ(0, std::memcmp(last[i].data(), logits.data() + logits.size() - V, V * 4)) << i;
    EXPECT_TRUE(SameState(batched[i], alone)) << i;
    EXPECT_EQ(caps[i].first_pos, cap.first_pos) << i;
    EXPECT_EQ(caps[i].normed, cap.normed) << i;
    EXPECT_EQ(caps[i].stream_mean, cap.stream_mean) << i;
  }
  // A capture list of another size is refused before anything changes.
  std::vector<SequenceState> again = base;
  std::vector<SequenceState*> two = {&again[0], &again[1]};
  std::vector<std::span<const int32_t>> two_spans = {spans[0], spans[1]};
  EXPECT_FALSE(e->ForwardBatch(two, two_spans, &last, &all, cap_ptrs).ok());
  EXPECT_TRUE(SameState(again[0], base[0]));
}

// Several sequences per round, verified in one ForwardBatch: every sequence emits plain
// greedy's tokens, and after every round (rejections included) its state equals plain
// decoding's bit for bit. Sequences leave the batch as they finish, so the batch shrinks.
TEST(Speculative, BatchedGreedyEqualsPlainGreedyAndStateAfterEveryRound) {
  const Trained& m = Model();
  auto e = MakeEngine();
  constexpr int kNew = 40, kBatch = 4;
  const int K = m.dconfig.block_size;
  uint64_t rejections = 0, accepted = 0, rounds = 0, batched_rounds = 0;
  for (int mode : {5, 2, -1}) {  // fixed draft lengths, then the scheduler
    for (size_t g = 0; g + kBatch <= Texts().size(); g += kBatch) {
      std::vector<std::vector<int32_t>> want(kBatch);
      std::vector<std::vector<SequenceState>> plain(kBatch);
      for (int i = 0; i < kBatch; ++i)
        PlainGreedy(e.get(), Bytes(Texts()[g + i]), kNew + K + 1, &want[i], &plain[i]);
      // A table in which drafting pays (flat verify cost, cheap drafts): the scheduler's
      // choices vary across requests; verify timings then update it as they come.
      DraftScheduler sched(kBatch * (K + 1));
      for (int t = 1; t <= sched.max_tokens(); ++t) sched.Record(t, 0.001);
      sched.RecordDraft(1e-6, std::vector<float>(K, 0.8f));
      SpeculativeOptions o;
      o.draft_len = std::max(0, mode);
      o.scheduler = mode < 0;
      std::vector<Sampler> samplers(kBatch, Sampler(0, 1, 0));
      std::vector<std::unique_ptr<SpeculativeDecoder>> decs;
      std::vector<SequenceState> st;
      std::vector<std::vector<int32_t>> got(kBatch);
      for (int i = 0; i < kBatch; ++i) {
        decs.push_back(std::make_unique<SpeculativeDecoder>(e.get(), m.draft.get(), m.weights.get(),
                                                            &sched, o, &samplers[i]));
        st.push_back(e->NewSequence());
        int32_t first = -1;
        ASSERT_TRUE(decs[i]->Start(&st[i], Bytes(Texts()[g + i]), &first).ok());
        got[i] = {first};
      }
      for (;;) {
        std::vector<SpeculativeDecoder*> live;
        std::vector<SequenceState*> lst;
        std::vector<int> idx;
        for (int i = 0; i < kBatch; ++i) {
          if (static_cast<int>(got[i].size()) >= kNew) continue;
          live.push_back(decs[i].get());
          lst.push_back(&st[i]);
          idx.push_back(i);
        }
        if (live.empty()) break;
        std::vector<std::vector<int32_t>> outs(live.size());
        ASSERT_TRUE(SpeculativeDecoder::RoundBatch(live, lst, &outs).ok());
        batched_rounds += live.size() > 1 ? 1 : 0;
        for (size_t j = 0; j < live.size(); ++j) {
          const int i = idx[j];
          ASSERT_GE(outs[j].size(), 1u);
          got[i].insert(got[i].end(), outs[j].begin(), outs[j].end());
          const size_t done = got[i].size() - 1;
          ASSERT_LE(done, plain[i].size());
          ASSERT_TRUE(SameState(st[i], plain[i][done - 1]))
              << "mode " << mode << " sequence " << g + i << " after " << done;
        }
      }
      for (int i = 0; i < kBatch; ++i) {
        got[i].resize(kNew);
        EXPECT_EQ(got[i], std::vector<int32_t>(want[i].begin(), want[i].begin() + kNew))
            << "mode " << mode << " sequence " << g + i;
        if (mode > 0) {
          rejections += decs[i]->stats().rejections;
          accepted += decs[i]->stats().accepted;
          rounds += decs[i]->stats().rounds;
        }
      }
    }
  }
  EXPECT_GT(rejections, 10u);
  EXPECT_GT(accepted, rounds);
  EXPECT_GT(batched_rounds, 30u);
}

// When drafting does not pay, a batch of sequences runs as plain decode steps and probes with
// one sequence's draft pass, not all of theirs.
TEST(Speculative, BatchProbeDraftsForOneSequence) {
  const Trained& m = Model();
  auto e = MakeEngine();
  constexpr int kBatch = 4;
  const int K = m.dconfig.block_size;
  DraftScheduler sched(kBatch * (K + 1));
  for (int t = 1; t <= sched.max_tokens(); ++t) sched.Record(t, 0.001 * t * t);
  sched.RecordDraft(1.0, std::vector<float>(K, 0.5f));  // a draft pass costs a second
  SpeculativeOptions o;
  o.scheduler = true;
  std::vector<Sampler> samplers(kBatch, Sampler(0, 1, 0));
  std::vector<std::unique_ptr<SpeculativeDecoder>> decs;
  std::vector<SpeculativeDecoder*> ptrs;
  std::vector<SequenceState> st(kBatch);
  std::vector<SequenceState*> sptrs;
  for (int i = 0; i < kBatch; ++i) {
    decs.push_back(std::make_unique<SpeculativeDecoder>(e.get(), m.draft.get(), m.weights.get(),
                                                        &sched, o, &samplers[i]));
    ptrs.push_back(decs.back().get());
    st[i] = e->NewSequence();
    sptrs.push_back(&st[i]);
    int32_t first = -1;
    ASSERT_TRUE(decs[i]->Start(&st[i], Bytes(Texts()[i]), &first).ok());
  }
  // kProbeRounds rounds without drafting, then one probe.
  for (int r = 0; r < DraftScheduler::kProbeRounds + 2; ++r) {
    std::vector<std::vector<int32_t>> outs(kBatch);
    ASSERT_TRUE(SpeculativeDecoder::RoundBatch(ptrs, sptrs, &outs).ok());
  }
  uint64_t drafts = 0;
  for (const auto& d : decs) drafts += d->stats().drafts;
  EXPECT_EQ(drafts, 1u);
}

// Undrafted rounds capture the target layers' rows only when a draft can come within the
// context's W + 1 rounds (StepCapture, DraftScheduler::MayDraftWithin): here drafting never
// pays, so only the W + 1 rounds before each probe capture. The probe after the gap drafts
// exactly what a decoder that captured every round drafts at the same position (the draft
// reads the context's last W rows; with a lead of W - 1 its confidences differ), and both emit
// plain greedy's tokens. A decoder of fixed draft length 0 never captures.
TEST(Speculative, UndraftedRoundsCaptureOnlyBeforeAProbe) {
  const Trained& m = Model();
  auto e = MakeEngine();
  const int K = m.dconfig.block_size;
  const int lead = m.config.sliding_window + 1;
  double now = 0;
  DraftScheduler sched(K + 1, [&] { return now += 0.001; });
  for (int t = 1; t <= sched.max_tokens(); ++t) sched.Record(t, 0.001 * t);
  sched.RecordDraft(0.001, std::vector<float>(K, 0.5f));  // as costly as a step: never pays
  SpeculativeOptions gated_o;
  gated_o.scheduler = true;
  SpeculativeOptions always_o;
  always_o.draft_len = K;  // captures every round
  SpeculativeOptions never_o;
  never_o.draft_len = 0;
  Sampler s1(0, 1, 0), s2(0, 1, 0), s3(0, 1, 0);
  SpeculativeDecoder gated(e.get(), m.draft.get(), m.weights.get(), &sched, gated_o, &s1);
  SpeculativeDecoder always(e.get(), m.draft.get(), m.weights.get(), nullptr, always_o, &s2);
  SpeculativeDecoder never(e.get(), m.draft.get(), m.weights.get(), nullptr, never_o, &s3);
  SequenceState gs = e->NewSequence(), as = e->NewSequence(), ns = e->NewSequence();
  const std::vector<int32_t> prompt = Bytes(Texts()[0]);
  int32_t first = -1;
  ASSERT_TRUE(gated.Start(&gs, prompt, &first).ok());
  ASSERT_TRUE(always.Start(&as, prompt, &first).ok());
  ASSERT_TRUE(never.Start(&ns, prompt, &first).ok());
  std::vector<int32_t> gout = {first}, aout = {first}, nout = {first};
  const int rounds = DraftScheduler::kProbeRounds + 1;  // the last one is the first probe
  std::vector<int> captured;
  for (int r = 0; r < rounds; ++r) {
    SpeculativeDecoder* g = &gated;
    SequenceState* gp = &gs;
    const bool draft = SpeculativeDecoder::DraftsRound({&g, 1});
    ASSERT_EQ(draft, r == rounds - 1) << r;
    if (!draft) {
      AttnInputCapture* cap = gated.StepCapture(gs, 1);
      if (cap != nullptr) captured.push_back(r);
      EXPECT_EQ(never.StepCapture(ns, 1), nullptr) << r;
    }
    std::vector<std::vector<int32_t>> go(1), ao(1), no(1);
    ASSERT_TRUE(SpeculativeDecoder::RoundBatch({&g, 1}, {&gp, 1}, &go, draft).ok()) << r;
    SpeculativeDecoder* a = &always;
    SequenceState* ap = &as;
    ASSERT_TRUE(SpeculativeDecoder::RoundBatch({&a, 1}, {&ap, 1}, &ao, draft).ok()) << r;
    SpeculativeDecoder* n = &never;
    SequenceState* np = &ns;
    if (!draft) {
      ASSERT_TRUE(SpeculativeDecoder::RoundBatch({&n, 1}, {&np, 1}, &no, false).ok());
    }
    gout.insert(gout.end(), go[0].begin(), go[0].end());
    aout.insert(aout.end(), ao[0].begin(), ao[0].end());
    nout.insert(nout.end(), no[0].begin(), no[0].end());
  }
  std::vector<int> want_captured;
  for (int r = rounds - 1 - lead; r < rounds - 1; ++r) want_captured.push_back(r);
  EXPECT_EQ(captured, want_captured);
  EXPECT_EQ(gated.stats().drafts, 1u);
  EXPECT_EQ(always.stats().drafts, 1u);
  EXPECT_EQ(gated.last_draft_tokens(), always.last_draft_tokens());
  EXPECT_EQ(gated.last_draft_confidence(), always.last_draft_confidence());
  std::vector<int32_t> want;
  std::vector<SequenceState> plain;
  PlainGreedy(e.get(), prompt, static_cast<int>(aout.size()), &want, &plain);
  const size_t n = std::min(gout.size(), aout.size());
  EXPECT_TRUE(std::equal(gout.begin(), gout.begin() + n, want.begin()));
  EXPECT_TRUE(std::equal(aout.begin(), aout.begin() + n, want.begin()));
  EXPECT_TRUE(std::equal(nout.begin(), nout.end(), want.begin()));
}

// Verified drafts feed the scheduler's calibration: after rounds that verify every drafted
// token, the calibrated survival of each verified position's bin is what the rounds measured
// (with the prior's weight), not the head's word.
TEST(Speculative, RoundsRecordWhatVerificationMeasured) {
  const Trained& m = Model();
  auto e = MakeEngine();
  const int K = m.dconfig.block_size;
  DraftScheduler sched(K + 1);
  SpeculativeOptions o;
  o.draft_len = K;  // fixed: every round verifies all K; the scheduler only records
  Sampler greedy(0, 1, 0);
  SpeculativeDecoder dec(e.get(), m.draft.get(), m.weights.get(), &sched, o, &greedy);
  SequenceState st = e->NewSequence();
  int32_t first = -1;
  ASSERT_TRUE(dec.Start(&st, Bytes(Texts()[0]), &first).ok());
  // Per calibration bin: verified positions and survived ones, counted here.
  std::vector<double> verified(DraftScheduler::kCalibrationBins), survived(verified.size());
  std::vector<int32_t> out;
  for (int r = 0; r < 30; ++r) {
    const uint64_t accepted = dec.stats().accepted;
    ASSERT_TRUE(dec.Round(&st, &out).ok());
    const int a = static_cast<int>(dec.stats().accepted - accepted);
    double s = 1;
    for (int k = 0; k < K; ++k) {
      s *= std::clamp(static_cast<double>(dec.last_draft_confidence()[k]), 0.0, 1.0);
      const int b = std::min(static_cast<int>(s * DraftScheduler::kCalibrationBins),
                             DraftScheduler::kCalibrationBins - 1);
      verified[b] += 1;
      survived[b] += k < a ? 1 : 0;
    }
  }
  int checked = 0;
  for (size_t b = 0; b < verified.size(); ++b) {
    if (verified[b] == 0) continue;
    const double centre = (b + 0.5) / DraftScheduler::kCalibrationBins;
    const double want = (survived[b] + DraftScheduler::kCalibrationPrior * centre) /
                        (verified[b] + DraftScheduler::kCalibrationPrior);
    EXPECT_NEAR(sched.Calibrated(centre), want, 1e-9) << "bin " << b;
    ++checked;
  }
  EXPECT_GT(checked, 2);
}

// Sequences that switch between drafted and undrafted rounds (both ways, runs of each) emit
// plain greedy's tokens with plain decoding's state after every round; undrafted rounds run
// either as RoundBatch's own plain pass or inside a caller's ForwardBatch beside a prefill
// chunk of another sequence (StepCapture / FinishStep). The draft's context follows the
// undrafted rounds: every drafted round drafts the same tokens with the same confidences (bit
// for bit) and accepts as many as a fresh decoder whose context was observed from a prefill of
// the same tokens.
TEST(Speculative, SwitchingBetweenDraftedAndUndraftedRoundsEqualsPlain) {
  const Trained& m = Model();
  auto e = MakeEngine();
  constexpr int kNew = 48, kBatch = 4;
  const int K = m.dconfig.block_size;
  // 1 drafts; 0 does not, 2 does not in a caller's pass. The run of 20 undrafted rounds
  // leaves more rows waiting for the draft than its context keeps (W + 1).
  std::vector<int> pattern = {1, 0, 0, 2, 1, 1, 0, 2, 2, 0, 1};
  pattern.insert(pattern.end(), 20, 0);
  uint64_t drafted_rounds = 0, undrafted_rounds = 0, accepted = 0;
  for (size_t g = 0; g + kBatch <= Texts().size(); g += kBatch) {
    std::vector<std::vector<int32_t>> want(kBatch);
    std::vector<std::vector<SequenceState>> plain(kBatch);
    for (int i = 0; i < kBatch; ++i)
      PlainGreedy(e.get(), Bytes(Texts()[g + i]), kNew + K + 1, &want[i], &plain[i]);
    SpeculativeOptions o;
    o.draft_len = K;
    std::vector<Sampler> samplers(kBatch, Sampler(0, 1, 0));
    std::vector<std::unique_ptr<SpeculativeDecoder>> decs;
    std::vector<SequenceState> st;
    std::vector<std::vector<int32_t>> got(kBatch);
    for (int i = 0; i < kBatch; ++i) {
      decs.push_back(std::make_unique<SpeculativeDecoder>(e.get(), m.draft.get(), m.weights.get(),
                                                          nullptr, o, &samplers[i]));
      st.push_back(e->NewSequence());
      int32_t first = -1;
      ASSERT_TRUE(decs[i]->Start(&st[i], Bytes(Texts()[g + i]), &first).ok());
      got[i] = {first};
    }
    for (size_t round = 0;; ++round) {
      std::vector<SpeculativeDecoder*> live;
      std::vector<SequenceState*> lst;
      std::vector<int> idx;
      for (int i = 0; i < kBatch; ++i) {
        if (static_cast<int>(got[i].size()) >= kNew) continue;
        live.push_back(decs[i].get());
        lst.push_back(&st[i]);
        idx.push_back(i);
      }
      if (live.empty()) break;
      const int mode = pattern[round % pattern.size()];
      std::vector<std::vector<int32_t>> outs(live.size());
      std::vector<uint64_t> want_accepted(live.size(), 0), before(live.size());
      std::vector<std::vector<int32_t>> want_draft(live.size());
      std::vector<std::vector<float>> want_conf(live.size());
      for (size_t j = 0; j < live.size(); ++j) before[j] = live[j]->stats().accepted;
      if (mode == 1) {
        // The reference: a fresh decoder prefilled with the same tokens drafts from a context
        // observed in one go; its round accepts what this round must.
        for (size_t j = 0; j < live.size(); ++j) {
          Sampler rs(0, 1, 0);
          SpeculativeDecoder ref(e.get(), m.draft.get(), m.weights.get(), nullptr, o, &rs);
          SequenceState rst = e->NewSequence();
          ASSERT_TRUE(ref.StartWith(&rst, lst[j]->tokens, live[j]->pending()).ok());
          std::vector<int32_t> rout;
          ASSERT_TRUE(ref.Round(&rst, &rout).ok());
          want_accepted[j] = ref.stats().accepted;
          want_draft[j] = ref.last_draft_tokens();
          want_conf[j] = ref.last_draft_confidence();
        }
        ASSERT_TRUE(SpeculativeDecoder::RoundBatch(live, lst, &outs, true).ok());
        ++drafted_rounds;
      } else if (mode == 0) {
        ASSERT_TRUE(SpeculativeDecoder::RoundBatch(live, lst, &outs, false).ok());
        ++undrafted_rounds;
      } else {
        // The caller's own pass: the pending tokens beside a prefill chunk of another sequence.
        SequenceState other = e->NewSequence();
        const std::vector<int32_t> chunk = Bytes(Texts()[(g + kBatch) % Texts().size()]);
        std::vector<SequenceState*> ptrs = lst;
        ptrs.push_back(&other);
        std::vector<int32_t> pend;
        for (SpeculativeDecoder* d : live) pend.push_back(d->pending());
        std::vector<std::span<const int32_t>> spans;
        std::vector<AttnInputCapture*> caps;
        for (size_t j = 0; j < live.size(); ++j) {
          spans.emplace_back(&pend[j], 1);
          caps.push_back(live[j]->StepCapture(*lst[j]));
        }
        spans.emplace_back(chunk);
        caps.push_back(nullptr);
        std::vector<std::vector<float>> last;
        ASSERT_TRUE(e->ForwardBatch(ptrs, spans, &last, nullptr, caps).ok());
        for (size_t j = 0; j < live.size(); ++j)
          ASSERT_TRUE(live[j]->FinishStep(lst[j], last[j], &outs[j]).ok());
        ++undrafted_rounds;
      }
      for (size_t j = 0; j < live.size(); ++j) {
        const int i = idx[j];
        if (mode == 1) {
          EXPECT_EQ(live[j]->stats().accepted - before[j], want_accepted[j])
              << "sequence " << g + i << " round " << round << ": the draft saw another context";
          EXPECT_EQ(live[j]->last_draft_tokens(), want_draft[j]) << "sequence " << g + i;
          const std::vector<float>& c = live[j]->last_draft_confidence();
          EXPECT_TRUE(c.size() == want_conf[j].size() &&
                      std::memcmp(c.data(), want_conf[j].data(), c.size() * 4) == 0)
              << "sequence " << g + i << " round " << round << ": confidences differ";
          accepted += want_accepted[j];
        } else {
          ASSERT_EQ(outs[j].size(), 1u);
        }
        got[i].insert(got[i].end(), outs[j].begin(), outs[j].end());
        const size_t done = got[i].size() - 1;
        ASSERT_LE(done, plain[i].size());
        ASSERT_TRUE(SameState(st[i], plain[i][done - 1]))
            << "sequence " << g + i << " round " << round << " mode " << mode;
      }
    }
    for (int i = 0; i < kBatch; ++i) {
      got[i].resize(kNew);
      EXPECT_EQ(got[i], std::vector<int32_t>(want[i].begin(), want[i].begin() + kNew))
          << "sequence " << g + i;
    }
  }
  EXPECT_GT(drafted_rounds, 10u);
  EXPECT_GT(undrafted_rounds, 10u);
  EXPECT_GT(accepted, 20u);
}

// FinishStep refuses a state that the caller's pass did not extend by the pending token.
TEST(Speculative, FinishStepRejectsAStateItDidNotSee) {
  const Trained& m = Model();
  auto e = MakeEngine();
  Sampler s(0, 1, 0);
  SpeculativeOptions o;
  SpeculativeDecoder d(e.get(), m.draft.get(), m.weights.get(), nullptr, o, &s);
  SequenceState st = e->NewSequence();
  int32_t first = -1;
  ASSERT_TRUE(d.Start(&st, Bytes("abc"), &first).ok());
  std::vector<float> logits(static_cast<size_t>(m.config.vocab_size));
  std::vector<int32_t> out;
  EXPECT_FALSE(d.FinishStep(&st, logits, &out).ok()) << "no StepCapture";
  d.StepCapture(st);
  EXPECT_FALSE(d.FinishStep(&st, logits, &out).ok()) << "the pass did not run";
  const int32_t other = first == 10 ? 11 : 10;
  ASSERT_TRUE(e->Decode(&st, other, &logits).ok());
  EXPECT_FALSE(d.FinishStep(&st, logits, &out).ok()) << "another token ran";
  EXPECT_TRUE(out.empty());
  EXPECT_EQ(d.pending(), first);
}

TEST(Speculative, RoundBatchRejectsBadArguments) {
  const Trained& m = Model();
  auto e = MakeEngine();
  Sampler s1(0, 1, 0), s2(0, 1, 0);
  SpeculativeOptions o;
  SpeculativeDecoder a(e.get(), m.draft.get(), m.weights.get(), nullptr, o, &s1);
  SpeculativeDecoder b(e.get(), m.draft.get(), m.weights.get(), nullptr, o, &s2);
  SequenceState sa = e->NewSequence(), sb = e->NewSequence();
  std::vector<std::vector<int32_t>> outs(2);
  std::vector<SpeculativeDecoder*> ab = {&a, &b};
  std::vector<SequenceState*> states = {&sa, &sb};
  EXPECT_FALSE(SpeculativeDecoder::RoundBatch(ab, states, &outs).ok());  // not started
  int32_t first = -1;
  ASSERT_TRUE(a.Start(&sa, Bytes("abc"), &first).ok());
  ASSERT_TRUE(b.Start(&sb, Bytes("xyz"), &first).ok());
  const SequenceState before = sa;
  std::vector<SequenceState*> twice = {&sa, &sa};
  EXPECT_FALSE(SpeculativeDecoder::RoundBatch(ab, twice, &outs).ok());
  std::vector<SpeculativeDecoder*> dtwice = {&a, &a};
  EXPECT_FALSE(SpeculativeDecoder::RoundBatch(dtwice, states, &outs).ok());
  std::vector<SequenceState*> one = {&sa};
  EXPECT_FALSE(SpeculativeDecoder::RoundBatch(ab, one, &outs).ok());
  EXPECT_FALSE(SpeculativeDecoder::RoundBatch({}, {}, &outs).ok());
  auto other = MakeEngine();
  SpeculativeDecoder c(other.get(), m.draft.get(), m.weights.get(), nullptr, o, &s2);
  SequenceState sc = other->NewSequence();
  ASSERT_TRUE(c.Start(&sc, Bytes("xyz"), &first).ok());
  std::vector<SpeculativeDecoder*> ac = {&a, &c};
  std::vector<SequenceState*> asc = {&sa, &sc};
  EXPECT_FALSE(SpeculativeDecoder::RoundBatch(ac, asc, &outs).ok());
  EXPECT_TRUE(SameState(sa, before));
  EXPECT_TRUE(SpeculativeDecoder::RoundBatch(ab, states, &outs).ok());
}

// The first token a round emits after a fixed pending token is distributed as the target's
// (temperature 1.5, top-p 0.95 after "ls [-": a few dozen candidate ids). 2000 rounds from copies
// of one decoder; Pearson chi-square over the ids with expected count >= 5 (the rest pooled),
// against a bound far in the tail (df + 6 sqrt(2 df)); a sampler that skips the residual (draws the
// rejection's token from p) fails it.
TEST(Speculative, SamplingMatchesTargetDistribution) {
  const Trained& m = Model();
  auto e = MakeEngine();
  const std::vector<int32_t> prompt = Bytes(Texts()[4]);
  const int32_t next = 3 + '-';
  Sampler sampler(1.5, 0.95, 42);
  SpeculativeOptions o;
  o.draft_len = 5;
  SpeculativeDecoder dec(e.get(), m.draft.get(), m.weights.get(), nullptr, o, &sampler);
  SequenceState st0 = e->NewSequence();
  ASSERT_TRUE(dec.StartWith(&st0, prompt, next).ok());
  // The target's distribution of the token after `next`.
  std::vector<double> p;
  {
    SequenceState s = st0;
    std::vector<float> logits;
    ASSERT_TRUE(e->Decode(&s, next, &logits).ok());
    p = sampler.Probabilities(logits);
  }
  constexpr int kTrials = 2000;
  std::map<int32_t, int> count;
  uint64_t rejected = 0;
  for (int i = 0; i < kTrials; ++i) {
    SpeculativeDecoder d = dec;
    SequenceState s = st0;
    std::vector<int32_t> out;
    ASSERT_TRUE(d.Round(&s, &out).ok());
    ++count[out[0]];
    rejected += d.stats().rejections;
  }
  double chi2 = 0, pooled_e = 0, pooled_o = 0;
  int df = -1;
  for (size_t v = 0; v < p.size(); ++v) {
    const double ex = p[v] * kTrials;
    const double ob = count.count(static_cast<int32_t>(v)) ? count[static_cast<int32_t>(v)] : 0;
    if (ex >= 5) {
      chi2 += (ob - ex) * (ob - ex) / ex;
      ++df;
    } else {
      pooled_e += ex;
      pooled_o += ob;
    }
  }
  if (pooled_e > 0) {
    chi2 += (pooled_o - pooled_e) * (pooled_o - pooled_e) / std::max(pooled_e, 1.0);
    ++df;
  }
  ASSERT_GE(df, 3);
  EXPECT_LT(chi2, df + 6 * std::sqrt(2.0 * df)) << "df " << df;
  std::printf("chi-square %.1f, df %d, %llu rejections\n", chi2, df,
              static_cast<unsigned long long>(rejected));
  EXPECT_GT(rejected, 100u);  // the residual path ran
}

}  // namespace
}  // namespace kvtier::engine
