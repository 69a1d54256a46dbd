// ARC (Megiddo & Modha, FAST'03): two LRU lists, T1 (seen once recently) and T2 (seen at
// least twice), with ghost lists B1/B2 of recently evicted ids. A ghost hit in B1 grows the
// target size p of T1, a ghost hit in B2 shrinks it: the policy adapts between recency and
// frequency. Follows libCacheSim's ARC.c (the REPLACE rule, case A/B) with its real-valued target p
// and deltas: p moves by max(|B2|/|B1|, 1) as a double, so small ghost lists adapt p by fractions.
//
// Capacity c: from OnCapacity(), else the number of objects tracked at the first Evict().
// For exact ARC the owner calls OnMiss(id) before evicting for id (policy.h); without it, a
// ghost hit is recognised at OnInsert and only adapts p.
// OnGiveBack: the victim goes back to the MRU end of the list it left (T1 or T2), its ghost
// entry dropped; a pending ghost-hit hint (OnMiss) stays for the next OnInsert.
// Thread safety: none (see policy.h).
#pragma once

#include "policies/internal/evicted_log.h"
#include "policies/internal/slab_list.h"
#include "policies/policy.h"

namespace kvtier::policies {

class ArcPolicy final : public EvictionPolicy {
 public:
  std::string_view Name() const override { return "arc"; }
  void OnInsert(const ObjectInfo& info, uint64_t now_us) override;
  void OnAccess(ObjectId id, uint64_t now_us) override;
  void OnRemove(ObjectId id) override;
  void OnMiss(ObjectId id, uint64_t now_us) override;
  void OnCapacity(uint64_t capacity_objects) override { capacity_ = capacity_objects; }
  std::optional<ObjectId> Evict(uint64_t now_us) override;
  void OnGiveBack(const ObjectInfo& info, uint64_t now_us) override;
  size_t Size() const override { return t1_.size + t2_.size; }
  bool Contains(ObjectId id) const override;

  // For tests: the current target size of T1, in objects.
  double TEST_Target() const { return p_; }
  bool TEST_InGhost(ObjectId id) const;
  bool TEST_InT2(ObjectId id) const;

 private:
  enum List : uint8_t { kT1 = 1, kT2 = 2, kB1 = 3, kB2 = 4 };
  struct Empty {};
  internal::ListHead& ListOf(uint8_t list);
  void Drop(uint32_t slot);  // unlink and free
  ObjectId Replace();        // moves one data object to its ghost list; returns its id
  void AdaptOnGhostHit(uint32_t slot);

  internal::Slab<Empty> slab_;
  internal::ListHead t1_, t2_, b1_, b2_;
  uint64_t capacity_ = 0;
  double p_ = 0;                           // target size of T1 in objects, in [0, capacity_]
  bool in_b1_ = false, in_b2_ = false;     // the pending miss was a ghost hit in B1 / B2
  bool pending_replace_ = false;           // OnMiss saw a ghost hit: the next Evict is REPLACE
  internal::EvictedLog<uint8_t> evicted_;  // for OnGiveBack: the list (T1/T2) a victim left
};

}  // namespace kvtier::policies
