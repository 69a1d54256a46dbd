#include "engine/device/layers.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>

#include "engine/model.h"

namespace kvtier::engine::device {

// One layer's device weights.
struct DeviceLayers::Layer {
  const float* norm[2] = {};
  const float* hc_fn[2] = {};  // output-minor (kernels.h), as every matrix below but gate and head
  const float* hc_scale[2] = {};
  const float* hc_base[2] = {};
  const float* gate = nullptr;
  const float* gate_bias = nullptr;
  const float* w1 = nullptr;  // output-minor per expert: [experts x hidden x inter]
  const float* w3 = nullptr;
  const float* w2 = nullptr;  // output-minor per expert: [experts x inter x hidden]
  const float *s_w1 = nullptr, *s_w3 = nullptr, *s_w2 = nullptr;
  const float *wq_a = nullptr, *q_norm = nullptr, *wq_b = nullptr, *wkv = nullptr;
  const float *kv_norm = nullptr, *i_wproj = nullptr, *i_wq_b = nullptr;
  const float *c_wkv = nullptr, *c_wgate = nullptr;
  const float* wo_a = nullptr;  // output-minor per group: [groups x group inputs x o_lora_rank]
  const float* wo_b = nullptr;
  const float* sink = nullptr;
};

DeviceLayers::DeviceLayers(const EngineConfig& config, std::unique_ptr<DeviceBackend> backend,
                           size_t attention_weights_bytes_max, size_t kv_mirror_bytes_max)
    : config_(config),
      backend_(std::make_unique<FailStopBackend>(std::move(backend))),
      attention_weights_bytes_max_(attention_weights_bytes_max),
      kv_mirror_bytes_max_(kv_mirror_bytes_max) {}

DeviceLayers::~DeviceLayers() {
  for (void* p : activations_) backend_->Free(p);
  for (void* p : held_) backend_->Free(p);
  for (void* p : {key_upload_, keys_f_, attn_w_}) backend_->Free(p);
  for (auto& [id, m] : mirrors_) {
    backend_->Free(m.data);
    backend_->Free(m.scales);
  }
}

Status DeviceLayers::Grow(void** p, size_t* capacity, size_t bytes) {
  if (bytes <= *capacity) return Status::Ok();
  // At least 3/2 of the old size, so that passes that grow a little at a time do not reallocate
  // every time.
  const size_t want = std::max(bytes, *capacity + *capacity / 2);
  backend_->Free(*p);
  *p = nullptr;
  *capacity = 0;
  KVTIER_ASSIGN_OR_RETURN(*p, backend_->Alloc(want));
  *capacity = want;
  return Status::Ok();
}

StatusOr<float*> DeviceLayers::Hold(size_t floats) {
  KVTIER_ASSIGN_OR_RETURN(void* p, backend_->Alloc(std::max<size_t>(floats, 1) * sizeof(float)));
  held_.push_back(p);
  return static_cast<float*>(p);
}

StatusOr<float*> DeviceLayers::Upload(const float* host, size_t floats) {
  if (host == nullptr) return Status::InvalidArgument("device layers: a weight is missing");
  KVTIER_ASSIGN_OR_RETURN(float* d, Hold(floats));
  KVTIER_RETURN_IF_ERROR(backend_->ToDevice(d, host, floats * sizeof(float)));
  weight_bytes_ += floats * sizeof(float);
  return d;
}

StatusOr<float*> DeviceLayers::UploadIf(const float* host, size_t floats) {
  if (host == nullptr) return static_cast<float*>(nullptr);
  return Upload(host, floats);
}

StatusOr<float*> DeviceLayers::UploadOutputMinor(const float* const* mats, size_t count, size_t out,
                                                 size_t in) {
  KVTIER_ASSIGN_OR_RETURN(float* d, Hold(count * out * in));
  std::vector<float> t(out * in);
  for (size_t i = 0; i < count; ++i) {
    if (mats[i] == nullptr) return Status::InvalidArgument("device layers: a weight is missing");
    for (size_t o = 0; o < out; ++o) {
      for (size_t k = 0; k < in; ++k) t[k * out + o] = mats[i][o * in + k];
    }
    KVTIER_RETURN_IF_ERROR(
        backend_->ToDevice(d + i * out * in, t.data(), t.size() * sizeof(float)));
  }
  weight_bytes_ += count * out * in * sizeof(float);
  return d;
}

namespace {

// What Create refuses before it touches a device.
Status CheckModel(const EngineConfig& c, const DeviceModelWeights& weights) {
  if (c.num_experts_per_tok > kDeviceExpertsPerTokenMax)
    return Status::InvalidArgument("device layers: num_experts_per_tok over " +
                                   std::to_string(kDeviceExpertsPerTokenMax));
  if (c.hc_mult > kDeviceHcMultMax)
    return Status::InvalidArgument("device layers: hc_mult over the kernels' limit");
  if (static_cast<int>(weights.layers.size()) != c.num_hidden_layers)
    return Status::InvalidArgument("device layers: one weight set per layer needed");
  return Status::Ok();
}

}  // namespace

StatusOr<std::unique_ptr<DeviceLayers>> DeviceLayers::Create(DeviceKind kind, const EngineConfig& c,
                                                             const DeviceModelWeights& weights,
                                                             size_t attention_weights_bytes_max,
                                                             size_t kv_mirror_bytes_max) {
  KVTIER_RETURN_IF_ERROR(CheckModel(c, weights));
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<DeviceBackend> backend, MakeDeviceBackend(kind));
  return Create(std::move(backend), c, weights, attention_weights_bytes_max, kv_mirror_bytes_max);
}

