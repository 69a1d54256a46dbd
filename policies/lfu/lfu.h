// LFU: evicts the object with the fewest accesses since it was inserted; ties go to the least
// recently used. O(log n) per operation. Counts are forgotten on eviction (no aging: a
// formerly hot object stays until something hotter arrives; see GDSF for an aged variant).
// OnGiveBack: the victim keeps its count, as the most recently touched of its count.
// Thread safety: none (see policy.h).
#pragma once

#include <set>
#include <tuple>
#include <unordered_map>

#include "policies/internal/evicted_log.h"
#include "policies/policy.h"

namespace kvtier::policies {

class LfuPolicy final : public EvictionPolicy {
 public:
  std::string_view Name() const override { return "lfu"; }
  void OnInsert(const ObjectInfo& info, uint64_t now_us) override;
  void OnAccess(ObjectId id, uint64_t now_us) override;
  void OnRemove(ObjectId id) override;
  std::optional<ObjectId> Evict(uint64_t now_us) override;
  void OnGiveBack(const ObjectInfo& info, uint64_t now_us) override;
  size_t Size() const override { return entries_.size(); }
  bool Contains(ObjectId id) const override { return entries_.count(id) != 0; }

 private:
  using Key = std::tuple<uint64_t, uint64_t, ObjectId>;  // (count, last-touch sequence, id)
  std::set<Key> order_;
  std::unordered_map<ObjectId, Key> entries_;
  uint64_t sequence_ = 0;
  internal::EvictedLog<uint64_t> evicted_;  // for OnGiveBack: a victim's count
};

}  // namespace kvtier::policies
