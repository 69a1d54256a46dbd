// S3-FIFO (Yang et al., SOSP'23): a small FIFO (10%) that filters one-hit wonders, a main
// FIFO (90%) run as CLOCK with a 2-bit counter, and a ghost FIFO of ids evicted from the small
// queue. A new id enters the small queue, or the main queue when it is in the ghost. Evicting
// from small: an object hit at least `move_to_main_threshold` times moves to main, otherwise
// it is evicted and its id remembered in the ghost. Evicting from main: an object with a
// non-zero counter is reinserted with counter min(c,3)-1. The defaults are libCacheSim's
// S3FIFO.c defaults (threshold 2, every new id enters small) and reproduce its miss ratios to
// 4 decimals on the shared traces (tests/sim/libcachesim_vectors_test.cc).
//
// Parameters (PolicyParams): small_ratio (0.10), ghost_ratio (0.90),
// move_to_main_threshold (2), fill_main_first (0). fill_main_first = 1 is the variant of
// one libCacheSim revision: until the first eviction, inserts go to main once small is full
// (with threshold 1 that is the policy kvtier shipped before; kept for comparison).
// Capacity from OnCapacity(), else inferred at the first Evict.
// OnGiveBack: the victim goes back to the head of the queue it left with the counter it had,
// its ghost entry dropped; a pending ghost-hit hint (OnMiss) stays for the next OnInsert.
// Thread safety: none (see policy.h).
#pragma once

#include "policies/internal/evicted_log.h"
#include "policies/internal/slab_list.h"
#include "policies/policy.h"

namespace kvtier::policies {

struct S3FifoOptions {
  double small_ratio = 0.10;            // fraction of capacity for the small queue
  double ghost_ratio = 0.90;            // ghost entries, as a fraction of capacity
  uint64_t move_to_main_threshold = 2;  // hits in small needed to move to main
  bool fill_main_first = false;         // before the first eviction, overflow small into main
};

class S3FifoPolicy final : public EvictionPolicy {
 public:
  explicit S3FifoPolicy(const S3FifoOptions& options = {}) : options_(options) {}
  static StatusOr<std::unique_ptr<EvictionPolicy>> Make(const PolicyParams& params);

  std::string_view Name() const override { return "s3fifo"; }
  void OnInsert(const ObjectInfo& info, uint64_t now_us) override;
  void OnAccess(ObjectId id, uint64_t now_us) override;
  void OnRemove(ObjectId id) override;
  void OnMiss(ObjectId id, uint64_t now_us) override;
  void OnCapacity(uint64_t capacity_objects) override;
  std::optional<ObjectId> Evict(uint64_t now_us) override;
  void OnGiveBack(const ObjectInfo& info, uint64_t now_us) override;
  size_t Size() const override { return small_.size + main_.size; }
  bool Contains(ObjectId id) const override;

  bool TEST_InGhost(ObjectId id) const;
  bool TEST_InMain(ObjectId id) const;

 private:
  enum List : uint8_t { kSmall = 1, kMain = 2, kGhost = 3 };
  struct Freq {
    uint32_t freq = 0;
  };
  internal::ListHead& ListOf(uint8_t list);
  void Drop(uint32_t slot);
  void Push(uint32_t slot, uint8_t list);
  ObjectId EvictSmall();
  ObjectId EvictMain();
  void AddGhost(ObjectId id);

  S3FifoOptions options_;
  internal::Slab<Freq> slab_;
  internal::ListHead small_, main_, ghost_;
  uint64_t capacity_ = 0, small_capacity_ = 0, main_capacity_ = 0, ghost_capacity_ = 0;
  bool has_evicted_ = false;
  bool hit_on_ghost_ = false;
  struct Evicted {
    uint8_t list = kSmall;
    uint32_t freq = 0;
  };
  internal::EvictedLog<Evicted> evicted_;  // for OnGiveBack
};

}  // namespace kvtier::policies
