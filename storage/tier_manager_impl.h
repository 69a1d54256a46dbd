// TierManagerImpl: the TierManager of tier_manager.h, declared here for its three source
// files (one concern each):
//   tier_manager.cc        construction, placement, demotion and write-back, Put;
//   tier_manager_read.cc   Get, GetBatch and promotion, Lookup, Prefetch, ListUnits, Describe;
//   tier_manager_admin.cc  pins, Delete, DeleteTenant, policy switch, stats.
// Internal to kvtier_storage: include only from those files.
//
// Concurrency design: one mutation lock (mu_) serialises everything that moves or changes
// units (Put, Delete, demotion, promotion, pins, policy switch); reads (Get, Lookup) take only
// the tiers' internal locks (and, when the admission policy counts lookups, admission_mu_:
// see CountReferences). Units move so that a concurrent reader never misses a unit that
// is present: demotion writes the lower tier before removing the upper copy, a put writes its
// new tier before removing stale copies, promotion copies (the SSD copy stays: inclusive).
//
// Durable writes (the contract in tier_manager.h): a put that goes to SSD (highest_tier ssd,
// or written through under kBatched / kSync) runs in three steps: (1) under mu_: quota,
// version, the key is marked as being written (writing_); (2) without mu_: the SSD put and,
// under kSync, the wait for its commit, so concurrent writers share one commit; (3) under
// mu_: memory placement, stale copies, accounting, unmark. While a key is marked, other
// writers of that key (Put, Delete) wait for it, and demotion, write-back and promotion
// leave it alone (they would move an older version past the newer one in flight). Deletes
// remove under mu_ and wait for their commit without it. DeleteTenant first waits until no
// put of the tenant is in step (2) and holds new ones back meanwhile.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>

#include "common/logging.h"
#include "storage/block_device.h"
#include "storage/key_util.h"
#include "storage/memory_tier.h"
#include "storage/ssd_tier.h"
#include "storage/tier_manager.h"

namespace kvtier::storage::internal {

// Remembers why recent keys left the cache, bounded (oldest forgotten first).
class MissMemory {
 public:
  explicit MissMemory(size_t capacity) : capacity_(std::max<size_t>(capacity, 1)) {}
  void Remember(const Key& k, MissReason r) {
    std::lock_guard lock(mu_);
    auto [it, inserted] = reasons_.insert_or_assign(k, r);
    if (inserted) order_.push_back(k);
    while (reasons_.size() > capacity_ && !order_.empty()) {
      reasons_.erase(order_.front());
      order_.pop_front();
    }
    // Keys forgotten via Forget leave stale entries in order_; keep it bounded too.
    while (order_.size() > 2 * capacity_) order_.pop_front();
  }
  void Forget(const Key& k) {
    std::lock_guard lock(mu_);
    reasons_.erase(k);
  }
  MissReason Reason(const Key& k) const {
    std::lock_guard lock(mu_);
    auto it = reasons_.find(k);
    return it == reasons_.end() ? MissReason::kNeverStored : it->second;
  }

 private:
  size_t capacity_;
  mutable std::mutex mu_;
  std::unordered_map<Key, MissReason, KeyHash> reasons_;
  std::deque<Key> order_;
};

struct DirEntry {
  TenantId tenant = 0;
  uint64_t bytes = 0;
  // When the unit expires (options clock ms, as MemMeta::expires_ms); 0: never. Where the
  // unit sits in its tenant's expiry index (TierManagerImpl::expiring_).
  uint64_t expires_ms = 0;
};

class TierManagerImpl final : public TierManager {
 public:
  explicit TierManagerImpl(const TierManagerOptions& o)
      : o_(o),
        clock_(o.clock != nullptr ? o.clock : &DefaultSteadyClock()),
        misses_(o.miss_memory_entries) {}

  Status Init();

