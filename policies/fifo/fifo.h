// FIFO: evicts the object inserted longest ago; hits change nothing. O(1) per operation.
// Thread safety: none (see policy.h).
#pragma once

#include "policies/internal/slab_list.h"
#include "policies/policy.h"

namespace kvtier::policies {

class FifoPolicy final : public EvictionPolicy {
 public:
  std::string_view Name() const override { return "fifo"; }
  void OnInsert(const ObjectInfo& info, uint64_t now_us) override;
  void OnAccess(ObjectId /*id*/, uint64_t /*now_us*/) override {}
  void OnRemove(ObjectId id) override;
  std::optional<ObjectId> Evict(uint64_t now_us) override;
  size_t Size() const override { return slab_.Live(); }
  bool Contains(ObjectId id) const override { return slab_.Find(id) != internal::kNil; }

 private:
  struct Empty {};
  internal::Slab<Empty> slab_;
  internal::ListHead queue_;  // head = newest
};

}  // namespace kvtier::policies
