// PrefixLayer: the prefix structure that every eviction policy runs under for a fair comparison
// (docs/POLICIES.md, "Structures"). One implementation serves the trace simulator
// (`kvtier sim --structure prefix`, sim/simulator.cc) and the live tiers (DRAM, HBM and SSD
// under TierManagerOptions::eviction_structure = kPrefix), so that both make the same decisions
// for the same calls.
//
// It wraps any EvictionPolicy (the inner policy, owned) and is an EvictionPolicy itself: an
// owner calls it as it would call the inner policy, plus BeginRequest instead of OnRequest. It
// adds three rules; the inner policy only sees their effect:
//
//  1. Hits deepest first. OnAccess calls are held back and reach the inner policy in reverse
//     order of arrival, just before the next call of any other kind (or the next request, or
//     when kPendingHitsMax are waiting). Owners report a request's hits in prefix order, so the
//     inner policy sees them deepest first and a chain's root is its most recently used unit.
//  2. The running request is held. The units a request touched (OnAccess, OnMiss, OnInsert
//     since its BeginRequest; at most kHeldUnitsMax of them) are held: a victim among them is
//     set aside (the inner policy cannot choose it again) and Evict asks again, at most as many
//     times per Evict as the request holds units (or as BeginRequest's units_hint, when larger);
//     then the victim goes all the same (when the inner policy has nothing left, the first unit
//     set aside goes). The units set aside are then given back, in the order chosen
//     (EvictionPolicy::OnGiveBack: each goes back as it was, its eviction undone: no ghost, and
//     an OnMiss hint stays for the unit it was given for). A request resumed after others
//     (interleaved sessions; the owner calls BeginRequest with its key again) holds what it touched
//     before, for the last kHeldRequestsMax requests.
//  3. Leaf first. When the victim (after rule 2) has tracked children, the layer walks down to
//     a unit without tracked children (taking at each step the tracked child with the smallest
//     id), gives the victim back (OnGiveBack, after rule 2's) and evicts the leaf instead (inner
//     OnRemove). So a tier whose units are inserted parents first stays closed under prefixes.
//     Parent links come from ObjectInfo::parent_id; a cycle (a hostile client's parents) ends
//     the walk where it would revisit the victim.
//
// Not here, the owner's part: a partial unit is never cached (the simulator skips it; the engine
// never stores one), and the order in which a request's misses are inserted.
//
// Thread safety: none, as every policy (policy.h). Memory: per tracked unit an ObjectInfo and a
// child link; per remembered request its held ids (bounded by the limits above).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <set>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "policies/policy.h"

namespace kvtier::policies {

// Which structure a tier's policy runs under (--structure, eviction_structure).
enum class Structure : uint8_t { kPlain, kPrefix };
// "plain" / "prefix".
const char* StructureName(Structure s);
// InvalidArgument for anything but "plain" and "prefix".
StatusOr<Structure> ParseStructure(std::string_view name);
class PrefixLayer;
// `inner` itself under kPlain; inner wrapped in a PrefixLayer under kPrefix. *layer (when not
// null) becomes the layer, or null under kPlain.
std::unique_ptr<EvictionPolicy> WithStructure(std::unique_ptr<EvictionPolicy> inner,
                                              Structure structure, PrefixLayer** layer = nullptr);

class PrefixLayer final : public EvictionPolicy {
 public:
  static constexpr size_t kHeldUnitsMax = 8192;    // units held per request
  static constexpr size_t kHeldRequestsMax = 64;   // requests whose held units are remembered
  static constexpr size_t kPendingHitsMax = 8192;  // OnAccess calls held back at most

  explicit PrefixLayer(std::unique_ptr<EvictionPolicy> inner);

  // A request begins (or resumes: a key seen before) at now_us; the inner policy gets
  // OnRequest(now_us). Keys are the owner's request ids (any value; equal keys are one request).
  // units_hint: how many units the request names, when the owner knows it up front (the
  // simulator, for a Mooncake request: its prefill's blocks); 0 when not (the live tiers).
  void BeginRequest(uint64_t request_key, uint64_t now_us, size_t units_hint = 0);

  std::string_view Name() const override { return inner_->Name(); }
  void OnInsert(const ObjectInfo& info, uint64_t now_us) override;
  void OnAccess(ObjectId id, uint64_t now_us) override;
  void OnRemove(ObjectId id) override;
  void OnMiss(ObjectId id, uint64_t now_us) override;
  void OnCapacity(uint64_t capacity_objects) override;
  // A request without a key of its own (an owner that only has OnRequest): a new request.
  void OnRequest(uint64_t now_us) override { BeginRequest(next_anonymous_++, now_us); }
  std::optional<ObjectId> Evict(uint64_t now_us) override;
  size_t Size() const override { return inner_->Size(); }
  bool Contains(ObjectId id) const override { return inner_->Contains(id); }

  EvictionPolicy* inner() { return inner_.get(); }
  // Victims replaced by a leaf below them (rule 3), and held victims set aside and given back
  // (rule 2).
  uint64_t leaf_swaps() const { return leaf_swaps_; }
  uint64_t held_given_back() const { return held_given_back_; }

 private:
  void Flush();
  void Hold(ObjectId id);
  void Forget(ObjectId id);
  // The inner policy's Evict returned `id`, which stays: OnGiveBack.
  void GiveBack(ObjectId id, uint64_t now_us);

  std::unique_ptr<EvictionPolicy> inner_;
  std::unordered_map<ObjectId, ObjectInfo> info_;       // tracked units
  std::set<std::pair<ObjectId, ObjectId>> children_;    // (parent, child) of tracked children
  std::vector<std::pair<ObjectId, uint64_t>> pending_;  // held-back OnAccess calls, in order
  uint64_t request_ = 0;
  std::unordered_set<ObjectId> held_;  // the running request's units
  size_t units_hint_ = 0;              // the running request's BeginRequest units_hint
  std::deque<std::pair<uint64_t, std::vector<ObjectId>>> recent_;  // paused requests, newest first
  uint64_t next_anonymous_ = 1ull << 63;
  uint64_t leaf_swaps_ = 0, held_given_back_ = 0;
};

}  // namespace kvtier::policies
