#include "engine/weights.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "engine/engram.h"
#include "kernels/quant.h"

namespace kvtier::engine {

namespace {

uint64_t SplitMix64(uint64_t* state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

uint64_t Fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return h;
}

// Uniform in [-1, 1): 24 random bits.
float UniformSym(uint64_t* state) {
  return static_cast<float>(SplitMix64(state) >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

std::string L(int l) { return "layers." + std::to_string(l) + "."; }

}  // namespace

StatusOr<std::vector<int64_t>> EngramTableRows(const EngineConfig& c) {
  if (c.engram_layer_ids.empty()) return std::vector<int64_t>{};
  EngramHashParams p;
  p.layer_ids = c.engram_layer_ids;
  p.max_ngram_size = c.engram_max_ngram_size;
  p.n_head_per_ngram = c.engram_n_heads;
  p.engram_vocab_size = c.engram_vocab_size;
  p.tokenizer_vocab_size = c.engram_compressed_vocab_size;
  p.pad_id = c.engram_pad_token_id;
  p.seed = static_cast<uint64_t>(c.engram_seed);
  KVTIER_ASSIGN_OR_RETURN(EngramHashing h, EngramHashing::Create(p));
  std::vector<int64_t> rows;
  for (int s = 0; s < h.num_layers(); ++s) rows.push_back(h.num_embeddings(s));
  return rows;
}

std::vector<WeightSpec> WeightSpecs(const EngineConfig& c) {
  std::vector<WeightSpec> v;
  auto add = [&](std::string name, std::vector<int64_t> shape, InitKind init, float gain = 1.0f,
                 std::string dtype = "F32") {
    v.push_back({std::move(name), std::move(dtype), std::move(shape), init, gain});
  };
  const int64_t D = c.hidden_size, V = c.vocab_size, H = c.num_attention_heads;
  const int64_t hd = c.head_dim, hc = c.hc_mult, M = c.hc_mix_count();
  add("embed.weight", {V, D}, InitKind::kUniform, 1.0f);
  add("norm.weight", {D}, InitKind::kOnes);
  add("head.weight", {V, D}, InitKind::kLinear);
  auto rows = EngramTableRows(c);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = L(l);
    for (const char* sub : {"attn", "ffn"}) {
      add(p + "hc_" + sub + "_fn", {M, hc * D}, InitKind::kLinear);
      add(p + "hc_" + sub + "_scale", {3}, InitKind::kHcScale, 0.5f);
      add(p + "hc_" + sub + "_base", {M}, InitKind::kHcBase, 1.0f);
    }
    add(p + "attn_norm.weight", {D}, InitKind::kOnes);
    add(p + "ffn_norm.weight", {D}, InitKind::kOnes);
    add(p + "attn.wq_a.weight", {c.q_lora_rank, D}, InitKind::kLinear);
    add(p + "attn.q_norm.weight", {c.q_lora_rank}, InitKind::kOnes);
    add(p + "attn.wq_b.weight", {H * hd, c.q_lora_rank}, InitKind::kLinear);
    add(p + "attn.wkv.weight", {hd, D}, InitKind::kLinear);
    add(p + "attn.kv_norm.weight", {hd}, InitKind::kOnes);
    add(p + "attn.wo_a.weight", {c.o_groups * c.o_lora_rank, (H / c.o_groups) * hd},
        InitKind::kLinear);
    add(p + "attn.wo_b.weight", {D, c.o_groups * c.o_lora_rank}, InitKind::kLinear, 0.5f);
    add(p + "attn.attn_sink", {H}, InitKind::kUniform, 0.5f);
    if (c.IsKvSource(l)) {
      add(p + "attn.compressor.wkv.weight", {hd, D}, InitKind::kLinear);
      if (c.ratio(l) > 1) add(p + "attn.compressor.wgate.weight", {hd, D}, InitKind::kLinear);
      add(p + "attn.compressor.norm.weight", {hd}, InitKind::kOnes);
      add(p + "attn.indexer.wk.weight", {c.index_head_dim, hd}, InitKind::kLinear);
      add(p + "attn.indexer.k_norm.weight", {c.index_head_dim}, InitKind::kOnes);
      add(p + "attn.indexer.k_norm.bias", {c.index_head_dim}, InitKind::kZeros);
    }
    if (c.IsIndexSource(l)) {
      add(p + "attn.indexer.wq_b.weight", {c.index_n_heads * c.index_head_dim, c.q_lora_rank},
          InitKind::kLinear);
      add(p + "attn.indexer.weights_proj.weight", {c.index_n_heads, D}, InitKind::kLinear);
    }
    add(p + "ffn.gate.weight", {c.n_routed_experts, D}, InitKind::kLinear);
    add(p + "ffn.gate.bias", {c.n_routed_experts}, InitKind::kUniform, 0.1f);
    const int64_t I = c.moe_intermediate_size;
    for (int e = 0; e < c.n_routed_experts; ++e) {
      const std::string ep = p + "ffn.experts." + std::to_string(e) + ".";
      add(ep + "w1.weight", {I, D}, InitKind::kLinear);
      add(ep + "w3.weight", {I, D}, InitKind::kLinear);
      add(ep + "w2.weight", {D, I}, InitKind::kLinear, 0.5f);
    }
    if (c.n_shared_experts > 0) {
      const int64_t IS = I * c.n_shared_experts;
      add(p + "ffn.shared_experts.w1.weight", {IS, D}, InitKind::kLinear);
      add(p + "ffn.shared_experts.w3.weight", {IS, D}, InitKind::kLinear);
      add(p + "ffn.shared_experts.w2.weight", {D, IS}, InitKind::kLinear, 0.5f);
    }
    const int slot = c.EngramSlot(l);
    if (slot >= 0 && rows.ok()) {
      const int64_t cols = static_cast<int64_t>(c.engram_max_ngram_size - 1) * c.engram_n_heads;
      const int64_t ed = c.engram_head_dim;
      add(p + "engram.table", {(*rows)[slot], ed}, InitKind::kEngramData, 1.0f, "F8_E4M3");
      add(p + "engram.table_scale", {(*rows)[slot], ed / 32}, InitKind::kEngramScale, 1.0f,
          "F8_E8M0");
      add(p + "engram.wkv.weight", {(hc + 1) * D, cols * ed}, InitKind::kLinear);
      add(p + "engram.q_norm.weight", {hc, D}, InitKind::kOnes);
      add(p + "engram.k_norm.weight", {hc, D}, InitKind::kOnes);
    }
  }
  return v;
}

const Tensor* ModelWeights::Find(const std::string& name) const {
  auto it = file.tensors.find(name);
  return it == file.tensors.end() ? nullptr : &it->second;
}

const float* ModelWeights::F32(const std::string& name) const {
  const Tensor* t = Find(name);
  return (t == nullptr || t->dtype != "F32") ? nullptr : t->f32();
}

uint64_t WeightBytes(const EngineConfig& c) {
  uint64_t total = 0;
  for (const WeightSpec& s : WeightSpecs(c)) {
    uint64_t bytes = s.dtype == "F32" ? 4 : 1;
    for (int64_t d : s.shape) {
      if (d < 0 || __builtin_mul_overflow(bytes, static_cast<uint64_t>(d), &bytes))
        return UINT64_MAX;
    }
    if (__builtin_add_overflow(total, bytes, &total)) return UINT64_MAX;
  }
  return total;
}

StatusOr<ModelWeights> InitWeights(const EngineConfig& c, uint64_t seed) {
  if (auto rows = EngramTableRows(c); !rows.ok()) return rows.status();
  if (const uint64_t bytes = WeightBytes(c); bytes > kInitWeightsBytesMax) {
    return Status::InvalidArgument(
        "config: its parameters take " +
        (bytes == UINT64_MAX ? std::string("more than 2^64") : std::to_string(bytes)) +
        " bytes, over the " + std::to_string(kInitWeightsBytesMax) +
        " that deterministic weights may take (kInitWeightsBytesMax)");
  }
  ModelWeights w;
  w.file.metadata["format"] = "kvtier-engine";
  w.file.metadata["init_seed"] = std::to_string(seed);
  const std::vector<WeightSpec> specs = WeightSpecs(c);
  for (size_t si = 0; si < specs.size(); ++si) {
    const WeightSpec& s = specs[si];
    if (s.init == InitKind::kEngramScale) continue;  // made with its data tensor
    Tensor t;
    t.dtype = s.dtype;
    t.shape = s.shape;
    const int64_t n = t.NumElements();
    uint64_t state = seed ^ Fnv1a(s.name);
    if (s.init == InitKind::kEngramData) {
      const int64_t rows = s.shape[0], dim = s.shape[1];
      std::vector<float> x(static_cast<size_t>(rows * dim));
      for (float& f : x) f = UniformSym(&state);
      t.bytes.resize(static_cast<size_t>(rows * dim));
      Tensor sc;
      sc.dtype = "F8_E8M0";
      sc.shape = {rows, dim / 32};
      sc.bytes.resize(static_cast<size_t>(rows * (dim / 32)));
      KVTIER_RETURN_IF_ERROR(kernels::Quantize(kernels::QuantFormat::kFp8Ue8m0x32, x.data(), rows,
                                               dim, t.bytes.data(), sc.bytes.data(),
                                               kernels::Backend::kReference));
      // The scale tensor's spec follows its data tensor.
      w.file.tensors.emplace(specs[si + 1].name, std::move(sc));
      w.file.tensors.emplace(s.name, std::move(t));
      continue;
    }
    t.bytes.resize(static_cast<size_t>(n) * 4);
    float* f = t.f32();
    switch (s.init) {
      case InitKind::kLinear: {
        const float a = s.gain * std::sqrt(3.0f / static_cast<float>(s.shape.back()));
        for (int64_t i = 0; i < n; ++i) f[i] = a * UniformSym(&state);
        break;
      }
      case InitKind::kOnes:
        for (int64_t i = 0; i < n; ++i) f[i] = s.gain;
        break;
      case InitKind::kZeros:
        for (int64_t i = 0; i < n; ++i) f[i] = 0.0f;
        break;
      case InitKind::kUniform:
        for (int64_t i = 0; i < n; ++i) f[i] = s.gain * UniformSym(&state);
        break;
      case InitKind::kHcScale:
        f[0] = s.gain;
        f[1] = s.gain;
        f[2] = s.gain * 0.5f;
        break;
      case InitKind::kHcBase: {
        const int hc = c.hc_mult;
        for (int64_t i = 0; i < n; ++i) f[i] = 0.0f;
        for (int i = 0; i < hc; ++i) f[2 * hc + i * hc + i] = s.gain;
        break;
      }
      default:
        return Status::Internal("weights: unexpected init kind");
    }
    w.file.tensors.emplace(s.name, std::move(t));
  }
  return w;
}

namespace {

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

// Every spec'd tensor present with its shape; `widen`: F16/BF16 also accepted for F32 specs.
Status CheckSpecs(const EngineConfig& c, const TensorFile& file, bool widen) {
  for (const WeightSpec& s : WeightSpecs(c)) {
    auto it = file.tensors.find(s.name);
    if (it == file.tensors.end()) return Status::InvalidArgument("weights: missing " + s.name);
    const Tensor& t = it->second;
    const bool dtype_ok = t.dtype == s.dtype ||
                          (widen && s.dtype == "F32" && (t.dtype == "F16" || t.dtype == "BF16"));
    if (!dtype_ok)
      return Status::InvalidArgument("weights: " + s.name + " has dtype " + t.dtype +
                                     ", expected " + s.dtype +
                                     (widen && s.dtype == "F32" ? " (or F16, BF16)" : ""));
    if (t.shape != s.shape)
      return Status::InvalidArgument("weights: " + s.name + " has shape " + ShapeText(t.shape) +
                                     ", expected " + ShapeText(s.shape));
  }
  return Status::Ok();
}

}  // namespace

Status CheckWeights(const EngineConfig& c, const TensorFile& file) {
  return CheckSpecs(c, file, /*widen=*/false);
}

StatusOr<ModelWeights> LoadWeights(const EngineConfig& c, const std::string& path) {
  // Only the specs' tensors are read, and at most the bytes they take as F32 (F16/BF16 take
  // less): a file's size says nothing about what loading it allocates.
  SafetensorsReadOptions ro;
  ro.max_data_bytes = WeightBytes(c);
  for (const WeightSpec& s : WeightSpecs(c)) ro.only.insert(s.name);
  KVTIER_ASSIGN_OR_RETURN(TensorFile f, ReadSafetensors(path, ro));
  KVTIER_RETURN_IF_ERROR(CheckSpecs(c, f, /*widen=*/true).WithContext(path));
  for (const WeightSpec& s : WeightSpecs(c)) {
    Tensor& t = f.tensors.at(s.name);
    if (s.dtype == "F8_E4M3" || s.dtype == "F8_E8M0") {
      // The FP8 codes that mean NaN (neither format has infinities): e4m3fn S.1111.111, and
      // the ue8m0 scale 0xff (kernels/quant.h), which dequantise whole rows to NaN.
      const bool e4m3 = s.dtype == "F8_E4M3";
      for (size_t i = 0; i < t.bytes.size(); ++i) {
        if (e4m3 ? (t.bytes[i] & 0x7f) == 0x7f : t.bytes[i] == 0xff)
          return Status::InvalidArgument("weights: " + s.name + " element " + std::to_string(i) +
                                         " is NaN (" + s.dtype + " code " +
                                         std::to_string(t.bytes[i]) + ")")
              .WithContext(path);
      }
      continue;
    }
    if (s.dtype != "F32") continue;
    KVTIER_RETURN_IF_ERROR(ConvertToF32(s.name, &t).WithContext(path));
    const float* v = t.f32();
    for (int64_t i = 0, n = t.NumElements(); i < n; ++i) {
      if (!std::isfinite(v[i]))
        return Status::InvalidArgument("weights: " + s.name + " element " + std::to_string(i) +
                                       " is " + (std::isnan(v[i]) ? "NaN" : "infinite"))
            .WithContext(path);
    }
  }
  KVTIER_RETURN_IF_ERROR(CheckWeights(c, f).WithContext(path));
  ModelWeights w;
  w.file = std::move(f);
  return w;
}

}  // namespace kvtier::engine
