#include "engine/config.h"

#include <algorithm>
#include <charconv>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/config.h"
#include "engine/config_json.h"

namespace kvtier::engine {

namespace {

using nlohmann::json;

// Limits that keep a malformed config from allocating absurd amounts of memory.
constexpr int kMaxLayers = 256;
constexpr int kMaxDim = 65536;
constexpr int kMaxVocab = 1 << 22;
constexpr int kMaxExperts = 4096;

template <typename T>
Status Get(const json& j, const char* key, T* out, bool required) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (required) return Status::InvalidArgument(std::string("config: missing key ") + key);
    return Status::Ok();
  }
  if (!internal::ReadJsonValue(*it, out)) {
    return Status::InvalidArgument(std::string("config: bad value for ") + key + " (a JSON " +
                                   it->type_name() +
                                   ": wrong type, not an integer, or out of range)");
  }
  return Status::Ok();
}

bool Contains(const std::vector<int>& v, int x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

}  // namespace

std::string_view LayerModeName(LayerMode mode) {
  switch (mode) {
    case LayerMode::kSwaOnly:
      return "swa";
    case LayerMode::kFull:
      return "full";
    case LayerMode::kReindex:
      return "reindex";
    case LayerMode::kReuse:
      return "reuse";
  }
  return "?";
}

std::string_view ExpertFormatName(ExpertFormat format) {
  return format == ExpertFormat::kMxfp4 ? "mxfp4" : "f32";
}

std::string_view WeightFormatName(WeightFormat format) {
  return format == WeightFormat::kFp8 ? "fp8" : "f32";
}

bool EngineConfig::IsKvSource(int layer) const { return Contains(kv_source_layer_ids, layer); }
bool EngineConfig::IsIndexSource(int layer) const {
  return Contains(index_source_layer_ids, layer);
}
bool EngineConfig::IsEngramLayer(int layer) const { return EngramSlot(layer) >= 0; }
int EngineConfig::EngramSlot(int layer) const {
  for (size_t i = 0; i < engram_layer_ids.size(); ++i) {
    if (engram_layer_ids[i] == layer) return static_cast<int>(i);
  }
  return -1;
}

double EngineConfig::GlobalKvBytesPerToken() const {
  double total = 0;
  for (int s : kv_source_layer_ids) {
    total += static_cast<double>(MainEntryBytes() + IndexEntryBytes()) / compress_ratios[s];
  }
  return total;
}

namespace {

// Appends ";key=value" to *out: integers in decimal, floats as the shortest text that reads
// back to the same double, strings as <bytes>:<text> (so no value can run into the next key),
// lists as [a,b,...].
class DescriptionWriter {
 public:
  explicit DescriptionWriter(std::string* out) : out_(out) {}
  void Int(std::string_view key, int64_t v) { Key(key) += std::to_string(v); }
  void Float(std::string_view key, double v) {
    char buf[64];
    const auto r = std::to_chars(buf, buf + sizeof(buf), v);
    Key(key).append(buf, r.ptr);
  }
  void Text(std::string_view key, std::string_view v) {
    Key(key) += std::to_string(v.size()) + ":";
    *out_ += v;
  }
  template <typename T>
  void List(std::string_view key, const std::vector<T>& v) {
    std::string& o = Key(key);
    o += '[';
    for (size_t i = 0; i < v.size(); ++i) o += (i ? "," : "") + std::to_string(v[i]);
    o += ']';
  }

 private:
  std::string& Key(std::string_view key) {
    *out_ += ';';
    *out_ += key;
    *out_ += '=';
    return *out_;
  }
  std::string* out_;
};

}  // namespace

