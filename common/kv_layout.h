// KvLayout: the global-KV layout of a model, computed from its config.json.
//
// The global KV of DeepSeek-V4.1-style models is written only at the KV source layers
// (`kv_source_layer_ids`); a source at compression ratio m holds one entry per m tokens. Each
// entry has two parts, both FP4 E2M1 (two codes per byte, even element in the low nibble):
//   main latent:  head_dim codes       + one E4M3 scale per 16  = head_dim/2 + head_dim/16 bytes
//   indexer key:  index_head_dim codes + one UE8M0 scale per 32 = index_head_dim/2 +
//                                                                 index_head_dim/32 bytes
// so bytes_per_token = sum over sources of (main_entry + index_entry) / ratio. The real
// V4.1-Flash gives 890 B/token (720 main + 170 index), the miniature 222.5 B/token.
//
// The prefix unit holds the global KV of `unit_tokens` consecutive tokens (default 64): it
// must be even and divisible by every source's ratio so that no compressed group is split.
// The payload byte layout of a unit is in common/unit_format.h and docs/format/unit.md.
//
// Config keys read (HF text_config naming; accepted at top level or nested under
// "text_config"): num_hidden_layers, num_nextn_predict_layers (optional, default 0),
// compress_ratios (one per layer, num_hidden_layers + num_nextn_predict_layers entries),
// kv_source_layer_ids, head_dim, index_head_dim. Everything else is ignored.
//
// Thread safety: KvLayout is an immutable value after construction; the functions are pure.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace kvtier {

// Default tokens per prefix unit.
inline constexpr uint32_t kDefaultUnitTokens = 64;
// Limits on what a config may ask for (sanity bounds; the real model is far below them).
inline constexpr uint32_t kUnitTokensLimit = 1u << 16;
inline constexpr uint32_t kLayersLimit = 4096;
inline constexpr uint32_t kHeadDimLimit = 1u << 16;
inline constexpr uint32_t kCompressRatioLimit = 1u << 16;
// Largest config.json accepted (bytes).
inline constexpr size_t kModelConfigBytesLimit = size_t{16} << 20;

struct KvSourceLayout {
  uint32_t layer_id = 0;
  uint32_t compress_ratio = 1;     // tokens per entry, >= 1
  uint32_t entries_per_unit = 0;   // unit_tokens / compress_ratio
  uint32_t main_entry_bytes = 0;   // head_dim/2 + head_dim/16
  uint32_t index_entry_bytes = 0;  // index_head_dim/2 + index_head_dim/32
};

struct KvLayout {
  uint32_t num_hidden_layers = 0;
  uint32_t head_dim = 0;
  uint32_t index_head_dim = 0;
  uint32_t unit_tokens = kDefaultUnitTokens;
  std::vector<KvSourceLayout> sources;  // in layer order (the unit payload order)

  // Per-token averages (bytes; fractional for ratio > 1).
  double main_bytes_per_token = 0;
  double index_bytes_per_token = 0;
  double bytes_per_token = 0;
  // Exact bytes of one unit's payload.
  uint64_t main_bytes_per_unit = 0;
  uint64_t index_bytes_per_unit = 0;
  uint64_t bytes_per_unit = 0;

  // Canonical, versioned text of everything that determines the payload bytes, e.g.
  // "kvtier.kv_layout.v1;unit_tokens=64;main=fp4_e2m1+e4m3x16:128;index=fp4_e2m1+ue8m0x32:32;
  //  sources=2/2,4/2,6/2,8/1". Hashed into the model fingerprint (common/key_spec.h).
  std::string CanonicalDescription() const;
  // xxh3-64 of CanonicalDescription(): the layout id stored in every unit header.
  uint64_t LayoutId() const;
};

struct KvLayoutOptions {
  // Tokens per prefix unit. Must be even, > 0, <= kUnitTokensLimit and divisible by every
  // source's compress ratio. Default 64.
  uint32_t unit_tokens = kDefaultUnitTokens;
};

// Parses config.json text. InvalidArgument (message names the key) for malformed JSON,
// missing or ill-typed keys, a compress_ratios list whose length does not match the layer
// count, a source id out of range / duplicated / not increasing / at a layer with ratio 0,
// dimensions that are not multiples of the scale blocks, or a unit_tokens that does not fit.
StatusOr<KvLayout> ParseKvLayout(std::string_view config_json, const KvLayoutOptions& options);

// Reads and parses a config file. IOError when it cannot be read; see ParseKvLayout.
StatusOr<KvLayout> LoadKvLayout(const std::string& path, const KvLayoutOptions& options);

// Builds a layout directly (tests, synthetic layouts). Same validation as ParseKvLayout;
// `compress_ratios` is indexed by layer id and must cover every source.
StatusOr<KvLayout> MakeKvLayout(uint32_t head_dim, uint32_t index_head_dim,
                                const std::vector<uint32_t>& compress_ratios,
                                const std::vector<uint32_t>& kv_source_layer_ids,
                                uint32_t unit_tokens);

}  // namespace kvtier
