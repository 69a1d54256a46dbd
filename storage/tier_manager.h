// TierManager: placement of all-or-nothing units across HBM -> DRAM -> SSD.
//
// This is the storage contract the daemon (cache_daemon/) programs against. Keys are
// storage keys: already bound to a tenant by the daemon (DESIGN §3), so two tenants' units
// can never collide. Values are opaque byte strings (an encoded unit, or a RESP value).
//
// Semantics:
// - Put admits a unit to the highest allowed tier that has room, evicting (and demoting to
//   the next tier through the admission policy) as needed. A put is all-or-nothing: after it
//   returns, Get returns either the complete value or NotFound, never a part.
// - Get returns the value from the fastest tier that holds it and promotes it per policy.
//   A value read from SSD is verified against the checksum in the index first; a mismatch is
//   reported as NotFound (the unit is quarantined and counted), never as data.
// - Lookup answers the longest prefix of a key chain that is fully present, with the tier of
//   each hit and a reason for the first miss.
// - Pinned units are never evicted until Unpin or until their lease expires.
//
// Durability contract (TierManagerOptions::durability; on-disk detail in docs/format/ssd.md).
// With an SSD tier present, every acknowledged write, whatever tier it was placed in, and
// every acknowledged delete (Delete, DeleteTenant) is durable under the mode in force:
//   kSync:    Put / Delete / DeleteTenant return OK only after the data (or the removal) and
//             its index entry are on disk (a put or delete whose commit is deferred,
//             PutOptions::defer_commit or DeleteDeferred: CompletePut returns OK only then).
//   kBatched: a crash loses at most the writes and deletes acknowledged in the last
//             group_commit_ms; everything acknowledged before that survives.
//   kNone:    a pure cache: a crash may lose anything (a graceful Flush still writes back).
// To keep it, a put placed in a memory tier (HBM, DRAM) is written through to the SSD tier
// as well (under kSync before Put returns; bypassing the admission policy, which only
// governs demotions), and a delete commits an index delete under the same mode. Recovery
// never brings back a unit whose delete was committed, nor an older version of a unit
// whose newer put was committed. Exceptions: a put with PutOptions::allow_ssd = false is
// memory-only by request (SWA hot state) and never durable; kNone writes memory-placed
// puts to SSD only on demotion or Flush. Capacity eviction and TTL expiry end a unit's
// life as always (a unit the SSD tier evicts while a memory tier holds it is served from
// memory until evicted there, but no longer survives a restart; a power failure may bring
// an evicted unit back, intact, unless it was deleted since: a delete of a unit the SSD
// tier evicted commits an index delete of its own). Without an SSD tier nothing is durable.
// Concurrent kSync writers share commits (one fdatasync + one index write for all the
// puts and deletes that arrive while the previous commit runs): the SSD write and the wait
// for its commit run outside TierManager's own lock. Writes of one key are serialised.
//
// Thread safety: every method may be called concurrently from any thread.
// Limits: values larger than TierManagerOptions::max_value_bytes are InvalidArgument; batch
// calls larger than kMaxBatch keys are InvalidArgument.
#pragma once

#include <array>
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

namespace rocksdb {
class Env;
}  // namespace rocksdb

