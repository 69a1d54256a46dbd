// Service: the daemon's operations, independent of the front end (native, RESP, HTTP).
//
// Every key a client sends is bound to the authenticated tenant here, before the store sees
// it: storage_key = StorageKey(tenant.salt, chain) (DESIGN §3). RESP keys (arbitrary byte
// strings) first become a chain digest SHA256("kvtier.resp.v1" field-encoded || key). A client
// therefore can only ever address its own tenant's units, whatever bytes it sends.
//
// RESP hot path: a connection may pass a RespKeyCache (its own, bounded) so a repeated key
// skips both SHA-256; RespGetRaw hands the stored bytes back in a caller-owned vector (reused
// across calls) with the payload as a span into it, so a GET reply can be written straight
// from it.
//
// Thread safety: every method may be called concurrently (the TierManager is thread-safe;
// the policy and RESP key bookkeeping have their own mutexes). A RespKeyCache is not
// thread-safe: one per connection.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cache_daemon/config.h"
#include "cache_daemon/metrics.h"
#include "cache_daemon/resp_commands.h"
#include "cache_daemon/resp_key_index.h"
#include "cache_daemon/tenants.h"
#include "cache_daemon/trace_writer.h"
#include "cache_daemon/wire.h"
#include "storage/tier_manager.h"

namespace kvtier::cluster {
class PauseGuard;
class Router;
}  // namespace kvtier::cluster

namespace kvtier::daemon {
class ClusterCopies;

// RESP values are stored in an envelope (docs/format/wire.md): u8 kRespEnvelopeTag, u64 LE
// absolute expiry in Unix ms (0: none), then the payload; or u8 kRespNamedEnvelopeTag, the
// expiry, u32 LE name length n, the key's name (n bytes), then the payload. The expiry lets TTL
// answer without a side index; the name rides with the unit so that one sync makes both
// durable (docs/RESP.md "Names across restarts"). SET writes the named form for names of up
// to kRespCarriedNameBytesMax bytes; both are read.
inline constexpr uint8_t kRespEnvelopeTag = 0xB1;
inline constexpr size_t kRespEnvelopeBytes = 9;
inline constexpr uint8_t kRespNamedEnvelopeTag = 0xB2;
inline constexpr size_t kRespNamedEnvelopeBytes = 13;  // besides the name
inline constexpr size_t kRespCarriedNameBytesMax = 4096;
// Parses a stored RESP value: *expire_at_ms, the payload's offset (*payload_at) and, for the
// named form, the name (*name, may be null; empty for the unnamed form). False: not a RESP
// envelope (wrong tag, or shorter than its header and name).
bool DecodeRespEnvelope(std::span<const uint8_t> v, uint64_t* expire_at_ms, size_t* payload_at,
                        std::string_view* name = nullptr);
// Keys named in the RespKeyIndex per tenant (beyond this SCAN/KEYS/DBSIZE miss keys).
inline constexpr size_t kRespTrackedKeysMax = 1u << 20;
// Stripes of the lock that orders the read-modify-write RESP commands of one key.
inline constexpr size_t kRespKeyLockStripes = 256;

// A per-connection memo of Service::BindResp: (tenant salt, RESP key) -> storage key, direct
// mapped, kSlots entries, keys up to kKeyBytesMax bytes (longer keys are not cached), so at
// most about kSlots * (kKeyBytesMax + 100) bytes per connection, allocated on first use. An
// entry matches only when both the full salt and the full key bytes are equal, so it returns
// exactly what BindResp would compute: one tenant can never be served another tenant's key
// (their salts differ), and re-authenticating as another tenant needs no invalidation.
class RespKeyCache {
 public:
  static constexpr size_t kSlots = 256;
  static constexpr size_t kKeyBytesMax = 128;

  // The cached storage key, or nullptr.
  const storage::Key* Find(const Digest& salt, std::string_view key) const;
  void Insert(const Digest& salt, std::string_view key, const storage::Key& value);
  uint64_t hits() const { return hits_; }

