#include "engine/model.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/quant.h"

namespace kvtier::engine {

namespace {

using kernels::Backend;
using kernels::QuantFormat;

// The engine quantises with the scalar reference (every backend must match it bit for bit;
// these calls are a negligible share of the work).
constexpr Backend kQuantBackend = Backend::kReference;
// Attention and the indexer dequantise the global KV they read with the vectorised codec
// (AVX2 where the CPU has it; bit-identical to the reference, tests/kernels).
constexpr Backend kCacheReadBackend = Backend::kAuto;
// Index key rows dequantised per pass of the indexer (a 4 KiB buffer at index_head_dim 32).
constexpr int64_t kIndexRowsPerPass = 32;

// Top-k of scores over `candidates` (entry indices), ties broken by the lowest index; the
// result is returned in index order.
std::vector<int32_t> TopK(const std::vector<float>& score, const std::vector<int32_t>& candidates,
                          int k) {
  std::vector<int32_t> c = candidates;
  auto better = [&](int32_t a, int32_t b) {
    if (score[a] != score[b]) return score[a] > score[b];
    return a < b;
  };
  if (static_cast<int>(c.size()) > k) {
    std::partial_sort(c.begin(), c.begin() + k, c.end(), better);
    c.resize(k);
  }
  std::sort(c.begin(), c.end());
  return c;
}

}  // namespace

size_t AppendKvBytes(std::vector<uint8_t>* v, size_t bytes) {
  const size_t old = v->size(), need = old + bytes;
  if (need > v->capacity()) v->reserve(std::max(need, old / kKvGrowthDen * kKvGrowthNum));
  v->resize(need);
  return old;
}

void KvSourceCache::Truncate(int64_t e) {
  const size_t n = static_cast<size_t>(std::min(e, n_entries));
  main_data.resize(n * kernels::DataBytes(QuantFormat::kFp4E4M3x16, head_dim));
  main_scales.resize(n * kernels::ScaleBytes(QuantFormat::kFp4E4M3x16, head_dim));
  index_data.resize(n * kernels::DataBytes(QuantFormat::kFp4Ue8m0x32, index_dim));
  index_scales.resize(n * kernels::ScaleBytes(QuantFormat::kFp4Ue8m0x32, index_dim));
  n_entries = static_cast<int64_t>(n);
}

KvMemory KvCacheBytes(const SequenceState& st) {
  KvMemory m;
  for (const KvSourceCache& k : st.kv) {
    m.global_kv_bytes += k.main_data.capacity() + k.main_scales.capacity() +
                         k.index_data.capacity() + k.index_scales.capacity();
    m.fixed_bytes += (k.kv_state.capacity() + k.score_state.capacity()) * sizeof(float);
    m.stored_bytes +=
        k.main_data.size() + k.main_scales.size() + k.index_data.size() + k.index_scales.size();
  }
  for (const SwaRing& r : st.swa) {
    m.fixed_bytes += r.values.capacity() * sizeof(float) + r.data.capacity() + r.scales.capacity();
  }
  return m;
}

struct Engine::LayerWeights {
  const float* hc_fn[2] = {};
  const float* hc_scale[2] = {};
  const float* hc_base[2] = {};
  const float* attn_norm = nullptr;
  const float* ffn_norm = nullptr;
  const float *wq_a = nullptr, *q_norm = nullptr, *wq_b = nullptr, *wkv = nullptr,
              *kv_norm = nullptr, *wo_a = nullptr, *wo_b = nullptr, *sink = nullptr;
  const float *c_wkv = nullptr, *c_wgate = nullptr, *c_norm = nullptr;
  const float *i_wk = nullptr, *i_kn_w = nullptr, *i_kn_b = nullptr;
  const float *i_wq_b = nullptr, *i_wproj = nullptr;
  const float *gate = nullptr, *gate_bias = nullptr;
  std::vector<const float*> w1, w2, w3;
  const float *s_w1 = nullptr, *s_w2 = nullptr, *s_w3 = nullptr;
  const float *e_wkv = nullptr, *e_qn = nullptr, *e_kn = nullptr;
  const std::vector<double>* rope = nullptr;
};

// SharedAttentionRuntime (reference §2): one slot each, written by sources before the
// consumers in later layers read them, within one pass over the layers.
struct Engine::Runtime {
  KvSourceCache* src = nullptr;
  std::vector<std::vector<int32_t>> topk;        // per batch token: entry indices
  std::vector<std::vector<uint8_t>> candidates;  // per batch token: block mask; empty: none
};

Engine::Engine(const EngineConfig& config, std::shared_ptr<const ModelWeights> weights,
               const EngineOptions& options)
    : config_(config), weights_(std::move(weights)), options_(options) {}

// One batch of Engram rows the engine requested (own step or prefetch) and still holds.
struct Engine::EngramPending {
  int slot = 0;
  int64_t p0 = 0;  // positions [p0, p0 + n)
  int n = 0;
  EngramRowBatch batch;   // row_ids: n x columns, token-major
  bool prefetch = false;  // requested ahead of its step
  bool waited = false;    // Wait() returned (status, batch.data/scales valid)
  Status status;
  bool discarded = false;  // no step will use it; waited (in order) and dropped
  bool used = false;       // served a step
  int64_t claim_end = -1;  // end of the running step that claimed it; -1: none
  int64_t end() const { return p0 + n; }
};

Engine::~Engine() {
  // The row source may still write into batches it was asked for: wait for every one.
  for (auto& q : engram_queue_) {
    for (auto& e : q) {
      if (!e->waited) (void)rows_->Wait(&e->batch);
    }
  }
}

StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineConfig& config,
                                                 std::shared_ptr<const ModelWeights> weights,
                                                 const EngineOptions& options) {
  if (weights == nullptr) return Status::InvalidArgument("engine: no weights");
  if (options.prefill_chunk_tokens < 1 ||
      static_cast<size_t>(options.prefill_chunk_tokens) > kMaxTokensPerCall)
    return Status::InvalidArgument("engine: prefill_chunk_tokens out of range");
  if (options.engram_lookahead_chunks < 0 ||
      options.engram_lookahead_chunks > kMaxEngramLookaheadChunks)
    return Status::InvalidArgument("engine: engram_lookahead_chunks out of range");
  if (options.engram_prefetch_batches_max < 1 ||
      options.engram_prefetch_batches_max > kMaxEngramPrefetchBatches)
    return Status::InvalidArgument("engine: engram_prefetch_batches_max out of range");
  EngineConfig c = config;
  KVTIER_RETURN_IF_ERROR(c.Validate());
  KVTIER_RETURN_IF_ERROR(CheckWeights(c, weights->file));
  std::unique_ptr<Engine> e(new Engine(c, std::move(weights), options));
  e->pool_ = std::make_unique<ThreadPool>(options.threads);
  KVTIER_RETURN_IF_ERROR(e->Bind());
  return e;
}

RopeParams RopeParamsFor(const EngineConfig& c, double theta) {
  RopeParams rp;
  rp.yarn = c.rope_scaling.type == "yarn" &&
            (c.max_position_embeddings == 0 ||
             c.max_position_embeddings > c.rope_scaling.original_max_position_embeddings);
  rp.factor = c.rope_scaling.factor;
  rp.original_max_position = static_cast<double>(c.rope_scaling.original_max_position_embeddings);
  rp.beta_fast = c.rope_scaling.beta_fast;
  rp.beta_slow = c.rope_scaling.beta_slow;
  rp.theta = theta;
  return rp;
}