std::string EngineConfig::CanonicalDescription() const {
  std::string out = "kvtier.engine_config.v1";
  DescriptionWriter w(&out);
  w.Int("vocab_size", vocab_size);
  w.Int("hidden_size", hidden_size);
  w.Int("num_hidden_layers", num_hidden_layers);
  w.Int("num_attention_heads", num_attention_heads);
  w.Int("num_key_value_heads", num_key_value_heads);
  w.Int("head_dim", head_dim);
  w.Int("qk_rope_head_dim", qk_rope_head_dim);
  w.Int("q_lora_rank", q_lora_rank);
  w.Int("o_lora_rank", o_lora_rank);
  w.Int("o_groups", o_groups);
  w.Int("sliding_window", sliding_window);
  w.Float("rms_norm_eps", rms_norm_eps);
  w.Float("rope_theta", rope_theta);
  w.Float("compress_rope_theta", compress_rope_theta);
  w.Text("rope_scaling.type", rope_scaling.type);
  w.Float("rope_scaling.factor", rope_scaling.factor);
  w.Int("rope_scaling.original_max_position_embeddings",
        rope_scaling.original_max_position_embeddings);
  w.Float("rope_scaling.beta_fast", rope_scaling.beta_fast);
  w.Float("rope_scaling.beta_slow", rope_scaling.beta_slow);
  w.Int("max_position_embeddings", max_position_embeddings);
  // One entry per layer: entries past the layers (DSpark's) change nothing the engine computes.
  const size_t layers = static_cast<size_t>(std::max(num_hidden_layers, 0));
  w.List("compress_ratios",
         std::vector<int>(compress_ratios.begin(),
                          compress_ratios.begin() + std::min(layers, compress_ratios.size())));
  w.List("kv_source_layer_ids", kv_source_layer_ids);
  w.List("index_source_layer_ids", index_source_layer_ids);
  w.Int("index_n_heads", index_n_heads);
  w.Int("index_head_dim", index_head_dim);
  w.Int("index_topk", index_topk);
  w.Int("candidate_source_layer_id", candidate_source_layer_id);
  w.Int("candidate_topk_blocks", candidate_topk_blocks);
  w.Int("candidate_block_size", candidate_block_size);
  w.Int("hc_mult", hc_mult);
  w.Int("hc_sinkhorn_iters", hc_sinkhorn_iters);
  w.Float("hc_eps", hc_eps);
  w.Int("n_routed_experts", n_routed_experts);
  w.Int("n_shared_experts", n_shared_experts);
  w.Int("num_experts_per_tok", num_experts_per_tok);
  w.Int("moe_intermediate_size", moe_intermediate_size);
  w.Text("scoring_func", scoring_func);
  w.Text("topk_method", topk_method);
  w.Int("norm_topk_prob", norm_topk_prob ? 1 : 0);
  w.Float("routed_scaling_factor", routed_scaling_factor);
  w.Float("swiglu_limit", swiglu_limit);
  w.Text("expert_format", ExpertFormatName(expert_format));
  w.Text("weight_format", WeightFormatName(weight_format));
  w.List("engram_layer_ids", engram_layer_ids);
  w.Int("engram_max_ngram_size", engram_max_ngram_size);
  w.Int("engram_n_heads", engram_n_heads);
  w.Int("engram_head_dim", engram_head_dim);
  w.List("engram_vocab_size", engram_vocab_size);
  w.Int("engram_pad_token_id", engram_pad_token_id);
  w.Int("engram_seed", engram_seed);
  w.Int("engram_compressed_vocab_size", engram_compressed_vocab_size);
  w.Int("dspark_noise_token_id", dspark_noise_token_id);
  return out;
}

