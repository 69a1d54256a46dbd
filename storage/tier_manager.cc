// TierManager implementation: placement HBM -> DRAM -> SSD over MemoryTier and SsdTier.
//
// Concurrency design: one mutation lock (mu_) serialises everything that moves or changes
// units (Put, Delete, demotion, promotion, pins, policy switch); reads (Get, Lookup) take only
// the tiers' internal locks. Units move so that a concurrent reader never misses a unit that
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
#include "storage/tier_manager.h"

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>

#include "common/logging.h"
#include "storage/block_device.h"
#include "storage/key_util.h"
#include "storage/memory_tier.h"
#include "storage/ssd_tier.h"

namespace kvtier::storage {

const char* TierName(Tier tier) {
  switch (tier) {
    case Tier::kHbm:
      return "hbm";
    case Tier::kDram:
      return "dram";
    case Tier::kSsd:
      return "ssd";
    case Tier::kNone:
      break;
  }
  return "none";
}

const char* MissReasonName(MissReason reason) {
  switch (reason) {
    case MissReason::kNone:
      return "none";
    case MissReason::kNeverStored:
      return "never_stored";
    case MissReason::kEvicted:
      return "evicted";
    case MissReason::kExpired:
      return "expired";
    case MissReason::kChecksumFailure:
      return "checksum_failure";
    case MissReason::kIoError:
      return "io_error";
  }
  return "unknown";
}

const char* CommitStageName(CommitStage stage) {
  switch (stage) {
    case CommitStage::kNone:
      return "none";
    case CommitStage::kBufferWrite:
      return "buffer_write";
    case CommitStage::kSync:
      return "sync";
    case CommitStage::kIndexWrite:
      return "index_write";
  }
  return "unknown";
}

namespace {

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
    return GetImpl(key, out, from, ReadMode::kGet, request);
  }
  Status Peek(const Key& key, std::vector<uint8_t>* out, Tier* from) override {
    return GetImpl(key, out, from, ReadMode::kPeek, RequestTag{});
  }
  void GetBatch(std::span<const Key> keys, std::vector<std::vector<uint8_t>>* outs,
                std::vector<Tier>* froms, std::vector<Status>* results,
                const RequestTag& request) override;
  void GetBatchVisit(std::span<const Key> keys, const BatchVisitor& visit,
                     const RequestTag& request, const std::function<void()>& visited) override;
  RequestTag BeginRequest() override {
    return RequestTag{next_request_.fetch_add(1, std::memory_order_relaxed) + 1, clock_->NowUs()};
  }
  LookupResult Lookup(std::span<const Key> chain) override;
  Status Prefetch(std::span<const Key> keys) override;
  Status Pin(std::span<const Key> keys, uint64_t lease_ms) override;
  Status Unpin(std::span<const Key> keys) override;
  Status Delete(const Key& key) override;
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
    if (Expired(expires_ms)) return;  // nothing worth refetching
    u.ttl_left_ms = expires_ms == 0 ? 0 : expires_ms - NowMs();
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
  // Expiry conversions between the options clock (memory tiers) and unix ms (SSD, persisted).
  uint64_t ToUnix(uint64_t expires_ms) const {
    if (expires_ms == 0) return 0;
    uint64_t now = NowMs();
    uint64_t left = expires_ms > now ? expires_ms - now : 0;
    return DefaultSystemClock().NowMs() + left;
  }
  uint64_t FromUnix(uint64_t expires_unix_ms) const {
    if (expires_unix_ms == 0) return 0;
    uint64_t now_unix = DefaultSystemClock().NowMs();
    uint64_t left = expires_unix_ms > now_unix ? expires_unix_ms - now_unix : 0;
    return NowMs() + std::max<uint64_t>(left, 1);
  }
  bool Expired(uint64_t expires_ms) const { return expires_ms != 0 && NowMs() >= expires_ms; }
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

