// TierManager: construction, placement HBM -> DRAM -> SSD, demotion, write-back and Put
// (the design and the durable-write steps: storage/tier_manager_impl.h).
#include "storage/tier_manager.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "common/logging.h"
#include "storage/tier_manager_impl.h"

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

uint64_t TierManagerOptions::ObjectsMax(Tier tier) const {
  const uint64_t configured = tier == Tier::kHbm    ? hbm_objects_max
                              : tier == Tier::kDram ? dram_objects_max
                                                    : ssd_objects_max;
  if (configured != 0) return configured;
  const uint64_t capacity = tier == Tier::kHbm    ? hbm_capacity_bytes
                            : tier == Tier::kDram ? dram_capacity_bytes
                                                  : ssd_capacity_bytes;
  const uint64_t derived = std::max<uint64_t>(capacity / kDefaultBytesPerObject, 1);
  return tier == Tier::kSsd ? std::min(derived, kDefaultSsdObjectsMax) : derived;
}

namespace internal {

Status TierManagerImpl::Init() {
  if (o_.max_value_bytes == 0) return Status::InvalidArgument("max_value_bytes is 0");
  KVTIER_ASSIGN_OR_RETURN(admission_,
                          policies::MakeAdmissionPolicy(o_.admission_policy, o_.policy_params));
  counts_lookups_.store(admission_->CountsLookups(), std::memory_order_relaxed);
  auto make_mem = [&](Tier t, uint64_t cap) -> StatusOr<std::unique_ptr<MemoryTier>> {
    MemoryTierOptions mo;
    mo.tier = t;
    mo.capacity_bytes = cap;
    mo.slab_page_bytes = std::min(o_.slab_page_bytes, cap);
    mo.mlock = o_.dram_mlock;
    mo.prefault = t == Tier::kDram && o_.dram_prefault;
    mo.eviction_policy = o_.eviction_policy;
    mo.policy_params = o_.policy_params;
    mo.structure = o_.eviction_structure;
    mo.eviction_policy_factory = o_.eviction_policy_factory;
    mo.clock = clock_;
    mo.objects_max = o_.ObjectsMax(t);
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
    so.index_env = o_.ssd_index_env;
    so.capacity_bytes = o_.ssd_capacity_bytes;
    so.segment_bytes = o_.ssd_segment_bytes;
    so.write_buffer_bytes = o_.ssd_write_buffer_bytes;
    so.background_io_bytes_per_s = o_.ssd_background_io_bytes_per_s;
    so.durability = o_.durability;
    so.group_commit_ms = o_.group_commit_ms;
    so.commit_delay_us = o_.ssd_commit_delay_us;
    so.disk_free_min_bytes = o_.ssd_disk_free_min_bytes;
    so.objects_max = o_.ObjectsMax(Tier::kSsd);
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
        for (const auto& [k, m] : loaded) {
          load_q_.push_back({k, m.tenant, m.version, m.raw_bytes, m.expires_unix_ms});
        }
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

bool TierManagerImpl::LiveLocked(const Key& key) const {
  // The fastest tier holding it decides, as for a read (Locate).
  MemMeta m;
  if (hbm_ && hbm_->Contains(key, &m)) return !Expired(m.expires_ms);
  if (dram_ && dram_->Contains(key, &m)) return !Expired(m.expires_ms);
  SsdMeta sm;
  return ssd_ && ssd_->Contains(key, nullptr, &sm) && !ExpiredUnix(sm.expires_unix_ms);
}

uint64_t TierManagerImpl::TierExpiryLocked(const Key& key) const {
  MemMeta m;
  if (hbm_ && hbm_->Contains(key, &m)) return m.expires_ms;
  if (dram_ && dram_->Contains(key, &m)) return m.expires_ms;
  SsdMeta sm;
  if (ssd_ && ssd_->Contains(key, nullptr, &sm)) return FromUnix(sm.expires_unix_ms);
  return 0;
}

void TierManagerImpl::ReclaimExpiredLocked(TenantId tenant) {
  auto t = expiring_.find(tenant);
  if (t == expiring_.end()) return;
  const uint64_t now = NowMs();
  std::vector<Key> due;  // copied first: expiring a unit changes the index
  for (auto it = t->second.begin();
       it != t->second.end() && it->first <= now && due.size() < kQuotaReclaimUnitsMax; ++it) {
    due.push_back(it->second);
  }
  for (const Key& k : due) {
    if (WritingLocked(k)) continue;  // the put in flight replaces its entry
    if (!LiveLocked(k)) {
      ExpireLocked(k);  // leaves the directory and the index (DroppedLocked)
      continue;
    }
    // A tier holds it unexpired: the index moves to the expiry that tier has.
    auto d = dir_.find(k);
    if (d == dir_.end()) continue;
    UnindexExpiryLocked(k, d->second);
    d->second.expires_ms = TierExpiryLocked(k);
    IndexExpiryLocked(k, d->second);
  }
}

void TierManagerImpl::DroppedLocked(const Key& key, MissReason r) {
  if (PresentAnywhereLocked(key)) return;
  auto it = dir_.find(key);
  if (it != dir_.end()) {
    UnindexExpiryLocked(key, it->second);
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
  if (ssd_) {
    // Also when the SSD tier evicted it by an index delete not synced yet (SsdTier::Remove):
    // a power failure must not bring back what this removes.
    uint64_t t = 0;
    Status st = ssd_->Remove(key, &t);
    if (st.ok() && ticket != nullptr) *ticket = std::max(*ticket, t);
    if (!st.ok() && !st.IsNotFound()) {
      KVTIER_LOG(kWarn) << "ssd remove: " << st.ToString();
    }
  }
}

void TierManagerImpl::ExpirePinsLocked() {
  if (pin_expiry_.empty()) return;  // no clock read on every put when nothing is pinned
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
    } else if (AdmitLocked(InfoOf(victim, meta))) {
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
  if (options.held != nullptr) *options.held = false;
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
    if (options.if_absent && LiveLocked(key)) {
      if (options.held != nullptr) *options.held = true;
      return Status::Rejected("put if absent: the store holds the key");
    }
    if (auto q = quotas_.find(options.tenant); q != quotas_.end()) {
      auto over_quota = [&] {
        uint64_t old_bytes = 0;  // the version this put replaces counts once
        if (auto it = dir_.find(key); it != dir_.end() && it->second.tenant == options.tenant) {
          old_bytes = it->second.bytes;
        }
        auto u = tenant_bytes_.find(options.tenant);
        const uint64_t used = u != tenant_bytes_.end() ? u->second : 0;
        return used - std::min(used, old_bytes) + value.size() > q->second;
      };
      if (over_quota()) {
        // Units whose TTL passed still count until something expires them: this put does,
        // for its tenant (bounded: ReclaimExpiredLocked), before it is refused.
        ReclaimExpiredLocked(options.tenant);
        if (over_quota()) return Status::Rejected("tenant over its byte quota");
      }
    }
    meta.tenant = options.tenant;
    meta.version = ++version_;
    meta.kind = options.kind;
    meta.expires_ms = options.ttl_ms == 0 ? 0 : AddSaturating(NowMs(), options.ttl_ms);
    meta.parent_id = ObjectIdOf(options.parent);
    meta.recompute_tokens = options.recompute_tokens;
    meta.allow_ssd = options.allow_ssd;
    meta.size_bytes = static_cast<uint32_t>(value.size());
    if (start == Tier::kSsd) {
      if (!ssd_) return Status::Rejected("no ssd tier");
      if (!AdmitLocked(InfoOf(key, meta))) {
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
  if (ssd_ && !(ssd_->Contains(key, &v) && v == meta.version)) {
    // Its removal is committed under the mode, so a crash never brings the old value back;
    // also an old value the SSD tier evicted by an index delete not synced yet (Remove).
    Status st = ssd_->Remove(key, stale_ticket);
    (void)st;  // NotFound: none there
  }
  // Account.
  const DirEntry entry{meta.tenant, meta.size_bytes, meta.expires_ms};
  auto [it, inserted] = dir_.try_emplace(key, entry);
  if (!inserted) {
    auto& tb = tenant_bytes_[it->second.tenant];
    tb -= std::min(tb, it->second.bytes);
    UnindexExpiryLocked(key, it->second);
    it->second = entry;
  }
  IndexExpiryLocked(key, entry);
  tenant_bytes_[meta.tenant] += meta.size_bytes;
  misses_.Forget(key);
}

}  // namespace internal

StatusOr<std::unique_ptr<TierManager>> TierManager::Open(const TierManagerOptions& options) {
  auto tm = std::make_unique<internal::TierManagerImpl>(options);
  KVTIER_RETURN_IF_ERROR(tm->Init());
  return std::unique_ptr<TierManager>(std::move(tm));
}

}  // namespace kvtier::storage