namespace kvtier::storage {

class DeviceEnv;  // storage/block_device.h

using Key = std::array<uint8_t, 32>;
using TenantId = uint64_t;

enum class Tier : uint8_t { kHbm = 0, kDram = 1, kSsd = 2, kNone = 255 };
const char* TierName(Tier tier);  // "hbm", "dram", "ssd", "none"

enum class MissReason : uint8_t {
  kNone = 0,         // not a miss
  kNeverStored,      // no record of this key (also: another tenant's key)
  kEvicted,          // it was stored and has been evicted
  kExpired,          // its TTL passed
  kChecksumFailure,  // it was stored but failed verification and was quarantined
  kIoError,          // the SSD tier failed to read it, or lost it in a failed write
};
const char* MissReasonName(MissReason reason);

enum class Durability : uint8_t {
  kNone,     // pure cache: data reaches disk eventually; a crash may lose anything
  kBatched,  // group commit every group_commit_ms; a crash loses at most that window
  kSync,     // acknowledged only after data and index are durable
};

// Where a failed SSD commit failed: decides what the tier may keep. Data whose buffer write
// or fdatasync failed is not durable and is forgotten; after an index-write failure the
// data is durable and the index operations are retried at the next commit.
enum class CommitStage : uint8_t {
  kNone = 0,     // no failure
  kBufferWrite,  // a write buffer covered by the commit failed to reach the device
  kSync,         // fdatasync of a segment (or fsync of the segment directory) failed
  kIndexWrite,   // building or writing the RocksDB batch failed
};
const char* CommitStageName(CommitStage stage);  // "none", "buffer_write", "sync", "index_write"

inline constexpr size_t kMaxBatch = 4096;
// A put that its tenant's quota refuses first reclaims the tenant's expired units, examining at
// most this many of them (TierManager::SetTenantQuota).
inline constexpr size_t kQuotaReclaimUnitsMax = 1024;

// One request as the eviction policies see it (policies::EvictionPolicy::OnRequest): every
// policy call made for calls that carry the same id belongs to one request with one time,
// now_us (taken once, when the request began). id 0 means "no request given": the call is a
// request of its own, timed by the clock when it runs. Get one from TierManager::BeginRequest.
// A memory tier calls OnRequest(now_us) on its policy whenever the id of the call touching
// the policy differs from the previous one (so requests that interleave are told again when
// they resume), then passes now_us to every hook of the call (OnMiss, Evict, OnInsert,
// OnAccess). The simulator (sim/simulator.h, trace field "request") does the same.
struct RequestTag {
  uint64_t id = 0;
  uint64_t now_us = 0;
};

struct TierManagerOptions {
  // Capacities; 0 disables a tier. HBM is a CUDA device arena when a GPU is present,
  // host-emulated otherwise.
  uint64_t hbm_capacity_bytes = 0;
  uint64_t dram_capacity_bytes = 1ull << 30;
  uint64_t ssd_capacity_bytes = 0;
  // SSD tier: data directory (segments + RocksDB index); required when ssd_capacity_bytes > 0.
  std::string data_dir;
  Durability durability = Durability::kBatched;
  uint32_t group_commit_ms = 10;
  uint64_t max_value_bytes = 64ull << 20;
  // Policy names and parameters (policies::MakeEvictionPolicy / MakeAdmissionPolicy).
  std::string eviction_policy = "lru";
  std::string admission_policy = "admit-all";
  policies::PolicyParams policy_params;
  // kPrefix: every tier's eviction policy runs under the prefix layer
  // (policies/prefix_layer/prefix_layer.h: hits deepest first, the running request held,
  // leaf-first victims), as `kvtier sim --structure prefix` replays it; kept across SetPolicy.
  policies::Structure eviction_structure = policies::Structure::kPlain;
  // Tests: when set, makes the memory tiers' eviction policies instead of eviction_policy;
  // ssd_eviction_policy_factory the SSD tier's.
  std::function<std::unique_ptr<policies::EvictionPolicy>()> eviction_policy_factory;
  std::function<std::unique_ptr<policies::EvictionPolicy>()> ssd_eviction_policy_factory;
  // Time source for TTLs and leases; nullptr means DefaultSteadyClock().
  const Clock* clock = nullptr;

  // Objects (units, RESP values) each tier may hold. Every object costs host memory for its
  // bookkeeping beside its bytes (the tier's index entry and policy node, the manager's
  // directory entry: docs/CONFIG.md gives the measured cost), which a flood of tiny values
  // would otherwise grow far past the tiers' capacities. Beyond the limit a new object evicts
  // by policy, as a full tier does. 0: one object per kDefaultBytesPerObject of the tier's
  // capacity, and for the SSD tier at most kDefaultSsdObjectsMax (raise it with the RAM to
  // hold a large SSD's index). ObjectsMax() gives the limit in force.
  static constexpr uint64_t kDefaultBytesPerObject = 512;
  static constexpr uint64_t kDefaultSsdObjectsMax = 8ull << 20;
  uint64_t hbm_objects_max = 0;
  uint64_t dram_objects_max = 0;
  uint64_t ssd_objects_max = 0;
  uint64_t ObjectsMax(Tier tier) const;

