// Engine: construction and binding, the passes over the layers (Forward, CED, replay), the mHC
// mixes around each sublayer and the head. Attention, MoE, Engram and ForwardBatch live in the
// model_*.cc files beside it (model_internal.h).
#include "engine/model.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#include "engine/model_internal.h"
#include "engine/scratch.h"
#include "kernels/quant.h"

namespace kvtier::engine {

namespace {
using model_detail::QuantFormat;
}  // namespace

size_t AppendKvBytes(std::vector<uint8_t>* v, size_t bytes) {
  const size_t old = v->size(), need = old + bytes;
  if (need > v->capacity()) v->reserve(std::max(need, old / kKvGrowthDen * kKvGrowthNum));
  v->resize(need);
  return old;
}

void ReserveKvTokens(SequenceState* st, int64_t tokens) {
  for (KvSourceCache& k : st->kv) {
    const size_t entries = static_cast<size_t>(std::max<int64_t>(tokens, 0) / std::max(k.ratio, 1));
    auto reserve = [entries](std::vector<uint8_t>* v, size_t entry_bytes) {
      v->reserve(entries * entry_bytes);  // no-op when the capacity is already there
    };
    reserve(&k.main_data, kernels::DataBytes(QuantFormat::kFp4E4M3x16, k.head_dim));
    reserve(&k.main_scales, kernels::ScaleBytes(QuantFormat::kFp4E4M3x16, k.head_dim));
    reserve(&k.index_data, kernels::DataBytes(QuantFormat::kFp4Ue8m0x32, k.index_dim));
    reserve(&k.index_scales, kernels::ScaleBytes(QuantFormat::kFp4Ue8m0x32, k.index_dim));
  }
}

void ShrinkKvToFit(SequenceState* st) {
  for (KvSourceCache& k : st->kv) {
    for (std::vector<uint8_t>* v : {&k.main_data, &k.main_scales, &k.index_data, &k.index_scales})
      v->shrink_to_fit();
  }
}

uint64_t NextHistoryNumber() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

void KvSourceCache::Truncate(int64_t e) {
  const size_t n = static_cast<size_t>(std::min(e, n_entries));
  if (static_cast<int64_t>(n) < n_entries) {  // a new history, the old one's first n entries kept
    parent_keep = static_cast<int64_t>(n);
    parent_epoch = epoch.value();
    epoch.Renew();
  }
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
    m.fixed_bytes += r.values.capacity() * sizeof(float) + r.data.capacity() + r.scales.capacity() +
                     r.stamps.capacity() * sizeof(uint64_t);
  }
  return m;
}

Engine::Engine(const EngineConfig& config, std::shared_ptr<const ModelWeights> weights,
               const EngineOptions& options)
    : config_(config), weights_(std::move(weights)), options_(options) {}

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
  if (options.prompt_piece_tokens != static_cast<int>(kMaxTokensPerCall) &&
      (options.prompt_piece_tokens <= c.sliding_window ||
       static_cast<size_t>(options.prompt_piece_tokens) > kMaxTokensPerCall))
    return Status::InvalidArgument(
        "engine: prompt_piece_tokens must be more than sliding_window and at most "
        "kMaxTokensPerCall");
  KVTIER_RETURN_IF_ERROR(CheckWeights(c, weights->file));
  std::unique_ptr<Engine> e(new Engine(c, std::move(weights), options));
  e->pool_ = std::make_unique<ThreadPool>(options.threads);
  KVTIER_RETURN_IF_ERROR(e->Bind());
  KVTIER_RETURN_IF_ERROR(e->BindDevice());
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

  embed_w_ = w.F32("embed.weight");
  norm_w_ = w.F32("norm.weight");
  head_w_ = w.F32("head.weight");
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
  KVTIER_ASSIGN_OR_RETURN(const CodedFormats coded, RoundCodedWeights());
  PackMatMulWeights(coded);
  return Status::Ok();
}

