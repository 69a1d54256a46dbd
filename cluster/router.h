// Router: the cluster side of a node's data path. The daemon's Service keeps its local path
// (its own store first) and asks the Router for everything beyond it:
//
//   LOOKUP  keys the local store misses are asked of their owners (and, during a membership
//           change, of their previous owners), one call per peer per batch, all peers in
//           parallel; a key counts as present when any peer holds it.
//   GET     values the local store misses are fetched from the peers that hold them (again
//           one call per peer per batch, in parallel); with options.staged, each call moves
//           the bytes through the peer's staging region (cluster/staged_fetch.h). While
//           MayHoldUnowned, the Service also asks for units it holds but does not own.
//   PUT     written to every owner (the local store when this node is one); acknowledged
//           when write_acks of them acknowledged (0: all live owners), at least one. In the
//           same fan-out the key's owners under the previous view that own it no longer are
//           told to drop their (older) version (DROP_OLDER; docs/CLUSTER.md, "Versions").
//           Then members that keep GET copies (MemberInfo::keeps_copies) and do not own
//           the key are told to drop their copy (all at once); one that does not answer, like a
//           previous owner that does not and an owner whose write failed, gets a tombstone
//           naming every other member (docs/CLUSTER.md, "Copies").
//   DELETE  sent to every live member (a unit may sit on a previous owner); a tenant delete
//           likewise.
// Peer calls run at once, all peers in parallel, on a fixed pool of peer_call_threads with
// room for peer_call_queue_max more waiting (cluster/peer_call_pool.h); one call of each
// fan-out runs on the caller's thread. A call the pool has no room for is not made: it
// fails as Unavailable, like a peer that cannot be reached (a GET tries the key's next owner,
// a PUT misses that acknowledgement, a DELETE is left to the tombstone), and is counted
// (peer_calls_refused).
// Owners come from placement (cluster/placement.h) over the current membership view; with
// no view yet (etcd never reached) a node acts alone.
//
// Thread safety: every method may be called concurrently.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "cluster/membership.h"
#include "cluster/peer_call_pool.h"
#include "cluster/peer_client.h"
#include "cluster/peer_wire.h"
#include "cluster/recent_deletes.h"
#include "cluster/staged_fetch.h"
#include "cluster/tombstones.h"

namespace kvtier::cluster {

struct RouterOptions {
  uint32_t replicas = 2;    // owners per unit (R), 1..16
  uint32_t write_acks = 0;  // acknowledgements a PUT waits for; 0: all live owners
  // Where this node notes the deletes it applies (may be null: nothing noted).
  RecentDeletes* recent_deletes = nullptr;
  uint32_t peer_call_threads = 16;     // peer calls in flight at once (1..1024)
  uint32_t peer_call_queue_max = 256;  // more waiting for a thread; past it refused
  // How long a member that left the view is remembered as one that may come back holding
  // units overwritten meanwhile (the tombstone TTL: past it the tombstones expire anyway).
  uint32_t departed_memory_s = 86400;
  // When set, GETs fetch through it (the region transport with a plain-GET fallback:
  // cluster/staged_fetch.h) instead of PeerClient::Get. Not owned; outlives the router.
  StagedFetcher* staged = nullptr;
};

struct RouterStats {
  uint64_t remote_lookups = 0, remote_lookup_hits = 0;
  uint64_t remote_gets = 0, remote_get_hits = 0, remote_get_bytes = 0;
  uint64_t forwarded_puts = 0, forwarded_put_failures = 0, puts_short_of_acks = 0;
  uint64_t peer_errors = 0;
  uint64_t copy_invalidations = 0;            // deletes of a PUT's key sent to copy keepers
  uint64_t copy_invalidation_failures = 0;    // of those, unanswered (left to a tombstone)
  uint64_t peer_calls_refused = 0;            // over peer_call_threads + peer_call_queue_max
  uint64_t peer_calls_queued = 0;             // waiting for a thread now
  uint64_t overwrite_tombstones = 0;          // PUT keys recorded for members with an older version
  uint64_t previous_owner_drops = 0;          // DROP_OLDERs of a PUT's key to its previous owners
  uint64_t previous_owner_drop_failures = 0;  // of those, unanswered (left to a tombstone)
};

class Router {
 public:
  // tombstones may be null (deletes are then not recorded for nodes that miss them).
  Router(Membership* membership, PeerClient* peers, RouterOptions options,
         TombstoneLog* tombstones = nullptr);

  // Owners of key under view (indices into view.members).
  std::vector<size_t> Owners(const PeerKey& key, const MemberView& view) const;
  std::shared_ptr<const MemberView> View() const { return membership_->View(); }
  const std::string& self_id() const { return membership_->options().self.node_id; }
  // True when this node should store key itself: it is an owner, or there is no view.
  bool OwnsLocally(const PeerKey& key) const;

