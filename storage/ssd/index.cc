#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "common/logging.h"
#include "storage/ssd/tier_impl.h"

namespace kvtier::storage {

namespace {

// Index entries loaded per lock hold by the background load (bounds the pause it causes).
constexpr size_t kLoadBatchEntries = 4096;

}  // namespace

void SsdTier::Impl::LoadIndex() {
  std::vector<std::pair<Key, IndexEntry>> batch;
  std::vector<std::pair<Key, SsdMeta>> inserted;
  std::vector<Key> bad;
  Status iter_status;
  bool done = false;
  while (!done && !stop_load_.load()) {
    batch.clear();
    bad.clear();
    for (; batch.size() + bad.size() < kLoadBatchEntries && load_iter_->Valid();
         load_iter_->Next()) {
      Key k{};
      IndexEntry e;
      rocksdb::Slice ks = load_iter_->key(), vs = load_iter_->value();
      if (ks.size() != k.size()) continue;
      std::memcpy(k.data(), ks.data(), k.size());
      if (!ssd::DecodeIndexEntry({reinterpret_cast<const uint8_t*>(vs.data()), vs.size()}, &e)
               .ok()) {
        bad.push_back(k);
        continue;
      }
      batch.emplace_back(k, e);
    }
    if (!load_iter_->Valid()) {
      iter_status = FromRocks(load_iter_->status(), "scan index");
      done = true;
    }
    inserted.clear();
    {
      std::lock_guard lock(mu_);
      for (const Key& k : bad) {
        if (map_.count(k) || tombstones_.count(k)) continue;
        PushPending({k, true, {}});
        ++stats_.dropped_on_recovery;
      }
      for (const auto& [k, e] : batch) {
        if (map_.count(k) || tombstones_.count(k)) continue;  // newer state since Open
        if (!segments_.count(e.segment) || TornAtOpen(e)) {
          PushPending({k, true, {}});
          ++stats_.dropped_on_recovery;
          continue;
        }
        next_seq_ = std::max(next_seq_, e.seq + 1);
        Insert(k, e);
        if (o_.on_index_load) inserted.emplace_back(k, MetaOf(e));
      }
      inserted.insert(inserted.end(), point_loaded_.begin(), point_loaded_.end());
      point_loaded_.clear();
      if (done && iter_status.ok()) {
        loaded_ = true;
        tombstones_.clear();
        stats_.index_load_ms = (NowUs() - open_us_) / 1000;
      }
    }
    if (o_.on_index_load && !inserted.empty()) o_.on_index_load(inserted);
  }
  if (!iter_status.ok()) {
    // Entries past the failure stay reachable by point reads (FindLocked keeps working only
    // while loading), so a failed scan keeps the tier in loading mode, with the deferred
    // cleaning never run: live bytes stay unknown. The load ends in its error (waiters wake
    // and see it: a put that needs room fails, and so do ForEach and WaitForIndexLoad).
    KVTIER_LOG(kError) << "ssd index load failed: " << iter_status.ToString()
                       << "; unloaded entries are served by point reads, but no room can be "
                          "made (no eviction beyond the loaded entries, no cleaning) until a "
                          "restart loads the index";
    {
      std::lock_guard lock(mu_);
      load_status_ = iter_status.WithContext("ssd index load failed");
      load_finished_ = true;
      load_cv_.notify_all();
    }
    // Entries met by point reads from now on are still reported, by this thread, until close.
    std::vector<std::pair<Key, SsdMeta>> point;
    while (true) {
      {
        std::unique_lock lock(mu_);
        load_cv_.wait(lock, [&] { return stop_load_.load() || !point_loaded_.empty(); });
        if (stop_load_.load()) return;
        point.swap(point_loaded_);
        point_loaded_.clear();
      }
      if (o_.on_index_load) o_.on_index_load(point);
      point.clear();
    }
  }
  if (!done) return;  // cancelled by close
  std::lock_guard lock(mu_);
  // Only now, after the last batch was reported: a waiter must not see the load finished
  // while on_index_load still has entries to report.
  load_finished_ = true;
  load_cv_.notify_all();
  // Cleaning was deferred while live bytes were only partly known.
  seg_cv_.notify_all();
}

std::unordered_map<Key, IndexEntry, KeyHash>::iterator SsdTier::Impl::FindLocked(
    const Key& key, std::unique_lock<std::mutex>& lock) {
  auto it = map_.find(key);
  if (it != map_.end() || loaded_ || tombstones_.count(key)) return it;
  lock.unlock();
  std::string v;
  rocksdb::Status rs = db_->Get({}, index_cf_, KeySlice(key), &v);
  lock.lock();
  it = map_.find(key);  // state may have changed while unlocked
  if (it != map_.end() || loaded_ || tombstones_.count(key) || !rs.ok()) return it;
  IndexEntry e;
  if (!ssd::DecodeIndexEntry({reinterpret_cast<const uint8_t*>(v.data()), v.size()}, &e).ok() ||
      !segments_.count(e.segment) || TornAtOpen(e)) {
    tombstones_.insert(key);  // the load must not insert it either
    PushPending({key, true, {}});
    ++stats_.dropped_on_recovery;
    return map_.end();
  }
  next_seq_ = std::max(next_seq_, e.seq + 1);
  Insert(key, e);
  // Reported by the load thread with its next batch (never from here: the caller may hold
  // locks of its own); after a failed load, as they come.
  if (o_.on_index_load) {
    point_loaded_.emplace_back(key, MetaOf(e));
    if (load_finished_) load_cv_.notify_all();
  }
  return map_.find(key);
}

void SsdTier::Impl::SetTracked(const Key& key, bool tracked) {
  std::lock_guard lock(mu_);
  if (tracked) {
    if (untracked_.erase(key) == 0) return;
    auto it = map_.find(key);
    if (it != map_.end()) Track(key, it->second);
  } else {
    if (!untracked_.insert(key).second) return;
    Untrack(key);
  }
}

Status SsdTier::Impl::SetPolicy(const std::string& eviction, const policies::PolicyParams& params) {
  KVTIER_ASSIGN_OR_RETURN(auto policy, policies::MakeEvictionPolicy(eviction, params));
  std::lock_guard lock(mu_);
  policy_ = policies::WithStructure(std::move(policy), o_.structure, &layer_);
  capacity_told_ = false;
  current_request_ = 0;
  id_to_key_.clear();
  std::vector<std::pair<uint64_t, Key>> order;
  for (const auto& [k, e] : map_) order.emplace_back(e.last_access_unix_ms, k);
  std::sort(order.begin(), order.end());
  for (const auto& [t, k] : order) Track(k, map_.at(k));
  return Status::Ok();
}

}  // namespace kvtier::storage
