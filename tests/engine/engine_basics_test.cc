// Engine building blocks: config loading, safetensors, tokenizer, numpy RNG port, mHC, pool.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <thread>

#include "engine/config.h"
#include "engine/engram.h"
#include "engine/numpy_random.h"
#include "engine/ops.h"
#include "engine/safetensors.h"
#include "engine/sampler.h"
#include "engine/session.h"
#include "engine/thread_pool.h"
#include "engine/tokenizer.h"
#include "engine/weights.h"
#include "engine_test_util.h"

namespace kvtier::engine {
namespace {

TEST(EngineConfig, LoadsTheMiniConfigAndDerivesTheSchedule) {
  auto c = LoadEngineConfig(KVTIER_MINI_CONFIG);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->num_hidden_layers, 16);
  EXPECT_EQ(c->compress_ratios.size(), 16u);  // DSpark entries dropped
  EXPECT_EQ(c->first_decoder_layer, 8);
  EXPECT_EQ(c->layer_modes[0], LayerMode::kSwaOnly);
  EXPECT_EQ(c->layer_modes[2], LayerMode::kFull);
  EXPECT_EQ(c->layer_modes[3], LayerMode::kReuse);
  EXPECT_EQ(c->layer_modes[8], LayerMode::kFull);
  EXPECT_EQ(c->layer_modes[10], LayerMode::kReindex);
  EXPECT_EQ(c->layer_modes[15], LayerMode::kReuse);
  EXPECT_EQ(c->kv_source_of_layer[7], 6);
  EXPECT_EQ(c->kv_source_of_layer[15], 8);
  EXPECT_EQ(c->engram_vocab_size, (std::vector<int64_t>{8192, 8192, 8192}));
  EXPECT_EQ(c->engram_compressed_vocab_size, 512);
  EXPECT_DOUBLE_EQ(c->GlobalKvBytesPerToken(), 222.5);
  EXPECT_EQ(c->rope_scaling.type, "yarn");
}

TEST(EngineConfig, AcceptsNestedTextConfigAndRejectsBadOnes) {
  std::FILE* f = std::fopen(KVTIER_MINI_CONFIG, "rb");
  ASSERT_NE(f, nullptr);
  std::string text;
  char buf[4096];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof(buf), f)) > 0) text.append(buf, got);
  std::fclose(f);
  auto nested = ParseEngineConfig("{\"architectures\":[\"x\"],\"text_config\":" + text + "}");
  ASSERT_TRUE(nested.ok()) << nested.status().ToString();
  EXPECT_EQ(nested->hidden_size, 256);

  EXPECT_TRUE(ParseEngineConfig("not json").status().IsInvalidArgument());
  EXPECT_TRUE(ParseEngineConfig("{}").status().IsInvalidArgument());
  auto j = text;
  auto replace = [&](const std::string& from, const std::string& to) {
    std::string s = text;
    size_t at = s.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return s.replace(at, from.size(), to);
  };
  // A kv source at a ratio-0 layer, a head_dim that is not a multiple of 32, a reuse layer
  // before any index source, a bad scoring function, more mHC streams than the ops' stack
  // arrays hold: all InvalidArgument with a message.
  for (const auto& bad :
       {replace("\"kv_source_layer_ids\":[2,4,6,8]", "\"kv_source_layer_ids\":[1,4,6,8]"),
        replace("\"head_dim\":128", "\"head_dim\":100"),
        replace("\"index_source_layer_ids\":[2,4,6,8,10,12,14]",
                "\"index_source_layer_ids\":[4,6,8,10,12,14]"),
        replace("\"sqrtsoftplus\"", "\"softmax\""),
        replace("\"num_key_value_heads\":1", "\"num_key_value_heads\":2"),
        replace("\"hc_mult\":4", "\"hc_mult\":" + std::to_string(kHcMultMax + 1)),
        // An integer key takes only a JSON integer in its type's range: 256.5 truncated and
        // 2^32 + 256 wrapped to a valid 256 before; a bool key only true or false.
        replace("\"hidden_size\":256", "\"hidden_size\":256.5"),
        replace("\"hidden_size\":256", "\"hidden_size\":4294967552"),
        replace("\"sliding_window\":16", "\"sliding_window\":-4294967280"),
        replace("\"compress_ratios\":[0,0,2", "\"compress_ratios\":[0,0,2.0"),
        replace("\"norm_topk_prob\":true", "\"norm_topk_prob\":1"),
        // Floats outside the range where their formulas stay finite (the engine config fuzzer
        // found hc_eps = 1e206 accepted and every logit NaN): Sinkhorn's and the norms' eps,
        // YaRN's log(theta) divisor and log(beta), the routed experts' scale.
        replace("\"hc_eps\":1e-6", "\"hc_eps\":1e206"),
        replace("\"rms_norm_eps\":1e-20", "\"rms_norm_eps\":2"),
        replace("\"rope_theta\":10000", "\"rope_theta\":1"),
        replace("\"beta_fast\":32", "\"beta_fast\":0"),
        replace("\"routed_scaling_factor\":1.5", "\"routed_scaling_factor\":1e300")}) {
    auto c = ParseEngineConfig(bad);
    EXPECT_TRUE(c.status().IsInvalidArgument());
    EXPECT_FALSE(c.status().message().empty());
  }
  EXPECT_TRUE(LoadEngineConfig("/nonexistent/config.json").status().IsIOError());
}