Status EngineConfig::Validate() {
  auto bad = [](const std::string& m) { return Status::InvalidArgument("config: " + m); };
  if (num_hidden_layers <= 0 || num_hidden_layers > kMaxLayers) return bad("num_hidden_layers");
  if (vocab_size <= 3 || vocab_size > kMaxVocab) return bad("vocab_size");
  if (hidden_size <= 0 || hidden_size > kMaxDim || hidden_size % 32 != 0)
    return bad("hidden_size must be a positive multiple of 32");
  if (num_key_value_heads != 1) return bad("num_key_value_heads must be 1 (one shared latent)");
  if (num_attention_heads <= 0 || num_attention_heads > 1024) return bad("num_attention_heads");
  if (head_dim <= 0 || head_dim > kMaxDim || head_dim % 32 != 0)
    return bad("head_dim must be a positive multiple of 32 (FP8/FP4 scale blocks)");
  if (qk_rope_head_dim <= 0 || qk_rope_head_dim % 2 != 0 || qk_rope_head_dim > head_dim)
    return bad("qk_rope_head_dim must be even and <= head_dim");
  if (q_lora_rank <= 0 || q_lora_rank > kMaxDim) return bad("q_lora_rank");
  if (o_groups <= 0 || num_attention_heads % o_groups != 0)
    return bad("o_groups must divide num_attention_heads");
  if (o_lora_rank <= 0 || o_lora_rank > kMaxDim) return bad("o_lora_rank");
  if (sliding_window <= 0 || sliding_window > 1 << 16) return bad("sliding_window");
  // The floats bound where their formulas stay finite (ops.cc: a norm's eps, the RoPE
  // frequencies' log(theta) divisor and log(beta), Sinkhorn's eps).
  if (!(rms_norm_eps >= 0 && rms_norm_eps <= 1)) return bad("rms_norm_eps must be in [0,1]");
  if (!(rope_theta > 1) || !(compress_rope_theta > 1))
    return bad("rope_theta and compress_rope_theta must be > 1");
  if (!rope_scaling.type.empty() && rope_scaling.type != "yarn")
    return bad("rope_scaling.rope_type must be yarn");
  if (rope_scaling.type == "yarn" &&
      (!(rope_scaling.factor >= 1) || rope_scaling.original_max_position_embeddings <= 0 ||
       !(rope_scaling.beta_fast > 0) || !(rope_scaling.beta_slow > 0)))
    return bad(
        "rope_scaling: factor >= 1, original_max_position_embeddings > 0, beta_fast > 0 and "
        "beta_slow > 0");
  if (static_cast<int>(compress_ratios.size()) < num_hidden_layers)
    return bad("compress_ratios needs one entry per layer");
  compress_ratios.resize(num_hidden_layers);
  for (int r : compress_ratios) {
    if (r < 0 || r > 128) return bad("compress_ratios entries must be in [0,128]");
  }
  if (index_n_heads <= 0 || index_n_heads > 1024) return bad("index_n_heads");
  if (index_head_dim <= 0 || index_head_dim % 32 != 0 || index_head_dim < qk_rope_head_dim)
    return bad("index_head_dim must be a multiple of 32 and >= qk_rope_head_dim");
  if (index_topk <= 0 || index_topk > 1 << 16) return bad("index_topk");
  if (hc_mult <= 0 || hc_mult > kHcMultMax) return bad("hc_mult");
  if (hc_sinkhorn_iters <= 0 || hc_sinkhorn_iters > 1000) return bad("hc_sinkhorn_iters");
  if (!(hc_eps >= 0 && hc_eps <= 1)) return bad("hc_eps must be in [0,1]");
  if (n_routed_experts <= 0 || n_routed_experts > kMaxExperts) return bad("n_routed_experts");
  if (num_experts_per_tok <= 0 || num_experts_per_tok > n_routed_experts)
    return bad("num_experts_per_tok");
  if (n_shared_experts < 0 || n_shared_experts > 64) return bad("n_shared_experts");
  if (moe_intermediate_size <= 0 || moe_intermediate_size > kMaxDim)
    return bad("moe_intermediate_size");
  if (scoring_func != "sqrtsoftplus") return bad("scoring_func must be sqrtsoftplus");
  if (!(swiglu_limit > 0)) return bad("swiglu_limit");
  if (!(routed_scaling_factor > 0 && routed_scaling_factor <= 1000))
    return bad("routed_scaling_factor must be in (0,1000]");
  if (expert_format == ExpertFormat::kMxfp4 &&
      (hidden_size % 32 != 0 || moe_intermediate_size % 32 != 0))
    return bad("expert_format mxfp4 needs hidden_size and moe_intermediate_size multiples of 32");
  if (weight_format == WeightFormat::kFp8 &&
      (hidden_size % 32 != 0 || q_lora_rank % 32 != 0 || (o_groups * o_lora_rank) % 32 != 0 ||
       (moe_intermediate_size * n_shared_experts) % 32 != 0 || engram_head_dim % 32 != 0))
    return bad(
        "weight_format fp8 needs hidden_size, q_lora_rank, o_groups x o_lora_rank, "
        "moe_intermediate_size x n_shared_experts and engram_head_dim multiples of 32");

  // Layer schedule (reference §2): sources and modes.
  layer_modes.assign(num_hidden_layers, LayerMode::kSwaOnly);
  kv_source_of_layer.assign(num_hidden_layers, -1);
  for (int s : kv_source_layer_ids) {
    if (s < 0 || s >= num_hidden_layers) return bad("kv_source_layer_ids out of range");
    if (compress_ratios[s] <= 0) return bad("a kv source needs compress_ratio > 0");
    if (!IsIndexSource(s)) return bad("a kv source must also be an index source");
  }
  for (int s : index_source_layer_ids) {
    if (s < 0 || s >= num_hidden_layers) return bad("index_source_layer_ids out of range");
    if (compress_ratios[s] <= 0) return bad("an index source needs compress_ratio > 0");
  }
  int current_source = -1;
  bool have_topk = false;
  for (int l = 0; l < num_hidden_layers; ++l) {
    if (compress_ratios[l] == 0) {
      layer_modes[l] = LayerMode::kSwaOnly;
      continue;
    }
    if (IsKvSource(l)) {
      current_source = l;
      layer_modes[l] = LayerMode::kFull;
    } else if (IsIndexSource(l)) {
      layer_modes[l] = LayerMode::kReindex;
    } else {
      layer_modes[l] = LayerMode::kReuse;
    }
    if (current_source < 0)
      return bad("layer " + std::to_string(l) + " has no kv source before it");
    if (compress_ratios[l] != compress_ratios[current_source])
      return bad("layer " + std::to_string(l) + " ratio differs from its kv source");
    if (layer_modes[l] == LayerMode::kReuse && !have_topk)
      return bad("reuse layer " + std::to_string(l) + " has no index source before it");
    if (layer_modes[l] != LayerMode::kReuse) have_topk = true;
    kv_source_of_layer[l] = current_source;
  }
  first_decoder_layer = num_hidden_layers / 2;
  if (candidate_source_layer_id >= 0) {
    if (!IsKvSource(candidate_source_layer_id))
      return bad("candidate_source_layer_id must be a kv source");
    if (candidate_block_size <= 0 || candidate_block_size > 4096)
      return bad("candidate_block_size");
    if (candidate_topk_blocks <= 0 || candidate_topk_blocks > 1 << 20)
      return bad("candidate_topk_blocks");
  }

  // Engram.
  for (int l : engram_layer_ids) {
    if (l < 0 || l >= num_hidden_layers) return bad("engram_layer_ids out of range");
  }
  if (!engram_layer_ids.empty()) {
    if (engram_max_ngram_size < 2 || engram_max_ngram_size > 8)
      return bad("engram_max_ngram_size must be in [2,8]");
    if (engram_n_heads <= 0 || engram_n_heads > 64) return bad("engram_n_heads");
    if (engram_head_dim <= 0 || engram_head_dim % 32 != 0)
      return bad("engram_head_dim must be a multiple of 32 (FP8 rows, ue8m0 per 32)");
    if (engram_vocab_size.size() == 1)
      engram_vocab_size.assign(engram_max_ngram_size - 1, engram_vocab_size[0]);
    if (static_cast<int>(engram_vocab_size.size()) != engram_max_ngram_size - 1)
      return bad("engram_vocab_size needs one entry per order");
    for (int64_t v : engram_vocab_size) {
      if (v < 2 || v > (int64_t{1} << 40)) return bad("engram_vocab_size");
    }
    if (engram_compressed_vocab_size == 0) engram_compressed_vocab_size = vocab_size;
    if (engram_compressed_vocab_size < 2 || engram_compressed_vocab_size > vocab_size)
      return bad("engram_compressed_vocab_size");
    if (engram_pad_token_id < 0 || engram_pad_token_id >= vocab_size)
      return bad("engram_pad_token_id");
  }
  if (dspark_noise_token_id >= vocab_size) return bad("dspark_noise_token_id");
  return Status::Ok();
}