Status Engine::Bind() {
  const EngineConfig& c = config_;
  const ModelWeights& w = *weights_;
  rope_main_ = RopeFrequencies(c.qk_rope_head_dim, RopeParamsFor(c, c.rope_theta));
  rope_compress_ = RopeFrequencies(c.qk_rope_head_dim, RopeParamsFor(c, c.compress_rope_theta));

  layers_.resize(c.num_hidden_layers);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    LayerWeights& lw = layers_[l];
    const std::string p = "layers." + std::to_string(l) + ".";
    auto f = [&](const std::string& n) { return w.F32(p + n); };
    const char* subs[2] = {"attn", "ffn"};
    for (int s = 0; s < 2; ++s) {
      lw.hc_fn[s] = f(std::string("hc_") + subs[s] + "_fn");
      lw.hc_scale[s] = f(std::string("hc_") + subs[s] + "_scale");
      lw.hc_base[s] = f(std::string("hc_") + subs[s] + "_base");
    }
    lw.attn_norm = f("attn_norm.weight");
    lw.ffn_norm = f("ffn_norm.weight");
    lw.wq_a = f("attn.wq_a.weight");
    lw.q_norm = f("attn.q_norm.weight");
    lw.wq_b = f("attn.wq_b.weight");
    lw.wkv = f("attn.wkv.weight");
    lw.kv_norm = f("attn.kv_norm.weight");
    lw.wo_a = f("attn.wo_a.weight");
    lw.wo_b = f("attn.wo_b.weight");
    lw.sink = f("attn.attn_sink");
    if (c.IsKvSource(l)) {
      lw.c_wkv = f("attn.compressor.wkv.weight");
      if (c.ratio(l) > 1) lw.c_wgate = f("attn.compressor.wgate.weight");
      lw.c_norm = f("attn.compressor.norm.weight");
      lw.i_wk = f("attn.indexer.wk.weight");
      lw.i_kn_w = f("attn.indexer.k_norm.weight");
      lw.i_kn_b = f("attn.indexer.k_norm.bias");
    }
    if (c.IsIndexSource(l)) {
      lw.i_wq_b = f("attn.indexer.wq_b.weight");
      lw.i_wproj = f("attn.indexer.weights_proj.weight");
    }
    lw.gate = f("ffn.gate.weight");
    lw.gate_bias = f("ffn.gate.bias");
    for (int e = 0; e < c.n_routed_experts; ++e) {
      const std::string ep = "ffn.experts." + std::to_string(e) + ".";
      lw.w1.push_back(f(ep + "w1.weight"));
      lw.w2.push_back(f(ep + "w2.weight"));
      lw.w3.push_back(f(ep + "w3.weight"));
    }
    if (c.n_shared_experts > 0) {
      lw.s_w1 = f("ffn.shared_experts.w1.weight");
      lw.s_w2 = f("ffn.shared_experts.w2.weight");
      lw.s_w3 = f("ffn.shared_experts.w3.weight");
    }
    if (c.IsEngramLayer(l)) {
      lw.e_wkv = f("engram.wkv.weight");
      lw.e_qn = f("engram.q_norm.weight");
      lw.e_kn = f("engram.k_norm.weight");
    }
    lw.rope = c.ratio(l) > 0 ? &rope_compress_ : &rope_main_;
  }

  if (!c.engram_layer_ids.empty()) {
    EngramHashParams p;
    p.layer_ids = c.engram_layer_ids;
    p.max_ngram_size = c.engram_max_ngram_size;
    p.n_head_per_ngram = c.engram_n_heads;
    p.engram_vocab_size = c.engram_vocab_size;
    p.tokenizer_vocab_size = c.engram_compressed_vocab_size;
    p.pad_id = c.engram_pad_token_id;
    p.seed = static_cast<uint64_t>(c.engram_seed);
    KVTIER_ASSIGN_OR_RETURN(EngramHashing h, EngramHashing::Create(p));
    engram_hash_ = std::make_unique<EngramHashing>(std::move(h));
    std::vector<LocalEngramRowSource::Table> tables;
    for (int l : c.engram_layer_ids) {
      const std::string p2 = "layers." + std::to_string(l) + ".engram.";
      const Tensor* d = w.Find(p2 + "table");
      const Tensor* s = w.Find(p2 + "table_scale");
      if (d == nullptr || s == nullptr) return Status::InvalidArgument("engine: engram table");
      tables.push_back({d->bytes.data(), s->bytes.data(), d->shape[0]});
    }
    local_rows_ = std::make_unique<LocalEngramRowSource>(c.engram_head_dim, std::move(tables));
    rows_ = options_.engram_rows != nullptr ? options_.engram_rows : local_rows_.get();
    if (rows_->row_dim() != c.engram_head_dim)
      return Status::InvalidArgument("engine: engram row source has the wrong row_dim");
    engram_queue_.resize(c.engram_layer_ids.size());
  }
  PackMatMulWeights();
  return Status::Ok();
}

void Engine::PackMatMulWeights() {
  if (ActiveMatMulKernel() == MatMulKernel::kScalar) return;  // reads W as it is
  const EngineConfig& c = config_;
  const int D = c.hidden_size, hd = c.head_dim, ql = c.q_lora_rank, H = c.num_attention_heads;
  const int G = c.o_groups, ol = c.o_lora_rank, gin = (H / G) * hd, I = c.moe_intermediate_size;
  auto pack = [&](const float* w, int in, int out) {
    if (w != nullptr) packed_.push_back(RegisterPackedWeight(w, in, out));
  };
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& lw = layers_[l];
    pack(lw.wq_a, D, ql);
    pack(lw.wq_b, ql, H * hd);
    pack(lw.wkv, D, hd);
    for (int g = 0; g < G; ++g) pack(lw.wo_a + static_cast<int64_t>(g) * ol * gin, gin, ol);
    pack(lw.wo_b, G * ol, D);
    pack(lw.c_wkv, D, hd);
    pack(lw.c_wgate, D, hd);
    pack(lw.i_wk, hd, c.index_head_dim);
    pack(lw.i_wq_b, ql, c.index_n_heads * c.index_head_dim);
    pack(lw.i_wproj, D, c.index_n_heads);
    pack(lw.gate, D, c.n_routed_experts);
    for (size_t e = 0; e < lw.w1.size(); ++e) {
      pack(lw.w1[e], D, I);
      pack(lw.w3[e], D, I);
      pack(lw.w2[e], I, D);
    }
    pack(lw.s_w1, D, I * c.n_shared_experts);
    pack(lw.s_w3, D, I * c.n_shared_experts);
    pack(lw.s_w2, I * c.n_shared_experts, D);
    if (lw.e_wkv != nullptr) {
      pack(lw.e_wkv, engram_hash_->num_columns() * c.engram_head_dim, (c.hc_mult + 1) * D);
    }
  }
  pack(weights_->F32("head.weight"), D, c.vocab_size);
}

SequenceState Engine::NewSequence() const {
  const EngineConfig& c = config_;
  SequenceState st;
  st.swa.resize(c.num_hidden_layers);
  for (SwaRing& r : st.swa) {
    r.window = c.sliding_window;
    r.dim = c.head_dim;
    r.values.assign(static_cast<size_t>(r.window) * r.dim, 0.0f);
    r.data.assign(static_cast<size_t>(r.window) * r.dim, 0);
    r.scales.assign(static_cast<size_t>(r.window) * (r.dim / 32), 0);
  }
  for (int l : c.kv_source_layer_ids) {
    KvSourceCache k;
    k.layer = l;
    k.ratio = c.ratio(l);
    k.head_dim = c.head_dim;
    k.index_dim = c.index_head_dim;
    k.kv_state.assign(static_cast<size_t>(k.ratio) * c.head_dim, 0.0f);
    k.score_state.assign(static_cast<size_t>(k.ratio) * c.head_dim, 0.0f);
    st.kv.push_back(std::move(k));
  }
  return st;
}

Status Engine::CheckTokens(std::span<const int32_t> tokens) const {
  if (tokens.empty()) return Status::InvalidArgument("engine: no tokens");
  if (tokens.size() > kMaxTokensPerCall)
    return Status::InvalidArgument("engine: more than kMaxTokensPerCall tokens in one call");
  for (int32_t t : tokens) {
    if (t < 0 || t >= config_.vocab_size)
      return Status::InvalidArgument("engine: token id outside the vocabulary");
  }
  return Status::Ok();
}

Status Engine::CheckExtendable(const SequenceState& st) const {
  const int64_t n = static_cast<int64_t>(st.tokens.size());
  if (static_cast<int>(st.swa.size()) != config_.num_hidden_layers ||
      st.kv.size() != config_.kv_source_layer_ids.size())
    return Status::InvalidArgument("engine: state was not made by this engine");
  for (const SwaRing& r : st.swa) {
    if (r.end != n && !(r.end == 0 && n == 0))
      return Status::InvalidArgument("engine: SWA ring does not end at the sequence end");
  }
  for (const KvSourceCache& k : st.kv) {
    if (k.consumed != n)
      return Status::InvalidArgument("engine: global KV does not cover the sequence");
  }
  return Status::Ok();
}

void Engine::Embed(std::span<const int32_t> tokens, float* x, float* pre) const {
  const int D = config_.hidden_size, hc = config_.hc_mult;
  const float* emb = weights_->F32("embed.weight");
  for (size_t t = 0; t < tokens.size(); ++t) {
    for (int i = 0; i < hc; ++i) {
      std::memcpy(x + (t * hc + i) * D, emb + static_cast<int64_t>(tokens[t]) * D, D * 4);
      pre[t * hc + i] = i == 0 ? 1.0f : 0.0f;  // one-hot pre_mix on copy 0
    }
  }
}

void Engine::PreMix(int n, const float* x, const float* pre, const float* norm_w, float* xn) const {
  const int D = config_.hidden_size, hc = config_.hc_mult;
  for (int t = 0; t < n; ++t) {
    float* y = xn + static_cast<int64_t>(t) * D;
    for (int d = 0; d < D; ++d) y[d] = 0.0f;
    for (int i = 0; i < hc; ++i) {
      const float p = pre[t * hc + i];
      const float* xi = x + (static_cast<int64_t>(t) * hc + i) * D;
      for (int d = 0; d < D; ++d) y[d] += p * xi[d];
    }
    RmsNorm(y, norm_w, D, config_.rms_norm_eps, y);
  }
}

void Engine::MixSublayer(int n, float* x, const float* f_out, const float* post,
                         const float* comb) const {
  const int D = config_.hidden_size, hc = config_.hc_mult;
  std::vector<float> old(static_cast<size_t>(hc) * D);
  for (int t = 0; t < n; ++t) {
    float* xt = x + static_cast<int64_t>(t) * hc * D;
    std::memcpy(old.data(), xt, old.size() * 4);
    const float* f = f_out + static_cast<int64_t>(t) * D;
    const float* cb = comb + static_cast<int64_t>(t) * hc * hc;
    for (int j = 0; j < hc; ++j) {
      float* out = xt + static_cast<int64_t>(j) * D;
      const float pj = post[t * hc + j];
      for (int d = 0; d < D; ++d) {
        float acc = pj * f[d];
        for (int i = 0; i < hc; ++i) acc += cb[i * hc + j] * old[static_cast<size_t>(i) * D + d];
        out[d] = acc;
      }
    }
  }
}