StatusOr<std::unique_ptr<DeviceLayers>> DeviceLayers::Create(std::unique_ptr<DeviceBackend> backend,
                                                             const EngineConfig& c,
                                                             const DeviceModelWeights& weights,
                                                             size_t attention_weights_bytes_max,
                                                             size_t kv_mirror_bytes_max) {
  if (backend == nullptr) return Status::InvalidArgument("device layers: no backend");
  KVTIER_RETURN_IF_ERROR(CheckModel(c, weights));
  std::unique_ptr<DeviceLayers> d(
      new DeviceLayers(c, std::move(backend), attention_weights_bytes_max, kv_mirror_bytes_max));
  const size_t D = c.hidden_size, hc = c.hc_mult, E = c.n_routed_experts;
  const size_t I = c.moe_intermediate_size, Is = I * c.n_shared_experts;
  const size_t m = (2 + hc) * hc;
  const size_t ql = c.q_lora_rank, Hd = static_cast<size_t>(c.num_attention_heads) * c.head_dim;
  const size_t hd = c.head_dim, IH = c.index_n_heads, id = c.index_head_dim;
  const size_t G = c.o_groups, ol = c.o_lora_rank, gin = Hd / G;
  for (const DeviceLayerWeights& hw : weights.layers) {
    Layer l;
    for (int s = 0; s < 2; ++s) {
      KVTIER_ASSIGN_OR_RETURN(l.norm[s], d->Upload(hw.norm[s], D));
      KVTIER_ASSIGN_OR_RETURN(l.hc_fn[s], d->UploadOutputMinor(&hw.hc_fn[s], 1, m, hc * D));
      KVTIER_ASSIGN_OR_RETURN(l.hc_scale[s], d->Upload(hw.hc_scale[s], 3));
      KVTIER_ASSIGN_OR_RETURN(l.hc_base[s], d->Upload(hw.hc_base[s], m));
    }
    KVTIER_ASSIGN_OR_RETURN(l.gate, d->Upload(hw.gate, E * D));
    KVTIER_ASSIGN_OR_RETURN(l.gate_bias, d->Upload(hw.gate_bias, E));
    if (hw.w1.size() != E || hw.w2.size() != E || hw.w3.size() != E)
      return Status::InvalidArgument("device layers: one weight per routed expert needed");
    // The routed experts' matrices output-minor and side by side (expert e's at e * size).
    KVTIER_ASSIGN_OR_RETURN(l.w1, d->UploadOutputMinor(hw.w1.data(), E, I, D));
    KVTIER_ASSIGN_OR_RETURN(l.w3, d->UploadOutputMinor(hw.w3.data(), E, I, D));
    KVTIER_ASSIGN_OR_RETURN(l.w2, d->UploadOutputMinor(hw.w2.data(), E, D, I));
    if (hw.s_w1 != nullptr) {
      KVTIER_ASSIGN_OR_RETURN(l.s_w1, d->UploadOutputMinor(&hw.s_w1, 1, Is, D));
      KVTIER_ASSIGN_OR_RETURN(l.s_w3, d->UploadOutputMinor(&hw.s_w3, 1, Is, D));
      KVTIER_ASSIGN_OR_RETURN(l.s_w2, d->UploadOutputMinor(&hw.s_w2, 1, D, Is));
    }
    KVTIER_ASSIGN_OR_RETURN(l.wq_a, d->Upload(hw.wq_a, ql * D));
    KVTIER_ASSIGN_OR_RETURN(l.q_norm, d->Upload(hw.q_norm, ql));
    KVTIER_ASSIGN_OR_RETURN(l.wq_b, d->Upload(hw.wq_b, Hd * ql));
    KVTIER_ASSIGN_OR_RETURN(l.wkv, d->Upload(hw.wkv, hd * D));
    KVTIER_ASSIGN_OR_RETURN(l.kv_norm, d->Upload(hw.kv_norm, hd));
    KVTIER_ASSIGN_OR_RETURN(l.i_wproj, d->UploadIf(hw.i_wproj, IH * D));
    KVTIER_ASSIGN_OR_RETURN(l.i_wq_b, d->UploadIf(hw.i_wq_b, IH * id * ql));
    KVTIER_ASSIGN_OR_RETURN(l.c_wkv, d->UploadIf(hw.c_wkv, hd * D));
    KVTIER_ASSIGN_OR_RETURN(l.c_wgate, d->UploadIf(hw.c_wgate, hd * D));
    // The output groups' matrices output-minor and side by side, as the routed experts'.
    if (hw.wo_a == nullptr) return Status::InvalidArgument("device layers: a weight is missing");
    std::vector<const float*> groups(G);
    for (size_t g = 0; g < G; ++g) groups[g] = hw.wo_a + g * ol * gin;
    KVTIER_ASSIGN_OR_RETURN(l.wo_a, d->UploadOutputMinor(groups.data(), G, ol, gin));
    KVTIER_ASSIGN_OR_RETURN(l.wo_b, d->Upload(hw.wo_b, D * G * ol));
    KVTIER_ASSIGN_OR_RETURN(l.sink, d->Upload(hw.sink, c.num_attention_heads));
    d->layers_.push_back(l);
  }
  KVTIER_ASSIGN_OR_RETURN(d->norm_w_, d->Upload(weights.norm_w, D));
  KVTIER_ASSIGN_OR_RETURN(d->head_w_,
                          d->Upload(weights.head_w, static_cast<size_t>(c.vocab_size) * D));
  return d;
}

