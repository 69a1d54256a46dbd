// ParamReader: strict parsing of PolicyParams ("key=value" strings) for one policy.
//
//   ParamReader r("ttl", params);
//   uint64_t ttl_ms = 259200000;
//   KVTIER_RETURN_IF_ERROR(r.Uint("ttl_global_ms", &ttl_ms));
//   KVTIER_RETURN_IF_ERROR(r.Finish());   // InvalidArgument naming any unknown key
//
// Malformed values are InvalidArgument; an absent key leaves the default untouched.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <string_view>

#include "common/status.h"
#include "policies/policy.h"

namespace kvtier::policies::internal {

class ParamReader {
 public:
  ParamReader(std::string_view policy, const PolicyParams& params)
      : policy_(policy), params_(params) {}

  Status Uint(std::string_view key, uint64_t* out, uint64_t min = 0, uint64_t max = UINT64_MAX);
  Status Double(std::string_view key, double* out, double min, double max);
  Status Bool(std::string_view key, bool* out);
  // InvalidArgument if any key was never read.
  Status Finish() const;

 private:
  const std::string* Lookup(std::string_view key);
  std::string policy_;
  const PolicyParams& params_;
  std::set<std::string, std::less<>> known_;
};

}  // namespace kvtier::policies::internal
