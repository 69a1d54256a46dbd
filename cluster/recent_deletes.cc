#include "cluster/recent_deletes.h"

#include <algorithm>
#include <chrono>

namespace kvtier::cluster {
namespace {

uint64_t SteadyMs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

}  // namespace

RecentDeletes::RecentDeletes(RecentDeletesOptions options) : options_(options), now_ms_(SteadyMs) {
  options_.window_ms = std::clamp<uint64_t>(options_.window_ms, 1, 3'600'000);
  options_.keys_max = std::clamp<size_t>(options_.keys_max, 1, 16'777'216);
}

void RecentDeletes::SetClockForTest(uint64_t (*now_ms)()) { now_ms_ = now_ms; }

void RecentDeletes::ExpireLocked(uint64_t now) {
  while (!order_.empty() && order_.front().first + options_.window_ms <= now) {
    auto it = keys_.find(order_.front().second);
    // A key noted again later has a newer time: only its last note expires it.
    if (it != keys_.end() && it->second == order_.front().first) keys_.erase(it);
    order_.pop_front();
  }
  std::erase_if(tenants_, [&](const auto& t) { return t.second + options_.window_ms <= now; });
}

void RecentDeletes::NoteKeys(std::span<const PeerKey> keys) {
  std::lock_guard lock(mu_);
  const uint64_t now = now_ms_();
  ExpireLocked(now);
  for (const PeerKey& k : keys) {
    if (order_.size() >= options_.keys_max) {
      refuse_all_until_ = now + options_.window_ms;  // over the bound: fence every copy
      continue;
    }
    keys_[k] = now;
    order_.emplace_back(now, k);
  }
}

void RecentDeletes::NoteTenant(std::string_view tenant) {
  std::lock_guard lock(mu_);
  const uint64_t now = now_ms_();
  ExpireLocked(now);
  auto it = tenants_.find(tenant);
  if (it == tenants_.end()) {
    tenants_.emplace(std::string(tenant), now);
  } else {
    it->second = now;
  }
}

bool RecentDeletes::NotedLocked(const PeerKey& key, std::string_view tenant) {
  const uint64_t now = now_ms_();
  ExpireLocked(now);
  return now < refuse_all_until_ || keys_.contains(key) || tenants_.find(tenant) != tenants_.end();
}

bool RecentDeletes::RefusesRepair(const PeerKey& key, std::string_view tenant) {
  std::lock_guard lock(mu_);
  const bool refuse = NotedLocked(key, tenant);
  if (refuse) ++refused_;
  return refuse;
}

bool RecentDeletes::NotedSince(const PeerKey& key, std::string_view tenant, uint64_t since_ms) {
  std::lock_guard lock(mu_);
  const uint64_t now = now_ms_();
  ExpireLocked(now);
  if (now < refuse_all_until_) return true;
  auto k = keys_.find(key);
  if (k != keys_.end() && k->second >= since_ms) return true;
  auto t = tenants_.find(tenant);
  return t != tenants_.end() && t->second >= since_ms;
}

bool RecentDeletes::Noted(const PeerKey& key, std::string_view tenant) {
  std::lock_guard lock(mu_);
  return NotedLocked(key, tenant);
}

uint64_t RecentDeletes::refused() const {
  std::lock_guard lock(mu_);
  return refused_;
}

}  // namespace kvtier::cluster
