// ClusterCopies: copies of units this node fetched from their owners for a GET, kept in its
// own store's DRAM tier so that the next GET of the unit is served locally ([cluster]
// get_copy_bytes_max > 0; docs/CLUSTER.md, "Copies").
//
// A copy is a store unit like any other (DRAM only: allow_ssd false, so the DRAM tier's
// budget and policy govern it and it is dropped, never demoted, when evicted; TTL
// get_copy_ttl_ms, or less: never past the unit's own TTL as its owner reported it), listed
// here with its size so that copies stay under bytes_max (oldest dropped first) and can all
// be dropped at once.
//
// Coherence: a copy must never be served after its unit was deleted or replaced. Rules:
//   - Deletes and tenant deletes reach every live member (router fan-out, tombstones); each
//     path calls Drop / DropTenant after deleting from the store, which drops the copy.
//   - A PUT through any node, once its owners answered, tells every member that keeps copies
//     to drop its copy of the key (peer DROP_COPIES -> Drop); a member that does not answer
//     gets a tombstone.
//   - Fence: Keep refuses a value whose fetch began more than fetch_window_ms ago, whose key
//     or tenant the node's RecentDeletes noted (a delete, 10 s), or whose key or tenant Drop /
//     DropTenant noted at or after the fetch began (an overwrite's drop follows the owners'
//     write, so a later fetch read the new value). Keep runs under the same lock as Drop, so
//     a Keep that passed the fence is dropped by the Drop that follows. Keep puts only if
//     the store holds no unit of the key, so a copy never replaces a unit written here.
//   - Lease: copies are kept and served only while this node's etcd lease is confirmed
//     (Membership::lease_confirmed_ms within 2/3 of lease_ttl_s) under the registration they
//     were made in. Otherwise every copy is dropped: a node stopped, partitioned or cut off
//     from etcd past that point may have missed a delete or an overwrite. DropAll also runs
//     before every (re)registration.
//
// Thread safety: every method may be called concurrently.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <span>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "cluster/membership.h"
#include "cluster/recent_deletes.h"
#include "storage/tier_manager.h"

namespace kvtier::daemon {

struct CopyOptions {
  uint64_t bytes_max = 0;           // copies held at once, in value bytes; 0: keep none
  uint64_t ttl_ms = 60000;          // a copy expires this long after it was kept
  uint64_t fetch_window_ms = 5000;  // a fetch older than this is not kept (< fence window)
};

struct CopyStats {
  uint64_t bytes = 0, units = 0;  // gauges: copies listed now
  uint64_t kept = 0, hits = 0;    // counters: copies made, GET hits served from one
  uint64_t dropped = 0;           // copies dropped by a delete, overwrite, cap or TTL
  uint64_t fenced = 0;            // fetched values not kept (fence, lease, too large)
  uint64_t drop_alls = 0;         // every copy dropped (lease not confirmed, re-registration)
};

class ClusterCopies {
 public:
  // membership: the lease fence (its lease_ttl_s); recent: the node's RecentDeletes.
  ClusterCopies(storage::TierManager* store, cluster::Membership* membership,
                cluster::RecentDeletes* recent, CopyOptions options);

  // Steady ms: call before fetching, pass to Keep.
  static uint64_t BeginFetch();
  // A GET batch's local hits (results[i].ok()): a hit on a copy that may not be served now
  // (lease fence, expired) is dropped and becomes NotFound; a copy served is counted.
  void CheckHits(std::span<const storage::Key> keys, std::vector<Status>* results);
  // Keeps value (fetched from an owner since fetch_started) as a copy of key, unless the
  // fence, the lease or bytes_max forbids it, or the store holds a unit of the key (put only
  // if absent: whatever is there was written after the fetch began, or is a copy already).
  // Call it only for keys this node does not own (docs/CLUSTER.md, "Versions"). ttl_left_ms:
  // the unit's remaining TTL as the owner reported it (0: none; nullopt: not told, an owner
  // older than the peer protocol's TTL trailer): the copy expires get_copy_ttl_ms after now or
  // ttl_left_ms after fetch_started, whichever is first (never after the unit), and a unit
  // whose TTL has run out by now is not kept.
  void Keep(storage::TenantId tenant, std::string_view tenant_name, const storage::Key& key,
            std::span<const uint8_t> value, uint64_t fetch_started,
            std::optional<uint64_t> ttl_left_ms = std::nullopt);
  // key was just stored here by its owner's write (a client or peer PUT): not a copy.
  void Forget(const storage::Key& key);
  // The keys were deleted or replaced: notes them (fence) and drops the copies held.
  void Drop(std::span<const storage::Key> keys);
  void DropTenant(storage::TenantId tenant, std::string_view tenant_name);
  void DropAll();
  bool IsCopy(const storage::Key& key) const;
  CopyStats stats() const;

 private:
  struct Entry {
    uint64_t bytes = 0;
    uint64_t expires_ms = 0;
    uint64_t seq = 0;  // position in order_
    storage::TenantId tenant = 0;
  };
  // True when copies may be kept and served now: the lease is confirmed and the copies held
  // were made under the current registration (the caller drops them all otherwise). mu_ held.
  bool TrustedLocked(uint64_t now);
  void DropLocked(const storage::Key& key, bool delete_unit);
  void DropAllLocked();

  storage::TierManager* store_;
  cluster::Membership* membership_;
  cluster::RecentDeletes* recent_;
  CopyOptions options_;
  cluster::RecentDeletes fence_;  // keys / tenants replaced or deleted moments ago
  mutable std::mutex mu_;
  std::unordered_map<storage::Key, Entry, storage::KeyHash> copies_;
  std::deque<std::pair<uint64_t, storage::Key>> order_;  // (seq, key), oldest first; lazy
  uint64_t next_seq_ = 1;
  uint64_t bytes_ = 0;
  uint64_t registration_ = 0;  // Membership registrations the copies were made under
  std::atomic<uint64_t> kept_{0}, hits_{0}, dropped_{0}, fenced_{0}, drop_alls_{0};
};

}  // namespace kvtier::daemon
