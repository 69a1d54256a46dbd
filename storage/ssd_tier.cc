#include "storage/ssd_tier.h"

#include <rocksdb/db.h>
#include <rocksdb/filter_policy.h>
#include <rocksdb/options.h>
#include <rocksdb/table.h>
#include <rocksdb/write_batch.h>
#include <zstd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "common/logging.h"
#include "storage/key_util.h"
#include "storage/ssd_format.h"

namespace kvtier::storage {
using ssd::AlignUp;
using ssd::Codec;
using ssd::IndexEntry;
using ssd::RecordHeader;

namespace {

constexpr const char* kFormatName = "kvtier-ssd-1";
constexpr size_t kMaxDirtyAccess = 1 << 20;  // access stats persisted at close, bounded
// Index entries loaded per lock hold by the background load (bounds the pause it causes).
constexpr size_t kLoadBatchEntries = 4096;
// The write buffer is submitted as this many writes at once (queue depth of a buffer write).
constexpr size_t kWriteSplit = 4;
constexpr size_t kMinWriteChunkBytes = 128 << 10;

rocksdb::Slice KeySlice(const Key& k) {
  return {reinterpret_cast<const char*>(k.data()), k.size()};
}

struct Segment {
  uint32_t id = 0;
  std::shared_ptr<BlockDevice> dev;
  uint64_t live_bytes = 0;
};

uint64_t LiveCost(const IndexEntry& e) { return AlignUp(e.record_bytes, ssd::kRecordAlignBytes); }

Status FromRocks(const rocksdb::Status& s, const char* what) {
  if (s.ok()) return Status::Ok();
  if (s.IsCorruption()) return Status::Corruption(std::string(what) + ": " + s.ToString());
  return Status::IOError(std::string(what) + ": " + s.ToString());
}

}  // namespace

class SsdTier::Impl {
 public:
  explicit Impl(const SsdOptions& o) : o_(o) {}
  ~Impl();

