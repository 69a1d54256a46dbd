#include "cache_daemon/cluster_refetch.h"

#include <algorithm>
#include <optional>
#include <vector>

#include "common/clock.h"
#include "common/logging.h"

namespace kvtier::daemon {

ClusterRefetch::ClusterRefetch(storage::TierManager* store, const TenantRegistry* tenants,
                               cluster::Router* router, cluster::RecentDeletes* recent,
                               RefetchOptions options)
    : store_(store), tenants_(tenants), router_(router), recent_(recent), options_(options) {}

ClusterRefetch::~ClusterRefetch() { Stop(); }

void ClusterRefetch::Start() {
  thread_ = std::thread([this] { Run(); });
}

void ClusterRefetch::Stop() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
    queue_.clear();
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void ClusterRefetch::Report(const storage::UnitInfo& unit) {
  {
    std::lock_guard lock(mu_);
    if (stop_) return;
    if (queue_.size() >= options_.queue_max) {
      dropped_.fetch_add(1);
      return;
    }
    queue_.push_back({unit, DefaultSteadyClock().NowMs()});
  }
  cv_.notify_one();
}

RefetchStats ClusterRefetch::stats() const {
  return {refetched_.load(), failed_.load(), dropped_.load(), skipped_.load(), superseded_.load()};
}

void ClusterRefetch::Run() {
  for (;;) {
    Reported unit;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      unit = queue_.front();
      queue_.pop_front();
    }
    Refetch(unit);
  }
}

void ClusterRefetch::Refetch(const Reported& reported) {
  const storage::UnitInfo& u = reported.unit;
  const Tenant* tenant = tenants_->FindById(u.tenant);
  const bool native =
      u.kind == policies::ObjectKind::kGlobalKv || u.kind == policies::ObjectKind::kSwa;
  if (!native || tenant == nullptr || !router_->OwnsLocally(u.key) ||
      router_->View()->members.empty()) {
    skipped_.fetch_add(1);
    return;
  }
  auto deleted = [&] { return recent_ != nullptr && recent_->RefusesRepair(u.key, tenant->name); };
  // Already back (a client put it again, or an earlier report of the same unit was served).
  if (deleted() || store_->Probe(std::span<const storage::Key>(&u.key, 1)).hit_count == 1) {
    skipped_.fetch_add(1);
    return;
  }
  std::vector<Status> statuses(1, Status::NotFound("not fetched"));
  std::vector<std::span<const uint8_t>> values(1);
  std::vector<cluster::PeerBytes> replies;  // what values[0] points into
  std::vector<std::optional<uint64_t>> fetched_ttl_ms(1);
  router_->GetRemote(std::span<const storage::Key>(&u.key, 1), std::vector<bool>{true}, &statuses,
                     &values, &replies, &fetched_ttl_ms);
  if (!statuses[0].ok()) {
    failed_.fetch_add(1);
    KVTIER_LOG(kWarn) << "cluster: no other owner holds a unit quarantined here for a checksum "
                         "failure; it is lost on this node";
    return;
  }
  storage::PutOptions po;
  po.tenant = u.tenant;
  po.kind = u.kind;
  po.parent = u.parent;
  po.recompute_tokens = u.recompute_tokens;
  if (u.ttl_left_ms > 0) {  // what the lost record had left, counted from its report
    const uint64_t elapsed = DefaultSteadyClock().NowMs() - reported.reported_ms;
    if (elapsed >= u.ttl_left_ms) {
      skipped_.fetch_add(1);
      return;
    }
    po.ttl_ms = u.ttl_left_ms - elapsed;
  }
  // And no later than the version fetched, which may be newer than the lost record (a PUT
  // the other owner took first): its TTL, counted from the fetch (0: none). A peer older
  // than the TTL trailer reports none (nullopt).
  if (fetched_ttl_ms[0].has_value() && *fetched_ttl_ms[0] != 0) {
    po.ttl_ms = po.ttl_ms == 0 ? *fetched_ttl_ms[0] : std::min(po.ttl_ms, *fetched_ttl_ms[0]);
  }
  po.highest_tier = u.tier == storage::Tier::kNone ? storage::Tier::kSsd : u.tier;
  po.allow_ssd = u.allow_ssd;
  // Only if absent: the other owner may have read the fetched value just before a client
  // PUT of a newer value reached it, and that PUT may have reached this node since; a unit
  // written here meanwhile is that newer value, and stays (docs/CLUSTER.md, "Versions").
  bool held = false;
  po.if_absent = true;
  po.held = &held;
  if (deleted()) {
    skipped_.fetch_add(1);
    return;
  }
  Status put = store_->Put(u.key, values[0], po);
  if (held) {
    superseded_.fetch_add(1);
    return;
  }
  if (!put.ok()) {
    failed_.fetch_add(1);
    KVTIER_LOG(kWarn) << "cluster: rewriting a unit after a checksum failure: " << put.message();
    return;
  }
  if (deleted()) {  // a delete reached this node while the copy was in flight: apply it again
    (void)store_->Delete(u.key);
    skipped_.fetch_add(1);
    return;
  }
  refetched_.fetch_add(1);
}

}  // namespace kvtier::daemon
