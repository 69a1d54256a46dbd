// long-tail: a reuse-aware, prefix-structure-aware eviction policy for KV units whose reuse
// has a long tail (minutes to ~72 h). docs/POLICIES.md has the model, the measurements that
// motivated it and every parameter; in short:
//
//  * Every cached unit is in one class, fixed when it enters the cache or is hit:
//      0 fresh      never hit, inserted as part of a new prefix
//      1 extension  never hit, appended after a prefix that was hit in the same request (the
//                   new turn of a resumed conversation)
//      2/3/4        hit once / twice / three or more times (counts survive an eviction
//                   through the ghost table)
//      5 leaf       never hit and the last unit of its request (no request extended it by the
//                   time the next request started: typically the partial last block);
//                   requests come from OnRequest when the owner calls it, else are guessed
//                   (a unit whose parent is not the previously touched unit starts one)
//  * Per class, the policy learns online the distribution of reuse ages (age = time since
//    the unit entered the class): a hit, or a re-reference of an evicted unit still in the
//    ghost table, at age a counts one reuse in bucket(a); every entry into the class counts
//    one trial. Buckets are log-spaced, `buckets_per_octave` per doubling of base_ms, out to
//    ~12 days at the defaults (past 72 h). Counts decay by `decay` at every relearn.
//  * Value of a unit of class c at age a = its best achievable hit density: the maximum over
//    horizons T of P(reuse in (a, a+T] | not reused by a) / T, i.e. expected hits per unit of
//    cache time if it is kept a further T. Unlike a plain recency order this values a fresh
//    unit low while it is young and its reuse is still improbable, high around the typical
//    think time of a conversation, and low again when that has passed.
//  * Each class is a list ordered by entry time (oldest first); within one request's burst
//    (equal entry times) deeper units sit nearer the old end, so the deepest unit of a chain
//    goes first and cached prefixes stay contiguous. Units of one class at one age are
//    equivalent, and the value is (close to) unimodal in age, so the minimum of each class is
//    at one of its two ends: Evict compares the oldest and the youngest unit of every class
//    and evicts the lowest value (ties: the older entry). Exact, O(classes), no sampling.
//  * Cost: value *= ((recompute_tokens / size_bytes) / mean over inserts)^cost_exponent for
//    the compared candidates (units of unknown cost count as the mean).
//
//  * OnGiveBack (a prefix layer keeps a victim): the unit goes back where it was, with its class,
//    hit count and entry time, and its eviction is undone in the model (no ghost, no sampled
//    ghost, no censored observation, the oldest exact ghost the bound let go of comes back), so
//    a kept unit counts no reuse and its age stays true. A full sampled-ghost table's drop (and
//    lower rate) is taken back only when no eviction since has dropped another.
//
// Parameters (PolicyParams, all optional; defaults in LongTailOptions).
// Deterministic: no randomness at all (PolicyParams::seed is accepted and unused).
// Thread safety: none (see policy.h).
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <string>
#include <unordered_map>
#include <vector>

#include "policies/internal/evicted_log.h"
#include "policies/internal/slab_list.h"
#include "policies/policy.h"