  // How a read behaves: a client's Get (counted, promotes when the lock is free), a
  // Prefetch (waits for the lock to promote) or a Peek (neither counts nor promotes).
  enum class ReadMode { kGet, kPrefetch, kPeek };
  Status GetImpl(const Key& key, std::vector<uint8_t>* out, Tier* from, ReadMode mode,
                 const RequestTag& request);
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
  // Where the key is now (fastest tier), kNone if absent; *expired when present but past TTL.
  Tier Locate(const Key& key, bool* expired) const;

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
  bool PresentAnywhereLocked(const Key& key) const;
  void ExpirePinsLocked();
  bool PinnedLocked(const Key& key) const { return pins_.count(key) != 0; }
  void SetTrackedEverywhereLocked(const Key& key, bool tracked) {
    if (hbm_) hbm_->SetTracked(key, tracked);
    if (dram_) dram_->SetTracked(key, tracked);
    if (ssd_) ssd_->SetTracked(key, tracked);
  }
  void PromoteLocked(const RequestTag& request, const Key& key, std::span<const uint8_t> value,
                     const SsdMeta& meta);

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
      dir_[l.key] = {l.tenant, l.bytes};
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
  std::unique_ptr<policies::AdmissionPolicy> admission_;
  std::unordered_map<Key, DirEntry, KeyHash> dir_;
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

Status TierManagerImpl::Init() {
  if (o_.max_value_bytes == 0) return Status::InvalidArgument("max_value_bytes is 0");
  KVTIER_ASSIGN_OR_RETURN(admission_,
                          policies::MakeAdmissionPolicy(o_.admission_policy, o_.policy_params));
  auto make_mem = [&](Tier t, uint64_t cap) -> StatusOr<std::unique_ptr<MemoryTier>> {
    MemoryTierOptions mo;
    mo.tier = t;
    mo.capacity_bytes = cap;
    mo.slab_page_bytes = std::min(o_.slab_page_bytes, cap);
    mo.mlock = o_.dram_mlock;
    mo.eviction_policy = o_.eviction_policy;
    mo.policy_params = o_.policy_params;
    mo.structure = o_.eviction_structure;
    mo.eviction_policy_factory = o_.eviction_policy_factory;
    mo.clock = clock_;
    return MemoryTier::Create(mo);
  };
  if (o_.hbm_capacity_bytes > 0) {
    KVTIER_ASSIGN_OR_RETURN(hbm_, make_mem(Tier::kHbm, o_.hbm_capacity_bytes));
  }
  if (o_.dram_capacity_bytes > 0) {
    KVTIER_ASSIGN_OR_RETURN(dram_, make_mem(Tier::kDram, o_.dram_capacity_bytes));
  }
  if (o_.ssd_capacity_bytes > 0) {
    SsdOptions so;
    so.dir = o_.data_dir;
    so.env = o_.ssd_env;
    so.capacity_bytes = o_.ssd_capacity_bytes;
    so.segment_bytes = o_.ssd_segment_bytes;
    so.write_buffer_bytes = o_.ssd_write_buffer_bytes;
    so.background_io_bytes_per_s = o_.ssd_background_io_bytes_per_s;
    so.durability = o_.durability;
    so.group_commit_ms = o_.group_commit_ms;
    so.commit_delay_us = o_.ssd_commit_delay_us;
    so.eviction_policy = o_.eviction_policy;
    so.policy_params = o_.policy_params;
    so.structure = o_.eviction_structure;
    so.eviction_policy_factory = o_.ssd_eviction_policy_factory;
    so.clock = clock_;
    // Warm restart: the SSD tier loads its index in the background and reports what it
    // loaded; the directory (tenant accounting) is filled from those reports.
    so.on_index_load = [this](std::span<const std::pair<Key, SsdMeta>> loaded) {
      {
        std::lock_guard q(load_q_mu_);
        for (const auto& [k, m] : loaded) load_q_.push_back({k, m.tenant, m.version, m.raw_bytes});
      }
      std::unique_lock lock(mu_, std::try_to_lock);  // never wait: mu_ may wait for the load
      if (lock.owns_lock()) DrainLoadedLocked();
    };
    // Units lost to a failed buffer write: remembered as io_error misses at once (MissMemory
    // has its own lock), removed from the directory at the next drain under mu_.
    so.on_write_lost = [this](std::span<const Key> keys) {
      for (const Key& k : keys) misses_.Remember(k, MissReason::kIoError);
      std::lock_guard q(load_q_mu_);
      for (const Key& k : keys) {
        if (lost_q_.size() < kLostQueueMax) lost_q_.push_back(k);
      }
    };
    KVTIER_ASSIGN_OR_RETURN(auto ssd, SsdTier::Open(so));
    std::lock_guard lock(mu_);
    ssd_ = std::move(ssd);
    version_ = ssd_->max_version();
    DrainLoadedLocked();
  }
  if (!hbm_ && !dram_ && !ssd_) return Status::InvalidArgument("every tier has capacity 0");
  return Status::Ok();
}

bool TierManagerImpl::PresentAnywhereLocked(const Key& key) const {
  return (hbm_ && hbm_->Contains(key)) || (dram_ && dram_->Contains(key)) ||
         (ssd_ && ssd_->Contains(key));
}

void TierManagerImpl::DroppedLocked(const Key& key, MissReason r) {
  if (PresentAnywhereLocked(key)) return;
  auto it = dir_.find(key);
  if (it != dir_.end()) {
    auto t = tenant_bytes_.find(it->second.tenant);
    if (t != tenant_bytes_.end()) {
      t->second -= std::min(t->second, it->second.bytes);
      if (t->second == 0) tenant_bytes_.erase(t);
    }
    dir_.erase(it);
  }
  if (auto p = pins_.find(key); p != pins_.end()) {
    pin_expiry_.erase({p->second, key});
    pins_.erase(p);
  }
  if (r != MissReason::kNone && r != MissReason::kNeverStored) {
    misses_.Remember(key, r);
  } else {
    misses_.Forget(key);
  }
}

void TierManagerImpl::RemoveEverywhereLocked(const Key& key, uint64_t* ticket) {
  if (hbm_) (void)hbm_->Remove(key);
  if (dram_) (void)dram_->Remove(key);
  if (ssd_ && ssd_->Contains(key)) {
    uint64_t t = 0;
    Status st = ssd_->Remove(key, &t);
    if (st.ok() && ticket != nullptr) *ticket = std::max(*ticket, t);
    if (!st.ok() && !st.IsNotFound()) {
      KVTIER_LOG(kWarn) << "ssd remove: " << st.ToString();
    }
  }
}

void TierManagerImpl::ExpirePinsLocked() {
  uint64_t now = NowMs();
  while (!pin_expiry_.empty() && pin_expiry_.begin()->first <= now) {
    Key k = pin_expiry_.begin()->second;
    pin_expiry_.erase(pin_expiry_.begin());
    pins_.erase(k);
    SetTrackedEverywhereLocked(k, true);
  }
}

Status TierManagerImpl::PlaceLocked(const RequestTag* request, Tier tier, const Key& key,
                                    std::span<const uint8_t> value, const MemMeta& meta) {
  if (tier == Tier::kHbm && !hbm_) tier = Tier::kDram;
  if (tier == Tier::kDram && !dram_) tier = Tier::kSsd;
  if (MemoryTier* mem = MemTier(tier)) {
    Tier next = tier == Tier::kHbm ? Tier::kDram : Tier::kSsd;
    if (value.size() > mem->max_value_bytes()) return PlaceLocked(request, next, key, value, meta);
    // A copy already here leaves first (the policy sees OnRemove), so that every placement is
    // one insert as the simulator makes it: OnMiss, Evict while full, OnInsert.
    if (mem->Contains(key)) (void)mem->Remove(key, request);
    mem->NoteMiss(key, value.size(), request);
    // Evict until the insert succeeds; each round removes one object from this tier.
    while (true) {
      Status st = mem->Insert(key, value, meta, !PinnedLocked(key), request);
      if (st.ok()) return st;
      if (!st.IsRejected()) return st;
      auto victim = mem->PickVictim(request);
      if (!victim) break;  // everything left is pinned: place lower
      if (*victim == key) {
        // The victim is this tier's older copy of the unit being placed: it only leaves the
        // tier. Demoting it would move the older version past the new one (a written-through
        // put's SSD copy), and the stale-copy removal that follows would then delete both.
        (void)mem->Remove(key);
        continue;
      }
      DemoteLocked(request, tier, *victim);
    }
    return PlaceLocked(request, next, key, value, meta);
  }
  // SSD.
  if (!ssd_ || !meta.allow_ssd) return Status::Rejected("no tier has room for the unit");
  uint64_t held = 0;
  if (ssd_->Contains(key, &held) && held == meta.version) return Status::Ok();  // written through
  std::vector<Key> evicted;
  Status st = ssd_->Put(key, value, ToSsd(meta, ToUnix(meta.expires_ms)), &evicted, request);
  for (const Key& k : evicted) {
    if (k != key) DroppedLocked(k, MissReason::kEvicted);
  }
  if (!st.ok()) {
    if (st.IsIOError()) io_errors_.fetch_add(1);
    return st;
  }
  if (PinnedLocked(key)) ssd_->SetTracked(key, false);
  return Status::Ok();
}

void TierManagerImpl::DemoteLocked(const RequestTag* request, Tier tier, const Key& victim) {
  MemoryTier* mem = MemTier(tier);
  if (WritingLocked(victim)) {
    // A newer version is on its way to SSD: this older copy is dropped, never demoted over it.
    (void)mem->Remove(victim);
    return;
  }
  std::vector<uint8_t> bytes;
  MemMeta meta;
  if (!mem->Read(victim, &bytes, &meta, /*count=*/false).ok()) return;
  if (uint64_t held = 0; ssd_ && ssd_->Contains(victim, &held) && held > meta.version) {
    // The SSD already holds a newer version (versions only grow): this copy is stale and
    // only leaves memory; demoting or dropping it must not touch the newer SSD copy.
    (void)mem->Remove(victim);
    return;
  }
  bool placed = false;
  if (tier == Tier::kHbm && (dram_ || ssd_)) {
    placed = PlaceLocked(request, Tier::kDram, victim, bytes, meta).ok();
  } else if (ssd_ && meta.allow_ssd && !Expired(meta.expires_ms)) {
    uint64_t version = 0;
    if (ssd_->Contains(victim, &version) && version == meta.version) {
      placed = true;  // the SSD already holds this version (inclusive after a promotion)
    } else if (admission_->Admit(InfoOf(victim, meta), clock_->NowUs())) {
      ++admissions_;
      placed = PlaceLocked(request, Tier::kSsd, victim, bytes, meta).ok();
    } else {
      ++admission_rejections_;
    }
  }
  (void)mem->Remove(victim);
  if (!placed) {
    if (ssd_ && ssd_->Contains(victim)) (void)ssd_->Remove(victim);  // never leave a stale copy
    DroppedLocked(victim, Expired(meta.expires_ms) ? MissReason::kExpired : MissReason::kEvicted);
  }
}

Status TierManagerImpl::WriteBackLocked() {
  Status first_error;
  size_t failed = 0;
  for (Tier tier : {Tier::kHbm, Tier::kDram}) {
    MemoryTier* mem = MemTier(tier);
    if (mem == nullptr) continue;
    std::vector<Key> candidates;
    mem->ForEach([&](const Key& key, const MemMeta& meta) {
      if (meta.allow_ssd && !Expired(meta.expires_ms)) candidates.push_back(key);
    });
    std::vector<uint8_t> bytes;
    for (const Key& key : candidates) {
      if (WritingLocked(key)) continue;  // its newer version is being written to SSD
      MemMeta meta;
      if (!mem->Read(key, &bytes, &meta, /*count=*/false).ok()) continue;  // gone meanwhile
      uint64_t version = 0;
      if (ssd_->Contains(key, &version) && version == meta.version) continue;
      Status st = PlaceLocked(nullptr, Tier::kSsd, key, bytes, meta);
      if (!st.ok()) {
        ++failed;
        if (first_error.ok()) first_error = st;
      }
    }
  }
  if (failed == 0) return Status::Ok();
  return first_error.WithContext(std::to_string(failed) + " memory-tier units not written back");
}

Status TierManagerImpl::Put(const Key& key, std::span<const uint8_t> value,
                            const PutOptions& options) {
  if (value.size() > o_.max_value_bytes) {
    return Status::InvalidArgument("value of " + std::to_string(value.size()) +
                                   " bytes exceeds max_value_bytes");
  }
  if (options.highest_tier == Tier::kNone) return Status::InvalidArgument("highest_tier none");
  Tier start = options.highest_tier;
  if (start == Tier::kSsd && !options.allow_ssd) {
    return Status::InvalidArgument("highest_tier ssd with allow_ssd false");
  }
  // Written to SSD outside mu_: a put to the SSD tier, and (the durability contract) a put
  // placed in memory that may reach SSD while the mode is batched or sync.
  bool to_ssd = ssd_ != nullptr && options.allow_ssd &&
                (start == Tier::kSsd || o_.durability != Durability::kNone);
  const RequestTag request = options.request.id != 0 ? options.request : BeginRequest();
  MemMeta meta;
  uint64_t stale_ticket = 0;
  {
    std::unique_lock lock(mu_);
    WaitForKeyLocked(lock, key, &options.tenant);
    DrainLoadedLocked();
    ExpirePinsLocked();
    uint64_t old_bytes = 0;
    if (auto it = dir_.find(key); it != dir_.end() && it->second.tenant == options.tenant) {
      old_bytes = it->second.bytes;
    }
    if (auto q = quotas_.find(options.tenant); q != quotas_.end()) {
      uint64_t used = tenant_bytes_.count(options.tenant) ? tenant_bytes_[options.tenant] : 0;
      if (used - std::min(used, old_bytes) + value.size() > q->second) {
        return Status::Rejected("tenant over its byte quota");
      }
    }
    meta.tenant = options.tenant;
    meta.version = ++version_;
    meta.kind = options.kind;
    meta.expires_ms = options.ttl_ms == 0 ? 0 : NowMs() + options.ttl_ms;
    meta.parent_id = ObjectIdOf(options.parent);
    meta.recompute_tokens = options.recompute_tokens;
    meta.allow_ssd = options.allow_ssd;
    meta.size_bytes = static_cast<uint32_t>(value.size());
    if (start == Tier::kSsd) {
      if (!ssd_) return Status::Rejected("no ssd tier");
      policies::ObjectInfo info = InfoOf(key, meta);
      if (!admission_->Admit(info, clock_->NowUs())) {
        ++admission_rejections_;
        return Status::Rejected("admission policy refused the unit");
      }
      ++admissions_;
    }
    if (!to_ssd) {
      KVTIER_RETURN_IF_ERROR(PlaceLocked(&request, start, key, value, meta));
      FinishPutLocked(key, meta, &stale_ticket);
    } else {
      writing_.emplace(key, options.tenant);
    }
  }
  if (!to_ssd) {
    if (options.defer_commit != nullptr) {
      *options.defer_commit = DeferredCommit{stale_ticket, key, 0};
      return Status::Ok();
    }
    return WaitDurable(stale_ticket);  // the removal of an SSD copy it replaced
  }

  // Step 2, without mu_: the SSD write; under kSync it returns after the commit, which
  // concurrent writers share (or, deferred, leaves the commit to CompletePut).
  std::vector<Key> evicted;
  DeferredCommit* defer = options.defer_commit;
  uint64_t put_ticket = 0;
  Status st = ssd_->Put(key, value, ToSsd(meta, ToUnix(meta.expires_ms)), &evicted, &request,
                        defer != nullptr ? &put_ticket : nullptr);
  std::unique_lock lock(mu_);
  writing_.erase(key);
  key_cv_.notify_all();
  for (const Key& k : evicted) {
    if (k != key) DroppedLocked(k, MissReason::kEvicted);
  }
  if (!st.ok()) {
    if (st.IsIOError()) {
      io_errors_.fetch_add(1);
      // The SSD tier has replaced and then dropped the entry (or never took it): remove any
      // older copy as well, so the failed put leaves no stale value behind.
      uint64_t ticket = 0;
      RemoveEverywhereLocked(key, &ticket);
      DroppedLocked(key, MissReason::kIoError);
      lock.unlock();
      Status removed = WaitDurable(ticket);
      (void)removed;  // the put's own error is what the caller needs
    }
    return st;
  }
  if (PinnedLocked(key)) ssd_->SetTracked(key, false);
  // Step 3: memory placement. The SSD copy is durable, so a memory tier without room is no
  // failure (PlaceLocked's SSD step sees the version already there).
  if (start != Tier::kSsd) {
    Status placed = PlaceLocked(&request, start, key, value, meta);
    (void)placed;
  }
  FinishPutLocked(key, meta, &stale_ticket);
  lock.unlock();
  if (defer != nullptr) {
    // Tickets are ordered: committing up to the later one commits both.
    *defer = DeferredCommit{std::max(put_ticket, stale_ticket), key, meta.version};
    return Status::Ok();
  }
  return WaitDurable(stale_ticket);
}

Status TierManagerImpl::CompletePut(const DeferredCommit& d) {
  Status st = WaitDurable(d.ticket);
  if (st.ok() || d.version == 0) return st;
  // As Put's failed SSD step: the unit is not durable, so no tier may keep this version (a
  // newer put of the key, which replaced it, stays).
  std::unique_lock lock(mu_);
  WaitForKeyLocked(lock, d.key, nullptr);
  MemMeta m;
  uint64_t v = 0;
  bool ours = (hbm_ && hbm_->Contains(d.key, &m) && m.version == d.version) ||
              (dram_ && dram_->Contains(d.key, &m) && m.version == d.version) ||
              (ssd_->Contains(d.key, &v) && v == d.version);
  if (!ours) return st;
  if (st.IsIOError()) io_errors_.fetch_add(1);
  uint64_t ticket = 0;
  RemoveEverywhereLocked(d.key, &ticket);
  DroppedLocked(d.key, MissReason::kIoError);
  lock.unlock();
  (void)WaitDurable(ticket);  // the put's own error is what the caller needs
  return st;
}

void TierManagerImpl::FinishPutLocked(const Key& key, const MemMeta& meta, uint64_t* stale_ticket) {
  // Remove stale copies of earlier versions from the other tiers.
  MemMeta m;
  if (hbm_ && hbm_->Contains(key, &m) && m.version != meta.version) (void)hbm_->Remove(key);
  if (dram_ && dram_->Contains(key, &m) && m.version != meta.version) (void)dram_->Remove(key);
  uint64_t v = 0;
  if (ssd_ && ssd_->Contains(key, &v) && v != meta.version) {
    // Its removal is committed under the mode, so a crash never brings the old value back.
    Status st = ssd_->Remove(key, stale_ticket);
    (void)st;  // NotFound: removed meanwhile
  }
  // Account.
  auto [it, inserted] = dir_.try_emplace(key, DirEntry{meta.tenant, meta.size_bytes});
  if (!inserted) {
    auto& tb = tenant_bytes_[it->second.tenant];
    tb -= std::min(tb, it->second.bytes);
    it->second = DirEntry{meta.tenant, meta.size_bytes};
  }
  tenant_bytes_[meta.tenant] += meta.size_bytes;
  misses_.Forget(key);
}

void TierManagerImpl::ListUnits(UnitCursor* cursor, size_t units_max, std::vector<UnitInfo>* out) {
  out->clear();
  if (cursor->done) return;
  units_max = std::clamp<size_t>(units_max, 1, kMaxBatch);
  std::lock_guard lock(mu_);
  DrainLoadedLocked();
  if (cursor->buckets == 0) {
    cursor->buckets = dir_.bucket_count();
  } else if (cursor->buckets != dir_.bucket_count()) {
    cursor->disturbed = true;  // bucket indices moved: finish this pass, the caller rescans
    cursor->buckets = dir_.bucket_count();
  }
  // Whole buckets per page (a bucket holds ~1 key): a page may run a few keys over.
  while (cursor->bucket < dir_.bucket_count() && out->size() < units_max) {
    size_t b = cursor->bucket++;
    for (auto it = dir_.begin(b); it != dir_.end(b); ++it) {
      const Key& key = it->first;
      if (WritingLocked(key)) continue;
      UnitInfo u;
      u.key = key;
      u.tenant = it->second.tenant;
      u.bytes = it->second.bytes;
      MemMeta mm;
      SsdMeta sm;
      uint64_t expires_ms = 0;
      if (hbm_ && hbm_->Contains(key, &mm)) {
        u.tier = Tier::kHbm;
      } else if (dram_ && dram_->Contains(key, &mm)) {
        u.tier = Tier::kDram;
      }
      if (u.tier != Tier::kNone) {
        u.kind = mm.kind;
        std::memcpy(u.parent.data(), &mm.parent_id, sizeof(mm.parent_id));
        u.recompute_tokens = mm.recompute_tokens;
        u.allow_ssd = mm.allow_ssd;
        expires_ms = mm.expires_ms;
      } else if (ssd_ && ssd_->Contains(key, nullptr, &sm)) {
        u.tier = Tier::kSsd;
        u.kind = sm.kind;
        std::memcpy(u.parent.data(), &sm.parent_id, sizeof(sm.parent_id));
        u.recompute_tokens = sm.recompute_tokens;
        expires_ms = FromUnix(sm.expires_unix_ms);
      } else {
        continue;
      }
      if (Expired(expires_ms)) continue;
      u.ttl_left_ms = expires_ms == 0 ? 0 : expires_ms - NowMs();
      out->push_back(u);
    }
  }
  cursor->done = cursor->bucket >= dir_.bucket_count();
}

Tier TierManagerImpl::Locate(const Key& key, bool* expired) const {
  *expired = false;
  MemMeta m;
  if (hbm_ && hbm_->Contains(key, &m)) {
    *expired = Expired(m.expires_ms);
    return Tier::kHbm;
  }
  if (dram_ && dram_->Contains(key, &m)) {
    *expired = Expired(m.expires_ms);
    return Tier::kDram;
  }
  if (ssd_ && ssd_->Contains(key)) return Tier::kSsd;  // expiry checked on read
  return Tier::kNone;
}

Status TierManagerImpl::GetImpl(const Key& key, std::vector<uint8_t>* out, Tier* from,
                                ReadMode mode, const RequestTag& request) {
  const bool peek = mode == ReadMode::kPeek;
  out->clear();
  auto expire = [&]() -> Status {
    {
      std::lock_guard lock(mu_);
      ExpireLocked(key);
    }
    out->clear();
    if (!peek) CountMiss(MissReason::kExpired);
    return Status::NotFound("expired");
  };
  for (Tier t : {Tier::kHbm, Tier::kDram}) {
    MemoryTier* mem = MemTier(t);
    MemMeta m;
    if (mem && mem->Read(key, out, &m, /*count=*/!peek, &request).ok()) {
      if (Expired(m.expires_ms)) return expire();
      if (from != nullptr) *from = t;
      return Status::Ok();
    }
  }
  if (ssd_) {
    SsdMeta sm;
    Status st = ssd_->Get(key, out, &sm, &request);
    if (st.ok()) {
      if (ExpiredUnix(sm.expires_unix_ms)) return expire();
      if (from != nullptr) *from = Tier::kSsd;
      if ((dram_ || hbm_) && !peek) {
        std::unique_lock lock(mu_, std::defer_lock);
        if (mode == ReadMode::kPrefetch) {
          lock.lock();
        } else {
          (void)lock.try_lock();  // never make a reader wait for a writer to promote
        }
        if (lock.owns_lock()) PromoteLocked(request, key, *out, sm);
      }
      return Status::Ok();
    }
    out->clear();
    if (st.IsCorruption()) {
      {
        std::lock_guard lock(mu_);
        DroppedLocked(key, MissReason::kChecksumFailure);
      }
      if (!peek) CountMiss(MissReason::kChecksumFailure);
      ReportChecksumFailure(key, sm);
      return Status::NotFound("checksum failure: unit quarantined");
    }
    if (st.IsIOError()) {
      io_errors_.fetch_add(1);
      if (!peek) CountMiss(MissReason::kIoError);
      return Status::NotFound("io_error: ssd read failed: " + st.message());
    }
  }
  MissReason r = misses_.Reason(key);
  if (!peek) CountMiss(r);
  return Status::NotFound(MissReasonName(r));
}

void TierManagerImpl::GetBatch(std::span<const Key> keys, std::vector<std::vector<uint8_t>>* outs,
                               std::vector<Tier>* froms, std::vector<Status>* results,
                               const RequestTag& given) {
  const RequestTag request = given.id != 0 ? given : BeginRequest();
  const size_t n = keys.size();
  outs->resize(n);
  if (froms != nullptr) froms->assign(n, Tier::kNone);
  if (n > kMaxBatch) {
    results->assign(n, Status::InvalidArgument("batch larger than kMaxBatch"));
    return;
  }
  results->assign(n, Status::Ok());
  GetBatchImpl(
      keys, request, [&](size_t i) { return &(*outs)[i]; },
      [&](size_t i, const Status& st, Tier from, std::span<const uint8_t> value) {
        (*results)[i] = st;
        if (froms != nullptr) (*froms)[i] = from;
        std::vector<uint8_t>& out = (*outs)[i];
        if (value.data() != out.data() || value.size() != out.size()) {
          out.assign(value.begin(), value.end());  // an SSD value (viewed in its read region)
        }
      });
}

void TierManagerImpl::GetBatchVisit(std::span<const Key> keys, const BatchVisitor& visit,
                                    const RequestTag& given, const std::function<void()>& visited) {
  const RequestTag request = given.id != 0 ? given : BeginRequest();
  if (keys.size() > kMaxBatch) {
    for (size_t i = 0; i < keys.size(); ++i) {
      visit(i, Status::InvalidArgument("batch larger than kMaxBatch"), Tier::kNone, {});
    }
    if (visited) visited();
    return;
  }
  std::vector<uint8_t> scratch;  // memory-tier values, one at a time: no allocation per key
  GetBatchImpl(
      keys, request, [&](size_t) { return &scratch; }, visit, visited);
}

void TierManagerImpl::GetBatchImpl(std::span<const Key> keys, const RequestTag& request,
                                   const std::function<std::vector<uint8_t>*(size_t)>& slot,
                                   const BatchVisitor& visit,
                                   const std::function<void()>& visited) {
  const size_t n = keys.size();
  // The SSD units are read in one batch first; then every key, in order, takes its path and
  // reports its hit to its tier's policy (memory: Get's path; SSD: ReportHit), and the SSD
  // hits are promoted last, so that the policies see the batch as the simulator replays it.
  std::vector<size_t> ssd_slot(n, SIZE_MAX);
  std::vector<Key> ssd_keys;
  ssd_keys.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    bool expired = false;
    if (ssd_ && Locate(keys[i], &expired) == Tier::kSsd) {
      ssd_slot[i] = ssd_keys.size();
      ssd_keys.push_back(keys[i]);
    }
  }
  // The SSD values stay in the batch's read region (verified there) until the promotions
  // below have copied them: no vector per unit.
  SsdTier::Batch read;
  if (!ssd_keys.empty()) ssd_->GetBatch(ssd_keys, &read, &request, /*report_hits=*/false);
  // A value GetImpl read into *slot(i): visited where it lies.
  auto get = [&](size_t i) {
    std::vector<uint8_t>* out = slot(i);
    Tier from = Tier::kNone;
    Status st = GetImpl(keys[i], out, &from, ReadMode::kGet, request);
    visit(i, st, from, st.ok() ? std::span<const uint8_t>(*out) : std::span<const uint8_t>());
  };
  std::vector<size_t> promote;  // keys read from SSD, in order
  promote.reserve(ssd_keys.size());
  for (size_t i = 0; i < n; ++i) {
    if (ssd_slot[i] == SIZE_MAX) {
      get(i);
      continue;
    }
    const size_t j = ssd_slot[i];
    const Key& key = keys[i];
    const Status& st = read.result(j);
    if (st.IsCorruption()) {  // quarantined by the SSD tier, as in Get
      {
        std::lock_guard lock(mu_);
        DroppedLocked(key, MissReason::kChecksumFailure);
      }
      CountMiss(MissReason::kChecksumFailure);
      ReportChecksumFailure(key, read.meta(j));
      visit(i, Status::NotFound("checksum failure: unit quarantined"), Tier::kNone, {});
      continue;
    }
    if (st.IsIOError()) {
      io_errors_.fetch_add(1);
      CountMiss(MissReason::kNeverStored);
      visit(i, Status::NotFound("ssd read failed: " + st.message()), Tier::kNone, {});
      continue;
    }
    if (!st.ok() || ExpiredUnix(read.meta(j).expires_unix_ms)) {
      // Gone since Locate, or expired: Get's path (it re-reads, and accounts the miss).
      get(i);
      continue;
    }
    ssd_->ReportHit(key, &request);
    visit(i, Status::Ok(), Tier::kSsd, read.value(j));
    promote.push_back(i);
  }
  // Every key was visited: the caller may answer now (GetBatchVisit's `visited`). The
  // promotions below re-check each unit under mu_, so a delete or put after this is honoured.
  if (visited) visited();
  // The SSD hits are promoted after every hit of the batch was reported (in key order; the
  // simulator's order): a promotion's demotions then never evict a unit the batch has yet to
  // report. A unit the SSD evicted meanwhile is not promoted (PromoteLocked checks). Each is
  // copied once, from the read region into its memory-tier chunk.
  if (promote.empty() || (!dram_ && !hbm_)) return;
  std::unique_lock lock(mu_, std::try_to_lock);  // never make a reader wait to promote
  if (!lock.owns_lock()) return;
  // Under the prefix layer deepest first, as the simulator inserts a request's units.
  if (o_.eviction_structure == policies::Structure::kPrefix) {
    std::reverse(promote.begin(), promote.end());
  }
  for (size_t i : promote) {
    PromoteLocked(request, keys[i], read.value(ssd_slot[i]), read.meta(ssd_slot[i]));
  }
  if (o_.eviction_structure != policies::Structure::kPrefix) return;
  // As the simulator under the prefix layer: a unit of the batch whose predecessor in it the
  // promotions evicted after all (the request outgrew what the layer gives back) leaves the
  // tier, since a cached unit whose prefix is gone is of no use.
  MemoryTier* mem = dram_ ? dram_.get() : hbm_.get();
  for (size_t k = 1; k < n; ++k) {
    if (WritingLocked(keys[k]) || !mem->Contains(keys[k]) || mem->Contains(keys[k - 1])) continue;
    (void)mem->Remove(keys[k], &request);
    DroppedLocked(keys[k], MissReason::kEvicted);  // unless another tier still holds it
  }
}

