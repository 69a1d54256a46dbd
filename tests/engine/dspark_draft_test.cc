// The DSpark draft on the trained miniature (deploy/models/kvmini-trained*):
//   - the draft pass against the PyTorch reference's golden vectors (reference/dspark_golden.py),
//     and the attention-input captures it reads;
//   - hostile DSpark configs and misshapen draft weights.
// Part of kvtier_engine_speculative_test (speculative_test_util.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "engine/dspark.h"
#include "engine/speculative.h"
#include "tests/engine/speculative_test_util.h"

namespace kvtier::engine {
namespace {

using json = nlohmann::json;
using testing_spec::Bytes;
using testing_spec::MakeEngine;
using testing_spec::Model;
using testing_spec::Src;
using testing_spec::Texts;
using testing_spec::Trained;

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

// The context keeps each row's per-block latents and keys (computed once, when the row is
// observed): a draft after rows observed one at a time, or a few at a time, is the same bit for
// bit as one after all of them observed at once.
TEST(DSparkContext, LatentsDoNotDependOnHowTheRowsWereObserved) {
  const Trained& m = Model();
  auto e = MakeEngine();
  SequenceState st = e->NewSequence();
  AttnInputCapture cap;
  cap.layers = m.dconfig.target_layer_ids;
  e->set_attn_capture(&cap);
  std::vector<float> out;
  const std::vector<int32_t> tokens = Bytes(Texts()[0]);
  ASSERT_GT(tokens.size(), 40u);
  ASSERT_TRUE(e->Forward(&st, tokens, false, &out).ok());
  e->set_attn_capture(nullptr);
  const int64_t n = static_cast<int64_t>(tokens.size()) - 1;  // the last token is `last`
  DraftContext whole, singles, pairs;
  ASSERT_TRUE(m.draft->Observe(cap, 0, n, &whole).ok());
  for (int64_t p = 0; p < n; ++p) ASSERT_TRUE(m.draft->Observe(cap, p, 1, &singles).ok());
  for (int64_t p = 0; p < n; p += 3)
    ASSERT_TRUE(m.draft->Observe(cap, p, std::min<int64_t>(3, n - p), &pairs).ok());
  DraftResult a, b, c;
  ASSERT_TRUE(m.draft->Draft(whole, tokens.back(), 0, {}, &a).ok());
  ASSERT_TRUE(m.draft->Draft(singles, tokens.back(), 0, {}, &b).ok());
  ASSERT_TRUE(m.draft->Draft(pairs, tokens.back(), 0, {}, &c).ok());
  for (const DraftResult* r : {&b, &c}) {
    EXPECT_EQ(r->tokens, a.tokens);
    ASSERT_EQ(r->logits.size(), a.logits.size());
    for (size_t k = 0; k < a.logits.size(); ++k) {
      EXPECT_EQ(std::memcmp(r->logits[k].data(), a.logits[k].data(), a.logits[k].size() * 4), 0)
          << "position " << k;
    }
    EXPECT_EQ(std::memcmp(r->confidence.data(), a.confidence.data(), a.confidence.size() * 4), 0);
  }
}

// A context's latents come from the weights of the draft that observed it: another draft (even
// one loaded from the same file) refuses to draft from it or to extend it.
TEST(DSparkContext, AnotherDraftRefusesTheContext) {
  const Trained& m = Model();
  auto other = DSpark::Load(m.config, m.dconfig, m.weights,
                            Src("deploy/models/kvmini-trained-dspark.safetensors"));
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  AttnInputCapture cap;
  cap.layers = m.dconfig.target_layer_ids;
  cap.Clear();
  const int D = m.config.hidden_size;
  for (size_t i = 0; i < cap.layers.size(); ++i) {
    cap.first_pos[i] = 0;
    cap.stream_mean[i].assign(static_cast<size_t>(8) * D, 0.25f);
  }
  DraftContext ctx;
  ASSERT_TRUE(m.draft->Observe(cap, 0, 4, &ctx).ok());
  DraftResult r;
  EXPECT_EQ((*other)->Draft(ctx, 7, 0, {}, &r).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*other)->Observe(cap, 4, 4, &ctx).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(m.draft->Draft(ctx, 7, 0, {}, &r).ok());
  // Cleared, the context is anyone's.
  ctx.Clear();
  EXPECT_TRUE((*other)->Observe(cap, 0, 4, &ctx).ok());
  EXPECT_TRUE((*other)->Draft(ctx, 7, 0, {}, &r).ok());
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

// ---- config and weights ----------------------------------------------------------------------

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
  EXPECT_FALSE(with("dspark_block_size", "5.5").ok());         // not truncated to 5
  EXPECT_FALSE(with("dspark_block_size", "4294967301").ok());  // not wrapped to 5
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

// Only the draft's own tensors are read, and no more bytes than they take: a file that also
// holds a large tensor of something else loads as fast as the draft alone (before, every tensor
// was read, up to 4 GiB); one of its own tensors larger than its shape says is refused.
TEST(DSparkLoad, ReadsOnlyItsOwnTensors) {
  const Trained& m = Model();
  auto f = ReadSafetensors(Src("deploy/models/kvmini-trained-dspark.safetensors"));
  ASSERT_TRUE(f.ok());
  const std::string dir = ::testing::TempDir();
  TensorFile more = *f;
  Tensor big;
  big.dtype = "F32";
  big.shape = {4 << 20};  // 16 MiB, more than the draft's own bytes
  big.bytes.assign(static_cast<size_t>(16) << 20, 0);
  more.tensors["other.unused"] = std::move(big);
  ASSERT_TRUE(WriteSafetensors(dir + "/more.safetensors", more).ok());
  auto d = DSpark::Load(m.config, m.dconfig, m.weights, dir + "/more.safetensors");
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ((*d)->held_bytes(), m.draft->held_bytes()) << "the extra tensor was read";
  EXPECT_LT(m.draft->held_bytes(), uint64_t{2} << 20);
  // The same draft as the shipped file's.
  AttnInputCapture cap;
  cap.layers = m.dconfig.target_layer_ids;
  cap.Clear();
  for (size_t i = 0; i < cap.layers.size(); ++i) {
    cap.first_pos[i] = 0;
    cap.stream_mean[i].assign(static_cast<size_t>(8) * m.config.hidden_size, 0.25f);
  }
  DraftContext a, b;
  ASSERT_TRUE(m.draft->Observe(cap, 0, 8, &a).ok());
  ASSERT_TRUE((*d)->Observe(cap, 0, 8, &b).ok());
  DraftResult ra, rb;
  ASSERT_TRUE(m.draft->Draft(a, 7, 0, {}, &ra).ok());
  ASSERT_TRUE((*d)->Draft(b, 7, 0, {}, &rb).ok());
  EXPECT_EQ(ra.tokens, rb.tokens);
  EXPECT_EQ(ra.logits, rb.logits);
  // One of its own tensors declared larger than its shape: refused before it is read (the
  // bytes allowed are what the draft's shapes take), not after.
  TensorFile inflated = *f;
  Tensor& bias = inflated.tensors["dspark.conf.bias"];
  bias.shape = {4 << 20};
  bias.bytes.assign(static_cast<size_t>(16) << 20, 0);
  ASSERT_TRUE(WriteSafetensors(dir + "/inflated.safetensors", inflated).ok());
  auto bad = DSpark::Load(m.config, m.dconfig, m.weights, dir + "/inflated.safetensors");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("allowed"), std::string::npos) << bad.status().ToString();
}

}  // namespace
}  // namespace kvtier::engine
