#include "storage/ssd_tier.h"

#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/table.h>
#include <rocksdb/write_batch.h>
#include <zstd.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
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
  bool Contains(const Key& key, uint64_t* version) const {
    std::lock_guard lock(mu_);
    auto it = map_.find(key);
    if (it == map_.end()) return false;
    if (version != nullptr) *version = it->second.version;
    return true;
  }
  Status Remove(const Key& key) {
    std::lock_guard lock(mu_);
    if (!map_.count(key)) return Status::NotFound("not in ssd tier");
    RemoveLocked(key);
    if (o_.durability == Durability::kSync) return CommitLocked();
    return Status::Ok();
  }
  std::optional<Key> EvictOne() {
    std::lock_guard lock(mu_);
    return EvictLocked();
  }
  void SetTracked(const Key& key, bool tracked);
  Status SetPolicy(const std::string& eviction, const policies::PolicyParams& params);
  void ForEach(const std::function<void(const Key&, const SsdMeta&)>& fn) const {
    std::lock_guard lock(mu_);
    for (const auto& [k, e] : map_) fn(k, MetaOf(e));
  }
  Status Flush() {
    std::lock_guard lock(mu_);
    return CommitLocked();
  }
  SsdStats GetStats() const {
    std::lock_guard lock(mu_);
    SsdStats s = stats_;
    s.capacity_bytes = o_.capacity_bytes;
    s.objects = map_.size();
    s.segments = segments_.size();
    s.live_bytes = 0;
    for (const auto& [id, seg] : segments_) s.live_bytes += seg->live_bytes;
    s.disk_bytes = segments_.size() * o_.segment_bytes;
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
    if (log_delete) pending_.push_back({k, true, {}});
  }
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

  bool InBuffer(const IndexEntry& e) const {
    return active_ != nullptr && e.segment == active_->id && e.offset >= buf_file_offset_;
  }
  Status AppendLocked(const Key& key, const RecordHeader& h, std::span<const uint8_t> payload,
                      IndexEntry* e, bool allow_roll);
  Status WriteBufferLocked();
  void DropUnwrittenLocked();
  Status CommitLocked();
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
  AlignedBuffer buf_;
  uint64_t buf_file_offset_ = 0;
  size_t buf_len_ = 0;
  bool unsynced_ = false;
  std::vector<PendingOp> pending_;
  std::vector<Key>* evicted_sink_ = nullptr;
  uint64_t next_seq_ = 1;
  uint64_t max_version_ = 0;
  std::unique_ptr<policies::EvictionPolicy> policy_;
  SsdStats stats_;

  std::thread commit_thread_;
  std::condition_variable cv_;
  bool stop_ = false;
};

SsdTier::Impl::~Impl() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (commit_thread_.joinable()) commit_thread_.join();
  if (db_ != nullptr) {
    std::lock_guard lock(mu_);
    for (const Key& k : dirty_access_) {
      auto it = map_.find(k);
      if (it != map_.end() && !InBuffer(it->second)) pending_.push_back({k, false, it->second});
    }
    dirty_access_.clear();
    Status st = CommitLocked();
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
  buf_ = AllocateAligned(o_.write_buffer_bytes, ssd::kBlockBytes);
  std::span<uint8_t> region(buf_.get(), o_.write_buffer_bytes);
  KVTIER_RETURN_IF_ERROR(env_->RegisterBuffers({&region, 1}));

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

  // ---- index ----
  std::vector<Key> bad;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator({}, index_cf_));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    Key k{};
    IndexEntry e;
    rocksdb::Slice ks = it->key(), vs = it->value();
    if (ks.size() != k.size()) continue;
    std::memcpy(k.data(), ks.data(), k.size());
    if (!ssd::DecodeIndexEntry({reinterpret_cast<const uint8_t*>(vs.data()), vs.size()}, &e).ok() ||
        !segments_.count(e.segment)) {
      bad.push_back(k);
      continue;
    }
    next_seq_ = std::max(next_seq_, e.seq + 1);
    Insert(k, e);
  }
  KVTIER_RETURN_IF_ERROR(FromRocks(it->status(), "scan index"));
  it.reset();
  for (const Key& k : bad) pending_.push_back({k, true, {}});
  stats_.dropped_on_recovery += bad.size();

  // ---- tail of the newest segment ----
  uint32_t next_id = 1;
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
    std::vector<std::pair<Key, IndexEntry>> found;
    KVTIER_RETURN_IF_ERROR(ScanTail(newest, start, &valid_end, &found));
    // Entries pointing past the valid end of the log (index written ahead of data in kNone).
    std::vector<Key> torn;
    for (const auto& [k, e] : map_) {
      if (e.segment == newest->id && e.offset + e.record_bytes > valid_end) torn.push_back(k);
    }
    for (const Key& k : torn) RemoveLocked(k);
    stats_.dropped_on_recovery += torn.size();
    for (const auto& [k, e] : found) {
      auto cur = map_.find(k);
      if (cur != map_.end() && cur->second.seq > e.seq) continue;
      next_seq_ = std::max(next_seq_, e.seq + 1);
      Insert(k, e);
      pending_.push_back({k, false, e});
      ++stats_.recovered_records;
    }
    if (!torn.empty() || !found.empty()) {
      KVTIER_LOG(kInfo) << "ssd recovery: segment " << newest->id << " re-indexed " << found.size()
                        << " records past the last commit, dropped " << torn.size()
                        << " entries past the torn tail at offset " << valid_end;
    }
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
    Status st = CommitLocked();
    if (st.ok()) st = CleanLocked(/*threshold_clean=*/false);
    KVTIER_RETURN_IF_ERROR(st);
  }
  commit_thread_ = std::thread([this] { CommitLoop(); });
  return Status::Ok();
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

  std::lock_guard lock(mu_);
  evicted_sink_ = evicted;
  struct SinkReset {
    std::vector<Key>** p;
    ~SinkReset() { *p = nullptr; }
  } reset{&evicted_sink_};
  // Make room: the previous version of the key no longer counts; then evict by policy.
  uint64_t need = AlignUp(ssd::kRecordHeaderBytes + payload.size(), ssd::kRecordAlignBytes);
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
    Status st = CommitLocked();
    if (!st.ok()) return st;  // the entry was dropped: nothing indexed
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
  if (buf_len_ + padded > o_.write_buffer_bytes) KVTIER_RETURN_IF_ERROR(WriteBufferLocked());
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
    unsynced_ = true;
  } else {
    ssd::EncodeRecordHeader(h, buf_.get() + buf_len_);
    std::memcpy(buf_.get() + buf_len_ + ssd::kRecordHeaderBytes, payload.data(), payload.size());
    std::memset(buf_.get() + buf_len_ + rec, 0, padded - rec);
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
  pending_.push_back({key, false, *e});
  return Status::Ok();
}

