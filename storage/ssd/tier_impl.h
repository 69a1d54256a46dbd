// Private to the SSD tier: the declaration of SsdTier::Impl, shared by the files that implement
// it, one concern each (docs/format/ssd.md describes the behaviour):
//   storage/ssd_tier.cc         the public SsdTier, and the request paths Put and Get
//   storage/ssd/segment_log.cc  segment appends, write buffers and their writer thread, rolls
//   storage/ssd/commit.cc       the group commit pipeline (prepare / execute / settle)
//   storage/ssd/recovery.cc     Open (RocksDB, segments, tail scan) and close
//   storage/ssd/cleaner.cc      segment cleaning (relocating live records)
//   storage/ssd/disk_space.cc   the free-space floor left to the index (disk_free_min_bytes)
//   storage/ssd/index.cc        the in-memory index: background load, point reads, policy
// Nothing outside storage/ includes this header.
#pragma once

#include <rocksdb/db.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/logging.h"
#include "storage/key_util.h"
#include "storage/ssd_format.h"
#include "storage/ssd_tier.h"

namespace kvtier::storage {
using ssd::AlignUp;
using ssd::Codec;
using ssd::IndexEntry;
using ssd::RecordHeader;

namespace ssd {

// a + b, or UINT64_MAX when the sum does not fit (a free-space floor near UINT64_MAX means
// "never enough").
inline uint64_t SaturatingAdd(uint64_t a, uint64_t b) {
  return a > UINT64_MAX - b ? UINT64_MAX : a + b;
}

inline rocksdb::Slice KeySlice(const Key& k) {
  return {reinterpret_cast<const char*>(k.data()), k.size()};
}

struct Segment {
  uint32_t id = 0;
  std::shared_ptr<BlockDevice> dev;
  uint64_t live_bytes = 0;
};

inline uint64_t LiveCost(const IndexEntry& e) { return AlignUp(e.record_bytes, kRecordAlignBytes); }

inline Status FromRocks(const rocksdb::Status& s, const char* what) {
  if (s.ok()) return Status::Ok();
  if (s.IsCorruption()) return Status::Corruption(std::string(what) + ": " + s.ToString());
  return Status::IOError(std::string(what) + ": " + s.ToString());
}

}  // namespace ssd

using ssd::FromRocks;
using ssd::KeySlice;
using ssd::LiveCost;
using ssd::Segment;

class SsdTier::Impl {
 public:
  explicit Impl(const SsdOptions& o) : o_(o) {}
  ~Impl();

  Status Open();
  Status Put(const Key& key, std::span<const uint8_t> value, const SsdMeta& meta,
             std::vector<Key>* evicted, const RequestTag* request, uint64_t* defer_ticket);
  Status Get(const Key& key, std::vector<uint8_t>* out, SsdMeta* meta, const RequestTag* request);
  void GetBatch(std::span<const Key> keys, std::vector<std::vector<uint8_t>>* outs,
                std::vector<SsdMeta>* metas, std::vector<Status>* results,
                const RequestTag* request, bool report_hits);
  void GetBatch(std::span<const Key> keys, Batch* batch, const RequestTag* request,
                bool report_hits);
  void ReportHit(const Key& key, const RequestTag* request) {
    std::lock_guard lock(mu_);
    auto it = id_to_key_.find(ObjectIdOf(key));
    if (it != id_to_key_.end() && it->second == key)
      policy_->OnAccess(it->first, EnterLocked(request));
  }
  bool Contains(const Key& key, uint64_t* version, SsdMeta* meta) {
    std::unique_lock lock(mu_);
    auto it = FindLocked(key, lock);
    if (it == map_.end()) return false;
    if (version != nullptr) *version = it->second.version;
    if (meta != nullptr) *meta = MetaOf(it->second);
    return true;
  }
  Status Remove(const Key& key, uint64_t* ticket) {
    std::unique_lock lock(mu_);
    if (FindLocked(key, lock) == map_.end()) {
      // Evicted, but the index may still hold it (unsynced_evictions_): a delete of its own,
      // not an eviction, so that its commit syncs the index.
      auto ev = unsynced_evictions_.find(key);
      if (ev == unsynced_evictions_.end()) return Status::NotFound("not in ssd tier");
      unsynced_evictions_.erase(ev);
      PushPending({key, true, {}});
    } else {
      RemoveLocked(key);
    }
    if (ticket != nullptr) *ticket = pending_ticket_;
    return Status::Ok();
  }
  Status WaitDurable(uint64_t ticket) {
    if (o_.durability != Durability::kSync || ticket == 0) return Status::Ok();
    return Commit(ticket);
  }
  std::optional<Key> EvictOne() {
    std::lock_guard lock(mu_);
    return EvictLocked();
  }
  void SetTracked(const Key& key, bool tracked);
  Status SetPolicy(const std::string& eviction, const policies::PolicyParams& params);
  Status ForEach(const std::function<void(const Key&, const SsdMeta&)>& fn) {
    std::unique_lock lock(mu_);
    load_cv_.wait(lock, [&] { return load_finished_; });
    for (const auto& [k, e] : map_) fn(k, MetaOf(e));
    return load_status_;
  }
  void ForEachUnsyncedEviction(const std::function<void(const Key&, TenantId)>& fn) {
    std::lock_guard lock(mu_);
    for (const auto& [k, ev] : unsynced_evictions_) fn(k, ev.tenant);
  }
  Status WaitForIndexLoad() {
    std::unique_lock lock(mu_);
    load_cv_.wait(lock, [&] { return load_finished_; });
    return load_status_;
  }
  Status Flush() { return Commit(kForceCommit, /*sync_index=*/true); }
  LogPosition LogEnd() const {
    std::lock_guard lock(mu_);
    return {active_->id, buf_file_offset_ + buf_len_};
  }
  // SsdTier::Replay (storage/ssd/recovery.cc).
  Status Replay(const LogPosition& from, const LogRecordVisitor& visit);
  SsdStats GetStats() const {
    std::lock_guard lock(mu_);
    SsdStats s = stats_;
    // What the tier holds now: capacity_bytes, or the segments the disk held once it proved
    // smaller.
    s.capacity_bytes =
        disk_segments_max_ == SIZE_MAX && free_segments_max_ == SIZE_MAX
            ? o_.capacity_bytes
            : std::min<uint64_t>(o_.capacity_bytes, (MaxSegments() + 1) * o_.segment_bytes);
    s.objects = map_.size();
    s.objects_max = o_.objects_max;
    s.segments = segments_.size();
    s.live_bytes = 0;
    for (const auto& [id, seg] : segments_) s.live_bytes += seg->live_bytes;
    s.disk_bytes = segments_.size() * o_.segment_bytes;
    s.syncs = syncs_.load();
    s.index_syncs = index_syncs_.load();
    s.index_reopens = index_reopens_.load();
    s.index_loaded = load_finished_ && load_status_.ok();
    s.index_load_failed = !load_status_.ok();
    return s;
  }
  uint64_t max_version() const {
    std::lock_guard lock(mu_);
    return max_version_;
  }