  Status Open();
  Status Put(const Key& key, std::span<const uint8_t> value, const SsdMeta& meta,
             std::vector<Key>* evicted);
  Status Get(const Key& key, std::vector<uint8_t>* out, SsdMeta* meta);
  bool Contains(const Key& key, uint64_t* version) {
    std::unique_lock lock(mu_);
    auto it = FindLocked(key, lock);
    if (it == map_.end()) return false;
    if (version != nullptr) *version = it->second.version;
    return true;
  }
  Status Remove(const Key& key) {
    uint64_t ticket = 0;
    {
      std::unique_lock lock(mu_);
      if (FindLocked(key, lock) == map_.end()) return Status::NotFound("not in ssd tier");
      RemoveLocked(key);
      ticket = pending_ticket_;
    }
    if (o_.durability == Durability::kSync) return Commit(ticket);
    return Status::Ok();
  }
  std::optional<Key> EvictOne() {
    std::lock_guard lock(mu_);
    return EvictLocked();
  }
  void SetTracked(const Key& key, bool tracked);
  Status SetPolicy(const std::string& eviction, const policies::PolicyParams& params);
  void ForEach(const std::function<void(const Key&, const SsdMeta&)>& fn) {
    std::unique_lock lock(mu_);
    load_cv_.wait(lock, [&] { return loaded_; });
    for (const auto& [k, e] : map_) fn(k, MetaOf(e));
  }
  void WaitForIndexLoad() {
    std::unique_lock lock(mu_);
    load_cv_.wait(lock, [&] { return loaded_; });
  }
  Status Flush() { return Commit(kForceCommit); }
  SsdStats GetStats() const {
    std::lock_guard lock(mu_);
    SsdStats s = stats_;
    s.capacity_bytes = o_.capacity_bytes;
    s.objects = map_.size();
    s.segments = segments_.size();
    s.live_bytes = 0;
    for (const auto& [id, seg] : segments_) s.live_bytes += seg->live_bytes;
    s.disk_bytes = segments_.size() * o_.segment_bytes;
    s.index_loaded = loaded_;
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
  size_t MaxSegments() const {
    return std::max<size_t>(2, o_.capacity_bytes / o_.segment_bytes - 1);
  }
  uint64_t LiveLimit() const {
    return static_cast<uint64_t>(static_cast<double>((MaxSegments() - 1) * o_.segment_bytes) *
                                 (1.0 - o_.clean_live_ratio));
  }

  void Track(const Key& k, const IndexEntry& e) {
    if (untracked_.count(k)) return;
    auto [it, inserted] = id_to_key_.emplace(ObjectIdOf(k), k);
    if (!inserted && it->second != k) return;  // 64-bit id collision: leave untracked
    policy_->OnInsert(InfoOf(k, e), NowUs());
  }
  void Untrack(const Key& k) {
    auto it = id_to_key_.find(ObjectIdOf(k));
    if (it == id_to_key_.end() || it->second != k) return;
    policy_->OnRemove(it->first);
    id_to_key_.erase(it);
  }
  void Insert(const Key& k, const IndexEntry& e) {
    auto it = map_.find(k);
    if (it != map_.end()) RemoveLocked(k, /*log_delete=*/false);
    map_.emplace(k, e);
    auto seg = segments_.find(e.segment);
    if (seg != segments_.end()) seg->second->live_bytes += LiveCost(e);
    Track(k, e);
    max_version_ = std::max(max_version_, e.version);
  }
  void RemoveLocked(const Key& k, bool log_delete = true) {
    auto it = map_.find(k);
    if (it == map_.end()) return;
    auto seg = segments_.find(it->second.segment);
    if (seg != segments_.end()) seg->second->live_bytes -= LiveCost(it->second);
    Untrack(k);
    map_.erase(it);
    dirty_access_.erase(k);
    // While the background load runs, the loader must not bring the key back.
    if (!loaded_) tombstones_.insert(k);
    if (log_delete) PushPending({k, true, {}});
  }
  void PushPending(PendingOp op) {
    pending_.push_back(std::move(op));
    ++pending_ticket_;
  }
  // True when the index entry points past the valid end of the log found by recovery (a
  // torn tail, or an entry written ahead of its data in kNone): never served, deleted.
  bool TornAtOpen(const IndexEntry& e) const {
    return e.segment == recovered_segment_ && e.offset + e.record_bytes > recovered_valid_end_;
  }
  // map_ lookup; while the background load runs, a key not loaded yet is read from the
  // RocksDB index (outside the lock) and inserted, so hits are served right after Open.
  std::unordered_map<Key, IndexEntry, KeyHash>::iterator FindLocked(
      const Key& key, std::unique_lock<std::mutex>& lock);
  std::optional<Key> EvictLocked() {
    while (true) {
      auto id = policy_->Evict(NowUs());
      if (!id) return std::nullopt;
      auto it = id_to_key_.find(*id);
      if (it == id_to_key_.end()) continue;
      Key k = it->second;
      id_to_key_.erase(it);
      if (!map_.count(k)) continue;
      RemoveLocked(k);
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
  Status AppendLocked(const Key& key, const RecordHeader& h, std::span<const uint8_t> payload,
                      IndexEntry* e, bool allow_roll);
  // Hands the buffer being filled (if not empty) to the writer thread; never blocks.
  void WriteBufferLocked();
  // Makes a buffer the one being filled, waiting (mu_ held) for the writer when all are busy.
  void AcquireBufferLocked();
  // Frees the buffers the writer has finished; drops the entries of failed ones.
  void ReapLocked();
  void WriterLoop();
  void MarkUnsyncedLocked() {
    if (unsynced_segs_.empty() || unsynced_segs_.back() != active_)
      unsynced_segs_.push_back(active_);
  }

  // Group commit. A commit (1) under mu_ writes the buffer and takes the pending index ops
  // (PrepareLocked), (2) outside mu_ fdatasyncs the segments written since the last commit and
  // writes the ops to RocksDB (Execute), (3) under mu_ settles the outcome (Settle). Commits
  // are applied to RocksDB in order: Commit() callers are serialised by commit_mu_, and
  // CommitLocked() (rolls, cleaning, close: mu_ held throughout) first waits until no
  // out-of-lock commit is in flight. Lock order: commit_mu_ -> mu_ -> cstate_mu_.
  struct CommitBatch {
    bool empty = true;
    std::vector<PendingOp> ops;
    uint64_t first_ticket = 0, last_ticket = 0;
    std::vector<std::shared_ptr<Segment>> sync_segs;
    uint32_t durable_segment = 0;
    uint64_t durable_end = 0, next_seq = 0, max_version = 0;
    // Buffers handed to the writer in (write_seq_lo, write_seq_hi] belong to this commit.
    uint64_t write_seq_lo = 0, write_seq_hi = 0;
  };
  static constexpr uint64_t kForceCommit = UINT64_MAX;
  Status PrepareLocked(CommitBatch* b);
  // Returns the commit's status (sync + index write); *write_status: the first failed buffer
  // write of the batch (its records are left out of the index write), or OK.
  Status Execute(const CommitBatch& b, Status* write_status);
  void Settle(CommitBatch* b, const Status& st);
  // Commits everything pending up to `ticket` (kForceCommit: a commit pass now). Not under mu_.
  // Returns the commit's error, else a failed buffer write of the commit, else OK.
  Status Commit(uint64_t ticket);
  // Commits with mu_ held (rolls, cleaning, recovery, close). A failed buffer write of the
  // commit is stored in *write_status when not null (its records are dropped either way).
  Status CommitLocked(Status* write_status = nullptr);
  Status TicketResult(uint64_t ticket) const;
  void LoadIndex();
  Status RollLocked();
  // threshold_clean: also clean one sparse sealed segment (at a roll, not at open).
  Status CleanLocked(bool threshold_clean);
  Status CleanSegmentLocked(std::shared_ptr<Segment> seg);
  Status ReadRecord(const Segment& seg, uint64_t offset, uint32_t record_bytes,
                    std::vector<uint8_t>* out);
  Status ScanTail(const std::shared_ptr<Segment>& seg, uint64_t start, uint64_t* valid_end,
                  std::vector<std::pair<Key, IndexEntry>>* found);
  void CommitLoop();

  SsdOptions o_;
  const Clock* clock_ = nullptr;
  std::unique_ptr<DeviceEnv> owned_env_;
  DeviceEnv* env_ = nullptr;
  std::unique_ptr<rocksdb::DB> db_;
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
    bool done = false;  // under wb_mu_
    Status status;      // under wb_mu_
  };
  static constexpr size_t kNoBuffer = SIZE_MAX;
  AlignedBuffer buf_region_;  // write_buffers x write_buffer_bytes, registered with the env
  std::vector<WriteBuf> bufs_;
  size_t fill_ = kNoBuffer;       // the buffer being filled, under mu_
  uint64_t buf_file_offset_ = 0;  // file offset of the buffer being filled (active_)
  size_t buf_len_ = 0;
  uint64_t enqueued_seq_ = 0;  // under mu_: buffers ever handed to the writer
  uint64_t prepared_seq_ = 0;  // under mu_: enqueued_seq_ at the last PrepareLocked
  std::mutex wb_mu_;           // lock order: mu_ -> wb_mu_; the writer takes only wb_mu_
  std::condition_variable wb_cv_;
  std::deque<size_t> wb_queue_;  // under wb_mu_, FIFO (one writer: completes in order)
  uint64_t completed_seq_ = 0;   // under wb_mu_
  struct FailedWrite {
    uint64_t seq;
    uint32_t segment;
    uint64_t offset, len;
    Status status;
  };
  std::vector<FailedWrite> failed_writes_;  // under wb_mu_; consumed by Execute
  bool wb_stop_ = false;                    // under wb_mu_
  std::thread writer_thread_;
  std::vector<std::shared_ptr<Segment>> unsynced_segs_;
  std::vector<PendingOp> pending_;
  uint64_t pending_ticket_ = 0;  // ops ever pushed to pending_
  std::vector<Key>* evicted_sink_ = nullptr;
  uint64_t next_seq_ = 1;
  uint64_t max_version_ = 0;
  std::unique_ptr<policies::EvictionPolicy> policy_;
  SsdStats stats_;

  std::thread commit_thread_;
  std::condition_variable cv_;
  bool stop_ = false;

  // ---- commit state ----
  std::mutex commit_mu_;
  mutable std::mutex cstate_mu_;
  std::condition_variable cstate_cv_;
  bool commit_inflight_ = false;   // under cstate_mu_
  uint64_t committed_ticket_ = 0;  // under cstate_mu_
  struct FailedRange {
    uint64_t first, last;
    Status status;
  };
  static constexpr size_t kMaxFailedRanges = 64;
  std::deque<FailedRange> failed_;  // under cstate_mu_

  // ---- background index load (warm restart) ----
  std::unique_ptr<rocksdb::Iterator> load_iter_;  // implicit snapshot taken at Open
  std::thread load_thread_;
  std::atomic<bool> stop_load_{false};
  std::condition_variable load_cv_;
  bool loaded_ = false;                          // under mu_
  std::unordered_set<Key, KeyHash> tombstones_;  // removed since Open, while loading
  uint32_t recovered_segment_ = UINT32_MAX;      // newest segment at Open
  uint64_t recovered_valid_end_ = UINT64_MAX;    // its valid end found by the tail scan
  uint64_t open_bytes_bound_ = 0;                // bytes in segments at Open (live bound)
  uint64_t open_us_ = 0;
  std::vector<std::pair<Key, SsdMeta>> point_loaded_;  // for on_index_load, under mu_
};

SsdTier::Impl::~Impl() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (commit_thread_.joinable()) commit_thread_.join();
  // Cancel the background load: what it did not reach stays in RocksDB, untouched.
  stop_load_.store(true);
  if (load_thread_.joinable()) load_thread_.join();
  load_iter_.reset();
  if (db_ != nullptr) {
    std::lock_guard lock(mu_);
    for (const Key& k : dirty_access_) {
      auto it = map_.find(k);
      if (it != map_.end() && BufferedRecord(it->second) == nullptr) {
        PushPending({k, false, it->second});
      }
    }
    dirty_access_.clear();
    // Drains every write buffer (the commit waits for the writer), then commits the index.
    Status write_st;
    Status st = CommitLocked(&write_st);
    if (st.ok()) st = write_st;
    if (!st.ok()) {
      KVTIER_LOG(kWarn) << "ssd tier close: " << st.ToString();
    }
    // Persist the memtables so the next open replays no WAL (warm restart in well under 1 s).
    rocksdb::FlushOptions fo;
    db_->Flush(fo, std::vector<rocksdb::ColumnFamilyHandle*>{index_cf_, meta_cf_})
        .PermitUncheckedError();
    for (auto* h : {index_cf_, meta_cf_, default_cf_}) {
      if (h != nullptr) db_->DestroyColumnFamilyHandle(h).PermitUncheckedError();
    }
    db_->Close().PermitUncheckedError();
  }
  // The writer drains its queue before it exits (nothing is queued after the last commit).
  {
    std::lock_guard wb(wb_mu_);
    wb_stop_ = true;
  }
  wb_cv_.notify_all();
  if (writer_thread_.joinable()) writer_thread_.join();
}

Status SsdTier::Impl::Open() {
  clock_ = o_.clock != nullptr ? o_.clock : &DefaultSteadyClock();
  if (o_.dir.empty()) return Status::InvalidArgument("ssd tier needs a data directory");
  if (o_.segment_bytes < (1u << 20) || o_.segment_bytes % ssd::kBlockBytes != 0) {
    return Status::InvalidArgument("segment_bytes must be a multiple of 4096 and >= 1 MiB");
  }
  if (o_.capacity_bytes < 3 * o_.segment_bytes) {
    return Status::InvalidArgument("ssd capacity must hold at least 3 segments");
  }
  o_.write_buffer_bytes = std::clamp<uint64_t>(AlignUp(o_.write_buffer_bytes, ssd::kBlockBytes),
                                               ssd::kBlockBytes, o_.segment_bytes);
  if (o_.clean_live_ratio < 0.05 || o_.clean_live_ratio > 0.9) {
    return Status::InvalidArgument("clean_live_ratio must be in [0.05, 0.9]");
  }
  KVTIER_ASSIGN_OR_RETURN(policy_,
                          policies::MakeEvictionPolicy(o_.eviction_policy, o_.policy_params));
  if (o_.env == nullptr) {
    KVTIER_ASSIGN_OR_RETURN(owned_env_, NewDirEnv(o_.dir + "/segments", o_.dir_env));
    env_ = owned_env_.get();
  } else {
    env_ = o_.env;
  }
  o_.write_buffers = std::clamp<uint32_t>(o_.write_buffers, 1, SsdOptions::kMaxWriteBuffers);
  buf_region_ = AllocateAligned(o_.write_buffers * o_.write_buffer_bytes, ssd::kBlockBytes);
  bufs_.resize(o_.write_buffers);
  for (size_t i = 0; i < bufs_.size(); ++i) {
    bufs_[i].data = buf_region_.get() + i * o_.write_buffer_bytes;
  }
  std::span<uint8_t> region(buf_region_.get(), o_.write_buffers * o_.write_buffer_bytes);
  KVTIER_RETURN_IF_ERROR(env_->RegisterBuffers({&region, 1}));
  writer_thread_ = std::thread([this] { WriterLoop(); });

  // ---- RocksDB index ----
  rocksdb::Options options;
  options.create_if_missing = true;
  options.create_missing_column_families = true;
  options.paranoid_checks = true;
  options.max_background_jobs = 2;
  options.keep_log_file_num = 4;
  options.info_log_level = rocksdb::InfoLogLevel::WARN_LEVEL;
  rocksdb::ColumnFamilyOptions cf_options(options);
  // Bounds the WAL replayed after a crash (a clean close flushes it all).
  cf_options.write_buffer_size = 16ull << 20;
  rocksdb::BlockBasedTableOptions table;
  table.checksum = rocksdb::kXXH3;
  // Point reads serve keys the background load has not reached yet (and misses).
  table.filter_policy.reset(rocksdb::NewBloomFilterPolicy(10));
  cf_options.table_factory.reset(rocksdb::NewBlockBasedTableFactory(table));
  std::vector<rocksdb::ColumnFamilyDescriptor> cfs = {
      {rocksdb::kDefaultColumnFamilyName, cf_options}, {"index", cf_options}, {"meta", cf_options}};
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* raw = nullptr;
  KVTIER_RETURN_IF_ERROR(
      FromRocks(rocksdb::DB::Open(options, o_.dir + "/index", cfs, &handles, &raw), "open index"));
  db_.reset(raw);
  default_cf_ = handles[0];
  index_cf_ = handles[1];
  meta_cf_ = handles[2];

  std::string format;
  rocksdb::Status s = db_->Get({}, meta_cf_, "format", &format);
  if (s.IsNotFound()) {
    rocksdb::WriteBatch wb;
    KVTIER_RETURN_IF_ERROR(FromRocks(wb.Put(meta_cf_, "format", kFormatName), "meta"));
    rocksdb::WriteOptions wo;
    wo.sync = true;
    KVTIER_RETURN_IF_ERROR(FromRocks(db_->Write(wo, &wb), "write meta"));
  } else if (!s.ok()) {
    return FromRocks(s, "read meta");
  } else if (format != kFormatName) {
    return Status::Corruption("unknown ssd format '" + format + "'");
  }

  // ---- segments ----
  KVTIER_ASSIGN_OR_RETURN(auto names, env_->List());
  for (const auto& name : names) {
    uint32_t id = 0;
    if (!ssd::ParseSegmentName(name, &id)) continue;
    KVTIER_ASSIGN_OR_RETURN(auto dev, env_->Open(name, false));
    auto seg = std::make_shared<Segment>();
    seg->id = id;
    seg->dev = std::move(dev);
    segments_[id] = std::move(seg);
  }

  // ---- counters: persisted by every commit, so Open needs no index scan ----
  bool have_counters = false;
  {
    std::string c;
    if (db_->Get({}, meta_cf_, "counters", &c).ok() && c.size() == 16) {
      std::memcpy(&next_seq_, c.data(), 8);
      std::memcpy(&max_version_, c.data() + 8, 8);
      have_counters = true;
    }
  }
  for (const auto& [id, seg] : segments_) open_bytes_bound_ += seg->dev->Size();

  // ---- tail of the newest segment ----
  uint32_t next_id = 1;
  std::vector<std::pair<Key, IndexEntry>> found;
  if (!segments_.empty()) {
    auto newest = segments_.rbegin()->second;
    next_id = newest->id + 1;
    uint64_t start = 0;
    std::string de;
    if (db_->Get({}, meta_cf_, "durable_end", &de).ok() && de.size() == 12) {
      uint32_t seg_id;
      std::memcpy(&seg_id, de.data(), 4);
      if (seg_id == newest->id) std::memcpy(&start, de.data() + 4, 8);
    }
    uint64_t valid_end = start;
    KVTIER_RETURN_IF_ERROR(ScanTail(newest, start, &valid_end, &found));
    // Index entries pointing past the valid end of the log (index written ahead of data in
    // kNone, or a torn tail) are dropped as the load or a point read meets them.
    recovered_segment_ = newest->id;
    recovered_valid_end_ = valid_end;
    if (!found.empty()) {
      KVTIER_LOG(kInfo) << "ssd recovery: segment " << newest->id << " re-indexes " << found.size()
                        << " records past the last commit; valid end at offset " << valid_end;
    }
  }
  // The index is loaded into memory in the background (LoadIndex); the iterator's implicit
  // snapshot is the index as of now, before any write of this process.
  load_iter_.reset(db_->NewIterator({}, index_cf_));
  load_iter_->SeekToFirst();
  for (const auto& [k, e] : found) {
    // A record past the last commit replaces the indexed entry only when it is newer.
    IndexEntry cur;
    std::string v;
    if (db_->Get({}, index_cf_, KeySlice(k), &v).ok() &&
        ssd::DecodeIndexEntry({reinterpret_cast<const uint8_t*>(v.data()), v.size()}, &cur).ok() &&
        cur.seq > e.seq && !TornAtOpen(cur)) {
      continue;
    }
    if (auto m = map_.find(k); m != map_.end() && m->second.seq > e.seq) continue;
    next_seq_ = std::max(next_seq_, e.seq + 1);
    Insert(k, e);
    PushPending({k, false, e});
    ++stats_.recovered_records;
  }

  // Appends always continue in a fresh segment, so a torn tail is never scanned again.
  KVTIER_ASSIGN_OR_RETURN(auto dev, env_->Open(ssd::SegmentName(next_id), true));
  KVTIER_RETURN_IF_ERROR(dev->Allocate(0, o_.segment_bytes));
  active_ = std::make_shared<Segment>();
  active_->id = next_id;
  active_->dev = std::move(dev);
  segments_[next_id] = active_;
  buf_file_offset_ = 0;
  buf_len_ = 0;
  {
    std::lock_guard lock(mu_);
    KVTIER_RETURN_IF_ERROR(CommitLocked());
  }
  open_us_ = NowUs();
  load_thread_ = std::thread([this] { LoadIndex(); });
  commit_thread_ = std::thread([this] { CommitLoop(); });
  if (!have_counters) {
    // An index written before the counters existed: versions and sequence numbers are only
    // known after the full load, so wait for it (once; the next commit persists them).
    WaitForIndexLoad();
  }
  return Status::Ok();
}

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
    // Entries past the failure stay reachable by point reads (FindLocked keeps working
    // only while loading), so a failed scan keeps the tier in loading mode: logged, loud.
    KVTIER_LOG(kError) << "ssd index load stopped: " << iter_status.ToString()
                       << "; unloaded entries are served by point reads";
    return;
  }
  if (!done) return;  // cancelled by close
  std::lock_guard lock(mu_);
  // Cleaning was deferred while live bytes were only partly known.
  Status st = CleanLocked(/*threshold_clean=*/false);
  if (!st.ok()) {
    KVTIER_LOG(kWarn) << "ssd clean after index load: " << st.ToString();
  }
  load_cv_.notify_all();
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
  // locks of its own).
  if (o_.on_index_load) point_loaded_.emplace_back(key, MetaOf(e));
  return map_.find(key);
}

