// A test-only in-memory TierManager for protocol tests that must not depend on the real
// storage engine. It keeps everything in one map at the DRAM tier (or SSD when the put asks
// for it), enforces per-tenant quotas, and records the calls it received. Not a store.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <mutex>

#include "storage/tier_manager.h"

namespace kvtier::testing {

class FakeTierManager final : public storage::TierManager {
 public:
  struct Entry {
    std::vector<uint8_t> value;
    storage::TenantId tenant = 0;
    storage::Tier tier = storage::Tier::kDram;
  };

  Status Put(const storage::Key& key, std::span<const uint8_t> value,
             const storage::PutOptions& o) override {
    std::lock_guard<std::mutex> lock(mu);
    if (o.held != nullptr) *o.held = map.contains(key) && o.if_absent;
    if (o.if_absent && map.contains(key)) return Status::Rejected("put if absent: held");
    uint64_t quota = quotas.count(o.tenant) ? quotas[o.tenant] : 0;
    if (quota != 0 && used[o.tenant] + value.size() > quota) {
      return Status::Rejected("tenant over quota");
    }
    auto& e = map[key];
    used[e.tenant] -= e.value.size();
    e.value.assign(value.begin(), value.end());
    e.tenant = o.tenant;
    e.tier = o.highest_tier == storage::Tier::kSsd ? storage::Tier::kSsd : storage::Tier::kDram;
    used[o.tenant] += value.size();
    ++puts;
    return Status::Ok();
  }
  Status Get(const storage::Key& key, std::vector<uint8_t>* out, storage::Tier* from) override {
    std::function<void()> hook;
    Status s = Status::Ok();
    {
      std::lock_guard<std::mutex> lock(mu);
      hook.swap(after_next_get);
      auto it = map.find(key);
      if (it == map.end()) {
        s = Status::NotFound("miss");
      } else {
        *out = it->second.value;
        if (from) *from = it->second.tier;
      }
    }
    if (hook) hook();  // without mu: the hook may call into the store
    return s;
  }
  storage::LookupResult Lookup(std::span<const storage::Key> chain) override {
    std::lock_guard<std::mutex> lock(mu);
    storage::LookupResult r;
    for (const auto& k : chain) {
      auto it = map.find(k);
      if (it == map.end()) {
        r.first_miss = storage::MissReason::kNeverStored;
        break;
      }
      r.tiers.push_back(it->second.tier);
      ++r.hit_count;
    }
    return r;
  }
  // GetBatchVisit as the base class runs it (GetBatch, the visits, then `visited`), followed
  // by after_visited when set: where a real store promotes what the batch read, so that a
  // test can hold the store there and see what its caller did at `visited`.
  void GetBatchVisit(std::span<const storage::Key> keys, const BatchVisitor& visit,
                     const storage::RequestTag& request,
                     const std::function<void()>& visited) override {
    TierManager::GetBatchVisit(keys, visit, request, visited);
    if (after_visited) after_visited();
  }
  Status Prefetch(std::span<const storage::Key>) override { return Status::Ok(); }
  Status Pin(std::span<const storage::Key> keys, uint64_t) override {
    pinned += keys.size();
    return Status::Ok();
  }
  Status Unpin(std::span<const storage::Key>) override { return Status::Ok(); }
  Status Delete(const storage::Key& key) override {
    std::lock_guard<std::mutex> lock(mu);
    auto it = map.find(key);
    if (it == map.end()) return Status::NotFound("absent");
    used[it->second.tenant] -= it->second.value.size();
    map.erase(it);
    return Status::Ok();
  }
  Status DeleteTenant(storage::TenantId tenant) override {
    std::lock_guard<std::mutex> lock(mu);
    for (auto it = map.begin(); it != map.end();) {
      it = it->second.tenant == tenant ? map.erase(it) : std::next(it);
    }
    used[tenant] = 0;
    return Status::Ok();
  }
  void SetTenantQuota(storage::TenantId tenant, uint64_t quota_bytes) override {
    std::lock_guard<std::mutex> lock(mu);
    quotas[tenant] = quota_bytes;
  }
  Status SetPolicy(const std::string& eviction, const std::string& admission,
                   const policies::PolicyParams&) override {
    if (eviction != "lru" && eviction != "fifo") return Status::InvalidArgument("unknown policy");
    std::lock_guard<std::mutex> lock(mu);
    policy = eviction + "/" + admission;
    return Status::Ok();
  }
  storage::Stats GetStats() const override {
    std::lock_guard<std::mutex> lock(mu);
    storage::Stats s;
    s.dram.objects = map.size();
    for (const auto& [t, b] : used) s.tenant_bytes.emplace_back(t, b);
    return s;
  }
  Status Flush() override {
    ++flushes;
    return Status::Ok();
  }

  std::function<void()> after_visited;  // set while no GET runs
  mutable std::mutex mu;
  // Runs hook once, after the next Get has read (outside mu).
  void AfterNextGet(std::function<void()> hook) {
    std::lock_guard<std::mutex> lock(mu);
    after_next_get = std::move(hook);
  }
  std::function<void()> after_next_get;  // guarded by mu
  std::map<storage::Key, Entry> map;
  std::map<storage::TenantId, uint64_t> quotas, used;
  std::string policy;
  std::atomic<int> puts{0}, flushes{0};
  std::atomic<size_t> pinned{0};
};

}  // namespace kvtier::testing
