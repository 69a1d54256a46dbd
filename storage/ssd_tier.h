// SsdTier: the persistent tier. Values are appended as self-describing records to segment
// files (BlockDevices from a DeviceEnv), packed into a write buffer and written as large
// sequential writes; a RocksDB index (column families "index" and "meta") maps each key to
// its record. Formats and durability modes: docs/format/ssd.md.
//
// - Put appends; the index entry reaches RocksDB only after the record is durable under the
//   durability mode (kSync: before Put returns; kBatched: at the next group commit, every
//   group_commit_ms, by a background thread; kNone: written at the group commit without fsync).
//   Until then the entry lives in memory and Get serves it (from the write buffer if needed).
// - Get verifies the record against the checksum kept in the index. A mismatch or a bad
//   header is a quarantine: the entry is removed (memory and index), counted, and Get returns
//   Corruption. An I/O error is counted and returned as IOError; the entry stays.
// - Capacity: live bytes are kept under a limit by evicting through the eviction policy
//   (evicted keys are reported to the caller); segments are cleaned (live records relocated)
//   when the segment count is over its limit, or (one per roll) when a sealed segment's live
//   ratio falls below clean_live_ratio.
// - Segment thread: no segment I/O runs under the tier lock. A background thread keeps the
//   next segment prepared (created and fallocated; under kSync also zero-filled, see
//   zero_fill_segments), so a roll only swaps it in (no commit, no fallocate), and cleans:
//   it reads the victim's live records outside the lock, paced by
//   background_io_bytes_per_s, relocates them in chunks of about 1 MiB per lock hold,
//   commits through the group commit path, then deletes the segment. A put waits only when
//   its record does not fit in the active segment and no segment is prepared (the tier is
//   at its segment limit and cleaning, or preparation failed: then the put returns that
//   error); the I/O budget is lifted while a put waits. Units the cleaner drops (unreadable,
//   or no room to relocate) are reported in the `evicted` list of the next Put.
// - Open recovers: RocksDB recovery, then a scan of the log past the last commit (the
//   segment active at that commit from its durable offset, and every later segment from 0):
//   whole records are re-indexed, each segment's scan stops at its first torn or invalid
//   record, index entries pointing past it are dropped (when met), empty later segments are
//   removed, and appends continue in a fresh segment. Open does NOT load the index: it returns at
//   once (warm restart) and a background thread loads the RocksDB index into memory (and the
//   eviction policy) in batches of 4096. Until it finishes, a key not loaded yet is read from
//   RocksDB by a point read (Get, Contains, Remove, Put), with the same checks; keys removed
//   meanwhile are never brought back. Capacity during the load: a Put that could need eviction or
//   segment cleaning (live bytes bounded by the bytes on disk at Open) waits for the load; cleaning
//   is deferred to its end; EvictOne evicts among loaded entries. Close cancels the load. A
//   load that fails (the index unreadable past some entry: an I/O error, a corrupt table) is
//   logged and ends in that error: unloaded entries are still served by point reads, but live
//   bytes stay unknown until a restart loads the index, so cleaning never runs and a Put that
//   could need room fails with the load's error ("ssd index load failed: ..."), as do
//   ForEach and WaitForIndexLoad; SsdStats::index_load_failed says so. Open fails instead when
//   it must wait for the load (an index without the counters of this format's later versions).
// - Double buffering: there are write_buffers write buffers. A full buffer (or the one a
//   commit closes) is handed to a writer thread, which submits it as up to 4 writes at once;
//   the putting thread goes on filling the next free buffer meanwhile, and waits (tier lock
//   held) only when every buffer is still in flight. Get serves records from the buffer
//   being filled and from buffers in flight, bit exact. Memory: write_buffers x
//   write_buffer_bytes.
// - Commits: a commit closes the buffer being filled, then outside the tier lock waits for
//   every buffer handed over before it, fdatasyncs, and writes the index entries of the
//   records whose write succeeded (puts and gets continue meanwhile); index writes are
//   applied in commit order. The data fdatasync is a commit's only sync unless the batch holds
//   a delete other than an eviction or covers a failed buffer write (whose hole would stop the
//   tail scan), or Flush, open, close, cleaning ask: the index of a put
//   is rebuilt by the tail scan when a power failure loses its unsynced RocksDB write
//   (docs/format/ssd.md, "One synced write per commit"). The committing thread writes the
//   buffer it closes itself. Concurrent kSync puts share one commit; before it commits, a
//   kSync leader may wait (commit_delay_us, tier lock released) for the writers it expects. Every
//   put and removal gets a commit ticket; WaitDurable(ticket) commits up to it (kSync) so that
//   callers can release their own locks first and share the commit. A failed commit carries its
//   CommitStage (stats, log): after kBufferWrite / kSync its data is forgotten (reported to
//   on_write_lost), after kIndexWrite (data durable) its index operations are retried at the
//   next commit. A relocation by the cleaner whose write or sync failed is not forgotten: its
//   entry goes back to the (durable) record it copied, and the victim segment stays.
// - Deletes: Remove takes the entry out of memory at once and commits an index delete with
//   the next commit. An eviction's index delete does not sync the index (a power failure may
//   bring an evicted unit back, intact); a Remove of a key so evicted, before a synced index
//   write covered its delete, records a delete that does. A commit records durable_end (the end of
//   everything appended before it); the recovery tail scan starts there, so it never re-indexes a
//   record whose delete, or whose newer version, was committed.
// - Segment files: the segment directory is fsynced after a segment is created (before any
//   commit names it) and after one is deleted (DeviceEnv::SyncDir).
// - Async write errors (EIO, ENOSPC): the records of the failed buffer are dropped (never
//   indexed; Get returns NotFound), counted in io_errors, and the commit covering the buffer
//   returns the error (Flush, the kSync put that waits for it, the group commit's log line).
//
// Thread safety: all methods may be called concurrently. Reads of sealed data run outside
// the tier lock; appends are serialised by it; commits by a commit lock; segment preparation
// and cleaning run on the segment thread, taking the tier lock only between device I/Os.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/status.h"
#include "policies/policy.h"
#include "policies/prefix_layer/prefix_layer.h"
#include "storage/block_device.h"
#include "storage/tier_manager.h"