  // ---- added by the storage implementation (defaults keep the original behaviour) ----
  // SSD segment file size and write-buffer size (docs/format/ssd.md).
  uint64_t ssd_segment_bytes = 256ull << 20;
  uint64_t ssd_write_buffer_bytes = 2ull << 20;
  // I/O budget of the SSD segment thread's cleaning (SsdOptions::background_io_bytes_per_s).
  uint64_t ssd_background_io_bytes_per_s = 256ull << 20;
  // sync: how long a commit's leader may wait for the writers it expects to join
  // (SsdOptions::commit_delay_us; at most SsdOptions::kMaxCommitDelayUs). 0: never waits.
  static constexpr uint32_t kDefaultSsdCommitDelayUs = 0;  // off: docs/CONFIG.md says why
  uint32_t ssd_commit_delay_us = kDefaultSsdCommitDelayUs;
  // Free space the SSD tier leaves on its disk for its index and the files beside it
  // (SsdOptions::disk_free_min_bytes; docs/format/ssd.md "Free space for the index"). 0: none.
  static constexpr uint64_t kDefaultSsdDiskFreeMinBytes = 256ull << 20;
  uint64_t ssd_disk_free_min_bytes = kDefaultSsdDiskFreeMinBytes;
  // Segment devices for the SSD tier; not owned. nullptr: files under data_dir/segments
  // (io_uring + O_DIRECT, POSIX fallback). Tests pass a memory or fault-injecting env.
  DeviceEnv* ssd_env = nullptr;
  // The SSD index's RocksDB Env (SsdOptions::index_env); not owned. nullptr: RocksDB's default.
  rocksdb::Env* ssd_index_env = nullptr;
  // DRAM/HBM slab page size: the largest value a memory tier can hold (larger values go to SSD).
  uint64_t slab_page_bytes = 4ull << 20;
  bool dram_mlock = false;
  // Populate the DRAM arena at open (MemoryTierOptions::prefault; docs/CONFIG.md).
  bool dram_prefault = false;
  // Keys remembered as evicted / expired / quarantined, so Lookup can name the miss reason.
  size_t miss_memory_entries = 1 << 20;
  // Pinned keys at most; Pin beyond this is Rejected.
  size_t max_pinned = 1 << 20;
};

// What a put with a deferred commit (PutOptions::defer_commit), or a DeleteDeferred, leaves
// for CompletePut.
struct DeferredCommit {
  uint64_t ticket = 0;  // the SSD commit ticket; 0: nothing to wait for
  Key key{};
  uint64_t version = 0;  // the put's version; 0: no put to undo on failure (a delete)
};

// A place in the SSD tier's append-only log (docs/format/ssd.md): segment id, then byte offset
// in it. Records are appended in this order (segment ids only grow, offsets grow within a
// segment), so a record appended before another lies before it. {0, 0} is the log's start.
struct LogPosition {
  uint32_t segment = 0;
  uint64_t offset = 0;
  friend bool operator==(const LogPosition&, const LogPosition&) = default;
  friend auto operator<=>(const LogPosition&, const LogPosition&) = default;
};

// What ReplaySsdLog hands over per record: its tenant, storage key and decoded value.
using LogRecordVisitor =
    std::function<void(TenantId tenant, const Key& key, std::span<const uint8_t> value)>;

struct PutOptions {
  TenantId tenant = 0;
  policies::ObjectKind kind = policies::ObjectKind::kGlobalKv;
  // The previous unit in the chain (all zeros for the first unit).
  Key parent{};
  uint32_t recompute_tokens = 0;
  // 0: no expiry. Any value: one past the clock's range expires never (not at once).
  uint64_t ttl_ms = 0;
  // The fastest tier this value may be placed in.
  Tier highest_tier = Tier::kDram;
  // Lower tiers only: a value whose kind must never reach SSD (SWA state) sets this false.
  bool allow_ssd = true;
  // The request this put belongs to (a native batch PUT, or an engine turn); id 0: its own.
  RequestTag request;
  // Put only if absent: the unit is written only when the store holds no live unit of the
  // key (in any tier, unexpired; a put of the key in flight is waited for first, and then
  // counts). The check and the write are one step under the manager's lock, so a write that
  // got there first is never replaced. When a unit is held, nothing changes and Put returns
  // Rejected with *held set to true (held may be null). *held is false after every other
  // outcome. For copies that must not replace a newer write: the cluster's repair copies,
  // GET copies and checksum refetches (docs/CLUSTER.md).
  bool if_absent = false;
  bool* held = nullptr;
  // Not null: the put does not wait for its SSD commit (kSync). It returns once the unit is
  // appended to the SSD tier and placed (readers may see it before it is durable) and fills
  // *defer_commit; the put is durable, and may be acknowledged, only once
  // CompletePut(*defer_commit) returned OK. Callers batch puts and then complete them, so
  // one commit covers them all. Null (the default): Put waits itself.
  DeferredCommit* defer_commit = nullptr;
};

struct LookupResult {
  // Number of leading keys of the chain that hit.
  size_t hit_count = 0;
  // tiers[i] for i < hit_count.
  std::vector<Tier> tiers;
  // Why key[hit_count] missed (kNone when everything hit).
  MissReason first_miss = MissReason::kNone;
  // Value bytes of the hit units (their stored values; 0 when nothing hit).
  uint64_t hit_bytes = 0;
};

struct TierStats {
  uint64_t capacity_bytes = 0, used_bytes = 0, objects = 0;
  uint64_t hits = 0, evictions = 0, bytes_read = 0, bytes_written = 0;
  uint64_t objects_max = 0;  // the tier's object limit (TierManagerOptions::*_objects_max)
};

struct Stats {
  TierStats hbm, dram, ssd;
  uint64_t misses_never_stored = 0, misses_evicted = 0, misses_expired = 0, misses_checksum = 0;
  uint64_t misses_io_error = 0;
  // SSD commits that succeeded, fdatasync calls they made, commits that failed and the stage
  // of the most recent failure.
  uint64_t ssd_commits = 0, ssd_syncs = 0, ssd_commit_failures = 0;
  // SSD commits that also synced the index WAL (SsdStats::index_syncs).
  uint64_t ssd_index_syncs = 0;
  // Failed index writes after which the SSD index was reopened (SsdStats::index_reopens).
  uint64_t ssd_index_reopens = 0;
  // SsdStats::commit_writers, commit_delays, commit_delay_us, commit_delay_timeouts.
  uint64_t ssd_commit_writers = 0, ssd_commit_delays = 0, ssd_commit_delay_us = 0;
  uint64_t ssd_commit_delay_timeouts = 0;
  CommitStage ssd_last_failed_stage = CommitStage::kNone;
  // SsdStats::index_load_failed: the SSD index failed to load after a restart; puts that need
  // room fail until the index is repaired and the daemon restarted.
  bool ssd_index_load_failed = false;
  // SsdStats::index_loaded: the SSD index's background load has finished.
  bool ssd_index_loaded = false;
  uint64_t admissions = 0, admission_rejections = 0, checksum_failures = 0, io_errors = 0;
  // The admission policy's byte budget (AdmissionPolicy::Budget); all 0 when it has none.
  uint64_t admission_budget_bytes = 0, admission_budget_window_ms = 0;
  uint64_t admission_budget_spent_bytes = 0;
  uint64_t compressed_bytes_saved = 0, segments_cleaned = 0, ssd_queue_depth = 0;
  uint64_t ssd_relocated_bytes = 0;       // SsdStats::relocated_bytes
  uint64_t ssd_disk_full_shrinks = 0;     // SsdStats::disk_full_shrinks
  uint64_t ssd_disk_free_shrinks = 0;     // SsdStats::disk_free_shrinks
  uint64_t ssd_disk_full_open_drops = 0;  // SsdStats::disk_full_open_drops
  // SsdStats::disk_free_bytes (UINT64_MAX, DeviceEnv::kNoFreeSpaceLimit: unknown, or no SSD
  // tier).
  uint64_t ssd_disk_free_bytes = UINT64_MAX;
  // Value bytes per tenant, units whose TTL has passed included until they are expired
  // (SetTenantQuota).
  std::vector<std::pair<TenantId, uint64_t>> tenant_bytes;
};

// One unit as ListUnits reports it: what a copy of it elsewhere needs besides its bytes.
struct UnitInfo {
  Key key{};
  TenantId tenant = 0;
  uint64_t bytes = 0;
  policies::ObjectKind kind = policies::ObjectKind::kGlobalKv;
  // The parent's object id in its first 8 bytes, zeros after: ObjectIdOf(parent) is the
  // stored parent id (the full parent key is not kept), which is all a Put of it uses.
  Key parent{};
  uint32_t recompute_tokens = 0;
  uint64_t ttl_left_ms = 0;  // 0: no expiry
  Tier tier = Tier::kNone;   // the fastest tier holding it
  bool allow_ssd = true;
};

// Where ListUnits resumes. Start a scan with a default-constructed cursor.
struct UnitCursor {
  size_t bucket = 0;
  size_t buckets = 0;      // the directory's bucket count when the scan started
  bool done = false;       // the scan reached the end
  bool disturbed = false;  // the directory was rehashed during the scan: units added
                           // meanwhile may have been skipped or listed twice; scan again
};

class TierManager {
 public:
  virtual ~TierManager() = default;