Status SsdTier::Impl::ScanTail(const std::shared_ptr<Segment>& seg, uint64_t start,
                               uint64_t* valid_end,
                               std::vector<std::pair<Key, IndexEntry>>* found) {
  uint64_t size = seg->dev->Size();
  uint64_t pos = start;
  std::vector<uint8_t> rec;
  while (pos + ssd::kRecordHeaderBytes <= size) {
    Status st = ReadRecord(*seg, pos, ssd::kRecordHeaderBytes, &rec);
    RecordHeader h;
    if (st.ok()) st = ssd::DecodeRecordHeader(rec, &h);
    if (!st.ok()) {
      // Padding after a group commit runs to the next 4 KiB block; anything else ends the log.
      if (pos % ssd::kBlockBytes != 0) {
        pos = AlignUp(pos, ssd::kBlockBytes);
        continue;
      }
      break;
    }
    uint64_t n = ssd::RecordBytes(h);
    if (pos + n > size || n > o_.segment_bytes) break;
    if (!ReadRecord(*seg, pos, static_cast<uint32_t>(n), &rec).ok()) break;
    std::span<const uint8_t> payload(rec.data() + ssd::kRecordHeaderBytes, h.stored_bytes);
    if (ssd::PayloadChecksum(payload) != h.payload_checksum) break;  // torn
    IndexEntry e;
    e.codec = h.codec;
    e.kind = h.kind;
    e.segment = seg->id;
    e.offset = pos;
    e.record_bytes = static_cast<uint32_t>(n);
    e.raw_bytes = h.raw_bytes;
    e.checksum = h.payload_checksum;
    e.tenant = h.tenant;
    e.created_unix_ms = h.created_unix_ms;
    e.seq = h.seq;
    e.version = h.version;
    e.expires_unix_ms = h.expires_unix_ms;
    e.parent_id = h.parent_id;
    e.recompute_tokens = h.recompute_tokens;
    found->emplace_back(h.key, e);
    pos += AlignUp(n, ssd::kRecordAlignBytes);
  }
  *valid_end = pos;
  return Status::Ok();
}