// The model fingerprint hashes CanonicalDescription (engine/session.h EngineModelFingerprint):
// a key the parser reads that does not change it lets two configs that compute different KV
// from one weights file share cache keys (expert_format mxfp4 and f32 did: the fingerprint
// bound only the KV layout and the file's tensors). Each key of the mini config, and each
// optional key, is changed to another valid value: the description changes, and so does the
// fingerprint over the same weights. DSpark's keys and compress_ratios entries past the layers
// change nothing the engine computes: the description stays.
TEST(EngineConfig, CanonicalDescriptionCoversEveryKey) {
  std::FILE* f = std::fopen(KVTIER_MINI_CONFIG, "rb");
  ASSERT_NE(f, nullptr);
  std::string text;
  char buf[4096];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof(buf), f)) > 0) text.append(buf, got);
  std::fclose(f);
  const nlohmann::json mini = nlohmann::json::parse(text);
  auto base = ParseEngineConfig(text);
  ASSERT_TRUE(base.ok()) << base.status().ToString();
  const std::string base_text = base->CanonicalDescription();
  const ModelWeights weights;  // one set for all: only the config varies
  auto base_fp = EngineModelFingerprint(*base, weights, 64);
  ASSERT_TRUE(base_fp.ok());
  using nlohmann::json;
  json yarn = mini["rope_scaling"];
  auto with = [&](const char* key, json v) {
    json y = yarn;
    y[key] = std::move(v);
    return y;
  };
  const std::vector<std::pair<std::string, json>> edits = {
      {"vocab_size", 520},
      {"hidden_size", 288},
      {"num_hidden_layers", 17},
      {"num_attention_heads", 4},
      {"head_dim", 96},
      {"qk_rope_head_dim", 32},
      {"q_lora_rank", 96},
      {"o_lora_rank", 96},
      {"o_groups", 4},
      {"sliding_window", 32},
      {"rms_norm_eps", 1e-6},
      {"rope_theta", 20000},
      {"compress_rope_theta", 80000},
      {"rope_scaling", nullptr},
      {"rope_scaling", with("factor", 8)},
      {"rope_scaling", with("original_max_position_embeddings", 256)},
      {"rope_scaling", with("beta_fast", 16)},
      {"rope_scaling", with("beta_slow", 2)},
      {"max_position_embeddings", 8192},
      {"compress_ratios", json::array({0, 0, 4, 4, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0})},
      {"kv_source_layer_ids", json::array({2, 4, 8})},
      {"index_source_layer_ids", json::array({2, 4, 6, 8, 10, 12})},
      {"index_n_heads", 2},
      {"index_head_dim", 64},
      {"index_topk", 8},
      {"candidate_source_layer_id", -1},
      {"candidate_topk_blocks", 32},
      {"candidate_block_size", 16},
      {"hc_mult", 2},
      {"hc_sinkhorn_iters", 10},
      {"hc_eps", 1e-5},
      {"n_routed_experts", 8},
      {"n_shared_experts", 2},
      {"num_experts_per_tok", 3},
      {"moe_intermediate_size", 96},
      {"topk_method", "greedy"},
      {"norm_topk_prob", false},
      {"routed_scaling_factor", 2.5},
      {"swiglu_limit", 7.0},
      {"expert_format", "mxfp4"},
      {"weight_format", "fp8"},
      {"engram_layer_ids", json::array({1, 5})},
      {"engram_max_ngram_size", 3},
      {"engram_n_heads", 2},
      {"engram_head_dim", 64},
      {"engram_vocab_size", 8000},
      {"engram_pad_token_id", 3},
      {"engram_seed", 5},
      {"engram_compressed_vocab_size", 256},
      {"dspark_noise_token_id", 510},
  };
  // Keys with a single valid value (Validate), and keys the engine does not read.
  const std::set<std::string> one_value = {"num_key_value_heads", "scoring_func"};
  const std::set<std::string> not_engine = {
      "num_nextn_predict_layers", "dspark_block_size",       "dspark_target_layer_ids",
      "dspark_markov_rank",       "dspark_n_routed_experts", "dspark_num_experts_per_tok"};
  std::set<std::string> edited;
  for (const auto& [key, value] : edits) {
    json j = mini;
    if (value.is_null()) {
      j.erase(key);
    } else {
      j[key] = value;
    }
    auto c = ParseEngineConfig(j.dump());
    ASSERT_TRUE(c.ok()) << key << ": " << c.status().ToString();
    EXPECT_NE(c->CanonicalDescription(), base_text) << key;
    auto fp = EngineModelFingerprint(*c, weights, 64);
    ASSERT_TRUE(fp.ok()) << key;
    EXPECT_NE(*fp, *base_fp) << key;
    edited.insert(key);
  }
  for (auto it = mini.begin(); it != mini.end(); ++it) {
    EXPECT_TRUE(edited.contains(it.key()) || one_value.contains(it.key()) ||
                not_engine.contains(it.key()))
        << "key " << it.key() << " is not checked";
  }
  for (const std::string& key : not_engine) {
    json j = mini;
    j[key] = key == "dspark_target_layer_ids" ? json::array({12, 13, 14}) : json(2);
    auto c = ParseEngineConfig(j.dump());
    ASSERT_TRUE(c.ok()) << key << ": " << c.status().ToString();
    EXPECT_EQ(c->CanonicalDescription(), base_text) << key;
  }
  json j = mini;
  j["compress_ratios"].push_back(1);  // past the layers
  EXPECT_EQ(ParseEngineConfig(j.dump())->CanonicalDescription(), base_text);
}