void TierManagerImpl::PromoteLocked(const RequestTag& request, const Key& key,
                                    std::span<const uint8_t> value, const SsdMeta& sm) {
  if (WritingLocked(key)) return;  // a put of the key is in flight: it places the new version
  uint64_t version = 0;
  if (!ssd_->Contains(key, &version) || version != sm.version) return;  // changed meanwhile
  if ((dram_ && dram_->Contains(key)) || (hbm_ && hbm_->Contains(key))) return;
  MemMeta meta;
  meta.tenant = sm.tenant;
  meta.version = sm.version;
  meta.kind = sm.kind;
  meta.expires_ms = FromUnix(sm.expires_unix_ms);
  meta.parent_id = sm.parent_id;
  meta.recompute_tokens = sm.recompute_tokens;
  meta.allow_ssd = true;
  meta.size_bytes = static_cast<uint32_t>(value.size());
  Tier target = dram_ ? Tier::kDram : Tier::kHbm;
  MemoryTier* mem = MemTier(target);
  if (value.size() > mem->max_value_bytes()) return;
  mem->NoteMiss(key, value.size(), &request);
  while (true) {
    Status st = mem->Insert(key, value, meta, !PinnedLocked(key), &request);
    if (st.ok() || !st.IsRejected()) return;
    auto victim = mem->PickVictim(&request);
    if (!victim) return;
    DemoteLocked(&request, target, *victim);
  }
}

