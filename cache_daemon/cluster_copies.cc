#include "cache_daemon/cluster_copies.h"

#include <algorithm>

#include "common/clock.h"

namespace kvtier::daemon {

ClusterCopies::ClusterCopies(storage::TierManager* store, cluster::Membership* membership,
                             cluster::RecentDeletes* recent, CopyOptions options)
    : store_(store),
      membership_(membership),
      recent_(recent),
      options_(options),
      fence_(cluster::RecentDeletesOptions{}) {}

uint64_t ClusterCopies::BeginFetch() { return DefaultSteadyClock().NowMs(); }

bool ClusterCopies::TrustedLocked(uint64_t now) {
  const uint64_t confirmed = membership_->lease_confirmed_ms();
  const uint64_t fence_ms = membership_->options().lease_ttl_s * 1000ull * 2 / 3;
  const uint64_t registration = membership_->Stats().registrations;
  // Nothing was made under the old registration: adopt the new one.
  if (copies_.empty()) registration_ = registration;
  return confirmed != 0 && now >= confirmed && now - confirmed < fence_ms &&
         registration == registration_;
}

void ClusterCopies::DropLocked(const storage::Key& key, bool delete_unit) {
  auto it = copies_.find(key);
  if (it == copies_.end()) return;
  bytes_ -= it->second.bytes;
  copies_.erase(it);
  dropped_.fetch_add(1);
  // NotFound: the DRAM policy evicted it, its TTL ran out, or a delete got there first.
  if (delete_unit) (void)store_->Delete(key);
}

void ClusterCopies::DropAllLocked() {
  if (copies_.empty()) return;
  drop_alls_.fetch_add(1);
  for (const auto& [key, e] : copies_) (void)store_->Delete(key);
  dropped_.fetch_add(copies_.size());
  copies_.clear();
  order_.clear();
  bytes_ = 0;
}

void ClusterCopies::CheckHits(std::span<const storage::Key> keys, std::vector<Status>* results) {
  std::lock_guard lock(mu_);
  if (copies_.empty()) return;
  const uint64_t now = DefaultSteadyClock().NowMs();
  const bool trusted = TrustedLocked(now);
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!(*results)[i].ok()) continue;
    auto it = copies_.find(keys[i]);
    if (it == copies_.end()) continue;  // a unit held here as an owner
    if (!trusted) {
      (*results)[i] = Status::NotFound("cluster copy dropped: lease not confirmed");
    } else if (now >= it->second.expires_ms) {
      DropLocked(keys[i], /*delete_unit=*/true);
      (*results)[i] = Status::NotFound("cluster copy expired");
    } else {
      hits_.fetch_add(1);
    }
  }
  if (!trusted) DropAllLocked();
}

void ClusterCopies::Keep(storage::TenantId tenant, std::string_view tenant_name,
                         const storage::Key& key, std::span<const uint8_t> value,
                         uint64_t fetch_started, std::optional<uint64_t> ttl_left_ms) {
  if (options_.bytes_max == 0) return;
  std::lock_guard lock(mu_);
  const uint64_t now = DefaultSteadyClock().NowMs();
  if (!TrustedLocked(now)) {
    DropAllLocked();
    if (!TrustedLocked(now)) {
      fenced_.fetch_add(1);
      return;
    }
  }
  if (value.size() > options_.bytes_max || now - fetch_started > options_.fetch_window_ms ||
      fence_.NotedSince(key, tenant_name, fetch_started) || recent_->Noted(key, tenant_name)) {
    fenced_.fetch_add(1);
    return;
  }
  // The owner read the unit after fetch_started: counted from there, the copy ends no later
  // than the unit does.
  uint64_t ttl_ms = options_.ttl_ms;
  if (ttl_left_ms.has_value() && *ttl_left_ms > 0) {
    const uint64_t elapsed = now - fetch_started;
    if (*ttl_left_ms <= elapsed) {
      fenced_.fetch_add(1);
      return;
    }
    ttl_ms = std::min(ttl_ms, *ttl_left_ms - elapsed);
  }
  while (bytes_ + value.size() > options_.bytes_max && !order_.empty()) {
    auto [seq, oldest] = order_.front();
    order_.pop_front();
    auto it = copies_.find(oldest);
    if (it != copies_.end() && it->second.seq == seq) DropLocked(oldest, /*delete_unit=*/true);
  }
  storage::PutOptions po;
  po.tenant = tenant;
  po.ttl_ms = ttl_ms;
  po.highest_tier = storage::Tier::kDram;
  po.allow_ssd = false;  // DRAM only: evicted means dropped
  // Only if absent: a unit the store holds (an owner's write that got here after the fetch
  // read the owners, or a copy another GET kept) is newer or the same, and stays.
  po.if_absent = true;
  if (!store_->Put(key, value, po).ok()) {
    fenced_.fetch_add(1);
    return;
  }
  DropLocked(key, /*delete_unit=*/false);  // a listed copy the store no longer held
  const uint64_t seq = next_seq_++;
  copies_[key] =
      Entry{.bytes = value.size(), .expires_ms = now + ttl_ms, .seq = seq, .tenant = tenant};
  order_.emplace_back(seq, key);
  bytes_ += value.size();
  kept_.fetch_add(1);
  // order_ holds stale entries of replaced or dropped copies until they reach its front;
  // bound it at twice the live copies.
  if (order_.size() > 2 * copies_.size() + 1024) {
    std::deque<std::pair<uint64_t, storage::Key>> live;
    for (const auto& [s, k] : order_) {
      auto it = copies_.find(k);
      if (it != copies_.end() && it->second.seq == s) live.emplace_back(s, k);
    }
    order_.swap(live);
  }
}

void ClusterCopies::Forget(const storage::Key& key) {
  std::lock_guard lock(mu_);
  DropLocked(key, /*delete_unit=*/false);
}

void ClusterCopies::Drop(std::span<const storage::Key> keys) {
  fence_.NoteKeys(keys);
  std::lock_guard lock(mu_);
  for (const storage::Key& k : keys) DropLocked(k, /*delete_unit=*/true);
}

void ClusterCopies::DropTenant(storage::TenantId tenant, std::string_view tenant_name) {
  fence_.NoteTenant(tenant_name);
  std::lock_guard lock(mu_);
  std::vector<storage::Key> keys;
  for (const auto& [k, e] : copies_) {
    if (e.tenant == tenant) keys.push_back(k);
  }
  for (const storage::Key& k : keys) DropLocked(k, /*delete_unit=*/true);
}

void ClusterCopies::DropAll() {
  std::lock_guard lock(mu_);
  DropAllLocked();
}

bool ClusterCopies::IsCopy(const storage::Key& key) const {
  std::lock_guard lock(mu_);
  return copies_.contains(key);
}

CopyStats ClusterCopies::stats() const {
  CopyStats s;
  {
    std::lock_guard lock(mu_);
    s.bytes = bytes_;
    s.units = copies_.size();
  }
  s.kept = kept_.load();
  s.hits = hits_.load();
  s.dropped = dropped_.load();
  s.fenced = fenced_.load();
  s.drop_alls = drop_alls_.load();
  return s;
}

}  // namespace kvtier::daemon
