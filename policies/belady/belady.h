// Belady's MIN: evicts the object whose next access lies farthest in the future. It needs the
// future, so it exists for the trace simulator only and is NOT in the registry (a live tier
// cannot use it). At each reference of an id, the owner calls SetNextAccess(id, t) with the
// position (any monotone clock: the simulator uses the index of the next reference) of that
// id's next reference, or kNever; the id's next OnInsert/OnAccess takes the latest one given
// (kNever when none was), however late it comes (a prefix layer holds accesses back and gives
// victims back). Like libCacheSim's Belady.c it
// evicts among cached objects before inserting the new one (no bypass).
// O(log n) per operation (a max-heap with lazy deletion).
// Thread safety: none (see policy.h).
#pragma once

#include <queue>
#include <unordered_map>
#include <utility>
#include <vector>

#include "policies/policy.h"

namespace kvtier::policies {

class BeladyPolicy final : public EvictionPolicy {
 public:
  static constexpr uint64_t kNever = UINT64_MAX;

  std::string_view Name() const override { return "belady"; }
  // The next access of `id` after its latest reference. Kept per id (one entry per id ever
  // given: the simulator's memory, not a live tier's).
  void SetNextAccess(ObjectId id, uint64_t next_access) { hints_[id] = next_access; }

  void OnInsert(const ObjectInfo& info, uint64_t now_us) override;
  void OnAccess(ObjectId id, uint64_t now_us) override;
  void OnRemove(ObjectId id) override { next_.erase(id); }
  std::optional<ObjectId> Evict(uint64_t now_us) override;
  size_t Size() const override { return next_.size(); }
  bool Contains(ObjectId id) const override { return next_.count(id) != 0; }

 private:
  uint64_t TakeHint(ObjectId id);
  void Compact();

  std::unordered_map<ObjectId, uint64_t> hints_;             // id -> its latest SetNextAccess
  std::unordered_map<ObjectId, uint64_t> next_;              // tracked -> next access
  std::priority_queue<std::pair<uint64_t, ObjectId>> heap_;  // max next first; stale entries
};

}  // namespace kvtier::policies