// ---- Engram prefetch -------------------------------------------------------------------
//
// engram_queue_[slot] holds every batch requested for that Engram layer and not yet consumed
// or dropped, in request order; Waits are made in that order. A step *claims* the batch that
// covers its positions with equal row ids (requesting one if none does), and every other
// batch of the slot that cannot serve a later step (it ends within the step, or covers it
// with other row ids) is discarded: waited in turn, then dropped, never used.

Status Engine::EngramRowIds(int slot, std::span<const int32_t> toks, int64_t toks_p0, int64_t p0,
                            int n, std::vector<int64_t>* rows) const {
  // Only the last max_ngram-1 tokens before the batch matter (the n-gram history).
  const int64_t start = std::max<int64_t>(0, p0 - (config_.engram_max_ngram_size - 1));
  if (start < toks_p0 || p0 + n > toks_p0 + static_cast<int64_t>(toks.size()))
    return Status::Internal("engine: engram rows without their n-gram history");
  std::vector<int64_t> t(toks.begin() + (start - toks_p0), toks.begin() + (p0 + n - toks_p0));
  return engram_hash_->RowIds(slot, t, static_cast<size_t>(p0 - start), rows);
}

void Engine::WaitEngram(EngramPending* e) {
  const auto t0 = std::chrono::steady_clock::now();
  e->status = rows_->Wait(&e->batch);
  e->waited = true;
  ++stats_.engram_waits;
  if (e->batch.stalled) {
    ++stats_.engram_stalls;
    stats_.engram_stall_us += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0)
            .count());
  }
}

void Engine::DiscardEngram(EngramPending* e) {
  if (e->discarded) return;
  e->discarded = true;
  if (e->prefetch && !e->used) ++stats_.engram_prefetches_discarded;
}

void Engine::ReapEngram(int slot) {
  auto& q = engram_queue_[slot];
  q.erase(std::remove_if(
              q.begin(), q.end(),
              [](const std::unique_ptr<EngramPending>& e) { return e->discarded && e->waited; }),
          q.end());
}

Status Engine::RequestEngram(std::unique_ptr<EngramPending> e, bool own, EngramPending** out) {
  auto& q = engram_queue_[e->slot];
  if (!own && static_cast<int>(q.size()) >= options_.engram_prefetch_batches_max) {
    ++stats_.engram_prefetches_rejected;
    return Status::Rejected("engine: engram_prefetch_batches_max batches already held");
  }
  Status s = rows_->Request(&e->batch);
  if (s.IsRejected() && own) {
    // The source's per-slot bound is taken by earlier batches: wait for them (in order; they
    // stay held with their rows) and ask once more.
    for (auto& o : q) {
      if (!o->waited) WaitEngram(o.get());
    }
    ReapEngram(e->slot);
    s = rows_->Request(&e->batch);
  }
  if (!s.ok()) {
    if (!own && s.IsRejected()) ++stats_.engram_prefetches_rejected;
    return s;
  }
  ++stats_.engram_requests;
  if (!own) ++stats_.engram_prefetches_issued;
  e->prefetch = !own;
  *out = e.get();
  q.push_back(std::move(e));
  return Status::Ok();
}

Status Engine::EnsureEngram(const Step& s, std::span<const int32_t> toks, int64_t toks_p0, bool own,
                            std::vector<EngramPending*>* claimed, const std::vector<Step>* plan,
                            size_t step) {
  const EngineConfig& c = config_;
  const size_t C = static_cast<size_t>(engram_hash_->num_columns());
  const int64_t s_end = s.p0 + s.n;
  // Whether `e` covers a later step of the plan within the lookahead (positions may go back
  // within a call: CED's decoder pass re-reads layer d's last positions).
  auto planned = [&](const EngramPending& e) {
    if (plan == nullptr) return false;
    const int layer = c.engram_layer_ids[e.slot];
    const size_t last =
        std::min(plan->size(), step + 1 + static_cast<size_t>(options_.engram_lookahead_chunks));
    for (size_t j = step + 1; j < last; ++j) {
      const Step& t = (*plan)[j];
      if (layer >= t.l_begin && layer < t.l_end && e.p0 <= t.p0 && t.p0 + t.n <= e.end())
        return true;
    }
    return false;
  };
  for (int l = s.l_begin; l < s.l_end; ++l) {
    if (!c.IsEngramLayer(l)) continue;
    const int slot = c.EngramSlot(l);
    std::vector<int64_t> ids;
    KVTIER_RETURN_IF_ERROR(EngramRowIds(slot, toks, toks_p0, s.p0, s.n, &ids));
    EngramPending* match = nullptr;
    for (auto& e : engram_queue_[slot]) {
      if (own) e->claim_end = -1;  // claims last one step
      if (e->discarded) continue;
      const bool covers = e->p0 <= s.p0 && s_end <= e->end();
      // A batch the running step consumes to its end is gone before a later step runs.
      const bool consumed_now = e->claim_end >= e->end();
      if (covers && match == nullptr && !consumed_now &&
          std::equal(ids.begin(), ids.end(),
                     e->batch.row_ids.begin() + static_cast<size_t>(s.p0 - e->p0) * C)) {
        match = e.get();
        continue;
      }
      if (own && (covers || e->end() <= s_end) && !planned(*e)) DiscardEngram(e.get());
    }
    if (match == nullptr) {
      auto e = std::make_unique<EngramPending>();
      e->slot = slot;
      e->p0 = s.p0;
      e->n = s.n;
      e->batch.slot = slot;
      e->batch.row_ids = std::move(ids);
      Status r = RequestEngram(std::move(e), own, &match);
      if (!r.ok()) {
        return own ? r.WithContext("engram layer " + std::to_string(l) + " (slot " +
                                   std::to_string(slot) + ")")
                   : r;
      }
    }
    if (own) {
      match->claim_end = s_end;
      (*claimed)[slot] = match;
    }
  }
  return Status::Ok();
}

Status Engine::BeginEngramStep(const SequenceState& st, const std::vector<Step>& plan, size_t step,
                               std::vector<EngramPending*>* claimed) {
  if (engram_hash_ == nullptr) return Status::Ok();
  claimed->assign(engram_queue_.size(), nullptr);
  KVTIER_RETURN_IF_ERROR(EnsureEngram(plan[step], st.tokens, 0, true, claimed, &plan, step));
  // Lookahead: the next steps' rows, while this one computes. A refused prefetch is simply
  // requested again when its step runs.
  const size_t last =
      std::min(plan.size(), step + 1 + static_cast<size_t>(options_.engram_lookahead_chunks));
  for (size_t j = step + 1; j < last; ++j) {
    if (!EnsureEngram(plan[j], st.tokens, 0, false, nullptr).ok()) break;
  }
  return Status::Ok();
}

Status Engine::TakeEngram(int layer, EngramPending* e, int64_t p0, int n, EngramRowBatch* out) {
  const EngineConfig& c = config_;
  const int slot = c.EngramSlot(layer);
  const int ed = c.engram_head_dim;
  const size_t C = static_cast<size_t>(engram_hash_->num_columns());
  auto& q = engram_queue_[slot];
  auto where = [&]() {
    return "engram layer " + std::to_string(layer) + " (slot " + std::to_string(slot) +
           "), positions [" + std::to_string(p0) + ", " + std::to_string(p0 + n) + ")";
  };
  if (e == nullptr) return Status::Internal("engine: " + where() + " has no requested rows");
  // Waits come in request order: first every older batch of the slot.
  for (auto& o : q) {
    if (o.get() == e) break;
    if (!o->waited) WaitEngram(o.get());
  }
  if (!e->waited) WaitEngram(e);
  if (!e->status.ok() && e->prefetch) {
    // A prefetched read failed (e.g. its row server went away while it was in flight and the
    // fetcher's retries ran out): ask once more now, as this step's own read.
    ++stats_.engram_prefetches_failed;
    DiscardEngram(e);
    auto again = std::make_unique<EngramPending>();
    again->slot = slot;
    again->p0 = p0;
    again->n = n;
    again->batch.slot = slot;
    const size_t off = static_cast<size_t>(p0 - e->p0) * C;
    again->batch.row_ids.assign(e->batch.row_ids.begin() + off,
                                e->batch.row_ids.begin() + off + static_cast<size_t>(n) * C);
    KVTIER_RETURN_IF_ERROR(RequestEngram(std::move(again), true, &e).WithContext(where()));
    for (auto& o : q) {
      if (!o->waited) WaitEngram(o.get());  // older ones first, then e (the newest)
    }
  }
  if (!e->status.ok()) {
    Status s = e->status.WithContext(where());
    DiscardEngram(e);
    ReapEngram(slot);
    return s;
  }
  const size_t rows = static_cast<size_t>(n) * C;
  if (e->batch.data.size() != static_cast<size_t>(e->n) * C * ed ||
      e->batch.scales.size() != static_cast<size_t>(e->n) * C * (ed / 32))
    return Status::Internal("engine: engram row source returned a short batch");
  if (e->prefetch && !e->used) ++stats_.engram_prefetches_consumed;
  e->used = true;
  e->claim_end = -1;
  const bool whole = e->p0 == p0 && e->n == n;
  if (whole) {
    out->data = std::move(e->batch.data);
    out->scales = std::move(e->batch.scales);
  } else {
    const size_t off = static_cast<size_t>(p0 - e->p0) * C;
    out->data.assign(e->batch.data.begin() + off * ed, e->batch.data.begin() + (off + rows) * ed);
    out->scales.assign(e->batch.scales.begin() + off * (ed / 32),
                       e->batch.scales.begin() + (off + rows) * (ed / 32));
  }
  out->slot = slot;
  if (p0 + n == e->end()) {  // fully consumed (no later step starts inside it)
    e->discarded = true;     // not counted: it was used
  }
  ReapEngram(slot);
  return Status::Ok();
}

