#include "cache_daemon/resp_key_index.h"

#include <algorithm>
#include <chrono>

namespace kvtier::daemon {
namespace {

// The smallest storage key whose position is `cursor` (>= 1).
storage::Key FirstKeyAt(uint64_t cursor) {
  uint64_t prefix = (cursor - 1) << 1;
  storage::Key k{};
  for (int i = 0; i < 8; ++i) k[i] = static_cast<uint8_t>(prefix >> (56 - 8 * i));
  return k;
}

}  // namespace

uint64_t RespKeyIndex::CursorOf(const storage::Key& k) {
  uint64_t prefix = 0;
  for (int i = 0; i < 8; ++i) prefix = (prefix << 8) | k[i];
  return (prefix >> 1) + 1;
}

RespKeyIndex::~RespKeyIndex() {
  {
    std::lock_guard<std::mutex> l(stop_mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  if (syncer_.joinable()) syncer_.join();
}

void RespKeyIndex::SyncEvery(uint64_t interval_ms) {
  std::unique_lock<std::mutex> l(stop_mu_);
  while (!stop_cv_.wait_for(l, std::chrono::milliseconds(interval_ms), [this] { return stop_; })) {
    l.unlock();
    Checkpoint();
    (void)WaitSynced(appended_.load());  // failures are counted in log_errors_
    l.lock();
  }
}

Status RespKeyIndex::Persist(const std::string& path, bool sync_adds, uint64_t sync_interval_ms,
                             LogSource source) {
  std::lock_guard<std::mutex> lock(mu_);
  std::optional<storage::LogPosition> checkpoint;
  auto replay = [this, &checkpoint](const RespNameLog::Record& r) {
    switch (r.op) {
      case RespNameLog::Op::kAdd:
        (void)AddLocked(r.tenant, r.key, r.name);
        break;
      case RespNameLog::Op::kRemove:
        RemoveLocked(r.tenant, r.key);
        break;
      case RespNameLog::Op::kRemoveTenant:
        RemoveTenantLocked(r.tenant);
        break;
      case RespNameLog::Op::kCheckpoint:
        checkpoint = r.position;
        break;
    }
  };
  KVTIER_ASSIGN_OR_RETURN(log_, RespNameLog::Open(path, name_bytes_max_, replay));
  sync_adds_ = sync_adds;
  source_ = std::move(source);
  if (source_.end && source_.replay) {
    // Names appended after the last durable checkpoint may be lost; their units' records,
    // all at or after it, carry them. (No checkpoint: a version 1 log, whose adds were synced
    // before their puts, or a new one.)
    uint64_t found = 0;
    if (checkpoint) {
      Status st = source_.replay(
          *checkpoint, [&](uint64_t tenant, const storage::Key& k, std::string_view name) {
            auto t = keys_.find(tenant);
            if (t != keys_.end() && t->second.count(k) != 0) return;
            if (!AddLocked(tenant, k, name)) return;
            ++found;
            (void)AppendLocked({RespNameLog::Op::kAdd, tenant, k, name});
          });
      KVTIER_RETURN_IF_ERROR(st);
    }
    recovered_from_store_.store(found);
    if (log_->version() < RespNameLog::kVersion) {
      CompactLocked();  // version 2, with a checkpoint
    } else if (std::optional<storage::LogPosition> end = source_.end()) {
      CheckpointLocked(*end);
    }
    // Durable before the first write: the next start reads the store from here on.
    std::unique_lock<std::mutex> s(sync_mu_);
    sync_cv_.wait(s, [this] { return !syncing_; });
    Status synced = log_->Sync();
    if (!synced.ok()) return synced;
    synced_ = std::max(synced_, written_.load());
  }
  MaybeCompactLocked();
  if (sync_interval_ms > 0 && (!sync_adds || source_.end)) {
    // The names ride in their units and a checkpoint follows within sync_interval_ms: adds
    // can wait in memory for it (or for the next writer) instead of a write each.
    buffer_adds_ = source_.end && source_.replay;
    syncer_ = std::thread([this, sync_interval_ms] { SyncEvery(sync_interval_ms); });
  }
  return Status::Ok();
}

Status RespKeyIndex::AppendLocked(const RespNameLog::Record& r) {
  Status st = log_->Append(r);  // writes the buffered records first, in order
  if (!st.ok()) {
    log_errors_.fetch_add(1);
    return st;
  }
  written_.store(appended_.fetch_add(1) + 1);
  return st;
}

Status RespKeyIndex::WritePendingLocked() {
  if (log_ == nullptr || log_->pending_records() == 0) return Status::Ok();
  Status st = log_->WritePending();
  if (!st.ok()) {
    log_errors_.fetch_add(1);
    return st;
  }
  written_.store(appended_.load());
  return st;
}

void RespKeyIndex::CheckpointLocked(const storage::LogPosition& at) {
  if (log_ == nullptr || last_checkpoint_ == at) return;
  // Append writes the buffered names first: every name added before `at` was read precedes it.
  RespNameLog::Record r{RespNameLog::Op::kCheckpoint, 0, {}, {}, at};
  if (!AppendLocked(r).ok()) return;
  last_checkpoint_ = at;
  MaybeCompactLocked();
}

void RespKeyIndex::Checkpoint() {
  if (!source_.end) return;
  // Read before the checkpoint is appended: every record before it was put after its name
  // was appended (Add comes before the put), so that name lies before the checkpoint.
  std::optional<storage::LogPosition> end = source_.end();
  if (!end) return;
  std::lock_guard<std::mutex> lock(mu_);
  CheckpointLocked(*end);
}

bool RespKeyIndex::AddLocked(uint64_t tenant, const storage::Key& k, std::string_view name) {
  std::map<storage::Key, std::string>& keys = keys_[tenant];
  if (keys.find(k) != keys.end()) return true;
  uint64_t cost = name.size() + kEntryOverheadBytes;
  if (keys.size() >= keys_per_tenant_max_ || bytes_ + cost > name_bytes_max_) {
    ++unindexed_;
    return false;
  }
  keys.emplace(k, std::string(name));
  bytes_ += cost;
  return true;
}

void RespKeyIndex::RemoveLocked(uint64_t tenant, const storage::Key& k) {
  auto t = keys_.find(tenant);
  if (t == keys_.end()) return;
  auto it = t->second.find(k);
  if (it == t->second.end()) return;
  bytes_ -= it->second.size() + kEntryOverheadBytes;
  t->second.erase(it);
}

void RespKeyIndex::RemoveTenantLocked(uint64_t tenant) {
  auto t = keys_.find(tenant);
  if (t == keys_.end()) return;
  for (const auto& [k, name] : t->second) bytes_ -= name.size() + kEntryOverheadBytes;
  keys_.erase(t);
}

void RespKeyIndex::LogLocked(const RespNameLog::Record& r) {
  if (log_ == nullptr) return;
  if (!AppendLocked(r).ok()) return;
  MaybeCompactLocked();
}

void RespKeyIndex::MaybeCompactLocked() {
  if (log_ == nullptr) return;
  uint64_t file = log_->file_bytes();
  if (file <= kLogCompactBytesMin || file <= 2 * bytes_) return;
  CompactLocked();
}

void RespKeyIndex::CompactLocked() {
  // No sync may run on the descriptor the rewrite replaces.
  {
    std::unique_lock<std::mutex> s(sync_mu_);
    sync_cv_.wait(s, [this] { return !syncing_; });
    syncing_ = true;
  }
  // The rewrite holds every indexed name, so the store's end now is a checkpoint for it
  // (read under mu_: no Add appends meanwhile).
  std::optional<storage::LogPosition> end;
  if (source_.end) end = source_.end();
  Status st = log_->Rewrite([&](const std::function<void(const RespNameLog::Record&)>& emit) {
    for (const auto& [tenant, keys] : keys_) {
      for (const auto& [k, name] : keys) emit({RespNameLog::Op::kAdd, tenant, k, name});
    }
    if (end) emit({RespNameLog::Op::kCheckpoint, 0, {}, {}, *end});
  });
  if (!st.ok()) log_errors_.fetch_add(1);
  if (st.ok() && end) last_checkpoint_ = end;
  // The rewrite dropped the buffered records: it holds what they led to.
  if (st.ok()) written_.store(appended_.load());
  std::lock_guard<std::mutex> s(sync_mu_);
  syncing_ = false;
  // The rewritten log holds every entry durably (a failed rewrite left the old log in use).
  if (st.ok()) synced_ = std::max(synced_, appended_.load());
  sync_cv_.notify_all();
}

Status RespKeyIndex::WaitSynced(uint64_t seq) {
  if (written_.load() < seq) {
    // Buffered: written first (mu_ before sync_mu_, as CompactLocked takes them).
    std::lock_guard<std::mutex> lock(mu_);
    KVTIER_RETURN_IF_ERROR(WritePendingLocked());
    if (written_.load() < seq) return Status::IOError("resp name log: record not written");
  }
  std::unique_lock<std::mutex> l(sync_mu_);
  while (synced_ < seq) {
    if (syncing_) {
      sync_cv_.wait(l);
      continue;
    }
    // Leader: one fdatasync covers every record written before it starts.
    syncing_ = true;
    uint64_t target = written_.load();
    l.unlock();
    Status st = log_->Sync();
    l.lock();
    syncing_ = false;
    if (st.ok()) synced_ = std::max(synced_, target);
    sync_cv_.notify_all();
    if (!st.ok()) {
      log_errors_.fetch_add(1);
      return st;
    }
  }
  return Status::Ok();
}

Status RespKeyIndex::WaitDurable(uint64_t durable_seq) {
  if (log_ == nullptr || !sync_adds_ || durable_seq == 0) return Status::Ok();
  return WaitSynced(durable_seq);
}

Status RespKeyIndex::Add(uint64_t tenant, const storage::Key& k, std::string_view name,
                         bool* indexed, uint64_t* durable_seq) {
  uint64_t wait = 0;
  bool in = true;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::map<storage::Key, std::string>& keys = keys_[tenant];
    if (keys.find(k) != keys.end()) {
      // Indexed already, perhaps by an Add whose sync has not finished: wait for it too.
      wait = appended_.load();
    } else if (log_ != nullptr && keys.size() < keys_per_tenant_max_ &&
               bytes_ + name.size() + kEntryOverheadBytes <= name_bytes_max_) {
      const RespNameLog::Record r{RespNameLog::Op::kAdd, tenant, k, name};
      if (buffer_adds_) {
        // Written with the next record, checkpoint or sync, or once kPendingBytesMax gather
        // (Persist: the unit carries the name until then).
        KVTIER_RETURN_IF_ERROR(log_->Buffer(r));
        wait = appended_.fetch_add(1) + 1;
        if (log_->pending_bytes() >= kPendingBytesMax) (void)WritePendingLocked();
      } else {
        KVTIER_RETURN_IF_ERROR(AppendLocked(r));
        wait = appended_.load();
      }
      (void)AddLocked(tenant, k, name);
      MaybeCompactLocked();
    } else {
      in = AddLocked(tenant, k, name);
    }
  }
  if (indexed != nullptr) *indexed = in;
  if (durable_seq != nullptr) {
    *durable_seq = wait;
    return Status::Ok();
  }
  return WaitDurable(wait);
}

void RespKeyIndex::Remove(uint64_t tenant, const storage::Key& k) {
  std::lock_guard<std::mutex> lock(mu_);
  auto t = keys_.find(tenant);
  if (t == keys_.end() || t->second.find(k) == t->second.end()) return;
  RemoveLocked(tenant, k);
  LogLocked({RespNameLog::Op::kRemove, tenant, k, {}});
}

void RespKeyIndex::RemoveTenant(uint64_t tenant) {
  std::lock_guard<std::mutex> lock(mu_);
  if (keys_.find(tenant) == keys_.end()) return;
  RemoveTenantLocked(tenant);
  LogLocked({RespNameLog::Op::kRemoveTenant, tenant, {}, {}});
}

Status RespKeyIndex::Flush() {
  if (log_ == nullptr) return Status::Ok();
  Checkpoint();
  return WaitSynced(appended_.load());
}

uint64_t RespKeyIndex::Scan(uint64_t tenant, uint64_t cursor, size_t count, std::vector<Entry>* out,
                            uint64_t names_bytes_max) const {
  out->clear();
  std::lock_guard<std::mutex> lock(mu_);
  auto t = keys_.find(tenant);
  if (t == keys_.end()) return 0;
  const std::map<storage::Key, std::string>& keys = t->second;
  auto it = cursor == 0 ? keys.begin() : keys.lower_bound(FirstKeyAt(cursor));
  uint64_t last = 0, names_bytes = 0;
  for (; it != keys.end(); ++it) {
    uint64_t pos = CursorOf(it->first);
    if ((out->size() >= count || names_bytes >= names_bytes_max) && pos != last) return pos;
    out->push_back(Entry{it->first, it->second});
    names_bytes += it->second.size();
    last = pos;
  }
  return 0;
}

size_t RespKeyIndex::size(uint64_t tenant) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto t = keys_.find(tenant);
  return t == keys_.end() ? 0 : t->second.size();
}

bool RespKeyIndex::Contains(uint64_t tenant, const storage::Key& k) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto t = keys_.find(tenant);
  return t != keys_.end() && t->second.count(k) != 0;
}

bool RespKeyIndex::AtLimit(uint64_t tenant, const storage::Key& k, size_t name_bytes) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto t = keys_.find(tenant);
  if (t != keys_.end() && t->second.count(k) != 0) return false;
  const size_t held = t == keys_.end() ? 0 : t->second.size();
  return held >= keys_per_tenant_max_ ||
         bytes_ + name_bytes + kEntryOverheadBytes > name_bytes_max_;
}

std::optional<uint64_t> RespKeyIndex::LargestTenantBesides(uint64_t besides) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::optional<uint64_t> largest;
  size_t most = 0;
  for (const auto& [tenant, keys] : keys_) {
    if (tenant != besides && keys.size() > most) {
      most = keys.size();
      largest = tenant;
    }
  }
  return largest;
}

uint64_t RespKeyIndex::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

uint64_t RespKeyIndex::unindexed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return unindexed_;
}

uint64_t RespKeyIndex::log_errors() const { return log_errors_.load(); }

}  // namespace kvtier::daemon
