#include "policies/lru/lru.h"

namespace kvtier::policies {

void LruPolicy::OnInsert(const ObjectInfo& info, uint64_t now_us) {
  auto it = index_.find(info.id);
  if (it != index_.end()) {
    OnAccess(info.id, now_us);
    return;
  }
  order_.push_front(info.id);
  index_.emplace(info.id, order_.begin());
}

void LruPolicy::OnAccess(ObjectId id, uint64_t /*now_us*/) {
  auto it = index_.find(id);
  if (it == index_.end()) return;
  order_.splice(order_.begin(), order_, it->second);
}

void LruPolicy::OnRemove(ObjectId id) {
  auto it = index_.find(id);
  if (it == index_.end()) return;
  order_.erase(it->second);
  index_.erase(it);
}

std::optional<ObjectId> LruPolicy::Evict(uint64_t /*now_us*/) {
  if (order_.empty()) return std::nullopt;
  ObjectId victim = order_.back();
  order_.pop_back();
  index_.erase(victim);
  return victim;
}

}  // namespace kvtier::policies
