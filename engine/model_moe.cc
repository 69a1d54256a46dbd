// Engine: the MoE sublayer (router, routed experts grouped by expert, shared expert).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "engine/model_internal.h"
#include "engine/scratch.h"

namespace kvtier::engine {

namespace {

// g <- silu(min(g, limit)) * clamp(u, -limit, limit), times row_weight[r] (when given) per row.
void SwigluActivate(int rows, int inter, float limit, const float* row_weight, float* g,
                    const float* u) {
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < inter; ++i) {
      const size_t k = static_cast<size_t>(r) * inter + i;
      const float gi = std::min(g[k], limit);
      const float ui = std::clamp(u[k], -limit, limit);
      g[k] = Silu(gi) * ui;
      if (row_weight) g[k] *= row_weight[r];  // router weight before w2
    }
  }
}

// The rows routed to one expert: the (token, slot) indices whose choice is `e`, in order, the
// tokens' normed inputs gathered as rows and their router weights.
struct ExpertRows {
  std::vector<int64_t> slots;
  std::vector<float> x, weight;
  int rows() const { return static_cast<int>(slots.size()); }
};
// Fills *g (its buffers reused from expert to expert).
void GatherExpertRowsInto(int32_t e, int64_t n_slots, int K, int D, const int32_t* chosen,
                          const float* weight, const float* xn, ExpertRows* g) {
  g->slots.clear();
  for (int64_t i = 0; i < n_slots; ++i) {
    if (chosen[i] == e) g->slots.push_back(i);
  }
  g->x.resize(g->slots.size() * D);
  g->weight.resize(g->slots.size());
  for (size_t r = 0; r < g->slots.size(); ++r) {
    std::memcpy(g->x.data() + r * D, xn + (g->slots[r] / K) * D, D * 4);
    g->weight[r] = weight[g->slots[r]];
  }
}

// Row r of y (the expert's outputs) to slot r's place in `routed` ([n * K x D]).
void ScatterExpertRows(const ExpertRows& g, int D, const float* y, float* routed) {
  for (size_t r = 0; r < g.slots.size(); ++r) {
    std::memcpy(routed + g.slots[r] * D, y + r * D, D * 4);
  }
}

// out = the K routed outputs of each token, summed in slot order, plus the shared output.
void CombineExperts(int n, int K, int D, const float* routed, const float* shared, float* out) {
  for (int t = 0; t < n; ++t) {
    for (int d = 0; d < D; ++d) {
      float acc = routed[(static_cast<size_t>(t) * K) * D + d];
      for (int k = 1; k < K; ++k) acc += routed[(static_cast<size_t>(t) * K + k) * D + d];
      out[static_cast<size_t>(t) * D + d] = acc + shared[static_cast<size_t>(t) * D + d];
    }
  }
}
}  // namespace

