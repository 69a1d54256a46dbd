#include <rocksdb/write_batch.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "common/logging.h"
#include "storage/ssd/tier_impl.h"

namespace kvtier::storage {

Status SsdTier::Impl::PrepareLocked(CommitBatch* b) {
  b->empty = true;
  if (buf_len_ == 0 && pending_.empty() && unsynced_segs_.empty()) return Status::Ok();
  WriteBufferLocked(/*wake_writer=*/false);  // Execute writes it
  b->empty = false;
  b->writers = sync_puts_.load(std::memory_order_relaxed) - prepared_puts_;
  prepared_puts_ += b->writers;
  b->write_seq_lo = prepared_seq_;
  b->write_seq_hi = enqueued_seq_;
  prepared_seq_ = enqueued_seq_;
  b->ops.clear();
  b->ops.swap(pending_);
  pending_.swap(spare_ops_);  // empty; its capacity is a settled commit's (Settle)
  for (const PendingOp& op : b->ops) {
    if (op.is_delete && !op.eviction) b->sync_index = true;
  }
  if (sync_index_next_) b->sync_index = true;  // too many unsynced evictions
  sync_index_next_ = false;
  b->last_ticket = pending_ticket_;
  b->first_ticket = pending_ticket_ - b->ops.size() + 1;
  b->sync_segs = std::move(unsynced_segs_);
  unsynced_segs_.clear();
  b->durable_segment = active_->id;
  b->durable_end = buf_file_offset_;
  b->next_seq = next_seq_;
  b->max_version = max_version_;
  std::lock_guard c(cstate_mu_);
  commit_inflight_ = true;
  return Status::Ok();
}

Status SsdTier::Impl::Execute(const CommitBatch& b, Status* write_status, CommitStage* stage) {
  *stage = CommitStage::kNone;
  bool durable = o_.durability != Durability::kNone;
  // Every buffer of this commit must have reached the device before the sync; records of a
  // failed buffer are never indexed.
  std::vector<FailedWrite> failed;
  {
    std::unique_lock wb(wb_mu_);
    while (completed_seq_ < b.write_seq_hi) {
      // The commit writes its own buffers rather than wake the writer thread and wait for
      // it; it waits only while a write is running (the writer's, or another commit's).
      if (!writer_busy_ && !wb_queue_.empty()) {
        WriteQueuedLocked(wb, b.write_seq_hi);
      } else {
        wb_cv_.wait(wb);
      }
    }
    for (const FailedWrite& f : failed_writes_) {
      if (f.seq > b.write_seq_lo && f.seq <= b.write_seq_hi) failed.push_back(f);
    }
    std::erase_if(failed_writes_, [&](const FailedWrite& f) { return f.seq <= b.write_seq_hi; });
  }
  *write_status = failed.empty() ? Status::Ok() : failed.front().status;
  auto lost = [&](const IndexEntry& e) {
    for (const FailedWrite& f : failed) {
      if (e.segment == f.segment && e.offset >= f.offset && e.offset < f.offset + f.len) {
        return true;
      }
    }
    return false;
  };
  Status st;
  if (durable) {
    for (const auto& seg : b.sync_segs) {
      syncs_.fetch_add(1);
      st = seg->dev->Sync(true);
      if (!st.ok()) {
        *stage = CommitStage::kSync;
        break;
      }
    }
  }
  if (st.ok() && db_ == nullptr) {
    // A reopen after a failed index write failed to open it: again now (not with mu_ held).
    st = b.mu_held ? Status::IOError("ssd index: not open (reopening it failed)")
                   : OpenIndexDb().WithContext("ssd index: opening it again");
    if (st.ok()) index_reopens_.fetch_add(1);
    if (!st.ok()) *stage = CommitStage::kIndexWrite;
  }
  if (st.ok()) {
    rocksdb::WriteBatch wb;
    for (const auto& op : b.ops) {
      if (!op.is_delete && lost(op.entry)) continue;
      rocksdb::Status rs =
          op.is_delete ? wb.Delete(index_cf_, KeySlice(op.key))
                       : wb.Put(index_cf_, KeySlice(op.key), ssd::EncodeIndexEntry(op.entry));
      st = FromRocks(rs, "batch");
      if (!st.ok()) break;
    }
    if (st.ok()) {
      char de[12];
      std::memcpy(de, &b.durable_segment, 4);
      std::memcpy(de + 4, &b.durable_end, 8);
      char counters[16];
      std::memcpy(counters, &b.next_seq, 8);
      std::memcpy(counters + 8, &b.max_version, 8);
      st = FromRocks(wb.Put(meta_cf_, "durable_end", {de, 12}), "batch");
      if (st.ok()) st = FromRocks(wb.Put(meta_cf_, "counters", {counters, 16}), "batch");
    }
    if (st.ok()) {
      // The data sync above is the commit's only sync unless the batch must not be lost
      // from the index (CommitBatch): Open's tail scan recovers the rest from the segments.
      rocksdb::WriteOptions wo;
      // A failed buffer write left a hole in its segment, where the recovery tail scan stops:
      // durable_end must be durable past it before any later put relies on that scan.
      wo.sync = durable && (b.sync_index || !failed.empty());
      st = FromRocks(db_->Write(wo, &wb), "index write");
      if (st.ok() && wo.sync) index_syncs_.fetch_add(1);
      if (!st.ok() && !b.mu_held) {
        // RocksDB refuses every write after a failed write-ahead-log sync (its background
        // error) and does not resume from it in place: without a reopen, one transient EIO
        // under the index failed every later commit until a restart. This commit still
        // fails (its ops are retried by the next, with a sync); when the reopen fails too,
        // the next failed commit tries again.
        Status reopened = ReopenIndexDb();
        if (reopened.ok()) {
          index_reopens_.fetch_add(1);
        } else {
          KVTIER_LOG(kWarn) << "ssd index: reopening after a failed write: " << reopened.ToString();
        }
      }
    }
    if (!st.ok()) *stage = CommitStage::kIndexWrite;
  }
  if (st.ok() && !write_status->ok()) *stage = CommitStage::kBufferWrite;
  // The writers that appended while this commit ran, before it releases its own: with them,
  // the group the next leader waits for (Settle).
  puts_at_sync_end_.store(sync_puts_.load(std::memory_order_relaxed), std::memory_order_relaxed);
  {
    std::lock_guard c(cstate_mu_);
    // A failed buffer write fails every ticket of the commit (the waiters learn it here,
    // without taking mu_ again): a put reported failed may have been stored, never the reverse.
    Status ticket_st = st.ok() ? *write_status : st;
    if (b.last_ticket >= b.first_ticket && !ticket_st.ok()) {
      failed_.push_back({b.first_ticket, b.last_ticket, ticket_st});
      if (failed_.size() > kMaxFailedRanges) failed_.pop_front();
    }
    committed_ticket_ = std::max(committed_ticket_, b.last_ticket);
    commit_inflight_ = false;
  }
  cstate_cv_.notify_all();
  return st;
}

void SsdTier::Impl::Settle(CommitBatch* b, const Status& st, CommitStage stage) {
  ReapLocked();  // drops the entries of failed buffer writes before ops are retried
  if (b->writers > 0) {
    // Commits are serialised: prepared_puts_ is still this commit's.
    expected_writers_ =
        b->writers + (puts_at_sync_end_.load(std::memory_order_relaxed) - prepared_puts_);
    stats_.commit_writers += b->writers;
  }
  if (stage != CommitStage::kNone) {
    ++stats_.commit_failures;
    stats_.last_failed_stage = stage;
    uint64_t held = 0;
    if (commit_failure_log_.Allow(NowUs() / 1000, &held)) {
      KVTIER_LOG(kWarn) << "ssd commit failed at " << CommitStageName(stage) << ": "
                        << (st.ok() ? "a buffer write failed" : st.ToString()) << " (" << held
                        << " more failed commits since the last such line)";
    }
  }
  // Whatever happens below copies what it keeps: the vector goes back for pending_'s reuse.
  struct Recycle {
    Impl* impl;
    std::vector<PendingOp>* ops;
    ~Recycle() {
      if (ops->capacity() > kSpareOpsKeep || ops->capacity() <= impl->spare_ops_.capacity()) {
        return;
      }
      ops->clear();
      impl->spare_ops_.swap(*ops);
    }
  } recycle{this, &b->ops};
  // The data reached the device unless the sync failed (records of a failed buffer write were
  // dropped by ReapLocked above).
  if (stage != CommitStage::kSync) {
    durable_pos_ = std::max(durable_pos_, {b->durable_segment, b->durable_end});
  }
  // A relocation settles with its commit: kept for a retry only when its index write failed.
  // (The put of the record it copied, same seq, is at the source: that op settles nothing.)
  auto settle_relocation = [&](const PendingOp& op) {
    if (relocated_from_.empty() || op.is_delete) return;
    auto r = relocated_from_.find(op.key);
    if (r != relocated_from_.end() && r->second.seq == op.entry.seq &&
        (r->second.segment != op.entry.segment || r->second.offset != op.entry.offset)) {
      relocated_from_.erase(r);
    }
  };
  if (st.ok()) {
    ++stats_.commits;
    if (b->sync_index && o_.durability != Durability::kNone) IndexSyncedLocked(b->last_ticket);
    for (const auto& op : b->ops) settle_relocation(op);
    return;
  }
  ++stats_.io_errors;
  // The retry of a failed index write syncs (the batch may have had to: a hole to cover).
  if (stage == CommitStage::kIndexWrite) sync_index_next_ = true;
  // Ops are retried at the next commit only while they are still the key's newest state
  // (another commit may have run since Execute: a stale op must not overwrite a newer one).
  // After an index-write failure the data is durable (the sync succeeded) and ops are kept;
  // after a sync failure the data may not be: its entries are forgotten and reported lost,
  // except relocations, which go back to their durable source (UndoFailedWriteLocked).
  bool data_durable = stage == CommitStage::kIndexWrite;
  std::vector<PendingOp> retry;
  std::vector<Key> lost;
  for (auto& op : b->ops) {
    auto it = map_.find(op.key);
    // The very record this op wrote (a relocation moved since, or put back, is another).
    bool current = it != map_.end() && it->second.seq == op.entry.seq &&
                   it->second.segment == op.entry.segment && it->second.offset == op.entry.offset;
    if (op.is_delete) {
      if (it == map_.end()) retry.push_back(op);
    } else if (current && data_durable) {
      retry.push_back(op);
    } else if (current) {
      if (UndoFailedWriteLocked(op.key)) lost.push_back(op.key);
    } else {
      settle_relocation(op);
    }
  }
  // Logged with the commit's failure above (throttled: a failing disk fails every commit).
  if (o_.on_write_lost && !lost.empty()) o_.on_write_lost(lost);
  pending_.insert(pending_.begin(), retry.begin(), retry.end());
  pending_ticket_ += retry.size();
  for (const auto& seg : b->sync_segs) {
    if (std::find(unsynced_segs_.begin(), unsynced_segs_.end(), seg) == unsynced_segs_.end()) {
      unsynced_segs_.push_back(seg);
    }
  }
}

Status SsdTier::Impl::TicketResult(uint64_t ticket) const {
  std::lock_guard c(cstate_mu_);
  for (const auto& f : failed_) {
    if (ticket >= f.first && ticket <= f.last) return f.status;
  }
  return Status::Ok();
}

void SsdTier::Impl::DelayForWritersLocked(std::unique_lock<std::mutex>& lock) {
  uint32_t delay_us = std::min(o_.commit_delay_us, SsdOptions::kMaxCommitDelayUs);
  uint64_t target = expected_writers_;
  auto joined = [&] { return sync_puts_.load(std::memory_order_relaxed) - prepared_puts_; };
  if (delay_us == 0 || o_.durability != Durability::kSync || target < 2 || joined() >= target) {
    return;
  }
  ++stats_.commit_delays;  // counted when the wait starts (tests wait for it)
  auto start = std::chrono::steady_clock::now();
  auto deadline = start + std::chrono::microseconds(delay_us);
  delay_target_ = target;
  delay_cv_.wait_until(lock, deadline, [&] { return joined() >= target; });
  delay_target_ = 0;
  auto end = std::chrono::steady_clock::now();
  stats_.commit_delay_us += static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(end - start).count());
  // A wait that ran to the bound counts as a timeout even when the group completed by then
  // (so a lost wake-up shows in the count, not only in the time spent).
  if (end >= deadline) ++stats_.commit_delay_timeouts;
}

