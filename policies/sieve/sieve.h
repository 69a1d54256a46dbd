// SIEVE (Zhang et al., NSDI'24): a FIFO queue with one "visited" bit per object and a hand.
// A hit sets the bit. Eviction moves the hand from the oldest object towards the newest,
// clearing set bits, and evicts the first object whose bit is clear; the hand stays where it
// stopped (it does not return to the tail), which is what separates SIEVE from CLOCK.
// New objects enter at the head. Matches libCacheSim's Sieve.c step for step.
// Thread safety: none (see policy.h).
#pragma once

#include "policies/internal/slab_list.h"
#include "policies/policy.h"

namespace kvtier::policies {

class SievePolicy final : public EvictionPolicy {
 public:
  std::string_view Name() const override { return "sieve"; }
  void OnInsert(const ObjectInfo& info, uint64_t now_us) override;
  void OnAccess(ObjectId id, uint64_t now_us) override;
  void OnRemove(ObjectId id) override;
  std::optional<ObjectId> Evict(uint64_t now_us) override;
  size_t Size() const override { return slab_.Live(); }
  bool Contains(ObjectId id) const override { return slab_.Find(id) != internal::kNil; }

  // For tests: whether `id` has its visited bit set (false when untracked).
  bool TEST_Visited(ObjectId id) const;

 private:
  struct Bits {
    bool visited = false;
  };
  internal::Slab<Bits> slab_;
  internal::ListHead queue_;        // head = newest
  uint32_t hand_ = internal::kNil;  // kNil: start from the tail
};

}  // namespace kvtier::policies