// Every width of this config is within Validate's per-field limits, and its parameters take
// terabytes: InitWeights refuses it before allocating (it ended in std::bad_alloc, or in the
// kernel's OOM killer, before the bound). The mini's own weights stay far below the bound.
TEST(EngineConfig, InitWeightsRefusesAConfigOverItsByteBound) {
  EngineConfig huge = testutil::MiniConfig();
  huge.hidden_size = 65536;
  huge.vocab_size = 1 << 22;
  ASSERT_TRUE(huge.Validate().ok());
  EXPECT_GT(WeightBytes(huge), kInitWeightsBytesMax);
  auto w = InitWeights(huge, 1);
  ASSERT_TRUE(w.status().IsInvalidArgument()) << w.status().ToString();
  EXPECT_NE(w.status().message().find("kInitWeightsBytesMax"), std::string::npos);

  const EngineConfig& mini = testutil::MiniConfig();
  uint64_t stored = 0;
  auto weights = InitWeights(mini, 1);
  ASSERT_TRUE(weights.ok());
  for (const auto& [name, t] : weights->file.tensors) stored += t.bytes.size();
  EXPECT_EQ(WeightBytes(mini), stored);
  EXPECT_LT(stored, kInitWeightsBytesMax);
}
TEST(Safetensors, RoundTripsAndRejectsCorruption) {
  TensorFile f;
  Tensor a;
  a.dtype = "F32";
  a.shape = {2, 3};
  a.bytes.resize(24);
  for (int i = 0; i < 6; ++i) a.f32()[i] = static_cast<float>(i) * 0.5f - 1.0f;
  f.tensors["a.weight"] = a;
  Tensor b;
  b.dtype = "F8_E4M3";
  b.shape = {5};
  b.bytes = {1, 2, 3, 4, 5};
  f.tensors["b"] = b;
  f.metadata["k"] = "v";
  auto bytes = EncodeSafetensors(f);
  ASSERT_TRUE(bytes.ok());
  // Header length is little-endian and the header is padded to 8 bytes.
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>((*bytes)[i]) << (8 * i);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(bytes->size(), 8 + n + 24 + 5);
  auto back = DecodeSafetensors(bytes->data(), bytes->size());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->tensors["a.weight"].bytes, a.bytes);
  EXPECT_EQ(back->tensors["a.weight"].shape, a.shape);
  EXPECT_EQ(back->tensors["b"].bytes, b.bytes);
  EXPECT_EQ(back->metadata["k"], "v");

  std::vector<uint8_t> bad = *bytes;
  bad.pop_back();  // truncated data
  EXPECT_TRUE(DecodeSafetensors(bad.data(), bad.size()).status().IsCorruption());
  bad = *bytes;
  bad[0] = 0xff;  // header length beyond the file
  EXPECT_TRUE(DecodeSafetensors(bad.data(), bad.size()).status().IsCorruption());
  bad = *bytes;
  bad[9] = '#';  // broken JSON
  EXPECT_TRUE(DecodeSafetensors(bad.data(), bad.size()).status().IsCorruption());
  EXPECT_TRUE(DecodeSafetensors(bad.data(), 3).status().IsCorruption());

  Tensor wrong = a;
  wrong.shape = {7};
  f.tensors["a.weight"] = wrong;
  EXPECT_TRUE(EncodeSafetensors(f).status().IsInvalidArgument());
}

TEST(ByteTokenizer, EncodesBytesAndKeepsReservedIds) {
  auto t = ByteTokenizer::Create(512, 2, 511);
  ASSERT_TRUE(t.ok());
  auto ids = t->Encode("Hi\xff");
  EXPECT_EQ(ids, (std::vector<int32_t>{3 + 'H', 3 + 'i', 3 + 255}));
  EXPECT_EQ(t->Decode(ids), "Hi\xff");
  EXPECT_EQ(t->Decode({2, 511, 300}), "<|pad|><|noise|><|id:300|>");
  // TokenCount is what the server refuses an over-long prompt by before building its ids.
  for (std::string_view text :
       {std::string_view(""), std::string_view("Hi\xff"), std::string_view("<|bos|> \xe2\x82\xac")})
    EXPECT_EQ(ByteTokenizer::TokenCount(text), t->Encode(text).size()) << text;
  for (int c = 0; c < 256; ++c) {
    auto one = t->Encode(std::string(1, static_cast<char>(c)));
    EXPECT_NE(one[0], 2);
    EXPECT_NE(one[0], 511);
  }
  EXPECT_FALSE(ByteTokenizer::Create(100, 2, 99).ok());
  EXPECT_FALSE(ByteTokenizer::Create(512, 2, 100).ok());
}

TEST(NumpyRandom, DefaultRngIntegersMatchNumpy) {
  // numpy 1.24: 2*default_rng(10007).integers(0, (2**63-1)//512//2, 4, dtype=int64)+1 =
  // [14831304026200453, 936705081716061, 6959601268494069, 14319439928568407]
  // (the Engram demo's layer-1 multipliers of the miniature, vectors/engram_hash.json).
  numpy::Pcg64 rng(10007);
  auto r = numpy::Integers(&rng, 0, INT64_MAX / 512 / 2, 4);
  ASSERT_TRUE(r.ok());
  std::vector<int64_t> m;
  for (int64_t x : *r) m.push_back(2 * x + 1);
  EXPECT_EQ(m, (std::vector<int64_t>{14831304026200453, 936705081716061, 6959601268494069,
                                     14319439928568407}));
  EXPECT_TRUE(numpy::Integers(&rng, 5, 5, 1).status().IsInvalidArgument());
  // The 32-bit Lemire path stays in range and is deterministic.
  numpy::Pcg64 a(7), b(7);
  auto ra = numpy::Integers(&a, 10, 20, 100);
  auto rb = numpy::Integers(&b, 10, 20, 100);
  ASSERT_TRUE(ra.ok() && rb.ok());
  EXPECT_EQ(*ra, *rb);
  for (int64_t x : *ra) {
    EXPECT_GE(x, 10);
    EXPECT_LT(x, 20);
  }
}

TEST(EngramPrimes, IsPrimeAgreesWithTrialDivision) {
  for (uint64_t n = 0; n < 20000; ++n) {
    bool trial = n >= 2;
    for (uint64_t d = 2; d * d <= n && trial; ++d) trial = n % d != 0;
    ASSERT_EQ(IsPrime(n), trial) << n;
  }
  EXPECT_TRUE(IsPrime(16000057));
  EXPECT_FALSE(IsPrime(16000059));
}