void Engine::Mm(ThreadPool* pool, const float* x, int rows, int in, const float* w,
                const PackedMatrix* pw, int out, float* y) const {
  MatMul(pool, x, rows, in, w, pw, out, y);
}

void Engine::MmMany(ThreadPool* pool, std::span<MatMulPart> parts) const {
  MatMulMany(pool, parts.data(), static_cast<int>(parts.size()));
}

StatusOr<Engine::CodedFormats> Engine::RoundCodedWeights() {
  const EngineConfig& c = config_;
  const int64_t D = c.hidden_size, I = c.moe_intermediate_size, Is = I * c.n_shared_experts;
  const int64_t H = c.num_attention_heads, hd = c.head_dim, ql = c.q_lora_rank;
  const int64_t Go = static_cast<int64_t>(c.o_groups) * c.o_lora_rank;
  // Each matrix to round: where its pointer is, its rows (outputs) and inputs, its format.
  struct Matrix {
    const float** w;
    int64_t rows, inputs;
    PackedFormat format;
  };
  std::vector<Matrix> to_round;
  for (LayerWeights& lw : layers_) {
    if (c.expert_format == ExpertFormat::kMxfp4) {
      constexpr auto f = PackedFormat::kMxfp4;
      for (size_t e = 0; e < lw.w1.size(); ++e) {
        to_round.push_back({&lw.w1[e], I, D, f});
        to_round.push_back({&lw.w3[e], I, D, f});
        to_round.push_back({&lw.w2[e], D, I, f});
      }
    }
    if (c.weight_format == WeightFormat::kFp8) {
      constexpr auto f = PackedFormat::kFp8;
      to_round.push_back({&lw.wq_a, ql, D, f});
      to_round.push_back({&lw.wq_b, H * hd, ql, f});
      to_round.push_back({&lw.wkv, hd, D, f});
      to_round.push_back({&lw.wo_b, D, Go, f});
      if (lw.s_w1 != nullptr) {
        to_round.push_back({&lw.s_w1, Is, D, f});
        to_round.push_back({&lw.s_w3, Is, D, f});
        to_round.push_back({&lw.s_w2, D, Is, f});
      }
      if (lw.e_wkv != nullptr) {
        to_round.push_back({&lw.e_wkv, (c.hc_mult + 1) * D,
                            static_cast<int64_t>(engram_hash_->num_columns()) * c.engram_head_dim,
                            f});
      }
    }
  }
  int64_t total = 0;
  for (const Matrix& m : to_round) {
    if (*m.w == nullptr) return Status::InvalidArgument("engine: a weight to round is missing");
    total += m.rows * m.inputs;
  }
  coded_values_.resize(static_cast<size_t>(total));
  CodedFormats formats;
  float* next = coded_values_.data();
  for (const Matrix& m : to_round) {  // copy, round each row's blocks of 32, repoint
    std::memcpy(next, *m.w, static_cast<size_t>(m.rows * m.inputs) * sizeof(float));
    KVTIER_RETURN_IF_ERROR(
        kernels::RoundTrip(CodedQuantFormat(m.format), next, static_cast<size_t>(m.rows),
                           static_cast<size_t>(m.inputs), kernels::Backend::kAuto));
    *m.w = next;
    formats[next] = m.format;
    next += m.rows * m.inputs;
  }
  return formats;
}

