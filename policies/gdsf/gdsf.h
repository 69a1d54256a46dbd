// GDSF (Greedy-Dual-Size-Frequency, Cherkasova 1998): priority H = L + count * cost / size,
// evict the lowest H and raise the inflation value L to it, so that objects not touched for a
// while age out. cost = recompute_tokens (recompute cost; `default_cost` when 0), size =
// size_bytes (1 when 0): a unit that is expensive to recompute per byte stays longer.
// Ties go to the least recently touched. O(log n) per operation. OnGiveBack: the victim keeps
// its count and takes H = L + count * cost / size at the current L (as if touched, uncounted).
// Thread safety: none (see policy.h).
#pragma once

#include <set>
#include <tuple>
#include <unordered_map>

#include "policies/internal/evicted_log.h"
#include "policies/policy.h"

namespace kvtier::policies {

struct GdsfOptions {
  double default_cost = 1.0;  // cost of an object whose recompute_tokens is 0
};

class GdsfPolicy final : public EvictionPolicy {
 public:
  explicit GdsfPolicy(const GdsfOptions& options = {}) : options_(options) {}
  static StatusOr<std::unique_ptr<EvictionPolicy>> Make(const PolicyParams& params);

  std::string_view Name() const override { return "gdsf"; }
  void OnInsert(const ObjectInfo& info, uint64_t now_us) override;
  void OnAccess(ObjectId id, uint64_t now_us) override;
  void OnRemove(ObjectId id) override;
  std::optional<ObjectId> Evict(uint64_t now_us) override;
  void OnGiveBack(const ObjectInfo& info, uint64_t now_us) override;
  size_t Size() const override { return entries_.size(); }
  bool Contains(ObjectId id) const override { return entries_.count(id) != 0; }

  double TEST_Inflation() const { return inflation_; }

 private:
  using Key = std::tuple<double, uint64_t, ObjectId>;  // (H, last-touch sequence, id)
  struct Entry {
    Key key;
    uint64_t count = 0;
    double cost_per_byte = 0;
  };
  void Place(Entry& e, ObjectId id);
  void Insert(const ObjectInfo& info, uint64_t count);

  GdsfOptions options_;
  std::set<Key> order_;
  std::unordered_map<ObjectId, Entry> entries_;
  double inflation_ = 0;  // L
  uint64_t sequence_ = 0;
  internal::EvictedLog<uint64_t> evicted_;  // for OnGiveBack: a victim's count
};

}  // namespace kvtier::policies