  Status Put(const Key& key, std::span<const uint8_t> value, const PutOptions& options) override;
  Status CompletePut(const DeferredCommit& deferred) override;
  Status Get(const Key& key, std::vector<uint8_t>* out, Tier* from) override {
    const RequestTag request = BeginRequest();
    CountReferences(std::span<const Key>(&key, 1), request.now_us);
    return GetImpl(key, out, from, ReadMode::kGet, request);
  }
  Status Peek(const Key& key, std::vector<uint8_t>* out, UnitInfo* info) override {
    return GetImpl(key, out, nullptr, ReadMode::kPeek, RequestTag{}, nullptr, info);
  }
  Status GetWithTtl(const Key& key, std::vector<uint8_t>* out, uint64_t* ttl_left_ms) override {
    const RequestTag request = BeginRequest();
    CountReferences(std::span<const Key>(&key, 1), request.now_us);
    return GetImpl(key, out, nullptr, ReadMode::kGet, request, ttl_left_ms);
  }
  void GetBatch(std::span<const Key> keys, std::vector<std::vector<uint8_t>>* outs,
                std::vector<Tier>* froms, std::vector<Status>* results,
                const RequestTag& request) override;
  void GetBatchVisit(std::span<const Key> keys, const BatchVisitor& visit,
                     const RequestTag& request, const std::function<void()>& visited) override;
  RequestTag BeginRequest() override {
    return RequestTag{next_request_.fetch_add(1, std::memory_order_relaxed) + 1, clock_->NowUs()};
  }
  LookupResult Lookup(std::span<const Key> chain) override { return LookupImpl(chain, true); }
  LookupResult Probe(std::span<const Key> chain) override { return LookupImpl(chain, false); }
  Status Prefetch(std::span<const Key> keys) override;
  Status Pin(std::span<const Key> keys, uint64_t lease_ms) override;
  Status Unpin(std::span<const Key> keys) override;
  Status Delete(const Key& key) override;
  Status DeleteDeferred(const Key& key, DeferredCommit* deferred) override;
  Status DeleteTenant(TenantId tenant) override;
  void SetTenantQuota(TenantId tenant, uint64_t quota_bytes) override {
    std::lock_guard lock(mu_);
    if (quota_bytes == 0) {
      quotas_.erase(tenant);
    } else {
      quotas_[tenant] = quota_bytes;
    }
  }
  Status SetPolicy(const std::string& eviction, const std::string& admission,
                   const policies::PolicyParams& params) override;
  Stats GetStats() const override;
  void ListUnits(UnitCursor* cursor, size_t units_max, std::vector<UnitInfo>* out) override;
  bool Describe(const Key& key, UnitInfo* info) override;
  void SetChecksumFailureListener(std::function<void(const UnitInfo&)> listener) override {
    std::lock_guard lock(listener_mu_);
    on_checksum_failure_ = std::move(listener);
  }
  // Tells the listener (if any) about a unit quarantined for a checksum failure; sm is its
  // record's meta. Not under mu_.
  void ReportChecksumFailure(const Key& key, const SsdMeta& sm) {
    std::function<void(const UnitInfo&)> listener;
    {
      std::lock_guard lock(listener_mu_);
      listener = on_checksum_failure_;
    }
    if (!listener) return;
    UnitInfo u;
    u.key = key;
    u.tenant = sm.tenant;
    u.bytes = sm.raw_bytes;
    u.kind = sm.kind;
    std::memcpy(u.parent.data(), &sm.parent_id, sizeof(sm.parent_id));
    u.recompute_tokens = sm.recompute_tokens;
    const uint64_t expires_ms = FromUnix(sm.expires_unix_ms);
    if (!TtlLeftMs(expires_ms, &u.ttl_left_ms)) return;  // expired: nothing worth refetching
    u.tier = Tier::kSsd;
    u.allow_ssd = true;
    listener(u);
  }
  Status Flush() override {
    if (ssd_ == nullptr) return Status::Ok();
    Status written_back;
    {
      std::lock_guard lock(mu_);
      written_back = WriteBackLocked();
    }
    Status flushed = ssd_->Flush();
    return written_back.ok() ? flushed : written_back;
  }
  std::optional<LogPosition> SsdLogEnd() override {
    if (ssd_ == nullptr) return std::nullopt;
    return ssd_->LogEnd();
  }
  Status ReplaySsdLog(const LogPosition& from, const LogRecordVisitor& visit) override {
    if (ssd_ == nullptr) return Status::Ok();
    return ssd_->Replay(from, visit);
  }