Status SsdTier::Impl::ReadRecord(const Segment& seg, uint64_t offset, uint32_t record_bytes,
                                 std::vector<uint8_t>* out) {
  size_t a = std::max<size_t>(seg.dev->Alignment(), 1);
  uint64_t start = offset / a * a;
  uint64_t end = AlignUp(offset + record_bytes, a);
  AlignedBuffer buf = AllocateAligned(end - start, std::max<size_t>(a, 64));
  KVTIER_RETURN_IF_ERROR(seg.dev->Read(start, {buf.get(), end - start}));
  out->assign(buf.get() + (offset - start), buf.get() + (offset - start) + record_bytes);
  return Status::Ok();
}

Status SsdTier::Impl::Put(const Key& key, std::span<const uint8_t> value, const SsdMeta& meta,
                          std::vector<Key>* evicted) {
  if (value.size() + ssd::kRecordHeaderBytes + ssd::kBlockBytes > o_.segment_bytes ||
      value.size() > UINT32_MAX / 2) {
    return Status::InvalidArgument("value larger than an ssd segment");
  }
  // Adaptive compression, outside the lock. FP4 global KV is incompressible: skipped.
  std::vector<uint8_t> compressed;
  std::span<const uint8_t> payload = value;
  Codec codec = Codec::kNone;
  if (o_.compression && meta.kind != policies::ObjectKind::kGlobalKv && value.size() >= 512) {
    size_t sample = std::min<size_t>(value.size(), o_.compression_sample_bytes);
    std::vector<uint8_t> tmp(ZSTD_compressBound(sample));
    size_t n = ZSTD_compress(tmp.data(), tmp.size(), value.data(), sample, o_.zstd_level);
    if (!ZSTD_isError(n) && n * 10 < sample * 9) {
      compressed.resize(ZSTD_compressBound(value.size()));
      n = ZSTD_compress(compressed.data(), compressed.size(), value.data(), value.size(),
                        o_.zstd_level);
      if (!ZSTD_isError(n) && n * 20 < value.size() * 19) {
        compressed.resize(n);
        payload = compressed;
        codec = Codec::kZstd;
      }
    }
  }
  RecordHeader h;
  h.codec = codec;
  h.kind = static_cast<uint8_t>(meta.kind);
  h.stored_bytes = static_cast<uint32_t>(payload.size());
  h.raw_bytes = static_cast<uint32_t>(value.size());
  h.tenant = meta.tenant;
  h.key = key;
  h.created_unix_ms = DefaultSystemClock().NowMs();
  h.payload_checksum = ssd::PayloadChecksum(payload);
  h.version = meta.version;
  h.expires_unix_ms = meta.expires_unix_ms;
  h.parent_id = meta.parent_id;
  h.recompute_tokens = meta.recompute_tokens;

  uint64_t need = AlignUp(ssd::kRecordHeaderBytes + payload.size(), ssd::kRecordAlignBytes);
  std::unique_lock lock(mu_);
  // The previous version (if any) must be in memory to be replaced (point read if not loaded).
  (void)FindLocked(key, lock);
  if (!loaded_) {
    // While the index loads, live bytes are known only for loaded entries. A put that could
    // need eviction or segment cleaning (bounded by the bytes that existed at Open) waits for
    // the load; any other put proceeds at once.
    auto needs_full_state = [&] {
      uint64_t live = open_bytes_bound_;
      for (const auto& [id, seg] : segments_) live += seg->live_bytes;
      bool may_roll = buf_file_offset_ + buf_len_ + need + ssd::kBlockBytes > o_.segment_bytes;
      return live + need > LiveLimit() || (may_roll && segments_.size() + 1 > MaxSegments());
    };
    if (needs_full_state()) load_cv_.wait(lock, [&] { return loaded_; });
  }
  evicted_sink_ = evicted;
  struct SinkReset {
    std::vector<Key>** p;
    ~SinkReset() { *p = nullptr; }
  } reset{&evicted_sink_};
  // Make room: the previous version of the key no longer counts; then evict by policy.
  uint64_t live = 0;
  for (const auto& [id, seg] : segments_) live += seg->live_bytes;
  if (auto it = map_.find(key); it != map_.end()) live -= LiveCost(it->second);
  while (live + need > LiveLimit()) {
    auto victim = EvictLocked();
    if (!victim) return Status::Rejected("ssd tier full (pinned objects fill it)");
    if (evicted != nullptr) evicted->push_back(*victim);
    live = 0;
    for (const auto& [id, seg] : segments_) live += seg->live_bytes;
  }
  h.seq = next_seq_++;
  IndexEntry e;
  KVTIER_RETURN_IF_ERROR(AppendLocked(key, h, payload, &e, true));
  if (codec == Codec::kZstd) stats_.compressed_bytes_saved += value.size() - payload.size();
  if (o_.durability == Durability::kSync) {
    uint64_t ticket = pending_ticket_;
    lock.unlock();
    Status st = Commit(ticket);
    // An error: the commit failed (the entry was dropped) or one of its buffer writes did
    // (this unit's included, or not: reported either way; nothing unwritten is indexed).
    if (!st.ok()) return st;
    lock.lock();
    ReapLocked();  // a buffer write that failed in another thread's commit drops the entry
    auto it = map_.find(key);
    if (it == map_.end() || it->second.seq != h.seq) {
      // Its buffer write failed inside another thread's commit: dropped, never indexed.
      return Status::IOError("ssd write failed; the unit was not stored");
    }
  }
  return Status::Ok();
}

