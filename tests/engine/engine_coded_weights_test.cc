// expert_format "mxfp4" and weight_format "fp8" (engine/config.h): the config keys and their
// limits, and an engine with MXFP4 routed experts or FP8 dense projections computes exactly what
// an f32 engine computes on the checkpoint with those matrices rounded (kernels::RoundTrip of
// each row), through prompts, decodes and batched passes, while it reads their codes. ctest
// runs it also with the AVX2 and the scalar MatMul.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/matmul.h"
#include "engine/model.h"
#include "engine/weights.h"
#include "engine_test_util.h"
#include "kernels/quant.h"

namespace kvtier::engine {
namespace {

using testutil::BitEqual;
using testutil::Prompt;
using testutil::TinyConfig;

std::string MiniJsonWith(const std::string& extra) {
  return R"({"vocab_size":512,"hidden_size":256,"num_hidden_layers":2,"num_attention_heads":8,
    "head_dim":128,"qk_rope_head_dim":16,"q_lora_rank":64,"o_lora_rank":64,"o_groups":2,
    "sliding_window":16,"compress_ratios":[0,0],"kv_source_layer_ids":[],
    "index_source_layer_ids":[],"index_n_heads":4,"index_head_dim":32,"index_topk":16,
    "n_routed_experts":4,"num_experts_per_tok":2,"moe_intermediate_size":)" +
         extra + "}";
}

TEST(Mxfp4Experts, TheConfigKeyTakesF32OrMxfp4) {
  auto plain = ParseEngineConfig(MiniJsonWith("128"));
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_EQ(plain->expert_format, ExpertFormat::kF32);
  auto f32 = ParseEngineConfig(MiniJsonWith(R"(128, "expert_format":"f32")"));
  ASSERT_TRUE(f32.ok()) << f32.status().ToString();
  EXPECT_EQ(f32->expert_format, ExpertFormat::kF32);
  auto fp4 = ParseEngineConfig(MiniJsonWith(R"(128, "expert_format":"mxfp4")"));
  ASSERT_TRUE(fp4.ok()) << fp4.status().ToString();
  EXPECT_EQ(fp4->expert_format, ExpertFormat::kMxfp4);
  EXPECT_EQ(ExpertFormatName(fp4->expert_format), "mxfp4");

  auto unknown = ParseEngineConfig(MiniJsonWith(R"(128, "expert_format":"fp8")"));
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("expert_format"), std::string::npos);
  auto wrong_type = ParseEngineConfig(MiniJsonWith(R"(128, "expert_format":4)"));
  EXPECT_EQ(wrong_type.status().code(), StatusCode::kInvalidArgument);
  // MXFP4 blocks are 32 inputs: w2's inputs are moe_intermediate_size.
  auto ragged = ParseEngineConfig(MiniJsonWith(R"(48, "expert_format":"mxfp4")"));
  ASSERT_FALSE(ragged.ok());
  EXPECT_NE(ragged.status().message().find("multiples of 32"), std::string::npos);
  EXPECT_TRUE(ParseEngineConfig(MiniJsonWith("48")).ok());  // f32 has no such limit
}

// The checkpoint with the matrices a format covers rounded row by row: the routed experts to
// MXFP4, or the dense projections to FP8 (engine/config.h lists them).
bool CoveredByFp8(const std::string& name) {
  for (const char* s : {".attn.wq_a.weight", ".attn.wq_b.weight", ".attn.wkv.weight",
                        ".attn.wo_b.weight", ".ffn.shared_experts.", ".engram.wkv.weight"}) {
    if (name.find(s) != std::string::npos) return true;
  }
  return false;
}
std::shared_ptr<const ModelWeights> Rounded(const ModelWeights& w, kernels::QuantFormat f) {
  const bool fp8 = f == kernels::QuantFormat::kFp8Ue8m0x32;
  auto r = std::make_shared<ModelWeights>(w);
  int rounded = 0;
  for (auto& [name, t] : r->file.tensors) {
    if (fp8 ? !CoveredByFp8(name) : name.find(".ffn.experts.") == std::string::npos) continue;
    ++rounded;
    EXPECT_EQ(t.dtype, "F32");
    EXPECT_EQ(t.shape.size(), 2u);
    EXPECT_TRUE(kernels::RoundTrip(f, t.f32(), static_cast<size_t>(t.shape[0]),
                                   static_cast<size_t>(t.shape[1]), kernels::Backend::kReference)
                    .ok());
  }
  EXPECT_GT(rounded, 0);
  return r;
}

