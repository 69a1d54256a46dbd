#include "common/kv_layout.h"

#include <fstream>
#include <nlohmann/json.hpp>

#include "common/checksum.h"

namespace kvtier {
namespace {

using Json = nlohmann::json;

// Reads a non-negative integer key no larger than `limit`.
Status GetUint(const Json& obj, const char* key, uint32_t limit, bool required,
               uint32_t default_value, uint32_t* out) {
  auto it = obj.find(key);
  if (it == obj.end()) {
    if (required) return Status::InvalidArgument(std::string("missing key '") + key + "'");
    *out = default_value;
    return Status::Ok();
  }
  if (!it->is_number_integer()) {
    return Status::InvalidArgument(std::string("key '") + key + "': expected an integer, got " +
                                   it->type_name());
  }
  if (it->is_number_unsigned() ? it->get<uint64_t>() > limit
                               : (it->get<int64_t>() < 0 || it->get<int64_t>() > limit)) {
    return Status::InvalidArgument(std::string("key '") + key + "': " + it->dump() +
                                   " out of range [0, " + std::to_string(limit) + "]");
  }
  *out = static_cast<uint32_t>(it->get<int64_t>());
  return Status::Ok();
}

Status GetUintList(const Json& obj, const char* key, uint32_t limit, std::vector<uint32_t>* out) {
  auto it = obj.find(key);
  if (it == obj.end()) return Status::InvalidArgument(std::string("missing key '") + key + "'");
  if (!it->is_array()) {
    return Status::InvalidArgument(std::string("key '") + key + "': expected an array, got " +
                                   it->type_name());
  }
  if (it->size() > kLayersLimit) {
    return Status::InvalidArgument(std::string("key '") + key + "': more than " +
                                   std::to_string(kLayersLimit) + " entries");
  }
  out->clear();
  for (size_t i = 0; i < it->size(); ++i) {
    const Json& v = (*it)[i];
    const bool ok = v.is_number_integer() &&
                    (v.is_number_unsigned() ? v.get<uint64_t>() <= limit
                                            : v.get<int64_t>() >= 0 && v.get<int64_t>() <= limit);
    if (!ok) {
      return Status::InvalidArgument(std::string("key '") + key + "'[" + std::to_string(i) +
                                     "]: expected an integer in [0, " + std::to_string(limit) +
                                     "], got " + v.dump());
    }
    out->push_back(static_cast<uint32_t>(v.get<int64_t>()));
  }
  return Status::Ok();
}

// Validates and computes every derived field. `num_layers` bounds the source ids.
StatusOr<KvLayout> Build(uint32_t num_layers, uint32_t head_dim, uint32_t index_head_dim,
                         const std::vector<uint32_t>& ratios,
                         const std::vector<uint32_t>& source_ids, uint32_t unit_tokens) {
  if (head_dim == 0 || head_dim % 16 != 0) {
    return Status::InvalidArgument("key 'head_dim': " + std::to_string(head_dim) +
                                   " is not a positive multiple of 16 (E4M3 scale block)");
  }
  if (index_head_dim == 0 || index_head_dim % 32 != 0) {
    return Status::InvalidArgument("key 'index_head_dim': " + std::to_string(index_head_dim) +
                                   " is not a positive multiple of 32 (UE8M0 scale block)");
  }
  if (unit_tokens == 0 || unit_tokens % 2 != 0 || unit_tokens > kUnitTokensLimit) {
    return Status::InvalidArgument("unit_tokens: " + std::to_string(unit_tokens) +
                                   " must be even and in [2, " + std::to_string(kUnitTokensLimit) +
                                   "]");
  }
  if (source_ids.empty()) {
    return Status::InvalidArgument("key 'kv_source_layer_ids': no KV source layers");
  }
  KvLayout layout;
  layout.num_hidden_layers = num_layers;
  layout.head_dim = head_dim;
  layout.index_head_dim = index_head_dim;
  layout.unit_tokens = unit_tokens;
  const uint32_t main_entry = head_dim / 2 + head_dim / 16;
  const uint32_t index_entry = index_head_dim / 2 + index_head_dim / 32;
  for (size_t i = 0; i < source_ids.size(); ++i) {
    const uint32_t id = source_ids[i];
    const std::string where =
        "key 'kv_source_layer_ids'[" + std::to_string(i) + "]: layer " + std::to_string(id);
    if (id >= num_layers || id >= ratios.size()) {
      return Status::InvalidArgument(where + " out of range (num_hidden_layers " +
                                     std::to_string(num_layers) + ")");
    }
    if (i > 0 && id <= source_ids[i - 1]) {
      return Status::InvalidArgument(where + " is not in increasing order (or duplicated)");
    }
    const uint32_t ratio = ratios[id];
    if (ratio == 0) {
      return Status::InvalidArgument(where + " has compress_ratios[" + std::to_string(id) +
                                     "] = 0 (an SWA-only layer cannot be a KV source)");
    }
    if (unit_tokens % ratio != 0) {
      return Status::InvalidArgument("unit_tokens: " + std::to_string(unit_tokens) +
                                     " is not divisible by compress ratio " +
                                     std::to_string(ratio) + " of layer " + std::to_string(id));
    }
    KvSourceLayout s;
    s.layer_id = id;
    s.compress_ratio = ratio;
    s.entries_per_unit = unit_tokens / ratio;
    s.main_entry_bytes = main_entry;
    s.index_entry_bytes = index_entry;
    layout.sources.push_back(s);
    layout.main_bytes_per_token += static_cast<double>(main_entry) / ratio;
    layout.index_bytes_per_token += static_cast<double>(index_entry) / ratio;
    layout.main_bytes_per_unit += uint64_t{s.entries_per_unit} * main_entry;
    layout.index_bytes_per_unit += uint64_t{s.entries_per_unit} * index_entry;
  }
  layout.bytes_per_token = layout.main_bytes_per_token + layout.index_bytes_per_token;
  layout.bytes_per_unit = layout.main_bytes_per_unit + layout.index_bytes_per_unit;
  return layout;
}

}  // namespace

std::string KvLayout::CanonicalDescription() const {
  std::string out = "kvtier.kv_layout.v1;unit_tokens=" + std::to_string(unit_tokens) +
                    ";main=fp4_e2m1+e4m3x16:" + std::to_string(head_dim) +
                    ";index=fp4_e2m1+ue8m0x32:" + std::to_string(index_head_dim) + ";sources=";
  for (size_t i = 0; i < sources.size(); ++i) {
    if (i > 0) out += ',';
    out += std::to_string(sources[i].layer_id) + "/" + std::to_string(sources[i].compress_ratio);
  }
  return out;
}

uint64_t KvLayout::LayoutId() const {
  const std::string desc = CanonicalDescription();
  return Xxh3_64(desc.data(), desc.size());
}

StatusOr<KvLayout> ParseKvLayout(std::string_view config_json, const KvLayoutOptions& options) {
  if (config_json.size() > kModelConfigBytesLimit) {
    return Status::InvalidArgument("model config larger than " +
                                   std::to_string(kModelConfigBytesLimit) + " bytes");
  }
  // No exceptions: a parse failure yields a `discarded` value.
  const Json root = Json::parse(config_json.begin(), config_json.end(), nullptr,
                                /*allow_exceptions=*/false);
  if (root.is_discarded()) return Status::InvalidArgument("model config: malformed JSON");
  if (!root.is_object()) return Status::InvalidArgument("model config: not a JSON object");
  const Json* cfg = &root;
  if (auto it = root.find("text_config"); it != root.end()) {
    if (!it->is_object()) {
      return Status::InvalidArgument(std::string("key 'text_config': expected an object, got ") +
                                     it->type_name());
    }
    cfg = &*it;
  }
  uint32_t layers = 0, nextn = 0, head_dim = 0, index_head_dim = 0;
  KVTIER_RETURN_IF_ERROR(GetUint(*cfg, "num_hidden_layers", kLayersLimit, true, 0, &layers));
  KVTIER_RETURN_IF_ERROR(GetUint(*cfg, "num_nextn_predict_layers", kLayersLimit, false, 0, &nextn));
  KVTIER_RETURN_IF_ERROR(GetUint(*cfg, "head_dim", kHeadDimLimit, true, 0, &head_dim));
  KVTIER_RETURN_IF_ERROR(GetUint(*cfg, "index_head_dim", kHeadDimLimit, true, 0, &index_head_dim));
  std::vector<uint32_t> ratios, sources;
  KVTIER_RETURN_IF_ERROR(GetUintList(*cfg, "compress_ratios", kCompressRatioLimit, &ratios));
  KVTIER_RETURN_IF_ERROR(GetUintList(*cfg, "kv_source_layer_ids", kLayersLimit, &sources));
  if (ratios.size() != size_t{layers} + nextn) {
    return Status::InvalidArgument(
        "key 'compress_ratios': has " + std::to_string(ratios.size()) +
        " entries, expected num_hidden_layers + num_nextn_predict_layers = " +
        std::to_string(layers) + " + " + std::to_string(nextn));
  }
  return Build(layers, head_dim, index_head_dim, ratios, sources, options.unit_tokens);
}

StatusOr<KvLayout> LoadKvLayout(const std::string& path, const KvLayoutOptions& options) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::IOError("cannot open model config '" + path + "'");
  std::string text;
  char buf[65536];
  while (in.read(buf, sizeof(buf)) || in.gcount() > 0) {
    text.append(buf, static_cast<size_t>(in.gcount()));
    if (text.size() > kModelConfigBytesLimit) {
      return Status::InvalidArgument("model config '" + path + "' larger than " +
                                     std::to_string(kModelConfigBytesLimit) + " bytes");
    }
  }
  if (in.bad()) return Status::IOError("cannot read model config '" + path + "'");
  StatusOr<KvLayout> layout = ParseKvLayout(text, options);
  if (!layout.ok()) return layout.status().WithContext(path);
  return layout;
}

StatusOr<KvLayout> MakeKvLayout(uint32_t head_dim, uint32_t index_head_dim,
                                const std::vector<uint32_t>& compress_ratios,
                                const std::vector<uint32_t>& kv_source_layer_ids,
                                uint32_t unit_tokens) {
  if (compress_ratios.size() > kLayersLimit) {
    return Status::InvalidArgument("compress_ratios: more than " + std::to_string(kLayersLimit) +
                                   " layers");
  }
  for (uint32_t r : compress_ratios) {
    if (r > kCompressRatioLimit) return Status::InvalidArgument("compress_ratios: out of range");
  }
  return Build(static_cast<uint32_t>(compress_ratios.size()), head_dim, index_head_dim,
               compress_ratios, kv_source_layer_ids, unit_tokens);
}

}  // namespace kvtier