 private:
  struct PendingOp {
    Key key;
    bool is_delete;
    IndexEntry entry;
    // An eviction's index delete may be lost in a power failure (the unit comes back, intact:
    // a cache may keep it); every other delete syncs the index with its commit.
    bool eviction = false;
  };

  static SsdMeta MetaOf(const IndexEntry& e) {
    SsdMeta m;
    m.tenant = e.tenant;
    m.version = e.version;
    m.kind = static_cast<policies::ObjectKind>(e.kind);
    m.expires_unix_ms = e.expires_unix_ms;
    m.parent_id = e.parent_id;
    m.recompute_tokens = e.recompute_tokens;
    m.raw_bytes = e.raw_bytes;
    return m;
  }
  policies::ObjectInfo InfoOf(const Key& k, const IndexEntry& e) const {
    policies::ObjectInfo info;
    info.id = ObjectIdOf(k);
    info.size_bytes = e.record_bytes;
    info.parent_id = e.parent_id;
    info.recompute_tokens = e.recompute_tokens;
    info.kind = static_cast<policies::ObjectKind>(e.kind);
    return info;
  }
  uint64_t NowUs() const { return clock_->NowUs(); }
  // Under mu_: the time of this call's policy hooks (RequestTag, as a memory tier does): tells
  // the policy when a request begins or resumes; the clock for a call without one.
  uint64_t EnterLocked(const RequestTag* request) {
    if (request == nullptr || request->id == 0) return NowUs();
    if (request->id != current_request_) {
      if (layer_ != nullptr) {
        layer_->BeginRequest(request->id, request->now_us);
      } else {
        policy_->OnRequest(request->now_us);
      }
      current_request_ = request->id;
    }
    return request->now_us;
  }
  // Under mu_: the time of hooks called inside a put (Evict, OnInsert): its request's.
  uint64_t PolicyNowLocked() const { return call_now_us_ != 0 ? call_now_us_ : NowUs(); }
  // The segment limit: capacity_bytes' (the files stay within one of it: MaxSegments() + 1),
  // or lower once the disk proved smaller (disk_segments_max_) or while its free space is
  // below the floor (free_segments_max_).
  size_t CapacitySegments() const { return o_.capacity_bytes / o_.segment_bytes - 1; }
  size_t MaxSegments() const {
    return std::max<size_t>(2,
                            std::min({CapacitySegments(), disk_segments_max_, free_segments_max_}));
  }
  uint64_t LiveLimit() const {
    return static_cast<uint64_t>(static_cast<double>((MaxSegments() - 1) * o_.segment_bytes) *
                                 (1.0 - o_.clean_live_ratio));
  }