Status DeviceLayers::EnsureRows(int n) {
  if (n <= capacity_) return Status::Ok();
  // At least double, so that passes that grow one row at a time do not reallocate every time.
  const int rows = std::max(n, std::min<int>(2 * capacity_, static_cast<int>(kMaxTokensPerCall)));
  for (void* p : activations_) backend_->Free(p);
  activations_.clear();
  capacity_ = 0;
  const EngineConfig& c = config_;
  const size_t R = rows, D = c.hidden_size, hc = c.hc_mult, K = c.num_experts_per_tok;
  const size_t m = (2 + hc) * hc, I = c.moe_intermediate_size;
  const size_t Is = I * c.n_shared_experts;
  const size_t wide = std::max<size_t>(c.n_routed_experts, c.vocab_size);
  const size_t ql = c.q_lora_rank, Hd = static_cast<size_t>(c.num_attention_heads) * c.head_dim;
  const size_t hd = c.head_dim, IH = c.index_n_heads, id = c.index_head_dim;
  const size_t G = c.o_groups, ol = c.o_lora_rank;
  auto alloc = [&](size_t bytes) -> StatusOr<void*> {
    KVTIER_ASSIGN_OR_RETURN(void* p, backend_->Alloc(std::max<size_t>(bytes, 4)));
    activations_.push_back(p);
    return p;
  };
  auto floats = [&](float** out, size_t count) -> Status {
    KVTIER_ASSIGN_OR_RETURN(void* p, alloc(count * sizeof(float)));
    *out = static_cast<float*>(p);
    return Status::Ok();
  };
  KVTIER_RETURN_IF_ERROR(floats(&x_, R * hc * D));
  KVTIER_RETURN_IF_ERROR(floats(&pre_, R * hc));
  KVTIER_RETURN_IF_ERROR(floats(&next_pre_, R * hc));
  KVTIER_RETURN_IF_ERROR(floats(&post_, R * hc));
  KVTIER_RETURN_IF_ERROR(floats(&comb_, R * hc * hc));
  KVTIER_RETURN_IF_ERROR(floats(&xn_, R * D));
  KVTIER_RETURN_IF_ERROR(floats(&f_, R * D));
  KVTIER_RETURN_IF_ERROR(floats(&r_, R));
  KVTIER_RETURN_IF_ERROR(floats(&mixes_, R * m));
  KVTIER_RETURN_IF_ERROR(floats(&logits_, R * wide));
  KVTIER_RETURN_IF_ERROR(floats(&weight_, R * K));
  KVTIER_RETURN_IF_ERROR(floats(&routed_, R * K * D));
  KVTIER_RETURN_IF_ERROR(floats(&g_, R * K * I));
  KVTIER_RETURN_IF_ERROR(floats(&shared_, R * D));
  KVTIER_RETURN_IF_ERROR(floats(&sg_, R * Is));
  KVTIER_RETURN_IF_ERROR(floats(&head_x_, R * hc * D));
  KVTIER_RETURN_IF_ERROR(floats(&head_pre_, R * hc));
  KVTIER_RETURN_IF_ERROR(floats(&qr_, R * ql));
  KVTIER_RETURN_IF_ERROR(floats(&products_, R * (Hd + 3 * hd + IH * id + IH)));
  KVTIER_RETURN_IF_ERROR(floats(&o_, R * Hd));
  KVTIER_RETURN_IF_ERROR(floats(&oa_, R * G * ol));
  KVTIER_ASSIGN_OR_RETURN(void* ch, alloc(R * K * sizeof(int32_t)));
  chosen_ = static_cast<int32_t*>(ch);
  KVTIER_ASSIGN_OR_RETURN(void* gr, alloc(R * G * sizeof(int32_t)));
  groups_ = static_cast<int32_t*>(gr);
  std::vector<int32_t> group_of(R * G);
  for (size_t r = 0; r < group_of.size(); ++r) group_of[r] = static_cast<int32_t>(r % G);
  KVTIER_RETURN_IF_ERROR(
      backend_->ToDevice(groups_, group_of.data(), group_of.size() * sizeof(int32_t)));
  KVTIER_ASSIGN_OR_RETURN(void* hr, alloc(R * sizeof(int64_t)));
  head_rows_ = static_cast<int64_t*>(hr);
  capacity_ = rows;
  return Status::Ok();
}

Status DeviceLayers::Begin(int n, const float* x, const float* pre) {
  if (n < 1 || static_cast<size_t>(n) > kMaxTokensPerCall)
    return Status::InvalidArgument("device layers: a pass of 1 to kMaxTokensPerCall rows");
  KVTIER_RETURN_IF_ERROR(EnsureRows(n));
  n_ = n;
  products_layer_ = -1;
  attention_layer_ = -1;
  const size_t hc = config_.hc_mult, D = config_.hidden_size;
  KVTIER_RETURN_IF_ERROR(backend_->ToDevice(x_, x, n * hc * D * sizeof(float)));
  return backend_->ToDevice(pre_, pre, n * hc * sizeof(float));
}