LookupResult TierManagerImpl::Lookup(std::span<const Key> chain) {
  LookupResult r;
  size_t n = std::min(chain.size(), kMaxBatch);
  for (size_t i = 0; i < n; ++i) {
    bool expired = false;
    // SSD expiry is enforced on Get, not here (reading the record's meta per key would cost
    // an index read): a Lookup hit on an expired SSD unit can miss on the following Get.
    Tier t = Locate(chain[i], &expired);
    if (expired) {
      std::lock_guard lock(mu_);
      ExpireLocked(chain[i]);
      t = Tier::kNone;
    }
    if (t == Tier::kNone) {
      r.first_miss = misses_.Reason(chain[i]);
      CountMiss(r.first_miss);
      return r;
    }
    r.tiers.push_back(t);
    ++r.hit_count;
  }
  return r;
}

Status TierManagerImpl::Prefetch(std::span<const Key> keys) {
  if (keys.size() > kMaxBatch) return Status::InvalidArgument("batch larger than kMaxBatch");
  const RequestTag request = BeginRequest();
  std::vector<uint8_t> buf;
  for (const Key& k : keys) {
    bool expired = false;
    if (Locate(k, &expired) != Tier::kSsd) continue;
    Status st = GetImpl(k, &buf, nullptr, ReadMode::kPrefetch, request);
    (void)st;  // a miss is skipped
  }
  return Status::Ok();
}

