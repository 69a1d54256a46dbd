// long-tail: a reuse-aware, prefix-structure-aware eviction policy for KV units whose reuse
// has a long tail (minutes to ~72 h). The model (docs/POLICIES.md has the full description):
//
//  * Reuse gaps are learned online, per class (the number of earlier hits of a unit: 0, 1, 2,
//    3+), in log-spaced age buckets (base_ms * 2^(i/2), 48 buckets: out to ~194 days, well past
//    72 h). A hit at age a counts a reuse in bucket(a); an eviction at age a counts a censored
//    lifetime (the unit was not reused before a). A ghost table of recently evicted ids turns a
//    later re-reference into an observed reuse gap, so the tail beyond what the cache holds is
//    learned too. Counts decay by `decay` every `relearn_every` events.
//  * From these, a Kaplan-Meier hazard per bucket gives P(reuse within horizon | age, class).
//    The horizon is `horizon_ms`, or (0, the default) the cache's own characteristic time: an
//    EWMA of the age of evicted units.
//  * Structure: a unit with cached children (units whose parent_id is this unit) is worth
//    (1 + child_weight * children) times more; with leaves_first, a sampled leaf is always
//    evicted before any sampled interior unit. A unit whose parent is not cached is an orphan
//    (a prefix cache cannot reach it) and its score is multiplied by orphan_factor.
//  * Cost: score *= (recompute_tokens / size_bytes) / mean over cached units, raised to
//    cost_exponent (units with unknown cost count as the mean).
//  * Eviction samples `sample_size` cached units with the seeded RNG (PolicyParams::seed) and
//    evicts the lowest score (ties: least recently used). Deterministic for a seed.
//
// Parameters (PolicyParams, all optional): horizon_ms (0 = auto), sample_size (64),
// base_ms (1000), decay (0.9), relearn_every (4096), ghost_factor (2.0: ghost entries as a
// multiple of the cached count), child_weight (1.0), leaves_first (1), orphan_factor (0.5),
// cost_exponent (1.0), min_samples (64: per class, below this the class borrows the pooled
// estimate).
// Thread safety: none (see policy.h).
#pragma once

#include <array>
#include <deque>
#include <unordered_map>
#include <vector>

#include "policies/policy.h"

namespace kvtier::policies {

struct LongTailOptions {
  uint64_t horizon_ms = 0;
  uint64_t sample_size = 64;
  uint64_t base_ms = 1000;
  double decay = 0.9;
  uint64_t relearn_every = 4096;
  double ghost_factor = 2.0;
  double child_weight = 1.0;
  bool leaves_first = true;
  double orphan_factor = 0.5;
  double cost_exponent = 1.0;
  uint64_t min_samples = 64;
  uint64_t seed = 42;
};

class LongTailPolicy final : public EvictionPolicy {
 public:
  static constexpr size_t kClasses = 4;
  static constexpr size_t kBuckets = 48;

  explicit LongTailPolicy(const LongTailOptions& options = {});
  static StatusOr<std::unique_ptr<EvictionPolicy>> Make(const PolicyParams& params);

  std::string_view Name() const override { return "long-tail"; }
  void OnInsert(const ObjectInfo& info, uint64_t now_us) override;
  void OnAccess(ObjectId id, uint64_t now_us) override;
  void OnRemove(ObjectId id) override;
  std::optional<ObjectId> Evict(uint64_t now_us) override;
  size_t Size() const override { return objects_.size(); }
  bool Contains(ObjectId id) const override { return objects_.count(id) != 0; }

  // The learned P(reuse within horizon | age, class) (for tests and docs).
  double TEST_ReuseProbability(size_t cls, uint64_t age_ms) const;
  uint64_t TEST_HorizonMs() const;
  uint32_t TEST_Children(ObjectId id) const;

 private:
  struct Object {
    uint64_t last_access_us = 0;
    ObjectId parent = kNoParent;
    double cost_per_byte = 0;  // 0: unknown
    uint32_t children = 0;     // cached units whose parent is this one
    uint32_t position = 0;     // index in members_
    uint8_t cls = 0;
  };
  struct Ghost {
    uint64_t last_access_us = 0;
    uint8_t cls = 0;
  };

  size_t Bucket(uint64_t age_us) const;
  double Score(const Object& o, uint64_t now_us) const;
  void CountEvent(bool reuse, size_t cls, uint64_t age_us);
  void Relearn();
  void Forget(ObjectId id, Object& o);  // unlink from members_ and the parent's child count
  uint64_t NextRandom();

  LongTailOptions options_;
  std::unordered_map<ObjectId, Object> objects_;
  std::vector<ObjectId> members_;  // for O(1) uniform sampling
  std::unordered_map<ObjectId, Ghost> ghosts_;
  std::deque<ObjectId> ghost_order_;

  // Learned state. counts_[reuse?1:0][class][bucket].
  std::array<std::array<std::array<double, kBuckets>, kClasses>, 2> counts_{};
  std::array<std::array<double, kBuckets>, kClasses> reuse_p_{};  // P(reuse in horizon|age)
  std::array<uint64_t, kBuckets> bucket_lower_ms_{};
  uint64_t events_since_learn_ = 0;
  double eviction_age_ms_ewma_ = 0;
  double cost_sum_ = 0;
  uint64_t cost_known_ = 0;
  uint64_t rng_state_;
};

}  // namespace kvtier::policies
