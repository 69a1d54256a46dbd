#include <rocksdb/filter_policy.h>
#include <rocksdb/options.h>
#include <rocksdb/table.h>
#include <rocksdb/write_batch.h>
#include <zstd.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "common/logging.h"
#include "storage/ssd/tier_impl.h"

namespace kvtier::storage {

namespace {

// Free bytes the RocksDB index needs to open (its OPTIONS file, a new manifest and WAL, a few
// KiB written; preallocation beyond is best effort).
constexpr uint64_t kIndexOpenMinBytes = 1ull << 20;

constexpr const char* kFormatName = "kvtier-ssd-1";

}  // namespace

SsdTier::Impl::~Impl() {
  {
    // The segment thread stops between chunks; a clean it leaves half done keeps its victim.
    std::lock_guard lock(mu_);
    seg_stop_.store(true);
    seg_cv_.notify_all();
  }
  if (segment_thread_.joinable()) segment_thread_.join();
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (commit_thread_.joinable()) commit_thread_.join();
  // Cancel the background load: what it did not reach stays in RocksDB, untouched.
  {
    std::lock_guard lock(mu_);
    stop_load_.store(true);
  }
  load_cv_.notify_all();  // a failed load's thread waits there for point reads to report
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
    if (next_seg_ != nullptr) {
      // Prepared, never written: not left behind (recovery would drop it as empty anyway).
      Status rm = env_->Remove(ssd::SegmentName(next_seg_->id));
      (void)rm;
      next_seg_.reset();
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
  writer_cv_.notify_all();
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
  if (o_.eviction_policy_factory) {
    policy_ = o_.eviction_policy_factory();
  } else {
    KVTIER_ASSIGN_OR_RETURN(policy_,
                            policies::MakeEvictionPolicy(o_.eviction_policy, o_.policy_params));
  }
  policy_ = policies::WithStructure(std::move(policy_), o_.structure, &layer_);
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
  // RocksDB 7.8 opening on a disk with no room for its new WAL and manifest ends the process
  // with an assertion of its own (probed: a tmpfs filled to 0 bytes free); a start then fails
  // with an error that says what to do instead.
  if (auto free = env_->FreeBytes(); free.ok() && *free < kIndexOpenMinBytes) {
    return NoSpaceError("the disk under " + o_.dir + " has " + std::to_string(*free) +
                        " bytes free; the SSD index needs at least " +
                        std::to_string(kIndexOpenMinBytes) +
                        " to open (a new WAL and manifest): free space on that disk (the "
                        "oldest segment files under " +
                        o_.dir + "/segments may be deleted, their units are then lost)");
  }
  KVTIER_RETURN_IF_ERROR(OpenIndexDb());

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
  if (auto free = env_->FreeBytes();
      o_.disk_free_min_bytes > 0 && free.ok() && *free != DeviceEnv::kNoFreeSpaceLimit &&
      *free + open_bytes_bound_ <
          ssd::SaturatingAdd(o_.disk_free_min_bytes, 3 * o_.segment_bytes)) {
    KVTIER_LOG(kWarn) << "ssd disk has " << *free << " bytes free beside " << open_bytes_bound_
                      << " bytes of segments: less than disk_free_min_bytes ("
                      << o_.disk_free_min_bytes << ") and the tier's smallest size (3 segments of "
                      << o_.segment_bytes << " bytes); puts will fail once the segments are full";
  }

  // ---- the log past the last commit ----
  // durable_end names the segment that was active at the last commit and the end of what it
  // covered. Records past it (in that segment, and in every later one: segments roll without
  // a commit) were written but not committed: they are scanned and re-indexed. Empty later
  // segments (prepared, never written) are removed.
  uint32_t next_id = 1;
  uint32_t durable_seg = 0;
  std::vector<std::pair<Key, IndexEntry>> found;
  if (!segments_.empty()) {
    if (segments_.rbegin()->first == ssd::kSegmentIdMax) {
      // Appends continue in a fresh segment, and ids do not wrap (segments are ordered by id).
      return Status::IOError("ssd segment ids exhausted: segment " +
                             std::to_string(ssd::kSegmentIdMax) +
                             " exists, so no segment can follow it (docs/format/ssd.md)");
    }
    next_id = segments_.rbegin()->first + 1;
    uint64_t durable_off = 0;
    std::string de;
    if (db_->Get({}, meta_cf_, "durable_end", &de).ok() && de.size() == 12) {
      std::memcpy(&durable_seg, de.data(), 4);
      std::memcpy(&durable_off, de.data() + 4, 8);
    }
    std::vector<uint32_t> empty;
    for (auto it = segments_.lower_bound(durable_seg); it != segments_.end(); ++it) {
      uint64_t start = it->first == durable_seg ? durable_off : 0;
      uint64_t valid_end = start;
      size_t before = found.size();
      KVTIER_RETURN_IF_ERROR(ScanTail(it->second, start, &valid_end, &found));
      // Index entries pointing past the valid end of the log (index written ahead of data in
      // kNone, or a torn tail) are dropped as the load or a point read meets them.
      recovered_ends_[it->first] = valid_end;
      if (found.size() > before) {
        KVTIER_LOG(kInfo) << "ssd recovery: segment " << it->first << " re-indexes "
                          << found.size() - before
                          << " records past the last commit; valid end at offset " << valid_end;
      }
      if (it->first != durable_seg && valid_end == 0) empty.push_back(it->first);
    }
    for (uint32_t id : empty) {
      segments_.erase(id);
      Status rm = env_->Remove(ssd::SegmentName(id));
      if (!rm.ok()) {
        KVTIER_LOG(kWarn) << "remove empty segment " << id << ": " << rm.ToString();
      }
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

  // Appends always continue in a fresh segment, so a torn tail is never scanned again. On a
  // disk too full for it (ENOSPC: the daemon stopped with its disk full), the oldest segment
  // gives way rather than the start failing: its file is deleted and its units dropped (the
  // index load drops the entries of a missing segment, counted in dropped_on_recovery), as
  // long as no record re-indexed above lies in it (those lie from durable_seg on).
  std::shared_ptr<BlockDevice> dev;
  while (true) {
    Status st = OpenFreshSegment(next_id, &dev);
    if (st.ok()) break;
    (void)env_->Remove(ssd::SegmentName(next_id));
    if (!IsNoSpace(st) || segments_.empty() || segments_.begin()->first >= durable_seg) return st;
    const uint32_t oldest = segments_.begin()->first;
    const uint64_t oldest_bytes = segments_.begin()->second->dev->Size();
    segments_.erase(segments_.begin());
    KVTIER_RETURN_IF_ERROR(env_->Remove(ssd::SegmentName(oldest)));
    open_bytes_bound_ -= std::min(open_bytes_bound_, oldest_bytes);
    ++stats_.disk_full_open_drops;
    KVTIER_LOG(kWarn) << "ssd segment " << next_id << " not created at start: " << st.ToString()
                      << "; the oldest segment (" << oldest
                      << ") was deleted to make room, its units dropped";
  }
  KVTIER_RETURN_IF_ERROR(env_->SyncDir());  // before a commit names the new segment
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
  segment_thread_ = std::thread([this] { SegmentLoop(); });
  if (!have_counters) {
    // An index written before the counters existed: versions and sequence numbers are only
    // known after the full load, so wait for it (once; the next commit persists them). A
    // failed load fails Open: the versions it would hand out are unknown.
    KVTIER_RETURN_IF_ERROR(WaitForIndexLoad());
  }
  return Status::Ok();
}

Status SsdTier::Impl::OpenIndexDb() {
  rocksdb::Options options;
  if (o_.index_env != nullptr) options.env = o_.index_env;
  options.create_if_missing = true;
  options.create_missing_column_families = true;
  options.paranoid_checks = true;
  options.max_background_jobs = 2;
  options.keep_log_file_num = 4;
  options.info_log_level = rocksdb::InfoLogLevel::WARN_LEVEL;
  // The index shares the disk with the segments and must leave them most of it (a small tier
  // on a small disk: docs/format/ssd.md, "Free space for the index"). The manifest grows in
  // 1 MiB steps instead of 4; the WAL, preallocated at 1.1 memtables, is bounded below.
  options.manifest_preallocation_size = 1ull << 20;
  // Memtables: a 64th of the tier's capacity, within [1 MiB, 16 MiB] (16 MiB from 1 GiB up).
  // The size bounds the WAL replayed after a crash (a clean close flushes it all).
  const uint64_t memtable_bytes =
      std::clamp<uint64_t>(o_.capacity_bytes / 64, 1ull << 20, 16ull << 20);
  // The meta column family takes a small write per commit and would never fill its memtable:
  // without this bound every WAL since its last flush stays on disk (a 48 MiB disk held 23 MiB
  // of WALs beside 1 MiB of index tables). Past it, the column families holding the oldest WAL
  // are flushed and the WAL deleted.
  options.max_total_wal_size = 2 * memtable_bytes;
  rocksdb::ColumnFamilyOptions cf_options(options);
  cf_options.write_buffer_size = memtable_bytes;
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
  return Status::Ok();
}

Status SsdTier::Impl::ReopenIndexDb() {
  {
    std::lock_guard lock(mu_);
    // Until the load finished, point reads (FindLocked) and the load's iterator use the DB
    // outside every lock this commit holds.
    if (!loaded_ || !load_finished_) {
      return Status::Unavailable("ssd index: not reopened while the index still loads");
    }
  }
  load_iter_.reset();  // finished with (the load is done): it holds the DB's column families
  for (auto* h : {index_cf_, meta_cf_, default_cf_}) {
    if (h != nullptr) db_->DestroyColumnFamilyHandle(h).PermitUncheckedError();
  }
  index_cf_ = meta_cf_ = default_cf_ = nullptr;
  db_->Close().PermitUncheckedError();  // its background error: what the reopen clears
  db_.reset();
  return OpenIndexDb();
}

Status SsdTier::Impl::OpenFreshSegment(uint32_t id, std::shared_ptr<BlockDevice>* dev) {
  KVTIER_ASSIGN_OR_RETURN(*dev, env_->Open(ssd::SegmentName(id), true));
  Status st = (*dev)->Allocate(0, o_.segment_bytes);
  if (st.ok()) st = ZeroFillSegment(dev->get(), nullptr);
  if (!st.ok()) dev->reset();
  return st;
}

uint64_t SsdTier::Impl::WalkRecords(
    const Segment& seg, uint64_t start, uint64_t end,
    const std::function<void(uint64_t, const RecordHeader&, std::span<const uint8_t>)>& visit) {
  uint64_t pos = start;
  std::vector<uint8_t> rec;
  while (pos + ssd::kRecordHeaderBytes <= end) {
    Status st = ReadRecord(seg, pos, ssd::kRecordHeaderBytes, &rec);
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
    if (pos + n > end || n > o_.segment_bytes) break;
    if (!ReadRecord(seg, pos, static_cast<uint32_t>(n), &rec).ok()) break;
    std::span<const uint8_t> payload(rec.data() + ssd::kRecordHeaderBytes, h.stored_bytes);
    if (ssd::PayloadChecksum(payload) != h.payload_checksum) break;  // torn
    visit(pos, h, rec);
    pos += AlignUp(n, ssd::kRecordAlignBytes);
  }
  return pos;
}

Status SsdTier::Impl::ScanTail(const std::shared_ptr<Segment>& seg, uint64_t start,
                               uint64_t* valid_end,
                               std::vector<std::pair<Key, IndexEntry>>* found) {
  *valid_end = WalkRecords(*seg, start, seg->dev->Size(),
                           [&](uint64_t pos, const RecordHeader& h, std::span<const uint8_t> rec) {
                             IndexEntry e;
                             e.codec = h.codec;
                             e.kind = h.kind;
                             e.segment = seg->id;
                             e.offset = pos;
                             e.record_bytes = static_cast<uint32_t>(rec.size());
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
                           });
  return Status::Ok();
}

Status SsdTier::Impl::Replay(const LogPosition& from, const LogRecordVisitor& visit) {
  // Everything appended so far reaches the device (a walk reads only the device).
  KVTIER_RETURN_IF_ERROR(Commit(kForceCommit));
  // The segments to walk and where each walk ends, as of now. A segment the cleaner deletes
  // meanwhile stays readable through its device; its records were relocated past `end`.
  std::vector<std::pair<std::shared_ptr<Segment>, uint64_t>> walk;
  {
    std::lock_guard lock(mu_);
    for (auto it = segments_.lower_bound(from.segment); it != segments_.end(); ++it) {
      uint64_t end = it->second == active_ ? buf_file_offset_ : it->second->dev->Size();
      walk.emplace_back(it->second, end);
    }
  }
  std::vector<uint8_t> decoded;
  for (const auto& [seg, end] : walk) {
    uint64_t start = seg->id == from.segment ? AlignUp(from.offset, ssd::kRecordAlignBytes) : 0;
    WalkRecords(
        *seg, start, end, [&](uint64_t, const RecordHeader& h, std::span<const uint8_t> rec) {
          std::span<const uint8_t> payload = rec.subspan(ssd::kRecordHeaderBytes);
          if (h.codec == Codec::kZstd) {
            decoded.resize(h.raw_bytes);
            size_t n =
                ZSTD_decompress(decoded.data(), decoded.size(), payload.data(), payload.size());
            if (ZSTD_isError(n) || n != h.raw_bytes) return;  // never a wrong value
            payload = decoded;
          }
          visit(h.tenant, h.key, payload);
        });
  }
  return Status::Ok();
}

}  // namespace kvtier::storage
