// RespKeyIndex: the names of the RESP keys each tenant has written, so SCAN, KEYS and DBSIZE
// can list them. The store holds only storage keys (digests of tenant salt and name), from
// which no name can be recovered.
//
// Entries are ordered by storage key, which is a fixed function of (tenant, name), so the
// order of the keys present never changes while keys come and go. A SCAN cursor is a position
// in that order: CursorOf(k) = (the first 8 bytes of k, big-endian) / 2 + 1, in 1..2^63, so 0
// stays "start" / "done". Scan() returns every entry whose position lies in [cursor, next),
// where next is the position of the first entry not returned (entries sharing a position are
// never split across calls). Hence a full iteration returns every key present from its start
// to its end at least once (exactly once unless it was deleted and written again), whatever
// is added or removed in between; keys added or removed during it may or may not appear.
//
// The index is bounded and best-effort:
//  - at most keys_per_tenant_max entries per tenant and name_bytes_max bytes over all
//    tenants (each entry costs its name plus kEntryOverheadBytes); a key beyond either is
//    stored but not indexed, and counted in unindexed();
//  - without Persist() it is memory only and empty after a restart. With Persist() every
//    change is also appended to a RespNameLog (cache_daemon/resp_name_log.h) and the names
//    are read back at the next start: Add() returns once the name is durable (sync_adds), so
//    a caller that Adds before its put makes the name at least as durable as the unit; or a
//    background thread syncs the log every sync_interval_ms (the window durability batched
//    allows to lose);
//  - with a LogSource (the store, whose records carry their names: Service) the log also
//    holds checkpoints: "every store record before position p had its name appended before
//    this record" (written every sync_interval_ms, at Flush, compaction and start). At start
//    the names of the records from the last checkpoint on are read back from the store
//    (LogSource::replay), so a name whose Add was appended before its put but lost with the
//    log's unsynced tail (a power loss) comes back with its unit: a caller whose unit carries
//    its name need not wait for the log's sync (Add's durable_seq). With a source and the
//    sync thread, Add does not even write: it buffers the name in memory (RespNameLog::Buffer),
//    and the buffer is written with one write before the next checkpoint, log record, sync
//    or rewrite, or once kPendingBytesMax gather. A process crash (kill -9) then loses the
//    buffered names as a power loss loses the unsynced ones, and they come back the same way:
//    no checkpoint is ever written before a buffered name (a name Added before its put lies
//    before every checkpoint at or past its record), so every record after the last
//    checkpoint is read back. (Measured: one pwrite per new name was ~3 % of a 1 KB durable
//    SET's CPU, docs/performance/storage.md "Durable SET: less work per SET".)
//  - entries of keys the store evicted or expired stay until a caller Remove()s them (the
//    Service checks each listed key against the store and removes the gone ones).
// The log is rewritten from the entries (compacted) when it exceeds both
// kLogCompactBytesMin and twice bytes(), so it stays below about 2 x name_bytes_max.
//
// Thread safety: every method may be called concurrently (one mutex; log syncs are group
// commits outside it: concurrent Adds share one fdatasync).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "cache_daemon/resp_name_log.h"
#include "common/status.h"
#include "storage/tier_manager.h"

namespace kvtier::daemon {

class RespKeyIndex {
 public:
  // Bytes charged per entry besides its name: the storage key, the map node and the string.
  static constexpr uint64_t kEntryOverheadBytes = 128;
  // The log is compacted only beyond this size (bytes).
  static constexpr uint64_t kLogCompactBytesMin = 4ull << 20;

  struct Entry {
    storage::Key key;
    std::string name;
  };

  // Buffered adds are written once they reach this many bytes (about 1,000 short names).
  static constexpr uint64_t kPendingBytesMax = 64 << 10;
  // Under durability sync, how often the background thread checkpoints and syncs the log
  // when the names ride with their units (bounds the store records read back at start to
  // about what the store appended in this long).
  static constexpr uint64_t kSyncCheckpointIntervalMs = 1000;

  // Where the names can be found again besides the log: a store whose records carry them.
  struct LogSource {
    // The store's log end now (storage::TierManager::SsdLogEnd); nullopt: no log.
    std::function<std::optional<storage::LogPosition>()> end;
    // Calls add(tenant, key, name) for each name carried by a store record from `from` on
    // (storage::TierManager::ReplaySsdLog).
    std::function<Status(
        const storage::LogPosition& from,
        const std::function<void(uint64_t, const storage::Key&, std::string_view)>& add)>
        replay;
  };

  RespKeyIndex(size_t keys_per_tenant_max, uint64_t name_bytes_max)
      : keys_per_tenant_max_(keys_per_tenant_max), name_bytes_max_(name_bytes_max) {}

  // Reads the names kept in the log at path (created when absent), indexes them within the
  // limits, and keeps the log: from now on every change is logged. With a source: the names
  // the store's records carry from the log's last checkpoint on are indexed (and logged)
  // too, a version 1 log is rewritten as version 2, and a checkpoint at the store's end is
  // written and synced before Persist returns (the store must be open; call before serving).
  // sync_adds: Add() waits until its name is durable (fdatasync) unless given durable_seq;
  // with sync_interval_ms > 0 a background thread checkpoints (with a source) and syncs the
  // log that often (with a source it also writes the buffered adds: see above); else names
  // reach the disk with the page cache (and at Flush). The log is
  // compacted here when over its bounds. Call once, before any other method. Errors: the log
  // cannot be read or written (Open's), or the store's replay failed.
  Status Persist(const std::string& path, bool sync_adds, uint64_t sync_interval_ms = 0,
                 LogSource source = {});
  ~RespKeyIndex();  // stops the sync thread

