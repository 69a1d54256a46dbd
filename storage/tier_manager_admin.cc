// TierManager administration: pins, Delete, DeleteTenant, policy switch, stats
// (storage/tier_manager_impl.h).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>

#include "common/logging.h"
#include "storage/tier_manager_impl.h"

namespace kvtier::storage::internal {

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
  DeferredCommit deferred;
  Status st = DeleteDeferred(key, &deferred);
  // kSync: the index delete is committed before the delete is acknowledged (shared with
  // concurrent writers' commits).
  Status committed = CompletePut(deferred);
  return committed.ok() ? st : committed;
}

Status TierManagerImpl::DeleteDeferred(const Key& key, DeferredCommit* deferred) {
  uint64_t ticket = 0;
  bool present = false, live = false;
  {
    std::unique_lock lock(mu_);
    WaitForKeyLocked(lock, key, nullptr);  // a put of the key in flight finishes first
    DrainLoadedLocked();
    // One past its TTL is removed, but was not there. Live implies present: one lookup for
    // the usual delete of a live unit.
    live = LiveLocked(key);
    present = live || PresentAnywhereLocked(key);
    // Absent too: the SSD index may still hold a unit its tier evicted (the eviction's delete
    // not synced yet): after this Delete it must not come back either (RemoveEverywhereLocked).
    RemoveEverywhereLocked(key, &ticket);
    if (present) DroppedLocked(key, MissReason::kNeverStored);
  }
  // Version 0: a failed commit has no put to undo (CompletePut only waits).
  *deferred = DeferredCommit{ticket, key, 0};
  return live ? Status::Ok() : Status::NotFound("no such unit");
}

Status TierManagerImpl::DeleteTenant(TenantId tenant) {
  // Every SSD unit of the tenant must be found, also those the background index load has
  // not reported yet: wait for the load (without mu_: the load never waits for mu_). After a
  // failed load they cannot all be found: nothing is deleted.
  if (ssd_) {
    KVTIER_RETURN_IF_ERROR(ssd_->WaitForIndexLoad().WithContext(
        "delete tenant " + std::to_string(tenant) + ": its SSD units cannot all be found"));
  }
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
      // OK: the load finished above.
      (void)ssd_->ForEach([&](const Key& k, const SsdMeta& m) {
        if (m.tenant == tenant && !dir_.count(k)) keys.push_back(k);
      });
      // Units the SSD tier evicted (gone from every tier, or still in memory) whose index
      // delete is not synced yet: a power failure must not bring them back either.
      ssd_->ForEachUnsyncedEviction([&](const Key& k, TenantId t) {
        if (t == tenant && !dir_.count(k)) keys.push_back(k);
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
  // A policy whose name and parameters are unchanged keeps its instance and state (a reload
  // that changes nothing must not refill a write budget, forget second-hit counts or reorder
  // the tiers); a changed admission policy takes over what still applies (CarryOver). Tiers
  // made by a test's factory are always switched to the named policy.
  if (admission != o_.admission_policy ||
      !policies::SameParamsFor(admission, params, o_.policy_params)) {
    std::lock_guard admission_lock(admission_mu_);  // readers count without mu_
    adm->CarryOver(*admission_, clock_->NowUs());
    admission_ = std::move(adm);
    counts_lookups_.store(admission_->CountsLookups(), std::memory_order_relaxed);
  }
  if (eviction != o_.eviction_policy ||
      !policies::SameParamsFor(eviction, params, o_.policy_params) || o_.eviction_policy_factory ||
      o_.ssd_eviction_policy_factory) {
    if (hbm_) KVTIER_RETURN_IF_ERROR(hbm_->SetPolicy(eviction, params));
    if (dram_) KVTIER_RETURN_IF_ERROR(dram_->SetPolicy(eviction, params));
    if (ssd_) KVTIER_RETURN_IF_ERROR(ssd_->SetPolicy(eviction, params));
  }
  o_.eviction_policy = eviction;
  o_.admission_policy = admission;
  o_.policy_params = params;
  return Status::Ok();
}

Stats TierManagerImpl::GetStats() const {
  Stats s;
  auto fill = [](const MemoryTier* t, TierStats* out) {
    if (t == nullptr) return;
    MemoryTierStats m = t->GetStats();
    *out = {m.capacity_bytes, m.used_bytes, m.objects,       m.hits,
            m.evictions,      m.bytes_read, m.bytes_written, m.objects_max};
  };
  fill(hbm_.get(), &s.hbm);
  fill(dram_.get(), &s.dram);
  if (ssd_) {
    SsdStats d = ssd_->GetStats();
    s.ssd = {d.capacity_bytes, d.live_bytes, d.objects,       d.hits,
             d.evictions,      d.bytes_read, d.bytes_written, d.objects_max};
    s.checksum_failures = d.checksum_failures;
    s.compressed_bytes_saved = d.compressed_bytes_saved;
    s.segments_cleaned = d.segments_cleaned;
    s.ssd_relocated_bytes = d.relocated_bytes;
    s.ssd_disk_full_shrinks = d.disk_full_shrinks;
    s.ssd_disk_free_shrinks = d.disk_free_shrinks;
    s.ssd_disk_full_open_drops = d.disk_full_open_drops;
    s.ssd_disk_free_bytes = d.disk_free_bytes;
    s.ssd_commits = d.commits;
    s.ssd_syncs = d.syncs;
    s.ssd_index_syncs = d.index_syncs;
    s.ssd_index_reopens = d.index_reopens;
    s.ssd_commit_writers = d.commit_writers;
    s.ssd_commit_delays = d.commit_delays;
    s.ssd_commit_delay_us = d.commit_delay_us;
    s.ssd_commit_delay_timeouts = d.commit_delay_timeouts;
    s.ssd_commit_failures = d.commit_failures;
    s.ssd_last_failed_stage = d.last_failed_stage;
    s.ssd_index_load_failed = d.index_load_failed;
    s.ssd_index_loaded = d.index_loaded;
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
  std::optional<policies::AdmissionPolicy::ByteBudget> budget;
  {
    std::lock_guard admission_lock(admission_mu_);
    budget = admission_->Budget(clock_->NowUs());
  }
  if (const std::optional<policies::AdmissionPolicy::ByteBudget>& b = budget) {
    s.admission_budget_bytes = b->bytes_per_window;
    s.admission_budget_window_ms = b->window_ms;
    s.admission_budget_spent_bytes = b->spent_bytes;
  }
  for (const auto& [t, b] : tenant_bytes_) s.tenant_bytes.emplace_back(t, b);
  std::sort(s.tenant_bytes.begin(), s.tenant_bytes.end());
  return s;
}

}  // namespace kvtier::storage::internal