 private:
  struct Slot {
    bool used = false;
    Digest salt{};
    storage::Key value{};
    std::string key;
  };
  static size_t SlotOf(const Digest& salt, std::string_view key);

  std::unique_ptr<Slot[]> slots_;
  mutable uint64_t hits_ = 0;
};

struct PutItem {
  wire::Key chain{};
  wire::Key parent_chain{};
  std::span<const uint8_t> value;
};

// A plain RESP SET taken apart (Service::RespSetStage / RespSetPut / RespSetComplete), so
// that one name-log sync and one SSD commit serve many SETs (resp_durable_sets.h).
struct RespSetJob {
  const Tenant* tenant = nullptr;
  storage::Key key{};
  std::string name;      // the RESP key
  std::string envelope;  // the stored value (kRespEnvelopeTag envelope)
  uint64_t ttl_ms = 0;
  uint64_t value_bytes = 0;  // payload bytes (trace)
  uint64_t name_seq = 0;     // RespKeyIndex::WaitDurable before the put (0: name carried)
  uint64_t renamed_seq = 0;  // the same, for a name logged again after the put
  bool indexed = false;
  storage::DeferredCommit commit;
};

class Service {
 public:
  // resp_key_index_bytes_max bounds the RespKeyIndex (limits.resp_key_index_bytes_max).
  Service(storage::TierManager* store, const TenantRegistry* tenants, DaemonMetrics* metrics,
          TraceWriter* trace, PolicySettings policy,
          uint64_t resp_key_index_bytes_max = 256ull << 20);

  // Cluster mode (docs/CLUSTER.md): the native LOOKUP, GET, PUT, DELETE and tenant deletes
  // go through router (cluster/router.h) beyond the local store; RESP stays per node. Call
  // once before serving; router must outlive the Service. Null (the default): one node.
  void SetRouter(cluster::Router* router) { router_ = router; }
  // With SetRouter: units a GET fetched from peers are kept as copies (cluster_copies.h)
  // and served locally; PUT and DELETE drop them. Null (the default): no copies.
  void SetClusterCopies(ClusterCopies* copies) { copies_ = copies; }
  // With SetRouter: after a pause of this process (cluster/pause_guard.h) the store may hold
  // units deleted meanwhile until the deletes that timed out on it are applied; while the
  // guard holds, a LOOKUP and a GET of this node's clients count and read nothing from the
  // local store and ask the keys' other owners instead (docs/CLUSTER.md, "Tombstones").
  // Null (the default): the local store is always read.
  void SetPauseGuard(const cluster::PauseGuard* guard) { pause_guard_ = guard; }
  // The local part of DeleteTenant, for a peer's request (no forwarding).
  Status DeleteTenantLocal(const Tenant& t);

  storage::Key Bind(const Tenant& t, const wire::Key& chain) const;
  // cache may be null (no memo).
  storage::Key BindResp(const Tenant& t, std::string_view key, RespKeyCache* cache = nullptr) const;

