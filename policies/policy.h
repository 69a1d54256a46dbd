// Eviction and admission policy interfaces: the one contract shared by the storage tiers
// (DRAM -> SSD demotion, SSD eviction) and the trace simulator (`kvtier sim`).
//
// Policies are pure and deterministic: no I/O, no wall clock, no global RNG. Time arrives as
// an argument (`now_us`, from an injected Clock) and randomness from a seeded generator the
// policy owns (seed in its options). The same call sequence always yields the same victims.
//
// Thread safety: none. A policy instance is owned by one tier (or shard) and called under
// that owner's lock.
//
// Object lifecycle, as the owner drives it:
//   OnInsert(info)          the object is now cached in this tier
//   OnAccess(id)            a hit
//   Evict() -> id           the policy chooses a victim, forgets it, and returns it; the owner
//                           must then drop or demote that object
//   OnRequest(now)          (optional) the calls that follow belong to one new request
//   OnRemove(id)            the object left for another reason (delete, expiry, checksum
//                           failure, pinned: a pinned object is removed from its policy and
//                           re-inserted on unpin, so that Evict never returns a pinned object)
//   OnGiveBack(info)        (optional) the owner keeps an object Evict just returned, which
//                           goes back as it was (the prefix layer's held units and leaf swaps)
// Calling OnAccess/OnRemove with an id the policy does not track is a no-op.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace kvtier::policies {

// A 64-bit digest of the storage key (first 8 bytes, little-endian). Policies never see keys.
using ObjectId = uint64_t;
inline constexpr ObjectId kNoParent = 0;

// What kind of state an object holds; TTL and recompute cost defaults depend on it.
enum class ObjectKind : uint8_t {
  kGlobalKv = 0,  // a prefix unit of FP4 global KV (long tail, ~72 h)
  kSwa = 1,       // SWA ring state (minutes)
  kBlob = 2,      // an opaque value stored through RESP
};

struct ObjectInfo {
  ObjectId id = 0;
  uint64_t size_bytes = 0;
  // The previous unit in the key chain (kNoParent for the first unit of a prefix). Lets a
  // structure-aware policy evict leaves before their ancestors.
  ObjectId parent_id = kNoParent;
  // Tokens it would cost to recompute this object (0 when unknown).
  uint32_t recompute_tokens = 0;
  ObjectKind kind = ObjectKind::kGlobalKv;
};

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  virtual std::string_view Name() const = 0;

  virtual void OnInsert(const ObjectInfo& info, uint64_t now_us) = 0;
  virtual void OnAccess(ObjectId id, uint64_t now_us) = 0;
  virtual void OnRemove(ObjectId id) = 0;
  // Optional hint: a lookup of `id` missed in this tier, and the owner is about to make room
  // (Evict) and then OnInsert it. Ghost-aware policies (ARC, S3-FIFO, long-tail) adapt here so
  // that the victims they choose for this insert already know it was a ghost hit. Owners that
  // never call it still get correct (slightly less adaptive) behaviour. Default: no-op.
  virtual void OnMiss(ObjectId id, uint64_t now_us) { (void)id, (void)now_us; }
  // Optional hint: the owner's capacity in objects (for tiers of equal-size units), given
  // before the first insert and whenever it changes. Policies that size internal queues from
  // it (ARC, S3-FIFO) otherwise infer it from the number of objects tracked at the first
  // eviction. Default: no-op.
  virtual void OnCapacity(uint64_t capacity_objects) { (void)capacity_objects; }
  // Optional hint: a request (one engine prefill; one batch get or put) begins at now_us, and
  // every call until the next OnRequest belongs to it. Owners that call it pass this now_us
  // to the request's calls. Lets structure-aware policies (long-tail) see request boundaries
  // instead of guessing them from parent links, which concurrent sessions interleave. Owners
  // that never call it get the guess. Default: no-op.
  virtual void OnRequest(uint64_t now_us) { (void)now_us; }
  // Chooses a victim among tracked objects, stops tracking it and returns it; nullopt when
  // nothing is tracked.
  virtual std::optional<ObjectId> Evict(uint64_t now_us) = 0;
  // The owner keeps an object that Evict returned after all (a prefix layer keeps a unit the
  // running request holds, or one with cached children: policies/prefix_layer/prefix_layer.h).
  // Only for an id returned by one of the Evict calls since the policy's last call other than
  // Evict and OnGiveBack, once per such return. The policy tracks it again with the state it had
  // before that Evict (its list or class, hit count or frequency) and undoes what the eviction
  // recorded about it: no ghost entry is left and no reuse is counted, and a ghost-hit hint from
  // OnMiss stays for the OnInsert it was given for. Where it goes in the eviction order is the
  // policy's: recency-ordered policies put it at their newest end (as an insert at now_us);
  // long-tail, whose order is each unit's entry time into its class, where it was. `info` is
  // what the object was inserted with. Default: OnInsert(info, now_us), exact for a policy that
  // keeps nothing per object but its place (LRU, FIFO, SIEVE, TTL, Belady).
  virtual void OnGiveBack(const ObjectInfo& info, uint64_t now_us) { OnInsert(info, now_us); }

  // Objects currently tracked.
  virtual size_t Size() const = 0;
  virtual bool Contains(ObjectId id) const = 0;
};

