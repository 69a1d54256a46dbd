#include "serving/api_keys.h"

#include <nlohmann/json.hpp>
#include <sstream>

#include "common/config.h"

namespace kvtier::serving {
namespace {

StatusOr<double> Price(const nlohmann::json& p, const char* field, const std::string& where) {
  auto it = p.find(field);
  if (it == p.end()) return 0.0;
  if (!it->is_number() || it->get<double>() < 0 || !std::isfinite(it->get<double>()))
    return Status::InvalidArgument(where + ".prices." + field + " must be a number >= 0");
  return it->get<double>();
}

}  // namespace

ApiKeys ApiKeys::Open(const std::string& daemon_token) {
  ApiKeys k;
  k.open_ = std::make_shared<Tenant>();
  k.open_->name = "default";
  k.open_->daemon_token = daemon_token;
  return k;
}

StatusOr<ApiKeys> ApiKeys::Load(const std::string& path) {
  auto text = ReadFileBounded(path, kApiKeysFileBytesMax);
  if (!text.ok()) return text.status().WithContext("API keys file");
  auto k = Parse(*text);
  if (!k.ok()) return Status::InvalidArgument(path + ": " + k.status().message());
  return k;
}

StatusOr<ApiKeys> ApiKeys::Parse(std::string_view text) {
  auto j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("keys") || !j["keys"].is_array() ||
      j["keys"].empty())
    return Status::InvalidArgument("expected {\"keys\": [ ...at least one entry... ]}");
  ApiKeys k;
  for (size_t i = 0; i < j["keys"].size(); ++i) {
    const auto& e = j["keys"][i];
    const std::string where = "keys[" + std::to_string(i) + "]";
    if (!e.is_object()) return Status::InvalidArgument(where + " must be an object");
    for (const char* f : {"key", "tenant"}) {
      if (!e.contains(f) || !e[f].is_string() || e[f].get<std::string>().empty())
        return Status::InvalidArgument(where + "." + f + " must be a non-empty string");
    }
    if (e.contains("daemon_token") && !e["daemon_token"].is_string())
      return Status::InvalidArgument(where + ".daemon_token must be a string");
    const std::string key = e["key"];
    if (key.size() > kApiKeyBytesMax)
      return Status::InvalidArgument(where + ".key is over 256 bytes");
    auto t = std::make_shared<Tenant>();
    t->name = e["tenant"];
    t->daemon_token = e.value("daemon_token", "");
    if (e.contains("prices")) {
      if (!e["prices"].is_object()) return Status::InvalidArgument(where + ".prices: object");
      KVTIER_ASSIGN_OR_RETURN(t->prices.input_per_mtok,
                              Price(e["prices"], "input_per_mtok", where));
      KVTIER_ASSIGN_OR_RETURN(t->prices.cached_input_per_mtok,
                              Price(e["prices"], "cached_input_per_mtok", where));
      KVTIER_ASSIGN_OR_RETURN(t->prices.output_per_mtok,
                              Price(e["prices"], "output_per_mtok", where));
    }
    if (e.contains("weight")) {
      const auto& wj = e["weight"];
      if (!wj.is_number_integer() || wj.get<int64_t>() < 1 ||
          wj.get<int64_t>() > static_cast<int64_t>(kTenantWeightMax))
        return Status::InvalidArgument(where + ".weight must be an integer in [1, " +
                                       std::to_string(kTenantWeightMax) + "]");
      t->weight = static_cast<uint32_t>(wj.get<int64_t>());
    }
    auto [it, fresh] = k.tenants_.emplace(t->name, t);
    if (!fresh) {
      const Tenant& o = *it->second;
      if (o.daemon_token != t->daemon_token ||
          o.prices.input_per_mtok != t->prices.input_per_mtok ||
          o.prices.cached_input_per_mtok != t->prices.cached_input_per_mtok ||
          o.prices.output_per_mtok != t->prices.output_per_mtok || o.weight != t->weight)
        return Status::InvalidArgument(where + ": tenant " + t->name +
                                       " appears with another daemon_token, prices or weight");
    }
    if (!k.keys_.emplace(key, it->second.get()).second)
      return Status::InvalidArgument(where + ": duplicate key");
  }
  return k;
}

const Tenant* ApiKeys::Find(std::string_view authorization) const {
  if (keys_.empty()) return open_.get();
  constexpr std::string_view kBearer = "Bearer ";
  if (authorization.substr(0, kBearer.size()) != kBearer) return nullptr;
  auto it = keys_.find(authorization.substr(kBearer.size()));
  return it == keys_.end() ? nullptr : it->second;
}

}  // namespace kvtier::serving