namespace kvtier::storage {

struct SsdMeta;  // below

struct SsdOptions {
  // Directory holding "index/" (RocksDB) and, when env is null, "segments/".
  std::string dir;
  // Segment devices; not owned. nullptr: a DirEnv over dir + "/segments".
  DeviceEnv* env = nullptr;
  // The index's RocksDB Env; not owned. nullptr: RocksDB's default (tests pass one whose
  // write-ahead log fails its syncs on demand).
  rocksdb::Env* index_env = nullptr;
  DirEnvOptions dir_env;
  // Bytes on disk the tier may use (segments); at least 3 segments' worth.
  uint64_t capacity_bytes = 4ull << 30;
  uint64_t segment_bytes = 256ull << 20;
  uint64_t write_buffer_bytes = 2ull << 20;
  // Write buffers (double buffering: one filling while the others are in flight); clamped to
  // [1, kMaxWriteBuffers]. 1 keeps one buffer, written by the writer thread while puts wait.
  // 4 (not 2): a group commit closes the buffer being filled early, and a putting thread that
  // misses a CPU for a few ms must still find a free buffer; with 2 the device queue drained
  // at such moments (docs/performance/storage.md, "Unit writes with four write buffers"). Under a
  // saturated device an acknowledged kBatched put may wait in memory for the buffers ahead of
  // it, so the loss window of a crash grows by up to write_buffers x write_buffer_bytes of
  // device write time (8 MiB: ~13 ms at 650 MiB/s).
  uint32_t write_buffers = 4;
  static constexpr uint32_t kMaxWriteBuffers = 8;
  Durability durability = Durability::kBatched;
  uint32_t group_commit_ms = 10;
  // kSync commit delay: the thread about to commit (the leader) first waits up to this long,
  // tier lock released, for the sync writers it expects to join, ending as soon as they have:
  // expected are as many as the last commit covered plus those that appended while it ran
  // (writers it released come back while the next commit would already run, so without the
  // wait the writers settle into two alternating groups). No wait when fewer than 2 are
  // expected or they have all joined. 0: never wait. Counted in SsdStats::commit_delays.
  static constexpr uint32_t kDefaultCommitDelayUs = TierManagerOptions::kDefaultSsdCommitDelayUs;
  static constexpr uint32_t kMaxCommitDelayUs = 1000000;  // larger values are clamped
  uint32_t commit_delay_us = kDefaultCommitDelayUs;
  // kSync only: every new segment is written with zeros (and fdatasynced) before records are
  // appended to it, by the segment thread (paced by background_io_bytes_per_s) or, for the
  // segment Open starts, by Open itself (256 MiB: ~0.4 s here). A commit's records then land
  // in blocks already written: no unwritten-extent conversion (a kworker and a wake-up) at
  // each write's completion (docs/format/ssd.md, "Zero-filled segments"). Costs one extra
  // write of each segment. false, and on devices of alignment 1 (memory): segments are only
  // fallocated (as under kBatched / kNone).
  bool zero_fill_segments = true;
  // Free space the tier leaves on its disk for the files beside its segments: the RocksDB
  // index (its WAL, memtable flushes and compactions) and the RESP name log (and its rewrite),
  // which grow with the keys while the segments stay fallocated. The segment thread prepares no
  // segment that would leave less free (DeviceEnv::FreeBytes), and checks the disk every
  // disk_check_ms: while less is free, the segment limit drops to one below the segments there
  // are (the cleaner reclaims the emptiest, relocating what fits and evicting the rest, as
  // after ENOSPC), one segment per check; it rises again by one per check once the floor plus
  // two segments are free and 30 checks have passed since it was last lowered. The tier keeps at
  // least 3 segment files: below that, preparing one fails (puts that need it fail with a no-space
  // error). 0: no floor, and a disk that fills then meets the index (docs/format/ssd.md, "Free
  // space for the index").
  static constexpr uint64_t kDefaultDiskFreeMinBytes =
      TierManagerOptions::kDefaultSsdDiskFreeMinBytes;
  uint64_t disk_free_min_bytes = kDefaultDiskFreeMinBytes;
  // How often the segment thread reads the disk's free space (with a floor only); clamped to
  // [1, kMaxDiskCheckMs].
  static constexpr uint32_t kMaxDiskCheckMs = 60'000;
  uint32_t disk_check_ms = 1000;
  // Objects the tier may hold (0: no limit): a put of a new key beyond it evicts by policy as
  // a full tier does. Each object's entry in memory (index map, policy) costs host memory that
  // a flood of tiny values would grow without bound (docs/CONFIG.md, ssd_objects_max). While
  // the index loads, a put that could exceed it waits for the load, as one that could need
  // cleaning does.
  uint64_t objects_max = 0;
  // A sealed segment whose live bytes fall below this fraction is cleaned after the next roll.
  double clean_live_ratio = 0.25;
  // I/O budget of the segment thread's cleaning (bytes read + bytes relocated per second);
  // lifted while a put waits for a segment. 0: unlimited.
  uint64_t background_io_bytes_per_s = 256ull << 20;
  // A batch read (GetBatch) reads records that lie next to each other in a segment (their
  // aligned spans overlap or touch) with one device read of at most this many bytes, instead
  // of one read each: the units of a session, put together, are read in a few large requests,
  // and a block two records share is read once. Reads nothing no unit of the batch needs
  // (beyond the < 8 bytes of padding between records on a device of alignment 1); each record
  // is still verified on its own, and a failed read fails each of its units. 0: one read per
  // record.
  uint64_t batch_read_merge_bytes_max = 128ull << 10;
  // Adaptive zstd: level, and the sample size used to decide.
  bool compression = true;
  int zstd_level = 1;
  uint32_t compression_sample_bytes = 4096;
  // Values smaller than this are stored as they are (codec none), never compressed: below one
  // 4 KiB block zstd saves at most part of one block of a larger write, and on a 1 KB durable
  // SET it cost ~7 % of the daemon's CPU, its buffers another ~3 % (docs/performance/storage.md
  // "Durable SET: less work per SET"). 0 or 1: every value is a candidate.
  static constexpr uint32_t kDefaultCompressionMinBytes = 4096;
  uint32_t compression_min_bytes = kDefaultCompressionMinBytes;
  std::string eviction_policy = "lru";
  policies::PolicyParams policy_params;
  // kPrefix: the policy runs under policies::PrefixLayer (also after SetPolicy), told of each
  // request by BeginRequest(RequestTag::id), as a memory tier's.
  policies::Structure structure = policies::Structure::kPlain;
  // Tests: when set, makes the policy instead of eviction_policy (SetPolicy still switches to
  // a named one).
  std::function<std::unique_ptr<policies::EvictionPolicy>()> eviction_policy_factory;
  const Clock* clock = nullptr;  // policy time; nullptr: DefaultSteadyClock()
  // Called by the background index-load thread (no tier lock held) with entries it has just
  // loaded into memory (also entries first met by a point read). Must not block on a lock
  // that a caller of this tier may hold while calling it (use try_lock / a queue), and must
  // not call back into the tier. Empty: not called.
  std::function<void(std::span<const std::pair<Key, SsdMeta>>)> on_index_load;
  // Called with the keys whose records were lost to a failed buffer write or commit sync
  // (forgotten, never served again; also kBatched puts already acknowledged), with the tier
  // lock held: must only take locks of its own and not call back. Empty: not called.
  std::function<void(std::span<const Key>)> on_write_lost;
};

// What the caller (TierManager) keeps about a value besides its bytes.
struct SsdMeta {
  TenantId tenant = 0;
  uint64_t version = 0;
  policies::ObjectKind kind = policies::ObjectKind::kGlobalKv;
  uint64_t expires_unix_ms = 0;
  policies::ObjectId parent_id = 0;
  uint32_t recompute_tokens = 0;
  uint32_t raw_bytes = 0;  // filled on read / ForEach
};

struct SsdStats {
  uint64_t capacity_bytes = 0, live_bytes = 0, disk_bytes = 0, objects = 0, segments = 0;
  uint64_t objects_max = 0;  // SsdOptions::objects_max
  uint64_t hits = 0, evictions = 0, bytes_read = 0, bytes_written = 0;
  uint64_t checksum_failures = 0, io_errors = 0, compressed_bytes_saved = 0;
  uint64_t segments_cleaned = 0, commits = 0, recovered_records = 0, dropped_on_recovery = 0;
  // Bytes of live records the cleaner wrote again (its write amplification).
  uint64_t relocated_bytes = 0;
  // Times preparing a segment hit ENOSPC and the tier lowered its segment limit to what the
  // disk held (docs/format/ssd.md, "Capacity and cleaning": a disk smaller than
  // ssd_capacity_bytes).
  uint64_t disk_full_shrinks = 0;
  // Times the disk's free space fell below disk_free_min_bytes and the tier lowered its segment
  // limit (at a check, or instead of preparing a segment); the free space last read
  // (DeviceEnv::kNoFreeSpaceLimit: not read, or no such limit).
  uint64_t disk_free_shrinks = 0;
  // Segments Open deleted (oldest first, their units dropped) because the disk had no room
  // for the fresh segment a start appends to (ENOSPC).
  uint64_t disk_full_open_drops = 0;
  uint64_t disk_free_bytes = DeviceEnv::kNoFreeSpaceLimit;
  // fdatasync calls made by commits; failed commits and the stage of the latest failure.
  uint64_t syncs = 0, commit_failures = 0;
  // Commits (and Flushes) that synced the RocksDB index WAL: those holding a delete other
  // than an eviction, or covering a failed buffer write, Flush, recovery, close, the cleaner's
  // before a segment deletion, and the one after 16384 evictions wait unsynced (Remove).
  uint64_t index_syncs = 0;
  // Failed index writes after which the index was closed and opened again (RocksDB refuses
  // every write after a failed WAL sync until then).
  uint64_t index_reopens = 0;
  // kSync puts that commits covered (commit_writers / commits: writers per commit); commits
  // whose leader waited for more writers (SsdOptions::commit_delay_us), the microseconds it
  // waited in all, and the waits that ended at the bound rather than when all had joined.
  uint64_t commit_writers = 0, commit_delays = 0, commit_delay_us = 0, commit_delay_timeouts = 0;
  CommitStage last_failed_stage = CommitStage::kNone;
  // Background index load: done, and how long after Open it finished. index_load_failed: it
  // failed (logged): no room can be made until a restart loads the index (class comment).
  bool index_loaded = false;
  bool index_load_failed = false;
  uint64_t index_load_ms = 0;
};

class SsdTier {
  class Impl;