  void Track(const Key& k, const IndexEntry& e) {
    if (untracked_.count(k)) return;
    auto [it, inserted] = id_to_key_.emplace(ObjectIdOf(k), k);
    if (!inserted && it->second != k) return;  // 64-bit id collision: leave untracked
    policy_->OnInsert(InfoOf(k, e), PolicyNowLocked());
  }
  void Untrack(const Key& k) {
    auto it = id_to_key_.find(ObjectIdOf(k));
    if (it == id_to_key_.end() || it->second != k) return;
    policy_->OnRemove(it->first);
    id_to_key_.erase(it);
  }
  void Insert(const Key& k, const IndexEntry& e) {
    auto it = map_.find(k);
    // The same record moved (the cleaner relocates it: same seq) keeps its place in the
    // policy: a relocation is no access, insert or removal of the unit.
    const bool relocated = it != map_.end() && it->second.seq == e.seq;
    if (it != map_.end()) RemoveLocked(k, /*log_delete=*/false, false, /*keep_policy=*/relocated);
    map_.emplace(k, e);
    // Any later removal syncs the index, or is an eviction that records itself again.
    if (!unsynced_evictions_.empty()) unsynced_evictions_.erase(k);
    auto seg = segments_.find(e.segment);
    if (seg != segments_.end()) seg->second->live_bytes += LiveCost(e);
    if (!relocated) Track(k, e);
    max_version_ = std::max(max_version_, e.version);
  }
  void RemoveLocked(const Key& k, bool log_delete = true, bool eviction = false,
                    bool keep_policy = false) {
    auto it = map_.find(k);
    if (it == map_.end()) return;
    auto seg = segments_.find(it->second.segment);
    if (seg != segments_.end()) seg->second->live_bytes -= LiveCost(it->second);
    if (!keep_policy) Untrack(k);
    const TenantId tenant = it->second.tenant;
    map_.erase(it);
    dirty_access_.erase(k);
    // While the background load runs, the loader must not bring the key back.
    if (!loaded_) tombstones_.insert(k);
    if (!log_delete) return;
    PushPending({k, true, {}, eviction});
    if (eviction && o_.durability != Durability::kNone) NoteUnsyncedEvictionLocked(k, tenant);
  }
  // Under mu_: the eviction delete of k (pending_ticket_) is not synced yet (unsynced_evictions_).
  void NoteUnsyncedEvictionLocked(const Key& k, TenantId tenant) {
    unsynced_evictions_[k] = {pending_ticket_, tenant};
    unsynced_eviction_order_.emplace_back(pending_ticket_, k);
    if (unsynced_eviction_order_.size() >= kMaxUnsyncedEvictions) sync_index_next_ = true;
  }
  // Under mu_: a synced RocksDB write covered every index operation up to `ticket`.
  void IndexSyncedLocked(uint64_t ticket) {
    while (!unsynced_eviction_order_.empty() && unsynced_eviction_order_.front().first <= ticket) {
      const auto& [t, k] = unsynced_eviction_order_.front();
      auto it = unsynced_evictions_.find(k);
      if (it != unsynced_evictions_.end() && it->second.ticket == t) unsynced_evictions_.erase(it);
      unsynced_eviction_order_.pop_front();
    }
  }
  void PushPending(PendingOp op) {
    pending_.push_back(std::move(op));
    ++pending_ticket_;
  }
  // True when the index entry points past the valid end of the log found by recovery (a
  // torn tail, or an entry written ahead of its data in kNone): never served, deleted.
  bool TornAtOpen(const IndexEntry& e) const {
    auto it = recovered_ends_.find(e.segment);
    return it != recovered_ends_.end() && e.offset + e.record_bytes > it->second;
  }
  // map_ lookup; while the background load runs, a key not loaded yet is read from the
  // RocksDB index (outside the lock) and inserted, so hits are served right after Open.
  std::unordered_map<Key, IndexEntry, KeyHash>::iterator FindLocked(
      const Key& key, std::unique_lock<std::mutex>& lock);
  std::optional<Key> EvictLocked() {
    while (true) {
      auto id = policy_->Evict(PolicyNowLocked());
      if (!id) return std::nullopt;
      auto it = id_to_key_.find(*id);
      if (it == id_to_key_.end()) continue;
      Key k = it->second;
      id_to_key_.erase(it);
      if (!map_.count(k)) continue;
      RemoveLocked(k, /*log_delete=*/true, /*eviction=*/true);
      ++stats_.evictions;
      return k;
    }
  }