  // `request`: the turn's (RequestTag), for the trace only (a lookup touches no policy).
  wire::LookupReply Lookup(const Tenant& t, std::span<const wire::Key> chain, uint32_t unit_tokens,
                           const storage::RequestTag& request = {});
  // One status per unit; a unit whose parent is all zeros has no parent. The batch is one
  // request for the eviction policies: `request` (a native turn's), or a new one when its id
  // is 0 (storage::RequestTag).
  std::vector<StatusCode> Put(const Tenant& t, const wire::PutRequest& args,
                              std::span<const PutItem> items, uint32_t unit_tokens,
                              const storage::RequestTag& request = {});
  // Calls visit(i, status, tier, value) for each key in order; value is valid only during
  // the call. The batch is one request for the policies, as for Put. visited, when set, is
  // called once, after the last visit and before the last batch's promotions into DRAM
  // (TierManager::GetBatchVisit's `visited`), so that the caller can answer before them;
  // the promotions then finish before Get returns.
  void Get(const Tenant& t, std::span<const wire::Key> chain, uint32_t unit_tokens,
           const storage::RequestTag& request,
           const std::function<void(size_t, const Status&, storage::Tier,
                                    std::span<const uint8_t>)>& visit,
           const std::function<void()>& visited = nullptr);
  void Get(const Tenant& t, std::span<const wire::Key> chain, uint32_t unit_tokens,
           const std::function<void(size_t, const Status&, storage::Tier,
                                    std::span<const uint8_t>)>& visit) {
    Get(t, chain, unit_tokens, storage::RequestTag{}, visit);
  }
  Status Prefetch(const Tenant& t, std::span<const wire::Key> chain);
  Status Pin(const Tenant& t, std::span<const wire::Key> chain, uint64_t lease_ms);
  Status Unpin(const Tenant& t, std::span<const wire::Key> chain);
  // Returns how many keys existed and were deleted. *error (may be null) receives the first
  // failure other than NotFound (e.g. a kSync delete whose commit failed).
  uint32_t Delete(const Tenant& t, std::span<const wire::Key> chain, uint32_t unit_tokens,
                  Status* error = nullptr);
  Status DeleteTenant(const Tenant& t);

  // JSON: tiers, misses, tenant bytes (all tenants for admins, else only the caller's).
  std::string StatsJson(const Tenant* t) const;
  std::string PolicyJson() const;
  // JSON: what this node holds of tenant t's unit `chain` (its tier, bytes, kind, TTL left,
  // whether it is a GET copy), from metadata alone (TierManager::Describe: nothing read or
  // counted), and in cluster mode the unit's owners under this node's view (GET /v1/unit).
  std::string UnitJson(const Tenant& t, const wire::Key& chain) const;
  // The same for t's RESP key `name` (any bytes; the JSON names it with U+FFFD for each byte
  // that is not UTF-8), without owners: RESP keys stay on the node they were written to.
  std::string RespUnitJson(const Tenant& t, std::string_view name) const;
  // Body: {"eviction": "...", "admission": "...", "params": {"k": "v"}, "seed": N}; absent
  // fields keep their current value. InvalidArgument for bad JSON, objects or arrays nested
  // more than 16 levels deep (the body is the first), or an unknown policy.
  Status SetPolicyJson(std::string_view json);
  Status SetPolicy(const PolicySettings& p);
  PolicySettings policy() const;

