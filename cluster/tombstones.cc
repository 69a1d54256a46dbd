#include "cluster/tombstones.h"

#include <charconv>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/clock.h"
#include "common/logging.h"

namespace kvtier::cluster {
namespace {

// How often the watch thread looks whether the first catch-up is done.
constexpr uint64_t kWatchStartWaitMs = 20;

std::string Hex(const PeerKey& k) {
  static const char* d = "0123456789abcdef";
  std::string out;
  for (uint8_t b : k) {
    out += d[b >> 4];
    out += d[b & 15];
  }
  return out;
}

bool FromHex(std::string_view s, PeerKey* k) {
  if (s.size() != 64) return false;
  for (size_t i = 0; i < 32; ++i) {
    unsigned v = 0;
    auto [p, ec] = std::from_chars(s.data() + 2 * i, s.data() + 2 * i + 2, v, 16);
    if (ec != std::errc() || p != s.data() + 2 * i + 2) return false;
    (*k)[i] = static_cast<uint8_t>(v);
  }
  return true;
}

std::string Record(const std::vector<std::string>& applied_by) {
  return nlohmann::json{{"applied_by", applied_by}}.dump();
}

// True when the record names node_id in applied_by (a malformed record names nobody).
bool AppliedBy(std::string_view record, const std::string& node_id) {
  if (record.size() > 64 * 1024) return false;
  auto j = nlohmann::json::parse(record, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("applied_by") ||
      !j["applied_by"].is_array()) {
    return false;
  }
  for (const auto& id : j["applied_by"]) {
    if (id.is_string() && id.get_ref<const std::string&>() == node_id) return true;
  }
  return false;
}

}  // namespace

TombstoneLog::TombstoneLog(EtcdClient* etcd, TombstoneOptions options, ApplyKeys apply_keys,
                           ApplyTenant apply_tenant)
    : etcd_(etcd),
      options_(std::move(options)),
      apply_keys_(std::move(apply_keys)),
      apply_tenant_(std::move(apply_tenant)) {
  if (!options_.state_file.empty()) {
    std::ifstream in(options_.state_file);
    int64_t rev = 0;
    if (in >> rev && rev > 0) applied_revision_.store(rev);
  }
}

TombstoneLog::~TombstoneLog() { Stop(); }

StatusOr<int64_t> TombstoneLog::Lease() {
  auto now = std::chrono::steady_clock::now();
  if (lease_id_ != 0 && now - lease_granted_ < std::chrono::seconds(options_.ttl_s / 10 + 1)) {
    return lease_id_;
  }
  KVTIER_ASSIGN_OR_RETURN(EtcdLease lease, etcd_->LeaseGrant(options_.ttl_s));
  lease_id_ = lease.id;
  lease_granted_ = now;
  return lease_id_;
}

Status TombstoneLog::PutUnderLease(const std::vector<std::pair<std::string, std::string>>& kvs) {
  auto lease = Lease();
  if (!lease.ok()) {
    errors_.fetch_add(1);
    return lease.status();
  }
  Status s = etcd_->PutMany(kvs, *lease);
  if (s.IsNotFound()) lease_id_ = 0;  // the lease expired under us: a new one next time
  if (!s.ok()) errors_.fetch_add(1);
  return s;
}

Status TombstoneLog::RecordKeys(std::span<const PeerKey> keys,
                                const std::vector<std::string>& applied_by) {
  std::lock_guard lock(mu_);
  const std::string value = Record(applied_by);
  for (size_t first = 0; first < keys.size(); first += EtcdClient::kTxnOpsMax) {
    std::vector<std::pair<std::string, std::string>> kvs;
    for (size_t i = first; i < std::min(keys.size(), first + EtcdClient::kTxnOpsMax); ++i) {
      kvs.emplace_back(options_.key_prefix + "tombstones/" + Hex(keys[i]), value);
    }
    KVTIER_RETURN_IF_ERROR(PutUnderLease(kvs));
    recorded_.fetch_add(kvs.size());
  }
  return Status::Ok();
}

Status TombstoneLog::RecordTenant(std::string_view tenant,
                                  const std::vector<std::string>& applied_by) {
  std::lock_guard lock(mu_);
  return PutUnderLease(
      {{options_.key_prefix + "tenant_deletes/" + std::string(tenant), Record(applied_by)}});
}

void TombstoneLog::PersistRevision(int64_t revision) {
  applied_revision_.store(revision);
  if (options_.state_file.empty()) return;
  std::string tmp = options_.state_file + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << revision << "\n";
    if (!out) return;
  }
  std::error_code ec;
  std::filesystem::rename(tmp, options_.state_file, ec);
}