// Drops every entry whose record has not reached the device (after a failed write).
void SsdTier::Impl::DropUnwrittenLocked() {
  std::vector<Key> lost;
  for (const auto& [k, e] : map_) {
    if (InBuffer(e)) lost.push_back(k);
  }
  for (const Key& k : lost) RemoveLocked(k);
  buf_len_ = 0;
}

Status SsdTier::Impl::WriteBufferLocked() {
  if (buf_len_ == 0) return Status::Ok();
  uint64_t n = AlignUp(buf_len_, ssd::kBlockBytes);
  std::memset(buf_.get() + buf_len_, 0, n - buf_len_);
  Status st = active_->dev->Write(buf_file_offset_, {buf_.get(), n});
  if (!st.ok()) {
    ++stats_.io_errors;
    DropUnwrittenLocked();
    return st;
  }
  stats_.bytes_written += n;
  buf_file_offset_ += n;
  buf_len_ = 0;
  unsynced_ = true;
  return Status::Ok();
}

Status SsdTier::Impl::CommitLocked() {
  if (buf_len_ == 0 && pending_.empty() && !unsynced_) return Status::Ok();
  KVTIER_RETURN_IF_ERROR(WriteBufferLocked());
  bool durable = o_.durability != Durability::kNone;
  if (unsynced_ && durable) {
    Status st = active_->dev->Sync(true);
    if (!st.ok()) {
      // The data may not be durable: forget every entry that is not yet indexed.
      ++stats_.io_errors;
      std::vector<Key> lost;
      for (const auto& op : pending_) {
        if (!op.is_delete) lost.push_back(op.key);
      }
      for (const Key& k : lost) {
        auto it = map_.find(k);
        if (it != map_.end() && it->second.segment == active_->id) RemoveLocked(k);
      }
      return st;
    }
  }
  unsynced_ = false;
  rocksdb::WriteBatch wb;
  for (const auto& op : pending_) {
    if (op.is_delete) {
      KVTIER_RETURN_IF_ERROR(FromRocks(wb.Delete(index_cf_, KeySlice(op.key)), "batch"));
    } else {
      KVTIER_RETURN_IF_ERROR(
          FromRocks(wb.Put(index_cf_, KeySlice(op.key), ssd::EncodeIndexEntry(op.entry)), "batch"));
    }
  }
  char de[12];
  std::memcpy(de, &active_->id, 4);
  std::memcpy(de + 4, &buf_file_offset_, 8);
  KVTIER_RETURN_IF_ERROR(FromRocks(wb.Put(meta_cf_, "durable_end", {de, 12}), "batch"));
  rocksdb::WriteOptions wo;
  wo.sync = durable;
  Status st = FromRocks(db_->Write(wo, &wb), "index write");
  if (!st.ok()) {
    ++stats_.io_errors;
    return st;
  }
  pending_.clear();
  ++stats_.commits;
  return Status::Ok();
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
    std::lock_guard lock(mu_);
    auto it = map_.find(key);
    if (it == map_.end()) return Status::NotFound("not in ssd tier");
    it->second.hit_count++;
    it->second.last_access_unix_ms = DefaultSystemClock().NowMs();
    if (dirty_access_.size() < kMaxDirtyAccess) dirty_access_.insert(key);
    e = it->second;
    if (id_to_key_.count(ObjectIdOf(key))) policy_->OnAccess(ObjectIdOf(key), NowUs());
    if (InBuffer(e)) {
      const uint8_t* p = buf_.get() + (e.offset - buf_file_offset_);
      rec.assign(p, p + e.record_bytes);
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
    Status st = CommitLocked();
    if (!st.ok()) {
      KVTIER_LOG(kWarn) << "ssd group commit failed: " << st.ToString();
    }
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
Status SsdTier::Flush() { return impl_->Flush(); }
SsdStats SsdTier::GetStats() const { return impl_->GetStats(); }
uint64_t SsdTier::max_version() const { return impl_->max_version(); }

}  // namespace kvtier::storage
