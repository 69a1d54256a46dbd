// Weighted fair shares of one engine step's token budget across tenants (docs/SERVING.md,
// "Per-tenant fairness").
//
// FairShares splits `budget` tokens among tenants with demand by weight, max-min fair: a
// tenant that wants less than its weighted share gets all it wants and the rest is split
// again among the others (work-conserving: tokens are left unused only when every demand is
// met). The last split is rounded to whole tokens with a per-tenant credit carried across
// steps (the exact share minus what was given), so over many steps each tenant's tokens
// follow its weight even when a step's share is fractional (2 tenants, weights 3:1, a budget
// of 2 tokens: the steps alternate 2+0 and 1+1, on average 1.5 and 0.5). A tenant without
// unmet demand has its credit reset to 0 (no hoarding).
//
// Thread safety: pure function over its arguments.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace kvtier::serving {

// Largest weight a tenant may have (weights are 1..kTenantWeightMax; api_keys.h).
inline constexpr uint32_t kTenantWeightMax = 1000;

// demand[i], weight[i] (>= 1) and (*credit)[i] per tenant; returns the tokens given to each,
// given[i] <= demand[i], sum(given) = min(budget, sum(demand)). credit is resized to the
// tenants' count when it differs (new tenants start at 0).
std::vector<uint64_t> FairShares(std::span<const uint64_t> demand, std::span<const uint32_t> weight,
                                 uint64_t budget, std::vector<double>* credit);

}  // namespace kvtier::serving