  // The record's bytes when they sit in a write buffer (being filled, in flight, or written
  // but not reaped yet); nullptr when they are only on the device. Under mu_.
  const uint8_t* BufferedRecord(const IndexEntry& e) const {
    if (fill_ != kNoBuffer && active_ != nullptr && e.segment == active_->id &&
        e.offset >= buf_file_offset_ && e.offset < buf_file_offset_ + buf_len_) {
      return bufs_[fill_].data + (e.offset - buf_file_offset_);
    }
    for (size_t i = 0; i < bufs_.size(); ++i) {
      const WriteBuf& b = bufs_[i];
      if (i == fill_ || !b.in_use || b.seg == nullptr || b.seg->id != e.segment) continue;
      if (e.offset >= b.file_offset && e.offset < b.file_offset + b.len) {
        return b.data + (e.offset - b.file_offset);
      }
    }
    return nullptr;
  }
  // True when a record of `padded` bytes fits in the active segment after what is buffered,
  // with keep_free_bytes left after it, as AppendLocked writes it: a record that does not fit
  // in the write buffer goes after the buffer written out, which is padded to a block first
  // (buf_file_offset_ is block-aligned, and so is every write's length).
  bool FitsActiveLocked(uint64_t padded, uint64_t keep_free_bytes = 0) const {
    uint64_t start = buf_file_offset_ + buf_len_;
    if (buf_len_ + padded > o_.write_buffer_bytes) {
      start = buf_file_offset_ + AlignUp(buf_len_, ssd::kBlockBytes);
    }
    return AlignUp(start + padded + keep_free_bytes, ssd::kBlockBytes) <= o_.segment_bytes;
  }
  // The same for a put: the room the cleaner keeps for its relocations (clean_reserve_bytes_)
  // is not a put's.
  bool PutFitsActiveLocked(uint64_t padded) const {
    return FitsActiveLocked(padded, clean_reserve_bytes_);
  }
  // Appends to the active segment, rolling into the prepared segment when it does not fit
  // with keep_free_bytes left over (a put: clean_reserve_bytes_; the cleaner: 0); Rejected
  // when it does not fit and no segment is prepared (never waits for one).
  Status AppendLocked(const Key& key, const RecordHeader& h, std::span<const uint8_t> payload,
                      uint64_t keep_free_bytes, IndexEntry* e);
  // Queues the buffer being filled (if not empty) for writing; never blocks. wake_writer:
  // false when the caller (a commit) writes it itself (WriteQueuedLocked), saving two thread
  // switches on the commit's critical path.
  void WriteBufferLocked(bool wake_writer = true);
  // Makes a buffer the one being filled, waiting (mu_ held) for the writer when all are busy.
  void AcquireBufferLocked();
  // Frees the buffers the writer has finished; drops the entries of failed ones (a relocation
  // goes back to its victim instead: UndoFailedWriteLocked), reported to on_write_lost.
  void ReapLocked();
  // Under mu_: k's current entry names a record whose write (buffer write or fdatasync)
  // failed. A relocation whose source record is durable (relocated_from_, DurableLocked) goes
  // back to it: the victim keeps the unit (and its live bytes, so it is not deleted). Anything
  // else is forgotten (its removal committed like a delete); returns true then: the unit is
  // lost, for the caller to report (on_write_lost).
  bool UndoFailedWriteLocked(const Key& k);
  // Under mu_: the record of e reached the device with a commit's sync (DurableLocked: it ends
  // at or before durable_pos_).
  bool DurableLocked(const IndexEntry& e) const {
    return e.segment < durable_pos_.first ||
           (e.segment == durable_pos_.first && e.offset + e.record_bytes <= durable_pos_.second);
  }
  void WriterLoop();
  // Writes the queued buffers, up to the one with write_seq last_seq, as one stream of
  // chunks (DeviceEnv::Stream: kWriteDepth chunks in flight, the next one handed over as
  // each completes, across buffers); wb_mu_ is held on entry and exit, released meanwhile.
  // Marks each buffer done, and advances completed_seq_, once it and every buffer before it
  // have completed. Called by the writer thread (last_seq UINT64_MAX), and by a commit
  // waiting for its own buffers, only while no other stream runs (writer_busy_).
  void WriteQueuedLocked(std::unique_lock<std::mutex>& wb, uint64_t last_seq);
  void MarkUnsyncedLocked() {
    if (unsynced_segs_.empty() || unsynced_segs_.back() != active_)
      unsynced_segs_.push_back(active_);
  }

  // Group commit. A commit (1) under mu_ queues the buffer and takes the pending index ops
  // (PrepareLocked), (2) outside mu_ writes its buffers (itself, unless the writer thread is
  // on them), fdatasyncs the segments written since the last commit and writes the ops to
  // RocksDB (Execute), (3) under mu_ settles the outcome (Settle). Commits are applied to
  // RocksDB in order: Commit() callers are serialised by commit_mu_, and CommitLocked()
  // (recovery, close: mu_ held throughout) first waits until no out-of-lock commit is in
  // flight. While a commit runs, the next group forms: puts append and wait, and the first of
  // them to take commit_mu_ after it commits them all. Lock order: commit_mu_ -> mu_ ->
  // cstate_mu_.
  //
  // One synced write per commit: the RocksDB write is synced only when the batch holds a
  // delete other than an eviction or covers a failed buffer write (a hole where the tail scan
  // stops), or the caller asks (sync_index: Flush, recovery, close, the cleaner before it
  // deletes a segment; sync_index_next_). Otherwise the fdatasync of the data is the
  // commit's only sync: RocksDB recovers a prefix of its writes after a power failure, so the
  // durable_end it keeps is the one of an earlier commit, and Open's tail scan from there
  // re-indexes every record written since (same seq: relocated copies replace the old entry).
  struct CommitBatch {
    bool empty = true;
    bool sync_index = false;  // sync the RocksDB WAL with this commit's index write
    std::vector<PendingOp> ops;
    uint64_t first_ticket = 0, last_ticket = 0;
    std::vector<std::shared_ptr<Segment>> sync_segs;
    uint32_t durable_segment = 0;
    uint64_t durable_end = 0, next_seq = 0, max_version = 0;
    // Buffers handed to the writer in (write_seq_lo, write_seq_hi] belong to this commit.
    uint64_t write_seq_lo = 0, write_seq_hi = 0;
    uint64_t writers = 0;  // kSync puts this commit covers (sync_puts_ - prepared_puts_)
    // Run with mu_ held (CommitLocked: recovery, close): a failed index write does not reopen
    // the index (ReopenIndexDb takes mu_; the tier is starting or closing anyway).
    bool mu_held = false;
  };
  static constexpr uint64_t kForceCommit = UINT64_MAX;
  Status PrepareLocked(CommitBatch* b);
  // Returns the commit's status (sync + index write); *write_status: the first failed buffer
  // write of the batch (its records are left out of the index write), or OK. *stage: where
  // it failed (kBufferWrite when only a buffer write did), kNone when nothing did.
  Status Execute(const CommitBatch& b, Status* write_status, CommitStage* stage);
  // Under mu_: counts the outcome; after a failure at kBufferWrite / kSync forgets the data
  // the commit covered, after kIndexWrite (data durable) queues its index ops again.
  void Settle(CommitBatch* b, const Status& st, CommitStage stage);
  // Commits everything pending up to `ticket` (kForceCommit: a commit pass now). Not under mu_.
  // sync_index: the RocksDB WAL is synced too (even when nothing is pending), so that the
  // index as of this call survives a power failure. Returns the commit's error, else a failed
  // buffer write of the commit, else OK.
  Status Commit(uint64_t ticket, bool sync_index = false);
  // Commits with mu_ held (recovery, close). A failed buffer write of the
  // commit is stored in *write_status when not null (its records are dropped either way).
  Status CommitLocked(Status* write_status = nullptr);
  Status TicketResult(uint64_t ticket) const;
  // The commit delay (SsdOptions::commit_delay_us), called by the leader with commit_mu_ and
  // mu_ held: waits (mu_ released) until as many kSync puts as expected_writers_ have appended
  // since the last prepared commit, or the delay has passed; no wait when fewer than 2 are
  // expected or they have joined already. Counts what it did in stats_.
  void DelayForWritersLocked(std::unique_lock<std::mutex>& lock);
  void LoadIndex();
  // Seals the active segment and makes the prepared one active (no I/O, no commit: the next
  // commit covers the sealed segment's last buffer). Rejected when none is prepared.
  Status RollLocked();
  // Waits (mu_ released) until a put's record of `padded` bytes fits in the active segment
  // (PutFitsActiveLocked) or a segment is prepared; the error of the last failed preparation
  // otherwise.
  Status WaitForRoomLocked(std::unique_lock<std::mutex>& lock, uint64_t padded);