StatusOr<EngineConfig> ParseEngineConfig(std::string_view json_text) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    return Status::InvalidArgument(std::string("config: invalid JSON: ") + e.what());
  }
  if (!root.is_object()) return Status::InvalidArgument("config: not a JSON object");
  const json& j = (root.contains("text_config") && root["text_config"].is_object())
                      ? root["text_config"]
                      : root;
  EngineConfig c;
  KVTIER_RETURN_IF_ERROR(Get(j, "vocab_size", &c.vocab_size, true));
  KVTIER_RETURN_IF_ERROR(Get(j, "hidden_size", &c.hidden_size, true));
  KVTIER_RETURN_IF_ERROR(Get(j, "num_hidden_layers", &c.num_hidden_layers, true));
  KVTIER_RETURN_IF_ERROR(Get(j, "num_attention_heads", &c.num_attention_heads, true));
  KVTIER_RETURN_IF_ERROR(Get(j, "num_key_value_heads", &c.num_key_value_heads, false));
  KVTIER_RETURN_IF_ERROR(Get(j, "head_dim", &c.head_dim, true));
  KVTIER_RETURN_IF_ERROR(Get(j, "qk_rope_head_dim", &c.qk_rope_head_dim, true));
  KVTIER_RETURN_IF_ERROR(Get(j, "q_lora_rank", &c.q_lora_rank, true));
  KVTIER_RETURN_IF_ERROR(Get(j, "o_lora_rank", &c.o_lora_rank, true));
  KVTIER_RETURN_IF_ERROR(Get(j, "o_groups", &c.o_groups, false));
  KVTIER_RETURN_IF_ERROR(Get(j, "sliding_window", &c.sliding_window, true));
  KVTIER_RETURN_IF_ERROR(Get(j, "rms_norm_eps", &c.rms_norm_eps, false));
  KVTIER_RETURN_IF_ERROR(Get(j, "rope_theta", &c.rope_theta, false));
  KVTIER_RETURN_IF_ERROR(Get(j, "compress_rope_theta", &c.compress_rope_theta, false));
  KVTIER_RETURN_IF_ERROR(Get(j, "max_position_embeddings", &c.max_position_embeddings, false));
  if (auto it = j.find("rope_scaling"); it != j.end() && it->is_object()) {
    const json& rs = *it;
    std::string type;
    KVTIER_RETURN_IF_ERROR(Get(rs, "rope_type", &type, false));
    if (type.empty()) KVTIER_RETURN_IF_ERROR(Get(rs, "type", &type, false));
    c.rope_scaling.type = type;
    KVTIER_RETURN_IF_ERROR(Get(rs, "factor", &c.rope_scaling.factor, false));
    KVTIER_RETURN_IF_ERROR(Get(rs, "original_max_position_embeddings",
                               &c.rope_scaling.original_max_position_embeddings, false));
    KVTIER_RETURN_IF_ERROR(Get(rs, "beta_fast", &c.rope_scaling.beta_fast, false));
    KVTIER_RETURN_IF_ERROR(Get(rs, "beta_slow", &c.rope_scaling.beta_slow, false));
  }
  KVTIER_RETURN_IF_ERROR(Get(j, "compress_ratios", &c.compress_ratios, true));
  KVTIER_RETURN_IF_ERROR(Get(j, "kv_source_layer_ids", &c.kv_source_layer_ids, true));
  KVTIER_RETURN_IF_ERROR(Get(j, "index_source_layer_ids", &c.index_source_layer_ids, true));
  KVTIER_RETURN_IF_ERROR(Get(j, "index_n_heads", &c.index_n_heads, true));
  KVTIER_RETURN_IF_ERROR(Get(j, "index_head_dim", &c.index_head_dim, true));
  KVTIER_RETURN_IF_ERROR(Get(j, "index_topk", &c.index_topk, true));
  KVTIER_RETURN_IF_ERROR(Get(j, "candidate_source_layer_id", &c.candidate_source_layer_id, false));
  KVTIER_RETURN_IF_ERROR(Get(j, "candidate_topk_blocks", &c.candidate_topk_blocks, false));
  KVTIER_RETURN_IF_ERROR(Get(j, "candidate_block_size", &c.candidate_block_size, false));
  KVTIER_RETURN_IF_ERROR(Get(j, "hc_mult", &c.hc_mult, false));
  KVTIER_RETURN_IF_ERROR(Get(j, "hc_sinkhorn_iters", &c.hc_sinkhorn_iters, false));
  KVTIER_RETURN_IF_ERROR(Get(j, "hc_eps", &c.hc_eps, false));
  KVTIER_RETURN_IF_ERROR(Get(j, "n_routed_experts", &c.n_routed_experts, true));
  KVTIER_RETURN_IF_ERROR(Get(j, "n_shared_experts", &c.n_shared_experts, false));
  KVTIER_RETURN_IF_ERROR(Get(j, "num_experts_per_tok", &c.num_experts_per_tok, true));
  KVTIER_RETURN_IF_ERROR(Get(j, "moe_intermediate_size", &c.moe_intermediate_size, true));
  KVTIER_RETURN_IF_ERROR(Get(j, "scoring_func", &c.scoring_func, false));
  KVTIER_RETURN_IF_ERROR(Get(j, "topk_method", &c.topk_method, false));
  KVTIER_RETURN_IF_ERROR(Get(j, "norm_topk_prob", &c.norm_topk_prob, false));
  KVTIER_RETURN_IF_ERROR(Get(j, "routed_scaling_factor", &c.routed_scaling_factor, false));
  KVTIER_RETURN_IF_ERROR(Get(j, "swiglu_limit", &c.swiglu_limit, false));
  // A format key: "f32" (the default) or `coded`, which sets *is_coded.
  auto format = [&](const char* key, const char* coded, bool* is_coded) -> Status {
    std::string v = "f32";
    KVTIER_RETURN_IF_ERROR(Get(j, key, &v, false));
    *is_coded = v == coded;
    if (!*is_coded && v != "f32") {
      return Status::InvalidArgument(std::string("config: ") + key + " must be \"f32\" or \"" +
                                     coded + "\", not \"" + v.substr(0, 32) + "\"");
    }
    return Status::Ok();
  };
  bool coded = false;
  KVTIER_RETURN_IF_ERROR(format("expert_format", "mxfp4", &coded));
  if (coded) c.expert_format = ExpertFormat::kMxfp4;
  KVTIER_RETURN_IF_ERROR(format("weight_format", "fp8", &coded));
  if (coded) c.weight_format = WeightFormat::kFp8;
  KVTIER_RETURN_IF_ERROR(Get(j, "engram_layer_ids", &c.engram_layer_ids, false));
  KVTIER_RETURN_IF_ERROR(Get(j, "engram_max_ngram_size", &c.engram_max_ngram_size, false));
  KVTIER_RETURN_IF_ERROR(Get(j, "engram_n_heads", &c.engram_n_heads, false));
  KVTIER_RETURN_IF_ERROR(Get(j, "engram_head_dim", &c.engram_head_dim, false));
  if (auto it = j.find("engram_vocab_size"); it != j.end()) {
    if (it->is_array()) {
      KVTIER_RETURN_IF_ERROR(Get(j, "engram_vocab_size", &c.engram_vocab_size, false));
    } else {
      int64_t v = 0;
      KVTIER_RETURN_IF_ERROR(Get(j, "engram_vocab_size", &v, false));
      c.engram_vocab_size = {v};
    }
  }
  KVTIER_RETURN_IF_ERROR(Get(j, "engram_pad_token_id", &c.engram_pad_token_id, false));
  KVTIER_RETURN_IF_ERROR(Get(j, "engram_seed", &c.engram_seed, false));
  KVTIER_RETURN_IF_ERROR(
      Get(j, "engram_compressed_vocab_size", &c.engram_compressed_vocab_size, false));
  KVTIER_RETURN_IF_ERROR(Get(j, "dspark_noise_token_id", &c.dspark_noise_token_id, false));
  KVTIER_RETURN_IF_ERROR(c.Validate());
  return c;
}

StatusOr<EngineConfig> LoadEngineConfig(const std::string& path) {
  // Read under the bound (--config /dev/zero ends).
  auto text = ReadFileBounded(path, kEngineConfigBytesMax);
  if (!text.ok()) {
    if (!text.status().IsInvalidArgument()) return text.status();
    return Status::InvalidArgument("config: over kEngineConfigBytesMax (" +
                                   std::to_string(kEngineConfigBytesMax) + " bytes): " + path);
  }
  auto cfg = ParseEngineConfig(*text);
  if (!cfg.ok()) return cfg.status().WithContext(path);
  return cfg;
}

}  // namespace kvtier::engine