Status Engine::PrefetchPlan(const std::vector<Step>& plan, std::span<const int32_t> toks,
                            int64_t toks_p0) {
  if (engram_hash_ == nullptr) return Status::Ok();
  int64_t covered = 0;
  for (const Step& s : plan) {
    Status r = EnsureEngram(s, toks, toks_p0, false, nullptr);
    if (!r.ok()) {
      return r.WithContext("engine: engram prefetch stopped after " + std::to_string(covered) +
                           " tokens");
    }
    covered += s.n;
  }
  return Status::Ok();
}

Status Engine::PrefetchEngram(const SequenceState& st, std::span<const int32_t> upcoming) {
  KVTIER_RETURN_IF_ERROR(CheckTokens(upcoming));
  if (engram_hash_ == nullptr) return Status::Ok();
  const int64_t p = static_cast<int64_t>(st.tokens.size());
  const int64_t hist = std::min<int64_t>(p, config_.engram_max_ngram_size - 1);
  std::vector<int32_t> toks(st.tokens.end() - hist, st.tokens.end());
  toks.insert(toks.end(), upcoming.begin(), upcoming.end());
  std::vector<Step> plan;
  AppendChunks(p, static_cast<int64_t>(upcoming.size()), 0, config_.num_hidden_layers, &plan);
  return PrefetchPlan(plan, toks, p - hist);
}

Status Engine::PrefetchEngramReplay(std::span<const int32_t> tokens) {
  return PrefetchEngramReplay(tokens, config_.sliding_window);
}

Status Engine::PrefetchEngramReplay(std::span<const int32_t> tokens, int64_t replay_tokens) {
  KVTIER_RETURN_IF_ERROR(CheckTokens(tokens));
  if (replay_tokens < config_.sliding_window)
    return Status::InvalidArgument("engine: replay_tokens must be at least the sliding window");
  if (engram_hash_ == nullptr) return Status::Ok();
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t r = std::min<int64_t>(n, replay_tokens);
  std::vector<Step> plan;
  AppendChunks(n - r, r, 0, config_.num_hidden_layers, &plan);
  return PrefetchPlan(plan, tokens, 0);
}

void Engine::AppendChunks(int64_t p0, int64_t n, int l_begin, int l_end,
                          std::vector<Step>* plan) const {
  const int64_t chunk = options_.prefill_chunk_tokens;
  for (int64_t a = 0; a < n; a += chunk) {
    plan->push_back({p0 + a, static_cast<int>(std::min(chunk, n - a)), l_begin, l_end});
  }
}

Status Engine::ApplyEngram(int layer, const EngramRowBatch& batch, int n, float* x) {
  const EngineConfig& c = config_;
  const LayerWeights& lw = layers_[layer];
  const int slot = c.EngramSlot(layer);
  const int D = c.hidden_size, hc = c.hc_mult, ed = c.engram_head_dim;
  const int C = engram_hash_->num_columns();
  if (batch.data.size() != static_cast<size_t>(n) * C * ed ||
      batch.scales.size() != static_cast<size_t>(n) * C * (ed / 32))
    return Status::Internal("engine: engram rows of the wrong size");
  std::vector<float> emb(static_cast<size_t>(n) * C * ed);
  KVTIER_RETURN_IF_ERROR(kernels::Dequantize(QuantFormat::kFp8Ue8m0x32, batch.data.data(),
                                             batch.scales.data(), static_cast<size_t>(n) * C, ed,
                                             emb.data(), kQuantBackend));
  const int kvw = (hc + 1) * D;
  std::vector<float> kv(static_cast<size_t>(n) * kvw);
  MatMul(pool_.get(), emb.data(), n, C * ed, lw.e_wkv, kvw, kv.data());
  const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(D));
  std::vector<float> gates(static_cast<size_t>(n) * hc);
  pool_->ParallelFor(n, [&](int64_t b, int64_t e) {
    std::vector<float> tmp(D);
    for (int64_t t = b; t < e; ++t) {
      const float* kvt = kv.data() + t * kvw;
      const float* value = kvt + static_cast<int64_t>(hc) * D;
      for (int cp = 0; cp < hc; ++cp) {
        float* h = x + (t * hc + cp) * D;
        const float* key = kvt + static_cast<int64_t>(cp) * D;
        const float* qw = lw.e_qn + static_cast<int64_t>(cp) * D;
        const float* kw = lw.e_kn + static_cast<int64_t>(cp) * D;
        double sh = 0, sk = 0;
        for (int d = 0; d < D; ++d) {
          sh += static_cast<double>(h[d]) * h[d];
          sk += static_cast<double>(key[d]) * key[d];
          tmp[d] = h[d] * qw[d] * kw[d];
        }
        const float rh = static_cast<float>(1.0 / std::sqrt(sh / D + c.rms_norm_eps));
        const float rk = static_cast<float>(1.0 / std::sqrt(sk / D + c.rms_norm_eps));
        const float g = Dot(tmp.data(), key, D) * rh * rk * inv_sqrt_d;
        const float signed_sqrt = g >= 0 ? std::sqrt(g) : -std::sqrt(-g);
        const float gate = Sigmoid(signed_sqrt);
        gates[t * hc + cp] = gate;
        for (int d = 0; d < D; ++d) h[d] += gate * value[d];
      }
    }
  });
  if (trace_ != nullptr) {
    auto& g = trace_->engram_gates[slot];
    g.insert(g.end(), gates.begin(), gates.end());
  }
  return Status::Ok();
}

Status Engine::Compress(int layer, SequenceState* st, int64_t p0, int n, const float* xa) {
  const EngineConfig& c = config_;
  const LayerWeights& lw = layers_[layer];
  KvSourceCache* k = nullptr;
  for (KvSourceCache& kc : st->kv) {
    if (kc.layer == layer) k = &kc;
  }
  if (k == nullptr) return Status::Internal("engine: no cache for kv source");
  const int64_t first = std::max(p0, k->consumed);
  if (first >= p0 + n) return Status::Ok();  // already projected (CED replay, import)
  if (k->consumed < p0) return Status::Internal("engine: compressor input has a gap");
  const int D = c.hidden_size, hd = c.head_dim, id = c.index_head_dim, m = k->ratio;
  const int rd = c.qk_rope_head_dim;
  const int rows = static_cast<int>(p0 + n - first);
  const float* xin = xa + (first - p0) * D;
  std::vector<float> ckv(static_cast<size_t>(rows) * hd), cg;
  MatMul(pool_.get(), xin, rows, D, lw.c_wkv, hd, ckv.data());
  if (m > 1) {
    cg.resize(ckv.size());
    MatMul(pool_.get(), xin, rows, D, lw.c_wgate, hd, cg.data());
  }
  // Collect finished groups: latent (pre-RoPE, normalised) per entry.
  std::vector<float> latents;
  std::vector<int64_t> entry_ids;
  for (int r = 0; r < rows; ++r) {
    const int64_t p = first + r;
    const int slot = static_cast<int>(p % m);
    std::vector<float> lat(hd);
    if (m == 1) {
      std::memcpy(lat.data(), ckv.data() + static_cast<int64_t>(r) * hd, hd * 4);
    } else {
      std::memcpy(k->kv_state.data() + static_cast<int64_t>(slot) * hd,
                  ckv.data() + static_cast<int64_t>(r) * hd, hd * 4);
      std::memcpy(k->score_state.data() + static_cast<int64_t>(slot) * hd,
                  cg.data() + static_cast<int64_t>(r) * hd, hd * 4);
      if (slot != m - 1) continue;
      // Per-channel softmax over the m tokens of the group.
      for (int ch = 0; ch < hd; ++ch) {
        float mx = -INFINITY;
        for (int j = 0; j < m; ++j) mx = std::max(mx, k->score_state[j * hd + ch]);
        float den = 0, num = 0;
        for (int j = 0; j < m; ++j) {
          const float e = std::exp(k->score_state[j * hd + ch] - mx);
          den += e;
          num += e * k->kv_state[j * hd + ch];
        }
        lat[ch] = num / den;
      }
    }
    RmsNorm(lat.data(), lw.c_norm, hd, c.rms_norm_eps, lat.data());
    latents.insert(latents.end(), lat.begin(), lat.end());
    entry_ids.push_back(p / m);
  }
  k->consumed = p0 + n;
  const int ne = static_cast<int>(entry_ids.size());
  if (ne == 0) return Status::Ok();
  if (entry_ids[0] != k->entries())
    return Status::Internal("engine: compressed entry out of order");
  // Indexer keys from the pre-RoPE latent: k = k_norm(wk(latent)), RoPE, FP4 (ue8m0 / 32).
  std::vector<float> ik(static_cast<size_t>(ne) * id);
  MatMul(pool_.get(), latents.data(), ne, hd, lw.i_wk, id, ik.data());
  for (int e = 0; e < ne; ++e) {
    float* kk = ik.data() + static_cast<int64_t>(e) * id;
    LayerNorm(kk, lw.i_kn_w, lw.i_kn_b, id, c.rms_norm_eps, kk);
    ApplyRope(kk + id - rd, *lw.rope, entry_ids[e] * m, false);
    ApplyRope(latents.data() + static_cast<int64_t>(e) * hd + hd - rd, *lw.rope, entry_ids[e] * m,
              false);
  }
  auto append = [&](QuantFormat fmt, const std::vector<float>& v, int dim,
                    std::vector<uint8_t>* data, std::vector<uint8_t>* scales) -> Status {
    const size_t d0 = AppendKvBytes(data, ne * kernels::DataBytes(fmt, dim));
    const size_t s0 = AppendKvBytes(scales, ne * kernels::ScaleBytes(fmt, dim));
    return kernels::Quantize(fmt, v.data(), ne, dim, data->data() + d0, scales->data() + s0,
                             kQuantBackend);
  };
  KVTIER_RETURN_IF_ERROR(
      append(QuantFormat::kFp4E4M3x16, latents, hd, &k->main_data, &k->main_scales));
  KVTIER_RETURN_IF_ERROR(
      append(QuantFormat::kFp4Ue8m0x32, ik, id, &k->index_data, &k->index_scales));
  k->n_entries += ne;
  return Status::Ok();
}