  // ---- the segment thread (storage/ssd/cleaner.cc) ----
  // Keeps the next segment prepared (created and fallocated outside mu_) and cleans segments
  // (over the segment limit, or one sparse segment per roll) with its own I/O budget
  // (background_io_bytes_per_s). Request paths wait for it only when no segment is prepared.
  void SegmentLoop();
  // Creates and fallocates the next segment outside mu_ (lock held on entry and exit); under
  // kSync also writes it with zeros first (ZeroFillSegment).
  void PrepareSegment(std::unique_lock<std::mutex>& lock);
  // Under kSync (and SsdOptions::zero_fill_segments): writes zeros over the whole new segment
  // and fdatasyncs it, before any record is appended to it, so that a commit's records land in
  // blocks already written (no unwritten-extent conversion at each write's completion:
  // docs/format/ssd.md, "Zero-filled segments"). No-op otherwise, and on devices
  // of alignment 1 (memory). lock null (Open): at once. lock given (the segment thread, mu_
  // released on entry and exit): each chunk (4 MiB, at most a quarter segment) waits until the
  // active segment's fill is at least 3/4 of the chunk's offset (so the segment is ready when the
  // active one is 3/4 full, and its zeros are spread over the active segment's life instead of
  // competing with commits for the device all at once), then counts against
  // background_io_bytes_per_s; no waiting while a put waits for a segment. Unavailable when the
  // tier closes meanwhile.
  Status ZeroFillSegment(BlockDevice* dev, std::unique_lock<std::mutex>* lock);
  // Opens the RocksDB index (db_ and its column family handles) under o_.dir + "/index".
  Status OpenIndexDb();
  // Closes the index and opens it again: what clears RocksDB's background error after a failed
  // WAL sync. Only with commit_mu_ held and mu_ not (no other commit uses db_; it takes mu_ to
  // look at the load) and once the load finished (no point read or load iterator uses it);
  // Unavailable before.
  Status ReopenIndexDb();
  // Open: creates, fallocates and (kSync) zero-fills segment `id`; *dev is null on error (the
  // caller removes the file).
  Status OpenFreshSegment(uint32_t id, std::shared_ptr<BlockDevice>* dev);
  // The segment to clean now, or nullptr (under mu_).
  std::shared_ptr<Segment> PickVictimLocked();

