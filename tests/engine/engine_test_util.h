// Shared setup of the engine tests: the mini config and one set of deterministic weights.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "engine/config.h"
#include "engine/model.h"
#include "engine/weights.h"

namespace kvtier::engine::testutil {

inline const EngineConfig& MiniConfig() {
  static const EngineConfig* c = [] {
    auto r = LoadEngineConfig(KVTIER_MINI_CONFIG);
    if (!r.ok()) {
      ADD_FAILURE() << r.status().ToString();
      std::abort();
    }
    return new EngineConfig(*r);
  }();
  return *c;
}

// The mini's layer schedule (every mechanism and ratio, W = 16) at a quarter of its widths, for
// tests that need many forward passes or write weight files.
inline const EngineConfig& TinyConfig() {
  static const EngineConfig* c = [] {
    EngineConfig t = MiniConfig();
    t.hidden_size = 64;
    t.num_attention_heads = 4;
    t.head_dim = 64;
    t.q_lora_rank = 32;
    t.o_lora_rank = 32;
    t.index_n_heads = 2;
    t.n_routed_experts = 4;
    t.moe_intermediate_size = 32;
    t.engram_n_heads = 2;
    t.engram_vocab_size = {509, 509, 509};
    Status s = t.Validate();
    if (!s.ok()) {
      ADD_FAILURE() << s.ToString();
      std::abort();
    }
    return new EngineConfig(t);
  }();
  return *c;
}

inline std::shared_ptr<const ModelWeights> MiniWeights() {
  static std::shared_ptr<const ModelWeights> w = [] {
    auto r = InitWeights(MiniConfig(), 7);
    if (!r.ok()) {
      ADD_FAILURE() << r.status().ToString();
      std::abort();
    }
    return std::make_shared<const ModelWeights>(std::move(*r));
  }();
  return w;
}

inline std::unique_ptr<Engine> MakeEngine(int threads = 2, bool use_pool = true) {
  EngineOptions o;
  o.threads = threads;
  o.use_candidate_pool = use_pool;
  auto e = Engine::Create(MiniConfig(), MiniWeights(), o);
  if (!e.ok()) {
    ADD_FAILURE() << e.status().ToString();
    std::abort();
  }
  return std::move(*e);
}

// A deterministic pseudo-text prompt of n byte tokens (ids 3..258).
inline std::vector<int32_t> Prompt(int n, uint32_t seed = 1) {
  std::vector<int32_t> t(n);
  uint32_t s = seed * 2654435761u + 12345;
  for (int i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    t[i] = 3 + static_cast<int32_t>('a' + (s >> 24) % 26);
  }
  return t;
}

inline int32_t Argmax(const float* v, int n) {
  return static_cast<int32_t>(std::max_element(v, v + n) - v);
}

inline bool BitEqual(const float* a, const float* b, size_t n) {
  return std::memcmp(a, b, n * sizeof(float)) == 0;
}

}  // namespace kvtier::engine::testutil