Status Engine::SelectTopk(int layer, int64_t p0, int n, const float* qr, const float* xa,
                          Runtime* rt) {
  const EngineConfig& c = config_;
  const LayerWeights& lw = layers_[layer];
  const int IH = c.index_n_heads, id = c.index_head_dim, rd = c.qk_rope_head_dim;
  const KvSourceCache* src = rt->src;
  const int m = src->ratio;
  std::vector<float> iq(static_cast<size_t>(n) * IH * id), wts(static_cast<size_t>(n) * IH);
  MatMul(pool_.get(), qr, n, c.q_lora_rank, lw.i_wq_b, IH * id, iq.data());
  for (int t = 0; t < n; ++t) {
    for (int h = 0; h < IH; ++h) {
      ApplyRope(iq.data() + (static_cast<int64_t>(t) * IH + h) * id + id - rd, *lw.rope, p0 + t,
                false);
    }
  }
  // FP4 QAT of the index query (ue8m0 per 32), as the reference does.
  KVTIER_RETURN_IF_ERROR(kernels::RoundTrip(QuantFormat::kFp4Ue8m0x32, iq.data(),
                                            static_cast<size_t>(n) * IH, id, kQuantBackend));
  MatMul(pool_.get(), xa, n, c.hidden_size, lw.i_wproj, IH, wts.data());
  const float wscale = 1.0f / std::sqrt(static_cast<float>(id)) / std::sqrt(static_cast<float>(IH));
  const bool is_candidate_source = layer == c.candidate_source_layer_id;
  const bool restrict = c.layer_modes[layer] == LayerMode::kReindex &&
                        options_.use_candidate_pool && !rt->candidates.empty();
  rt->topk.assign(n, {});
  if (is_candidate_source) rt->candidates.assign(n, {});
  std::vector<int64_t> cand_visible(n, 0), cand_pool(n, 0);
  // Index keys are read as their FP4 bytes and dequantised (exactly) a block of rows at a
  // time; a Reindex layer reads and scores only the rows of its candidate pool.
  const QuantFormat ifmt = QuantFormat::kFp4Ue8m0x32;
  const size_t idb = kernels::DataBytes(ifmt, id), isb = kernels::ScaleBytes(ifmt, id);
  std::atomic<bool> failed{false};
  pool_->ParallelFor(n, [&](int64_t b, int64_t e) {
    std::vector<float> score, keys(static_cast<size_t>(kIndexRowsPerPass) * id);
    std::vector<int32_t> eligible;
    for (int64_t t = b; t < e; ++t) {
      const int64_t p = p0 + t;
      const int64_t nv = std::min<int64_t>((p + 1) / m, src->entries());
      if (nv <= 0) continue;
      score.assign(nv, 0.0f);
      const float* q = iq.data() + t * IH * id;
      const float* w = wts.data() + t * IH;
      eligible.clear();
      // Scores rows [j0, j1) (at most kIndexRowsPerPass), every head against each key.
      auto score_rows = [&](int64_t j0, int64_t j1) {
        if (!kernels::Dequantize(ifmt, src->index_data.data() + j0 * idb,
                                 src->index_scales.data() + j0 * isb, j1 - j0, id, keys.data(),
                                 kCacheReadBackend)
                 .ok()) {
          failed = true;
          return;
        }
        for (int64_t j = j0; j < j1; ++j) {
          const float* kj = keys.data() + (j - j0) * id;
          float s = 0;
          for (int h = 0; h < IH; ++h) {
            const float dot = Dot(q + static_cast<int64_t>(h) * id, kj, id);
            s += std::max(dot, 0.0f) * (w[h] * wscale);  // ReLU before the head weight
          }
          score[j] = s;
        }
      };
      const int bs = c.candidate_block_size;
      if (restrict) {
        const std::vector<uint8_t>& mask = rt->candidates[t];
        const int64_t nb = std::min<int64_t>((nv + bs - 1) / bs, mask.size());
        for (int64_t bi = 0; bi < nb; ++bi) {
          if (!mask[bi]) continue;
          const int64_t j1 = std::min<int64_t>(nv, (bi + 1) * bs);
          for (int64_t j0 = bi * bs; j0 < j1; j0 += kIndexRowsPerPass)
            score_rows(j0, std::min<int64_t>(j1, j0 + kIndexRowsPerPass));
          for (int64_t j = bi * bs; j < j1; ++j) eligible.push_back(static_cast<int32_t>(j));
        }
        rt->topk[t] = TopK(score, eligible, c.index_topk);
        continue;
      }
      for (int64_t j0 = 0; j0 < nv; j0 += kIndexRowsPerPass)
        score_rows(j0, std::min<int64_t>(nv, j0 + kIndexRowsPerPass));
      if (is_candidate_source) {
        const int64_t nb = (nv + bs - 1) / bs;
        std::vector<float> bscore(nb, -INFINITY);
        for (int64_t j = 0; j < nv; ++j) bscore[j / bs] = std::max(bscore[j / bs], score[j]);
        bscore[nb - 1] = INFINITY;  // the block holding the newest position is pinned
        std::vector<int32_t> blocks(nb);
        for (int64_t i = 0; i < nb; ++i) blocks[i] = static_cast<int32_t>(i);
        std::vector<int32_t> top = TopK(bscore, blocks, c.candidate_topk_blocks);
        std::vector<uint8_t> mask(nb, 0);
        int64_t pool_positions = 0;
        for (int32_t bi : top) {
          mask[bi] = 1;
          pool_positions += std::min<int64_t>(bs, nv - static_cast<int64_t>(bi) * bs);
        }
        rt->candidates[t] = std::move(mask);
        cand_visible[t] = nv;
        cand_pool[t] = pool_positions;
      }
      for (int64_t j = 0; j < nv; ++j) eligible.push_back(static_cast<int32_t>(j));
      rt->topk[t] = TopK(score, eligible, c.index_topk);
    }
  });
  if (failed) return Status::Internal("engine: index keys could not be dequantised");
  if (trace_ != nullptr && is_candidate_source) {  // appended chunk by chunk
    trace_->candidate_visible.insert(trace_->candidate_visible.end(), cand_visible.begin(),
                                     cand_visible.end());
    trace_->candidate_pool.insert(trace_->candidate_pool.end(), cand_pool.begin(), cand_pool.end());
  }
  return Status::Ok();
}

