#include "policies/s3fifo/s3fifo.h"

#include <algorithm>

#include "policies/internal/params.h"

namespace kvtier::policies {

StatusOr<std::unique_ptr<EvictionPolicy>> S3FifoPolicy::Make(const PolicyParams& params) {
  S3FifoOptions o;
  internal::ParamReader r("s3fifo", params);
  KVTIER_RETURN_IF_ERROR(r.Double("small_ratio", &o.small_ratio, 0.01, 0.9));
  KVTIER_RETURN_IF_ERROR(r.Double("ghost_ratio", &o.ghost_ratio, 0.0, 4.0));
  KVTIER_RETURN_IF_ERROR(r.Uint("move_to_main_threshold", &o.move_to_main_threshold, 1, 64));
  uint64_t fill_main_first = o.fill_main_first ? 1 : 0;
  KVTIER_RETURN_IF_ERROR(r.Uint("fill_main_first", &fill_main_first, 0, 1));
  o.fill_main_first = fill_main_first != 0;
  KVTIER_RETURN_IF_ERROR(r.Finish());
  return std::unique_ptr<EvictionPolicy>(new S3FifoPolicy(o));
}

internal::ListHead& S3FifoPolicy::ListOf(uint8_t list) {
  return list == kSmall ? small_ : list == kMain ? main_ : ghost_;
}

void S3FifoPolicy::OnCapacity(uint64_t capacity_objects) {
  capacity_ = capacity_objects;
  small_capacity_ = std::max<uint64_t>(
      1, static_cast<uint64_t>(static_cast<double>(capacity_) * options_.small_ratio));
  main_capacity_ = capacity_ > small_capacity_ ? capacity_ - small_capacity_ : 1;
  ghost_capacity_ = static_cast<uint64_t>(static_cast<double>(capacity_) * options_.ghost_ratio);
}

bool S3FifoPolicy::Contains(ObjectId id) const {
  uint32_t slot = slab_.Find(id);
  return slot != internal::kNil && slab_[slot].list != kGhost;
}
bool S3FifoPolicy::TEST_InGhost(ObjectId id) const {
  uint32_t slot = slab_.Find(id);
  return slot != internal::kNil && slab_[slot].list == kGhost;
}
bool S3FifoPolicy::TEST_InMain(ObjectId id) const {
  uint32_t slot = slab_.Find(id);
  return slot != internal::kNil && slab_[slot].list == kMain;
}

void S3FifoPolicy::Drop(uint32_t slot) {
  ListOf(slab_[slot].list).Unlink(slab_, slot);
  slab_.Free(slot);
}

void S3FifoPolicy::Push(uint32_t slot, uint8_t list) {
  slab_[slot].list = list;
  ListOf(list).PushFront(slab_, slot);
}

void S3FifoPolicy::OnMiss(ObjectId id, uint64_t /*now_us*/) {
  evicted_.Clear();
  hit_on_ghost_ = false;
  uint32_t slot = slab_.Find(id);
  if (slot != internal::kNil && slab_[slot].list == kGhost) {
    Drop(slot);
    hit_on_ghost_ = true;
  }
}

void S3FifoPolicy::OnInsert(const ObjectInfo& info, uint64_t now_us) {
  evicted_.Clear();
  uint32_t slot = slab_.Find(info.id);
  if (slot != internal::kNil) {
    if (slab_[slot].list != kGhost) return OnAccess(info.id, now_us);
    Drop(slot);  // the owner did not call OnMiss
    hit_on_ghost_ = true;
  }
  uint8_t list = kSmall;
  if (hit_on_ghost_ || (options_.fill_main_first && !has_evicted_ && capacity_ > 0 &&
                        small_.size >= small_capacity_)) {
    list = kMain;
  }
  hit_on_ghost_ = false;
  slot = slab_.Alloc(info.id);
  Push(slot, list);
}

void S3FifoPolicy::OnAccess(ObjectId id, uint64_t /*now_us*/) {
  evicted_.Clear();
  uint32_t slot = slab_.Find(id);
  if (slot == internal::kNil || slab_[slot].list == kGhost) return;
  auto& f = slab_[slot].data.freq;
  if (f < UINT32_MAX) ++f;
}

void S3FifoPolicy::OnRemove(ObjectId id) {
  evicted_.Clear();
  uint32_t slot = slab_.Find(id);
  if (slot != internal::kNil) Drop(slot);
}

void S3FifoPolicy::AddGhost(ObjectId id) {
  if (ghost_capacity_ == 0) return;
  while (ghost_.size >= ghost_capacity_) Drop(ghost_.tail);
  Push(slab_.Alloc(id), kGhost);
}

ObjectId S3FifoPolicy::EvictSmall() {
  // Bounded: each pass moves one object out of small. If every object in small was hot, they
  // all moved to main and the victim comes from main (as libCacheSim's evict loop does).
  while (!small_.empty()) {
    uint32_t slot = small_.tail;
    small_.Unlink(slab_, slot);
    if (slab_[slot].data.freq >= options_.move_to_main_threshold) {
      slab_[slot].data.freq = 0;
      Push(slot, kMain);
      continue;
    }
    ObjectId victim = slab_[slot].id;
    evicted_.Add(victim, Evicted{kSmall, slab_[slot].data.freq});
    slab_.Free(slot);
    AddGhost(victim);
    return victim;
  }
  return EvictMain();
}

ObjectId S3FifoPolicy::EvictMain() {
  // Bounded: every reinsertion decrements a counter capped at 2.
  while (true) {
    uint32_t slot = main_.tail;
    uint32_t f = slab_[slot].data.freq;
    if (f >= 1) {
      main_.MoveToFront(slab_, slot);
      slab_[slot].data.freq = std::min<uint32_t>(f, 3) - 1;
      continue;
    }
    ObjectId victim = slab_[slot].id;
    Drop(slot);
    evicted_.Add(victim, Evicted{kMain, 0});
    return victim;
  }
}

std::optional<ObjectId> S3FifoPolicy::Evict(uint64_t /*now_us*/) {
  if (Size() == 0) return std::nullopt;
  if (capacity_ == 0) OnCapacity(Size());
  has_evicted_ = true;
  if (main_.size > main_capacity_ || small_.empty()) {
    if (!main_.empty()) return EvictMain();
  }
  if (small_.empty()) return EvictMain();
  return EvictSmall();
}

void S3FifoPolicy::OnGiveBack(const ObjectInfo& info, uint64_t /*now_us*/) {
  const std::optional<Evicted> e = evicted_.Take(info.id);
  uint32_t slot = slab_.Find(info.id);
  if (slot != internal::kNil) {
    if (slab_[slot].list != kGhost) return;  // cached: nothing to undo
    Drop(slot);                              // the ghost its eviction left
  }
  slot = slab_.Alloc(info.id);
  slab_[slot].data.freq = e ? e->freq : 0;
  Push(slot, e ? e->list : static_cast<uint8_t>(kSmall));
}

}  // namespace kvtier::policies
