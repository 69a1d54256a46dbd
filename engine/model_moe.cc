// Engine: the MoE sublayer (router, routed experts grouped by expert, shared expert).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "engine/model_internal.h"

namespace kvtier::engine {

namespace {
using model_detail::TopK;
}  // namespace

void Engine::Moe(int layer, int n, const float* xn, float* out) {
  const EngineConfig& c = config_;
  const LayerWeights& lw = layers_[layer];
  const int D = c.hidden_size, E = c.n_routed_experts, K = c.num_experts_per_tok;
  const int I = c.moe_intermediate_size;
  const float limit = static_cast<float>(c.swiglu_limit);
  std::vector<float> logits(static_cast<size_t>(n) * E);
  Mm(pool_.get(), xn, n, D, lw.gate, E, logits.data());
  std::vector<int32_t> chosen(static_cast<size_t>(n) * K);
  std::vector<float> weight(static_cast<size_t>(n) * K);
  for (int t = 0; t < n; ++t) {
    std::vector<float> s(E), biased(E);
    for (int e = 0; e < E; ++e) {
      s[e] = std::sqrt(Softplus(logits[static_cast<size_t>(t) * E + e]));
      biased[e] = s[e] + lw.gate_bias[e];  // the selection bias only picks experts
    }
    std::vector<int32_t> all(E);
    for (int e = 0; e < E; ++e) all[e] = e;
    std::vector<int32_t> top = TopK(biased, all, K);  // index order
    float sum = 0;
    for (int k = 0; k < K; ++k) sum += s[top[k]];
    for (int k = 0; k < K; ++k) {
      chosen[static_cast<size_t>(t) * K + k] = top[k];
      float w = c.norm_topk_prob ? s[top[k]] / sum : s[top[k]];
      weight[static_cast<size_t>(t) * K + k] = w * static_cast<float>(c.routed_scaling_factor);
    }
  }
  if (trace_ != nullptr) {
    for (int32_t e : chosen) trace_->expert_tokens[layer][e] += 1;
  }
  auto swiglu = [&](const float* x, int rows, const float* w1, const float* w3, const float* w2,
                    int inter, const float* row_weight, float* y, ThreadPool* pool) {
    std::vector<float> g(static_cast<size_t>(rows) * inter), u(g.size());
    Mm(pool, x, rows, D, w1, inter, g.data());
    Mm(pool, x, rows, D, w3, inter, u.data());
    for (int r = 0; r < rows; ++r) {
      for (int i = 0; i < inter; ++i) {
        const size_t k = static_cast<size_t>(r) * inter + i;
        const float gi = std::min(g[k], limit);
        const float ui = std::clamp(u[k], -limit, limit);
        g[k] = Silu(gi) * ui;
        if (row_weight) g[k] *= row_weight[r];  // router weight before w2
      }
    }
    Mm(pool, g.data(), rows, inter, w2, D, y);
  };
  // Routed experts, grouped by expert; each (token, slot) output lands in its own buffer.
  // Few tokens (decode): few experts are active, so the experts run one after another with the
  // threads inside each matmul; otherwise the threads take whole experts. MatMul's results do
  // not depend on the pool, so neither do the outputs.
  std::vector<float> routed(static_cast<size_t>(n) * K * D);
  const bool split_matmuls = static_cast<int64_t>(n) * K < 2 * pool_->threads();
  ThreadPool* expert_pool = split_matmuls ? pool_.get() : nullptr;
  auto over_experts = [&](const std::function<void(int64_t, int64_t)>& fn) {
    if (split_matmuls) {
      fn(0, E);
    } else {
      pool_->ParallelFor(E, fn);
    }
  };
  over_experts([&](int64_t b, int64_t e_end) {
    for (int64_t e = b; e < e_end; ++e) {
      std::vector<int64_t> slots;
      for (int64_t i = 0; i < static_cast<int64_t>(n) * K; ++i) {
        if (chosen[i] == e) slots.push_back(i);
      }
      if (slots.empty()) continue;
      const int rows = static_cast<int>(slots.size());
      std::vector<float> xg(static_cast<size_t>(rows) * D), wg(rows), yg(xg.size());
      for (int r = 0; r < rows; ++r) {
        std::memcpy(xg.data() + static_cast<int64_t>(r) * D, xn + (slots[r] / K) * D, D * 4);
        wg[r] = weight[slots[r]];
      }
      swiglu(xg.data(), rows, lw.w1[e], lw.w3[e], lw.w2[e], I, wg.data(), yg.data(), expert_pool);
      for (int r = 0; r < rows; ++r) {
        std::memcpy(routed.data() + slots[r] * D, yg.data() + static_cast<int64_t>(r) * D, D * 4);
      }
    }
  });
  std::vector<float> shared(static_cast<size_t>(n) * D, 0.0f);
  if (lw.s_w1 != nullptr) {
    swiglu(xn, n, lw.s_w1, lw.s_w3, lw.s_w2, I * c.n_shared_experts, nullptr, shared.data(),
           pool_.get());
  }
  for (int t = 0; t < n; ++t) {
    for (int d = 0; d < D; ++d) {
      float acc = routed[(static_cast<size_t>(t) * K) * D + d];
      for (int k = 1; k < K; ++k) acc += routed[(static_cast<size_t>(t) * K + k) * D + d];
      out[static_cast<size_t>(t) * D + d] = acc + shared[static_cast<size_t>(t) * D + d];
    }
  }
}

}  // namespace kvtier::engine