Status Engine::Attention(int layer, SequenceState* st, int64_t p0, int n, const float* xa,
                         Runtime* rt, float* out) {
  const EngineConfig& c = config_;
  const LayerWeights& lw = layers_[layer];
  const int D = c.hidden_size, H = c.num_attention_heads, hd = c.head_dim;
  const int rd = c.qk_rope_head_dim, W = c.sliding_window, ql = c.q_lora_rank;
  const LayerMode mode = c.layer_modes[layer];
  SwaRing& ring = st->swa[layer];
  if (ring.end != p0) {
    if (ring.valid_from < p0) return Status::Internal("engine: SWA ring has a gap");
    ring.end = p0;
  }

  std::vector<float> qr(static_cast<size_t>(n) * ql), q(static_cast<size_t>(n) * H * hd);
  MatMul(pool_.get(), xa, n, D, lw.wq_a, ql, qr.data());
  for (int t = 0; t < n; ++t) {
    RmsNorm(qr.data() + static_cast<int64_t>(t) * ql, lw.q_norm, ql, c.rms_norm_eps,
            qr.data() + static_cast<int64_t>(t) * ql);
  }
  MatMul(pool_.get(), qr.data(), n, ql, lw.wq_b, H * hd, q.data());
  for (int t = 0; t < n; ++t) {
    for (int h = 0; h < H; ++h) {
      ApplyRope(q.data() + (static_cast<int64_t>(t) * H + h) * hd + hd - rd, *lw.rope, p0 + t,
                false);
    }
  }
  // SWA entries of this batch: kv_norm(wkv x), RoPE, FP8 e4m3 + ue8m0/32.
  std::vector<float> kv(static_cast<size_t>(n) * hd);
  MatMul(pool_.get(), xa, n, D, lw.wkv, hd, kv.data());
  for (int t = 0; t < n; ++t) {
    float* kt = kv.data() + static_cast<int64_t>(t) * hd;
    RmsNorm(kt, lw.kv_norm, hd, c.rms_norm_eps, kt);
    ApplyRope(kt + hd - rd, *lw.rope, p0 + t, false);
  }
  std::vector<uint8_t> kv_data(static_cast<size_t>(n) * hd),
      kv_scales(static_cast<size_t>(n) * hd / 32);
  KVTIER_RETURN_IF_ERROR(kernels::Quantize(QuantFormat::kFp8Ue8m0x32, kv.data(), n, hd,
                                           kv_data.data(), kv_scales.data(), kQuantBackend));
  KVTIER_RETURN_IF_ERROR(kernels::Dequantize(QuantFormat::kFp8Ue8m0x32, kv_data.data(),
                                             kv_scales.data(), n, hd, kv.data(), kQuantBackend));

  // Compressed entries: sources write, then this layer (and later ones) read.
  if (mode != LayerMode::kSwaOnly) {
    if (mode == LayerMode::kFull) {
      KVTIER_RETURN_IF_ERROR(Compress(layer, st, p0, n, xa));
      for (KvSourceCache& k : st->kv) {
        if (k.layer == layer) rt->src = &k;
      }
      if (layer != c.candidate_source_layer_id) rt->candidates.clear();
    }
    if (rt->src == nullptr || rt->src->layer != c.kv_source_of_layer[layer])
      return Status::Internal("engine: shared runtime has no kv source for this layer");
    if (mode == LayerMode::kFull || mode == LayerMode::kReindex) {
      KVTIER_RETURN_IF_ERROR(SelectTopk(layer, p0, n, qr.data(), xa, rt));
    } else if (static_cast<int>(rt->topk.size()) != n) {
      return Status::Internal("engine: reuse layer without top-k");
    }
    if (trace_ != nullptr) {
      trace_->topk[layer].insert(trace_->topk[layer].end(), rt->topk.begin(), rt->topk.end());
    }
  }

  // Sparse attention over [selected compressed entries] + [SWA window], one latent as K and V.
  // Per query token the keys are gathered once (compressed entries dequantised from their FP4
  // bytes into a buffer, SWA keys read in place) and every head runs against them.
  std::vector<float> o(static_cast<size_t>(n) * H * hd);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const KvSourceCache* src = rt->src;
  const QuantFormat mfmt = QuantFormat::kFp4E4M3x16;
  const size_t mdb = kernels::DataBytes(mfmt, hd), msb = kernels::ScaleBytes(mfmt, hd);
  std::atomic<bool> failed{false};
  pool_->ParallelFor(n, [&](int64_t b, int64_t e) {
    std::vector<const float*> keys;
    std::vector<float> logit, latent;
    for (int64_t t = b; t < e; ++t) {
      const int64_t p = p0 + t;
      keys.clear();
      if (mode != LayerMode::kSwaOnly) {
        const std::vector<int32_t>& sel = rt->topk[t];
        latent.resize(sel.size() * hd);
        for (size_t i = 0; i < sel.size(); ++i) {
          const int64_t j = sel[i];
          if (!kernels::Dequantize(mfmt, src->main_data.data() + j * mdb,
                                   src->main_scales.data() + j * msb, 1, hd, latent.data() + i * hd,
                                   kCacheReadBackend)
                   .ok()) {
            failed = true;
            return;
          }
        }
        for (size_t i = 0; i < sel.size(); ++i) keys.push_back(latent.data() + i * hd);
      }
      const int64_t lo = std::max(ring.valid_from, p - W + 1);
      for (int64_t s = std::max<int64_t>(lo, 0); s <= p; ++s) {
        if (s >= p0) {
          keys.push_back(kv.data() + (s - p0) * hd);
        } else if (ring.Has(s)) {
          keys.push_back(ring.values.data() + (s % W) * hd);
        }
      }
      logit.resize(keys.size());
      for (int h = 0; h < H; ++h) {
        const float* qh = q.data() + (t * H + h) * hd;
        const float sink = lw.sink[h];
        float mx = sink;
        for (size_t i = 0; i < keys.size(); ++i) {
          logit[i] = Dot(qh, keys[i], hd) * scale;
          mx = std::max(mx, logit[i]);
        }
        float den = std::exp(sink - mx);
        for (size_t i = 0; i < keys.size(); ++i) {
          logit[i] = std::exp(logit[i] - mx);
          den += logit[i];
        }
        float* oh = o.data() + (t * H + h) * hd;
        for (int d = 0; d < hd; ++d) oh[d] = 0.0f;
        for (size_t i = 0; i < keys.size(); ++i) {
          Axpy(logit[i] / den, keys[i], hd, oh);
        }
        ApplyRope(oh + hd - rd, *lw.rope, p, true);  // inverse RoPE on the output
      }
    }
  });
  if (failed) return Status::Internal("engine: global KV entries could not be dequantised");

  // Grouped output projection: wo_a is block-diagonal over o_groups, then wo_b.
  const int G = c.o_groups, ol = c.o_lora_rank, gin = (H / G) * hd;
  std::vector<float> oa(static_cast<size_t>(n) * G * ol), tmp(static_cast<size_t>(n) * ol);
  std::vector<float> og(static_cast<size_t>(n) * gin);
  for (int g = 0; g < G; ++g) {
    for (int t = 0; t < n; ++t) {
      std::memcpy(og.data() + static_cast<int64_t>(t) * gin,
                  o.data() + static_cast<int64_t>(t) * H * hd + static_cast<int64_t>(g) * gin,
                  gin * 4);
    }
    MatMul(pool_.get(), og.data(), n, gin, lw.wo_a + static_cast<int64_t>(g) * ol * gin, ol,
           tmp.data());
    for (int t = 0; t < n; ++t) {
      std::memcpy(oa.data() + (static_cast<int64_t>(t) * G + g) * ol,
                  tmp.data() + static_cast<int64_t>(t) * ol, ol * 4);
    }
  }
  MatMul(pool_.get(), oa.data(), n, G * ol, lw.wo_b, D, out);

  // Push this batch's SWA entries into the ring.
  const int sb = hd / 32;
  for (int64_t p = std::max<int64_t>(p0, p0 + n - W); p < p0 + n; ++p) {
    const int64_t slot = p % W, t = p - p0;
    std::memcpy(ring.values.data() + slot * hd, kv.data() + t * hd, hd * 4);
    std::memcpy(ring.data.data() + slot * hd, kv_data.data() + t * hd, hd);
    std::memcpy(ring.scales.data() + slot * sb, kv_scales.data() + t * sb, sb);
  }
  ring.end = p0 + n;
  return Status::Ok();
}

void Engine::Moe(int layer, int n, const float* xn, float* out) {
  const EngineConfig& c = config_;
  const LayerWeights& lw = layers_[layer];
  const int D = c.hidden_size, E = c.n_routed_experts, K = c.num_experts_per_tok;
  const int I = c.moe_intermediate_size;
  const float limit = static_cast<float>(c.swiglu_limit);
  std::vector<float> logits(static_cast<size_t>(n) * E);
  MatMul(pool_.get(), xn, n, D, lw.gate, E, logits.data());
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
    MatMul(pool, x, rows, D, w1, inter, g.data());
    MatMul(pool, x, rows, D, w3, inter, u.data());
    for (int r = 0; r < rows; ++r) {
      for (int i = 0; i < inter; ++i) {
        const size_t k = static_cast<size_t>(r) * inter + i;
        const float gi = std::min(g[k], limit);
        const float ui = std::clamp(u[k], -limit, limit);
        g[k] = Silu(gi) * ui;
        if (row_weight) g[k] *= row_weight[r];  // router weight before w2
      }
    }
    MatMul(pool, g.data(), rows, inter, w2, D, y);
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

Status Engine::RunLayers(SequenceState* st, const std::vector<Step>& plan, size_t step, float* x,
                         float* pre) {
  const EngineConfig& c = config_;
  const int D = c.hidden_size, hc = c.hc_mult;
  const int64_t p0 = plan[step].p0;
  const int n = plan[step].n, l_begin = plan[step].l_begin, l_end = plan[step].l_end;
  Runtime rt;
  std::vector<float> xn(static_cast<size_t>(n) * D), f(static_cast<size_t>(n) * D);
  std::vector<float> post(static_cast<size_t>(n) * hc), comb(static_cast<size_t>(n) * hc * hc),
      next_pre(static_cast<size_t>(n) * hc);
  // Prefetch: this step's Engram rows (unless already requested) and the lookahead's are
  // requested before the first layer runs; each Engram layer waits just before it.
  std::vector<EngramPending*> claimed;
  KVTIER_RETURN_IF_ERROR(BeginEngramStep(*st, plan, step, &claimed));
  for (int l = l_begin; l < l_end; ++l) {
    const LayerWeights& lw = layers_[l];
    if (c.IsEngramLayer(l)) {
      EngramRowBatch rows;
      KVTIER_RETURN_IF_ERROR(TakeEngram(l, claimed[c.EngramSlot(l)], p0, n, &rows));
      KVTIER_RETURN_IF_ERROR(ApplyEngram(l, rows, n, x));
    }
    for (int s = 0; s < 2; ++s) {
      PreMix(n, x, pre, s == 0 ? lw.attn_norm : lw.ffn_norm, xn.data());
      if (s == 0 && capture_ != nullptr) capture_->Record(l, p0, n, hc, D, x, xn.data());
      pool_->ParallelFor(n, [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) {
          HcMixes(x + t * hc * D, hc, D, lw.hc_fn[s], lw.hc_scale[s], lw.hc_base[s],
                  c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps, next_pre.data() + t * hc,
                  post.data() + t * hc, comb.data() + t * hc * hc);
        }
      });
      if (trace_ != nullptr) {
        auto& tc = trace_->comb[2 * l + s];  // appended chunk by chunk
        for (int t = 0; t < n; ++t) {
          tc.emplace_back(comb.begin() + static_cast<int64_t>(t) * hc * hc,
                          comb.begin() + static_cast<int64_t>(t + 1) * hc * hc);
        }
      }
      if (s == 0) {
        KVTIER_RETURN_IF_ERROR(Attention(l, st, p0, n, xn.data(), &rt, f.data()));
      } else {
        Moe(l, n, xn.data(), f.data());
      }
      MixSublayer(n, x, f.data(), post.data(), comb.data());
      std::memcpy(pre, next_pre.data(), next_pre.size() * 4);  // single-pass: pre for next
    }
  }
  return Status::Ok();
}