// Mixing logits of moderate spread (what a trained or initialised network gives); Sinkhorn's
// 20 iterations reach 1e-5 there (strongly peaked matrices converge more slowly).
TEST(Mhc, CombIsDoublyStochasticWithinTolerance) {
  std::mt19937 gen(3);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const int hc = 4, dim = 64, m = (2 + hc) * hc;
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<float> x(hc * dim), fn(m * hc * dim), base(m);
    for (float& v : x) v = u(gen) * 3;
    for (float& v : fn) v = u(gen) * 0.05f;
    for (float& v : base) v = u(gen);
    float scale[3] = {1.0f, 1.0f, 0.5f + trial * 0.02f};
    float pre[4], post[4], comb[16];
    HcMixes(x.data(), hc, dim, fn.data(), scale, base.data(), 20, 1e-6, 1e-20, pre, post, comb);
    for (int i = 0; i < hc; ++i) {
      float rs = 0, cs = 0;
      for (int j = 0; j < hc; ++j) {
        rs += comb[i * hc + j];
        cs += comb[j * hc + i];
        EXPECT_GT(comb[i * hc + j], 0.0f);
      }
      EXPECT_NEAR(rs, 1.0f, 1e-5);
      EXPECT_NEAR(cs, 1.0f, 1e-5);
      EXPECT_GT(pre[i], 0.0f);
      EXPECT_LT(pre[i], 1.0f + 1e-5f);
      EXPECT_GT(post[i], 0.0f);
      EXPECT_LT(post[i], 2.0f);
    }
  }
}

// Attention accumulates its outputs with Axpy: every element must round exactly as the scalar
// `y[i] += a * x[i]` (a product, then a sum), for every length (vector steps and the tail).
TEST(Ops, AxpyIsBitIdenticalToTheScalarLoop) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  for (int n = 0; n <= 37; ++n) {
    std::vector<float> x(n), y(n), want(n);
    for (int i = 0; i < n; ++i) {
      x[i] = u(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 40) - 20);
      y[i] = want[i] = u(rng);
    }
    const float a = u(rng) / 7.0f;
    for (int i = 0; i < n; ++i) {
      const float prod = a * x[i];
      want[i] = want[i] + prod;
    }
    Axpy(a, x.data(), n, y.data());
    for (int i = 0; i < n; ++i) {
      ASSERT_EQ(std::bit_cast<uint32_t>(y[i]), std::bit_cast<uint32_t>(want[i]))
          << "n " << n << " i " << i;
    }
  }
}

// The mHC mixes and the indexer score four dot products per pass with Dot4: each must be the
// bits of Dot, for every length (8-wide steps and the tail).
// ArgMax is std::max_element's index on every input: ties (values from a small set), NaNs
// (at index 0 and elsewhere), infinities, and every length up to a few lanes past 8.
TEST(Ops, ArgMaxIsMaxElement) {
  std::mt19937 rng(7);
  const float special[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1.0f, -1.0f, 2.5f};
  int checked = 0;
  for (int n : {1, 2, 7, 8, 9, 15, 16, 17, 31, 64, 100, 512}) {
    for (int trial = 0; trial < 300; ++trial) {
      std::vector<float> x(n);
      for (float& v : x) {
        const unsigned r = rng() % 16;
        v = r < 8 ? special[r] : static_cast<float>(static_cast<int>(rng() % 5) - 2);
      }
      if (trial % 3 == 0) x[0] = NAN;
      if (trial % 5 == 0) std::fill(x.begin(), x.end(), -INFINITY);
      if (trial % 7 == 0) x[rng() % n] = NAN;
      ASSERT_EQ(ArgMax(x.data(), n), std::max_element(x.begin(), x.end()) - x.begin())
          << "n " << n << " trial " << trial;
      ++checked;
    }
  }
  // Distinct values: the maximum in every position.
  for (int n : {9, 512}) {
    for (int at = 0; at < n; ++at) {
      std::vector<float> x(n);
      for (int i = 0; i < n; ++i) x[i] = static_cast<float>(i % 13) * 0.25f;
      x[at] = 100.0f;
      ASSERT_EQ(ArgMax(x.data(), n), at);
      ++checked;
    }
  }
  EXPECT_EQ(checked, 12 * 300 + 9 + 512);
}

TEST(Ops, Dot4IsBitIdenticalToDot) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  for (int n = 0; n <= 70; ++n) {
    std::vector<float> b(n), a[4];
    for (int i = 0; i < n; ++i) b[i] = u(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 30) - 15);
    for (auto& v : a) {
      v.resize(n);
      for (float& f : v) f = u(rng);
    }
    const float* rows[4] = {a[0].data(), a[1].data(), a[2].data(), a[3].data()};
    float got[4];
    Dot4(rows, b.data(), n, got);
    for (int r = 0; r < 4; ++r) {
      ASSERT_EQ(std::bit_cast<uint32_t>(got[r]), std::bit_cast<uint32_t>(Dot(rows[r], b.data(), n)))
          << "n " << n << " row " << r;
    }
  }
}

