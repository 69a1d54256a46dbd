#include "serving/usage.h"

#include <nlohmann/json.hpp>

namespace kvtier::serving {

double Cost(const Usage& u, const Prices& p) {
  return (static_cast<double>(u.miss_tokens()) * p.input_per_mtok +
          static_cast<double>(u.cached_tokens) * p.cached_input_per_mtok +
          static_cast<double>(u.completion_tokens) * p.output_per_mtok) /
         1e6;
}

nlohmann::ordered_json UsageJson(const Usage& u) {
  nlohmann::ordered_json j;
  j["prompt_tokens"] = u.prompt_tokens;
  j["completion_tokens"] = u.completion_tokens;
  j["total_tokens"] = u.prompt_tokens + u.completion_tokens;
  j["prompt_tokens_details"] = {{"cached_tokens", u.cached_tokens}};
  j["prompt_cache_hit_tokens"] = u.cached_tokens;
  j["prompt_cache_miss_tokens"] = u.miss_tokens();
  return j;
}

}  // namespace kvtier::serving