  // Opens (recovering the SSD tier when data_dir holds one). Hits are served right after.
  static StatusOr<std::unique_ptr<TierManager>> Open(const TierManagerOptions& options);

  // Rejected: no tier has room even after eviction, the tenant is over quota, or (with
  // PutOptions::if_absent) the store holds the key.
  // IOError: the SSD write or its commit failed; the key then holds no value (an earlier
  // version is removed too, so a failed overwrite never leaves a stale value behind).
  virtual Status Put(const Key& key, std::span<const uint8_t> value, const PutOptions& options) = 0;
  // Finishes a put made with PutOptions::defer_commit, or a DeleteDeferred: under kSync
  // commits up to its ticket (sharing the commit with every other put and delete pending) and
  // returns that commit's outcome for it. IOError for a put: the put is not durable; its unit
  // is removed from every tier unless a newer put of the key replaced it (Put's IOError
  // contract). IOError for a delete: as Delete's (the removal stands in memory; its index
  // delete is retried at the next commit). Must not be called with a lock a put may wait for.
  // The default (test doubles, which never defer) returns OK.
  virtual Status CompletePut(const DeferredCommit& deferred) {
    (void)deferred;
    return Status::Ok();
  }

  // Appends the value to *out (cleared first) and sets *from to the tier it came from.
  // NotFound on a miss (including checksum failure).
  virtual Status Get(const Key& key, std::vector<uint8_t>* out, Tier* from = nullptr) = 0;