  // ---- the free-space floor (storage/ssd/disk_space.cc; SsdOptions::disk_free_min_bytes) ----
  // Segment thread, lock held on entry and exit (released while it reads the disk): at most
  // once per disk_check_ms, reads the free space and lowers free_segments_max_ while it is
  // below the floor, or raises it by one once the floor plus two segments are free. Returns
  // how long the thread may wait before calling again (forever without a floor).
  std::chrono::milliseconds WatchDiskFree(std::unique_lock<std::mutex>& lock);
  // Outside mu_: a NoSpaceError when creating one more segment would leave less than the
  // floor free (OK without a floor, or when the free space cannot be read); *free_bytes is
  // what was read.
  Status CheckRoomForSegment(uint64_t* free_bytes);
  // Under mu_: the free space is below the floor. Lowers free_segments_max_ to one below the
  // segments there are (counted, logged); at the tier's smallest (3 segments) only logs. `when`
  // completes "ssd disk <when> <free_bytes> bytes free" in the log line.
  void BelowFloorLocked(uint64_t free_bytes, const char* when);
  // Relocates the victim's live records (reads outside mu_, appends in chunks under it),
  // commits, then deletes the segment. Lock held on entry and exit.
  Status CleanSegment(const std::shared_ptr<Segment>& victim, std::unique_lock<std::mutex>& lock);
  // Paces background I/O to background_io_bytes_per_s; returns at once while a request
  // waits for a segment. Called outside mu_.
  void PaceBackgroundIo(uint64_t bytes);
  // A read in two halves (Get, GetBatch). BeginReadLocked finds the entry (point read while
  // loading), records the access and either copies the record from a write buffer into
  // *buffered or sets *seg to the segment to read it from. FinishRead verifies the record
  // (header, key, seq, checksum; a mismatch is quarantined) and decodes it into *out; it
  // takes mu_ only on failure. read_st: the device read's status.
  // request / report_hit: the policy's OnAccess for the hit, at the request's time (none when
  // report_hit is false: the caller reports it with ReportHit).
  Status BeginReadLocked(const Key& key, std::unique_lock<std::mutex>& lock, IndexEntry* e,
                         std::shared_ptr<Segment>* seg, std::vector<uint8_t>* buffered,
                         const RequestTag* request, bool report_hit);
  Status FinishRead(const Key& key, const IndexEntry& e, Status read_st,
                    std::span<const uint8_t> rec, std::vector<uint8_t>* out);
  // FinishRead in two steps: VerifyRead never takes mu_ (an I/O error is returned as is, any
  // mismatch or undecodable payload as Corruption); SettleReadFailure takes mu_, counts the
  // failure and quarantines a corrupted entry that is still current.
  Status VerifyRead(const Key& key, const IndexEntry& e, Status read_st,
                    std::span<const uint8_t> rec, std::vector<uint8_t>* out);
  // VerifyRead in two steps, for a caller that keeps the payload where it was read:
  // VerifyRecord checks the record (read status, header, key, seq, size, checksum) and fills
  // *h; DecodePayload copies (kNone) or decompresses (kZstd; Corruption when it fails) the
  // payload of a verified record into *out. Neither takes mu_.
  Status VerifyRecord(const Key& key, const IndexEntry& e, Status read_st,
                      std::span<const uint8_t> rec, RecordHeader* h);
  static Status DecodePayload(const RecordHeader& h, std::span<const uint8_t> rec,
                              std::vector<uint8_t>* out);
  void SettleReadFailure(const Key& key, const IndexEntry& e, const Status& st);
  Status ReadRecord(const Segment& seg, uint64_t offset, uint32_t record_bytes,
                    std::vector<uint8_t>* out);
  // ReadRecord without the copy: *rec views the calling thread's read buffer (or *owned, for
  // a record larger than that buffer), valid until the thread's next ReadRecord(View).
  Status ReadRecordView(const Segment& seg, uint64_t offset, uint32_t record_bytes,
                        AlignedBuffer* owned, std::span<const uint8_t>* rec);
  Status ScanTail(const std::shared_ptr<Segment>& seg, uint64_t start, uint64_t* valid_end,
                  std::vector<std::pair<Key, IndexEntry>>* found);
  // Walks the whole records of seg from start (8-byte aligned) up to end: calls
  // visit(offset, header, record) for each (header and payload checksums valid); zero
  // padding skips to the next 4 KiB block; stops at the first invalid record. Returns the
  // offset where the walk stopped. Reads only (no lock needed).
  uint64_t WalkRecords(
      const Segment& seg, uint64_t start, uint64_t end,
      const std::function<void(uint64_t, const RecordHeader&, std::span<const uint8_t>)>& visit);
  void CommitLoop();

  SsdOptions o_;
  const Clock* clock_ = nullptr;
  std::unique_ptr<DeviceEnv> owned_env_;
  DeviceEnv* env_ = nullptr;
  std::unique_ptr<rocksdb::DB> db_;
  // Failed commits and cleanings repeat every few ms while a disk stays full: one warning
  // per second each (protected by mu_).
  LogThrottle commit_failure_log_{1000}, clean_failure_log_{1000};
  rocksdb::ColumnFamilyHandle* index_cf_ = nullptr;
  rocksdb::ColumnFamilyHandle* meta_cf_ = nullptr;
  rocksdb::ColumnFamilyHandle* default_cf_ = nullptr;