void Engine::PackMatMulWeights(const CodedFormats& coded) {
  const EngineConfig& c = config_;
  const int D = c.hidden_size, hd = c.head_dim, ql = c.q_lora_rank, H = c.num_attention_heads;
  const int G = c.o_groups, ol = c.o_lora_rank, gin = (H / G) * hd, I = c.moe_intermediate_size;
  // The copy of (w, in, out), or null (absent matrix, scalar kernel). A rounded matrix is packed
  // as its codes (a copy holds kF32 where that is not exact).
  auto pack = [&](const float* w, int in, int out) {
    const auto it = coded.find(w);
    packed_.Add(w, in, out, it == coded.end() ? PackedFormat::kF32 : it->second);
    return packed_.Find(w, in, out);
  };
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    LayerWeights& lw = layers_[l];
    lw.pk_wq_a = pack(lw.wq_a, D, ql);
    lw.pk_wq_b = pack(lw.wq_b, ql, H * hd);
    lw.pk_wkv = pack(lw.wkv, D, hd);
    lw.pk_wo_a.resize(G);
    for (int g = 0; g < G; ++g)
      lw.pk_wo_a[g] = pack(lw.wo_a + static_cast<int64_t>(g) * ol * gin, gin, ol);
    lw.pk_wo_b = pack(lw.wo_b, G * ol, D);
    lw.pk_c_wkv = pack(lw.c_wkv, D, hd);
    lw.pk_c_wgate = pack(lw.c_wgate, D, hd);
    lw.pk_i_wk = pack(lw.i_wk, hd, c.index_head_dim);
    lw.pk_i_wq_b = pack(lw.i_wq_b, ql, c.index_n_heads * c.index_head_dim);
    lw.pk_i_wproj = pack(lw.i_wproj, D, c.index_n_heads);
    lw.pk_gate = pack(lw.gate, D, c.n_routed_experts);
    lw.pk_w1.resize(lw.w1.size());
    lw.pk_w2.resize(lw.w1.size());
    lw.pk_w3.resize(lw.w1.size());
    for (size_t e = 0; e < lw.w1.size(); ++e) {
      lw.pk_w1[e] = pack(lw.w1[e], D, I);
      lw.pk_w3[e] = pack(lw.w3[e], D, I);
      lw.pk_w2[e] = pack(lw.w2[e], I, D);
    }
    lw.pk_s_w1 = pack(lw.s_w1, D, I * c.n_shared_experts);
    lw.pk_s_w3 = pack(lw.s_w3, D, I * c.n_shared_experts);
    lw.pk_s_w2 = pack(lw.s_w2, I * c.n_shared_experts, D);
    if (lw.e_wkv != nullptr) {
      lw.pk_e_wkv =
          pack(lw.e_wkv, engram_hash_->num_columns() * c.engram_head_dim, (c.hc_mult + 1) * D);
    }
  }
  head_pk_ = pack(head_w_, D, c.vocab_size);
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
    r.stamps.assign(static_cast<size_t>(r.window), 0);
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

Status Engine::CheckTokens(std::span<const int32_t> tokens, size_t tokens_max) const {
  if (tokens.empty()) return Status::InvalidArgument("engine: no tokens");
  if (tokens.size() > tokens_max) {
    return Status::InvalidArgument(tokens_max == kMaxTokensPerCall
                                       ? "engine: more than kMaxTokensPerCall tokens in one call"
                                       : "engine: more than kMaxPromptTokens tokens in one call");
  }
  for (int32_t t : tokens) {
    if (t < 0 || t >= config_.vocab_size)
      return Status::InvalidArgument("engine: token id outside the vocabulary");
  }
  return Status::Ok();
}

bool Engine::RingOfThisEngine(const SwaRing& r) const {
  const size_t W = static_cast<size_t>(config_.sliding_window), hd = config_.head_dim;
  return r.window == config_.sliding_window && r.dim == config_.head_dim &&
         r.values.size() == W * hd && r.data.size() == W * hd && r.scales.size() == W * hd / 32 &&
         r.stamps.size() == W;
}