Status SsdTier::Impl::Commit(uint64_t ticket, bool sync_index) {
  // A ticketed caller either finds its ticket covered by a commit in flight (or by the one
  // its leader is about to make) and returns when that commit ends, or becomes the leader.
  // Only the leader queues on commit_mu_ (behind a forced commit at most), so a covered
  // writer never waits behind the next leader's delay.
  bool lead = false;
  if (ticket != kForceCommit) {
    std::unique_lock c(cstate_mu_);
    cstate_cv_.wait(c,
                    [&] { return committed_ticket_ >= ticket || (!leader_ && !commit_inflight_); });
    if (committed_ticket_ >= ticket) {
      for (const auto& f : failed_) {
        if (ticket >= f.first && ticket <= f.last) return f.status;
      }
      return Status::Ok();
    }
    leader_ = lead = true;
  }
  struct LeaderDone {  // after commit_mu_ is released: the next leader may start
    Impl* impl;
    bool lead;
    ~LeaderDone() {
      if (!lead) return;
      {
        std::lock_guard c(impl->cstate_mu_);
        impl->leader_ = false;
      }
      impl->cstate_cv_.notify_all();
    }
  } leader_done{this, lead};
  std::lock_guard serial(commit_mu_);
  if (ticket != kForceCommit) {
    std::lock_guard c(cstate_mu_);
    if (committed_ticket_ >= ticket) {
      for (const auto& f : failed_) {
        if (ticket >= f.first && ticket <= f.last) return f.status;
      }
      return Status::Ok();  // covered by an earlier (forced) commit
    }
  }
  CommitBatch b;
  std::unique_lock lock(mu_);
  // A ticketed commit may wait for the writers it expects (mu_ released meanwhile); forced
  // commits (Flush, cleaning, the batched loop) never wait.
  if (ticket != kForceCommit) DelayForWritersLocked(lock);
  {
    // A CommitLocked in flight has finished by now (it holds mu_ throughout).
    KVTIER_RETURN_IF_ERROR(PrepareLocked(&b));
  }
  if (b.empty) {
    const uint64_t written = pending_ticket_;  // every op up to it is in RocksDB
    lock.unlock();
    if (!sync_index || o_.durability == Durability::kNone) return Status::Ok();
    // Nothing pending, but earlier commits may have left the index unsynced.
    if (db_ == nullptr) return Status::IOError("ssd index: not open (reopening it failed)");
    index_syncs_.fetch_add(1);
    Status st = FromRocks(db_->SyncWAL(), "index sync");
    if (st.ok()) {
      lock.lock();
      IndexSyncedLocked(written);
    }
    return st;
  }
  b.sync_index = b.sync_index || sync_index;
  lock.unlock();
  Status write_st;
  CommitStage stage = CommitStage::kNone;
  Status st = Execute(b, &write_st, &stage);  // buffer writes, fdatasync, index: outside the lock
  lock.lock();
  Settle(&b, st, stage);
  if (!st.ok()) return st;
  lock.unlock();
  if (!write_st.ok()) return write_st;
  return ticket == kForceCommit ? Status::Ok() : TicketResult(ticket);
}

Status SsdTier::Impl::CommitLocked(Status* write_status) {
  {
    // Index writes stay in order: wait for an out-of-lock commit to finish its write.
    std::unique_lock c(cstate_mu_);
    cstate_cv_.wait(c, [&] { return !commit_inflight_; });
  }
  CommitBatch b;
  KVTIER_RETURN_IF_ERROR(PrepareLocked(&b));
  if (b.empty) return Status::Ok();
  b.sync_index = true;  // recovery and close: the index as of now survives a power failure
  b.mu_held = true;
  Status write_st;
  CommitStage stage = CommitStage::kNone;
  Status st = Execute(b, &write_st, &stage);
  Settle(&b, st, stage);
  if (write_status != nullptr) *write_status = write_st;
  return st;
}

void SsdTier::Impl::CommitLoop() {
  std::unique_lock lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, std::chrono::milliseconds(std::max<uint32_t>(o_.group_commit_ms, 1)));
    if (stop_) break;
    lock.unlock();
    // The fdatasync runs outside the tier lock; Settle logs a failure (throttled).
    (void)Commit(kForceCommit);
    lock.lock();
  }
}

}  // namespace kvtier::storage
