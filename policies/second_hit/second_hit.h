// second-hit admission (Dynamo KVBM's "write to disk after the second use"): an object is
// admitted to SSD only once it has been looked up at least `hits_required` times (default 2).
// Lookups are counted in a bounded table of `max_tracked` ids (default 1<<20); when full, the
// oldest-tracked id is forgotten (FIFO), so memory stays bounded whatever the key space.
// Thread safety: none (see policy.h).
#pragma once

#include <deque>
#include <unordered_map>

#include "policies/policy.h"

namespace kvtier::policies {

struct SecondHitOptions {
  uint64_t hits_required = 2;
  uint64_t max_tracked = 1u << 20;
};

class SecondHitPolicy final : public AdmissionPolicy {
 public:
  explicit SecondHitPolicy(const SecondHitOptions& options = {}) : options_(options) {}
  static StatusOr<std::unique_ptr<AdmissionPolicy>> Make(const PolicyParams& params);

  std::string_view Name() const override { return "second-hit"; }
  bool Admit(const ObjectInfo& info, uint64_t now_us) override;
  void OnLookup(ObjectId id, uint64_t now_us) override;
  // From a second-hit `previous`: its counts (the newest max_tracked of them).
  void CarryOver(const AdmissionPolicy& previous, uint64_t now_us) override;

  size_t TEST_Tracked() const { return counts_.size(); }

 private:
  SecondHitOptions options_;
  std::unordered_map<ObjectId, uint64_t> counts_;
  std::deque<ObjectId> order_;  // tracking order, oldest first
};

}  // namespace kvtier::policies