Status TierManagerImpl::Pin(std::span<const Key> keys, uint64_t lease_ms) {
  if (keys.size() > kMaxBatch) return Status::InvalidArgument("batch larger than kMaxBatch");
  if (lease_ms == 0) return Status::InvalidArgument("lease_ms is 0");
  std::lock_guard lock(mu_);
  ExpirePinsLocked();
  for (const Key& k : keys) {
    if (!PresentAnywhereLocked(k)) return Status::NotFound("cannot pin an absent unit");
  }
  if (pins_.size() + keys.size() > o_.max_pinned) return Status::Rejected("too many pinned units");
  uint64_t until = NowMs() + lease_ms;
  for (const Key& k : keys) {
    if (auto p = pins_.find(k); p != pins_.end()) {
      pin_expiry_.erase({p->second, k});
      p->second = std::max(p->second, until);
      pin_expiry_.insert({p->second, k});
      continue;
    }
    pins_[k] = until;
    pin_expiry_.insert({until, k});
    SetTrackedEverywhereLocked(k, false);
  }
  return Status::Ok();
}

Status TierManagerImpl::Unpin(std::span<const Key> keys) {
  if (keys.size() > kMaxBatch) return Status::InvalidArgument("batch larger than kMaxBatch");
  std::lock_guard lock(mu_);
  for (const Key& k : keys) {
    auto p = pins_.find(k);
    if (p == pins_.end()) continue;
    pin_expiry_.erase({p->second, k});
    pins_.erase(p);
    SetTrackedEverywhereLocked(k, true);
  }
  return Status::Ok();
}