// HcMixes as it was written before its Sinkhorn ran four lanes wide: the reference for the
// bit-identity test below.
void HcMixesScalar(const float* x, int hc, int dim, const float* fn, const float* scale,
                   const float* base, int iters, double hc_eps, double norm_eps, float* pre,
                   float* post, float* comb) {
  const int n = hc * dim;
  double ss = 0;
  for (int i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float r = static_cast<float>(1.0 / std::sqrt(ss / n + norm_eps));
  const int m = (2 + hc) * hc;
  std::vector<float> mixes(m);
  for (int i = 0; i < m; ++i) mixes[i] = Dot(fn + static_cast<int64_t>(i) * n, x, n) * r;
  const float e = static_cast<float>(hc_eps);
  for (int i = 0; i < hc; ++i) pre[i] = Sigmoid(mixes[i] * scale[0] + base[i]) + e;
  for (int i = 0; i < hc; ++i) post[i] = 2.0f * Sigmoid(mixes[hc + i] * scale[1] + base[hc + i]);
  for (int i = 0; i < hc; ++i) {
    float* row = comb + i * hc;
    float mx = -INFINITY;
    for (int j = 0; j < hc; ++j) {
      row[j] = mixes[2 * hc + i * hc + j] * scale[2] + base[2 * hc + i * hc + j];
      mx = std::max(mx, row[j]);
    }
    float sum = 0;
    for (int j = 0; j < hc; ++j) {
      row[j] = std::exp(row[j] - mx);
      sum += row[j];
    }
    for (int j = 0; j < hc; ++j) row[j] = row[j] / sum + e;
  }
  auto col_norm = [&] {
    for (int j = 0; j < hc; ++j) {
      float s = 0;
      for (int i = 0; i < hc; ++i) s += comb[i * hc + j];
      for (int i = 0; i < hc; ++i) comb[i * hc + j] /= (s + e);
    }
  };
  auto row_norm = [&] {
    for (int i = 0; i < hc; ++i) {
      float s = 0;
      for (int j = 0; j < hc; ++j) s += comb[i * hc + j];
      for (int j = 0; j < hc; ++j) comb[i * hc + j] /= (s + e);
    }
  };
  col_norm();
  for (int it = 1; it < iters; ++it) {
    row_norm();
    col_norm();
  }
}

TEST(Ops, HcMixesIsBitIdenticalToTheScalarSinkhorn) {
  std::mt19937 rng(13);
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (int hc : {1, 2, 3, 4, 5, 8}) {
    const int dim = 24, n = hc * dim, m = (2 + hc) * hc;
    std::vector<float> x(n), fn(static_cast<size_t>(m) * n), base(m), scale = {0.7f, 1.3f, 2.1f};
    for (float& f : x) f = g(rng);
    for (float& f : fn) f = 0.2f * g(rng);
    for (float& f : base) f = 0.5f * g(rng);
    std::vector<float> pre(hc), post(hc), comb(hc * hc), pre2(hc), post2(hc), comb2(hc * hc);
    HcMixes(x.data(), hc, dim, fn.data(), scale.data(), base.data(), 20, 1e-6, 1e-20, pre.data(),
            post.data(), comb.data());
    HcMixesScalar(x.data(), hc, dim, fn.data(), scale.data(), base.data(), 20, 1e-6, 1e-20,
                  pre2.data(), post2.data(), comb2.data());
    for (int i = 0; i < hc; ++i) {
      ASSERT_EQ(std::bit_cast<uint32_t>(pre[i]), std::bit_cast<uint32_t>(pre2[i])) << hc;
      ASSERT_EQ(std::bit_cast<uint32_t>(post[i]), std::bit_cast<uint32_t>(post2[i])) << hc;
    }
    for (int i = 0; i < hc * hc; ++i) {
      ASSERT_EQ(std::bit_cast<uint32_t>(comb[i]), std::bit_cast<uint32_t>(comb2[i]))
          << "hc " << hc << " element " << i;
    }
  }
}

// HcMixesRows takes the mix products of many rows at once (an AVX2 kernel, two rows of x by
// four rows of fn per pass, four rows of x by a tail of two or one rows of fn, their eight or
// four sums reduced side by side; or Dot4 over the rows): every product must be Dot's bits, for
// any row count (passes of four, two and one), any number of fn rows (blocks of four and tails
// of two and one) and any length (8-wide steps and the tail), with and without the AVX2 kernel.
TEST(Ops, HcMixDotsAreDotsBitForBit) {
  std::mt19937 rng(17);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  for (int n : {0, 1, 7, 8, 9, 24, 31, 32, 64, 70}) {
    for (int m : {1, 2, 3, 4, 6, 7, 9, 24}) {
      for (int rows : {1, 2, 3, 4, 5, 7, 9}) {
        std::vector<float> fn(static_cast<size_t>(m) * n), x(static_cast<size_t>(rows) * n);
        for (float& f : fn) f = u(rng);
        for (float& f : x) f = u(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 30) - 15);
        for (bool avx2 : {false, true}) {
          std::vector<float> got(static_cast<size_t>(rows) * m, -1.0f);
          HcMixDots(fn.data(), m, x.data(), rows, n, got.data(), avx2);
          for (int t = 0; t < rows; ++t) {
            for (int i = 0; i < m; ++i) {
              const float want = Dot(fn.data() + static_cast<size_t>(i) * n,
                                     x.data() + static_cast<size_t>(t) * n, n);
              ASSERT_EQ(std::bit_cast<uint32_t>(got[static_cast<size_t>(t) * m + i]),
                        std::bit_cast<uint32_t>(want))
                  << "n " << n << " m " << m << " rows " << rows << " row " << t << " mix " << i
                  << " avx2 " << avx2;
            }
          }
        }
      }
    }
  }
}

