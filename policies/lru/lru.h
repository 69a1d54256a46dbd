// LRU: evicts the least recently inserted-or-accessed object. O(1) per operation.
#pragma once

#include <list>
#include <unordered_map>

#include "policies/policy.h"

namespace kvtier::policies {

class LruPolicy final : public EvictionPolicy {
 public:
  std::string_view Name() const override { return "lru"; }
  void OnInsert(const ObjectInfo& info, uint64_t now_us) override;
  void OnAccess(ObjectId id, uint64_t now_us) override;
  void OnRemove(ObjectId id) override;
  std::optional<ObjectId> Evict(uint64_t now_us) override;
  size_t Size() const override { return index_.size(); }
  bool Contains(ObjectId id) const override { return index_.count(id) != 0; }

 private:
  std::list<ObjectId> order_;  // front = most recent
  std::unordered_map<ObjectId, std::list<ObjectId>::iterator> index_;
};

}  // namespace kvtier::policies
