// TombstoneLog: deletes that survive a node that was down while they happened.
//
// Tombstones, not epochs. A node that deletes units (or a whole tenant) sends the delete to
// every live member, then records it in etcd:
//   <prefix>tombstones/<hex storage key>   = {"applied_by": [node ids that acknowledged]}
//   <prefix>tenant_deletes/<tenant>        = {"applied_by": [...]}
// attached to a shared lease of ttl_s (a new lease every ttl_s / 10, so a tombstone lives
// 0.9..1 x ttl_s). Every node follows the log: it reads the records modified after the last
// revision it applied (min_mod_revision), applies those whose applied_by does not name it
// (deletes the keys / the tenant from its own store) and persists the revision in state_file,
// so a node restarted after a kill -9 applies what it missed. The records are read page_keys
// at a time, every page at one etcd revision (EtcdClient::RangePrefixPaged): a backlog of any
// size is read in replies within EtcdOptions::response_bytes_max (one unpaginated read of
// tens of thousands of tombstones used to be refused, and the catch-up failed every time).
// CatchUp runs before every (re)registration in etcd (Membership's before_register hook),
// and a node does not register until it succeeds, so a node that was stopped past its lease
// deletes what it missed before peers route to it again; a poll thread catches up every
// poll_ms while it runs (a failing poll is counted in errors and logged, throttled), and at
// once when a watch on the log sees a record put that does not name this node (a delete it
// missed, recorded moments ago: applied within milliseconds, not up to poll_ms later; the
// records that name it, every delete it acknowledged, wake nothing). The watch starts from the
// revision after the first catch-up's and goes on from the last one it delivered, so no record
// falls between; it only wakes the poll, and while it cannot run (etcd unreachable, the
// revision compacted) the poll applies records as before.
//
// Not guaranteed: a node down longer than ttl_s misses the tombstones that expired meanwhile.
//
// Thread safety: every method may be called concurrently.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "cluster/etcd_client.h"
#include "cluster/peer_wire.h"
#include "common/logging.h"

namespace kvtier::cluster {

struct TombstoneOptions {
  std::string key_prefix = "/kvtier/";
  std::string node_id;
  uint32_t ttl_s = 86400;  // how long a tombstone is kept
  std::string state_file;  // the last applied revision; "" keeps it in memory only
  uint64_t poll_ms = 1000;
  // Records per etcd read. A record is its key (about 90 bytes) and the node ids that applied
  // it, base64 in JSON (~300 bytes): 8192 of them (~2.5 MB) stay far below
  // EtcdOptions::response_bytes_max. Large, because the catch-up filters by mod revision,
  // and etcd then reads the whole rest of the range for every page before it truncates.
  int64_t page_keys = 8192;
};

struct TombstoneStats {
  uint64_t recorded = 0, applied = 0, tenant_deletes_applied = 0, errors = 0;
  int64_t applied_revision = 0;
  uint64_t watch_wakeups = 0;  // records seen by the watch that woke the poll
};

class TombstoneLog {
 public:
  using ApplyKeys = std::function<void(std::span<const PeerKey>)>;
  using ApplyTenant = std::function<void(std::string_view)>;
  TombstoneLog(EtcdClient* etcd, TombstoneOptions options, ApplyKeys apply_keys,
               ApplyTenant apply_tenant);
  ~TombstoneLog();

  // Records deletes of keys acknowledged by the nodes in applied_by.
  Status RecordKeys(std::span<const PeerKey> keys, const std::vector<std::string>& applied_by);
  Status RecordTenant(std::string_view tenant, const std::vector<std::string>& applied_by);

  // Applies every record newer than the last applied revision that does not name this node,
  // page by page; the revision is persisted only once every page was applied (an error leaves
  // it, so the next call reads those records again: applying a delete twice is harmless).
  Status CatchUp();
  // True once a CatchUp of this log has succeeded: every delete recorded before this node
  // (re)started has been applied to its store. Until then the node holds what it held when it
  // stopped, deleted and overwritten units included, and must serve no peer from it.
  bool caught_up() const { return caught_up_.load(std::memory_order_acquire); }

  // Starts the poll thread and the watch that wakes it.
  void StartPolling();
  void Stop();
  TombstoneStats stats() const;

 private:
  StatusOr<int64_t> Lease();
  // Puts kvs (at most EtcdClient::kTxnOpsMax, one transaction) under the log's lease; counts
  // an error and forgets an expired lease on failure. mu_ held.
  Status PutUnderLease(const std::vector<std::pair<std::string, std::string>>& kvs);
  void PersistRevision(int64_t revision);
  // The watch thread: once the first catch-up is done, watches the log's records from its
  // revision on, and wakes the poll for one that does not name this node; watches again after
  // a silent or failed watch.
  void WatchLoop();

  EtcdClient* etcd_;
  TombstoneOptions options_;
  ApplyKeys apply_keys_;
  ApplyTenant apply_tenant_;
  std::mutex mu_;  // serialises CatchUp and the lease
  int64_t lease_id_ = 0;
  std::chrono::steady_clock::time_point lease_granted_;
  std::atomic<int64_t> applied_revision_{0};
  std::atomic<bool> caught_up_{false};
  std::atomic<uint64_t> recorded_{0}, applied_{0}, tenants_applied_{0}, errors_{0};
  LogThrottle poll_failed_log_{10'000};  // the poll thread's only
  std::atomic<uint64_t> watch_wakeups_{0};
  LogThrottle watch_ended_log_{10'000};  // the watch thread's only
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stop_ = false;  // guarded by stop_mu_
  bool wake_ = false;  // guarded by stop_mu_: the watch saw a record for this node
  std::atomic<bool> watch_stop_{false};
  std::thread poller_, watcher_;
};

}  // namespace kvtier::cluster