// WeightedRowSums is, bit for bit, a zeroed row plus one Axpy per row of x in order, with and
// without the AVX2 kernel: lengths across its 64- and 8-element chunks and its scalar tail, row
// counts from none up, values spread over 30 binades so that a changed order of the sums shows.
TEST(Ops, WeightedRowSumsAreAxpysBitForBit) {
  std::mt19937 rng(23);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  for (int n : {0, 1, 7, 8, 9, 63, 64, 65, 72, 128, 131}) {
    for (int m : {1, 2, 8}) {
      for (int rows : {0, 1, 2, 5, 32}) {
        std::vector<float> w(static_cast<size_t>(m) * rows), x(static_cast<size_t>(rows) * n);
        for (float& f : w) f = u(rng);
        for (float& f : x) f = u(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 30) - 15);
        std::vector<float> want(static_cast<size_t>(m) * n, 0.0f);
        for (int r = 0; r < m; ++r) {
          for (int i = 0; i < rows; ++i) {
            Axpy(w[static_cast<size_t>(r) * rows + i], x.data() + static_cast<size_t>(i) * n, n,
                 want.data() + static_cast<size_t>(r) * n);
          }
        }
        for (bool avx2 : {false, true}) {
          std::vector<float> got(static_cast<size_t>(m) * n, -1.0f);
          WeightedRowSums(w.data(), m, x.data(), rows, n, got.data(), avx2);
          for (size_t i = 0; i < got.size(); ++i) {
            ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i]))
                << "n " << n << " m " << m << " rows " << rows << " element " << i << " avx2 "
                << avx2;
          }
        }
      }
    }
  }
}

// The rows of HcMixesRows are the scalar reference's rows, for row counts across its 16-row
// blocks, its eight-row mean-square groups and its Sinkhorn on four, three, two rows side by side
// or one alone, lengths with and without a tail.
TEST(Ops, HcMixesRowsIsTheScalarReferenceRowByRow) {
  std::mt19937 rng(19);
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (int hc : {1, 3, 4, 5}) {
    for (int dim : {7, 24}) {
      for (int rows : {1, 2, 3, 4, 5, 6, 7, 16, 17, 37}) {
        const int n = hc * dim, m = (2 + hc) * hc;
        std::vector<float> x(static_cast<size_t>(rows) * n), fn(static_cast<size_t>(m) * n),
            base(m), scale = {0.7f, 1.3f, 2.1f};
        for (float& f : x) f = g(rng);
        for (float& f : fn) f = 0.2f * g(rng);
        for (float& f : base) f = 0.5f * g(rng);
        std::vector<float> pre(rows * hc), post(rows * hc), comb(rows * hc * hc);
        HcMixesRows(rows, x.data(), hc, dim, fn.data(), scale.data(), base.data(), 20, 1e-6, 1e-20,
                    pre.data(), post.data(), comb.data());
        for (int t = 0; t < rows; ++t) {
          std::vector<float> pre2(hc), post2(hc), comb2(hc * hc);
          HcMixesScalar(x.data() + static_cast<size_t>(t) * n, hc, dim, fn.data(), scale.data(),
                        base.data(), 20, 1e-6, 1e-20, pre2.data(), post2.data(), comb2.data());
          for (int i = 0; i < hc; ++i) {
            ASSERT_EQ(std::bit_cast<uint32_t>(pre[t * hc + i]), std::bit_cast<uint32_t>(pre2[i]))
                << "hc " << hc << " dim " << dim << " rows " << rows << " row " << t;
            ASSERT_EQ(std::bit_cast<uint32_t>(post[t * hc + i]), std::bit_cast<uint32_t>(post2[i]))
                << "hc " << hc << " dim " << dim << " rows " << rows << " row " << t;
          }
          for (int i = 0; i < hc * hc; ++i) {
            ASSERT_EQ(std::bit_cast<uint32_t>(comb[(t * hc) * hc + i]),
                      std::bit_cast<uint32_t>(comb2[i]))
                << "hc " << hc << " dim " << dim << " rows " << rows << " row " << t;
          }
        }
      }
    }
  }
}

TEST(Rope, InverseUndoesForwardAndYarnStretchesLowFrequencies) {
  RopeParams p;
  p.theta = 160000;
  auto plain = RopeFrequencies(16, p);
  p.yarn = true;
  p.factor = 16;
  p.original_max_position = 512;
  auto yarn = RopeFrequencies(16, p);
  EXPECT_DOUBLE_EQ(yarn[0], plain[0]);         // fast dims untouched
  EXPECT_NEAR(yarn[7], plain[7] / 16, 1e-12);  // slow dims interpolated by the factor
  float x[16], y[16];
  for (int i = 0; i < 16; ++i) x[i] = y[i] = static_cast<float>(i) - 7.5f;
  ApplyRope(y, yarn, 1234, false);
  ApplyRope(y, yarn, 1234, true);
  for (int i = 0; i < 16; ++i) EXPECT_NEAR(y[i], x[i], 1e-4);
}

// A rotation taken once (RopeRotation) and applied (ApplyRopeRotation) is ApplyRope bit for bit,
// forward and inverse, at positions from 0 to far past the YaRN window, plain and YaRN.
TEST(Rope, RotationTakenOnceIsApplyRopeBitForBit) {
  std::mt19937 rng(29);
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  RopeParams p;
  p.theta = 160000;
  for (bool yarn : {false, true}) {
    p.yarn = yarn;
    p.factor = 16;
    p.original_max_position = 512;
    for (int dims : {2, 16, 64}) {
      const std::vector<double> freqs = RopeFrequencies(dims, p);
      const int np = static_cast<int>(freqs.size());
      for (int64_t pos : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{513}, int64_t{70001}}) {
        std::vector<float> c(np), s(np);
        RopeRotation(freqs, pos, c.data(), s.data());
        for (bool inverse : {false, true}) {
          std::vector<float> want(dims), got(dims);
          for (int i = 0; i < dims; ++i) want[i] = got[i] = u(rng);
          ApplyRope(want.data(), freqs, pos, inverse);
          ApplyRopeRotation(got.data(), c.data(), s.data(), np, inverse);
          for (int i = 0; i < dims; ++i) {
            ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i]))
                << "yarn " << yarn << " dims " << dims << " pos " << pos << " inverse " << inverse
                << " element " << i;
          }
        }
      }
    }
  }
}