Status DeviceLayers::Residual(float* x) {
  return backend_->ToHost(
      x, x_, static_cast<size_t>(n_) * config_.hc_mult * config_.hidden_size * sizeof(float));
}

Status DeviceLayers::Pre(float* pre) {
  return backend_->ToHost(pre, pre_, static_cast<size_t>(n_) * config_.hc_mult * sizeof(float));
}

Status DeviceLayers::SetResidual(const float* x) {
  return backend_->ToDevice(
      x_, x, static_cast<size_t>(n_) * config_.hc_mult * config_.hidden_size * sizeof(float));
}

Status DeviceLayers::MixesAndInput(const Layer& l, int s) {
  const EngineConfig& c = config_;
  const int D = c.hidden_size, hc = c.hc_mult, m = (2 + hc) * hc;
  const int64_t n = n_;
  // The mixes (HcMixesRows): scale, products, then pre / post / comb.
  KVTIER_RETURN_IF_ERROR(Run(RowRsqrtKernel{x_, hc * D, c.rms_norm_eps, r_, n}));
  KVTIER_RETURN_IF_ERROR(Run(MixDotsKernel{l.hc_fn[s], m, x_, hc * D, r_, mixes_, n * m}));
  KVTIER_RETURN_IF_ERROR(
      Run(MixOutputsKernel{mixes_, hc, l.hc_scale[s], l.hc_base[s], c.hc_sinkhorn_iters,
                           static_cast<float>(c.hc_eps), next_pre_, post_, comb_, n}));
  // The sublayer's input (PreMix): the streams weighted by pre, then RmsNorm.
  KVTIER_RETURN_IF_ERROR(Run(PreMixKernel{x_, pre_, hc, D, xn_, n * D}));
  KVTIER_RETURN_IF_ERROR(Run(RowRsqrtKernel{xn_, D, c.rms_norm_eps, r_, n}));
  return Run(ScaleRowsKernel{xn_, r_, l.norm[s], D, n * D});
}

Status DeviceLayers::MixSublayer() {
  const int D = config_.hidden_size, hc = config_.hc_mult;
  KVTIER_RETURN_IF_ERROR(
      Run(MixSublayerKernel{x_, f_, post_, comb_, hc, D, static_cast<int64_t>(n_) * D}));
  std::swap(pre_, next_pre_);  // the next sublayer's pre
  return Status::Ok();
}

Status DeviceLayers::AttentionInput(int layer, float* xn) {
  if (layer < 0 || layer >= static_cast<int>(layers_.size()) || n_ == 0)
    return Status::InvalidArgument("device layers: no such layer or no pass");
  KVTIER_RETURN_IF_ERROR(MixesAndInput(layers_[layer], 0));
  if (xn == nullptr) return Status::Ok();
  return backend_->ToHost(xn, xn_, static_cast<size_t>(n_) * config_.hidden_size * sizeof(float));
}