namespace kvtier::policies {

struct LongTailOptions {
  // First bucket edge: ages below base_ms share bucket 0.
  uint64_t base_ms = 1000;
  // Log-spaced buckets per doubling of age (resolution of the learned distribution).
  uint64_t buckets_per_octave = 4;
  // Multiplier applied to all learned counts at every relearn (forgetting).
  double decay = 0.9;
  // Events (hits, ghost hits, evictions) between relearns; 0 = max(2048, capacity / 2).
  uint64_t relearn_every = 0;
  // Ghost entries (evicted ids kept to observe long reuse gaps) per unit of capacity.
  double ghost_factor = 8.0;
  // Entries a class needs before its own estimate replaces the prior (LRU by class).
  uint64_t min_entries = 50;
  // Keep fresh units that extend a hit prefix in their own class (1) rather than class 0.
  bool split_extension = true;
  // Move a request's last never-hit unit to the leaf class (5) when the next request starts.
  bool leaf_class = true;
  // Also consider the youngest unit of each class (needed when young units are worth less).
  bool young_end = true;
  // Weight of recompute cost per byte (0: off). Off by default: with depth-weighted costs
  // (sim: attention over the prefix) it favoured deep units and lost prefix tokens on the
  // conversation trace (docs/POLICIES.md), and prefill is priced per token, not per FLOP.
  double cost_exponent = 0.0;
  // Sampled ghosts (SHARDS-style spatial sampling): an evicted unit whose id hash falls below
  // the sampling threshold is remembered until it is re-referenced, however long that takes
  // (hours to days), and stands for 1/rate evicted units in the reuse-age model. The table
  // holds at most sampled_ghosts_max entries (about 40 bytes each): when full, the threshold
  // drops to the largest hash held and that entry leaves (fixed-size SHARDS), so the rate
  // only falls. 0 entries: off (the model then sees reuses of cached units and of the exact
  // ghosts only, a horizon of ghost_factor x capacity evictions).
  double ghost_sample_rate = 0.05;  // initial rate, [1/65536, 1]
  uint64_t sampled_ghosts_max = 65536;
  // Kaplan-Meier: a unit whose observation ends without a reuse (evicted and not sampled,
  // removed, a sampled ghost dropped, or still cached / sampled at relearn time) is censored
  // at its age then, instead of being counted as never reused.
  // Off by default: frozen by the tuning protocol in docs/POLICIES.md (it lost 0.014 of
  // summed prefix-token hit ratio on the tuning part; re-run after the prefix layer's
  // give-back fix it gains 0.008, defaults left as frozen); on, it is what the test checks.
  bool censoring = false;
  // Admission that adapts to capacity from ghost-hit feedback: the value of never-hit units
  // (fresh, extension) is multiplied by a weight w in [1/64, 64]; a ghost hit on a unit evicted
  // never hit raises w by admit_step (they were evicted too early), a ghost hit on a unit
  // evicted after hits lowers it. A small cache drives w down (fresh units are evicted first,
  // i.e. admitted for good on their second reference); a large one up. 0: off (w = 1).
  double admit_step = 0.0;
};

class LongTailPolicy final : public EvictionPolicy {
 public:
  static constexpr size_t kClasses = 6;
  static constexpr size_t kMaxBuckets = 192;
  enum Class : uint8_t { kFresh = 0, kExtension = 1, kHit1 = 2, kHit2 = 3, kHit3 = 4, kLeaf = 5 };

  explicit LongTailPolicy(const LongTailOptions& options = {});
  static StatusOr<std::unique_ptr<EvictionPolicy>> Make(const PolicyParams& params);

  std::string_view Name() const override { return "long-tail"; }
  void OnInsert(const ObjectInfo& info, uint64_t now_us) override;
  void OnAccess(ObjectId id, uint64_t now_us) override;
  void OnRemove(ObjectId id) override;
  void OnCapacity(uint64_t capacity_objects) override;
  // From the first call on, request boundaries and times come from here: the previous
  // request's never-hit leaves move to the leaf class, and the extension class is "a fresh
  // unit of a request that hit a non-root unit" (the guess from parent links is off).
  void OnRequest(uint64_t now_us) override;
  std::optional<ObjectId> Evict(uint64_t now_us) override;
  void OnGiveBack(const ObjectInfo& info, uint64_t now_us) override;
  size_t Size() const override { return slab_.Live(); }
  bool Contains(ObjectId id) const override { return slab_.Find(id) != internal::kNil; }

  // Learned value (hit density, per second) of a unit of class `cls` at `age_ms`, and the
  // class a cached unit is in (kClasses when not cached). For tests and docs.
  double TEST_Value(size_t cls, uint64_t age_ms) const;
  size_t TEST_SampledGhosts() const { return sampled_.size(); }
  double TEST_SampleRate() const;
  double TEST_AdmitWeight() const { return admit_weight_; }
  size_t TEST_ClassOf(ObjectId id) const;
  void TEST_Relearn() { Relearn(); }
  // Everything the policy's decisions depend on, as text (two policies that print the same
  // decide the same), but the sampled-ghost heap's stale entries.
  std::string TEST_StateDigest() const;

 private:
  struct Payload {
    uint64_t entry_us = 0;  // time it entered its current class
    ObjectId parent = kNoParent;
    double cost_per_byte = 0;  // 0: unknown
    uint8_t hits = 0;          // saturating
    uint8_t cls = 0;
    uint32_t epoch = 0;  // relearns done when it entered its class (its weight has decayed since)
  };
  using Slab = internal::Slab<Payload>;
  // A class list: first = oldest entry, last = youngest; young_first = first unit of the
  // youngest burst (the units with the youngest entry time, deepest first).
  struct ClassList {
    uint32_t first = internal::kNil, last = internal::kNil, young_first = internal::kNil;
    uint64_t size = 0;
  };