Status TierManagerImpl::Delete(const Key& key) {
  uint64_t ticket = 0;
  {
    std::unique_lock lock(mu_);
    WaitForKeyLocked(lock, key, nullptr);  // a put of the key in flight finishes first
    DrainLoadedLocked();
    if (!PresentAnywhereLocked(key)) return Status::NotFound("no such unit");
    RemoveEverywhereLocked(key, &ticket);
    DroppedLocked(key, MissReason::kNeverStored);
  }
  // kSync: the index delete is committed before the delete is acknowledged (shared with
  // concurrent writers' commits).
  return WaitDurable(ticket);
}

Status TierManagerImpl::DeleteTenant(TenantId tenant) {
  // Every SSD unit of the tenant must be found, also those the background index load has
  // not reported yet: wait for the load (without mu_: the load never waits for mu_).
  if (ssd_) ssd_->WaitForIndexLoad();
  uint64_t ticket = 0;
  {
    std::unique_lock lock(mu_);
    // Puts of the tenant in their SSD step finish first; new ones wait until this is done.
    ++tenant_deletes_[tenant];
    key_cv_.wait(lock, [&] {
      return std::none_of(writing_.begin(), writing_.end(),
                          [&](const auto& w) { return w.second == tenant; });
    });
    DrainLoadedLocked();
    std::vector<Key> keys;
    for (const auto& [k, d] : dir_) {
      if (d.tenant == tenant) keys.push_back(k);
    }
    if (ssd_) {
      ssd_->ForEach([&](const Key& k, const SsdMeta& m) {
        if (m.tenant == tenant && !dir_.count(k)) keys.push_back(k);
      });
    }
    for (const Key& k : keys) {
      RemoveEverywhereLocked(k, &ticket);
      DroppedLocked(k, MissReason::kNeverStored);
    }
    tenant_bytes_.erase(tenant);
    if (--tenant_deletes_[tenant] == 0) tenant_deletes_.erase(tenant);
    key_cv_.notify_all();
  }
  // One commit for every removal (kSync), without mu_.
  return WaitDurable(ticket);
}