  // Get that also sets *ttl_left_ms to the unit's remaining TTL at the read (0: it has none),
  // for a copy of it elsewhere that must not outlive it (the cluster's GET copies). The
  // default (test doubles) reports 0.
  virtual Status GetWithTtl(const Key& key, std::vector<uint8_t>* out, uint64_t* ttl_left_ms) {
    *ttl_left_ms = 0;
    return Get(key, out);
  }

  // Get for internal copies (the cluster's repair scan): the same value and errors, but no
  // memory-tier hit or miss is counted, the policies are not told, and an SSD unit is not
  // promoted to DRAM (a scan over every unit must not displace what clients use); the SSD
  // tier still counts its read. A checksum failure still quarantines the unit (NotFound).
  // On a hit *info (may be null) describes the version read, as ListUnits would (its tier
  // the one read, ttl_left_ms counted at the read): a copy of the value must carry these, not
  // a listing's from before the read, which may describe an older version (a PUT between the
  // two replaces the value and its TTL). The default (test doubles) is Get, describing only
  // the key, the tier and the size (no expiry).
  virtual Status Peek(const Key& key, std::vector<uint8_t>* out, UnitInfo* info = nullptr) {
    Tier from = Tier::kNone;
    Status s = Get(key, out, &from);
    if (s.ok() && info != nullptr) *info = UnitInfo{.key = key, .bytes = out->size(), .tier = from};
    return s;
  }

  // Get for a batch of keys, each with Get's semantics (results[i], (*outs)[i], (*froms)[i]
  // for keys[i]; froms may be null). The SSD reads of the batch are submitted together
  // (SsdTier::GetBatch: one submission per segment, each record verified against its
  // checksum). More than kMaxBatch keys: every result is InvalidArgument. The batch is one
  // request for the policies: `request`, or a new one when its id is 0. The default runs
  // Get per key (for test doubles).
  virtual void GetBatch(std::span<const Key> keys, std::vector<std::vector<uint8_t>>* outs,
                        std::vector<Tier>* froms, std::vector<Status>* results,
                        const RequestTag& request = {}) {
    (void)request;
    outs->resize(keys.size());
    results->assign(keys.size(), Status::InvalidArgument("batch larger than kMaxBatch"));
    if (froms != nullptr) froms->assign(keys.size(), Tier::kNone);
    if (keys.size() > kMaxBatch) return;
    for (size_t i = 0; i < keys.size(); ++i) {
      (*results)[i] = Get(keys[i], &(*outs)[i], froms != nullptr ? &(*froms)[i] : nullptr);
    }
  }