  // ---- RESP ----
  // ttl_ms: 0 none; an expiry past the clock's range is kept as the farthest (never wrapped
  // into the past). The RESP commands refuse those first (resp::RelativeExpiryMs).
  Status RespSet(const Tenant& t, std::string_view key, std::string_view value, uint64_t ttl_ms,
                 RespKeyCache* cache = nullptr);
  // RespSet in three steps (RespSet runs them back to back). RespSetStage binds the key,
  // logs a new name without waiting for its sync and copies the stored envelope into *job
  // (value may change afterwards). RespSetPut, once RespKeyIndex::WaitDurable(job->name_seq)
  // returned OK, puts it without waiting for its SSD commit. RespSetComplete waits for that
  // commit (TierManager::CompletePut: shared with every put pending) and for the name when it
  // had to be logged again; the SET may be acknowledged only when it returned OK. An error
  // from any step ends the SET (later steps must not run).
  Status RespSetStage(const Tenant& t, std::string_view key, std::string_view value,
                      uint64_t ttl_ms, RespKeyCache* cache, RespSetJob* job);
  Status RespSetPut(RespSetJob* job);
  Status RespSetComplete(RespSetJob* job);
  // MSET: a RespSet of each pair of kv (key, value, key, value, ...; an even count, at most
  // the RESP parser's argument limit), with one name-log wait and one SSD commit for all of
  // them: every pair is staged, then put, then completed (the first completion commits them
  // all). OK only when every pair is durable. An error stops it: a failed stage writes
  // nothing; a failed put leaves the pairs before it written (and completed) and the rest
  // unwritten; a failed commit fails every put it covered, whose values are then removed
  // (RespSetComplete, Put's IOError contract). Returns the first error.
  Status RespMset(const Tenant& t, std::span<const std::string_view> kv, RespKeyCache* cache);
  // NotFound on a miss or an expired value.
  Status RespGet(const Tenant& t, std::string_view key, std::string* value);
  // As RespGet, without copying the payload: *raw receives the stored envelope (its capacity
  // is reused) and *value points at the payload inside it, valid until *raw changes.
  Status RespGetRaw(const Tenant& t, std::string_view key, std::vector<uint8_t>* raw,
                    std::span<const uint8_t>* value, RespKeyCache* cache = nullptr);
  bool RespExists(const Tenant& t, std::string_view key);
  // NotFound when absent.
  Status RespDel(const Tenant& t, std::string_view key);
  // DEL / UNLINK of several keys with one SSD commit for all the removals (under sync:
  // TierManager::DeleteDeferred for each, then their completions, the first of which commits
  // them all); *deleted: how many of them existed (a key named twice counts once). OK only
  // when every removal is durable; else the first error (a failed commit: as RespDel's, the
  // keys stay removed in memory and their index deletes are retried at the next commit).
  Status RespDelMany(const Tenant& t, std::span<const std::string_view> keys, int64_t* deleted);
  // RespDelMany's two halves, for a DEL completed asynchronously (RespDurableSets): the
  // removals, made now (in memory, and visible to every reader at once), each leaving the
  // commit it waits for in *commits (one per key, in order); then, later and on any thread,
  // their completion. Stage returns the first error other than NotFound (a removal that could
  // not be made); Complete returns OK only when every removal is durable.
  Status RespDelStage(const Tenant& t, std::span<const std::string_view> keys, int64_t* deleted,
                      std::vector<storage::DeferredCommit>* commits);
  Status RespDelComplete(std::span<const storage::DeferredCommit> commits);
  // SET with options (resp::SetOptions): reads the current value and writes only when the
  // NX/XX condition holds (*written tells), keeping its expiry under KEEPTTL; when o.get,
  // *old receives the previous value (nullopt: none). The read and the write hold a striped
  // per-key lock that RespExpire and every other RespSetIf also hold, and that every plain
  // SET's and DEL's store write takes (RespSetPut, RespDel, RespDelStage), so a write of the
  // key never lands between the read and the write (two SET NX of one key: exactly one
  // writes; an EXPIRE never puts back a value a SET replaced or a DEL removed). The lock is
  // released before the commit wait (docs/RESP.md "Conditional writes").
  Status RespSetIf(const Tenant& t, std::string_view key, std::string_view value,
                   const resp::SetOptions& o, bool* written, std::optional<std::string>* old);
  // Rewrites the value with a new expiry (ttl_ms 0: persist). NotFound when absent.
  Status RespExpire(const Tenant& t, std::string_view key, uint64_t ttl_ms);
  // One SCAN step over the tenant's indexed keys (RespKeyIndex: order, cursor and guarantees):
  // appends to *names (cleared) the keys at positions [cursor, next) for which want(name)
  // holds and that the store still holds (entries of evicted or expired keys are dropped
  // from the index on the way); examines about `count` entries; returns next (0: done).
  // Stops early, as RespKeyIndex::Scan does, once the names examined reach names_bytes_max.
  uint64_t RespScan(const Tenant& t, uint64_t cursor, size_t count,
                    const std::function<bool(std::string_view)>& want,
                    std::vector<std::string>* names,
                    uint64_t names_bytes_max = std::numeric_limits<uint64_t>::max());
  // -2 absent, -1 no expiry, else remaining ms (at most INT64_MAX).
  int64_t RespTtlMs(const Tenant& t, std::string_view key);
  uint64_t RespDbSize(const Tenant& t);
  Status RespFlush(const Tenant& t);