void Engine::Moe(int layer, int n, const float* xn, float* out) {
  const EngineConfig& c = config_;
  const LayerWeights& lw = layers_[layer];
  const int D = c.hidden_size, E = c.n_routed_experts, K = c.num_experts_per_tok;
  const int I = c.moe_intermediate_size;
  const float limit = static_cast<float>(c.swiglu_limit);
  thread_local std::vector<float> logits_slot, weight_slot, s_slot, biased_slot;
  thread_local std::vector<int32_t> chosen_slot, all_slot, top;
  Scratch<float> logits(logits_slot, static_cast<size_t>(n) * E);
  Mm(pool_.get(), xn, n, D, lw.gate, lw.pk_gate, E, logits.data());
  Scratch<int32_t> chosen(chosen_slot, static_cast<size_t>(n) * K);
  Scratch<float> weight(weight_slot, static_cast<size_t>(n) * K);
  Scratch<float> s(s_slot, E), biased(biased_slot, E);
  Scratch<int32_t> all(all_slot, E);
  for (int e = 0; e < E; ++e) all[e] = e;
  for (int t = 0; t < n; ++t) {
    for (int e = 0; e < E; ++e) {
      s[e] = std::sqrt(Softplus(logits[static_cast<size_t>(t) * E + e]));
      biased[e] = s[e] + lw.gate_bias[e];  // the selection bias only picks experts
    }
    TopKByScore(biased.data(), all.data(), E, K, &top);  // index order
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
  // The SwiGLU MLP of `rows` rows with w1, w3, w2 (pk: their packed copies); g and u: scratch.
  auto swiglu = [&](const float* x, int rows, const float* const w[3],
                    const PackedMatrix* const pk[3], int inter, const float* row_weight, float* y,
                    ThreadPool* pool, std::vector<float>& g, std::vector<float>& u) {
    g.resize(static_cast<size_t>(rows) * inter);
    u.resize(g.size());
    Mm(pool, x, rows, D, w[0], pk[0], inter, g.data());
    Mm(pool, x, rows, D, w[1], pk[1], inter, u.data());
    SwigluActivate(rows, inter, limit, row_weight, g.data(), u.data());
    Mm(pool, g.data(), rows, inter, w[2], pk[2], D, y);
  };
  // Routed experts, grouped by expert; each (token, slot) output lands in its own buffer.
  // Every (token, slot) of `routed` is written by its expert; `shared` stays zero without a
  // shared expert.
  thread_local std::vector<float> routed_slot, shared_slot;
  Scratch<float> routed(routed_slot, static_cast<size_t>(n) * K * D);
  Scratch<float> shared(shared_slot, static_cast<size_t>(n) * D);
  if (lw.s_w1 == nullptr) shared.fill(0.0f);
  if (static_cast<int64_t>(n) * K < 2 * pool_->threads()) {
    // Few tokens (decode): few experts are active, so the threads split the products instead:
    // every active expert's and the shared expert's gate and up products in one call, their
    // down products in another (MmMany; each output as its own MatMul computes it).
    // This thread's buffers, reused call to call: one group (and its products) per active
    // expert, the first A of each list in use.
    struct DecodeScratch {
      std::vector<int32_t> active;
      std::vector<ExpertRows> groups;
      std::vector<std::vector<float>> g, u, yg;
      std::vector<float> gs, us;
      std::vector<MatMulPart> up, down;
    };
    thread_local DecodeScratch ds;  // (`s` is the router's scores above)
    ScopeExit trim([&] {
      for (ExpertRows& grp : ds.groups) {
        TrimScratch(grp.slots);
        TrimScratch(grp.x);
        TrimScratch(grp.weight);
      }
      for (auto* list : {&ds.g, &ds.u, &ds.yg}) {
        for (auto& v : *list) TrimScratch(v);
      }
      TrimScratch(ds.gs);
      TrimScratch(ds.us);
    });
    std::vector<int32_t>& active = ds.active;
    std::vector<ExpertRows>& groups = ds.groups;
    active.clear();
    if (groups.size() < static_cast<size_t>(E)) groups.resize(E);
    for (int32_t e = 0; e < E; ++e) {
      ExpertRows& grp = groups[active.size()];
      GatherExpertRowsInto(e, static_cast<int64_t>(n) * K, K, D, chosen.data(), weight.data(), xn,
                           &grp);
      if (grp.slots.empty()) continue;
      active.push_back(e);
    }
    const int A = static_cast<int>(active.size()), Is = I * c.n_shared_experts;
    const bool has_shared = lw.s_w1 != nullptr;
    std::vector<std::vector<float>>&g = ds.g, &u = ds.u, &yg = ds.yg;
    for (auto* list : {&g, &u, &yg}) {
      if (list->size() < static_cast<size_t>(A)) list->resize(A);
    }
    std::vector<float>&gs = ds.gs, &us = ds.us;
    gs.resize(has_shared ? static_cast<size_t>(n) * Is : 0);
    us.resize(gs.size());
    std::vector<MatMulPart>&up = ds.up, &down = ds.down;
    up.clear();
    down.clear();
    for (int a = 0; a < A; ++a) {
      const int rows = groups[a].rows(), e = active[a];
      g[a].resize(static_cast<size_t>(rows) * I);
      u[a].resize(g[a].size());
      yg[a].resize(groups[a].x.size());
      up.push_back({groups[a].x.data(), rows, D, lw.w1[e], lw.pk_w1[e], I, g[a].data()});
      up.push_back({groups[a].x.data(), rows, D, lw.w3[e], lw.pk_w3[e], I, u[a].data()});
      down.push_back({g[a].data(), rows, I, lw.w2[e], lw.pk_w2[e], D, yg[a].data()});
    }
    if (has_shared) {
      up.push_back({xn, n, D, lw.s_w1, lw.pk_s_w1, Is, gs.data()});
      up.push_back({xn, n, D, lw.s_w3, lw.pk_s_w3, Is, us.data()});
      down.push_back({gs.data(), n, Is, lw.s_w2, lw.pk_s_w2, D, shared.data()});
    }
    MmMany(pool_.get(), up);
    for (int a = 0; a < A; ++a) {
      SwigluActivate(groups[a].rows(), I, limit, groups[a].weight.data(), g[a].data(), u[a].data());
    }
    if (has_shared) SwigluActivate(n, Is, limit, nullptr, gs.data(), us.data());
    MmMany(pool_.get(), down);
    for (int a = 0; a < A; ++a) ScatterExpertRows(groups[a], D, yg[a].data(), routed.data());
    CombineExperts(n, K, D, routed.data(), shared.data(), out);
    return;
  }
  // Otherwise the threads take whole experts. MatMul's results do not depend on the pool, so
  // neither do the outputs.
  pool_->ParallelFor(E, [&](int64_t b, int64_t e_end) {
    // The section's buffers, reused from expert to expert and from call to call.
    thread_local ExpertRows grp;
    thread_local std::vector<float> yg, g, u;
    for (int64_t e = b; e < e_end; ++e) {
      GatherExpertRowsInto(static_cast<int32_t>(e), static_cast<int64_t>(n) * K, K, D,
                           chosen.data(), weight.data(), xn, &grp);
      if (grp.slots.empty()) continue;
      yg.resize(grp.x.size());
      const float* w[3] = {lw.w1[e], lw.w3[e], lw.w2[e]};
      const PackedMatrix* pk[3] = {lw.pk_w1[e], lw.pk_w3[e], lw.pk_w2[e]};
      swiglu(grp.x.data(), grp.rows(), w, pk, I, grp.weight.data(), yg.data(), nullptr, g, u);
      ScatterExpertRows(grp, D, yg.data(), routed.data());
    }
    TrimScratch(grp.slots);
    TrimScratch(grp.x);
    TrimScratch(grp.weight);
    TrimScratch(yg);
    TrimScratch(g);
    TrimScratch(u);
  });
  if (lw.s_w1 != nullptr) {
    const float* w[3] = {lw.s_w1, lw.s_w3, lw.s_w2};
    const PackedMatrix* pk[3] = {lw.pk_s_w1, lw.pk_s_w3, lw.pk_s_w2};
    thread_local std::vector<float> g, u;
    swiglu(xn, n, w, pk, I * c.n_shared_experts, nullptr, shared.data(), pool_.get(), g, u);
    TrimScratch(g);
    TrimScratch(u);
  }
  CombineExperts(n, K, D, routed.data(), shared.data(), out);
}

}  // namespace kvtier::engine