Status TierManagerImpl::SetPolicy(const std::string& eviction, const std::string& admission,
                                  const policies::PolicyParams& params) {
  // Validate both names first, so a typo changes nothing.
  KVTIER_ASSIGN_OR_RETURN(auto adm, policies::MakeAdmissionPolicy(admission, params));
  KVTIER_RETURN_IF_ERROR(policies::MakeEvictionPolicy(eviction, params).status());
  std::lock_guard lock(mu_);
  admission_ = std::move(adm);
  if (hbm_) KVTIER_RETURN_IF_ERROR(hbm_->SetPolicy(eviction, params));
  if (dram_) KVTIER_RETURN_IF_ERROR(dram_->SetPolicy(eviction, params));
  if (ssd_) KVTIER_RETURN_IF_ERROR(ssd_->SetPolicy(eviction, params));
  o_.eviction_policy = eviction;
  o_.admission_policy = admission;
  return Status::Ok();
}

Stats TierManagerImpl::GetStats() const {
  Stats s;
  auto fill = [](const MemoryTier* t, TierStats* out) {
    if (t == nullptr) return;
    MemoryTierStats m = t->GetStats();
    *out = {m.capacity_bytes, m.used_bytes, m.objects,      m.hits,
            m.evictions,      m.bytes_read, m.bytes_written};
  };
  fill(hbm_.get(), &s.hbm);
  fill(dram_.get(), &s.dram);
  if (ssd_) {
    SsdStats d = ssd_->GetStats();
    s.ssd = {d.capacity_bytes, d.live_bytes, d.objects,      d.hits,
             d.evictions,      d.bytes_read, d.bytes_written};
    s.checksum_failures = d.checksum_failures;
    s.compressed_bytes_saved = d.compressed_bytes_saved;
    s.segments_cleaned = d.segments_cleaned;
    s.ssd_relocated_bytes = d.relocated_bytes;
    s.ssd_commits = d.commits;
    s.ssd_syncs = d.syncs;
    s.ssd_index_syncs = d.index_syncs;
    s.ssd_commit_writers = d.commit_writers;
    s.ssd_commit_delays = d.commit_delays;
    s.ssd_commit_delay_us = d.commit_delay_us;
    s.ssd_commit_delay_timeouts = d.commit_delay_timeouts;
    s.ssd_commit_failures = d.commit_failures;
    s.ssd_last_failed_stage = d.last_failed_stage;
  }
  s.misses_never_stored = misses_never_stored_.load();
  s.misses_evicted = misses_evicted_.load();
  s.misses_expired = misses_expired_.load();
  s.misses_checksum = misses_checksum_.load();
  s.misses_io_error = misses_io_error_.load();
  s.io_errors = io_errors_.load();
  std::lock_guard lock(mu_);
  const_cast<TierManagerImpl*>(this)->DrainLoadedLocked();
  s.admissions = admissions_;
  s.admission_rejections = admission_rejections_;
  if (std::optional<policies::AdmissionPolicy::ByteBudget> b =
          admission_->Budget(clock_->NowUs())) {
    s.admission_budget_bytes = b->bytes_per_window;
    s.admission_budget_window_ms = b->window_ms;
    s.admission_budget_spent_bytes = b->spent_bytes;
  }
  for (const auto& [t, b] : tenant_bytes_) s.tenant_bytes.emplace_back(t, b);
  std::sort(s.tenant_bytes.begin(), s.tenant_bytes.end());
  return s;
}

}  // namespace

StatusOr<std::unique_ptr<TierManager>> TierManager::Open(const TierManagerOptions& options) {
  auto tm = std::make_unique<TierManagerImpl>(options);
  KVTIER_RETURN_IF_ERROR(tm->Init());
  return std::unique_ptr<TierManager>(std::move(tm));
}

}  // namespace kvtier::storage
