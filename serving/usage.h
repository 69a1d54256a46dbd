// Usage and billing of one request (docs/SERVING.md, "Usage").
//
// cached_tokens are exactly the prompt tokens whose state came from the cache: tokens of
// whole units restored from kvtierd (their global KV was imported; the bounded replay that
// rebuilds the sliding-window rings over the last tokens of the hit counts as part of the
// hit, see docs/SERVING.md), or tokens still resident in the engine from the same tenant's
// previous request. Never more: a recomputed prompt reports 0, whatever the daemon holds.
// prompt_cache_hit_tokens + prompt_cache_miss_tokens == prompt_tokens.
//
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>

namespace kvtier::serving {

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;  // every sampled token, eos and stop-string tokens included
  int64_t cached_tokens = 0;      // <= prompt_tokens
  int64_t miss_tokens() const { return prompt_tokens - cached_tokens; }
};

// Per-tenant prices in currency units per million tokens; all 0 = no pricing.
struct Prices {
  double input_per_mtok = 0;         // uncached prompt tokens
  double cached_input_per_mtok = 0;  // cached prompt tokens
  double output_per_mtok = 0;        // completion tokens
  bool any() const {
    return input_per_mtok > 0 || cached_input_per_mtok > 0 || output_per_mtok > 0;
  }
};

double Cost(const Usage& usage, const Prices& prices);

// The OpenAI usage object plus DeepSeek's fields:
//   {"prompt_tokens", "completion_tokens", "total_tokens",
//    "prompt_tokens_details": {"cached_tokens"},
//    "prompt_cache_hit_tokens", "prompt_cache_miss_tokens"}
nlohmann::ordered_json UsageJson(const Usage& usage);

}  // namespace kvtier::serving