Status SsdTier::Impl::AppendLocked(const Key& key, const RecordHeader& h,
                                   std::span<const uint8_t> payload, IndexEntry* e,
                                   bool allow_roll) {
  uint64_t rec = ssd::kRecordHeaderBytes + payload.size();
  uint64_t padded = AlignUp(rec, ssd::kRecordAlignBytes);
  uint64_t pos = buf_file_offset_ + buf_len_;
  if (AlignUp(pos + padded, ssd::kBlockBytes) > o_.segment_bytes) {
    if (!allow_roll) return Status::Rejected("no room in the active segment");
    KVTIER_RETURN_IF_ERROR(RollLocked());
  }
  if (buf_len_ + padded > o_.write_buffer_bytes) WriteBufferLocked();
  uint64_t offset = buf_file_offset_ + buf_len_;
  if (padded > o_.write_buffer_bytes) {
    // A record larger than the write buffer is written on its own.
    uint64_t n = AlignUp(rec, ssd::kBlockBytes);
    AlignedBuffer big = AllocateAligned(n, ssd::kBlockBytes);
    std::memset(big.get() + rec, 0, n - rec);
    ssd::EncodeRecordHeader(h, big.get());
    std::memcpy(big.get() + ssd::kRecordHeaderBytes, payload.data(), payload.size());
    Status st = active_->dev->Write(buf_file_offset_, {big.get(), n});
    if (!st.ok()) {
      ++stats_.io_errors;
      return st;
    }
    buf_file_offset_ += n;
    stats_.bytes_written += n;
    MarkUnsyncedLocked();
  } else {
    AcquireBufferLocked();  // waits only when every buffer is in flight
    uint8_t* p = bufs_[fill_].data + buf_len_;
    ssd::EncodeRecordHeader(h, p);
    std::memcpy(p + ssd::kRecordHeaderBytes, payload.data(), payload.size());
    std::memset(p + rec, 0, padded - rec);
    buf_len_ += padded;
  }
  e->codec = h.codec;
  e->kind = h.kind;
  e->segment = active_->id;
  e->offset = offset;
  e->record_bytes = static_cast<uint32_t>(rec);
  e->raw_bytes = h.raw_bytes;
  e->checksum = h.payload_checksum;
  e->tenant = h.tenant;
  e->created_unix_ms = h.created_unix_ms;
  e->last_access_unix_ms = h.created_unix_ms;
  e->seq = h.seq;
  e->version = h.version;
  e->expires_unix_ms = h.expires_unix_ms;
  e->parent_id = h.parent_id;
  e->recompute_tokens = h.recompute_tokens;
  Insert(key, *e);
  PushPending({key, false, *e});
  return Status::Ok();
}

