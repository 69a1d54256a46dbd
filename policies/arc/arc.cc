#include "policies/arc/arc.h"

#include <algorithm>

namespace kvtier::policies {

internal::ListHead& ArcPolicy::ListOf(uint8_t list) {
  switch (list) {
    case kT1:
      return t1_;
    case kT2:
      return t2_;
    case kB1:
      return b1_;
    default:
      return b2_;
  }
}

bool ArcPolicy::Contains(ObjectId id) const {
  uint32_t slot = slab_.Find(id);
  return slot != internal::kNil && (slab_[slot].list == kT1 || slab_[slot].list == kT2);
}

bool ArcPolicy::TEST_InGhost(ObjectId id) const {
  uint32_t slot = slab_.Find(id);
  return slot != internal::kNil && (slab_[slot].list == kB1 || slab_[slot].list == kB2);
}

bool ArcPolicy::TEST_InT2(ObjectId id) const {
  uint32_t slot = slab_.Find(id);
  return slot != internal::kNil && slab_[slot].list == kT2;
}

void ArcPolicy::Drop(uint32_t slot) {
  ListOf(slab_[slot].list).Unlink(slab_, slot);
  slab_.Free(slot);
}

void ArcPolicy::AdaptOnGhostHit(uint32_t slot) {
  if (slab_[slot].list == kB1) {
    double delta = std::max(static_cast<double>(b2_.size) / static_cast<double>(b1_.size), 1.0);
    p_ = std::min(p_ + delta, static_cast<double>(capacity_));
    in_b1_ = true;
  } else {
    double delta = std::max(static_cast<double>(b1_.size) / static_cast<double>(b2_.size), 1.0);
    p_ = std::max(p_ - delta, 0.0);
    in_b2_ = true;
  }
  Drop(slot);
}

void ArcPolicy::OnMiss(ObjectId id, uint64_t /*now_us*/) {
  evicted_.Clear();
  in_b1_ = in_b2_ = pending_replace_ = false;
  uint32_t slot = slab_.Find(id);
  if (slot == internal::kNil) return;
  uint8_t list = slab_[slot].list;
  if (list != kB1 && list != kB2) return;
  AdaptOnGhostHit(slot);
  pending_replace_ = true;
}

void ArcPolicy::OnInsert(const ObjectInfo& info, uint64_t now_us) {
  evicted_.Clear();
  uint32_t slot = slab_.Find(info.id);
  if (slot != internal::kNil) {
    uint8_t list = slab_[slot].list;
    if (list == kT1 || list == kT2) return OnAccess(info.id, now_us);
    AdaptOnGhostHit(slot);  // the owner did not call OnMiss
  }
  bool to_t2 = in_b1_ || in_b2_;
  in_b1_ = in_b2_ = pending_replace_ = false;
  slot = slab_.Alloc(info.id);
  slab_[slot].list = to_t2 ? kT2 : kT1;
  ListOf(slab_[slot].list).PushFront(slab_, slot);
}

void ArcPolicy::OnAccess(ObjectId id, uint64_t /*now_us*/) {
  evicted_.Clear();
  uint32_t slot = slab_.Find(id);
  if (slot == internal::kNil) return;
  auto& node = slab_[slot];
  if (node.list == kT1) {
    t1_.Unlink(slab_, slot);
    node.list = kT2;
    t2_.PushFront(slab_, slot);
  } else if (node.list == kT2) {
    t2_.MoveToFront(slab_, slot);
  }
}

void ArcPolicy::OnRemove(ObjectId id) {
  evicted_.Clear();
  uint32_t slot = slab_.Find(id);
  if (slot != internal::kNil) Drop(slot);
}

ObjectId ArcPolicy::Replace() {
  uint32_t slot;
  uint8_t ghost;
  const double t1 = static_cast<double>(t1_.size);
  if (t1_.size > 0 && (t1 > p_ || (t1 == p_ && in_b2_) || t2_.empty())) {
    slot = t1_.tail;
    t1_.Unlink(slab_, slot);
    ghost = kB1;
  } else {
    slot = t2_.tail;
    t2_.Unlink(slab_, slot);
    ghost = kB2;
  }
  slab_[slot].list = ghost;
  ListOf(ghost).PushFront(slab_, slot);
  evicted_.Add(slab_[slot].id, ghost == kB1 ? kT1 : kT2);
  return slab_[slot].id;
}

std::optional<ObjectId> ArcPolicy::Evict(uint64_t /*now_us*/) {
  if (Size() == 0) return std::nullopt;
  capacity_ = std::max<uint64_t>(capacity_, Size());
  if (pending_replace_) {
    pending_replace_ = false;
    return Replace();
  }
  const uint64_t c = capacity_;
  if (t1_.size + b1_.size + 1 > c) {
    // Case A: |T1| + |B1| = c.
    if (t1_.size < c) {
      if (!b1_.empty()) Drop(b1_.tail);
      return Replace();
    }
    uint32_t slot = t1_.tail;  // T1 alone fills the cache: evict without a ghost
    ObjectId victim = slab_[slot].id;
    Drop(slot);
    evicted_.Add(victim, kT1);
    return victim;
  }
  // Case B.
  if (t1_.size + t2_.size + b1_.size + b2_.size >= 2 * c && !b2_.empty()) Drop(b2_.tail);
  return Replace();
}

void ArcPolicy::OnGiveBack(const ObjectInfo& info, uint64_t /*now_us*/) {
  const std::optional<uint8_t> list = evicted_.Take(info.id);
  uint32_t slot = slab_.Find(info.id);
  if (slot != internal::kNil) {
    if (slab_[slot].list == kT1 || slab_[slot].list == kT2) return;  // cached: nothing to undo
    Drop(slot);                                                      // the ghost its eviction left
  }
  slot = slab_.Alloc(info.id);
  slab_[slot].list = list.value_or(kT1);
  ListOf(slab_[slot].list).PushFront(slab_, slot);
}

}  // namespace kvtier::policies
