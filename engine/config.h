// EngineConfig: the model configuration of the miniature DeepSeek-V4.1-Flash engine.
//
// Loaded from a HF-style config.json whose keys are those of `text_config` (reference §0, §10).
// The keys may sit at the top level or inside a nested "text_config" object. Every key the
// engine needs is required except those with a documented default below; unknown keys are
// ignored (the same file also carries DSpark keys, which this engine does not run).
//
// Thread safety: an EngineConfig is an immutable value after loading.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace kvtier::engine {

// How a layer's sparse attention gets its compressed entries (reference §2).
enum class LayerMode : uint8_t {
  kSwaOnly,  // compress_ratio 0: only the sliding window
  kFull,     // owns a Compressor (kv source) and an indexer with keys (index source)
  kReindex,  // index source without keys: own query and top-k over the last source's keys
  kReuse,    // reuses the last Full/Reindex layer's top-k
};
std::string_view LayerModeName(LayerMode mode);

// How the routed experts' weights are defined (reference §8, "experts optionally in MXFP4").
// kMxfp4: each routed expert matrix is its MXFP4 rounding (E2M1 codes, one UE8M0 scale per 32
// inputs, kernels::RoundTrip(kFp4Ue8m0x32) of each row): the checkpoint's floats are rounded at
// load, as quantisation-aware training defines them, and the products read the 4.25-bit codes.
// The shared expert, the draft module's experts and every other matrix stay f32.
enum class ExpertFormat : uint8_t { kF32, kMxfp4 };
// "f32" / "mxfp4" (the JSON values of expert_format).
std::string_view ExpertFormatName(ExpertFormat format);

// How the dense projections' weights are defined (reference, "Quantisation": weights FP8 e4m3
// with ue8m0 scales). kFp8: wq_a, wq_b, wkv, wo_b, the shared expert and the Engram projection
// are each their FP8 rounding (E4M3 codes, one UE8M0 scale per 32 inputs of a row,
// kernels::RoundTrip(kFp8Ue8m0x32); the real model's blocks are 32 x 32, these 1 x 32), rounded
// at load, and the products read the 8.25-bit codes. The real model keeps the compressor, the
// indexer and wo_a in bf16; here they, the router, the head and the embedding stay f32.
enum class WeightFormat : uint8_t { kF32, kFp8 };
// "f32" / "fp8" (the JSON values of weight_format).
std::string_view WeightFormatName(WeightFormat format);

struct RopeScalingConfig {
  std::string type;  // "yarn" or "" (none)
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
};

// The most mHC streams (hc_mult) a config may have: the mHC ops keep one value per stream
// (and per stream pair) on the stack (engine/ops.cc, engine/model.cc MixSublayer).
inline constexpr int kHcMultMax = 16;

struct EngineConfig {
  int vocab_size = 0;
  int hidden_size = 0;
  int num_hidden_layers = 0;
  int num_attention_heads = 0;
  int num_key_value_heads = 1;
  int head_dim = 0;
  int qk_rope_head_dim = 0;
  int q_lora_rank = 0;
  int o_lora_rank = 0;
  int o_groups = 1;
  int sliding_window = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  double compress_rope_theta = 160000.0;
  RopeScalingConfig rope_scaling;
  // Default 0: YaRN is applied whenever rope_scaling.type == "yarn" (the reference applies it
  // when max_position_embeddings exceeds the original length; the mini config omits the key).
  int64_t max_position_embeddings = 0;

  std::vector<int> compress_ratios;  // one per layer; extra (DSpark) entries are ignored
  std::vector<int> kv_source_layer_ids;
  std::vector<int> index_source_layer_ids;
  int index_n_heads = 0;
  int index_head_dim = 0;
  int index_topk = 0;
  int candidate_source_layer_id = -1;  // -1: no candidate pool
  int candidate_topk_blocks = 0;
  int candidate_block_size = 8;

  int hc_mult = 4;
  int hc_sinkhorn_iters = 20;
  double hc_eps = 1e-6;

  int n_routed_experts = 0;
  int n_shared_experts = 1;
  int num_experts_per_tok = 0;
  int moe_intermediate_size = 0;
  std::string scoring_func = "sqrtsoftplus";
  std::string topk_method = "noaux_tc";
  bool norm_topk_prob = true;
  double routed_scaling_factor = 1.0;
  double swiglu_limit = 10.0;
  // JSON "expert_format": "f32" (default) or "mxfp4" (needs hidden_size and
  // moe_intermediate_size multiples of 32).
  ExpertFormat expert_format = ExpertFormat::kF32;
  // JSON "weight_format": "f32" (default) or "fp8" (needs hidden_size, q_lora_rank,
  // o_groups x o_lora_rank, moe_intermediate_size x n_shared_experts and engram_head_dim
  // multiples of 32).
  WeightFormat weight_format = WeightFormat::kF32;

  std::vector<int> engram_layer_ids;  // empty: no Engram
  int engram_max_ngram_size = 0;
  int engram_n_heads = 0;
  int engram_head_dim = 0;
  std::vector<int64_t> engram_vocab_size;  // per order 2..N; a scalar in JSON is repeated
  int engram_pad_token_id = 2;
  int64_t engram_seed = 0;  // default 0 (the reference demo's seed)
  // The compressed tokenizer vocabulary V (sets the multiplier bound). Default: vocab_size
  // (the mini's tokenizer compression is the identity).
  int64_t engram_compressed_vocab_size = 0;

  int dspark_noise_token_id = -1;  // reserved id; -1 when absent

  // ---- derived (filled by Validate) ----
  std::vector<LayerMode> layer_modes;
  std::vector<int> kv_source_of_layer;  // the KV source whose entries layer l reads, or -1
  int first_decoder_layer = 0;          // num_hidden_layers / 2 (CED split)

  int ratio(int layer) const { return compress_ratios[layer]; }
  bool IsKvSource(int layer) const;
  bool IsIndexSource(int layer) const;
  bool IsEngramLayer(int layer) const;
  int EngramSlot(int layer) const;  // index into engram_layer_ids, or -1
  int hc_mix_count() const { return (2 + hc_mult) * hc_mult; }
  // Global KV bytes of one entry (main FP4 E4M3x16 + index FP4 UE8M0x32), and per token.
  int64_t MainEntryBytes() const { return head_dim / 2 + head_dim / 16; }
  int64_t IndexEntryBytes() const { return index_head_dim / 2 + index_head_dim / 32; }
  double GlobalKvBytesPerToken() const;

  // Checks every invariant the engine relies on and fills the derived fields.
  Status Validate();

  // Canonical text of every field above the derived ones (compress_ratios: one entry per
  // layer): "kvtier.engine_config.v1;vocab_size=512;...;dspark_noise_token_id=511". Equal
  // texts mean configs that compute the same from the same weights; the model fingerprint
  // hashes it (engine/session.h EngineModelFingerprint). A field added to EngineConfig must be
  // added here (test EngineConfig.CanonicalDescriptionCoversEveryKey).
  std::string CanonicalDescription() const;
};

// Parses config JSON text (top-level keys or a nested "text_config"). Validates.
StatusOr<EngineConfig> ParseEngineConfig(std::string_view json_text);
// Upper bound on a config file read by LoadEngineConfig (1 MiB; the configs are a few KB).
inline constexpr size_t kEngineConfigBytesMax = 1 << 20;
// Reads and parses a config.json file. IOError when unreadable; InvalidArgument when over
// kEngineConfigBytesMax (only that much + 1 byte is read).
StatusOr<EngineConfig> LoadEngineConfig(const std::string& path);

}  // namespace kvtier::engine