void SsdTier::Impl::WriteBufferLocked() {
  if (buf_len_ == 0 || fill_ == kNoBuffer) return;
  uint64_t n = AlignUp(buf_len_, ssd::kBlockBytes);
  WriteBuf& b = bufs_[fill_];
  std::memset(b.data + buf_len_, 0, n - buf_len_);
  b.seg = active_;
  b.file_offset = buf_file_offset_;
  b.len = n;
  b.write_seq = ++enqueued_seq_;
  {
    std::lock_guard wb(wb_mu_);
    b.done = false;
    b.status = Status::Ok();
    wb_queue_.push_back(fill_);
  }
  wb_cv_.notify_all();
  fill_ = kNoBuffer;
  buf_file_offset_ += n;
  buf_len_ = 0;
  MarkUnsyncedLocked();
}

void SsdTier::Impl::AcquireBufferLocked() {
  while (fill_ == kNoBuffer) {
    ReapLocked();
    for (size_t i = 0; i < bufs_.size(); ++i) {
      if (!bufs_[i].in_use) {
        bufs_[i].in_use = true;
        fill_ = i;
        return;
      }
    }
    // Every buffer is in flight: wait for the writer (it never takes mu_).
    std::unique_lock wb(wb_mu_);
    wb_cv_.wait(wb, [&] {
      for (const WriteBuf& b : bufs_) {
        if (b.in_use && b.done) return true;
      }
      return false;
    });
  }
}

void SsdTier::Impl::ReapLocked() {
  struct Lost {
    std::shared_ptr<Segment> seg;
    uint64_t offset, len;
    Status status;
  };
  std::vector<Lost> lost;
  {
    std::lock_guard wb(wb_mu_);
    for (size_t i = 0; i < bufs_.size(); ++i) {
      WriteBuf& b = bufs_[i];
      if (i == fill_ || !b.in_use || !b.done) continue;
      if (b.status.ok()) {
        stats_.bytes_written += b.len;
      } else {
        lost.push_back({b.seg, b.file_offset, b.len, b.status});
      }
      b.in_use = false;
      b.done = false;
      b.seg.reset();
    }
  }
  for (const Lost& l : lost) {
    // The records never reached the device: forget them (their index entries are left out
    // of the commit that covers this write, see Execute).
    ++stats_.io_errors;
    std::vector<Key> keys;
    for (const auto& [k, e] : map_) {
      if (e.segment == l.seg->id && e.offset >= l.offset && e.offset < l.offset + l.len) {
        keys.push_back(k);
      }
    }
    for (const Key& k : keys) RemoveLocked(k);
    KVTIER_LOG(kWarn) << "ssd buffer write failed (segment " << l.seg->id << " @" << l.offset
                      << ", " << keys.size() << " units dropped): " << l.status.ToString();
  }
}

void SsdTier::Impl::WriterLoop() {
  std::unique_lock wb(wb_mu_);
  while (true) {
    wb_cv_.wait(wb, [&] { return wb_stop_ || !wb_queue_.empty(); });
    if (wb_queue_.empty()) return;  // stopping, and everything queued is written
    size_t i = wb_queue_.front();
    wb_queue_.pop_front();
    uint8_t* data = bufs_[i].data;
    std::shared_ptr<Segment> seg = bufs_[i].seg;
    uint64_t offset = bufs_[i].file_offset, n = bufs_[i].len, seq = bufs_[i].write_seq;
    wb.unlock();
    // Submitted as up to kWriteSplit writes in one batch (queue depth > 1 on io_uring).
    uint64_t chunk =
        std::max<uint64_t>(AlignUp(n / kWriteSplit, ssd::kBlockBytes), kMinWriteChunkBytes);
    IoRequest reqs[kWriteSplit + 1];
    size_t count = 0;
    for (uint64_t off = 0; off < n; off += chunk) {
      reqs[count++] = {IoRequest::Op::kWrite,
                       offset + off,
                       data + off,
                       static_cast<size_t>(std::min(chunk, n - off)),
                       {}};
    }
    Status st = seg->dev->Submit({reqs, count});
    wb.lock();
    bufs_[i].done = true;
    bufs_[i].status = st;
    completed_seq_ = seq;
    if (!st.ok()) failed_writes_.push_back({seq, seg->id, offset, n, st});
    wb_cv_.notify_all();
  }
}