 private:
  // Memory tiers in placement order (HBM first), null when disabled.
  MemoryTier* MemTier(Tier t) const {
    return t == Tier::kHbm ? hbm_.get() : t == Tier::kDram ? dram_.get() : nullptr;
  }
  uint64_t NowMs() const { return clock_->NowMs(); }
  // a + b, or UINT64_MAX where that overflows: an expiry past the clock's range stays the
  // farthest one instead of wrapping into the past (a client's ttl_ms is any u64).
  static uint64_t AddSaturating(uint64_t a, uint64_t b) {
    return b > std::numeric_limits<uint64_t>::max() - a ? std::numeric_limits<uint64_t>::max()
                                                        : a + b;
  }
  // Expiry conversions between the options clock (memory tiers) and unix ms (SSD, persisted).
  uint64_t ToUnix(uint64_t expires_ms) const {
    if (expires_ms == 0) return 0;
    uint64_t now = NowMs();
    uint64_t left = expires_ms > now ? expires_ms - now : 0;
    return AddSaturating(DefaultSystemClock().NowMs(), left);
  }
  uint64_t FromUnix(uint64_t expires_unix_ms) const {
    if (expires_unix_ms == 0) return 0;
    uint64_t now_unix = DefaultSystemClock().NowMs();
    uint64_t left = expires_unix_ms > now_unix ? expires_unix_ms - now_unix : 0;
    return AddSaturating(NowMs(), std::max<uint64_t>(left, 1));
  }
  bool Expired(uint64_t expires_ms) const { return expires_ms != 0 && NowMs() >= expires_ms; }
  // The time a unit expiring at expires_ms has left (0: it never expires), from one reading
  // of the clock; false when it has expired. Two readings (Expired, then NowMs) could straddle
  // the expiry and give 0, which a copy of the unit reads as "never expires".
  bool TtlLeftMs(uint64_t expires_ms, uint64_t* left_ms) const {
    *left_ms = 0;
    if (expires_ms == 0) return true;
    const uint64_t now = NowMs();
    if (now >= expires_ms) return false;
    *left_ms = expires_ms - now;
    return true;
  }
  bool ExpiredUnix(uint64_t expires_unix_ms) const {
    return expires_unix_ms != 0 && DefaultSystemClock().NowMs() >= expires_unix_ms;
  }
  static SsdMeta ToSsd(const MemMeta& m, uint64_t expires_unix_ms) {
    SsdMeta s;
    s.tenant = m.tenant;
    s.version = m.version;
    s.kind = m.kind;
    s.expires_unix_ms = expires_unix_ms;
    s.parent_id = m.parent_id;
    s.recompute_tokens = m.recompute_tokens;
    return s;
  }
  policies::ObjectInfo InfoOf(const Key& k, const MemMeta& m) const {
    policies::ObjectInfo info;
    info.id = ObjectIdOf(k);
    info.size_bytes = m.size_bytes;
    info.parent_id = m.parent_id;
    info.recompute_tokens = m.recompute_tokens;
    info.kind = m.kind;
    return info;
  }

  // Tells the admission policy of one reference to each key (AdmissionPolicy::OnLookup), when
  // it counts references; otherwise returns at once, taking no lock. Not under mu_ (a reader
  // must not wait for a writer's work under mu_): under admission_mu_ alone, held for the
  // keys' OnLookup calls only (at most kMaxBatch of them, each O(1)).
  void CountReferences(std::span<const Key> keys, uint64_t now_us) {
    if (keys.empty() || !counts_lookups_.load(std::memory_order_relaxed)) return;
    std::lock_guard lock(admission_mu_);
    for (const Key& k : keys) admission_->OnLookup(ObjectIdOf(k), now_us);
  }
  // Admission of a demotion or SSD put (under mu_; takes admission_mu_ for the call).
  bool AdmitLocked(const policies::ObjectInfo& info) {
    std::lock_guard lock(admission_mu_);
    return admission_->Admit(info, clock_->NowUs());
  }
  // Lookup and Probe: count_references says whether the keys from the first miss on are
  // counted for the admission policy (CountReferences).
  LookupResult LookupImpl(std::span<const Key> chain, bool count_references);