  mutable std::mutex mu_;
  std::unordered_map<Key, IndexEntry, KeyHash> map_;
  std::unordered_map<policies::ObjectId, Key> id_to_key_;
  std::unordered_set<Key, KeyHash> untracked_;
  std::unordered_set<Key, KeyHash> dirty_access_;
  std::map<uint32_t, std::shared_ptr<Segment>> segments_;
  std::shared_ptr<Segment> active_;
  // ---- write buffers (double buffering) ----
  // A buffer is free, being filled (fill_), queued/in flight on the writer thread, or done
  // (written or failed) and not yet reaped. data/seg/file_offset/len/write_seq are set under
  // mu_ before the buffer is queued and read by the writer after it takes it from the queue.
  struct WriteBuf {
    uint8_t* data = nullptr;
    bool in_use = false;  // under mu_: not free
    std::shared_ptr<Segment> seg;
    uint64_t file_offset = 0, len = 0, write_seq = 0;
    bool done = false;           // under wb_mu_
    bool commit_writes = false;  // under wb_mu_: queued by a commit, which writes it itself
    Status status;               // under wb_mu_
  };
  static constexpr size_t kNoBuffer = SIZE_MAX;
  AlignedBuffer buf_region_;  // write_buffers x write_buffer_bytes, registered with the env
  std::vector<WriteBuf> bufs_;
  size_t fill_ = kNoBuffer;       // the buffer being filled, under mu_
  uint64_t buf_file_offset_ = 0;  // file offset of the buffer being filled (active_)
  size_t buf_len_ = 0;
  uint64_t enqueued_seq_ = 0;          // under mu_: buffers ever handed to the writer
  uint64_t prepared_seq_ = 0;          // under mu_: enqueued_seq_ at the last PrepareLocked
  std::mutex wb_mu_;                   // lock order: mu_ -> wb_mu_; the writer takes only wb_mu_
  std::condition_variable wb_cv_;      // a buffer write completed (commits, AcquireBufferLocked)
  std::condition_variable writer_cv_;  // wakes the writer thread: a buffer for it, or stop
  std::deque<size_t> wb_queue_;        // under wb_mu_, FIFO (one stream at a time: done in order)
  uint64_t completed_seq_ = 0;         // under wb_mu_
  struct FailedWrite {
    uint64_t seq;
    uint32_t segment;
    uint64_t offset, len;
    Status status;
  };
  std::vector<FailedWrite> failed_writes_;  // under wb_mu_; consumed by Execute
  bool wb_stop_ = false;                    // under wb_mu_
  bool writer_busy_ = false;                // under wb_mu_: a write stream runs (one at a time)
  std::thread writer_thread_;
  std::vector<std::shared_ptr<Segment>> unsynced_segs_;
  std::vector<PendingOp> pending_;
  // The ops vector of the last settled commit, emptied, kept for pending_ to reuse (a commit
  // moves pending_ out: without it every commit regrew it, ~4 allocations of ~8 ops). Kept
  // only up to kSpareOpsKeep capacity. Guarded by mu_.
  static constexpr size_t kSpareOpsKeep = 4096;
  std::vector<PendingOp> spare_ops_;
  uint64_t pending_ticket_ = 0;  // ops ever pushed to pending_
  // Under mu_ (durability other than kNone): keys removed by an eviction whose index delete no
  // synced RocksDB write covers yet, with that delete's ticket and the unit's tenant. A power
  // failure may lose such a delete and bring the intact unit back, which a cache may do, but
  // not once the caller deleted the unit (TierManager's Delete while DRAM still served it):
  // Remove of such a key records a delete of its own, which syncs the index with its commit.
  // An entry goes when a synced commit covers its ticket (IndexSyncedLocked) or the key is put
  // again. unsynced_eviction_order_: (ticket, key) in ticket order, entries of keys since put
  // again or removed included; from kMaxUnsyncedEvictions of them on, the next commit syncs
  // the index (sync_index_next_), so both stay bounded by that plus the evictions of a commit.
  struct UnsyncedEviction {
    uint64_t ticket;
    TenantId tenant;
  };
  static constexpr size_t kMaxUnsyncedEvictions = 16384;
  std::unordered_map<Key, UnsyncedEviction, KeyHash> unsynced_evictions_;
  std::deque<std::pair<uint64_t, Key>> unsynced_eviction_order_;
  bool sync_index_next_ = false;
  // Under mu_: relocations not committed yet: key -> its entry before the cleaner moved it
  // (same seq). When the relocation's write or sync fails, the entry goes back there
  // (UndoFailedWriteLocked); an entry goes when the relocation's commit settles. Bounded by
  // the records of the clean in progress (its commit settles them all before the next clean).
  std::unordered_map<Key, IndexEntry, KeyHash> relocated_from_;
  // Under mu_: (segment, offset) that the last commit whose data reached the device covered
  // (its durable_end; fdatasynced unless kNone): every record ending before it is durable.
  std::pair<uint32_t, uint64_t> durable_pos_{0, 0};
  // Units the cleaner dropped (unreadable, or no room to relocate): handed to the caller of
  // the next Put through its `evicted` list. Under mu_.
  std::vector<Key> cleaner_dropped_;
  // Under mu_: once the cleaner has prepared a segment for its relocations (the files are at
  // their limit + 1), the padded bytes of the victim's records it has still to copy; puts
  // leave that much of the active segment free (and wait for room meanwhile), so that they
  // cannot fill the segment under the cleaner and make it drop live units. 0 otherwise.
  uint64_t clean_reserve_bytes_ = 0;
  uint64_t next_seq_ = 1;
  uint64_t max_version_ = 0;
  std::unique_ptr<policies::EvictionPolicy> policy_;
  policies::PrefixLayer* layer_ = nullptr;  // policy_ itself under Structure::kPrefix
  // Under mu_: the policy was told its capacity (OnCapacity, at the first put); the request
  // it was last told of (EnterLocked); the request time of the put holding mu_ (0: none).
  bool capacity_told_ = false;
  uint64_t current_request_ = 0;
  uint64_t call_now_us_ = 0;
  SsdStats stats_;