TEST(Sampler, GreedyTopPAndSeededSamplingAreDeterministic) {
  std::vector<float> logits = {0.1f, 2.0f, 1.9f, -1.0f, 2.0f};
  EXPECT_EQ(Sampler(0.0, 1.0, 1).Sample(logits), 1);   // greedy, tie to the lowest id
  EXPECT_EQ(Sampler(1.0, 1e-6, 9).Sample(logits), 1);  // top-p keeps only the best
  std::vector<int32_t> a, b;
  Sampler sa(0.9, 0.95, 42), sb(0.9, 0.95, 42);
  std::set<int32_t> seen;
  for (int i = 0; i < 200; ++i) {
    a.push_back(sa.Sample(logits));
    b.push_back(sb.Sample(logits));
    seen.insert(a.back());
  }
  EXPECT_EQ(a, b);
  EXPECT_GE(seen.size(), 3u);    // it does sample
  EXPECT_EQ(seen.count(3), 0u);  // -1.0 lies outside the 0.95 nucleus
}

TEST(ThreadPool, CoversEveryIndexOnce) {
  for (int threads : {1, 2, 5}) {
    ThreadPool pool(threads);
    std::vector<int> hits(1000, 0);
    for (int round = 0; round < 20; ++round) {
      pool.ParallelFor(1000, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) ++hits[i];
      });
    }
    for (int h : hits) ASSERT_EQ(h, 20);
  }
}

// Back-to-back short calls: a late worker must never run a chunk of an older call or run a
// chunk twice (the claim word names its call), and every call returns only when all its chunks
// are done.
TEST(ThreadPool, ManyShortCallsBackToBackRunEachIndexOnce) {
  for (int threads : {2, 3}) {
    ThreadPool pool(threads);
    std::vector<std::atomic<int>> hits(16);
    for (int round = 0; round < 5000; ++round) {
      const int64_t n = 1 + round % 11;
      for (auto& h : hits) h.store(0, std::memory_order_relaxed);
      pool.ParallelFor(n, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) hits[i].fetch_add(1, std::memory_order_relaxed);
      });
      for (int64_t i = 0; i < 16; ++i) {
        ASSERT_EQ(hits[i].load(), i < n ? 1 : 0) << "threads " << threads << " round " << round;
      }
    }
  }
}

// One ParallelFor of n indices in which each chunk waits (at most 10 s) until `want` distinct
// threads are inside the call, so they all are only if every worker took part. Asserts that
// each index ran exactly once; returns how many distinct threads ran chunks.
size_t ThreadsInOneCall(ThreadPool* pool, int64_t n, size_t want) {
  std::vector<int> hits(n, 0);
  std::mutex mu;
  std::set<std::thread::id> ids;
  pool->ParallelFor(n, [&](int64_t b, int64_t e) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    {
      std::lock_guard<std::mutex> lock(mu);
      ids.insert(std::this_thread::get_id());
    }
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (ids.size() == want) break;
      }
      if (std::chrono::steady_clock::now() > deadline) break;
      std::this_thread::yield();
    }
    for (int64_t i = b; i < e; ++i) ++hits[i];
  });
  for (int h : hits) EXPECT_EQ(h, 1);
  return ids.size();
}

// Workers that went to sleep (idle past kSpinMicros) wake for the next call and take part:
// each chunk waits (at most 10 s) until all three threads are inside the call, which happens
// only if both sleeping workers were woken.
TEST(ThreadPool, SleepingWorkersWakeForTheNextCall) {
  ThreadPool pool(3);
  for (int round = 0; round < 5; ++round) {
    std::this_thread::sleep_for(std::chrono::microseconds(3 * ThreadPool::kSpinMicros));
    EXPECT_EQ(ThreadsInOneCall(&pool, 100, 3), 3u) << "round " << round;
  }
}

// One chunk per thread (the decode-sized calls' split): every index still runs exactly once, on
// back-to-back calls, and only calls handed to workers count as dispatches.
TEST(ThreadPool, OneChunkPerThreadCoversEveryIndexOnceAndCountsDispatches) {
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    std::vector<std::atomic<int>> hits(40);
    int64_t handed = 0;
    for (int round = 0; round < 3000; ++round) {
      const int64_t n = 1 + round % 37;
      for (auto& h : hits) h.store(0, std::memory_order_relaxed);
      pool.ParallelFor(
          n,
          [&](int64_t b, int64_t e) {
            for (int64_t i = b; i < e; ++i) hits[i].fetch_add(1, std::memory_order_relaxed);
          },
          1);
      if (threads > 1 && n > 1) ++handed;
      for (int64_t i = 0; i < 40; ++i) {
        ASSERT_EQ(hits[i].load(), i < n ? 1 : 0) << "threads " << threads << " round " << round;
      }
    }
    EXPECT_EQ(pool.dispatches(), handed) << "threads " << threads;
  }
}

// With a Hold alive, workers idle longer than kSpinMicros between calls (they sleep once past
// kHeldSpinMicros) still take part in the next call, and calls stay correct; holds nest.
TEST(ThreadPool, HeldPoolRunsCallsAcrossPauses) {
  ThreadPool pool(3);
  ThreadPool::Hold outer(&pool);
  for (int round = 0; round < 6; ++round) {
    ThreadPool::Hold inner(&pool);
    const int pause_us =
        round % 2 == 0 ? 2 * ThreadPool::kSpinMicros : 2 * ThreadPool::kHeldSpinMicros;
    std::this_thread::sleep_for(std::chrono::microseconds(pause_us));
    EXPECT_EQ(ThreadsInOneCall(&pool, 64, 3), 3u) << "round " << round;
  }
}