Status Engine::CheckExtendable(const SequenceState& st) const {
  const int64_t n = static_cast<int64_t>(st.tokens.size());
  if (static_cast<int>(st.swa.size()) != config_.num_hidden_layers ||
      st.kv.size() != config_.kv_source_layer_ids.size())
    return Status::InvalidArgument("engine: state was not made by this engine");
  for (const SwaRing& r : st.swa) {
    if (!RingOfThisEngine(r))
      return Status::InvalidArgument("engine: state was not made by this engine");
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
  const float* emb = embed_w_;
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
    // y = sum over the streams i of pre[i] * x[i]: a zeroed row plus one Axpy per stream.
    WeightedRowSums(pre + static_cast<int64_t>(t) * hc, 1, x + static_cast<int64_t>(t) * hc * D, hc,
                    D, y, /*avx2=*/true);
  }
  RmsNormRows(xn, n, norm_w, D, config_.rms_norm_eps, xn);
}

void Engine::MixSublayer(int n, float* x, const float* f_out, const float* post,
                         const float* comb) const {
  const int D = config_.hidden_size, hc = config_.hc_mult;
  // x[j][d] = post[j] * f[d] + sum over i in order of comb[i][j] * x_old[i][d]. Every stream's
  // old elements at d (four d per vector step) are loaded before any new one is stored there, so
  // the streams are updated in place; each element's products and sums are the scalar loop's.
  typedef float V4 __attribute__((vector_size(16)));
  for (int t = 0; t < n; ++t) {
    float* xt = x + static_cast<int64_t>(t) * hc * D;
    const float* f = f_out + static_cast<int64_t>(t) * D;
    const float* cb = comb + static_cast<int64_t>(t) * hc * hc;
    const float* pt = post + static_cast<int64_t>(t) * hc;
    int d = 0;
    for (; d + 4 <= D; d += 4) {
      V4 fv, ov[kHcMultMax];
      std::memcpy(&fv, f + d, sizeof fv);
      for (int i = 0; i < hc; ++i) std::memcpy(&ov[i], xt + static_cast<int64_t>(i) * D + d, 16);
      for (int j = 0; j < hc; ++j) {
        V4 acc = pt[j] * fv;
        for (int i = 0; i < hc; ++i) {
          const V4 prod = cb[i * hc + j] * ov[i];
          acc += prod;
        }
        std::memcpy(xt + static_cast<int64_t>(j) * D + d, &acc, sizeof acc);
      }
    }
    for (; d < D; ++d) {
      float old[kHcMultMax];
      for (int i = 0; i < hc; ++i) old[i] = xt[static_cast<int64_t>(i) * D + d];
      for (int j = 0; j < hc; ++j) {
        float acc = pt[j] * f[d];
        for (int i = 0; i < hc; ++i) acc += cb[i * hc + j] * old[i];
        xt[static_cast<int64_t>(j) * D + d] = acc;
      }
    }
  }
}

void Engine::AppendChunks(int64_t p0, int64_t n, int l_begin, int l_end,
                          std::vector<Step>* plan) const {
  const int64_t chunk = options_.prefill_chunk_tokens;
  for (int64_t a = 0; a < n; a += chunk) {
    plan->push_back({p0 + a, static_cast<int>(std::min(chunk, n - a)), l_begin, l_end});
  }
}