  struct Ghost {
    uint64_t entry_us = 0;
    uint8_t hits = 0;
    uint8_t cls = 0;
  };
  // Sampled ghosts: id -> entry; by hash for the fixed-size threshold drop.
  struct SampledGhost {
    uint64_t entry_us = 0;
    double weight = 1.0;  // 1 / sampling rate when it was sampled
    uint8_t hits = 0;
    uint8_t cls = 0;
    uint32_t epoch = 0;  // relearns done when it was sampled
  };
  // What an eviction changed, for OnGiveBack to undo.
  struct Evicted {
    Payload p;          // as it was cached
    ObjectId prev = 0;  // the unit before it in its burst (same class, entry time)
    bool has_prev = false;
    uint32_t epoch = 0;          // relearns done at the eviction
    double censored_weight = 0;  // added to censored_[p.cls][bucket]
    double sampled_weight = 0;   // a sampled ghost of this weight, added to resumed_
    size_t bucket = 0;           // its age bucket at the eviction
    bool ghost = false;          // an exact ghost entry was added
    uint32_t run_index = 0;      // its place among the consecutive evictions
    struct Trimmed {  // the oldest exact ghost order entry let go for it (the last, if several)
      bool valid = false;
      ObjectId id = 0;
      bool had_ghost = false;
      Ghost ghost;
    } trimmed;
    struct SampleDrop {  // the sample the full table let go of for it
      bool valid = false;
      ObjectId id = 0;
      SampledGhost ghost;
      double censored_weight = 0;
      size_t bucket = 0;
      uint64_t threshold_before = 0, threshold_after = 0;
    } drop;
  };

  size_t Bucket(uint64_t age_us) const;
  // In entry-time order; `at` (when given) the unit to go just before (kNil: last), a place in
  // that order (OnGiveBack's: right after its burst neighbour).
  void Link(uint32_t slot, uint8_t cls, uint64_t entry_us, const uint32_t* at = nullptr);
  void Unlink(uint32_t slot);
  void NoteRequestBoundary(ObjectId parent_of_current, ObjectId current);
  void MoveToLeafClass(ObjectId id);
  void CountReuse(uint8_t cls, uint64_t age_us, double weight);
  double Decayed(uint32_t since_epoch) const;
  void CountEvent();
  void Relearn();
  void Insert(const ObjectInfo& info, uint64_t now_us);  // OnInsert, keeping evicted_
  void Remember(ObjectId id, const Payload& p, uint64_t now_us, Evicted* undo);
  bool Sampled(ObjectId id) const;
  void Censor(uint8_t cls, uint64_t age_us, double weight);
  void DropLargestSample(uint64_t now_us, Evicted* undo);
  double CostFactor(const Payload& p) const;
  uint8_t HitClass(uint8_t hits) const;

  LongTailOptions options_;
  Slab slab_;
  std::array<ClassList, kClasses> lists_{};
  std::unordered_map<ObjectId, Ghost> ghosts_;
  std::deque<ObjectId> ghost_order_;
  std::unordered_map<ObjectId, SampledGhost> sampled_;
  std::vector<std::pair<uint64_t, ObjectId>> sampled_heap_;  // max-heap by hash
  uint64_t sample_threshold_ = 0;  // ids with Hash(id) < threshold are sampled
  double admit_weight_ = 1.0;
  // Kaplan-Meier counts per class and age bucket: observations ended without reuse
  // (censored), and observations that resumed at that age (sampled ghosts, weight 1/rate).
  std::array<std::vector<double>, kClasses> censored_, resumed_;
  uint64_t capacity_ = 0;  // from OnCapacity, else the largest size seen
  ObjectId last_touched_ = kNoParent;
  // Explicit requests (OnRequest): the units the current request touched, and whether it hit
  // a non-root unit.
  bool explicit_requests_ = false;
  bool request_nonroot_hit_ = false;
  uint64_t request_us_ = 0;
  std::vector<std::pair<ObjectId, ObjectId>> request_units_;  // (id, parent)

  size_t buckets_ = 0;
  std::vector<double> bucket_lo_s_;  // lower edge of each bucket, seconds
  std::array<std::vector<double>, kClasses> reuses_;
  std::array<double, kClasses> entries_{};
  std::array<std::vector<double>, kClasses> value_;
  uint64_t events_since_learn_ = 0;
  uint32_t epoch_ = 0;        // relearns so far
  uint64_t last_now_us_ = 0;  // latest time seen (OnRemove has none)
  double cost_sum_ = 0;
  uint64_t cost_known_ = 0;
  // For OnGiveBack, since the last call other than Evict and OnGiveBack: what each eviction
  // changed, and per class the last victim (its burst's next victim goes after it).
  void EndEvictions();
  internal::EvictedLog<Evicted> evicted_;
  struct RunVictim {
    bool valid = false;
    ObjectId id = 0;
    uint64_t entry_us = 0;
  };
  std::array<RunVictim, kClasses> run_last_{};
  uint32_t run_evictions_ = 0;                // evictions so far
  std::vector<uint32_t> run_trims_restored_;  // run indices whose trimmed ghost came back
};

}  // namespace kvtier::policies