  // How a read behaves: a client's Get (counted, promotes when the lock is free), a
  // Prefetch (waits for the lock to promote) or a Peek (neither counts nor promotes).
  enum class ReadMode { kGet, kPrefetch, kPeek };
  // ttl_left_ms (may be null): the unit's remaining TTL on a hit (0: none). info (may be
  // null): the version read, described as ListUnits would (Peek's contract).
  Status GetImpl(const Key& key, std::vector<uint8_t>* out, Tier* from, ReadMode mode,
                 const RequestTag& request, uint64_t* ttl_left_ms = nullptr,
                 UnitInfo* info = nullptr);
  // The body of GetBatch and GetBatchVisit (at most kMaxBatch keys): visit(i, ...) for each
  // key in order, as GetBatchVisit's contract says. A value read by GetImpl (a memory-tier
  // hit, or a re-read) is written to *slot(i) and viewed there.
  // visited: GetBatchVisit's (null from GetBatch).
  void GetBatchImpl(std::span<const Key> keys, const RequestTag& request,
                    const std::function<std::vector<uint8_t>*(size_t)>& slot,
                    const BatchVisitor& visit, const std::function<void()>& visited = nullptr);
  void CountMiss(MissReason r) {
    switch (r) {
      case MissReason::kEvicted:
        misses_evicted_.fetch_add(1);
        break;
      case MissReason::kExpired:
        misses_expired_.fetch_add(1);
        break;
      case MissReason::kChecksumFailure:
        misses_checksum_.fetch_add(1);
        break;
      case MissReason::kIoError:
        misses_io_error_.fetch_add(1);
        break;
      default:
        misses_never_stored_.fetch_add(1);
    }
  }
  // Where the key is now (fastest tier), kNone if absent; *expired (when not null) when present
  // but past TTL, in any tier.
  // *bytes (when not null): the value's bytes where it was found.
  Tier Locate(const Key& key, bool* expired, uint64_t* bytes = nullptr) const;