  // What GetBatchVisit hands its visitor for key i: Get's status, the tier the value came
  // from (kNone on a miss) and the value, empty unless the status is OK.
  using BatchVisitor =
      std::function<void(size_t i, const Status& st, Tier from, std::span<const uint8_t> value)>;
  // GetBatch without a value the caller keeps: visit is called once per key, in key order, on
  // the calling thread and with none of the manager's locks held, before GetBatchVisit
  // returns. The value is valid only during the call: it views the SSD batch's read region
  // (verified; nothing is copied per unit before the visitor's own copy) or a scratch copy of
  // a memory-tier value that the next key reuses. Otherwise GetBatch's semantics: the same
  // reads, checksum quarantine, misses, promotions and policy calls, in the same order (the
  // promotions follow the last visit). More than kMaxBatch keys: every key is visited with
  // InvalidArgument.
  //
  // visited, when set, is called once, after the last visit and before the promotions, on the
  // calling thread with none of the manager's locks held: a caller may answer its client there
  // (every hit is known and every value was visited) and leave the promotions, which then run
  // before GetBatchVisit returns, off its reply's path. A promotion copies the value the batch
  // verified and only when, under the manager's lock, the SSD still holds the version that was
  // read and no put of the key is in flight: a unit deleted or replaced after `visited` (by
  // this client or another) is never promoted. The default runs GetBatch (for test doubles).
  virtual void GetBatchVisit(std::span<const Key> keys, const BatchVisitor& visit,
                             const RequestTag& request = {},
                             const std::function<void()>& visited = nullptr) {
    std::vector<std::vector<uint8_t>> outs;
    std::vector<Tier> froms;
    std::vector<Status> results;
    GetBatch(keys, &outs, &froms, &results, request);
    for (size_t i = 0; i < keys.size(); ++i) visit(i, results[i], froms[i], outs[i]);
    if (visited) visited();
  }

  // Lookup of a chain (at most kMaxBatch keys are looked at): the leading units held and not
  // past their TTL, in whichever tier (an expired one is removed and is a miss, reason
  // kExpired, as a Get would find it). With an admission policy that
  // counts references (second-hit: AdmissionPolicy::OnLookup), a client's Lookup counts one
  // for each key from the first miss to the end of the chain (the keys the engine recomputes
  // and puts); the hits before it count when they are read (Get, GetWithTtl, GetBatch,
  // GetBatchVisit count each key, hit or miss; Peek and Prefetch do not).
  virtual LookupResult Lookup(std::span<const Key> chain) = 0;
  // Lookup for internal checks (the cluster's per-key look-ups after a chain's Lookup, repair
  // and refetch checks): the same answer, but no reference is counted for the admission
  // policy, since none of them is a client's. The default (test doubles) is Lookup.
  virtual LookupResult Probe(std::span<const Key> chain) { return Lookup(chain); }

  // A new request: a fresh id and the clock's time now. Pass it to the Put and GetBatch calls
  // of one native batch, or of one engine turn (LOOKUP, GET, PUT). Never returns id 0 from a
  // real tier manager; the default (test doubles) returns {0, 0}.
  virtual RequestTag BeginRequest() { return {}; }

  // Promotes the keys to DRAM ahead of a read. Missing keys are skipped.
  virtual Status Prefetch(std::span<const Key> keys) = 0;

  virtual Status Pin(std::span<const Key> keys, uint64_t lease_ms) = 0;
  virtual Status Unpin(std::span<const Key> keys) = 0;

  // NotFound if absent (a unit past its TTL is absent, and removed all the same; a unit the
  // SSD tier evicted, also from every other tier, is absent;
  // its index delete is then committed as a Delete's, so it never comes back after a power
  // failure). IOError: the removal is done in memory but its commit failed (kSync; the index
  // delete is retried at the next commit).
  virtual Status Delete(const Key& key) = 0;
  // Delete without waiting for its commit, so that one commit covers many deletes (and puts):
  // removes the unit as Delete does and fills *deferred, whatever it returns (OK, or NotFound
  // when absent: an index delete may still have to be committed). The delete is durable, and
  // may be acknowledged, only once CompletePut(*deferred) returned OK. The default (test
  // doubles) runs Delete and leaves nothing to complete.
  virtual Status DeleteDeferred(const Key& key, DeferredCommit* deferred) {
    *deferred = DeferredCommit{};
    return Delete(key);
  }
  // Removes every unit of the tenant from every tier and index (under kSync: one commit for
  // all of them before it returns). IOError as for Delete. The error of a failed SSD index
  // load (Stats::ssd_index_load_failed; nothing deleted: the units cannot all be found).
  virtual Status DeleteTenant(TenantId tenant) = 0;
  // Sets the per-tenant byte quota (0: unlimited): the value bytes of the tenant's units
  // (Stats::tenant_bytes). A put that would take the tenant past it is Rejected. A unit whose
  // TTL has passed counts until something expires it: a read of it, its eviction, or a put of
  // the tenant that the quota would refuse, which first expires the tenant's units whose TTL
  // has passed (soonest first, at most kQuotaReclaimUnitsMax of them per put; such a put is
  // refused only if it is still over the quota afterwards, and the next one goes on).
  virtual void SetTenantQuota(TenantId tenant, uint64_t quota_bytes) = 0;