std::unique_ptr<Engine> Make(ExpertFormat format, std::shared_ptr<const ModelWeights> w,
                             int threads, WeightFormat weights = WeightFormat::kF32) {
  EngineConfig c = TinyConfig();
  c.expert_format = format;
  c.weight_format = weights;
  EXPECT_TRUE(c.Validate().ok());
  EngineOptions o;
  o.threads = threads;
  auto e = Engine::Create(c, std::move(w), o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::move(*e) : nullptr;
}

// A prompt, then decodes: every step's logits.
std::vector<std::vector<float>> Generate(Engine& e, const std::vector<int32_t>& prompt,
                                         int decodes) {
  std::vector<std::vector<float>> out;
  SequenceState st = e.NewSequence();
  std::vector<float> logits;
  EXPECT_TRUE(e.Forward(&st, prompt, true, &logits).ok());
  out.push_back(logits);
  for (int i = 0; i < decodes; ++i) {
    const int32_t next = testutil::Argmax(logits.data() + logits.size() - TinyConfig().vocab_size,
                                          TinyConfig().vocab_size);
    EXPECT_TRUE(e.Decode(&st, next, &logits).ok());
    out.push_back(logits);
  }
  return out;
}

bool Same(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].size() != b[i].size() || !BitEqual(a[i].data(), b[i].data(), a[i].size()))
      return false;
  }
  return true;
}

// An engine with the formats, on `original`, computes at 1 and 2 threads what an f32 engine
// computes on `rounded`, and not what it computes on `original` (the formats change something).
void ExpectTheF32EngineOn(const std::shared_ptr<const ModelWeights>& rounded,
                          const std::shared_ptr<const ModelWeights>& original, ExpertFormat experts,
                          WeightFormat projections) {
  const auto prompt = Prompt(40, 5);
  for (int threads : {1, 2}) {
    auto coded = Make(experts, original, threads, projections);
    auto on_rounded = Make(ExpertFormat::kF32, rounded, threads);
    auto f32 = Make(ExpertFormat::kF32, original, threads);
    ASSERT_TRUE(coded && on_rounded && f32);
    const auto a = Generate(*coded, prompt, 6);
    EXPECT_TRUE(Same(a, Generate(*on_rounded, prompt, 6))) << "threads " << threads;
    EXPECT_FALSE(Same(a, Generate(*f32, prompt, 6))) << "the format changed nothing";
  }
}

std::shared_ptr<const ModelWeights> Initial(uint64_t seed) {
  auto w = InitWeights(TinyConfig(), seed);
  EXPECT_TRUE(w.ok()) << w.status().ToString();
  return w.ok() ? std::make_shared<const ModelWeights>(std::move(*w)) : nullptr;
}

TEST(Mxfp4Experts, AnMxfp4EngineIsTheF32EngineOnTheRoundedExperts) {
  auto original = Initial(3);
  ASSERT_TRUE(original);
  auto rounded = Rounded(*original, kernels::QuantFormat::kFp4Ue8m0x32);
  ExpectTheF32EngineOn(rounded, original, ExpertFormat::kMxfp4, WeightFormat::kF32);
  // Rounding the rounded experts again changes nothing (MXFP4 values are fixed points).
  const auto prompt = Prompt(40, 5);
  for (int threads : {1, 2}) {
    auto fp4_on_rounded = Make(ExpertFormat::kMxfp4, rounded, threads);
    auto on_rounded = Make(ExpertFormat::kF32, rounded, threads);
    ASSERT_TRUE(fp4_on_rounded && on_rounded);
    EXPECT_TRUE(Same(Generate(*fp4_on_rounded, prompt, 6), Generate(*on_rounded, prompt, 6)))
        << "threads " << threads;
  }
}

TEST(Fp8Weights, AnFp8EngineIsTheF32EngineOnTheRoundedProjections) {
  auto original = Initial(3);
  ASSERT_TRUE(original);
  auto rounded = Rounded(*original, kernels::QuantFormat::kFp8Ue8m0x32);
  ExpectTheF32EngineOn(rounded, original, ExpertFormat::kF32, WeightFormat::kFp8);
  // Both formats at once: the experts rounded too.
  ExpectTheF32EngineOn(Rounded(*rounded, kernels::QuantFormat::kFp4Ue8m0x32), original,
                       ExpertFormat::kMxfp4, WeightFormat::kFp8);
}