int AttnInputCapture::Slot(int layer) const {
  for (size_t i = 0; i < layers.size(); ++i) {
    if (layers[i] == layer) return static_cast<int>(i);
  }
  return -1;
}

void AttnInputCapture::Clear() {
  first_pos.assign(layers.size(), -1);
  stream_mean.assign(layers.size(), {});
  normed.assign(layers.size(), {});
}

void AttnInputCapture::Record(int layer, int64_t p0, int n, int hc, int dim, const float* x,
                              const float* xa) {
  const int i = Slot(layer);
  if (i < 0 || p0 + n <= from_pos) return;
  if (p0 < from_pos) {  // the call's tail only
    const int skip = static_cast<int>(from_pos - p0);
    x += static_cast<int64_t>(skip) * hc * dim;
    xa += static_cast<int64_t>(skip) * dim;
    p0 = from_pos;
    n -= skip;
  }
  if (first_pos[i] < 0) first_pos[i] = p0;
  std::vector<float>& m = stream_mean[i];
  const size_t m0 = m.size();
  m.resize(m0 + static_cast<size_t>(n) * dim);
  for (int t = 0; t < n; ++t) {
    float* y = m.data() + m0 + static_cast<size_t>(t) * dim;
    for (int d = 0; d < dim; ++d) {
      float acc = 0.0f;
      for (int c = 0; c < hc; ++c) acc += x[(static_cast<int64_t>(t) * hc + c) * dim + d];
      y[d] = acc / static_cast<float>(hc);
    }
  }
  normed[i].insert(normed[i].end(), xa, xa + static_cast<size_t>(n) * dim);
}

void Engine::ResetTrace() {
  if (capture_ != nullptr) capture_->Clear();
  if (trace_ == nullptr) return;
  const int L = config_.num_hidden_layers;
  trace_->candidate_visible.clear();
  trace_->candidate_pool.clear();
  trace_->topk.assign(L, {});
  trace_->comb.assign(2 * L, {});
  trace_->expert_tokens.assign(L, std::vector<int64_t>(config_.n_routed_experts, 0));
  trace_->engram_gates.assign(config_.engram_layer_ids.size(), {});
}

void Engine::Head(int n, const float* x, const float* pre, float* logits) {
  const int D = config_.hidden_size;
  std::vector<float> y(static_cast<size_t>(n) * D);
  PreMix(n, x, pre, weights_->F32("norm.weight"), y.data());
  MatMul(pool_.get(), y.data(), n, D, weights_->F32("head.weight"), config_.vocab_size, logits);
}

Status Engine::Forward(SequenceState* st, std::span<const int32_t> tokens, bool all_logits,
                       std::vector<float>* logits) {
  KVTIER_RETURN_IF_ERROR(CheckTokens(tokens));
  KVTIER_RETURN_IF_ERROR(CheckExtendable(*st));
  const EngineConfig& c = config_;
  const int n = static_cast<int>(tokens.size());
  const int D = c.hidden_size, hc = c.hc_mult, V = c.vocab_size;
  const int64_t p0 = static_cast<int64_t>(st->tokens.size());
  ResetTrace();
  st->tokens.insert(st->tokens.end(), tokens.begin(), tokens.end());
  std::vector<Step> plan;
  AppendChunks(p0, n, 0, c.num_hidden_layers, &plan);
  const int first = all_logits ? 0 : n - 1;
  std::vector<float> out(static_cast<size_t>(n - first) * V);  // *logits only on success
  const int cmax = std::min(n, options_.prefill_chunk_tokens);
  std::vector<float> x(static_cast<size_t>(cmax) * hc * D), pre(static_cast<size_t>(cmax) * hc);
  for (size_t i = 0; i < plan.size(); ++i) {
    const int a = static_cast<int>(plan[i].p0 - p0), cn = plan[i].n;
    Embed(tokens.subspan(a, cn), x.data(), pre.data());
    Status s = RunLayers(st, plan, i, x.data(), pre.data());
    if (!s.ok()) return s;              // the state is now unusable; the caller must discard it
    const int lo = std::max(a, first);  // this chunk's rows that want logits
    if (lo < a + cn) {
      Head(a + cn - lo, x.data() + static_cast<int64_t>(lo - a) * hc * D,
           pre.data() + static_cast<int64_t>(lo - a) * hc,
           out.data() + static_cast<int64_t>(lo - first) * V);
    }
  }
  *logits = std::move(out);
  return Status::Ok();
}

Status Engine::Decode(SequenceState* st, int32_t token, std::vector<float>* logits) {
  return Forward(st, std::span<const int32_t>(&token, 1), false, logits);
}

Status Engine::PrefillCed(SequenceState* st, std::span<const int32_t> tokens,
                          std::vector<float>* last_logits) {
  KVTIER_RETURN_IF_ERROR(CheckTokens(tokens));
  KVTIER_RETURN_IF_ERROR(CheckExtendable(*st));
  if (!st->tokens.empty())
    return Status::InvalidArgument("engine: CED prefill needs an empty state");
  return ExtendCed(st, tokens, last_logits);
}

Status Engine::ExtendCed(SequenceState* st, std::span<const int32_t> tokens,
                         std::vector<float>* last_logits) {
  KVTIER_RETURN_IF_ERROR(CheckTokens(tokens));
  KVTIER_RETURN_IF_ERROR(CheckExtendable(*st));
  const EngineConfig& c = config_;
  const int d = c.first_decoder_layer, L = c.num_hidden_layers;
  if (c.layer_modes[d] != LayerMode::kFull)
    return Status::InvalidArgument("engine: CED needs a kv source at the first decoder layer");
  for (int l = d + 1; l < L; ++l) {
    if (c.IsKvSource(l)) return Status::InvalidArgument("engine: CED needs one decoder kv source");
  }
  ResetTrace();
  const int n = static_cast<int>(tokens.size());
  const int64_t n0 = static_cast<int64_t>(st->tokens.size());
  const int D = c.hidden_size, hc = c.hc_mult;
  const int R = std::min(n, c.sliding_window);
  const int64_t start = n0 + n - R;
  st->tokens.insert(st->tokens.end(), tokens.begin(), tokens.end());
  // The plan: (1) the encoder [0, d) over every new token, (2) layer d's hc_pre -> Engram ->
  // attn_norm -> Compressor over every new token, (3) the decoder [d, L) over the last R of
  // them; each phase chunk by chunk. The lookahead runs across phases (the tokens are all
  // known), so Engram rows of the decoder's layers are prefetched while the encoder computes.
  std::vector<Step> plan;
  AppendChunks(n0, n, 0, d, &plan);
  const size_t compress_begin = plan.size();
  AppendChunks(n0, n, d, d + 1, &plan);
  const size_t tail_begin = plan.size();
  AppendChunks(start, R, d, L, &plan);
  std::vector<float> x(static_cast<size_t>(n) * hc * D), pre(static_cast<size_t>(n) * hc);
  Embed(tokens, x.data(), pre.data());
  auto xs = [&](int64_t p) { return x.data() + (p - n0) * hc * D; };
  auto pres = [&](int64_t p) { return pre.data() + (p - n0) * hc; };
  // 1. The encoder over every token.
  for (size_t i = 0; i < compress_begin; ++i) {
    KVTIER_RETURN_IF_ERROR(RunLayers(st, plan, i, xs(plan[i].p0), pres(plan[i].p0)));
  }
  // 2. The decoder source's global KV for every token: hc_pre -> attn_norm -> Compressor.
  for (size_t i = compress_begin; i < tail_begin; ++i) {
    const int64_t p0 = plan[i].p0;
    const int cn = plan[i].n;
    std::vector<EngramPending*> claimed;
    KVTIER_RETURN_IF_ERROR(BeginEngramStep(*st, plan, i, &claimed));
    std::vector<float> xd(xs(p0), xs(p0 + cn));
    if (c.IsEngramLayer(d)) {
      EngramRowBatch rows;
      KVTIER_RETURN_IF_ERROR(TakeEngram(d, claimed[c.EngramSlot(d)], p0, cn, &rows));
      KVTIER_RETURN_IF_ERROR(ApplyEngram(d, rows, cn, xd.data()));
    }
    std::vector<float> xa(static_cast<size_t>(cn) * D);
    PreMix(cn, xd.data(), pres(p0), layers_[d].attn_norm, xa.data());
    KVTIER_RETURN_IF_ERROR(Compress(d, st, p0, cn, xa.data()));
  }
  // The trace keeps layer d's Engram gates of the decoder pass (3) only.
  if (trace_ != nullptr && c.IsEngramLayer(d)) trace_->engram_gates[c.EngramSlot(d)].clear();
  // 3. The full decoder over the last R = min(W, n) new tokens. When it skips some (start >
  // n0) its rings restart at `start` (bounded replay); otherwise they continue.
  if (start > n0 || n0 == 0) {
    for (int l = d; l < L; ++l) {
      st->swa[l].valid_from = start;
      st->swa[l].end = start;
    }
  }
  for (size_t i = tail_begin; i < plan.size(); ++i) {
    KVTIER_RETURN_IF_ERROR(RunLayers(st, plan, i, xs(plan[i].p0), pres(plan[i].p0)));
  }
  last_logits->assign(c.vocab_size, 0.0f);
  Head(1, x.data() + static_cast<int64_t>(n - 1) * hc * D,
       pre.data() + static_cast<int64_t>(n - 1) * hc, last_logits->data());
  return Status::Ok();
}

