#include "policies/fifo/fifo.h"

namespace kvtier::policies {

void FifoPolicy::OnInsert(const ObjectInfo& info, uint64_t /*now_us*/) {
  if (slab_.Find(info.id) != internal::kNil) return;
  queue_.PushFront(slab_, slab_.Alloc(info.id));
}

void FifoPolicy::OnRemove(ObjectId id) {
  uint32_t slot = slab_.Find(id);
  if (slot == internal::kNil) return;
  queue_.Unlink(slab_, slot);
  slab_.Free(slot);
}

std::optional<ObjectId> FifoPolicy::Evict(uint64_t /*now_us*/) {
  if (queue_.empty()) return std::nullopt;
  uint32_t slot = queue_.tail;
  ObjectId victim = slab_[slot].id;
  queue_.Unlink(slab_, slot);
  slab_.Free(slot);
  return victim;
}

}  // namespace kvtier::policies