// Decides whether an object demoted or written to the SSD tier is admitted there.
class AdmissionPolicy {
 public:
  virtual ~AdmissionPolicy() = default;
  virtual std::string_view Name() const = 0;
  // Called once per candidate write; true admits it. A policy with a byte budget charges
  // size_bytes when it answers true.
  virtual bool Admit(const ObjectInfo& info, uint64_t now_us) = 0;
  // One reference to an object by a client, hit or miss, that the policy may want to count
  // (second-hit admission). Owners call it once per reference of a unit: the simulator at each
  // read reference; the live store (storage/tier_manager_impl.h) for each key a client reads
  // (Get, GetBatch: hit or miss) and, in a Lookup, for the keys from the first miss to the end
  // of the chain (those the engine recomputes and puts; the hits before it are read next, and
  // those reads count). Called only when CountsLookups() is true, so a policy that counts must
  // say so.
  virtual void OnLookup(ObjectId id, uint64_t now_us) { (void)id, (void)now_us; }
  // Whether OnLookup does anything. An owner skips the OnLookup calls (and the locking they
  // need) of a policy that returns false. Constant for the policy's lifetime. Default: false.
  virtual bool CountsLookups() const { return false; }
  // Called once on a policy that replaces `previous` at run time (a policy set or reload that
  // changed the admission policy's name or parameters), before any other call: it takes over
  // what of previous's state still means the same to it. write-budget: the bytes previous
  // spent in its current window (any policy with a Budget), charged to this one's current
  // window; second-hit: previous's lookup counts, when previous is second-hit. Default: nothing.
  virtual void CarryOver(const AdmissionPolicy& previous, uint64_t now_us) {
    (void)previous, (void)now_us;
  }

  // The byte budget of a policy that limits bytes admitted per window (write-budget), as of
  // now_us: bytes allowed per window, the window, and bytes spent in the window containing
  // now_us (0 once a new window has begun, even before the next Admit). A policy without a
  // budget returns nullopt.
  struct ByteBudget {
    uint64_t bytes_per_window = 0, window_ms = 0, spent_bytes = 0;
  };
  virtual std::optional<ByteBudget> Budget(uint64_t now_us) const {
    (void)now_us;
    return std::nullopt;
  }
};

// Parameters for a policy as "key=value" strings, e.g. {"ttl_ms": "259200000"}. Unknown keys
// are InvalidArgument, so a typo never silently changes nothing. A key scoped as
// "policy:key" (e.g. "write-budget:bytes_per_day") reaches only the named policy, so one set
// of parameters can configure an eviction and an admission policy together; plain keys reach
// every policy they are given to. A scope that names no policy is InvalidArgument too.
struct PolicyParams {
  std::vector<std::pair<std::string, std::string>> values;
  uint64_t seed = 42;
  // Introspection only: when set, a factory appends every key it reads (see
  // EvictionPolicyParamKeys). Never owned.
  std::vector<std::string>* keys_read = nullptr;
};

// Factories over every built-in policy (policies/registry.cc). Names: see
// docs/POLICIES.md. Unknown names or parameters are InvalidArgument.
StatusOr<std::unique_ptr<EvictionPolicy>> MakeEvictionPolicy(std::string_view name,
                                                             const PolicyParams& params = {});
StatusOr<std::unique_ptr<AdmissionPolicy>> MakeAdmissionPolicy(std::string_view name,
                                                               const PolicyParams& params = {});
std::vector<std::string> EvictionPolicyNames();
// The parameter keys eviction policy `name` takes (empty for a policy without parameters or an
// unknown name).
std::vector<std::string> EvictionPolicyParamKeys(std::string_view name);
std::vector<std::string> AdmissionPolicyNames();
// Whether policy `name` made with `a` and made with `b` is configured the same: the same seed
// and the same parameters reaching it (plain keys and keys scoped to it), in any order.
bool SameParamsFor(std::string_view name, const PolicyParams& a, const PolicyParams& b);

}  // namespace kvtier::policies