Status SsdTier::Impl::PrepareLocked(CommitBatch* b) {
  b->empty = true;
  if (buf_len_ == 0 && pending_.empty() && unsynced_segs_.empty()) return Status::Ok();
  WriteBufferLocked();
  b->empty = false;
  b->write_seq_lo = prepared_seq_;
  b->write_seq_hi = enqueued_seq_;
  prepared_seq_ = enqueued_seq_;
  b->ops = std::move(pending_);
  pending_.clear();
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

Status SsdTier::Impl::Execute(const CommitBatch& b, Status* write_status) {
  bool durable = o_.durability != Durability::kNone;
  // Every buffer of this commit must have reached the device before the sync; records of a
  // failed buffer are never indexed.
  std::vector<FailedWrite> failed;
  {
    std::unique_lock wb(wb_mu_);
    wb_cv_.wait(wb, [&] { return completed_seq_ >= b.write_seq_hi; });
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
      st = seg->dev->Sync(true);
      if (!st.ok()) break;
    }
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
      rocksdb::WriteOptions wo;
      wo.sync = durable;
      st = FromRocks(db_->Write(wo, &wb), "index write");
    }
  }
  {
    std::lock_guard c(cstate_mu_);
    if (b.last_ticket >= b.first_ticket && !st.ok()) {
      failed_.push_back({b.first_ticket, b.last_ticket, st});
      if (failed_.size() > kMaxFailedRanges) failed_.pop_front();
    }
    committed_ticket_ = std::max(committed_ticket_, b.last_ticket);
    commit_inflight_ = false;
  }
  cstate_cv_.notify_all();
  return st;
}

void SsdTier::Impl::Settle(CommitBatch* b, const Status& st) {
  ReapLocked();  // drops the entries of failed buffer writes before ops are retried
  if (st.ok()) {
    ++stats_.commits;
    return;
  }
  ++stats_.io_errors;
  // Ops are retried at the next commit only while they are still the key's newest state
  // (another commit may have run since Execute: a stale op must not overwrite a newer one).
  bool data_durable = st.message().find("index write") != std::string::npos ||
                      st.message().find("batch") != std::string::npos;
  std::vector<PendingOp> retry;
  for (auto& op : b->ops) {
    auto it = map_.find(op.key);
    bool current = it != map_.end() && it->second.seq == op.entry.seq;
    if (op.is_delete) {
      if (it == map_.end()) retry.push_back(op);
    } else if (current && data_durable) {
      retry.push_back(op);
    } else if (current) {
      RemoveLocked(op.key);  // the data may not be durable: forget the entry
    }
  }
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

Status SsdTier::Impl::Commit(uint64_t ticket) {
  std::lock_guard serial(commit_mu_);
  if (ticket != kForceCommit) {
    std::lock_guard c(cstate_mu_);
    if (committed_ticket_ >= ticket) {
      for (const auto& f : failed_) {
        if (ticket >= f.first && ticket <= f.last) return f.status;
      }
      return Status::Ok();  // covered by an earlier (group) commit
    }
  }
  CommitBatch b;
  std::unique_lock lock(mu_);
  {
    // A CommitLocked in flight has finished by now (it holds mu_ throughout).
    KVTIER_RETURN_IF_ERROR(PrepareLocked(&b));
  }
  if (b.empty) return Status::Ok();
  lock.unlock();
  Status write_st;
  Status st = Execute(b, &write_st);  // buffer writes, fdatasync, index write: outside the lock
  lock.lock();
  Settle(&b, st);
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
  Status write_st;
  Status st = Execute(b, &write_st);
  Settle(&b, st);
  if (write_status != nullptr) *write_status = write_st;
  return st;
}

Status SsdTier::Impl::RollLocked() {
  KVTIER_RETURN_IF_ERROR(CommitLocked());
  uint32_t id = active_->id + 1;
  KVTIER_ASSIGN_OR_RETURN(auto dev, env_->Open(ssd::SegmentName(id), true));
  Status st = dev->Allocate(0, o_.segment_bytes);
  if (!st.ok()) {
    ++stats_.io_errors;
    Status rm = env_->Remove(ssd::SegmentName(id));
    (void)rm;
    return st;
  }
  auto seg = std::make_shared<Segment>();
  seg->id = id;
  seg->dev = std::move(dev);
  segments_[id] = seg;
  active_ = seg;
  buf_file_offset_ = 0;
  buf_len_ = 0;
  return CleanLocked(/*threshold_clean=*/true);
}

Status SsdTier::Impl::CleanLocked(bool threshold_clean) {
  // At most one threshold-driven clean per roll, plus whatever the segment limit needs.
  bool threshold_done = !threshold_clean;
  // While the index loads, segments' live bytes are partial: cleaning would relocate too
  // little and delete live data. It is deferred to the end of the load (LoadIndex); Put
  // waits for the load before a roll could exceed the segment limit.
  if (!loaded_) return Status::Ok();
  while (true) {
    std::shared_ptr<Segment> victim;
    for (const auto& [id, seg] : segments_) {
      if (seg == active_) continue;
      if (victim == nullptr || seg->live_bytes < victim->live_bytes) victim = seg;
    }
    if (victim == nullptr) return Status::Ok();
    bool over_limit = segments_.size() > MaxSegments();
    bool sparse =
        !threshold_done && static_cast<double>(victim->live_bytes) <
                               o_.clean_live_ratio * static_cast<double>(o_.segment_bytes);
    if (!over_limit && !sparse) return Status::Ok();
    if (!over_limit) threshold_done = true;
    KVTIER_RETURN_IF_ERROR(CleanSegmentLocked(victim));
  }
}

Status SsdTier::Impl::CleanSegmentLocked(std::shared_ptr<Segment> seg) {
  std::vector<std::pair<Key, IndexEntry>> live;
  for (const auto& [k, e] : map_) {
    if (e.segment == seg->id) live.emplace_back(k, e);
  }
  std::sort(live.begin(), live.end(),
            [](const auto& a, const auto& b) { return a.second.offset < b.second.offset; });
  std::vector<uint8_t> rec;
  for (const auto& [k, old] : live) {
    Status st = ReadRecord(*seg, old.offset, old.record_bytes, &rec);
    RecordHeader h;
    if (st.ok()) st = ssd::DecodeRecordHeader(rec, &h);
    if (st.ok() && (h.key != k || h.seq != old.seq ||
                    ssd::PayloadChecksum({rec.data() + ssd::kRecordHeaderBytes, h.stored_bytes}) !=
                        old.checksum)) {
      st = Status::Corruption("checksum");
    }
    if (!st.ok()) {
      if (st.IsCorruption())
        ++stats_.checksum_failures;
      else
        ++stats_.io_errors;
      RemoveLocked(k);
      if (evicted_sink_ != nullptr) evicted_sink_->push_back(k);
      continue;
    }
    IndexEntry e;
    st = AppendLocked(k, h, {rec.data() + ssd::kRecordHeaderBytes, h.stored_bytes}, &e, false);
    if (!st.ok()) {
      // No room to relocate: the unit is dropped, as an eviction.
      RemoveLocked(k);
      ++stats_.evictions;
      if (evicted_sink_ != nullptr) evicted_sink_->push_back(k);
      if (!st.IsRejected()) return st;
      continue;
    }
    auto it = map_.find(k);
    if (it != map_.end()) {
      it->second.hit_count = old.hit_count;
      it->second.last_access_unix_ms = old.last_access_unix_ms;
      it->second.created_unix_ms = old.created_unix_ms;
    }
  }
  // Relocated entries must be durable before the old segment disappears.
  KVTIER_RETURN_IF_ERROR(CommitLocked());
  segments_.erase(seg->id);
  Status st = env_->Remove(ssd::SegmentName(seg->id));
  if (!st.ok() && !st.IsNotFound()) {
    KVTIER_LOG(kWarn) << "remove segment: " << st.ToString();
  }
  ++stats_.segments_cleaned;
  return Status::Ok();
}

Status SsdTier::Impl::Get(const Key& key, std::vector<uint8_t>* out, SsdMeta* meta) {
  IndexEntry e;
  std::shared_ptr<Segment> seg;
  std::vector<uint8_t> rec;
  {
    std::unique_lock lock(mu_);
    auto it = FindLocked(key, lock);
    if (it == map_.end()) return Status::NotFound("not in ssd tier");
    it->second.hit_count++;
    it->second.last_access_unix_ms = DefaultSystemClock().NowMs();
    if (dirty_access_.size() < kMaxDirtyAccess) dirty_access_.insert(key);
    e = it->second;
    if (id_to_key_.count(ObjectIdOf(key))) policy_->OnAccess(ObjectIdOf(key), NowUs());
    if (const uint8_t* p = BufferedRecord(e); p != nullptr) {
      rec.assign(p, p + e.record_bytes);  // being filled or in flight: served from memory
    } else {
      auto s = segments_.find(e.segment);
      if (s == segments_.end()) return Status::Internal("index points to a missing segment");
      seg = s->second;
    }
  }
  Status st;
  if (seg != nullptr) st = ReadRecord(*seg, e.offset, e.record_bytes, &rec);
  if (!st.ok() && !st.IsCorruption()) {
    std::lock_guard lock(mu_);
    ++stats_.io_errors;
    return st;
  }
  RecordHeader h;
  if (st.ok()) st = ssd::DecodeRecordHeader(rec, &h);
  if (st.ok() && (h.key != key || h.seq != e.seq || ssd::RecordBytes(h) != e.record_bytes ||
                  ssd::PayloadChecksum({rec.data() + ssd::kRecordHeaderBytes, h.stored_bytes}) !=
                      e.checksum)) {
    st = Status::Corruption("ssd record failed checksum verification");
  }
  if (!st.ok()) {
    std::lock_guard lock(mu_);
    ++stats_.checksum_failures;
    auto it = map_.find(key);
    if (it != map_.end() && it->second.seq == e.seq) RemoveLocked(key);  // quarantine
    KVTIER_LOG(kWarn) << "ssd checksum failure in segment " << e.segment << " @" << e.offset
                      << ": quarantined";
    return Status::Corruption(st.message());
  }
  std::span<const uint8_t> payload(rec.data() + ssd::kRecordHeaderBytes, h.stored_bytes);
  out->clear();
  if (h.codec == Codec::kZstd) {
    out->resize(h.raw_bytes);
    size_t n = ZSTD_decompress(out->data(), out->size(), payload.data(), payload.size());
    if (ZSTD_isError(n) || n != h.raw_bytes) {
      out->clear();
      std::lock_guard lock(mu_);
      ++stats_.checksum_failures;
      RemoveLocked(key);
      return Status::Corruption("zstd payload failed to decode");
    }
  } else {
    out->assign(payload.begin(), payload.end());
  }
  if (meta != nullptr) *meta = MetaOf(e);
  std::lock_guard lock(mu_);
  ++stats_.hits;
  stats_.bytes_read += e.record_bytes;
  return Status::Ok();
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
  policy_ = std::move(policy);
  id_to_key_.clear();
  std::vector<std::pair<uint64_t, Key>> order;
  for (const auto& [k, e] : map_) order.emplace_back(e.last_access_unix_ms, k);
  std::sort(order.begin(), order.end());
  for (const auto& [t, k] : order) Track(k, map_.at(k));
  return Status::Ok();
}

void SsdTier::Impl::CommitLoop() {
  std::unique_lock lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, std::chrono::milliseconds(std::max<uint32_t>(o_.group_commit_ms, 1)));
    if (stop_) break;
    lock.unlock();
    Status st = Commit(kForceCommit);  // the fdatasync runs outside the tier lock
    if (!st.ok()) {
      KVTIER_LOG(kWarn) << "ssd group commit failed: " << st.ToString();
    }
    lock.lock();
  }
}