// Side tasks: each runs exactly once per Side (on a worker, or on the caller at Join when no
// worker took it), calls made meanwhile still run every index once, and a side task counts as a
// dispatch only when the pool has workers.
TEST(ThreadPool, SideTaskRunsOnceBesideTheCallersCalls) {
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    std::atomic<int> side_runs{0};
    std::vector<std::atomic<int>> hits(24);
    const std::function<void()> side = [&] { side_runs.fetch_add(1, std::memory_order_relaxed); };
    for (int round = 0; round < 2000; ++round) {
      const int64_t n = 1 + round % 23;
      for (auto& h : hits) h.store(0, std::memory_order_relaxed);
      {
        ThreadPool::Side s(&pool, &side);
        for (int call = 0; call < round % 3; ++call) {
          pool.ParallelFor(
              n,
              [&](int64_t b, int64_t e) {
                for (int64_t i = b; i < e; ++i) hits[i].fetch_add(1, std::memory_order_relaxed);
              },
              1);
        }
        if (round % 2 == 0) {  // otherwise the destructor joins
          s.Join();
          ASSERT_EQ(side_runs.load(), round + 1) << "threads " << threads << " round " << round;
        }
      }
      ASSERT_EQ(side_runs.load(), round + 1) << "threads " << threads << " round " << round;
      for (int64_t i = 0; i < 24; ++i) {
        ASSERT_EQ(hits[i].load(), i < n ? round % 3 : 0)
            << "threads " << threads << " round " << round;
      }
    }
    if (threads == 1) {
      EXPECT_EQ(pool.dispatches(), 0);
    }
  }
}

// A side task is handed to a worker, asleep or spinning: the caller waits (at most 10 s) until
// the task has run before it joins, so the task can only have run on a worker.
TEST(ThreadPool, SideTaskRunsOnAWorkerWhileTheCallerWaits) {
  ThreadPool pool(2);
  for (int round = 0; round < 6; ++round) {
    // Even rounds: the worker has gone to sleep; odd rounds: it is still spinning.
    if (round % 2 == 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(3 * ThreadPool::kSpinMicros));
    }
    std::atomic<bool> ran{false};
    std::thread::id ran_on;
    const std::function<void()> side = [&] {
      ran_on = std::this_thread::get_id();
      ran.store(true, std::memory_order_release);
    };
    const int64_t before = pool.dispatches();
    ThreadPool::Side s(&pool, &side);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!ran.load(std::memory_order_acquire) && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::yield();
    }
    s.Join();
    EXPECT_NE(ran_on, std::this_thread::get_id()) << "round " << round;
    EXPECT_EQ(pool.dispatches(), before + 1);
  }
}

}  // namespace
// TopKByScore (a heap of packed keys) selects what the std::nth_element reference selects: the
// same indices in the same order, over candidates in any order, with many ties (broken by the
// lower index), -0.0 beside +0.0, infinities, k around the heap's stack size and n around k.
TEST(Ops, TopKByScoreIsTheReferenceSelection) {
  std::mt19937 rng(29);
  const float values[] = {-INFINITY, -2.5f, -1.0f, -0.0f, 0.0f, 0.5f, 1.0f, 3.0f, INFINITY};
  for (int n : {0, 1, 5, 16, 17, 63, 64, 65, 200, 1000}) {
    for (int k : {0, 1, 3, 16, 64, 65, 100}) {
      for (int trial = 0; trial < 4; ++trial) {
        const int universe = n + static_cast<int>(rng() % 50);
        std::vector<float> score(static_cast<size_t>(universe));
        for (float& s : score) {
          s = trial % 2 == 0 ? values[rng() % 9]
                             : std::uniform_real_distribution<float>(-4.0f, 4.0f)(rng);
        }
        std::vector<int32_t> all(static_cast<size_t>(universe));
        for (int i = 0; i < universe; ++i) all[i] = i;
        std::shuffle(all.begin(), all.end(), rng);
        std::vector<int32_t> cand(all.begin(), all.begin() + n), got = {-7}, want;
        TopKByScore(score.data(), cand.data(), n, k, &got);
        TopKByScoreReference(score.data(), cand.data(), n, k, &want);
        ASSERT_EQ(got, want) << "n " << n << " k " << k << " trial " << trial;
      }
    }
  }
}

// RmsNormRows is one RmsNorm per row, bit for bit: row counts across its groups of eight and
// tail, with and without a weight, in place and not, values over many binades.
TEST(Ops, RmsNormRowsIsRmsNormRowByRow) {
  std::mt19937 rng(31);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  for (int n : {1, 7, 64}) {
    for (int rows : {1, 3, 4, 5, 8, 9, 13}) {
      std::vector<float> x(static_cast<size_t>(rows) * n), w(n);
      for (float& f : x) f = u(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 30) - 15);
      for (float& f : w) f = u(rng);
      for (const float* weight :
           {static_cast<const float*>(nullptr), static_cast<const float*>(w.data())}) {
        std::vector<float> want(x.size()), got(x.size()), in_place = x;
        for (int t = 0; t < rows; ++t) {
          RmsNorm(x.data() + static_cast<size_t>(t) * n, weight, n, 1e-20,
                  want.data() + static_cast<size_t>(t) * n);
        }
        RmsNormRows(x.data(), rows, weight, n, 1e-20, got.data());
        RmsNormRows(in_place.data(), rows, weight, n, 1e-20, in_place.data());
        for (size_t i = 0; i < x.size(); ++i) {
          ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i]))
              << "n " << n << " rows " << rows << " element " << i;
          ASSERT_EQ(std::bit_cast<uint32_t>(in_place[i]), std::bit_cast<uint32_t>(want[i]));
        }
      }
    }
  }
}

}  // namespace kvtier::engine