  // Records that tenant's key k is named `name` (no-op when already indexed). With a log:
  // IOError when the name could not be logged (then it is not indexed either); with
  // sync_adds, returns once the name (also one already indexed) is durable.
  // *indexed (may be null) tells whether the name is in the index afterwards.
  // durable_seq (may be null): when not null, Add does not wait: *durable_seq receives what
  // to pass to WaitDurable before the put (0: nothing to wait for), so that one caller can
  // wait once for the names of many SETs.
  Status Add(uint64_t tenant, const storage::Key& k, std::string_view name, bool* indexed = nullptr,
             uint64_t* durable_seq = nullptr);
  // With sync_adds, returns once every name logged up to durable_seq (from Add) is durable
  // (concurrent callers share one fdatasync); otherwise OK at once.
  Status WaitDurable(uint64_t durable_seq);
  // Logged without waiting for the disk (a lost removal only leaves a name that SCAN prunes).
  void Remove(uint64_t tenant, const storage::Key& k);
  void RemoveTenant(uint64_t tenant);
  // Makes every logged change durable, with a checkpoint first when there is a source
  // (no-op without a log).
  Status Flush();
  // Names indexed at Persist from the store's records (not found in the log).
  uint64_t recovered_from_store() const { return recovered_from_store_.load(); }

  // Copies into *out (cleared) the entries at positions [cursor, next) in order: at least
  // `count` entries unless the tenant's keys run out first, or their names reach
  // names_bytes_max first (a few more when entries share the last position), and returns
  // next, or 0 when no entry is left. At least one position is taken when any is left.
  uint64_t Scan(uint64_t tenant, uint64_t cursor, size_t count, std::vector<Entry>* out,
                uint64_t names_bytes_max = std::numeric_limits<uint64_t>::max()) const;
  static uint64_t CursorOf(const storage::Key& k);

  size_t size(uint64_t tenant) const;
  bool Contains(uint64_t tenant, const storage::Key& k) const;
  // Whether Add(tenant, k, name of name_bytes) would now hit a limit: k is not indexed and the
  // tenant holds keys_per_tenant_max entries, or the name would take the index past
  // name_bytes_max.
  bool AtLimit(uint64_t tenant, const storage::Key& k, size_t name_bytes) const;
  // The tenant other than `tenant` with the most entries (nullopt: none): the one whose names
  // fill the byte limit if `tenant`'s do not.
  std::optional<uint64_t> LargestTenantBesides(uint64_t tenant) const;
  uint64_t bytes() const;       // charged bytes of all entries
  uint64_t unindexed() const;   // Add() calls that hit a limit
  uint64_t log_errors() const;  // log appends, syncs and rewrites that failed

 private:
  // Callers hold mu_. The index change alone (no log); false when a limit refused it.
  bool AddLocked(uint64_t tenant, const storage::Key& k, std::string_view name);
  void RemoveLocked(uint64_t tenant, const storage::Key& k);
  void RemoveTenantLocked(uint64_t tenant);
  void LogLocked(const RespNameLog::Record& r);  // Remove/RemoveTenant: errors only counted
  // log_->Append (after the buffered records) and the counters; errors counted.
  Status AppendLocked(const RespNameLog::Record& r);
  // Writes the buffered records (one write); errors counted, the records stay buffered.
  Status WritePendingLocked();
  void MaybeCompactLocked();
  // Rewrites the log from the entries (with a checkpoint at the source's end, if any).
  void CompactLocked();
  // Appends a checkpoint at the source's end `at` (no-op when it equals the last one).
  void CheckpointLocked(const storage::LogPosition& at);
  // Reads the source's end, then appends a checkpoint there (no-op without a source).
  void Checkpoint();
  Status WaitSynced(uint64_t seq);
  void SyncEvery(uint64_t interval_ms);  // the background sync thread's loop

  const size_t keys_per_tenant_max_;
  const uint64_t name_bytes_max_;
  mutable std::mutex mu_;
  std::map<uint64_t, std::map<storage::Key, std::string>> keys_;  // guarded by mu_
  uint64_t bytes_ = 0;                                            // guarded by mu_
  uint64_t unindexed_ = 0;                                        // guarded by mu_
  std::unique_ptr<RespNameLog> log_;                              // set by Persist
  bool sync_adds_ = false;
  bool buffer_adds_ = false;  // set by Persist: Add buffers its record (see above)
  LogSource source_;          // set by Persist
  std::optional<storage::LogPosition> last_checkpoint_;  // guarded by mu_
  std::atomic<uint64_t> recovered_from_store_{0};
  std::atomic<uint64_t> log_errors_{0};
  // Records appended so far, buffered or written (changed under mu_; the sequence Add hands
  // out), the prefix of them in the file (written_), and the group commit of their syncs.
  std::atomic<uint64_t> appended_{0};
  std::atomic<uint64_t> written_{0};
  std::mutex sync_mu_;
  std::condition_variable sync_cv_;
  uint64_t synced_ = 0;   // guarded by sync_mu_: records up to here are durable
  bool syncing_ = false;  // guarded by sync_mu_: a sync or a rewrite runs (outside it)
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stop_ = false;  // guarded by stop_mu_
  std::thread syncer_;
};

}  // namespace kvtier::daemon