// ---------------------------------------------------------------- SsdTier ----

SsdTier::SsdTier(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SsdTier::~SsdTier() = default;

StatusOr<std::unique_ptr<SsdTier>> SsdTier::Open(const SsdOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  KVTIER_RETURN_IF_ERROR(impl->Open());
  return std::unique_ptr<SsdTier>(new SsdTier(std::move(impl)));
}

Status SsdTier::Put(const Key& key, std::span<const uint8_t> value, const SsdMeta& meta,
                    std::vector<Key>* evicted) {
  return impl_->Put(key, value, meta, evicted);
}
Status SsdTier::Get(const Key& key, std::vector<uint8_t>* out, SsdMeta* meta) {
  return impl_->Get(key, out, meta);
}
bool SsdTier::Contains(const Key& key, uint64_t* version) const {
  return impl_->Contains(key, version);
}
Status SsdTier::Remove(const Key& key) { return impl_->Remove(key); }
std::optional<Key> SsdTier::EvictOne() { return impl_->EvictOne(); }
void SsdTier::SetTracked(const Key& key, bool tracked) { impl_->SetTracked(key, tracked); }
Status SsdTier::SetPolicy(const std::string& eviction, const policies::PolicyParams& params) {
  return impl_->SetPolicy(eviction, params);
}
void SsdTier::ForEach(const std::function<void(const Key&, const SsdMeta&)>& fn) const {
  impl_->ForEach(fn);
}
void SsdTier::WaitForIndexLoad() const { impl_->WaitForIndexLoad(); }
Status SsdTier::Flush() { return impl_->Flush(); }
SsdStats SsdTier::GetStats() const { return impl_->GetStats(); }
uint64_t SsdTier::max_version() const { return impl_->max_version(); }

}  // namespace kvtier::storage
