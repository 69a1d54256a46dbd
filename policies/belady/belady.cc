#include "policies/belady/belady.h"

namespace kvtier::policies {

uint64_t BeladyPolicy::TakeHint(ObjectId id) {
  auto it = hints_.find(id);
  return it == hints_.end() ? kNever : it->second;
}

void BeladyPolicy::Compact() {
  // Stale heap entries are bounded to 4x the live ones: rebuild when exceeded.
  if (heap_.size() <= 4 * next_.size() + 1024) return;
  std::vector<std::pair<uint64_t, ObjectId>> live;
  live.reserve(next_.size());
  for (const auto& [id, next] : next_) live.emplace_back(next, id);
  heap_ = std::priority_queue<std::pair<uint64_t, ObjectId>>(live.begin(), live.end());
}

void BeladyPolicy::OnInsert(const ObjectInfo& info, uint64_t /*now_us*/) {
  uint64_t next = TakeHint(info.id);
  next_[info.id] = next;
  heap_.emplace(next, info.id);
  Compact();
}

void BeladyPolicy::OnAccess(ObjectId id, uint64_t /*now_us*/) {
  uint64_t next = TakeHint(id);
  auto it = next_.find(id);
  if (it == next_.end()) return;
  it->second = next;
  heap_.emplace(next, id);
  Compact();
}

std::optional<ObjectId> BeladyPolicy::Evict(uint64_t /*now_us*/) {
  while (!heap_.empty()) {
    auto [next, id] = heap_.top();
    heap_.pop();
    auto it = next_.find(id);
    if (it != next_.end() && it->second == next) {
      next_.erase(it);
      return id;
    }
  }
  return std::nullopt;
}

}  // namespace kvtier::policies
