#include "engine/dspark.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "engine/config_json.h"
#include "engine/ops.h"

namespace kvtier::engine {

namespace {

using nlohmann::json;

template <typename T>
Status GetKey(const json& j, const char* key, T* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null())
    return Status::InvalidArgument(std::string("dspark config: missing key ") + key);
  if (!internal::ReadJsonValue(*it, out))
    return Status::InvalidArgument(std::string("dspark config: bad value for ") + key +
                                   " (wrong type, not an integer, or out of range)");
  return Status::Ok();
}

// Limits of the draft's sizes (a malformed config must not allocate absurd amounts).
constexpr int kMaxDraftBlocks = 16;
constexpr int kMaxMarkovRank = 4096;
constexpr int kMaxDraftExperts = 1024;

}  // namespace

StatusOr<DSparkConfig> ParseDSparkConfig(const std::string& json_text, const EngineConfig& c) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    return Status::InvalidArgument(std::string("dspark config: ") + e.what());
  }
  if (!j.is_object()) return Status::InvalidArgument("dspark config: not an object");
  if (j.contains("text_config") && j["text_config"].is_object()) j = j["text_config"];
  DSparkConfig d;
  KVTIER_RETURN_IF_ERROR(GetKey(j, "dspark_block_size", &d.block_size));
  KVTIER_RETURN_IF_ERROR(GetKey(j, "dspark_noise_token_id", &d.noise_token_id));
  KVTIER_RETURN_IF_ERROR(GetKey(j, "dspark_target_layer_ids", &d.target_layer_ids));
  KVTIER_RETURN_IF_ERROR(GetKey(j, "dspark_markov_rank", &d.markov_rank));
  KVTIER_RETURN_IF_ERROR(GetKey(j, "dspark_n_routed_experts", &d.n_routed_experts));
  KVTIER_RETURN_IF_ERROR(GetKey(j, "num_nextn_predict_layers", &d.n_blocks));
  int top = 1;
  if (j.contains("dspark_num_experts_per_tok"))
    KVTIER_RETURN_IF_ERROR(GetKey(j, "dspark_num_experts_per_tok", &top));
  auto bad = [](const char* k) {
    return Status::InvalidArgument(std::string("dspark config: ") + k + " out of range");
  };
  if (d.block_size < 1 || d.block_size > kMaxDraftBlock || d.block_size + 1 > c.sliding_window)
    return bad("dspark_block_size");
  if (d.noise_token_id < 0 || d.noise_token_id >= c.vocab_size) return bad("dspark_noise_token_id");
  if (d.target_layer_ids.empty() || d.target_layer_ids.size() > 16)
    return bad("dspark_target_layer_ids");
  for (int l : d.target_layer_ids) {
    if (l < 0 || l >= c.num_hidden_layers) return bad("dspark_target_layer_ids");
  }
  if (d.markov_rank < 1 || d.markov_rank > kMaxMarkovRank) return bad("dspark_markov_rank");
  if (d.n_routed_experts < 1 || d.n_routed_experts > kMaxDraftExperts)
    return bad("dspark_n_routed_experts");
  if (top != 1) return bad("dspark_num_experts_per_tok (only 1 is supported)");
  if (d.n_blocks < 1 || d.n_blocks > kMaxDraftBlocks) return bad("num_nextn_predict_layers");
  return d;
}

StatusOr<DSparkConfig> LoadDSparkConfig(const std::string& path, const EngineConfig& c) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::IOError("cannot open config " + path);
  std::string text(kDSparkConfigBytesMax + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  if (in.bad()) return Status::IOError("cannot read config " + path);
  text.resize(static_cast<size_t>(in.gcount()));
  if (text.size() > kDSparkConfigBytesMax)
    return Status::InvalidArgument("dspark config: over kDSparkConfigBytesMax: " + path);
  auto r = ParseDSparkConfig(text, c);
  if (!r.ok()) return r.status().WithContext(path);
  return r;
}

std::string DefaultDraftPath(const std::string& model_path) {
  std::string path = model_path;
  const std::string ext = ".safetensors";
  if (path.size() > ext.size() && path.compare(path.size() - ext.size(), ext.size(), ext) == 0)
    path.resize(path.size() - ext.size());
  return path + "-dspark.safetensors";
}

const float* DraftContext::Entry(int64_t pos) const {
  const int64_t first = end_ - static_cast<int64_t>(rows_.size());
  if (pos < first || pos >= end_) return nullptr;
  return rows_[static_cast<size_t>(pos - first)].data();
}