Status TombstoneLog::CatchUp() {
  std::lock_guard lock(mu_);
  const int64_t from = applied_revision_.load() + 1;
  const std::string tomb_prefix = options_.key_prefix + "tombstones/";
  const std::string tenant_prefix = options_.key_prefix + "tenant_deletes/";
  auto apply_keys = [&](const std::vector<EtcdKeyValue>& page) {
    std::vector<PeerKey> keys;
    for (const auto& kv : page) {
      PeerKey k{};
      if (AppliedBy(kv.value, options_.node_id)) continue;
      if (!FromHex(std::string_view(kv.key).substr(tomb_prefix.size()), &k)) continue;
      keys.push_back(k);
    }
    if (!keys.empty()) {
      apply_keys_(keys);
      applied_.fetch_add(keys.size());
    }
    return Status::Ok();
  };
  auto apply_tenants = [&](const std::vector<EtcdKeyValue>& page) {
    for (const auto& kv : page) {
      if (AppliedBy(kv.value, options_.node_id)) continue;
      apply_tenant_(std::string_view(kv.key).substr(tenant_prefix.size()));
      tenants_applied_.fetch_add(1);
    }
    return Status::Ok();
  };
  // Both prefixes at one revision: every record up to it is applied when this returns OK.
  auto revision = etcd_->RangePrefixPaged(tomb_prefix, options_.page_keys, from, 0, apply_keys);
  if (revision.ok()) {
    revision =
        etcd_->RangePrefixPaged(tenant_prefix, options_.page_keys, from, *revision, apply_tenants);
  }
  if (!revision.ok()) {
    errors_.fetch_add(1);
    return revision.status().WithContext("tombstone catch-up");
  }
  PersistRevision(*revision);
  caught_up_.store(true, std::memory_order_release);
  return Status::Ok();
}

void TombstoneLog::StartPolling() {
  poller_ = std::thread([this] {
    std::unique_lock lock(stop_mu_);
    while (!stop_) {
      wake_ = false;  // a record seen from here on wakes the next wait
      lock.unlock();
      Status s = CatchUp();
      uint64_t held = 0;
      if (!s.ok() && poll_failed_log_.Allow(DefaultSteadyClock().NowMs(), &held)) {
        KVTIER_LOG(kWarn) << "cluster: " << s.message() << " (" << held
                          << " more failures since the last such line; retried every "
                          << options_.poll_ms << " ms)";
      }
      lock.lock();
      stop_cv_.wait_for(lock, std::chrono::milliseconds(options_.poll_ms),
                        [&] { return stop_ || wake_; });
    }
  });
  watcher_ = std::thread([this] { WatchLoop(); });
}

void TombstoneLog::WatchLoop() {
  const std::string tomb_prefix = options_.key_prefix + "tombstones/";
  const std::string tenant_prefix = options_.key_prefix + "tenant_deletes/";
  // The revision to watch from: the one after the first catch-up's, then after the last one a
  // watch delivered, so a record put between a catch-up (or a watch that ended) and the next
  // watch is seen too. 0: from now (after a compaction took the revision away).
  int64_t from = -1;  // not known before the first catch-up
  auto wait_ms = [&](uint64_t ms) {
    std::unique_lock lock(stop_mu_);
    stop_cv_.wait_for(lock, std::chrono::milliseconds(ms), [&] { return stop_; });
  };
  while (!watch_stop_.load(std::memory_order_acquire)) {
    if (from < 0) {
      if (!caught_up()) {
        wait_ms(kWatchStartWaitMs);
        continue;
      }
      from = applied_revision_.load() + 1;
    }
    Status s = etcd_->Watch(
        options_.key_prefix, from,
        [&](const std::vector<EtcdEvent>& events, int64_t revision) {
          if (revision > 0) from = revision + 1;
          for (const EtcdEvent& e : events) {
            if (e.type != EtcdEvent::Type::kPut) continue;
            const std::string_view key = e.kv.key;
            if (!key.starts_with(tomb_prefix) && !key.starts_with(tenant_prefix)) continue;
            if (AppliedBy(e.kv.value, options_.node_id)) continue;
            {
              std::lock_guard lock(stop_mu_);
              wake_ = true;
            }
            stop_cv_.notify_all();
            watch_wakeups_.fetch_add(1);
            return;  // one wake-up per batch: the catch-up reads every record anyway
          }
        },
        &watch_stop_);
    if (watch_stop_.load(std::memory_order_acquire) || s.IsRetry()) continue;  // silent: again
    if (s.IsRejected()) from = 0;  // compacted: from now on (the poll applies the rest)
    uint64_t held = 0;
    if (watch_ended_log_.Allow(DefaultSteadyClock().NowMs(), &held)) {
      KVTIER_LOG(kWarn) << "cluster: tombstone watch ended: " << s.message() << " (" << held
                        << " more since the last such line; the poll applies records meanwhile)";
    }
    wait_ms(options_.poll_ms);
  }
}

void TombstoneLog::Stop() {
  {
    std::lock_guard lock(stop_mu_);
    stop_ = true;
  }
  watch_stop_.store(true, std::memory_order_release);
  stop_cv_.notify_all();
  if (poller_.joinable()) poller_.join();
  if (watcher_.joinable()) watcher_.join();
}

TombstoneStats TombstoneLog::stats() const {
  return {recorded_.load(), applied_.load(),          tenants_applied_.load(),
          errors_.load(),   applied_revision_.load(), watch_wakeups_.load()};
}

}  // namespace kvtier::cluster