  // ---- segment thread ----
  std::shared_ptr<Segment> next_seg_;  // under mu_: prepared, not yet in segments_
  Status prepare_status_;              // under mu_: the last preparation's outcome
  // Under mu_: a segment limit the disk imposed. When preparing one more segment fails with
  // ENOSPC (a disk smaller than capacity_bytes, or filled by others), the limit drops to one
  // below the segments there are, so that the files fit in what the disk held: the cleaner
  // then reclaims the emptiest segment (relocating what fits, evicting the rest) and puts
  // evict down to the lower LiveLimit(), instead of every put failing for good. It stays
  // until the tier is reopened. SIZE_MAX: none.
  size_t disk_segments_max_ = SIZE_MAX;
  // Under mu_: the segment limit the free-space floor imposes (disk_free_min_bytes; lowered
  // and raised by WatchDiskFree and PrepareSegment). SIZE_MAX: none.
  size_t free_segments_max_ = SIZE_MAX;
  // Segment thread only: when WatchDiskFree reads the disk next (steady clock, not the
  // policy clock, which tests stop).
  std::chrono::steady_clock::time_point next_disk_check_{};
  std::chrono::steady_clock::time_point floor_lowered_at_{};  // under mu_: last lowered
  LogThrottle disk_floor_log_{60'000};                        // under mu_: the floor cannot be kept
  uint64_t threshold_cleans_ = 0;   // under mu_: sparse cleans allowed (one per roll)
  std::condition_variable seg_cv_;  // wakes the segment thread (with mu_)
  std::condition_variable
      room_cv_;  // a segment was prepared, or a clean_reserve_bytes_ ended (with mu_)
  std::atomic<bool> seg_stop_{false};
  std::atomic<uint32_t> room_waiters_{0};  // requests waiting for a prepared segment
  // Under mu_: the active segment's fill (bytes appended) at which AppendLocked wakes the
  // segment thread waiting to zero-fill its next chunk (ZeroFillSegment); 0: none waits.
  uint64_t zero_fill_wake_at_ = 0;
  uint64_t bg_io_next_us_ = 0;  // segment thread only: pacing deadline
  std::thread segment_thread_;

  std::thread commit_thread_;
  std::condition_variable cv_;
  bool stop_ = false;

  // ---- commit state ----
  std::mutex commit_mu_;
  mutable std::mutex cstate_mu_;
  std::condition_variable cstate_cv_;
  bool commit_inflight_ = false;   // under cstate_mu_
  uint64_t committed_ticket_ = 0;  // under cstate_mu_
  // Under cstate_mu_: a ticketed Commit() caller leads (from before it takes commit_mu_ until
  // its commit settled). Other ticketed callers wait for its commit instead of queueing on
  // commit_mu_, so a writer it covers never waits behind the next leader's delay.
  bool leader_ = false;
  // Commit delay state. sync_puts_: kSync puts ever appended (written under mu_, read by
  // Execute without it); prepared_puts_: sync_puts_ at the last PrepareLocked (under mu_).
  // expected_writers_ (under mu_): the last commit's writers plus the kSync puts appended
  // while it ran, read when its sync ended. delay_target_ (under mu_): while a leader waits,
  // the count of joined writers that ends its wait (0: none waits); a put that reaches it
  // (counted under mu_) notifies delay_cv_ after releasing mu_.
  std::atomic<uint64_t> sync_puts_{0};
  uint64_t prepared_puts_ = 0;
  uint64_t expected_writers_ = 0;
  uint64_t delay_target_ = 0;
  std::atomic<uint64_t> puts_at_sync_end_{0};  // Execute -> Settle of the same commit
  std::condition_variable delay_cv_;
  struct FailedRange {
    uint64_t first, last;
    Status status;
  };
  static constexpr size_t kMaxFailedRanges = 64;
  std::deque<FailedRange> failed_;          // under cstate_mu_
  std::atomic<uint64_t> syncs_{0};          // fdatasync calls by commits
  std::atomic<uint64_t> index_syncs_{0};    // commits that synced the RocksDB WAL
  std::atomic<uint64_t> index_reopens_{0};  // reopened after a failed index write

  // ---- background index load (warm restart) ----
  std::unique_ptr<rocksdb::Iterator> load_iter_;  // implicit snapshot taken at Open
  std::thread load_thread_;
  std::atomic<bool> stop_load_{false};
  std::condition_variable load_cv_;
  // Under mu_. loaded_: every entry is in map_ (point reads stop). load_finished_: also
  // reported to on_index_load and the deferred cleaning done, or the load failed
  // (load_status_: its error; loaded_ then stays false for good); what waiters wait for.
  // load_cv_ also wakes the load thread after a failed load (point reads to report, close).
  bool loaded_ = false;
  bool load_finished_ = false;
  Status load_status_;
  std::unordered_set<Key, KeyHash> tombstones_;  // removed since Open, while loading
  // Segments scanned at Open (past the last commit) and the valid end the scan found in each.
  std::map<uint32_t, uint64_t> recovered_ends_;
  uint64_t open_bytes_bound_ = 0;  // bytes in segments at Open (live bound)
  uint64_t open_us_ = 0;
  std::vector<std::pair<Key, SsdMeta>> point_loaded_;  // for on_index_load, under mu_
};

}  // namespace kvtier::storage
