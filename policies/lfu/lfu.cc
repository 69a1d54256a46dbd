#include "policies/lfu/lfu.h"

namespace kvtier::policies {

void LfuPolicy::OnInsert(const ObjectInfo& info, uint64_t now_us) {
  if (entries_.count(info.id) != 0) return OnAccess(info.id, now_us);
  Key key{1, ++sequence_, info.id};
  order_.insert(key);
  entries_.emplace(info.id, key);
}

void LfuPolicy::OnAccess(ObjectId id, uint64_t /*now_us*/) {
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  order_.erase(it->second);
  it->second = Key{std::get<0>(it->second) + 1, ++sequence_, id};
  order_.insert(it->second);
}

void LfuPolicy::OnRemove(ObjectId id) {
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  order_.erase(it->second);
  entries_.erase(it);
}

std::optional<ObjectId> LfuPolicy::Evict(uint64_t /*now_us*/) {
  if (order_.empty()) return std::nullopt;
  ObjectId victim = std::get<2>(*order_.begin());
  order_.erase(order_.begin());
  entries_.erase(victim);
  return victim;
}

}  // namespace kvtier::policies
