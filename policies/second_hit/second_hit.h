// second-hit admission (Dynamo KVBM's "write to disk after the second use"): an object is
// admitted to SSD only once it has been looked up at least `hits_required` times (default 2;
// 1..1000). Lookups (AdmissionPolicy::OnLookup: one per reference of a unit) are counted in a
// bounded table of `max_tracked` ids (default 1<<20; 1..kMaxTrackedMax); when full, the
// oldest-tracked id is forgotten (FIFO), so memory stays bounded whatever the key space.
// Memory: at most kBytesPerTrackedId (48) bytes of heap per tracked id (a hash node of id and
// count in a 32-byte allocation, its bucket, its slot in the FIFO; 41 measured), so at most
// 48 MiB at the default and 768 MiB at kMaxTrackedMax (1<<24 ids), per policy instance (a
// policy set that replaces a second-hit holds both tables while it copies the counts).
// Thread safety: none (see policy.h).
#pragma once

#include <deque>
#include <unordered_map>

#include "policies/policy.h"

namespace kvtier::policies {

struct SecondHitOptions {
  uint64_t hits_required = 2;
  uint64_t max_tracked = 1u << 20;
  // The most ids a table may track (Make refuses more): 16 Mi ids, at most 768 MiB.
  static constexpr uint64_t kMaxTrackedMax = 1u << 24;
  // Heap bytes per tracked id, at most (tests/policies/admission_test.cc measures it).
  static constexpr uint64_t kBytesPerTrackedId = 48;
};

class SecondHitPolicy final : public AdmissionPolicy {
 public:
  explicit SecondHitPolicy(const SecondHitOptions& options = {}) : options_(options) {}
  static StatusOr<std::unique_ptr<AdmissionPolicy>> Make(const PolicyParams& params);

  std::string_view Name() const override { return "second-hit"; }
  bool Admit(const ObjectInfo& info, uint64_t now_us) override;
  void OnLookup(ObjectId id, uint64_t now_us) override;
  bool CountsLookups() const override { return true; }
  // From a second-hit `previous`: its counts (the newest max_tracked of them).
  void CarryOver(const AdmissionPolicy& previous, uint64_t now_us) override;

  size_t TEST_Tracked() const { return counts_.size(); }

 private:
  SecondHitOptions options_;
  std::unordered_map<ObjectId, uint64_t> counts_;
  std::deque<ObjectId> order_;  // tracking order, oldest first
};

}  // namespace kvtier::policies