Status DeviceLayers::AttentionProducts(int layer, const AttentionRows& rows) {
  if (layer < 0 || layer >= static_cast<int>(layers_.size()) || n_ == 0)
    return Status::InvalidArgument("device layers: no such layer or no pass");
  if (rows.kv == nullptr || (rows.iq == nullptr) != (rows.wts == nullptr))
    return Status::InvalidArgument("device layers: kv, and iq with wts, are needed");
  const Layer& l = layers_[layer];
  if ((rows.iq != nullptr && (l.i_wproj == nullptr || l.i_wq_b == nullptr)) ||
      (rows.ckv != nullptr && l.c_wkv == nullptr) ||
      (rows.cgate != nullptr && l.c_wgate == nullptr))
    return Status::InvalidArgument("device layers: a product of a weight this layer lacks");
  const EngineConfig& c = config_;
  const int D = c.hidden_size, Hd = c.num_attention_heads * c.head_dim, hd = c.head_dim;
  const int ql = c.q_lora_rank, IH = c.index_n_heads, iqd = IH * c.index_head_dim;
  const int64_t n = n_;
  // The products side by side in products_ (q always, the others asked for; n rows each).
  struct Section {
    float* host;
    int64_t width;
    float* dev;
  };
  Section sections[] = {{rows.q, Hd, nullptr},   {rows.kv, hd, nullptr},
                        {rows.iq, iqd, nullptr}, {rows.wts, IH, nullptr},
                        {rows.ckv, hd, nullptr}, {rows.cgate, hd, nullptr}};
  float* end = products_;
  for (Section& sec : sections) {
    if (sec.host == nullptr && &sec != &sections[0]) continue;
    sec.dev = end;
    end += n * sec.width;
  }
  float *q = sections[0].dev, *kv = sections[1].dev, *iq = sections[2].dev;
  float *wts = sections[3].dev, *ckv = sections[4].dev, *cgate = sections[5].dev;
  // AttnProducts' order: the products of x, q's low rank normed, its products, kv normed.
  KVTIER_RETURN_IF_ERROR(Run(MatMulKernel{xn_, D, l.wq_a, ql, qr_, n * ql}));
  KVTIER_RETURN_IF_ERROR(Run(MatMulKernel{xn_, D, l.wkv, hd, kv, n * hd}));
  if (rows.wts != nullptr)
    KVTIER_RETURN_IF_ERROR(Run(MatMulKernel{xn_, D, l.i_wproj, IH, wts, n * IH}));
  if (rows.ckv != nullptr)
    KVTIER_RETURN_IF_ERROR(Run(MatMulKernel{xn_, D, l.c_wkv, hd, ckv, n * hd}));
  if (rows.cgate != nullptr)
    KVTIER_RETURN_IF_ERROR(Run(MatMulKernel{xn_, D, l.c_wgate, hd, cgate, n * hd}));
  KVTIER_RETURN_IF_ERROR(Run(RowRsqrtKernel{qr_, ql, c.rms_norm_eps, r_, n}));
  KVTIER_RETURN_IF_ERROR(Run(ScaleRowsKernel{qr_, r_, l.q_norm, ql, n * ql}));
  KVTIER_RETURN_IF_ERROR(Run(MatMulKernel{qr_, ql, l.wq_b, Hd, q, n * Hd}));
  if (rows.iq != nullptr)
    KVTIER_RETURN_IF_ERROR(Run(MatMulKernel{qr_, ql, l.i_wq_b, iqd, iq, n * iqd}));
  KVTIER_RETURN_IF_ERROR(Run(RowRsqrtKernel{kv, hd, c.rms_norm_eps, r_, n}));
  KVTIER_RETURN_IF_ERROR(Run(ScaleRowsKernel{kv, r_, l.kv_norm, hd, n * hd}));
  products_layer_ = layer;
  attention_layer_ = -1;
  // One copy to the host for all those asked for (a GPU's copy costs a synchronisation), then
  // each to its destination; q is downloaded only when asked for.
  float* first = rows.q != nullptr ? products_ : sections[1].dev;
  const size_t used = static_cast<size_t>(end - first);
  if (staging_.size() < used) staging_.resize(used);
  KVTIER_RETURN_IF_ERROR(backend_->ToHost(staging_.data(), first, used * sizeof(float)));
  for (const Section& sec : sections) {
    if (sec.host != nullptr) {
      std::memcpy(sec.host, staging_.data() + (sec.dev - first),
                  static_cast<size_t>(n * sec.width) * sizeof(float));
    }
  }
  return Status::Ok();
}

namespace {

// Offset of a section of `bytes` after `*end` in the upload, aligned to 16 bytes.
size_t UploadSection(size_t* end, size_t bytes) {
  const size_t at = (*end + 15) / 16 * 16;
  *end = at + bytes;
  return at;
}

}  // namespace

