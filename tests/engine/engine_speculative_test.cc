// DSpark and speculative decoding on the trained miniature (deploy/models/kvmini-trained*):
//   - the draft pass against the PyTorch reference's golden vectors (reference/dspark_golden.py);
//   - RollbackTo leaves exactly the state plain decoding makes (every field, bit for bit);
//   - greedy speculative decoding emits plain greedy's tokens, and its state after every round
//     (rejections included) equals plain decoding's;
//   - with sampling, the first emitted token is distributed as the target's (chi-square);
//   - the scheduler's choice of B, and hostile DSpark configs.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <utility>

#include "engine/dspark.h"
#include "engine/sampler.h"
#include "engine/speculative.h"

namespace kvtier::engine {
namespace {

using json = nlohmann::json;

std::string Src(const std::string& rel) { return std::string(KVTIER_SOURCE_DIR) + "/" + rel; }

struct Trained {
  EngineConfig config;
  DSparkConfig dconfig;
  std::shared_ptr<const ModelWeights> weights;
  std::unique_ptr<DSpark> draft;
};

const Trained& Model() {
  static const Trained* t = [] {
    auto* m = new Trained();
    auto c = LoadEngineConfig(Src("deploy/models/kvmini-trained.json"));
    if (!c.ok()) {
      ADD_FAILURE() << c.status().ToString();
      std::abort();
    }
    m->config = *c;
    auto dc = LoadDSparkConfig(Src("deploy/models/kvmini-trained.json"), m->config);
    auto w = LoadWeights(m->config, Src("deploy/models/kvmini-trained.safetensors"));
    if (!dc.ok() || !w.ok()) {
      ADD_FAILURE() << dc.status().ToString() << " " << w.status().ToString();
      std::abort();
    }
    m->dconfig = *dc;
    m->weights = std::make_shared<const ModelWeights>(std::move(*w));
    auto d = DSpark::Load(m->config, m->dconfig, m->weights,
                          Src("deploy/models/kvmini-trained-dspark.safetensors"));
    if (!d.ok()) {
      ADD_FAILURE() << d.status().ToString();
      std::abort();
    }
    m->draft = std::move(*d);
    return m;
  }();
  return *t;
}

std::unique_ptr<Engine> MakeEngine() {
  auto e = Engine::Create(Model().config, Model().weights, EngineOptions{});
  if (!e.ok()) {
    ADD_FAILURE() << e.status().ToString();
    std::abort();
  }
  return std::move(*e);
}

std::vector<int32_t> Bytes(const std::string& s) {
  std::vector<int32_t> t = {0};  // bos
  for (unsigned char ch : s) t.push_back(3 + ch);
  return t;
}

const std::vector<std::string>& Texts() {
  static const std::vector<std::string> t = {
      "#include <stdio.h>\n\nint main(int argc, char **argv) {\n  ",
      "    def __init__(self, name, value=None):\n        self.",
      "This program is free software; you can redistribute it and/or modify\nit ",
      "2023-04-01  John Smith  <jsmith@example.org>\n\n\t* configure.ac: ",
      "NAME\n       ls - list directory contents\n\nSYNOPSIS\n       ls [",
      "  if (ret < 0) {\n    fprintf(stderr, \"error: %s\\n\", strerror(errno));\n",
      "import os\nimport sys\n\n\ndef main():\n    parser = argparse.",
      "PASS: test-suite/basic.exp: print the value\nPASS: ",
      "The GNU General Public License is a free, copyleft license for\n",
      "for (i = 0; i < n; i++) {\n\t\tif (a[i] == ",
      "set(CMAKE_CXX_STANDARD 20)\nadd_library(",
      "       -a, --all\n              do not ignore entries starting with .\n\n",
  };
  return t;
}

// Every field of two states, bit for bit; names the first difference.
::testing::AssertionResult SameState(const SequenceState& a, const SequenceState& b) {
  if (a.tokens != b.tokens) return ::testing::AssertionFailure() << "tokens differ";
  if (a.swa.size() != b.swa.size() || a.kv.size() != b.kv.size())
    return ::testing::AssertionFailure() << "layout differs";
  auto fbits = [](const std::vector<float>& x, const std::vector<float>& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * 4) == 0;
  };
  for (size_t l = 0; l < a.swa.size(); ++l) {
    const SwaRing &x = a.swa[l], &y = b.swa[l];
    if (x.window != y.window || x.dim != y.dim || x.valid_from != y.valid_from || x.end != y.end ||
        !fbits(x.values, y.values) || x.data != y.data || x.scales != y.scales)
      return ::testing::AssertionFailure() << "SWA ring of layer " << l << " differs";
  }
  for (size_t i = 0; i < a.kv.size(); ++i) {
    const KvSourceCache &x = a.kv[i], &y = b.kv[i];
    if (x.layer != y.layer || x.ratio != y.ratio || x.head_dim != y.head_dim ||
        x.index_dim != y.index_dim || x.consumed != y.consumed || x.entries() != y.entries())
      return ::testing::AssertionFailure() << "kv source " << x.layer << " header differs";
    if (x.main_data != y.main_data || x.main_scales != y.main_scales ||
        x.index_data != y.index_data || x.index_scales != y.index_scales)
      return ::testing::AssertionFailure() << "kv source " << x.layer << " entries differ";
    if (!fbits(x.kv_state, y.kv_state) || !fbits(x.score_state, y.score_state))
      return ::testing::AssertionFailure() << "kv source " << x.layer << " partial group differs";
  }
  return ::testing::AssertionSuccess();
}

// ---- the draft pass against the reference ---------------------------------------------------

TEST(DSparkGolden, DraftMatchesReference) {
  const Trained& m = Model();
  std::ifstream mf(Src("tests/engine/golden/dspark.json"));
  ASSERT_TRUE(mf.good());
  json man = json::parse(mf);
  std::ifstream bf(Src("tests/engine/golden/" + man["bin"].get<std::string>()), std::ios::binary);
  std::vector<char> raw((std::istreambuf_iterator<char>(bf)), std::istreambuf_iterator<char>());
  const std::vector<int32_t> tokens = man["tokens"].get<std::vector<int32_t>>();
  const int n = static_cast<int>(tokens.size()), NT = man["n_targets"], D = man["dim"];
  const int K = man["block_size"], V = man["vocab"];
  ASSERT_EQ(raw.size(), static_cast<size_t>(n * NT * D + K * V + K) * 4);
  const float* streams = reinterpret_cast<const float*>(raw.data());
  const float* logits = streams + n * NT * D;
  const float* conf = logits + K * V;

  // 1. The draft alone, fed the reference's streams: float32 rounding only.
  AttnInputCapture cap;
  cap.layers = m.dconfig.target_layer_ids;
  cap.Clear();
  for (int i = 0; i < NT; ++i) {
    cap.first_pos[i] = 0;
    for (int t = 0; t < n; ++t)
      cap.stream_mean[i].insert(cap.stream_mean[i].end(), streams + (t * NT + i) * D,
                                streams + (t * NT + i + 1) * D);
  }
  DraftContext ctx;
  ASSERT_TRUE(m.draft->Observe(cap, 0, n, &ctx).ok());
  DraftResult r;
  ASSERT_TRUE(m.draft->Draft(ctx, man["last"].get<int32_t>(), 0, {}, &r).ok());
  float worst = 0;
  for (int k = 0; k < K; ++k) {
    for (int v = 0; v < V; ++v)
      worst = std::max(worst, std::fabs(r.logits[k][v] - logits[k * V + v]));
    EXPECT_NEAR(r.confidence[k], conf[k], 1e-4) << "position " << k;
    if (man["margins"][k].get<float>() > 2e-3f) {
      EXPECT_EQ(r.tokens[k], man["draft_tokens"][k].get<int32_t>()) << "position " << k;
    }
  }
  EXPECT_LT(worst, 1e-3f);

  // 2. The engine's captured streams over the same prompt (its own caches: quantiser flips
  // allowed, see engine_golden_test.cc).
  auto e = MakeEngine();
  SequenceState st = e->NewSequence();
  AttnInputCapture mine;
  mine.layers = m.dconfig.target_layer_ids;
  e->set_attn_capture(&mine);
  std::vector<float> out;
  ASSERT_TRUE(e->Forward(&st, tokens, false, &out).ok());
  e->set_attn_capture(nullptr);
  float sworst = 0;
  for (int i = 0; i < NT; ++i) {
    ASSERT_EQ(mine.first_pos[i], 0);
    ASSERT_EQ(mine.stream_mean[i].size(), static_cast<size_t>(n) * D);
    for (int t = 0; t < n; ++t)
      for (int d = 0; d < D; ++d)
        sworst = std::max(
            sworst, std::fabs(mine.stream_mean[i][t * D + d] - streams[(t * NT + i) * D + d]));
  }
  EXPECT_LT(sworst, 0.05f);
}

// from_pos bounds a long prefill's capture to its tail, with the same rows as a full capture.
TEST(AttnInputCapture, FromPosKeepsOnlyTheTail) {
  const Trained& m = Model();
  auto e = MakeEngine();
  std::vector<int32_t> prompt;
  for (const std::string& t : Texts()) {
    const std::vector<int32_t> b = Bytes(t);
    prompt.insert(prompt.end(), b.begin(), b.end());
  }
  ASSERT_GT(prompt.size(), 300u);
  const int D = m.config.hidden_size, n = static_cast<int>(prompt.size());
  AttnInputCapture full, tail;
  full.layers = tail.layers = CaptureLayers(m.config, m.dconfig);
  tail.from_pos = n - 16;
  std::vector<float> logits;
  for (AttnInputCapture* c : {&full, &tail}) {
    SequenceState st = e->NewSequence();
    e->set_attn_capture(c);
    ASSERT_TRUE(e->Forward(&st, prompt, false, &logits).ok());
    e->set_attn_capture(nullptr);
  }
  for (size_t i = 0; i < tail.layers.size(); ++i) {
    EXPECT_EQ(full.first_pos[i], 0);
    EXPECT_EQ(tail.first_pos[i], n - 16);
    ASSERT_EQ(tail.stream_mean[i].size(), 16u * D);
    ASSERT_EQ(tail.normed[i].size(), 16u * D);
    EXPECT_TRUE(std::equal(tail.stream_mean[i].begin(), tail.stream_mean[i].end(),
                           full.stream_mean[i].end() - 16 * D));
    EXPECT_TRUE(
        std::equal(tail.normed[i].begin(), tail.normed[i].end(), full.normed[i].end() - 16 * D));
  }
}

// Record's stream mean, four elements at a time, equals the scalar sum of the copies in order
// divided by hc bit for bit (dims with and without a tail of fewer than 4), and
// record_normed = false leaves normed empty.
TEST(AttnInputCapture, RecordMeansTheCopiesBitForBitAsTheScalarLoop) {
  uint64_t z = 7;
  auto next = [&] {  // floats of mixed magnitudes and signs, zeros included
    z = z * 6364136223846793005ULL + 1442695040888963407ULL;
    const int e = static_cast<int>((z >> 40) % 40) - 20;
    return (z >> 63 ? -1.0f : 1.0f) *
           ((z >> 33) % 7 == 0 ? 0.0f : std::ldexp(1.0f + (z >> 41) % 997 / 997.0f, e));
  };
  for (const auto& [hc, dim] :
       {std::pair{4, 64}, std::pair{3, 6}, std::pair{1, 3}, std::pair{5, 9}}) {
    const int n = 3;
    std::vector<float> x(static_cast<size_t>(n) * hc * dim), xa(static_cast<size_t>(n) * dim);
    for (float& v : x) v = next();
    for (float& v : xa) v = next();
    for (const bool normed : {true, false}) {
      AttnInputCapture cap;
      cap.layers = {5};
      cap.record_normed = normed;
      cap.Clear();
      cap.Record(5, 10, n, hc, dim, x.data(), xa.data());
      ASSERT_EQ(cap.first_pos[0], 10);
      ASSERT_EQ(cap.stream_mean[0].size(), x.size() / hc);
      for (int t = 0; t < n; ++t) {
        for (int d = 0; d < dim; ++d) {
          float acc = 0.0f;
          for (int c = 0; c < hc; ++c) acc += x[(static_cast<size_t>(t) * hc + c) * dim + d];
          const float want = acc / static_cast<float>(hc);
          const float got = cap.stream_mean[0][static_cast<size_t>(t) * dim + d];
          EXPECT_EQ(std::memcmp(&got, &want, 4), 0) << "hc " << hc << " dim " << dim << " t " << t
                                                    << " d " << d << ": " << got << " != " << want;
        }
      }
      EXPECT_EQ(cap.normed[0], normed ? xa : std::vector<float>()) << "hc " << hc;
    }
  }
}

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

// Plain greedy decoding of `prompt`: the tokens and the state after prompt + tokens[0..i] for
// every i.
void PlainGreedy(Engine* e, const std::vector<int32_t>& prompt, int count,
                 std::vector<int32_t>* tokens, std::vector<SequenceState>* states) {
  Sampler greedy(0, 1, 0);
  SequenceState plain = e->NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(e->Forward(&plain, prompt, false, &logits).ok());
  for (int i = 0; i < count; ++i) {
    tokens->push_back(greedy.Sample(logits));
    ASSERT_TRUE(e->Decode(&plain, tokens->back(), &logits).ok());
    states->push_back(plain);
  }
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

// ---- scheduler and config -----------------------------------------------------------------------

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

TEST(DSparkConfigTest, RejectsHostileValues) {
  const EngineConfig& c = Model().config;
  const std::string ok =
      R"({"dspark_block_size":5,"dspark_noise_token_id":511,"dspark_target_layer_ids":[5,6,7],)"
      R"("dspark_markov_rank":32,"dspark_n_routed_experts":8,"num_nextn_predict_layers":3})";
  EXPECT_TRUE(ParseDSparkConfig(ok, c).ok());
  auto with = [&](const std::string& key, const std::string& value) {
    json j = json::parse(ok);
    j[key] = json::parse(value);
    return ParseDSparkConfig(j.dump(), c);
  };
  EXPECT_FALSE(with("dspark_block_size", "0").ok());
  EXPECT_FALSE(with("dspark_block_size", "16").ok());  // over the window
  EXPECT_FALSE(with("dspark_noise_token_id", "512").ok());
  EXPECT_FALSE(with("dspark_target_layer_ids", "[8]").ok());
  EXPECT_FALSE(with("dspark_target_layer_ids", "[]").ok());
  EXPECT_FALSE(with("dspark_markov_rank", "100000").ok());
  EXPECT_FALSE(with("dspark_block_size", "\"five\"").ok());
  EXPECT_FALSE(ParseDSparkConfig("{", c).ok());
  EXPECT_FALSE(ParseDSparkConfig("[]", c).ok());
}

TEST(DSparkLoad, RejectsMissingOrMisshapenTensors) {
  const Trained& m = Model();
  auto f = ReadSafetensors(Src("deploy/models/kvmini-trained-dspark.safetensors"));
  ASSERT_TRUE(f.ok());
  const std::string dir = ::testing::TempDir();
  TensorFile missing = *f;
  missing.tensors.erase("dspark.markov_head");
  ASSERT_TRUE(WriteSafetensors(dir + "/missing.safetensors", missing).ok());
  EXPECT_FALSE(DSpark::Load(m.config, m.dconfig, m.weights, dir + "/missing.safetensors").ok());
  TensorFile shape = *f;
  shape.tensors["dspark.conf.bias"].shape = {1, 1};
  ASSERT_TRUE(WriteSafetensors(dir + "/shape.safetensors", shape).ok());
  EXPECT_FALSE(DSpark::Load(m.config, m.dconfig, m.weights, dir + "/shape.safetensors").ok());
  TensorFile nan = *f;
  nan.tensors["dspark.conf.bias"].f32()[0] = std::nanf("");
  ASSERT_TRUE(WriteSafetensors(dir + "/nan.safetensors", nan).ok());
  EXPECT_FALSE(DSpark::Load(m.config, m.dconfig, m.weights, dir + "/nan.safetensors").ok());
}

}  // namespace
}  // namespace kvtier::engine