const float* DraftContext::Row(int64_t pos) const { return Entry(pos); }

void DraftContext::Clear() {
  rows_.clear();
  end_ = 0;
  owner_ = nullptr;
}

uint64_t DSpark::held_bytes() const {
  uint64_t n = 0;
  for (const auto& [name, t] : file_.tensors) n += t.bytes.size();
  return n;
}

void DSpark::Mm(const float* x, int rows, int in, const float* w, int out, float* y) const {
  MatMul(pool_.get(), x, rows, in, w, packed_.Find(w, in, out), out, y);
}

StatusOr<std::unique_ptr<DSpark>> DSpark::Load(const EngineConfig& c, const DSparkConfig& dc,
                                               std::shared_ptr<const ModelWeights> backbone,
                                               const std::string& path) {
  if (backbone == nullptr) return Status::InvalidArgument("dspark: no backbone weights");
  std::unique_ptr<DSpark> d(new DSpark());
  d->config_ = c;
  d->dc_ = dc;
  d->backbone_ = std::move(backbone);
  d->embed_ = d->backbone_->F32("embed.weight");
  d->head_ = d->backbone_->F32("head.weight");
  if (d->embed_ == nullptr || d->head_ == nullptr)
    return Status::InvalidArgument("dspark: backbone has no F32 embed/head");
  const int64_t D = c.hidden_size, V = c.vocab_size, H = c.num_attention_heads, hd = c.head_dim;
  const int64_t K = dc.block_size, r = dc.markov_rank, I = c.moe_intermediate_size;
  const int64_t NT = static_cast<int64_t>(dc.target_layer_ids.size());
  // Every tensor the draft reads, with its shape and where its pointer goes; only these are
  // read from the file (others are checked in its header and skipped).
  struct Want {
    std::string name;
    std::vector<int64_t> shape;
    const float** out;
  };
  std::vector<Want> want;
  auto add = [&](std::string name, std::vector<int64_t> shape, const float** out) {
    want.push_back(Want{std::move(name), std::move(shape), out});
  };
  add("dspark.proj.weight", {D, NT * D}, &d->proj_);
  add("dspark.proj_norm.weight", {D}, &d->proj_norm_);
  add("dspark.block_pos", {K, D}, &d->block_pos_);
  d->blocks_.resize(dc.n_blocks);  // not resized again: the pointers below stay valid
  for (int b = 0; b < dc.n_blocks; ++b) {
    const std::string p = "dspark.blocks." + std::to_string(b) + ".";
    Block& bl = d->blocks_[b];
    add(p + "attn_norm.weight", {D}, &bl.attn_norm);
    add(p + "wq.weight", {H * hd, D}, &bl.wq);
    add(p + "wkv.weight", {hd, D}, &bl.wkv);
    add(p + "kv_norm.weight", {hd}, &bl.kv_norm);
    add(p + "wo.weight", {D, H * hd}, &bl.wo);
    add(p + "ffn_norm.weight", {D}, &bl.ffn_norm);
    add(p + "gate.weight", {dc.n_routed_experts, D}, &bl.gate);
    bl.w1.resize(dc.n_routed_experts);
    bl.w3.resize(dc.n_routed_experts);
    bl.w2.resize(dc.n_routed_experts);
    for (int e = 0; e < dc.n_routed_experts; ++e) {
      const std::string ep = p + "experts." + std::to_string(e) + ".";
      add(ep + "w1.weight", {I, D}, &bl.w1[e]);
      add(ep + "w3.weight", {I, D}, &bl.w3[e]);
      add(ep + "w2.weight", {D, I}, &bl.w2[e]);
    }
    add(p + "shared.w1.weight", {I, D}, &bl.s_w1);
    add(p + "shared.w3.weight", {I, D}, &bl.s_w3);
    add(p + "shared.w2.weight", {D, I}, &bl.s_w2);
  }
  add("dspark.norm.weight", {D}, &d->norm_);
  add("dspark.markov_embed", {V, r}, &d->markov_embed_);
  add("dspark.markov_head", {V, r}, &d->markov_head_);
  add("dspark.conf.weight", {1, D + r}, &d->conf_w_);
  add("dspark.conf.bias", {1}, &d->conf_b_);
  // Only these are read, and no more bytes than they take as F32 (the widest dtype accepted):
  // a file whose other tensors are large costs nothing to load.
  SafetensorsReadOptions ro;
  ro.max_data_bytes = 0;
  for (const Want& w : want) {
    ro.only.insert(w.name);
    uint64_t elements = 1;
    for (int64_t n : w.shape) elements *= static_cast<uint64_t>(n);
    ro.max_data_bytes += 4 * elements;
  }
  KVTIER_ASSIGN_OR_RETURN(d->file_, ReadSafetensors(path, ro));
  auto get = [&](const Want& w) -> Status {
    auto it = d->file_.tensors.find(w.name);
    if (it == d->file_.tensors.end())
      return Status::InvalidArgument("dspark weights: missing " + w.name).WithContext(path);
    Tensor& t = it->second;
    if (t.shape != w.shape)
      return Status::InvalidArgument("dspark weights: " + w.name + " has the wrong shape")
          .WithContext(path);
    KVTIER_RETURN_IF_ERROR(ConvertToF32(w.name, &t).WithContext(path));
    if (t.dtype != "F32")
      return Status::InvalidArgument("dspark weights: " + w.name + " is not a float tensor")
          .WithContext(path);
    for (int64_t i = 0, n = t.NumElements(); i < n; ++i) {
      if (!std::isfinite(t.f32()[i]))
        return Status::InvalidArgument("dspark weights: " + w.name + " has a non-finite element")
            .WithContext(path);
    }
    *w.out = t.f32();
    return Status::Ok();
  };
  for (const Want& w : want) KVTIER_RETURN_IF_ERROR(get(w));
  d->rope_ = RopeFrequencies(c.qk_rope_head_dim, RopeParamsFor(c, c.rope_theta));
  d->pool_ = std::make_unique<ThreadPool>(1);
  // Packed copies of every matrix the draft multiplies by, held as long as the DSpark: without
  // them MatMul packs each one again on every call (engine/matmul.h), which made a draft pass
  // cost about as much as two decode steps of the backbone. The results do not change.
  auto pack = [&](const float* w, int64_t in, int64_t out) {
    d->packed_.Add(w, static_cast<int>(in), static_cast<int>(out));
  };
  pack(d->proj_, NT * D, D);
  pack(d->head_, D, V);
  pack(d->markov_head_, r, V);
  for (const Block& bl : d->blocks_) {
    pack(bl.wq, D, H * hd);
    pack(bl.wkv, D, hd);
    pack(bl.wo, H * hd, D);
    pack(bl.gate, D, dc.n_routed_experts);
    for (int e = 0; e < dc.n_routed_experts; ++e) {
      pack(bl.w1[e], D, I);
      pack(bl.w3[e], D, I);
      pack(bl.w2[e], I, D);
    }
    pack(bl.s_w1, D, I);
    pack(bl.s_w3, D, I);
    pack(bl.s_w2, I, D);
  }
  return d;
}

