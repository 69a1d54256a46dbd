// TTL: each object expires `ttl` after its last access, with a TTL per ObjectKind (global KV
// lives ~72 h, SWA state minutes). Evict() returns the earliest-expired object first; when
// nothing has expired it falls back to LRU across kinds. PopExpired() lets an owner reap
// expired objects proactively. O(1) per operation (one LRU list per kind: within a kind,
// recency order is expiry order).
//
// Parameters: ttl_global_ms (259200000 = 72 h), ttl_swa_ms (600000 = 10 min),
// ttl_blob_ms (86400000 = 24 h).
// Thread safety: none (see policy.h).
#pragma once

#include <array>

#include "policies/internal/slab_list.h"
#include "policies/policy.h"

namespace kvtier::policies {

struct TtlOptions {
  uint64_t ttl_global_ms = 72ull * 3600 * 1000;
  uint64_t ttl_swa_ms = 10ull * 60 * 1000;
  uint64_t ttl_blob_ms = 24ull * 3600 * 1000;
};

class TtlPolicy final : public EvictionPolicy {
 public:
  explicit TtlPolicy(const TtlOptions& options = {});
  static StatusOr<std::unique_ptr<EvictionPolicy>> Make(const PolicyParams& params);

  std::string_view Name() const override { return "ttl"; }
  void OnInsert(const ObjectInfo& info, uint64_t now_us) override;
  void OnAccess(ObjectId id, uint64_t now_us) override;
  void OnRemove(ObjectId id) override;
  std::optional<ObjectId> Evict(uint64_t now_us) override;
  size_t Size() const override { return slab_.Live(); }
  bool Contains(ObjectId id) const override { return slab_.Find(id) != internal::kNil; }

  // Removes and returns one object whose TTL has passed at now_us; nullopt when none.
  std::optional<ObjectId> PopExpired(uint64_t now_us);

 private:
  static constexpr size_t kKinds = 3;
  struct Stamp {
    uint64_t last_access_us = 0;
  };
  uint64_t ExpiryUs(uint32_t slot) const;
  ObjectId Take(uint32_t slot);

  std::array<uint64_t, kKinds> ttl_us_;
  internal::Slab<Stamp> slab_;
  std::array<internal::ListHead, kKinds> lists_;  // per kind; head = most recent
};

}  // namespace kvtier::policies