  // ---- under mu_ ----
  // `request`: the policy calls' request (RequestTag); null for none (Flush's write-back).
  Status PlaceLocked(const RequestTag* request, Tier tier, const Key& key,
                     std::span<const uint8_t> value, const MemMeta& meta);
  void DemoteLocked(const RequestTag* request, Tier tier, const Key& victim);
  // Copies every unexpired memory-tier unit that may reach SSD (allow_ssd) and whose current
  // version the SSD does not hold yet to the SSD tier, keeping the memory copy (inclusive).
  // Flush uses it so that a graceful shutdown loses nothing acknowledged. It bypasses the
  // admission policy: Flush's contract is durability for everything acknowledged.
  Status WriteBackLocked();
  // Removes the key from every tier; *ticket (when not null) becomes the SSD commit ticket
  // of the removal (0: nothing removed from SSD), to pass to ssd_->WaitDurable without mu_.
  // A key the SSD tier evicted by an index delete not synced yet gets a delete that syncs
  // (SsdTier::Remove): a power failure never brings back a unit this removed.
  void RemoveEverywhereLocked(const Key& key, uint64_t* ticket = nullptr);
  // Waits (releasing mu_ meanwhile) until no put of the key is in its SSD step, and, when
  // tenant is given, until no tenant delete of it is waiting.
  void WaitForKeyLocked(std::unique_lock<std::mutex>& lock, const Key& key,
                        const TenantId* tenant) {
    key_cv_.wait(lock, [&] {
      return !writing_.count(key) && (tenant == nullptr || !tenant_deletes_.count(*tenant));
    });
  }
  bool WritingLocked(const Key& key) const { return writing_.count(key) != 0; }
  // The end of a put (step 3, or the whole put when it does not go to SSD): removes stale
  // copies of other versions, accounts. *stale_ticket: an SSD removal to wait for.
  void FinishPutLocked(const Key& key, const MemMeta& meta, uint64_t* stale_ticket);
  // Waits for an SSD commit ticket (kSync: commits; otherwise returns at once). No mu_ held.
  Status WaitDurable(uint64_t ticket) {
    if (ssd_ == nullptr || ticket == 0) return Status::Ok();
    return ssd_->WaitDurable(ticket);
  }
  // An expired unit leaves every tier; while a put of the key is in flight only the memory
  // copies go (they are older; the SSD may already hold the new version).
  void ExpireLocked(const Key& key) {
    if (WritingLocked(key)) {
      if (hbm_) (void)hbm_->Remove(key);
      if (dram_) (void)dram_->Remove(key);
      return;
    }
    RemoveEverywhereLocked(key);
    DroppedLocked(key, MissReason::kExpired);
  }
  // The unit left the cache (all tiers) for reason r: forget it in the directory.
  void DroppedLocked(const Key& key, MissReason r);
  // Directory entries that expire are kept in their tenant's expiry index as well (expiring_):
  // IndexExpiryLocked after an entry is added or changed, UnindexExpiryLocked before it is
  // changed or erased, so that the index holds exactly the directory's expiring entries.
  void IndexExpiryLocked(const Key& key, const DirEntry& e) {
    // UINT64_MAX: a TTL past the clock's range, which never expires (PutOptions::ttl_ms).
    if (e.expires_ms != 0 && e.expires_ms != UINT64_MAX) {
      expiring_[e.tenant].emplace(e.expires_ms, key);
    }
  }
  void UnindexExpiryLocked(const Key& key, const DirEntry& e) {
    if (e.expires_ms == 0) return;
    auto t = expiring_.find(e.tenant);
    if (t == expiring_.end()) return;
    t->second.erase({e.expires_ms, key});
    if (t->second.empty()) expiring_.erase(t);
  }
  // A put of `tenant` that its quota refuses calls this first: the tenant's units whose TTL
  // has passed (by its expiry index, soonest first) leave every tier, as a read would expire
  // them, and stop counting against the quota. Examines at most kQuotaReclaimUnitsMax index
  // entries per call. An entry whose unit a tier still holds unexpired (the SSD keeps expiry
  // in unix time: the two clocks may disagree by a little) moves to that expiry instead, and
  // a unit with a put in flight is left to that put (which replaces its entry); so every other
  // examined entry leaves the due part of the index, and successive calls make progress.
  void ReclaimExpiredLocked(TenantId tenant);
  // The expiry (options clock ms; 0: never) of the unit as the fastest tier holding it has
  // it; 0 too when no tier holds it.
  uint64_t TierExpiryLocked(const Key& key) const;
  bool PresentAnywhereLocked(const Key& key) const;
  // Present in some tier and unexpired (PutOptions::if_absent).
  bool LiveLocked(const Key& key) const;
  void ExpirePinsLocked();
  bool PinnedLocked(const Key& key) const { return pins_.count(key) != 0; }
  void SetTrackedEverywhereLocked(const Key& key, bool tracked) {
    if (hbm_) hbm_->SetTracked(key, tracked);
    if (dram_) dram_->SetTracked(key, tracked);
    if (ssd_) ssd_->SetTracked(key, tracked);
  }
  void PromoteLocked(const RequestTag& request, const Key& key, std::span<const uint8_t> value,
                     const SsdMeta& meta);
  // ListUnits' entry for key (its directory entry): false when no tier holds it unexpired.
  bool DescribeLocked(const Key& key, const DirEntry& entry, UnitInfo* u) const;

  // Adds units reported by the SSD index load to the directory (if still present there),
  // and forgets units the SSD tier lost to a failed write (miss reason io_error).
  void DrainLoadedLocked() {
    if (closing_ || ssd_ == nullptr) return;
    std::vector<Loaded> batch;
    std::vector<Key> lost;
    {
      std::lock_guard q(load_q_mu_);
      batch.swap(load_q_);
      lost.swap(lost_q_);
    }
    for (const Key& k : lost) DroppedLocked(k, MissReason::kIoError);
    for (const Loaded& l : batch) {
      uint64_t v = 0;
      if (dir_.count(l.key) || !ssd_->Contains(l.key, &v) || v != l.version) continue;
      const DirEntry e{l.tenant, l.bytes, FromUnix(l.expires_unix_ms)};
      dir_[l.key] = e;
      IndexExpiryLocked(l.key, e);
      tenant_bytes_[l.tenant] += l.bytes;
    }
  }

