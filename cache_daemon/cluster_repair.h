// ClusterRepair: the background scan that restores R and moves units after a membership
// change (docs/CLUSTER.md, "Repair"). One thread per node.
//
// A scan runs after every change of the membership view (a node lost, joined or draining),
// again retry_ms after a scan that left work (doubling while work is left over scan after
// scan), and every interval_s regardless (anti-entropy). Work left because something failed
// (a LOOKUP or copy that failed, a drop that failed, not in our own view) backs off up to
// interval_s: a stuck copy does not cost a scan every retry_ms. Work left only waiting (a
// copy an owner refused because it deleted the unit or its tenant moments ago, which it takes
// once its refusal window ends; a hand-over waiting for another holder's copy) backs off up
// to waiting_retry_max_ms: the scan after the wait ends finds it done, rather than one up
// to interval_s later while the moves gauge still reports it. A scan pages through the
// units this node holds (TierManager::ListUnits, page_units at a time: the store's lock is
// held for one page only) in two passes:
//   1. local only: counts the held units this node does not own under the view (the moves
//      still to do, kvtier_cluster_moves_in_progress; a scan that reaches its end sets the
//      gauge again to those still held then, so one deleted meanwhile is not reported until
//      the next scan);
//   2. per page: asks every remote owner of the page's units which it holds (one peer LOOKUP
//      per owner per page), then for each unit an owner lacks, the designated sender copies
//      it (peer PUT) to those owners, paced to bytes_per_s. The designated sender is the
//      first owner, in rendezvous rank, that holds the unit; when no owner holds it, every
//      holder sends (the copies are idempotent). An owner stores a copy only if it holds no
//      unit of the key (a newer PUT that reached it after our read stays; PeerHandler::Put)
//      and then reports it held. A held unit this node does not own is dropped from the local
//      store once every current owner holds it (confirmed by LOOKUP or by an acknowledged
//      copy, stored or held); never earlier, so a read finds it here meanwhile.
// A scan under the current view that leaves no unit this node does not own tells the router
// (Router::NoteNoUnownedSince), so GETs stop asking owners before serving local units.
// A unit is read for its copy with TierManager::Peek: no hit counted, an SSD unit stays on SSD.
// Only native units are repaired (ObjectKind kGlobalKv and kSwa): RESP blobs are per node.
// Memory: one page of keys and one value at a time. Nothing runs while this node is not in
// its own view (etcd unreachable or not yet registered): the view cannot be trusted then.
//
// Thread safety: Start/Stop from one thread; Trigger and stats from any.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cache_daemon/tenants.h"
#include "cluster/peer_client.h"
#include "cluster/router.h"
#include "storage/tier_manager.h"

namespace kvtier::daemon {

struct RepairOptions {
  uint64_t bytes_per_s = 64ull << 20;  // copy budget of this node's repair ([cluster])
  uint32_t page_units = 256;           // units per page (store lock hold, LOOKUP batch)
  uint64_t retry_ms = 1000;            // rescan after a scan that left work
  uint64_t interval_s = 300;           // full rescan period even without a change
  // Longest back-off when the work left is only waiting (above). The owners' refusal window
  // (cluster::RecentDeletesOptions::window_ms): a refused copy is taken at most this long
  // after the refusal ends.
  uint64_t waiting_retry_max_ms = 10'000;
  // Applies the deletes this node missed (TombstoneLog::CatchUp): before each page, and
  // before and after any copy when the last call is over 200 ms old, so a node back from a
  // pause never copies a unit deleted meanwhile back to its owners (or undoes the copy). An
  // error skips the scan (retried). May be empty (tests).
  std::function<Status()> catch_up;
  // True for a GET copy this node keeps of another owner's unit (cluster_copies.h): not
  // repaired, not counted as a move, never sent. May be empty (no copies).
  std::function<bool(const storage::Key&)> is_copy;
};

struct RepairStats {
  // Gauges, of the scan in progress (or the last one when idle).
  uint64_t under_replicated = 0;   // units this node must copy that some owner still lacks
  uint64_t moves_in_progress = 0;  // held units this node no longer owns, not yet handed over
  uint64_t done_in_scan = 0;       // units copied or handed over by this scan
  bool active = false;             // a scan is running
  // Counters.
  uint64_t units_total = 0, bytes_total = 0;  // copies acknowledged by an owner
  uint64_t dropped_total = 0;                 // held units dropped after their hand-over
  uint64_t scans_total = 0, copy_failures_total = 0, lookup_failures_total = 0;
  // Copies of TTL units an owner did not store because, by its clock, the unit had ended
  // (cluster/peer_wire.h, kPeerFlagExpiresAt): a few where units expire in transit; many
  // point at an owner's clock running ahead of this node's.
  uint64_t expired_at_owner_total = 0;
};

class ClusterRepair {
 public:
  // None owned; all must outlive the object.
  ClusterRepair(storage::TierManager* store, const TenantRegistry* tenants, cluster::Router* router,
                cluster::PeerClient* peers, RepairOptions options);
  ~ClusterRepair();
  void Start();
  // Ends the scan in progress at its next unit and joins the thread.
  void Stop();
  // Asks for a scan (a membership change): one starts as soon as the current one ends.
  void Trigger();
  RepairStats stats() const;

 private:
  void Run();
  enum class ScanResult {
    kDone,      // nothing left
    kWaiting,   // left work only waiting: refused copies, hand-overs awaiting another's copy
    kLeftWork,  // something failed
  };
  ScanResult Scan();
  bool IsCopy(const storage::Key& key) const { return options_.is_copy && options_.is_copy(key); }
  // Sleeps until the budget allows `bytes` more; false when stopping.
  bool Pace(uint64_t bytes);
  bool WaitFor(uint64_t ms);  // false when stopping; wakes early on Trigger

  storage::TierManager* store_;
  const TenantRegistry* tenants_;
  cluster::Router* router_;
  cluster::PeerClient* peers_;
  RepairOptions options_;

  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false, triggered_ = true;  // guarded by mu_; the first scan runs at start
  std::thread thread_;
  uint64_t next_send_us_ = 0;  // pacing, repair thread only

  std::atomic<uint64_t> under_{0}, moves_{0}, done_{0};
  std::atomic<bool> active_{false};
  std::atomic<uint64_t> units_{0}, bytes_{0}, dropped_{0}, scans_{0}, copy_failures_{0},
      lookup_failures_{0}, expired_at_owner_{0};
};

}  // namespace kvtier::daemon
