// kvtier layout: global-KV bytes per token and per unit for a model config.json.
//
//   kvtier layout --model-config deploy/models/mini-v4.1.json [--json] [--unit-tokens 64]
//
// `--model-config` also accepts the name of a shipped model (e.g. "mini-v4.1"), which is
// embedded in the binary (common/shipped_models.h).
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "cli/commands.h"
#include "cli/flags.h"
#include "common/json_text.h"
#include "common/kv_layout.h"
#include "common/shipped_models.h"
#include "common/unit_format.h"

namespace kvtier::cli {
namespace {

nlohmann::ordered_json LayoutJson(const KvLayout& layout, const std::string& source) {
  nlohmann::ordered_json j;
  j["model_config"] = source;
  j["bytes_per_token"] = layout.bytes_per_token;
  j["main_bytes_per_token"] = layout.main_bytes_per_token;
  j["index_bytes_per_token"] = layout.index_bytes_per_token;
  j["unit_tokens"] = layout.unit_tokens;
  j["bytes_per_unit"] = layout.bytes_per_unit;
  j["main_bytes_per_unit"] = layout.main_bytes_per_unit;
  j["index_bytes_per_unit"] = layout.index_bytes_per_unit;
  j["unit_header_bytes"] = kUnitHeaderBytes;
  j["head_dim"] = layout.head_dim;
  j["index_head_dim"] = layout.index_head_dim;
  j["main_format"] = "fp4_e2m1 + e4m3 scale per 16";
  j["index_format"] = "fp4_e2m1 + ue8m0 scale per 32";
  char id[17];
  std::snprintf(id, sizeof(id), "%016llx", static_cast<unsigned long long>(layout.LayoutId()));
  j["layout_id"] = id;
  j["layout_description"] = layout.CanonicalDescription();
  const UnitPayloadLayout payload = UnitPayloadLayout::For(layout);
  nlohmann::ordered_json sources = nlohmann::ordered_json::array();
  for (size_t i = 0; i < layout.sources.size(); ++i) {
    const KvSourceLayout& s = layout.sources[i];
    const SourceRegions& r = payload.sources[i];
    sources.push_back({
        {"layer_id", s.layer_id},
        {"compress_ratio", s.compress_ratio},
        {"entries_per_unit", s.entries_per_unit},
        {"main_entry_bytes", s.main_entry_bytes},
        {"index_entry_bytes", s.index_entry_bytes},
        {"bytes_per_token",
         static_cast<double>(s.main_entry_bytes + s.index_entry_bytes) / s.compress_ratio},
        {"payload_offset_bytes", r.main_data.offset_bytes},
        {"payload_bytes",
         uint64_t{s.entries_per_unit} * (s.main_entry_bytes + s.index_entry_bytes)},
    });
  }
  j["sources"] = std::move(sources);
  return j;
}

void PrintHuman(const KvLayout& layout, const std::string& source) {
  std::printf("model config      %s\n", source.c_str());
  std::printf("bytes per token   %g  (main %g + index %g)\n", layout.bytes_per_token,
              layout.main_bytes_per_token, layout.index_bytes_per_token);
  std::printf("unit              %u tokens = %llu bytes payload + %zu header\n", layout.unit_tokens,
              static_cast<unsigned long long>(layout.bytes_per_unit), kUnitHeaderBytes);
  std::printf(
      "entry formats     main %u B (head_dim %u: FP4 E2M1 + E4M3/16), "
      "index %u B (index_head_dim %u: FP4 E2M1 + UE8M0/32)\n",
      layout.head_dim / 2 + layout.head_dim / 16, layout.head_dim,
      layout.index_head_dim / 2 + layout.index_head_dim / 32, layout.index_head_dim);
  std::printf("layout id         %016llx\n", static_cast<unsigned long long>(layout.LayoutId()));
  std::printf("\n  %-6s %-6s %-10s %-12s %s\n", "layer", "ratio", "entries", "bytes/token",
              "bytes/unit");
  for (const KvSourceLayout& s : layout.sources) {
    const uint32_t entry = s.main_entry_bytes + s.index_entry_bytes;
    std::printf("  %-6u %-6u %-10u %-12g %llu\n", s.layer_id, s.compress_ratio, s.entries_per_unit,
                static_cast<double>(entry) / s.compress_ratio,
                static_cast<unsigned long long>(uint64_t{s.entries_per_unit} * entry));
  }
}

}  // namespace

int RunLayout(Args args) {
  FlagSet flags(
      "kvtier layout",
      "Compute global-KV bytes per token and per prefix unit from a model config.json "
      "(HF text_config keys). FILE may also name a shipped model: " +
          [] {
            std::string names;
            for (const ShippedModel& m : ShippedModels()) {
              names += (names.empty() ? "" : ", ") + std::string(m.name);
            }
            return names;
          }() +
          ".");
  std::string config;
  bool json = false;
  uint64_t unit_tokens = kDefaultUnitTokens;
  flags.String("model-config", &config, "FILE", "model config.json", true);
  flags.Bool("json", &json, "print JSON instead of text");
  flags.Uint("unit-tokens", &unit_tokens,
             "tokens per prefix unit (even, divisible by every compress ratio)");
  if (int rc = flags.Parse(args); rc >= 0) return rc;
  if (unit_tokens == 0 || unit_tokens > kUnitTokensLimit) {
    std::fprintf(stderr, "kvtier layout: --unit-tokens must be in [2, %u]\n", kUnitTokensLimit);
    return 2;
  }
  const KvLayoutOptions options{.unit_tokens = static_cast<uint32_t>(unit_tokens)};
  StatusOr<KvLayout> layout = Status::NotFound("unset");
  if (const ShippedModel* m = FindShippedModel(config); m != nullptr) {
    layout = ParseKvLayout(m->config_json, options);
  } else {
    layout = LoadKvLayout(config, options);
  }
  if (!layout.ok()) {
    std::fprintf(stderr, "kvtier layout: %s\n", layout.status().ToString().c_str());
    return 1;
  }
  if (json) {
    std::printf("%s\n", JsonText(LayoutJson(*layout, config), 2).c_str());
  } else {
    PrintHuman(*layout, config);
  }
  return 0;
}

}  // namespace kvtier::cli