 public:
  // What GetBatch(keys, Batch*) leaves: each key's verified value where it was read, without
  // a copy or an allocation per unit. value(i) views the batch's read region (a record stored
  // uncompressed and read from the device) or a copy this object holds (a compressed record,
  // decoded; a record served from a write buffer). Views stay valid until the object is
  // destroyed or passed to GetBatch again. The read region is the thread's cached one (kept
  // between batches, its pages faulted in once) when it is large enough: the object holds it
  // while it lives and hands it back to the cache of the thread that destroys or reuses it.
  // Move-only.
  class Batch {
   public:
    Batch();
    ~Batch();
    Batch(Batch&&) noexcept;
    Batch& operator=(Batch&&) noexcept;
    Batch(const Batch&) = delete;
    Batch& operator=(const Batch&) = delete;

    size_t size() const { return results_.size(); }
    // Get's status for key i (duplicates are read once each).
    const Status& result(size_t i) const { return results_[i]; }
    // Key i's verified value; empty unless result(i) is OK.
    std::span<const uint8_t> value(size_t i) const { return values_[i]; }
    // Key i's indexed metadata (raw_bytes included) when result(i) is OK or Corruption (what
    // a refetch of a quarantined unit needs); default otherwise.
    const SsdMeta& meta(size_t i) const { return metas_[i]; }

