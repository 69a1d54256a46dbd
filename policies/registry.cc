// Factories for every built-in policy. Add a policy: include its header, add a row.
#include <algorithm>
#include <functional>

#include "policies/admit_all/admit_all.h"
#include "policies/arc/arc.h"
#include "policies/fifo/fifo.h"
#include "policies/gdsf/gdsf.h"
#include "policies/lfu/lfu.h"
#include "policies/long_tail/long_tail.h"
#include "policies/lru/lru.h"
#include "policies/policy.h"
#include "policies/s3fifo/s3fifo.h"
#include "policies/second_hit/second_hit.h"
#include "policies/sieve/sieve.h"
#include "policies/ttl/ttl.h"
#include "policies/write_budget/write_budget.h"

namespace kvtier::policies {
namespace {

Status RejectParams(std::string_view policy, const PolicyParams& params) {
  if (params.values.empty()) return Status::Ok();
  return Status::InvalidArgument(std::string(policy) + " takes no parameter '" +
                                 params.values.front().first + "'");
}

template <typename P>
StatusOr<std::unique_ptr<EvictionPolicy>> MakePlain(std::string_view name, const PolicyParams& p) {
  KVTIER_RETURN_IF_ERROR(RejectParams(name, p));
  return std::unique_ptr<EvictionPolicy>(new P());
}

struct EvictionEntry {
  const char* name;
  std::function<StatusOr<std::unique_ptr<EvictionPolicy>>(const PolicyParams&)> make;
};
struct AdmissionEntry {
  const char* name;
  std::function<StatusOr<std::unique_ptr<AdmissionPolicy>>(const PolicyParams&)> make;
};

const std::vector<EvictionEntry>& EvictionTable() {
  static const std::vector<EvictionEntry> table = {
      {"lru", [](const PolicyParams& p) { return MakePlain<LruPolicy>("lru", p); }},
      {"fifo", [](const PolicyParams& p) { return MakePlain<FifoPolicy>("fifo", p); }},
      {"lfu", [](const PolicyParams& p) { return MakePlain<LfuPolicy>("lfu", p); }},
      {"arc", [](const PolicyParams& p) { return MakePlain<ArcPolicy>("arc", p); }},
      {"s3fifo", &S3FifoPolicy::Make},
      {"sieve", [](const PolicyParams& p) { return MakePlain<SievePolicy>("sieve", p); }},
      {"gdsf", &GdsfPolicy::Make},
      {"ttl", &TtlPolicy::Make},
      {"long-tail", &LongTailPolicy::Make},
  };
  return table;
}

const std::vector<AdmissionEntry>& AdmissionTable() {
  static const std::vector<AdmissionEntry> table = {
      {"admit-all",
       [](const PolicyParams& p) -> StatusOr<std::unique_ptr<AdmissionPolicy>> {
         KVTIER_RETURN_IF_ERROR(RejectParams("admit-all", p));
         return std::unique_ptr<AdmissionPolicy>(new AdmitAllPolicy());
       }},
      {"second-hit", &SecondHitPolicy::Make},
      {"write-budget", &WriteBudgetPolicy::Make},
  };
  return table;
}

bool IsPolicyName(std::string_view name) {
  for (const auto& e : EvictionTable()) {
    if (name == e.name) return true;
  }
  for (const auto& e : AdmissionTable()) {
    if (name == e.name) return true;
  }
  return false;
}

// Keys scoped as "policy:key" reach only that policy (as "key"); plain keys reach every policy.
// A scope that names no policy is InvalidArgument naming the key: no policy would read it, so a
// typo ("write_budget:bytes_per_day") would otherwise change nothing and report success.
StatusOr<PolicyParams> ParamsFor(std::string_view name, const PolicyParams& params) {
  PolicyParams out;
  out.seed = params.seed;
  out.keys_read = params.keys_read;
  for (const auto& [key, value] : params.values) {
    const size_t colon = key.find(':');
    if (colon == std::string::npos) {
      out.values.emplace_back(key, value);
      continue;
    }
    const std::string_view scope = std::string_view(key).substr(0, colon);
    if (scope == name) {
      out.values.emplace_back(key.substr(colon + 1), value);
    } else if (!IsPolicyName(scope)) {
      return Status::InvalidArgument("parameter '" + key + "': '" + std::string(scope) +
                                     "' is not a policy");
    }
  }
  return out;
}

}  // namespace

StatusOr<std::unique_ptr<EvictionPolicy>> MakeEvictionPolicy(std::string_view name,
                                                             const PolicyParams& params) {
  for (const auto& e : EvictionTable()) {
    if (name != e.name) continue;
    KVTIER_ASSIGN_OR_RETURN(PolicyParams own, ParamsFor(name, params));
    return e.make(own);
  }
  return Status::InvalidArgument("unknown eviction policy '" + std::string(name) + "'");
}

StatusOr<std::unique_ptr<AdmissionPolicy>> MakeAdmissionPolicy(std::string_view name,
                                                               const PolicyParams& params) {
  for (const auto& e : AdmissionTable()) {
    if (name != e.name) continue;
    KVTIER_ASSIGN_OR_RETURN(PolicyParams own, ParamsFor(name, params));
    return e.make(own);
  }
  return Status::InvalidArgument("unknown admission policy '" + std::string(name) + "'");
}

std::vector<std::string> EvictionPolicyNames() {
  std::vector<std::string> out;
  for (const auto& e : EvictionTable()) out.emplace_back(e.name);
  return out;
}

std::vector<std::string> EvictionPolicyParamKeys(std::string_view name) {
  std::vector<std::string> keys;
  PolicyParams probe;
  probe.keys_read = &keys;
  (void)MakeEvictionPolicy(name, probe);  // defaults only: cannot fail for a known name
  return keys;
}

bool SameParamsFor(std::string_view name, const PolicyParams& a, const PolicyParams& b) {
  auto reaching = [&](const PolicyParams& p) {
    std::vector<std::pair<std::string, std::string>> out;
    for (const auto& [key, value] : p.values) {
      const size_t colon = key.find(':');
      if (colon == std::string::npos) {
        out.emplace_back(key, value);
      } else if (std::string_view(key).substr(0, colon) == name) {
        out.emplace_back(key.substr(colon + 1), value);
      }
    }
    std::sort(out.begin(), out.end());
    return out;
  };
  return a.seed == b.seed && reaching(a) == reaching(b);
}

std::vector<std::string> AdmissionPolicyNames() {
  std::vector<std::string> out;
  for (const auto& e : AdmissionTable()) out.emplace_back(e.name);
  return out;
}

}  // namespace kvtier::policies