Status DSpark::Observe(const AttnInputCapture& cap, int64_t from, int64_t count,
                       DraftContext* ctx) const {
  const int D = config_.hidden_size;
  const int NT = static_cast<int>(dc_.target_layer_ids.size());
  if (count < 0) return Status::InvalidArgument("dspark: negative count");
  std::vector<const float*> src(NT);
  for (int i = 0; i < NT; ++i) {
    const int s = cap.Slot(dc_.target_layer_ids[i]);
    if (s < 0 || static_cast<size_t>(s) >= cap.first_pos.size())
      return Status::InvalidArgument("dspark: the capture lacks a target layer");
    const int64_t f = cap.first_pos[s];
    const int64_t have = static_cast<int64_t>(cap.stream_mean[s].size()) / D;
    if (f < 0 || from < f || from + count > f + have)
      return Status::InvalidArgument("dspark: the capture lacks the observed positions");
    src[i] = cap.stream_mean[s].data() + (from - f) * D;
  }
  if (!ctx->rows_.empty() && ctx->owner_ != this)
    return Status::InvalidArgument("dspark: the context was observed by another draft");
  if (from != ctx->end_) {
    if (!ctx->rows_.empty() && from < ctx->end_)
      return Status::InvalidArgument("dspark: observed positions overlap the context");
    ctx->rows_.clear();
  }
  ctx->owner_ = this;
  // Only the last `keep` rows can stay; they are projected in one MatMul (a row's result does
  // not depend on the rows beside it, ops.h: the same bits as one call per row).
  const int64_t keep = config_.sliding_window + 1;
  const int64_t skip = std::max<int64_t>(0, count - keep);
  const int64_t rows = count - skip;
  if (skip > 0) ctx->rows_.clear();
  std::vector<float> cat(static_cast<size_t>(rows * NT * D));
  for (int64_t t = 0; t < rows; ++t) {
    for (int i = 0; i < NT; ++i)
      std::memcpy(cat.data() + (t * NT + i) * D, src[i] + (skip + t) * D, D * 4);
  }
  std::vector<float> proj(static_cast<size_t>(rows * D));
  if (rows > 0) Mm(cat.data(), static_cast<int>(rows), NT * D, proj_, D, proj.data());
  // main_x of every row, then each block's latent and key of all rows (one MatMul per block:
  // a row's result does not depend on the rows beside it, so these are the bits a draft pass
  // computing them itself would get).
  const int hd = config_.head_dim, rd = config_.qk_rope_head_dim;
  const int64_t entry = D + static_cast<int64_t>(blocks_.size()) * 2 * hd;
  std::vector<float> mx(static_cast<size_t>(rows * D)), xin(static_cast<size_t>(rows * D)),
      lat(static_cast<size_t>(rows * hd));
  std::vector<std::vector<float>> fresh(static_cast<size_t>(rows), std::vector<float>(entry));
  const int R = static_cast<int>(rows), pairs = static_cast<int>(rope_.size());
  const double eps = config_.rms_norm_eps;
  RmsNormRows(proj.data(), R, proj_norm_, D, eps, mx.data());
  // Each row's rotation, shared by its keys in every block.
  std::vector<float> rc(static_cast<size_t>(rows) * pairs), rs(rc.size());
  for (int64_t t = 0; t < rows; ++t) {
    std::memcpy(fresh[t].data(), mx.data() + t * D, D * 4);
    RopeRotation(rope_, from + skip + t, rc.data() + t * pairs, rs.data() + t * pairs);
  }
  for (size_t b = 0; b < blocks_.size(); ++b) {
    const Block& bl = blocks_[b];
    RmsNormRows(mx.data(), R, bl.attn_norm, D, eps, xin.data());
    if (rows > 0) Mm(xin.data(), R, D, bl.wkv, hd, lat.data());
    RmsNormRows(lat.data(), R, bl.kv_norm, hd, eps, lat.data());
    for (int64_t t = 0; t < rows; ++t) {
      float* li = fresh[t].data() + D + static_cast<int64_t>(b) * 2 * hd;
      float* ki = li + hd;
      std::memcpy(li, lat.data() + t * hd, hd * 4);
      std::memcpy(ki, li, hd * 4);
      ApplyRopeRotation(ki + hd - rd, rc.data() + t * pairs, rs.data() + t * pairs, pairs, false);
    }
  }
  for (int64_t t = 0; t < rows; ++t) {
    ctx->rows_.push_back(std::move(fresh[t]));
    if (static_cast<int64_t>(ctx->rows_.size()) > keep) ctx->rows_.pop_front();
  }
  ctx->end_ = from + count;
  return Status::Ok();
}