  // Keeps the RESP key names in the log at path across restarts (RespKeyIndex::Persist),
  // with the store's SSD log as the source of the names its records carry (named envelopes
  // whose name binds to the record's key under the record's tenant): sync_adds under
  // durability sync (for names too long to be carried), sync_interval_ms: how often the log
  // is checkpointed and synced. Call once, after the store opened, before serving.
  Status PersistRespNames(const std::string& path, bool sync_adds, uint64_t sync_interval_ms);
  const RespKeyIndex& resp_index() const { return resp_index_; }
  RespKeyIndex& resp_index() { return resp_index_; }
  storage::TierManager* store() const { return store_; }
  const TenantRegistry& tenants() const { return *tenants_; }

 private:
  bool LocalStoreHeld() const;  // SetPauseGuard's guard holds
  // request: the storage request's id (0: none), so a turn's records replay as one request.
  void Trace(const char* op, const Tenant& t, std::span<const storage::Key> keys, uint64_t bytes,
             uint32_t unit_tokens, uint64_t request = 0);
  std::mutex& KeyLock(const storage::Key& k);
  // RespSetPut for a caller that holds KeyLock(job->key).
  Status RespSetPutLocked(RespSetJob* job);
  // RespSet's steps: stage, wait for the name, put, wait for the commit. held: null, or the
  // caller's KeyLock of the key (a conditional command), under which the put is made and
  // which is released before the commit wait (never under the lock, which plain SETs take for
  // their puts: CompletePut's contract).
  Status RespSetImpl(const Tenant& t, std::string_view key, std::string_view value, uint64_t ttl_ms,
                     RespKeyCache* cache, std::unique_lock<std::mutex>* held);
  // The RESP name index at a limit may be full of names whose units the store has since
  // evicted or expired (a name is dropped only when a SCAN meets it), and a new SET's name
  // would then go unindexed: SCAN, KEYS and DBSIZE would miss a key the store holds. Before
  // that, RespSetStage has this check kRespPruneEntries of the tenant's names from a random
  // position and drop the gone ones (as RespScan does, looking again after each removal), and
  // when the name still would not fit, as many of the largest other tenant's (whose gone names
  // may fill the byte limit all tenants share); after a call that dropped none it rests for
  // kRespPruneQuietMs (an index full of live names).
  void PruneRespNames(const Tenant& t, const storage::Key& k, size_t name_bytes);
  // One sample of `tenant`'s names (above); returns how many were dropped.
  size_t PruneRespNamesOf(uint64_t tenant);
  // Drops e's name when the store no longer holds its unit and returns true; false (the name
  // kept, or given back) when the store holds it, also when a SET put it back meanwhile.
  bool DropNameIfGone(uint64_t tenant, const RespKeyIndex::Entry& e);
  static constexpr size_t kRespPruneEntries = 256;
  static constexpr uint64_t kRespPruneQuietMs = 1000;
  std::atomic<uint64_t> resp_prune_quiet_until_ms_{0};

  storage::TierManager* store_;
  cluster::Router* router_ = nullptr;
  ClusterCopies* copies_ = nullptr;
  const cluster::PauseGuard* pause_guard_ = nullptr;
  const TenantRegistry* tenants_;
  DaemonMetrics* metrics_;
  TraceWriter* trace_;
  mutable std::mutex policy_mu_;
  PolicySettings policy_;  // protected by policy_mu_
  RespKeyIndex resp_index_;
  std::array<std::mutex, kRespKeyLockStripes> resp_key_mu_;
};

uint64_t UnixNowMs();
uint64_t KeyId(const storage::Key& k);  // first 8 bytes, little-endian

}  // namespace kvtier::daemon