Status DeviceLayers::Attention(int layer, const AttentionKeys& k) {
  if (layer < 0 || layer >= static_cast<int>(layers_.size()) || n_ == 0)
    return Status::InvalidArgument("device layers: no such layer or no pass");
  if (products_layer_ != layer)
    return Status::InvalidArgument("device layers: attention without this layer's products");
  const EngineConfig& c = config_;
  const int64_t n = n_, H = c.num_attention_heads, hd = c.head_dim;
  const int pairs = c.qk_rope_head_dim / 2;
  if (k.main < 0 || k.swa < 0 || k.uploaded < 0 || k.key_off == nullptr || k.rope_c == nullptr ||
      k.rope_s == nullptr ||
      (k.main > 0 && (k.main_source == nullptr || k.main_entry == nullptr)) ||
      (k.swa > 0 && (k.swa_source == nullptr || k.swa_entry == nullptr)) ||
      (k.uploaded > 0 && (k.swa_data == nullptr || k.swa_scales == nullptr)))
    return Status::InvalidArgument("device layers: attention keys or rotations missing");
  if (k.main + k.swa > INT32_MAX || k.uploaded > INT32_MAX)
    return Status::InvalidArgument("device layers: more attention keys than an index holds");
  std::vector<const void*>& ids = source_ids_;
  ids.clear();
  for (const KvSource& s : k.sources) {
    if (s.id == nullptr || s.entries < 0 || s.entries > INT32_MAX || s.parent_keep < 0 ||
        (s.entries > 0 && (s.data == nullptr || s.scales == nullptr)))
      return Status::InvalidArgument("device layers: a KV source without identity or bytes");
    ids.push_back(s.id);
  }
  for (const SwaSource& r : k.rings) {
    if (r.id == nullptr || r.slots < 1 || r.slots > INT32_MAX || r.stamps == nullptr ||
        r.data == nullptr || r.scales == nullptr)
      return Status::InvalidArgument("device layers: an SWA ring without identity or bytes");
    ids.push_back(r.id);
  }
  std::sort(ids.begin(), ids.end());
  if (std::adjacent_find(ids.begin(), ids.end()) != ids.end())
    return Status::InvalidArgument("device layers: a KV source or SWA ring twice");
  for (int64_t i = 0; i < k.main; ++i) {
    const int32_t src = k.main_source[i];
    if (src < 0 || static_cast<size_t>(src) >= k.sources.size() || k.main_entry[i] < 0 ||
        k.main_entry[i] >= k.sources[src].entries)
      return Status::InvalidArgument("device layers: a global entry outside its source");
  }
  const int32_t nr = static_cast<int32_t>(k.rings.size());  // the uploaded entries' source
  for (int64_t i = 0; i < k.swa; ++i) {
    const int32_t src = k.swa_source[i], e = k.swa_entry[i];
    const bool ok =
        src >= 0 && src <= nr && e >= 0 &&
        (src < nr ? e < k.rings[src].slots && k.rings[src].stamps[e] != 0 : e < k.uploaded);
    if (!ok) return Status::InvalidArgument("device layers: an SWA entry outside its ring");
  }
  // The lists: offsets from 0, each row with 1 to kMaxAttentionKeysPerRow keys, every index in
  // the table (a kernel trusts them).
  if (k.key_off[0] != 0) return Status::InvalidArgument("device layers: key offsets not from 0");
  for (int64_t t = 0; t < n; ++t) {
    const int64_t nk = static_cast<int64_t>(k.key_off[t + 1]) - k.key_off[t];
    if (nk < 1 || nk > kMaxAttentionKeysPerRow)
      return Status::InvalidArgument("device layers: a row with no keys or too many");
  }
  const int64_t total = k.key_off[n];
  if (total > 0 && k.keys == nullptr)
    return Status::InvalidArgument("device layers: attention keys or rotations missing");
  const int64_t table = k.main + k.swa;
  for (int64_t i = 0; i < total; ++i) {
    if (k.keys[i] < 0 || k.keys[i] >= table)
      return Status::InvalidArgument("device layers: an attention key outside the table");
  }
  // The mirrors: each cache's with room for all its entries, each ring's with its slots; what
  // each lacks becomes runs of the upload, scattered into place on the device.
  ++attention_calls_;
  const size_t sdb = hd, ssb = hd / 32;
  std::vector<Mirror*>& mirror_of = mirror_of_;
  std::vector<Mirror*>& ring_mirror_of = ring_mirror_of_;
  mirror_of.assign(k.sources.size(), nullptr);
  ring_mirror_of.assign(k.rings.size(), nullptr);
  run_dst_.clear();
  run_begin_.assign(1, 0);
  run_src_.clear();
  for (size_t i = 0; i < k.sources.size(); ++i)
    KVTIER_RETURN_IF_ERROR(PrepareMirror(k.sources[i], &mirror_of[i]));
  for (size_t i = 0; i < k.rings.size(); ++i)
    KVTIER_RETURN_IF_ERROR(PrepareRingMirror(k.rings[i], &ring_mirror_of[i]));
  // One upload: the new bytes and where they go, the mirrors' addresses (the caches' codes and
  // scales, then the rings' and the uploaded SWA entries' as source nr), the table's entries, the
  // uploaded SWA entries' bytes, the lists and the rotations.
  const int runs = static_cast<int>(run_dst_.size());
  const size_t ns = k.sources.size(), nw = k.rings.size() + 1;
  size_t end = 0;
  const size_t fresh = UploadSection(&end, static_cast<size_t>(run_begin_.back()));
  const size_t fresh_begin = UploadSection(&end, run_begin_.size() * sizeof(int64_t));
  const size_t fresh_dst = UploadSection(&end, run_dst_.size() * sizeof(uint8_t*));
  const size_t mirrors = UploadSection(&end, (2 * ns + 2 * nw) * sizeof(const uint8_t*));
  const size_t main_source = UploadSection(&end, k.main * sizeof(int32_t));
  const size_t main_entry = UploadSection(&end, k.main * sizeof(int32_t));
  const size_t swa_source = UploadSection(&end, k.swa * sizeof(int32_t));
  const size_t swa_entry = UploadSection(&end, k.swa * sizeof(int32_t));
  const size_t swa_data = UploadSection(&end, k.uploaded * sdb),
               swa_scales = UploadSection(&end, k.uploaded * ssb);
  const size_t keys = UploadSection(&end, total * sizeof(int32_t));
  const size_t key_off = UploadSection(&end, (n + 1) * sizeof(int32_t));
  const size_t rope_c = UploadSection(&end, n * pairs * sizeof(float));
  const size_t rope_s = UploadSection(&end, n * pairs * sizeof(float));
  KVTIER_RETURN_IF_ERROR(Grow(&key_upload_, &key_upload_bytes_, end));
  KVTIER_RETURN_IF_ERROR(Grow(&keys_f_, &keys_f_bytes_, table * hd * sizeof(float)));
  uint8_t* d = static_cast<uint8_t*>(key_upload_);
  mirror_ptrs_.resize(2 * ns + 2 * nw);
  for (size_t i = 0; i < ns; ++i) {
    mirror_ptrs_[i] = mirror_of[i]->data;
    mirror_ptrs_[ns + i] = mirror_of[i]->scales;
  }
  for (size_t i = 0; i + 1 < nw; ++i) {
    mirror_ptrs_[2 * ns + i] = ring_mirror_of[i]->data;
    mirror_ptrs_[2 * ns + nw + i] = ring_mirror_of[i]->scales;
  }
  mirror_ptrs_[2 * ns + nw - 1] = d + swa_data;
  mirror_ptrs_[2 * ns + 2 * nw - 1] = d + swa_scales;
  if (key_staging_.size() < end) key_staging_.resize(end);
  uint8_t* h = key_staging_.data();
  auto put = [&](size_t at, const void* src, size_t bytes) {
    if (bytes > 0) std::memcpy(h + at, src, bytes);
  };
  for (int r = 0; r < runs; ++r)
    put(fresh + static_cast<size_t>(run_begin_[r]), run_src_[r].first, run_src_[r].second);
  put(fresh_begin, run_begin_.data(), run_begin_.size() * sizeof(int64_t));
  put(fresh_dst, run_dst_.data(), run_dst_.size() * sizeof(uint8_t*));
  put(mirrors, mirror_ptrs_.data(), mirror_ptrs_.size() * sizeof(const uint8_t*));
  put(main_source, k.main_source, k.main * sizeof(int32_t));
  put(main_entry, k.main_entry, k.main * sizeof(int32_t));
  put(swa_source, k.swa_source, k.swa * sizeof(int32_t));
  put(swa_entry, k.swa_entry, k.swa * sizeof(int32_t));
  put(swa_data, k.swa_data, k.uploaded * sdb);
  put(swa_scales, k.swa_scales, k.uploaded * ssb);
  put(keys, k.keys, total * sizeof(int32_t));
  put(key_off, k.key_off, (n + 1) * sizeof(int32_t));
  put(rope_c, k.rope_c, n * pairs * sizeof(float));
  put(rope_s, k.rope_s, n * pairs * sizeof(float));
  KVTIER_RETURN_IF_ERROR(backend_->ToDevice(key_upload_, h, end));
  const auto* d_keys = reinterpret_cast<const int32_t*>(d + keys);
  const auto* d_off = reinterpret_cast<const int32_t*>(d + key_off);
  const auto* d_c = reinterpret_cast<const float*>(d + rope_c);
  const auto* d_s = reinterpret_cast<const float*>(d + rope_s);
  const auto* d_mirrors = reinterpret_cast<const uint8_t* const*>(d + mirrors);
  float* keys_f = static_cast<float*>(keys_f_);
  float* q = products_;
  const int H32 = static_cast<int>(H), hd32 = static_cast<int>(hd);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));  // AttnCore's
  if (runs > 0) {
    KVTIER_RETURN_IF_ERROR(Run(ScatterBytesKernel{
        d + fresh, reinterpret_cast<const int64_t*>(d + fresh_begin),
        reinterpret_cast<uint8_t* const*>(d + fresh_dst), runs, run_begin_.back()}));
  }
  MirrorsHold(k);
  KVTIER_RETURN_IF_ERROR(Run(RopeRowsKernel{q, H32, hd32, pairs, d_c, d_s, n * H * pairs}));
  if (k.main > 0) {  // none on an SWA-only layer
    KVTIER_RETURN_IF_ERROR(Run(DecodeFp4KeysKernel{
        d_mirrors, d_mirrors + ns, reinterpret_cast<const int32_t*>(d + main_source),
        reinterpret_cast<const int32_t*>(d + main_entry), hd32 / 16, keys_f, k.main * hd / 16}));
  }
  if (k.swa > 0) {
    KVTIER_RETURN_IF_ERROR(
        Run(DecodeFp8KeysKernel{d_mirrors + 2 * ns, d_mirrors + 2 * ns + nw,
                                reinterpret_cast<const int32_t*>(d + swa_source),
                                reinterpret_cast<const int32_t*>(d + swa_entry), hd32 / 32,
                                keys_f + k.main * hd, k.swa * hd / 32}));
  }
  // The rows in groups whose weights (rows x heads x the group's most keys) fit the limit; each
  // group's kernels see its rows from 0 (every pointer moved to the group's first row; the
  // offsets stay indices into the whole list).
  const int64_t cap_floats =
      std::max<int64_t>(static_cast<int64_t>(attention_weights_bytes_max_ / sizeof(float)), 1);
  for (int64_t r0 = 0; r0 < n;) {
    int64_t r1 = r0, stride = 0;
    while (r1 < n) {
      const int64_t s = std::max<int64_t>(stride, k.key_off[r1 + 1] - k.key_off[r1]);
      if (r1 > r0 && (r1 - r0 + 1) * H * s > cap_floats) break;
      stride = s;
      ++r1;
    }
    const int64_t rows = r1 - r0;
    KVTIER_RETURN_IF_ERROR(Grow(&attn_w_, &attn_w_bytes_, rows * H * stride * sizeof(float)));
    float* w = static_cast<float*>(attn_w_);
    const float* qg = q + r0 * H * hd;
    const int32_t* offg = d_off + r0;
    const float *cg = d_c + r0 * pairs, *sg = d_s + r0 * pairs;
    const int st32 = static_cast<int>(stride);
    KVTIER_RETURN_IF_ERROR(Run(
        AttnDotsKernel{qg, H32, hd32, keys_f, d_keys, offg, scale, st32, w, rows * H * stride}));
    KVTIER_RETURN_IF_ERROR(
        Run(AttnSoftmaxKernel{layers_[layer].sink, H32, offg, st32, w, rows * H}));
    KVTIER_RETURN_IF_ERROR(Run(AttnSumsKernel{w, H32, hd32, pairs, keys_f, d_keys, offg, st32, cg,
                                              sg, o_ + r0 * H * hd, rows * H * hd}));
    r0 = r1;
  }
  products_layer_ = -1;  // q is rotated now
  attention_layer_ = layer;
  return Status::Ok();
}