void DSpark::MoeRows(const Block& b, const float* x, int rows, float* out) const {
  const int D = config_.hidden_size, I = config_.moe_intermediate_size, E = dc_.n_routed_experts;
  const float lim = static_cast<float>(config_.swiglu_limit);
  std::vector<float> s(static_cast<size_t>(rows) * E);
  Mm(x, rows, D, b.gate, E, s.data());
  std::vector<int> top(rows, 0);
  for (int t = 0; t < rows; ++t) {
    float* st = s.data() + static_cast<int64_t>(t) * E;
    for (int e = 0; e < E; ++e) {
      st[e] = std::sqrt(Softplus(st[e]));
      if (st[e] > st[top[t]]) top[t] = e;
    }
  }
  // SwiGLU of n rows of xs through one expert into y; weights: a factor per row, or none.
  std::vector<float> g(static_cast<size_t>(rows) * I), u(g.size());
  auto swiglu = [&](const float* xs, int n, const float* w1, const float* w3, const float* w2,
                    const float* weights, float* y) {
    Mm(xs, n, D, w1, I, g.data());
    Mm(xs, n, D, w3, I, u.data());
    for (int t = 0; t < n; ++t) {
      for (int i = 0; i < I; ++i) {
        float& gi = g[static_cast<size_t>(t) * I + i];
        gi = Silu(std::min(gi, lim)) * std::clamp(u[static_cast<size_t>(t) * I + i], -lim, lim);
        if (weights != nullptr) gi = gi * weights[t];
      }
    }
    Mm(g.data(), n, I, w2, D, y);
  };
  swiglu(x, rows, b.s_w1, b.s_w3, b.s_w2, nullptr, out);
  std::vector<float> xs(static_cast<size_t>(rows) * D), ys(xs.size()), ws(rows);
  std::vector<int> members;
  for (int e = 0; e < E; ++e) {
    members.clear();
    for (int t = 0; t < rows; ++t) {
      if (top[t] == e) members.push_back(t);
    }
    if (members.empty()) continue;
    const int n = static_cast<int>(members.size());
    for (int j = 0; j < n; ++j) {
      std::memcpy(xs.data() + static_cast<int64_t>(j) * D, x + static_cast<int64_t>(members[j]) * D,
                  D * 4);
      ws[j] = s[static_cast<size_t>(members[j]) * E + e];
    }
    swiglu(xs.data(), n, b.w1[e], b.w3[e], b.w2[e], ws.data(), ys.data());
    for (int j = 0; j < n; ++j) {
      float* o = out + static_cast<int64_t>(members[j]) * D;
      const float* y = ys.data() + static_cast<int64_t>(j) * D;
      for (int d = 0; d < D; ++d) o[d] += y[d];
    }
  }
}