Status Engine::RunLayers(SequenceState* st, const std::vector<Step>& plan, size_t step, float* x,
                         float* pre) {
  const EngineConfig& c = config_;
  const int D = c.hidden_size, hc = c.hc_mult;
  const int64_t p0 = plan[step].p0;
  const int n = plan[step].n, l_begin = plan[step].l_begin, l_end = plan[step].l_end;
  // This thread's runtime and buffers, reused pass to pass (every element is written before
  // it is read).
  thread_local Runtime rt;
  rt.Reset();
  thread_local std::vector<float> xn_slot, f_slot, post_slot, comb_slot, next_pre_slot;
  Scratch<float> xn(xn_slot, static_cast<size_t>(n) * D), f(f_slot, static_cast<size_t>(n) * D);
  Scratch<float> post(post_slot, static_cast<size_t>(n) * hc),
      comb(comb_slot, static_cast<size_t>(n) * hc * hc),
      next_pre(next_pre_slot, static_cast<size_t>(n) * hc);
  // Prefetch: this step's Engram rows (unless already requested) and the lookahead's are
  // requested before the first layer runs; each Engram layer waits just before it.
  thread_local std::vector<EngramPending*> claimed_slot;
  std::vector<EngramPending*>& claimed = claimed_slot;  // BeginEngramStep assigns every element
  KVTIER_RETURN_IF_ERROR(BeginEngramStep(*st, plan, step, &claimed));
  const ThreadPool::Hold hold(pool_.get());  // no sleeping between this pass's sections
  auto engram = [&](int l) -> Status {
    thread_local EngramRowBatch rows_slot;  // its buffers trade places with the batch taken
    EngramRowBatch& rows = rows_slot;
    KVTIER_RETURN_IF_ERROR(TakeEngram(l, claimed[c.EngramSlot(l)], p0, n, &rows));
    KVTIER_RETURN_IF_ERROR(ApplyEngram(l, rows, n, x));
    TrimEngramRows(rows);
    return Status::Ok();
  };
  if (device_ != nullptr && trace_ == nullptr) {
    // The layers on the device; the caches' part of attention and Engram here; the residual and
    // pre back in x and pre at the end.
    thread_local std::vector<int64_t> pos_slot;
    thread_local AttnKeyRows keys_slot;
    Scratch<int64_t> pos(pos_slot, static_cast<size_t>(n));
    for (int t = 0; t < n; ++t) pos[t] = p0 + t;
    AttnKeyRows* keys = &keys_slot;
    ScopeExit trim([&] { TrimKeyRows(*keys); });
    Status s = model_detail::RunDeviceLayers(
        *device_, c, n, l_begin, l_end, x, pre, xn.data(), engram,
        [&](int l) { return capture_ != nullptr && capture_->Slot(l) >= 0; },
        [&](int l) { capture_->Record(l, p0, n, hc, D, x, xn.data()); },
        [&](int l) -> Status {
          KVTIER_RETURN_IF_ERROR(DeviceAttnProject(l, n, pos.data(), &attn_rows_));
          KVTIER_RETURN_IF_ERROR(AttnCoreKeys(l, st, p0, n, attn_rows_, 0, &rt, pool_.get(), keys));
          return DeviceAttention(l, std::span<AttnKeyRows* const>(&keys, 1), attn_rows_);
        });
    if (s.ok()) s = device_->Residual(x);
    if (s.ok()) s = device_->Pre(pre);
    return AfterDevicePass(std::move(s));
  }
  for (int l = l_begin; l < l_end; ++l) {
    const LayerWeights& lw = layers_[l];
    if (c.IsEngramLayer(l)) KVTIER_RETURN_IF_ERROR(engram(l));
    for (int s = 0; s < 2; ++s) {
      PreMix(n, x, pre, s == 0 ? lw.attn_norm : lw.ffn_norm, xn.data());
      if (s == 0 && capture_ != nullptr) capture_->Record(l, p0, n, hc, D, x, xn.data());
      auto mixes = [&](int64_t b, int64_t e) {  // a range's rows share fn's reads
        HcMixesRows(static_cast<int>(e - b), x + b * hc * D, hc, D, lw.hc_fn[s], lw.hc_scale[s],
                    lw.hc_base[s], c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps,
                    next_pre.data() + b * hc, post.data() + b * hc, comb.data() + b * hc * hc);
      };
      KVTIER_RETURN_IF_ERROR(
          model_detail::MixesBesideSublayer(pool_.get(), n, mixes, [&]() -> Status {
            if (s == 0) return Attention(l, st, p0, n, xn.data(), &rt, f.data());
            Moe(l, n, xn.data(), f.data());
            return Status::Ok();
          }));
      if (trace_ != nullptr) {
        auto& tc = trace_->comb[2 * l + s];  // appended chunk by chunk
        for (int t = 0; t < n; ++t) {
          tc.emplace_back(comb.begin() + static_cast<int64_t>(t) * hc * hc,
                          comb.begin() + static_cast<int64_t>(t + 1) * hc * hc);
        }
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
  // Keeps the rows' buffers: a capture is cleared before every pass that records into it.
  first_pos.assign(layers.size(), -1);
  stream_mean.resize(layers.size());
  normed.resize(layers.size());
  for (auto& v : stream_mean) v.clear();
  for (auto& v : normed) v.clear();
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
  m.resize(m0 + static_cast<size_t>(n) * dim);  // the new rows are 0.0f
  // Per element: 0, plus copy 0, 1, ..., hc - 1 in that order, divided by hc. Axpy with a = 1
  // adds a copy four elements at a time with the rounding of the scalar `y[d] += x[d]` (1 * x is
  // exact); -O2 leaves the scalar loops unvectorised (their trip counts are runtime values), so
  // the division is four-wide too, elementwise and therefore bit-identical to `y[d] /= hc`.
  typedef float V4 __attribute__((vector_size(16)));
  const float h = static_cast<float>(hc);
  const V4 hv = {h, h, h, h};
  const int d4 = dim - dim % 4;
  for (int t = 0; t < n; ++t) {
    float* y = m.data() + m0 + static_cast<size_t>(t) * dim;
    const float* xt = x + static_cast<int64_t>(t) * hc * dim;
    for (int c = 0; c < hc; ++c) Axpy(1.0f, xt + static_cast<int64_t>(c) * dim, dim, y);
    for (int d = 0; d < d4; d += 4) {
      V4 a;
      std::memcpy(&a, y + d, sizeof a);
      a /= hv;
      std::memcpy(y + d, &a, sizeof a);
    }
    for (int d = d4; d < dim; ++d) y[d] /= h;
  }
  if (record_normed) normed[i].insert(normed[i].end(), xa, xa + static_cast<size_t>(n) * dim);
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
  thread_local std::vector<float> y_slot;
  Scratch<float> y(y_slot, static_cast<size_t>(n) * D);
  PreMix(n, x, pre, norm_w_, y.data());
  Mm(pool_.get(), y.data(), n, D, head_w_, head_pk_, config_.vocab_size, logits);
}

template <typename Run>
Status Engine::InPieces(std::span<const int32_t> tokens, const Run& run) const {
  const size_t piece = static_cast<size_t>(options_.prompt_piece_tokens);
  const size_t first = (tokens.size() - 1) % piece + 1;
  KVTIER_RETURN_IF_ERROR(run(tokens.first(first)));
  for (size_t at = first; at < tokens.size(); at += piece) {
    KVTIER_RETURN_IF_ERROR(run(tokens.subspan(at, piece)));
  }
  return Status::Ok();
}

Status Engine::Forward(SequenceState* st, std::span<const int32_t> tokens, bool all_logits,
                       std::vector<float>* logits) {
  KVTIER_RETURN_IF_ERROR(CheckTokens(tokens, all_logits ? kMaxTokensPerCall : kMaxPromptTokens));
  KVTIER_RETURN_IF_ERROR(CheckExtendable(*st));
  ResetTrace();
  return InPieces(tokens, [&](std::span<const int32_t> piece) {
    return ForwardPiece(st, piece, all_logits, logits);
  });
}

Status Engine::ForwardPiece(SequenceState* st, std::span<const int32_t> tokens, bool all_logits,
                            std::vector<float>* logits) {
  const EngineConfig& c = config_;
  const int n = static_cast<int>(tokens.size());
  const int D = c.hidden_size, hc = c.hc_mult, V = c.vocab_size;
  const int64_t p0 = static_cast<int64_t>(st->tokens.size());
  st->tokens.insert(st->tokens.end(), tokens.begin(), tokens.end());
  // The pass's buffers are this thread's, reused call to call (engine/scratch.h).
  thread_local std::vector<Step> plan_slot;
  std::vector<Step>& plan = plan_slot;
  plan.clear();
  AppendChunks(p0, n, 0, c.num_hidden_layers, &plan);
  const int first = all_logits ? 0 : n - 1;
  thread_local std::vector<float> out_slot, x_slot, pre_slot;
  Scratch<float> out(out_slot, static_cast<size_t>(n - first) * V);  // *logits only on success
  const int cmax = std::min(n, options_.prefill_chunk_tokens);
  Scratch<float> x(x_slot, static_cast<size_t>(cmax) * hc * D),
      pre(pre_slot, static_cast<size_t>(cmax) * hc);
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
  // The filled slot becomes *logits and the caller's old buffer the slot: a caller that passes
  // the same vector each step makes the two trade places without an allocation or a copy.
  logits->swap(out_slot);
  return Status::Ok();
}

Status Engine::Decode(SequenceState* st, int32_t token, std::vector<float>* logits) {
  return Forward(st, std::span<const int32_t>(&token, 1), false, logits);
}

Status Engine::PrefillCed(SequenceState* st, std::span<const int32_t> tokens,
                          std::vector<float>* last_logits) {
  KVTIER_RETURN_IF_ERROR(CheckTokens(tokens, kMaxPromptTokens));
  KVTIER_RETURN_IF_ERROR(CheckExtendable(*st));
  if (!st->tokens.empty())
    return Status::InvalidArgument("engine: CED prefill needs an empty state");
  return ExtendCed(st, tokens, last_logits);
}

Status Engine::ExtendCed(SequenceState* st, std::span<const int32_t> tokens,
                         std::vector<float>* last_logits) {
  KVTIER_RETURN_IF_ERROR(CheckTokens(tokens, kMaxPromptTokens));
  KVTIER_RETURN_IF_ERROR(CheckExtendable(*st));
  const EngineConfig& c = config_;
  const int d = c.first_decoder_layer, L = c.num_hidden_layers;
  if (c.layer_modes[d] != LayerMode::kFull)
    return Status::InvalidArgument("engine: CED needs a kv source at the first decoder layer");
  for (int l = d + 1; l < L; ++l) {
    if (c.IsKvSource(l)) return Status::InvalidArgument("engine: CED needs one decoder kv source");
  }
  ResetTrace();
  return InPieces(tokens, [&](std::span<const int32_t> piece) {
    return ExtendCedPiece(st, piece, last_logits);
  });
}

Status Engine::ExtendCedPiece(SequenceState* st, std::span<const int32_t> tokens,
                              std::vector<float>* last_logits) {
  const EngineConfig& c = config_;
  const int d = c.first_decoder_layer, L = c.num_hidden_layers;
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
      thread_local EngramRowBatch rows_slot;  // its buffers trade places with the batch taken
      EngramRowBatch& rows = rows_slot;
      KVTIER_RETURN_IF_ERROR(TakeEngram(d, claimed[c.EngramSlot(d)], p0, cn, &rows));
      KVTIER_RETURN_IF_ERROR(ApplyEngram(d, rows, cn, xd.data()));
      TrimEngramRows(rows);
    }
    std::vector<float> xa(static_cast<size_t>(cn) * D);
    PreMix(cn, xd.data(), pres(p0), layers_[d].attn_norm, xa.data());
    KVTIER_RETURN_IF_ERROR(Compress(d, st, p0, cn, xa.data(), pool_.get()));
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
  if (static_cast<int>(st->swa.size()) != c.num_hidden_layers)
    return Status::InvalidArgument("engine: state was not made by this engine");
  for (const SwaRing& r : st->swa) {
    if (!RingOfThisEngine(r))
      return Status::InvalidArgument("engine: state was not made by this engine");
  }
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

}  // namespace kvtier::engine
