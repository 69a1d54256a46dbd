// admit-all: every candidate is admitted to SSD.
#pragma once

#include "policies/policy.h"

namespace kvtier::policies {

class AdmitAllPolicy final : public AdmissionPolicy {
 public:
  std::string_view Name() const override { return "admit-all"; }
  bool Admit(const ObjectInfo& /*info*/, uint64_t /*now_us*/) override { return true; }
};

}  // namespace kvtier::policies
