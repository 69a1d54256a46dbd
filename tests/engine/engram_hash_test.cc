// Engram hashing against ../shared/vectors/engram_hash.json (the reference demo's output).
// Multipliers and primes are computed (numpy default_rng port, prime search), never read.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "engine/config.h"
#include "engine/engram.h"
#include "engine/numpy_random.h"
#include "tests/shared_dir.h"

namespace kvtier::engine {
namespace {

nlohmann::json LoadVectors() {
  std::ifstream in(testing::SharedPath("vectors/engram_hash.json"));
  EXPECT_TRUE(in.good()) << "missing " << testing::SharedPath("vectors/engram_hash.json");
  std::stringstream ss;
  ss << in.rdbuf();
  return nlohmann::json::parse(ss.str());
}

EngramHashParams ParamsOf(const nlohmann::json& g) {
  const auto& p = g["params"];
  EngramHashParams out;
  out.layer_ids = p["layer_ids"].get<std::vector<int>>();
  out.max_ngram_size = p["max_ngram_size"].get<int>();
  out.n_head_per_ngram = p["n_head_per_ngram"].get<int>();
  out.engram_vocab_size = p["engram_vocab_size"].get<std::vector<int64_t>>();
  out.tokenizer_vocab_size = p["tokenizer_vocab_size"].get<int64_t>();
  out.pad_id = p["pad_id"].get<int64_t>();
  out.seed = p["seed"].get<uint64_t>();
  return out;
}

TEST(EngramVectors, MultipliersPrimesOffsetsForAllGroups) {
  nlohmann::json v = LoadVectors();
  ASSERT_EQ(v["groups"].size(), 3u);
  for (const std::string kind : {"demo_default", "mini", "v41_full"}) {
    SCOPED_TRACE(kind);
    const auto& g = v["groups"][kind];
    auto h = EngramHashing::Create(ParamsOf(g));
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    const auto layers = g["params"]["layer_ids"].get<std::vector<int>>();
    for (size_t s = 0; s < layers.size(); ++s) {
      const std::string key = std::to_string(layers[s]);
      EXPECT_EQ(h->multipliers(s), g["multipliers"][key].get<std::vector<int64_t>>());
      std::vector<int64_t> flat;
      for (const auto& order : g["primes"][key]) {
        for (const auto& p : order) flat.push_back(p.get<int64_t>());
      }
      EXPECT_EQ(h->primes(s), flat);
      EXPECT_EQ(h->offsets(s), g["offsets"][key].get<std::vector<int64_t>>());
      EXPECT_EQ(h->num_embeddings(s), g["num_embeddings"][key].get<int64_t>());
    }
  }
  // The V4.1 prime sums reproduce the config's engram_num_embeddings.
  auto full = EngramHashing::Create(ParamsOf(v["groups"]["v41_full"]));
  ASSERT_TRUE(full.ok());
  EXPECT_EQ(full->num_embeddings(0), 384006168);
  EXPECT_EQ(full->num_embeddings(1), 384016682);
}

TEST(EngramVectors, HashIdsForEveryCase) {
  nlohmann::json v = LoadVectors();
  int checked = 0;
  for (const auto& c : v["cases"]) {
    const std::string kind = c["kind"].get<std::string>();
    const auto& g = v["groups"][kind];
    auto h = EngramHashing::Create(ParamsOf(g));
    ASSERT_TRUE(h.ok());
    const auto layers = g["params"]["layer_ids"].get<std::vector<int>>();
    const int layer = c["layer_id"].get<int>();
    int slot = -1;
    for (size_t s = 0; s < layers.size(); ++s) {
      if (layers[s] == layer) slot = static_cast<int>(s);
    }
    ASSERT_GE(slot, 0);
    std::vector<int64_t> flat;
    for (const auto& order : c["primes"]) {
      for (const auto& p : order) flat.push_back(p.get<int64_t>());
    }
    EXPECT_EQ(h->primes(slot), flat);
    const auto tokens = c["tokens"].get<std::vector<int64_t>>();
    std::vector<int64_t> ids;
    ASSERT_TRUE(h->HashIds(slot, tokens, 0, &ids).ok());
    const auto want = c["hash_ids"].get<std::vector<std::vector<int64_t>>>();
    ASSERT_EQ(want.size(), tokens.size());
    const int C = h->num_columns();
    for (size_t t = 0; t < tokens.size(); ++t) {
      ASSERT_EQ(want[t].size(), static_cast<size_t>(C));
      for (int col = 0; col < C; ++col) {
        ASSERT_EQ(ids[t * C + col], want[t][col]) << kind << " layer " << layer << " t " << t;
      }
    }
    // Suffix hashing (decode) equals the same rows of the whole-sequence hashing.
    std::vector<int64_t> tail;
    ASSERT_TRUE(h->HashIds(slot, tokens, tokens.size() - 1, &tail).ok());
    for (int col = 0; col < C; ++col) EXPECT_EQ(tail[col], want.back()[col]);
    ++checked;
  }
  EXPECT_EQ(checked, 22);
}

TEST(EngramVectors, MiniConfigMatchesTheMiniGroup) {
  auto cfg = LoadEngineConfig(KVTIER_MINI_CONFIG);
  ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
  nlohmann::json v = LoadVectors();
  const auto& g = v["groups"]["mini"];
  EngramHashParams p;
  p.layer_ids = cfg->engram_layer_ids;
  p.max_ngram_size = cfg->engram_max_ngram_size;
  p.n_head_per_ngram = cfg->engram_n_heads;
  p.engram_vocab_size = cfg->engram_vocab_size;
  p.tokenizer_vocab_size = cfg->engram_compressed_vocab_size;
  p.pad_id = cfg->engram_pad_token_id;
  p.seed = static_cast<uint64_t>(cfg->engram_seed);
  auto h = EngramHashing::Create(p);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->multipliers(0), g["multipliers"]["1"].get<std::vector<int64_t>>());
  EXPECT_EQ(h->num_embeddings(1), g["num_embeddings"]["6"].get<int64_t>());
}

}  // namespace
}  // namespace kvtier::engine