Status DeviceLayers::AttentionOutput(int layer, const float* o) {
  if (layer < 0 || layer >= static_cast<int>(layers_.size()) || n_ == 0)
    return Status::InvalidArgument("device layers: no such layer or no pass");
  const Layer& l = layers_[layer];
  const EngineConfig& c = config_;
  const int D = c.hidden_size, Hd = c.num_attention_heads * c.head_dim;
  const int G = c.o_groups, ol = c.o_lora_rank, gin = Hd / G;
  const int64_t n = n_;
  if (o != nullptr) {
    KVTIER_RETURN_IF_ERROR(backend_->ToDevice(o_, o, static_cast<size_t>(n * Hd) * sizeof(float)));
  } else if (attention_layer_ != layer) {
    return Status::InvalidArgument("device layers: no heads' outputs of this layer on the device");
  }
  attention_layer_ = -1;
  // Rows t * G + g of o (gin wide) each through group g's matrix: oa [n x G * ol] directly.
  KVTIER_RETURN_IF_ERROR(Run(PerRowMatMulKernel{o_, gin, ol, groups_, l.wo_a, oa_, n * G * ol}));
  KVTIER_RETURN_IF_ERROR(Run(MatMulKernel{oa_, G * ol, l.wo_b, D, f_, n * D}));
  return MixSublayer();
}

