// ClusterRefetch: a replica that served a checksum failure is rewritten from another
// (docs/CLUSTER.md, "Checksum failures"). The store quarantines a unit whose SSD record fails
// verification on any read (a client's, a peer's, the repair scan's) and reports it
// (TierManager::SetChecksumFailureListener); this node then fetches the unit from its other
// owners (Router::GetRemote: peers only, current and previous view) and puts it back into
// its own store with the metadata of the lost record (tenant, kind, parent, recompute tokens,
// TTL left), at the SSD tier it was read from, so the rewrite does not displace DRAM units.
// The read that found the corruption is answered by the router as any local miss: from
// another owner.
//
// Only native units (kinds global_kv and swa) of a configured tenant are refetched, only
// while this node owns the unit (a non-owner's copy is the repair scan's business), and a
// unit deleted here moments ago (RecentDeletes, the rule that guards repair copies) is not
// brought back: checked before the put and again after it (a delete that landed between
// the fetch and the put is applied again). The rewrite carries the TTL the lost record had
// left when it was reported, less the time since (the queue wait, the fetch): it never
// outlives the unit it replaces, and a unit that expired meanwhile is not put back. Nor does
// it outlive the version fetched (a newer one than the lost record, if the other owner took a
// PUT first): the TTL that owner reported, when shorter or when the record had none. The put is
// made only if the store holds no unit of the key (PutOptions::if_absent): a client PUT of a newer
// value that reached this node while the fetch was in flight stays, and the fetched value is
// dropped (counted).
//
// Reports wait in a queue of at most queue_max units (more are dropped and counted; the
// repair scan's anti-entropy pass still restores R for them). One thread.
//
// Thread safety: Report and stats from any thread; Start/Stop from one.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>

#include "cache_daemon/tenants.h"
#include "cluster/recent_deletes.h"
#include "cluster/router.h"
#include "storage/tier_manager.h"

namespace kvtier::daemon {

struct RefetchOptions {
  uint32_t queue_max = 1024;  // reported units waiting for their refetch
};

struct RefetchStats {
  uint64_t refetched = 0;   // units rewritten here from another owner
  uint64_t failed = 0;      // no other owner had it, or the local put failed
  uint64_t dropped = 0;     // reports over queue_max
  uint64_t skipped = 0;     // not native, tenant gone, not an owner, deleted, already back,
                            // expired before the put
  uint64_t superseded = 0;  // fetched, not put: a unit was written here meanwhile (kept)
};

class ClusterRefetch {
 public:
  // None owned; all must outlive the object. recent may be null (no delete check).
  ClusterRefetch(storage::TierManager* store, const TenantRegistry* tenants,
                 cluster::Router* router, cluster::RecentDeletes* recent, RefetchOptions options);
  ~ClusterRefetch();
  void Start();
  void Stop();  // drops what is queued, joins the thread
  // Queues a unit the store quarantined (the store's checksum-failure listener).
  void Report(const storage::UnitInfo& unit);
  RefetchStats stats() const;

 private:
  void Run();
  struct Reported {
    storage::UnitInfo unit;
    uint64_t reported_ms = 0;  // steady clock, when the store reported it
  };
  void Refetch(const Reported& reported);

  storage::TierManager* store_;
  const TenantRegistry* tenants_;
  cluster::Router* router_;
  cluster::RecentDeletes* recent_;
  RefetchOptions options_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Reported> queue_;  // guarded by mu_
  bool stop_ = false;           // guarded by mu_
  std::thread thread_;
  std::atomic<uint64_t> refetched_{0}, failed_{0}, dropped_{0}, skipped_{0}, superseded_{0};
};

}  // namespace kvtier::daemon
