#include "storage/ssd_tier.h"

#include <sys/mman.h>
#include <zstd.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

#include "common/logging.h"
#include "storage/ssd/tier_impl.h"

namespace kvtier::storage {

namespace {

constexpr size_t kMaxDirtyAccess = 1 << 20;  // access stats persisted at close, bounded
// A batch GET's read region is kept for the thread's next batch up to this size: no mmap,
// page faults and munmap per batch, and O_DIRECT reads land in pages already faulted in, so
// io_uring issues them at once instead of punting them to its worker threads. Larger
// regions are allocated per call. Memory: up to this much per thread that ran a batch GET.
constexpr uint64_t kReadRegionCachedBytesMax = 32ull << 20;
constexpr uint64_t kHugePageBytes = 2ull << 20;  // x86-64 PMD size: the cached region's grain

// The thread's cached batch read region: up to kReadRegionCachedBytesMax, huge-page advised,
// faulted in once. A Batch takes it for a read and gives it back when destroyed or reused.
struct CachedRegion {
  AlignedBuffer buf;
  uint64_t bytes = 0;
};
thread_local CachedRegion t_region;

// A region made before any batch needed it (SsdTier::Open: WarmReadRegion), taken by the
// first thread whose own cache is empty or too small instead of a fresh region: the first
// batch GET of a just-started daemon then reads into pages faulted in at startup, not into a
// new huge page the kernel must zero first (18% of kvtierd's CPU in the first 256-unit GET
// after a restart; docs/performance/resume.md, "one write per GET").
constexpr uint64_t kWarmRegionBytes = 4ull << 20;  // a 256-unit batch of records up to 16 KiB
std::mutex g_warm_mu;
CachedRegion g_warm;  // protected by g_warm_mu; empty once taken

// The warm region if it holds at least `bytes`, or an empty one.
CachedRegion TakeWarmRegion(uint64_t bytes) {
  std::lock_guard lock(g_warm_mu);
  if (g_warm.buf == nullptr || g_warm.bytes < bytes) return {};
  return std::exchange(g_warm, CachedRegion{});
}

// An aligned, faulted-in region of at least `bytes` (rounded up to the huge-page grain when
// the cache may keep it).
CachedRegion NewRegion(uint64_t bytes) {
  CachedRegion r;
  if (bytes > kReadRegionCachedBytesMax) {
    r.bytes = AlignUp(bytes, ssd::kBlockBytes);
    r.buf = AllocateAligned(r.bytes, ssd::kBlockBytes);
  } else {
    r.bytes = AlignUp(bytes, kHugePageBytes);
    r.buf = AllocateAligned(r.bytes, kHugePageBytes);
    // Huge pages where the kernel allows them (THP "madvise" or "always"): an O_DIRECT read
    // then pins one page instead of fifteen (pinning was ~16% of a batch's CPU time in
    // `perf`). Advisory: ignored where THP is off.
    (void)::madvise(r.buf.get(), r.bytes, MADV_HUGEPAGE);
  }
  // Fault the pages in once: with one system call where the kernel has MADV_POPULATE_WRITE
  // (5.14+), which does not write the (huge) pages a second time as a memset would.
#ifdef MADV_POPULATE_WRITE
  if (::madvise(r.buf.get(), r.bytes, MADV_POPULATE_WRITE) == 0) return r;
#endif
  std::memset(r.buf.get(), 0, r.bytes);
  return r;
}

// Makes the warm region of kWarmRegionBytes, unless there is one.
void WarmReadRegion() {
  {
    std::lock_guard lock(g_warm_mu);
    if (g_warm.buf != nullptr) return;
  }
  CachedRegion r = NewRegion(kWarmRegionBytes);
  std::lock_guard lock(g_warm_mu);
  if (g_warm.buf == nullptr) g_warm = std::move(r);
}

}  // namespace

// ---------------------------------------------------------------- SsdTier::Batch ----

SsdTier::Batch::Batch() = default;
SsdTier::Batch::~Batch() { ReleaseRegion(); }
SsdTier::Batch::Batch(Batch&& o) noexcept { *this = std::move(o); }
SsdTier::Batch& SsdTier::Batch::operator=(Batch&& o) noexcept {
  if (this == &o) return *this;
  ReleaseRegion();
  results_ = std::move(o.results_);
  metas_ = std::move(o.metas_);
  values_ = std::move(o.values_);
  owned_ = std::move(o.owned_);
  region_ = std::move(o.region_);
  region_bytes_ = std::exchange(o.region_bytes_, 0);
  return *this;
}

void SsdTier::Batch::Reset(size_t n) {
  results_.assign(n, Status::Ok());
  metas_.assign(n, SsdMeta{});
  values_.assign(n, {});
  owned_.resize(n);
  for (auto& v : owned_) v.clear();
}

uint8_t* SsdTier::Batch::Region(uint64_t bytes) {
  bytes = std::max<uint64_t>(bytes, ssd::kBlockBytes);
  if (region_bytes_ >= bytes) return region_.get();
  ReleaseRegion();
  if (t_region.bytes >= bytes) {
    region_ = std::move(t_region.buf);
    region_bytes_ = std::exchange(t_region.bytes, 0);
    return region_.get();
  }
  if (CachedRegion w = TakeWarmRegion(bytes); w.buf != nullptr) {
    region_ = std::move(w.buf);
    region_bytes_ = w.bytes;
    return region_.get();
  }
  // Too small (or none cached): grow geometrically up to what the cache keeps.
  uint64_t want = bytes;
  if (bytes <= kReadRegionCachedBytesMax) {
    want = std::min(std::max(bytes, 2 * t_region.bytes), kReadRegionCachedBytesMax);
  }
  CachedRegion r = NewRegion(want);
  region_ = std::move(r.buf);
  region_bytes_ = r.bytes;
  return region_.get();
}

void SsdTier::Batch::ReleaseRegion() {
  if (region_ == nullptr) return;
  if (region_bytes_ <= kReadRegionCachedBytesMax && region_bytes_ > t_region.bytes) {
    t_region.buf = std::move(region_);
    t_region.bytes = region_bytes_;
  }
  region_.reset();
  region_bytes_ = 0;
}

namespace {

// One zstd compression context per thread, reused across puts: ZSTD_compress would allocate and
// initialise a fresh context (its tables) on every call, which dominated the CPU of small puts
// (docs/performance/storage.md "Durable SET: the way back"). Freed after a call left it holding
// more than kCompressorKeepBytes (a large value), so each thread keeps at most that much.
constexpr size_t kCompressorKeepBytes = 4u << 20;

struct ThreadCompressorHolder {
  ZSTD_CCtx* cctx = nullptr;
  // The compressed bytes of the thread's last put (its payload until AppendLocked copied
  // it) and the sample's: reused, so a put allocates no buffer; dropped above
  // kCompressorKeepBytes like the context.
  std::vector<uint8_t> out, sample;
  ~ThreadCompressorHolder() { ZSTD_freeCCtx(cctx); }
};
thread_local ThreadCompressorHolder t_compressor;

// Makes *buf hold n bytes for zstd to write (contents unspecified), keeping its capacity;
// memory over kCompressorKeepBytes left by an earlier large value is given back first.
void SizeScratch(std::vector<uint8_t>* buf, size_t n) {
  if (buf->capacity() > kCompressorKeepBytes && n <= kCompressorKeepBytes) {
    std::vector<uint8_t>().swap(*buf);
  }
  buf->resize(n);
}

// The calling thread's context; null when it cannot be allocated (the put is then stored
// uncompressed).
ZSTD_CCtx* ThreadCompressor() {
  if (t_compressor.cctx != nullptr && ZSTD_sizeof_CCtx(t_compressor.cctx) > kCompressorKeepBytes) {
    ZSTD_freeCCtx(t_compressor.cctx);
    t_compressor.cctx = nullptr;
  }
  if (t_compressor.cctx == nullptr) t_compressor.cctx = ZSTD_createCCtx();
  return t_compressor.cctx;
}

}  // namespace

Status SsdTier::Impl::Put(const Key& key, std::span<const uint8_t> value, const SsdMeta& meta,
                          std::vector<Key>* evicted, const RequestTag* request,
                          uint64_t* defer_ticket) {
  if (value.size() + ssd::kRecordHeaderBytes + ssd::kBlockBytes > o_.segment_bytes ||
      value.size() > UINT32_MAX / 2) {
    return Status::InvalidArgument("value larger than an ssd segment");
  }
  // Adaptive compression, outside the lock. FP4 global KV is incompressible: skipped; so are
  // values below compression_min_bytes (docs/format/ssd.md "Compression").
  std::span<const uint8_t> payload = value;
  Codec codec = Codec::kNone;
  ZSTD_CCtx* cctx = nullptr;
  if (o_.compression && meta.kind != policies::ObjectKind::kGlobalKv &&
      value.size() >= std::max<uint64_t>(o_.compression_min_bytes, 1) &&
      (cctx = ThreadCompressor()) != nullptr) {
    std::vector<uint8_t>& compressed = t_compressor.out;
    size_t sample = std::min<size_t>(value.size(), o_.compression_sample_bytes);
    // A value no larger than the sample is compressed once: the sample is the whole value.
    const bool whole = sample == value.size();
    std::vector<uint8_t>& first = whole ? compressed : t_compressor.sample;
    SizeScratch(&first, ZSTD_compressBound(sample));
    size_t n =
        ZSTD_compressCCtx(cctx, first.data(), first.size(), value.data(), sample, o_.zstd_level);
    if (!ZSTD_isError(n) && n * 10 < sample * 9) {
      if (!whole) {
        SizeScratch(&compressed, ZSTD_compressBound(value.size()));
        n = ZSTD_compressCCtx(cctx, compressed.data(), compressed.size(), value.data(),
                              value.size(), o_.zstd_level);
      }
      if (!ZSTD_isError(n) && n * 20 < value.size() * 19) {
        payload = std::span<const uint8_t>(compressed.data(), n);
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
  // While the index loads, live bytes are known only for loaded entries. A put that could
  // need eviction or segment cleaning (bounded by the bytes that existed at Open) waits for
  // the load; any other put proceeds at once.
  auto needs_full_state = [&] {
    uint64_t live = open_bytes_bound_;
    for (const auto& [id, seg] : segments_) live += seg->live_bytes;
    bool may_roll = buf_file_offset_ + buf_len_ + need + ssd::kBlockBytes > o_.segment_bytes;
    return live + need > LiveLimit() || (may_roll && segments_.size() + 1 > MaxSegments()) ||
           (o_.objects_max > 0 && map_.size() + 1 > o_.objects_max);
  };
  while (true) {
    if (!loaded_ && needs_full_state()) {
      // A failed load never ends: live bytes stay unknown, so no room can be made.
      if (!load_status_.ok()) return load_status_.WithContext("ssd put needs room");
      load_cv_.wait(lock, [&] { return load_finished_; });
      continue;
    }
    // The segment thread prepares the next segment ahead: a put waits here only when it
    // has not (the tier is full and cleaning, or the device failed).
    if (!PutFitsActiveLocked(need) && next_seg_ == nullptr) {
      KVTIER_RETURN_IF_ERROR(WaitForRoomLocked(lock, need));
      continue;
    }
    break;
  }
  // Units the segment thread dropped since the last put are reported with this one.
  // (A key put again since is live: not reported.)
  for (const Key& k : cleaner_dropped_) {
    if (evicted != nullptr && !map_.count(k)) evicted->push_back(k);
  }
  cleaner_dropped_.clear();
  // The policy's hooks, as a memory tier calls them (tier_manager.h RequestTag): its capacity
  // in units of this size once, OnRequest, OnMiss; then Evict while full and OnInsert, all at
  // the request's time (call_now_us_, cleared before mu_ is released).
  if (!capacity_told_) {
    policy_->OnCapacity(LiveLimit() / need);
    capacity_told_ = true;
  }
  call_now_us_ = EnterLocked(request);
  policy_->OnMiss(ObjectIdOf(key), call_now_us_);
  // Make room: the previous version of the key no longer counts (unless the policy evicted
  // it meanwhile: then it is gone); then evict by policy.
  auto live_but_held = [&] {
    uint64_t live = 0;
    for (const auto& [id, seg] : segments_) live += seg->live_bytes;
    if (auto held = map_.find(key); held != map_.end()) live -= LiveCost(held->second);
    return live;
  };
  uint64_t live = live_but_held();
  const bool new_key = !map_.count(key);
  auto over = [&] {
    return live + need > LiveLimit() ||
           (new_key && o_.objects_max > 0 && map_.size() >= o_.objects_max);
  };
  while (over()) {
    auto victim = EvictLocked();
    if (!victim) {
      call_now_us_ = 0;
      return Status::Rejected("ssd tier full (pinned objects fill it)");
    }
    if (evicted != nullptr) evicted->push_back(*victim);
    live = live_but_held();
  }
  h.seq = next_seq_++;
  IndexEntry e;
  Status appended = AppendLocked(key, h, payload, clean_reserve_bytes_, &e);
  call_now_us_ = 0;
  KVTIER_RETURN_IF_ERROR(appended);
  if (codec == Codec::kZstd) stats_.compressed_bytes_saved += value.size() - payload.size();
  if (o_.durability == Durability::kSync) {
    uint64_t ticket = pending_ticket_;
    // One more sync writer; it ends a leader's commit delay when it is the last expected.
    uint64_t joined = sync_puts_.fetch_add(1, std::memory_order_relaxed) + 1 - prepared_puts_;
    bool wake_leader = delay_target_ != 0 && joined >= delay_target_;
    lock.unlock();
    if (wake_leader) delay_cv_.notify_one();
    if (defer_ticket != nullptr) {  // the caller waits (SsdTier::Put's contract)
      *defer_ticket = ticket;
      return Status::Ok();
    }
    // An error: the commit failed (the entry was dropped) or one of its buffer writes did
    // (this unit's included, or not: reported either way; nothing unwritten is indexed). The
    // commit settled it (its thread reaped the failed buffers): no second lock hold here.
    return Commit(ticket);
  }
  return Status::Ok();
}

Status SsdTier::Impl::BeginReadLocked(const Key& key, std::unique_lock<std::mutex>& lock,
                                      IndexEntry* e, std::shared_ptr<Segment>* seg,
                                      std::vector<uint8_t>* buffered, const RequestTag* request,
                                      bool report_hit) {
  auto it = FindLocked(key, lock);
  if (it == map_.end()) return Status::NotFound("not in ssd tier");
  it->second.hit_count++;
  it->second.last_access_unix_ms = DefaultSystemClock().NowMs();
  if (dirty_access_.size() < kMaxDirtyAccess) dirty_access_.insert(key);
  *e = it->second;
  if (auto t = id_to_key_.find(ObjectIdOf(key));
      report_hit && t != id_to_key_.end() && t->second == key) {
    policy_->OnAccess(t->first, EnterLocked(request));
  }
  if (const uint8_t* p = BufferedRecord(*e); p != nullptr) {
    buffered->assign(p, p + e->record_bytes);  // being filled or in flight: served from memory
    return Status::Ok();
  }
  auto s = segments_.find(e->segment);
  if (s == segments_.end()) return Status::Internal("index points to a missing segment");
  *seg = s->second;
  return Status::Ok();
}

Status SsdTier::Impl::FinishRead(const Key& key, const IndexEntry& e, Status st,
                                 std::span<const uint8_t> rec, std::vector<uint8_t>* out) {
  Status v = VerifyRead(key, e, std::move(st), rec, out);
  if (!v.ok()) SettleReadFailure(key, e, v);
  return v;
}

Status SsdTier::Impl::VerifyRead(const Key& key, const IndexEntry& e, Status st,
                                 std::span<const uint8_t> rec, std::vector<uint8_t>* out) {
  out->clear();
  RecordHeader h;
  KVTIER_RETURN_IF_ERROR(VerifyRecord(key, e, std::move(st), rec, &h));
  return DecodePayload(h, rec, out);
}

Status SsdTier::Impl::VerifyRecord(const Key& key, const IndexEntry& e, Status st,
                                   std::span<const uint8_t> rec, RecordHeader* h) {
  if (!st.ok() && !st.IsCorruption()) return st;
  if (st.ok()) st = ssd::DecodeRecordHeader(rec, h);
  if (st.ok() && (h->key != key || h->seq != e.seq || ssd::RecordBytes(*h) != e.record_bytes ||
                  rec.size() != e.record_bytes ||
                  ssd::PayloadChecksum({rec.data() + ssd::kRecordHeaderBytes, h->stored_bytes}) !=
                      e.checksum)) {
    st = Status::Corruption("ssd record failed checksum verification");
  }
  if (!st.ok()) return Status::Corruption(st.message());
  return Status::Ok();
}

Status SsdTier::Impl::DecodePayload(const RecordHeader& h, std::span<const uint8_t> rec,
                                    std::vector<uint8_t>* out) {
  std::span<const uint8_t> payload(rec.data() + ssd::kRecordHeaderBytes, h.stored_bytes);
  if (h.codec == Codec::kZstd) {
    out->resize(h.raw_bytes);
    size_t n = ZSTD_decompress(out->data(), out->size(), payload.data(), payload.size());
    if (ZSTD_isError(n) || n != h.raw_bytes) {
      out->clear();
      return Status::Corruption("zstd payload failed to decode");
    }
  } else {
    out->assign(payload.begin(), payload.end());
  }
  return Status::Ok();
}

void SsdTier::Impl::SettleReadFailure(const Key& key, const IndexEntry& e, const Status& st) {
  std::lock_guard lock(mu_);
  if (!st.IsCorruption()) {
    ++stats_.io_errors;
    return;
  }
  ++stats_.checksum_failures;
  auto it = map_.find(key);
  if (it != map_.end() && it->second.seq == e.seq) RemoveLocked(key);  // quarantine
  KVTIER_LOG(kWarn) << "ssd record in segment " << e.segment << " @" << e.offset
                    << " failed verification (" << st.message() << "): quarantined";
}

Status SsdTier::Impl::Get(const Key& key, std::vector<uint8_t>* out, SsdMeta* meta,
                          const RequestTag* request) {
  IndexEntry e;
  std::shared_ptr<Segment> seg;
  std::vector<uint8_t> buffered;
  {
    std::unique_lock lock(mu_);
    KVTIER_RETURN_IF_ERROR(BeginReadLocked(key, lock, &e, &seg, &buffered, request, true));
  }
  // Verified and copied straight out of the read buffer: one copy per read.
  Status st;
  AlignedBuffer owned;
  std::span<const uint8_t> rec = buffered;
  if (seg != nullptr) st = ReadRecordView(*seg, e.offset, e.record_bytes, &owned, &rec);
  Status done = FinishRead(key, e, st, rec, out);
  if (meta != nullptr && (done.ok() || done.IsCorruption())) *meta = MetaOf(e);
  KVTIER_RETURN_IF_ERROR(done);
  std::lock_guard lock(mu_);
  ++stats_.hits;
  stats_.bytes_read += e.record_bytes;
  return Status::Ok();
}

void SsdTier::Impl::GetBatch(std::span<const Key> keys, std::vector<std::vector<uint8_t>>* outs,
                             std::vector<SsdMeta>* metas, std::vector<Status>* results,
                             const RequestTag* request, bool report_hits) {
  Batch batch;
  GetBatch(keys, &batch, request, report_hits);
  const size_t n = keys.size();
  outs->resize(n);
  results->resize(n);
  if (metas != nullptr) metas->resize(n);
  for (size_t i = 0; i < n; ++i) {
    std::span<const uint8_t> v = batch.value(i);
    (*outs)[i].assign(v.begin(), v.end());
    (*results)[i] = batch.result(i);
    if (metas != nullptr) (*metas)[i] = batch.meta(i);
  }
}

void SsdTier::Impl::GetBatch(std::span<const Key> keys, Batch* batch, const RequestTag* request,
                             bool report_hits) {
  const size_t n = keys.size();
  batch->Reset(n);
  std::vector<Status>& results = batch->results_;
  std::vector<IndexEntry> entries(n);
  std::vector<std::shared_ptr<Segment>> segs(n);
  {
    std::unique_lock lock(mu_);
    for (size_t i = 0; i < n; ++i) {
      // A record still in a write buffer is copied into owned_[i] (the lock is released next).
      results[i] = BeginReadLocked(keys[i], lock, &entries[i], &segs[i], &batch->owned_[i], request,
                                   report_hits);
    }
  }
  // The device reads, sorted by segment and offset for locality. Records whose aligned spans
  // overlap or touch in one segment share a read (SsdOptions::batch_read_merge_bytes_max):
  // read k covers [start, start + len) of its segment and holds units order[first, last).
  // Sized once: each growth of these would take fresh heap pages (first-touch faults) in a
  // just-started daemon.
  std::vector<size_t> order;
  order.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (results[i].ok() && segs[i] != nullptr) order.push_back(i);
  }
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return segs[a]->id != segs[b]->id ? segs[a]->id < segs[b]->id
                                      : entries[a].offset < entries[b].offset;
  });
  struct Read {
    BlockDevice* dev = nullptr;
    uint64_t start = 0, len = 0, region_off = 0;
    size_t first = 0, last = 0;  // units order[first, last)
  };
  std::vector<Read> reads;
  reads.reserve(order.size());
  const uint64_t merge_max = o_.batch_read_merge_bytes_max;
  for (size_t k = 0; k < order.size(); ++k) {
    const size_t i = order[k];
    BlockDevice* dev = segs[i]->dev.get();
    const uint64_t a = std::max<uint64_t>(dev->Alignment(), 1);
    const uint64_t start = entries[i].offset / a * a;
    const uint64_t end = AlignUp(entries[i].offset + entries[i].record_bytes, a);
    if (!reads.empty()) {
      Read& r = reads.back();
      const uint64_t merged_end = std::max(r.start + r.len, end);
      // Touching: on a device of alignment 1 the records' 8-byte padding lies between them.
      if (r.dev == dev && start <= AlignUp(r.start + r.len, ssd::kRecordAlignBytes) &&
          merged_end - r.start <= merge_max) {
        r.len = merged_end - r.start;
        r.last = k + 1;
        continue;
      }
    }
    reads.push_back({dev, start, end - start, 0, k, k + 1});
  }
  // One aligned region for every device read.
  uint64_t region_bytes = 0;
  for (Read& r : reads) {
    r.region_off = region_bytes;
    region_bytes += AlignUp(r.len, ssd::kBlockBytes);
  }
  uint8_t* region = region_bytes > 0 ? batch->Region(region_bytes) : nullptr;
  uint64_t hits = 0, bytes = 0;
  std::vector<uint8_t> finished(n, 0);  // a read (or buffered copy) was verified: settle failures
  // Verifies unit i in `rec` (its record, read or buffered) and views its payload there (a
  // compressed one is decoded into owned_[i]). It runs while the thread holds an io_uring
  // ring, so it never takes mu_ (a put may hold mu_ while it waits for a ring): failures are
  // settled (counted, quarantined) after the submission.
  auto finish = [&](size_t i, const Status& read_st, std::span<const uint8_t> rec) {
    finished[i] = 1;
    RecordHeader h;
    Status& st = results[i];
    st = VerifyRecord(keys[i], entries[i], read_st, rec, &h);
    if (st.ok()) {
      if (h.codec == Codec::kNone) {
        batch->values_[i] = rec.subspan(ssd::kRecordHeaderBytes, h.stored_bytes);
      } else {
        std::vector<uint8_t> raw;  // rec may be owned_[i] itself: decode beside it
        st = DecodePayload(h, rec, &raw);
        if (st.ok()) {
          batch->owned_[i] = std::move(raw);
          batch->values_[i] = batch->owned_[i];
        }
      }
    }
    if (st.ok() || st.IsCorruption()) {
      batch->metas_[i] = MetaOf(entries[i]);  // a corrupt record's meta: what a refetch needs
    }
    if (!st.ok()) return;
    ++hits;
    bytes += entries[i].record_bytes;
  };
  // Every device read of the batch, whatever its segment, in one submission (io_uring: one
  // ring, up to its queue depth in flight; SubmitAcross), in chunks of kMaxBatchIos. The units
  // of a read are verified as it completes, while the rest of the batch is still in flight.
  // A read's result is each of its units' (a failed read fails them all, never a verification
  // of a buffer the device did not fill).
  auto finish_read = [&](const Read& r, const Status& read_st) {
    for (size_t k = r.first; k < r.last; ++k) {
      const size_t i = order[k];
      std::span<const uint8_t> record;  // none when the read failed
      if (read_st.ok()) {
        record = {region + r.region_off + (entries[i].offset - r.start), entries[i].record_bytes};
      }
      finish(i, read_st, record);
    }
  };
  std::vector<DeviceIo> ios;
  ios.reserve(std::min(reads.size(), kMaxBatchIos));
  for (size_t first = 0; first < reads.size(); first += kMaxBatchIos) {
    size_t last = std::min(reads.size(), first + kMaxBatchIos);
    ios.clear();
    for (size_t k = first; k < last; ++k) {
      const Read& r = reads[k];
      ios.push_back({r.dev, {IoRequest::Op::kRead, r.start, region + r.region_off, r.len, {}}});
    }
    std::vector<bool> done(last - first, false);
    Status st = env_->SubmitAcross(ios, [&](size_t k) {
      done[k] = true;
      finish_read(reads[first + k], ios[k].io.result);
    });
    // A request the env never reported (a batch it refused whole) is an I/O error, never a
    // verification of a buffer the device did not fill.
    for (size_t k = 0; k < done.size(); ++k) {
      if (!done[k])
        finish_read(reads[first + k], st.ok() ? Status::IOError("read not completed") : st);
    }
  }
  for (size_t i = 0; i < n; ++i) {
    if (results[i].ok() && segs[i] == nullptr) finish(i, Status::Ok(), batch->owned_[i]);
  }
  for (size_t i = 0; i < n; ++i) {
    // Device reads and verifications that failed (lookups that failed were never read).
    if (finished[i] && !results[i].ok()) SettleReadFailure(keys[i], entries[i], results[i]);
  }
  std::lock_guard lock(mu_);
  stats_.hits += hits;
  stats_.bytes_read += bytes;
}

// ---------------------------------------------------------------- SsdTier ----

SsdTier::SsdTier(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SsdTier::~SsdTier() = default;

StatusOr<std::unique_ptr<SsdTier>> SsdTier::Open(const SsdOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  KVTIER_RETURN_IF_ERROR(impl->Open());
  WarmReadRegion();
  return std::unique_ptr<SsdTier>(new SsdTier(std::move(impl)));
}

Status SsdTier::Put(const Key& key, std::span<const uint8_t> value, const SsdMeta& meta,
                    std::vector<Key>* evicted, const RequestTag* request, uint64_t* defer_ticket) {
  return impl_->Put(key, value, meta, evicted, request, defer_ticket);
}
Status SsdTier::Get(const Key& key, std::vector<uint8_t>* out, SsdMeta* meta,
                    const RequestTag* request) {
  return impl_->Get(key, out, meta, request);
}
void SsdTier::GetBatch(std::span<const Key> keys, std::vector<std::vector<uint8_t>>* outs,
                       std::vector<SsdMeta>* metas, std::vector<Status>* results,
                       const RequestTag* request, bool report_hits) {
  impl_->GetBatch(keys, outs, metas, results, request, report_hits);
}
void SsdTier::GetBatch(std::span<const Key> keys, Batch* batch, const RequestTag* request,
                       bool report_hits) {
  impl_->GetBatch(keys, batch, request, report_hits);
}
void SsdTier::ReportHit(const Key& key, const RequestTag* request) {
  impl_->ReportHit(key, request);
}
bool SsdTier::Contains(const Key& key, uint64_t* version, SsdMeta* meta) const {
  return impl_->Contains(key, version, meta);
}
Status SsdTier::Remove(const Key& key, uint64_t* ticket) { return impl_->Remove(key, ticket); }
Status SsdTier::WaitDurable(uint64_t ticket) { return impl_->WaitDurable(ticket); }
std::optional<Key> SsdTier::EvictOne() { return impl_->EvictOne(); }
void SsdTier::SetTracked(const Key& key, bool tracked) { impl_->SetTracked(key, tracked); }
Status SsdTier::SetPolicy(const std::string& eviction, const policies::PolicyParams& params) {
  return impl_->SetPolicy(eviction, params);
}
Status SsdTier::ForEach(const std::function<void(const Key&, const SsdMeta&)>& fn) const {
  return impl_->ForEach(fn);
}
void SsdTier::ForEachUnsyncedEviction(const std::function<void(const Key&, TenantId)>& fn) const {
  impl_->ForEachUnsyncedEviction(fn);
}
Status SsdTier::WaitForIndexLoad() const { return impl_->WaitForIndexLoad(); }
Status SsdTier::Flush() { return impl_->Flush(); }
LogPosition SsdTier::LogEnd() const { return impl_->LogEnd(); }
Status SsdTier::Replay(const LogPosition& from, const LogRecordVisitor& visit) {
  return impl_->Replay(from, visit);
}
SsdStats SsdTier::GetStats() const { return impl_->GetStats(); }
uint64_t SsdTier::max_version() const { return impl_->max_version(); }

}  // namespace kvtier::storage
