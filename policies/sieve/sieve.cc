#include "policies/sieve/sieve.h"

namespace kvtier::policies {

void SievePolicy::OnInsert(const ObjectInfo& info, uint64_t now_us) {
  if (slab_.Find(info.id) != internal::kNil) return OnAccess(info.id, now_us);
  queue_.PushFront(slab_, slab_.Alloc(info.id));
}

void SievePolicy::OnAccess(ObjectId id, uint64_t /*now_us*/) {
  uint32_t slot = slab_.Find(id);
  if (slot != internal::kNil) slab_[slot].data.visited = true;
}

void SievePolicy::OnRemove(ObjectId id) {
  uint32_t slot = slab_.Find(id);
  if (slot == internal::kNil) return;
  if (hand_ == slot) hand_ = slab_[slot].prev;
  queue_.Unlink(slab_, slot);
  slab_.Free(slot);
}

std::optional<ObjectId> SievePolicy::Evict(uint64_t /*now_us*/) {
  if (queue_.empty()) return std::nullopt;
  uint32_t slot = hand_ == internal::kNil ? queue_.tail : hand_;
  // Bounded: one full lap clears every bit, so at most size + 1 steps.
  while (slab_[slot].data.visited) {
    slab_[slot].data.visited = false;
    slot = slab_[slot].prev == internal::kNil ? queue_.tail : slab_[slot].prev;
  }
  hand_ = slab_[slot].prev;
  ObjectId victim = slab_[slot].id;
  queue_.Unlink(slab_, slot);
  slab_.Free(slot);
  return victim;
}

bool SievePolicy::TEST_Visited(ObjectId id) const {
  uint32_t slot = slab_.Find(id);
  return slot != internal::kNil && slab_[slot].data.visited;
}

}  // namespace kvtier::policies