 public:
  ~TierManagerImpl() override {
    {
      std::lock_guard lock(mu_);
      closing_ = true;
    }
    ssd_.reset();  // joins the SSD index load before the members it reports to go away
  }

 private:
  TierManagerOptions o_;
  const Clock* clock_;
  std::unique_ptr<MemoryTier> hbm_, dram_;
  std::unique_ptr<SsdTier> ssd_;
  MissMemory misses_;

  std::mutex listener_mu_;  // guards on_checksum_failure_ only
  std::function<void(const UnitInfo&)> on_checksum_failure_;
  mutable std::mutex mu_;
  // The admission policy. Locking contract: the pointer is replaced (SetPolicy) only under
  // both mu_ and admission_mu_, and every call into the policy holds admission_mu_: writers
  // (Admit, CarryOver, Budget) under mu_ as well, readers (OnLookup, CountReferences) without
  // mu_. Lock order: mu_, then admission_mu_; nothing else is taken under admission_mu_, and it
  // is held for policy calls only (each O(1), but CarryOver at a policy switch, which copies at
  // most second-hit's max_tracked counts). So a reader that counts waits at most for a policy
  // call, never for a writer's work under mu_ (placement, demotions, Flush's write-back), and
  // a policy's state is never touched by two threads at once (policies are not thread-safe).
  // counts_lookups_ caches admission_->CountsLookups(), written under both locks: a reader that
  // reads false takes no lock at all (a reference racing a switch to a counting policy may go
  // uncounted, as one just before the switch would).
  mutable std::mutex admission_mu_;
  std::unique_ptr<policies::AdmissionPolicy> admission_;
  std::atomic<bool> counts_lookups_{false};
  std::unordered_map<Key, DirEntry, KeyHash> dir_;
  // Per tenant, its directory entries that expire, as (expires_ms, key), soonest first: what
  // a put over its quota reclaims (ReclaimExpiredLocked). One entry per unit with a TTL
  // (about 80 bytes of heap each), so bounded as dir_ is, by the tiers' object limits.
  std::unordered_map<TenantId, std::set<std::pair<uint64_t, Key>>> expiring_;
  std::unordered_map<TenantId, uint64_t> tenant_bytes_;
  std::unordered_map<TenantId, uint64_t> quotas_;
  std::unordered_map<Key, uint64_t, KeyHash> pins_;  // key -> lease expiry (clock ms)
  std::set<std::pair<uint64_t, Key>> pin_expiry_;
  uint64_t version_ = 0;
  uint64_t admissions_ = 0, admission_rejections_ = 0;
  bool closing_ = false;
  struct Loaded {
    Key key;
    TenantId tenant;
    uint64_t version;
    uint64_t bytes;
    uint64_t expires_unix_ms;  // SsdMeta's; 0: never
  };
  std::mutex load_q_mu_;        // after mu_ in lock order; taken alone by the SSD load thread
  std::vector<Loaded> load_q_;  // bounded by the number of indexed units
  std::vector<Key> lost_q_;     // under load_q_mu_; bounded by kLostQueueMax
  static constexpr size_t kLostQueueMax = 1 << 16;
  // Keys whose put is in its SSD step (-> tenant), and tenants with a DeleteTenant waiting
  // for those to finish (-> number of waiting calls). Under mu_; key_cv_ signals changes.
  std::unordered_map<Key, TenantId, KeyHash> writing_;
  std::unordered_map<TenantId, int> tenant_deletes_;
  std::condition_variable key_cv_;
  std::atomic<uint64_t> next_request_{0};  // BeginRequest's ids
  std::atomic<uint64_t> misses_never_stored_{0}, misses_evicted_{0}, misses_expired_{0},
      misses_checksum_{0}, misses_io_error_{0}, io_errors_{0};
};

}  // namespace kvtier::storage::internal