  // tiers[i] == kPeerTierAbsent marks a key to ask about; filled in place from peers.
  void LookupRemote(std::span<const PeerKey> keys, std::vector<uint8_t>* tiers);
  // want[i] marks a key to fetch; statuses[i] / values[i] are filled for those, and with
  // ttl_left_ms (sized as keys; may be null) the remaining TTL of each unit found as the peer
  // that answered reported it (0: none; nullopt: that peer is older than the TTL trailer).
  // The values are views of the peers' replies, not copies: *held (appended to) holds what
  // they point into, so they are valid while it is.
  void GetRemote(std::span<const PeerKey> keys, const std::vector<bool>& want,
                 std::vector<Status>* statuses, std::vector<std::span<const uint8_t>>* values,
                 std::vector<PeerBytes>* held,
                 std::vector<std::optional<uint64_t>>* ttl_left_ms = nullptr);
  // Forwards put to the key's remote owners and drops the older version at its previous
  // owners that no longer own it (DROP_OLDER; not at this node: a caller that is not an
  // owner deletes its own version); local is the local store's result (nullopt when this
  // node is not an owner). Returns OK when enough owners acknowledged.
  Status Put(const PeerPut& put, const std::optional<Status>& local);
  // Deletes keys on every other live member; sets (*existed)[i] when one of them held key i.
  // Then records tombstones naming the members that applied the delete (this node
  // included), for the members that missed it (cluster/tombstones.h).
  void DeleteRemote(std::span<const PeerKey> keys, std::vector<bool>* existed);
  // Notes deletes this node is about to apply to its own store (RecentDeletes): called
  // before the local delete, so a repair copy landing just after it is refused.
  void NoteLocalDeletes(std::span<const PeerKey> keys);
  void NoteLocalTenantDelete(std::string_view tenant);
  // The same for a whole tenant; with tombstones, OK once the tombstone is recorded.
  Status DeleteTenantRemote(std::string_view tenant);

  // Whether this node may hold units it does not own under the current view: replicas not
  // yet handed over after a membership change (a PUT goes to the current owners only, so
  // such a replica may be older than theirs), or units a peer wrote here taking this node
  // for an owner. While true, a GET through this node asks the owners first before serving
  // such a unit from its own store (Service::Get; docs/CLUSTER.md, "Versions"). True at
  // start (a restarted node may hold anything) and after every view change or NoteUnownedWrite
  // until the repair scan reports a whole scan that left none (NoteNoUnownedSince). One
  // atomic load.
  bool MayHoldUnowned() const { return unowned_epoch_.load() != settled_epoch_.load(); }
  // A unit of a key this node does not own is about to be written here (a peer's PUT).
  void NoteUnownedWrite() { unowned_epoch_.fetch_add(1); }
  // The repair scan: UnownedEpoch() before it reads the view it scans under; after a whole
  // scan that left no unit this node does not own, NoteNoUnownedSince(that epoch). A view
  // change or an unowned write meanwhile advanced the epoch: MayHoldUnowned stays true.
  uint64_t UnownedEpoch() const { return unowned_epoch_.load(); }
  void NoteNoUnownedSince(uint64_t epoch) { settled_epoch_.store(epoch); }

  RouterStats stats() const;

 private:
  // Peers (not self) to ask about key: its owners under the current and previous views.
  void AddPeersFor(const PeerKey& key, const MemberView& view, std::vector<std::string>* out) const;
  // (node id, peer endpoint) of every other live member.
  std::vector<std::pair<std::string, std::string>> OtherMembers() const;
  void OnViewChange(const MemberView& view);
  // Whether a remembered departed member would own key (it would serve its old version if it
  // came back to the same membership; docs/CLUSTER.md, "Overwrites while an owner is down").
  bool DepartedOwns(const PeerKey& key, const MemberView& view);
  // After a PUT of key: when `stale` (members that may still hold an older version: owners
  // whose write failed, previous owners that did not delete theirs, copy keepers that did
  // not drop theirs) is not empty or a departed
  // member owns key, records one tombstone of key naming every live member (and self) but
  // those in `stale`, so each of them deletes its version at its next catch-up or before it
  // registers again. One record per PUT: a later record of the same key replaces an earlier.
  void RecordStaleVersions(const PeerKey& key, const MemberView& view,
                           const std::vector<std::string>& stale);

  Membership* membership_;
  PeerClient* peers_;
  RouterOptions options_;
  TombstoneLog* tombstones_;
  mutable std::mutex mu_;
  std::shared_ptr<const MemberView> previous_;  // the view before the latest change
  std::shared_ptr<const MemberView> latest_;
  // Members that left the view, with when they left (mu_), forgotten after departed_memory_s
  // or when they are back.
  std::vector<std::pair<MemberInfo, std::chrono::steady_clock::time_point>> departed_;
  std::atomic<uint64_t> overwrite_tombstones_{0};
  // MayHoldUnowned: bumped by every view change and unowned write; settled by the repair scan.
  std::atomic<uint64_t> unowned_epoch_{1}, settled_epoch_{0};
  std::atomic<uint64_t> remote_lookups_{0}, remote_lookup_hits_{0}, remote_gets_{0},
      remote_get_hits_{0}, remote_get_bytes_{0}, forwarded_puts_{0}, forwarded_put_failures_{0},
      puts_short_{0}, peer_errors_{0}, copy_invalidations_{0}, copy_invalidation_failures_{0},
      previous_owner_drops_{0}, previous_owner_drop_failures_{0};
  std::unique_ptr<PeerCallPool> pool_;  // last member: its threads stop first
};

}  // namespace kvtier::cluster
