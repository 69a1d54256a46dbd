#include "policies/lfu/lfu.h"

namespace kvtier::policies {

void LfuPolicy::OnInsert(const ObjectInfo& info, uint64_t now_us) {
  evicted_.Clear();
  if (entries_.count(info.id) != 0) return OnAccess(info.id, now_us);
  Key key{1, ++sequence_, info.id};
  order_.insert(key);
  entries_.emplace(info.id, key);
}

void LfuPolicy::OnAccess(ObjectId id, uint64_t /*now_us*/) {
  evicted_.Clear();
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  order_.erase(it->second);
  it->second = Key{std::get<0>(it->second) + 1, ++sequence_, id};
  order_.insert(it->second);
}

void LfuPolicy::OnRemove(ObjectId id) {
  evicted_.Clear();
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  order_.erase(it->second);
  entries_.erase(it);
}

std::optional<ObjectId> LfuPolicy::Evict(uint64_t /*now_us*/) {
  if (order_.empty()) return std::nullopt;
  const auto [count, sequence, victim] = *order_.begin();
  (void)sequence;
  order_.erase(order_.begin());
  entries_.erase(victim);
  evicted_.Add(victim, count);
  return victim;
}

void LfuPolicy::OnGiveBack(const ObjectInfo& info, uint64_t /*now_us*/) {
  if (entries_.count(info.id) != 0) return;
  Key key{evicted_.Take(info.id).value_or(1), ++sequence_, info.id};
  order_.insert(key);
  entries_.emplace(info.id, key);
}

}  // namespace kvtier::policies