TEST(Fp8Weights, TheConfigKeyTakesF32OrFp8) {
  auto plain = ParseEngineConfig(MiniJsonWith("128"));
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->weight_format, WeightFormat::kF32);
  auto fp8 = ParseEngineConfig(MiniJsonWith(R"(128, "weight_format":"fp8")"));
  ASSERT_TRUE(fp8.ok()) << fp8.status().ToString();
  EXPECT_EQ(fp8->weight_format, WeightFormat::kFp8);
  EXPECT_EQ(WeightFormatName(fp8->weight_format), "fp8");
  auto unknown = ParseEngineConfig(MiniJsonWith(R"(128, "weight_format":"bf16")"));
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("weight_format"), std::string::npos);
  // FP8 blocks are 32 inputs: the shared expert's w2 takes moe_intermediate_size inputs.
  auto ragged = ParseEngineConfig(MiniJsonWith(R"(48, "weight_format":"fp8")"));
  ASSERT_FALSE(ragged.ok());
  EXPECT_NE(ragged.status().message().find("multiples of 32"), std::string::npos);
}

// The equivalence tests above cannot tell codes from floats (the same bits either way): the
// products must read the codes, one packed copy per covered matrix (none while the scalar
// kernel, which packs nothing, is active).
TEST(CodedWeights, TheProductsReadEveryCoveredMatrixAsCodes) {
  auto w = Initial(3);
  ASSERT_TRUE(w);
  const EngineConfig& c = TinyConfig();
  const bool packs = ActiveMatMulKernel() != MatMulKernel::kScalar;
  const size_t L = c.num_hidden_layers, experts = L * c.n_routed_experts * 3;
  // wq_a, wq_b, wkv, wo_b and the shared expert's three per layer, the Engram projections.
  const size_t projections = L * 7 + c.engram_layer_ids.size();
  const struct {
    ExpertFormat experts;
    WeightFormat projections;
    size_t mxfp4, fp8;
  } cases[] = {{ExpertFormat::kF32, WeightFormat::kF32, 0, 0},
               {ExpertFormat::kMxfp4, WeightFormat::kF32, experts, 0},
               {ExpertFormat::kF32, WeightFormat::kFp8, 0, projections},
               {ExpertFormat::kMxfp4, WeightFormat::kFp8, experts, projections}};
  for (const auto& k : cases) {
    auto e = Make(k.experts, w, 1, k.projections);
    ASSERT_TRUE(e);
    EXPECT_EQ(e->PackedMatrices(PackedFormat::kMxfp4), packs ? k.mxfp4 : 0u);
    EXPECT_EQ(e->PackedMatrices(PackedFormat::kFp8), packs ? k.fp8 : 0u);
  }
}

TEST(Mxfp4Experts, ABatchedPassEqualsEachSequenceAlone) {
  auto w = Initial(4);
  ASSERT_TRUE(w);
  auto e = Make(ExpertFormat::kMxfp4, w, 2, WeightFormat::kFp8);
  ASSERT_TRUE(e);
  const int V = TinyConfig().vocab_size, k = 6;
  std::vector<SequenceState> states, alone;
  std::vector<float> logits;
  for (int i = 0; i < k; ++i) {
    states.push_back(e->NewSequence());
    alone.push_back(e->NewSequence());
    const auto p = Prompt(20 + 3 * i, 11 + i);
    ASSERT_TRUE(e->Forward(&states.back(), p, false, &logits).ok());
    ASSERT_TRUE(e->Forward(&alone.back(), p, false, &logits).ok());
  }
  std::vector<SequenceState*> ptrs;
  std::vector<std::vector<int32_t>> toks;
  for (int i = 0; i < k; ++i) {
    ptrs.push_back(&states[i]);
    toks.push_back({static_cast<int32_t>(40 + i)});
  }
  std::vector<std::span<const int32_t>> spans(toks.begin(), toks.end());
  std::vector<std::vector<float>> last;
  ASSERT_TRUE(e->ForwardBatch(ptrs, spans, &last).ok());
  ASSERT_EQ(last.size(), static_cast<size_t>(k));
  for (int i = 0; i < k; ++i) {
    ASSERT_TRUE(e->Decode(&alone[i], toks[i][0], &logits).ok());
    ASSERT_EQ(last[i].size(), static_cast<size_t>(V));
    EXPECT_TRUE(BitEqual(last[i].data(), logits.data(), V)) << "sequence " << i;
  }
}

}  // namespace
}  // namespace kvtier::engine