  // Switches the eviction / admission policy at run time. A policy whose name and parameters
  // (those reaching it: policies::SameParamsFor) are unchanged is kept as it is, state and
  // order. A changed eviction policy is told of each tier's units again, the memory tiers' in
  // the order of their last insert or hit, the SSD tier's by last access; a changed admission
  // policy takes over what applies of the old one's state (AdmissionPolicy::CarryOver).
  // InvalidArgument for an unknown name or parameter (nothing changes).
  virtual Status SetPolicy(const std::string& eviction, const std::string& admission,
                           const policies::PolicyParams& params) = 0;

  virtual Stats GetStats() const = 0;

  // Lists the next units held in any tier (unexpired, not in the middle of a put), at most
  // units_max of them (1..kMaxBatch), into *out (cleared first), and advances *cursor; sets
  // cursor->done at the end. Each call holds the manager's lock for one page only, so
  // requests run between pages. Units put or removed during a scan may or may not be
  // listed. The default (test doubles) lists nothing.
  virtual void ListUnits(UnitCursor* cursor, size_t units_max, std::vector<UnitInfo>* out) {
    (void)units_max;
    out->clear();
    cursor->done = true;
  }

  // One unit as ListUnits would list it, from the tiers' metadata alone: no value is read,
  // no hit or miss counted, nothing promoted (an operator's "where is this unit", kvtierd's
  // GET /v1/unit). False when no tier holds it unexpired. The default (test doubles) finds
  // nothing.
  virtual bool Describe(const Key& key, UnitInfo* info) {
    (void)key;
    (void)info;
    return false;
  }

  // Called with each unit a read (Get, GetBatch, Peek, Prefetch) found corrupt on SSD and
  // quarantined, described as ListUnits would (tier kSsd, ttl_left_ms from its record; the
  // value is gone): what a copy from another replica needs (the cluster refetches it,
  // cache_daemon/cluster_refetch.h). Called on the reading thread, outside the manager's
  // lock, so it may call the manager; it must be quick. Replaces the previous listener;
  // nullptr removes it. The default (test doubles) ignores it.
  virtual void SetChecksumFailureListener(std::function<void(const UnitInfo&)> listener) {
    (void)listener;
  }

  // Makes everything acknowledged so far durable (whatever the durability mode).
  virtual Status Flush() = 0;

  // The SSD log's end: every record appended to the SSD tier before this call lies before it
  // (a caller that logged something before its put can later tell, from this position, which
  // records may hold puts logged after it). nullopt without an SSD tier (and in test doubles).
  virtual std::optional<LogPosition> SsdLogEnd() { return std::nullopt; }
  // Calls visit, in log order, for every whole record (header and payload checksums valid)
  // of the SSD log from `from` up to the log's end at the call, with its decoded value: the
  // units stored there, also versions since replaced, deleted or evicted (a record outlives
  // its unit until its segment is cleaned). Commits first, so every record appended before
  // the call is on the device. Reads outside the tier's locks; meant for a start-up pass
  // before the caller serves (a record relocated by the cleaner meanwhile is visited at its
  // old or its new place). Each segment's walk stops at its first invalid or unreadable
  // record (as the recovery tail scan does). IOError: the commit failed (nothing visited).
  // Without an SSD tier (and in test doubles): OK, nothing visited.
  virtual Status ReplaySsdLog(const LogPosition& from, const LogRecordVisitor& visit) {
    (void)from;
    (void)visit;
    return Status::Ok();
  }
};

}  // namespace kvtier::storage