Status Engine::ReplayTail(SequenceState* st, std::vector<float>* last_logits) {
  return ReplayTail(st, config_.sliding_window, last_logits);
}

Status Engine::ReplayTail(SequenceState* st, int64_t replay_tokens,
                          std::vector<float>* last_logits) {
  const EngineConfig& c = config_;
  const int64_t n = static_cast<int64_t>(st->tokens.size());
  if (n == 0) return Status::InvalidArgument("engine: nothing to replay");
  if (replay_tokens < c.sliding_window)
    return Status::InvalidArgument("engine: replay_tokens must be at least the sliding window");
  for (const KvSourceCache& k : st->kv) {
    if (k.consumed != n)
      return Status::InvalidArgument("engine: global KV does not cover the tokens");
  }
  if (std::min<int64_t>(n, replay_tokens) > static_cast<int64_t>(kMaxTokensPerCall))
    return Status::InvalidArgument("engine: more than kMaxTokensPerCall tokens to replay");
  const int R = static_cast<int>(std::min<int64_t>(n, replay_tokens));
  const int64_t start = n - R;
  for (SwaRing& r : st->swa) {
    r.valid_from = start;
    r.end = start;
  }
  ResetTrace();
  const int D = c.hidden_size, hc = c.hc_mult;
  std::span<const int32_t> tail(st->tokens.data() + start, R);
  std::vector<float> x(static_cast<size_t>(R) * hc * D), pre(static_cast<size_t>(R) * hc);
  Embed(tail, x.data(), pre.data());
  std::vector<Step> plan;
  AppendChunks(start, R, 0, c.num_hidden_layers, &plan);
  for (size_t i = 0; i < plan.size(); ++i) {
    const int64_t a = plan[i].p0 - start;
    KVTIER_RETURN_IF_ERROR(RunLayers(st, plan, i, x.data() + a * hc * D, pre.data() + a * hc));
  }
  last_logits->assign(c.vocab_size, 0.0f);
  Head(1, x.data() + static_cast<int64_t>(R - 1) * hc * D,
       pre.data() + static_cast<int64_t>(R - 1) * hc, last_logits->data());
  return Status::Ok();
}

// Continuous batching (model.h). Added beside Forward rather than folded into RunLayers so
// that the single-sequence path stays as it is.
Status Engine::ForwardBatch(std::span<SequenceState* const> states,
                            std::span<const std::span<const int32_t>> tokens,
                            std::vector<std::vector<float>>* last_logits,
                            std::vector<std::vector<float>>* all_logits,
                            std::span<AttnInputCapture* const> captures) {
  const size_t k = states.size();
  if (k == 0 || tokens.size() != k)
    return Status::InvalidArgument("engine: ForwardBatch needs one token span per state");
  if (!captures.empty() && captures.size() != k)
    return Status::InvalidArgument("engine: ForwardBatch needs no capture or one per state");
  const EngineConfig& c = config_;
  const int D = c.hidden_size, hc = c.hc_mult, V = c.vocab_size, L = c.num_hidden_layers;
  std::vector<int64_t> off(k + 1, 0), p0(k);
  for (size_t i = 0; i < k; ++i) {
    KVTIER_RETURN_IF_ERROR(CheckTokens(tokens[i]));
    if (tokens[i].size() > static_cast<size_t>(options_.prefill_chunk_tokens))
      return Status::InvalidArgument("engine: ForwardBatch span over prefill_chunk_tokens");
    if (states[i] == nullptr) return Status::InvalidArgument("engine: null state");
    KVTIER_RETURN_IF_ERROR(CheckExtendable(*states[i]));
    for (size_t j = 0; j < i; ++j) {
      if (states[j] == states[i]) return Status::InvalidArgument("engine: a state twice");
    }
    off[i + 1] = off[i] + static_cast<int64_t>(tokens[i].size());
  }
  const int64_t total = off[k];
  if (total > static_cast<int64_t>(kMaxTokensPerCall))
    return Status::InvalidArgument("engine: more than kMaxTokensPerCall tokens in one call");
  ResetTrace();
  for (AttnInputCapture* cap : captures) {
    if (cap != nullptr) cap->Clear();
  }
  std::vector<float> x(static_cast<size_t>(total) * hc * D), pre(static_cast<size_t>(total) * hc);
  for (size_t i = 0; i < k; ++i) {
    p0[i] = static_cast<int64_t>(states[i]->tokens.size());
    states[i]->tokens.insert(states[i]->tokens.end(), tokens[i].begin(), tokens[i].end());
    Embed(tokens[i], x.data() + off[i] * hc * D, pre.data() + off[i] * hc);
  }
  const int n = static_cast<int>(total);
  std::vector<Runtime> rt(k);
  std::vector<float> xn(static_cast<size_t>(n) * D), f(static_cast<size_t>(n) * D);
  std::vector<float> post(static_cast<size_t>(n) * hc), comb(static_cast<size_t>(n) * hc * hc),
      next_pre(static_cast<size_t>(n) * hc);
  for (int l = 0; l < L; ++l) {
    const LayerWeights& lw = layers_[l];
    if (c.IsEngramLayer(l)) {
      // Per sequence, claimed and taken before the next sequence's rows are requested, so the
      // position-keyed Engram queue never holds two sequences' claims at once.
      for (size_t i = 0; i < k; ++i) {
        const int ni = static_cast<int>(off[i + 1] - off[i]);
        const std::vector<Step> one = {Step{p0[i], ni, l, l + 1}};
        std::vector<EngramPending*> claimed;
        KVTIER_RETURN_IF_ERROR(BeginEngramStep(*states[i], one, 0, &claimed));
        EngramRowBatch rows;
        KVTIER_RETURN_IF_ERROR(TakeEngram(l, claimed[c.EngramSlot(l)], p0[i], ni, &rows));
        KVTIER_RETURN_IF_ERROR(ApplyEngram(l, rows, ni, x.data() + off[i] * hc * D));
      }
    }
    for (int s = 0; s < 2; ++s) {
      PreMix(n, x.data(), pre.data(), s == 0 ? lw.attn_norm : lw.ffn_norm, xn.data());
      for (size_t i = 0; s == 0 && i < captures.size(); ++i) {
        if (captures[i] != nullptr)
          captures[i]->Record(l, p0[i], static_cast<int>(off[i + 1] - off[i]), hc, D,
                              x.data() + off[i] * hc * D, xn.data() + off[i] * D);
      }
      pool_->ParallelFor(n, [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) {
          HcMixes(x.data() + t * hc * D, hc, D, lw.hc_fn[s], lw.hc_scale[s], lw.hc_base[s],
                  c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps, next_pre.data() + t * hc,
                  post.data() + t * hc, comb.data() + t * hc * hc);
        }
      });
      if (trace_ != nullptr) {
        auto& tc = trace_->comb[2 * l + s];
        for (int t = 0; t < n; ++t) {
          tc.emplace_back(comb.begin() + static_cast<int64_t>(t) * hc * hc,
                          comb.begin() + static_cast<int64_t>(t + 1) * hc * hc);
        }
      }
      if (s == 0) {
        for (size_t i = 0; i < k; ++i) {
          KVTIER_RETURN_IF_ERROR(Attention(l, states[i], p0[i],
                                           static_cast<int>(off[i + 1] - off[i]),
                                           xn.data() + off[i] * D, &rt[i], f.data() + off[i] * D));
        }
      } else {
        Moe(l, n, xn.data(), f.data());
      }
      MixSublayer(n, x.data(), f.data(), post.data(), comb.data());
      std::memcpy(pre.data(), next_pre.data(), next_pre.size() * 4);
    }
  }
  if (all_logits != nullptr) {  // the head over every row; the last rows are among them
    std::vector<float> out(static_cast<size_t>(n) * V);
    Head(n, x.data(), pre.data(), out.data());
    all_logits->resize(k);
    last_logits->resize(k);
    for (size_t i = 0; i < k; ++i) {
      (*all_logits)[i].assign(out.begin() + off[i] * V, out.begin() + off[i + 1] * V);
      (*last_logits)[i].assign(out.begin() + (off[i + 1] - 1) * V, out.begin() + off[i + 1] * V);
    }
    return Status::Ok();
  }
  // The head over each sequence's last row only.
  std::vector<float> xl(k * hc * D), pl(k * hc), out(k * V);
  for (size_t i = 0; i < k; ++i) {
    const int64_t r = off[i + 1] - 1;
    std::memcpy(xl.data() + i * hc * D, x.data() + r * hc * D, static_cast<size_t>(hc) * D * 4);
    std::memcpy(pl.data() + i * hc, pre.data() + r * hc, static_cast<size_t>(hc) * 4);
  }
  Head(static_cast<int>(k), xl.data(), pl.data(), out.data());
  last_logits->resize(k);
  for (size_t i = 0; i < k; ++i)
    (*last_logits)[i].assign(out.begin() + i * V, out.begin() + (i + 1) * V);
  return Status::Ok();
}

}  // namespace kvtier::engine