Status DSpark::Draft(const DraftContext& ctx, int32_t last, double temperature,
                     const std::vector<double>& uniforms, DraftResult* out) const {
  const EngineConfig& c = config_;
  const int D = c.hidden_size, V = c.vocab_size, H = c.num_attention_heads, hd = c.head_dim;
  const int rd = c.qk_rope_head_dim, W = c.sliding_window, K = dc_.block_size;
  const int r = dc_.markov_rank;
  const double eps = c.rms_norm_eps;
  if (last < 0 || last >= V) return Status::InvalidArgument("dspark: token outside the vocabulary");
  if (temperature > 0 && static_cast<int>(uniforms.size()) < K)
    return Status::InvalidArgument("dspark: sampling needs one uniform per draft position");
  if (ctx.size() > 0 && ctx.owner_ != this)
    return Status::InvalidArgument("dspark: the context was observed by another draft");
  const int64_t n = ctx.end();
  // Context slots: positions n-W .. n-1 that the context holds (their latents and keys were
  // computed when they were observed).
  std::vector<const float*> crow;
  for (int64_t p = n - W; p < n; ++p) {
    const float* row = p >= 0 ? ctx.Entry(p) : nullptr;
    if (row != nullptr) crow.push_back(row);
  }
  const int C = static_cast<int>(crow.size());
  const int NK = C + K;
  std::vector<float> h(static_cast<size_t>(K) * D);
  for (int k = 0; k < K; ++k) {
    const int32_t tok = k == 0 ? last : dc_.noise_token_id;
    for (int d = 0; d < D; ++d)
      h[k * D + d] = embed_[static_cast<int64_t>(tok) * D + d] + block_pos_[k * D + d];
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  std::vector<float> xin(static_cast<size_t>(K) * D), lat(static_cast<size_t>(K) * hd),
      q(static_cast<size_t>(K) * H * hd), o(static_cast<size_t>(K) * H * hd),
      f(static_cast<size_t>(K) * D), xn(static_cast<size_t>(K) * D),
      logit(static_cast<size_t>(K) * H * NK);
  // Every key and latent the block positions attend to, contiguous: the context's, then the
  // block's own.
  std::vector<float> kall(static_cast<size_t>(NK) * hd), lall(kall.size());
  // The block positions' rotations, shared by their queries and keys in every block.
  const int pairs = static_cast<int>(rope_.size());
  std::vector<float> rc(static_cast<size_t>(K) * pairs), rs(rc.size());
  for (int k = 0; k < K; ++k)
    RopeRotation(rope_, n + k, rc.data() + k * pairs, rs.data() + k * pairs);
  for (size_t bi = 0; bi < blocks_.size(); ++bi) {
    const Block& b = blocks_[bi];
    // The block's states: normalised, projected to queries and to latents and keys; the
    // context's latents and keys come from the context.
    RmsNormRows(h.data(), K, b.attn_norm, D, eps, xin.data());
    Mm(xin.data(), K, D, b.wq, H * hd, q.data());
    Mm(xin.data(), K, D, b.wkv, hd, lat.data());
    for (int i = 0; i < C; ++i) {
      const float* li = crow[i] + D + static_cast<int64_t>(bi) * 2 * hd;
      std::memcpy(lall.data() + static_cast<int64_t>(i) * hd, li, hd * 4);
      std::memcpy(kall.data() + static_cast<int64_t>(i) * hd, li + hd, hd * 4);
    }
    RmsNormRows(lat.data(), K, b.kv_norm, hd, eps, lat.data());
    for (int k = 0; k < K; ++k) {
      float* li = lall.data() + static_cast<int64_t>(C + k) * hd;
      float* ki = kall.data() + static_cast<int64_t>(C + k) * hd;
      std::memcpy(li, lat.data() + static_cast<int64_t>(k) * hd, hd * 4);
      std::memcpy(ki, li, hd * 4);
      ApplyRopeRotation(ki + hd - rd, rc.data() + k * pairs, rs.data() + k * pairs, pairs, false);
      for (int hh = 0; hh < H; ++hh) {
        float* qk = q.data() + (static_cast<int64_t>(k) * H + hh) * hd;
        ApplyRopeRotation(qk + hd - rd, rc.data() + k * pairs, rs.data() + k * pairs, pairs, false);
      }
    }
    // Scores of every query (K x H rows of q) against every key (Dot's sums, bit for bit), a
    // softmax per query, and the weighted sums of the latents (Axpys in key order, bit for bit).
    HcMixDots(kall.data(), NK, q.data(), K * H, hd, logit.data(), /*avx2=*/true);
    for (int t = 0; t < K * H; ++t) {
      float* lt = logit.data() + static_cast<int64_t>(t) * NK;
      float mx = -INFINITY;
      for (int i = 0; i < NK; ++i) {
        lt[i] = lt[i] * scale;
        mx = std::max(mx, lt[i]);
      }
      float den = 0.0f;
      for (int i = 0; i < NK; ++i) {
        lt[i] = std::exp(lt[i] - mx);
        den += lt[i];
      }
      for (int i = 0; i < NK; ++i) lt[i] = lt[i] / den;
    }
    WeightedRowSums(logit.data(), K * H, lall.data(), NK, hd, o.data(), /*avx2=*/true);
    Mm(o.data(), K, H * hd, b.wo, D, f.data());
    for (size_t i = 0; i < h.size(); ++i) h[i] += f[i];
    RmsNormRows(h.data(), K, b.ffn_norm, D, eps, xn.data());
    MoeRows(b, xn.data(), K, f.data());
    for (size_t i = 0; i < h.size(); ++i) h[i] += f[i];
  }
  RmsNormRows(h.data(), K, norm_, D, eps, h.data());
  std::vector<float> base(static_cast<size_t>(K) * V), bias(V), feat(D + r);
  Mm(h.data(), K, D, head_, V, base.data());
  out->tokens.assign(K, 0);
  out->confidence.assign(K, 0.0f);
  out->logits.assign(K, std::vector<float>(V));
  int32_t prev = last;
  for (int k = 0; k < K; ++k) {
    const float* me = markov_embed_ + static_cast<int64_t>(prev) * r;
    Mm(me, 1, r, markov_head_, V, bias.data());
    std::vector<float>& lg = out->logits[k];
    for (int v = 0; v < V; ++v) lg[v] = base[static_cast<int64_t>(k) * V + v] + bias[v];
    std::memcpy(feat.data(), h.data() + k * D, D * 4);
    std::memcpy(feat.data() + D, me, r * 4);
    out->confidence[k] = Sigmoid(Dot(feat.data(), conf_w_, D + r) + conf_b_[0]);
    int32_t tok = static_cast<int32_t>(ArgMax(lg.data(), V));
    if (temperature > 0) {
      const double mx = lg[tok];
      std::vector<double> p(V);
      double sum = 0;
      for (int v = 0; v < V; ++v) sum += p[v] = std::exp((lg[v] - mx) / temperature);
      double u = uniforms[k] * sum;
      for (int v = 0; v < V; ++v) {
        u -= p[v];
        tok = v;
        if (u < 0) break;
      }
    }
    out->tokens[k] = tok;
    prev = tok;
  }
  return Status::Ok();
}

}  // namespace kvtier::engine