   private:
    friend class SsdTier::Impl;
    void Reset(size_t n);
    // The read region for `bytes` of device reads: the one held, the thread's cached one, or
    // (larger than the cache keeps) one of its own; aligned and faulted in.
    uint8_t* Region(uint64_t bytes);
    void ReleaseRegion();

    std::vector<Status> results_;
    std::vector<SsdMeta> metas_;
    std::vector<std::span<const uint8_t>> values_;
    // Per key, usually empty: a record copied from a write buffer, or a decoded payload.
    std::vector<std::vector<uint8_t>> owned_;
    AlignedBuffer region_;
    uint64_t region_bytes_ = 0;
  };

  static StatusOr<std::unique_ptr<SsdTier>> Open(const SsdOptions& options);
  // Commits everything (Flush) and persists access statistics.
  ~SsdTier();

  // Appends the value. Keys evicted to make room (and keys the segment thread dropped since
  // the last Put) are appended to *evicted (may be null).
  // IOError: the write failed (nothing indexed), or (kSync) another buffer write of the same
  // commit did: the unit may then be stored (a caller that must not keep it removes it).
  // InvalidArgument: larger than a segment.
  // Policy hooks (as a memory tier calls them, storage::RequestTag): OnCapacity once (the live
  // byte limit in records of this one's size), OnRequest when `request`'s id differs from the
  // last call's, OnMiss, then Evict while full and OnInsert, at the request's time (request
  // null or id 0: the clock's, and no OnRequest).
  // defer_ticket (kSync only; may be null): when not null, Put returns once the record is
  // appended, without committing, and sets *defer_ticket to the ticket to pass to
  // WaitDurable (the unit is durable, and the put may be acknowledged, only after that).
  Status Put(const Key& key, std::span<const uint8_t> value, const SsdMeta& meta,
             std::vector<Key>* evicted, const RequestTag* request = nullptr,
             uint64_t* defer_ticket = nullptr);
  // NotFound, Corruption (quarantined; *meta is still the record's, from the index), IOError.
  // A hit is the policy's OnAccess at the time of `request` (as for Put).
  Status Get(const Key& key, std::vector<uint8_t>* out, SsdMeta* meta = nullptr,
             const RequestTag* request = nullptr);
  // Get for many keys at once: the device reads of the batch, across all their segments, are
  // submitted together (DeviceEnv::SubmitAcross, up to kMaxBatchIos per submission; the queue
  // depth is min(reads, the env's queue_depth)), and each record is verified against its checksum
  // as Get does. Resizes *outs, *metas (may be null) and *results to keys.size(); results[i] is
  // Get's status for keys[i] (duplicates are read once each). report_hits false: the hits are
  // not reported to the policy here; the caller reports each with ReportHit, in its own order.
  void GetBatch(std::span<const Key> keys, std::vector<std::vector<uint8_t>>* outs,
                std::vector<SsdMeta>* metas, std::vector<Status>* results,
                const RequestTag* request = nullptr, bool report_hits = true);
  // GetBatch without the copy into a vector per unit: *batch (reset first) receives each
  // key's status, metadata and a view of its verified value (Batch). Same reads, checks,
  // quarantine, counters and policy calls. A record that fails verification is never viewed:
  // its result is Corruption and its value empty.
  void GetBatch(std::span<const Key> keys, Batch* batch, const RequestTag* request = nullptr,
                bool report_hits = true);
  // The policy's OnAccess for a hit read with GetBatch(..., report_hits = false); nothing when
  // the key is not tracked (gone, or pinned).
  void ReportHit(const Key& key, const RequestTag* request = nullptr);
  // *meta (may be null) receives the indexed metadata (raw_bytes included).
  bool Contains(const Key& key, uint64_t* version = nullptr, SsdMeta* meta = nullptr) const;
  // NotFound if absent. The removal is durable at the next commit (never commits itself);
  // *ticket (may be null) receives the commit ticket for WaitDurable. A key the tier evicted
  // whose eviction delete no synced index write covers yet (durability other than kNone) is
  // not absent: a power failure may lose that delete and bring the unit back. Remove then
  // records a delete of its own, which syncs the index with its commit, and returns OK.
  Status Remove(const Key& key, uint64_t* ticket = nullptr);
  // kSync: commits everything up to the ticket (sharing a commit with concurrent callers)
  // and returns the outcome of the commit that covered it. kBatched / kNone: returns OK at
  // once (the group commit covers it). Must not be called with a lock a put may wait for.
  Status WaitDurable(uint64_t ticket);
  // Evicts one object chosen by the policy (removed from the index); nullopt if none.
  std::optional<Key> EvictOne();
  // Pinned objects are untracked by the policy (never chosen by eviction).
  void SetTracked(const Key& key, bool tracked);
  Status SetPolicy(const std::string& eviction, const policies::PolicyParams& params);
  // Calls fn for every live object (under the tier lock: fn must not call back). Waits for
  // the background index load first; when it failed, calls fn for the loaded objects only
  // and returns the load's error.
  Status ForEach(const std::function<void(const Key&, const SsdMeta&)>& fn) const;
  // Calls fn for each key that Remove would find evicted with its delete not yet synced (see
  // Remove), with the unit's tenant (under the tier lock: fn must not call back). Bounded: a
  // commit syncs the index once 16384 such evictions are waiting.
  void ForEachUnsyncedEviction(const std::function<void(const Key&, TenantId)>& fn) const;
  // Blocks until the background index load has finished: every entry is in memory and has
  // been reported to on_index_load (the last batch too), and the deferred cleaning ran; or
  // until it failed: returns its error then (the class comment, "Open does NOT load").
  Status WaitForIndexLoad() const;
  // Writes the buffer, syncs, commits the index.
  Status Flush();
  // TierManager::SsdLogEnd / ReplaySsdLog (tier_manager.h): the append position, and a walk
  // of the records from `from` to it.
  LogPosition LogEnd() const;
  Status Replay(const LogPosition& from, const LogRecordVisitor& visit);
  SsdStats GetStats() const;
  uint64_t max_version() const;

 private:
  explicit SsdTier(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvtier::storage