Status DeviceLayers::Ffn(int layer) {
  if (layer < 0 || layer >= static_cast<int>(layers_.size()) || n_ == 0)
    return Status::InvalidArgument("device layers: no such layer or no pass");
  const Layer& l = layers_[layer];
  const EngineConfig& c = config_;
  const int D = c.hidden_size, E = c.n_routed_experts, K = c.num_experts_per_tok;
  const int I = c.moe_intermediate_size, Is = I * c.n_shared_experts;
  const float limit = static_cast<float>(c.swiglu_limit);
  const int64_t n = n_;
  KVTIER_RETURN_IF_ERROR(MixesAndInput(l, 1));
  // Router, then each (row, slot)'s expert, then the shared expert, then their sum.
  KVTIER_RETURN_IF_ERROR(Run(MatMulKernel{xn_, D, l.gate, E, logits_, n * E}));
  KVTIER_RETURN_IF_ERROR(
      Run(RouteKernel{logits_, l.gate_bias, E, K, c.norm_topk_prob,
                      static_cast<float>(c.routed_scaling_factor), chosen_, weight_, n}));
  KVTIER_RETURN_IF_ERROR(
      Run(SwigluUpKernel{xn_, D, I, K, chosen_, weight_, l.w1, l.w3, limit, g_, n * K * I}));
  KVTIER_RETURN_IF_ERROR(Run(PerRowMatMulKernel{g_, I, D, chosen_, l.w2, routed_, n * K * D}));
  if (l.s_w1 != nullptr) {
    KVTIER_RETURN_IF_ERROR(
        Run(SwigluUpKernel{xn_, D, Is, 1, nullptr, nullptr, l.s_w1, l.s_w3, limit, sg_, n * Is}));
    KVTIER_RETURN_IF_ERROR(Run(PerRowMatMulKernel{sg_, Is, D, nullptr, l.s_w2, shared_, n * D}));
  }
  KVTIER_RETURN_IF_ERROR(
      Run(CombineKernel{routed_, l.s_w1 != nullptr ? shared_ : nullptr, K, D, f_, n * D}));
  return MixSublayer();
}

Status DeviceLayers::Head(std::span<const int64_t> rows, float* logits) {
  if (n_ == 0) return Status::InvalidArgument("device layers: no pass");
  const EngineConfig& c = config_;
  const int D = c.hidden_size, hc = c.hc_mult, V = c.vocab_size;
  const float* x = x_;
  const float* pre = pre_;
  int64_t k = n_;
  if (!rows.empty()) {
    for (int64_t r : rows) {
      if (r < 0 || r >= n_) return Status::InvalidArgument("device layers: head row out of range");
    }
    k = static_cast<int64_t>(rows.size());
    if (k > n_) return Status::InvalidArgument("device layers: more head rows than the pass");
    KVTIER_RETURN_IF_ERROR(backend_->ToDevice(head_rows_, rows.data(), k * sizeof(int64_t)));
    KVTIER_RETURN_IF_ERROR(Run(GatherRowsKernel{x_, head_rows_, hc * D, head_x_, k * hc * D}));
    KVTIER_RETURN_IF_ERROR(Run(GatherRowsKernel{pre_, head_rows_, hc, head_pre_, k * hc}));
    x = head_x_;
    pre = head_pre_;
  }
  // Engine::Head: PreMix with the final norm, then the head's product.
  KVTIER_RETURN_IF_ERROR(Run(PreMixKernel{x, pre, hc, D, xn_, k * D}));
  KVTIER_RETURN_IF_ERROR(Run(RowRsqrtKernel{xn_, D, c.rms_norm_eps, r_, k}));
  KVTIER_RETURN_IF_ERROR(Run(ScaleRowsKernel{xn_, r_, norm_w_, D, k * D}));
  KVTIER_RETURN_IF_ERROR(Run(MatMulKernel{xn_, D, head_w_, V, logits_, k * V}));
  return backend_->ToHost(logits, logits_, static_cast<size_t>(k) * V * sizeof(float));
}

}  // namespace kvtier::engine::device
