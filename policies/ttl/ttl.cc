#include "policies/ttl/ttl.h"

#include "policies/internal/params.h"

namespace kvtier::policies {

TtlPolicy::TtlPolicy(const TtlOptions& o)
    : ttl_us_{o.ttl_global_ms * 1000, o.ttl_swa_ms * 1000, o.ttl_blob_ms * 1000} {}

StatusOr<std::unique_ptr<EvictionPolicy>> TtlPolicy::Make(const PolicyParams& params) {
  TtlOptions o;
  internal::ParamReader r("ttl", params);
  constexpr uint64_t kMaxMs = 365ull * 24 * 3600 * 1000;  // a year: keeps *1000 in range
  KVTIER_RETURN_IF_ERROR(r.Uint("ttl_global_ms", &o.ttl_global_ms, 1, kMaxMs));
  KVTIER_RETURN_IF_ERROR(r.Uint("ttl_swa_ms", &o.ttl_swa_ms, 1, kMaxMs));
  KVTIER_RETURN_IF_ERROR(r.Uint("ttl_blob_ms", &o.ttl_blob_ms, 1, kMaxMs));
  KVTIER_RETURN_IF_ERROR(r.Finish());
  return std::unique_ptr<EvictionPolicy>(new TtlPolicy(o));
}

uint64_t TtlPolicy::ExpiryUs(uint32_t slot) const {
  return slab_[slot].data.last_access_us + ttl_us_[slab_[slot].list];
}

ObjectId TtlPolicy::Take(uint32_t slot) {
  ObjectId id = slab_[slot].id;
  lists_[slab_[slot].list].Unlink(slab_, slot);
  slab_.Free(slot);
  return id;
}

void TtlPolicy::OnInsert(const ObjectInfo& info, uint64_t now_us) {
  if (slab_.Find(info.id) != internal::kNil) return OnAccess(info.id, now_us);
  uint32_t slot = slab_.Alloc(info.id);
  size_t kind = static_cast<size_t>(info.kind) < kKinds ? static_cast<size_t>(info.kind) : 2;
  slab_[slot].list = static_cast<uint8_t>(kind);
  slab_[slot].data.last_access_us = now_us;
  lists_[kind].PushFront(slab_, slot);
}

void TtlPolicy::OnAccess(ObjectId id, uint64_t now_us) {
  uint32_t slot = slab_.Find(id);
  if (slot == internal::kNil) return;
  slab_[slot].data.last_access_us = now_us;
  lists_[slab_[slot].list].MoveToFront(slab_, slot);
}

void TtlPolicy::OnRemove(ObjectId id) {
  uint32_t slot = slab_.Find(id);
  if (slot != internal::kNil) Take(slot);
}

std::optional<ObjectId> TtlPolicy::PopExpired(uint64_t now_us) {
  uint32_t best = internal::kNil;
  for (const auto& list : lists_) {
    if (list.empty()) continue;
    uint32_t s = list.tail;
    if (ExpiryUs(s) <= now_us && (best == internal::kNil || ExpiryUs(s) < ExpiryUs(best))) {
      best = s;
    }
  }
  if (best == internal::kNil) return std::nullopt;
  return Take(best);
}

std::optional<ObjectId> TtlPolicy::Evict(uint64_t now_us) {
  if (auto expired = PopExpired(now_us)) return expired;
  uint32_t oldest = internal::kNil;
  for (const auto& list : lists_) {
    if (list.empty()) continue;
    uint32_t s = list.tail;
    if (oldest == internal::kNil ||
        slab_[s].data.last_access_us < slab_[oldest].data.last_access_us) {
      oldest = s;
    }
  }
  if (oldest == internal::kNil) return std::nullopt;
  return Take(oldest);
}

}  // namespace kvtier::policies
