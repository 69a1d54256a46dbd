#include <algorithm>
#include <array>
#include <cstring>

#include "common/logging.h"
#include "storage/ssd/tier_impl.h"

namespace kvtier::storage {

namespace {

// A write buffer is written as this many chunks (of at least kMinWriteChunkBytes), and the
// writer keeps up to kWriteDepth chunks in flight across buffers, handing the device the next
// chunk as each one completes (the device's queue does not drain between buffers).
constexpr size_t kWriteSplit = 4;
constexpr size_t kWriteDepth = 4;
constexpr size_t kMinWriteChunkBytes = 128 << 10;
// ReadRecord reads into a per-thread buffer of up to this size, kept between reads (faulted
// in once, so io_uring issues an O_DIRECT read at once instead of punting it to a worker);
// larger reads allocate per call. Memory: up to this much per reading thread.
constexpr size_t kReadScratchBytesMax = 4 << 20;

}  // namespace

Status SsdTier::Impl::ReadRecordView(const Segment& seg, uint64_t offset, uint32_t record_bytes,
                                     AlignedBuffer* owned, std::span<const uint8_t>* rec) {
  size_t a = std::max<size_t>(seg.dev->Alignment(), 1);
  uint64_t start = offset / a * a;
  uint64_t end = AlignUp(offset + record_bytes, a);
  thread_local AlignedBuffer scratch;
  thread_local size_t scratch_bytes = 0;
  uint8_t* buf = nullptr;
  if (end - start > kReadScratchBytesMax) {
    *owned = AllocateAligned(end - start, std::max<size_t>(a, 64));
    buf = owned->get();
  } else {
    if (end - start > scratch_bytes) {
      size_t n = std::min(std::max<size_t>(end - start, 2 * scratch_bytes), kReadScratchBytesMax);
      n = AlignUp(n, ssd::kBlockBytes);
      scratch = AllocateAligned(n, ssd::kBlockBytes);
      std::memset(scratch.get(), 0, n);  // fault the pages in once
      scratch_bytes = n;
    }
    buf = scratch.get();
  }
  KVTIER_RETURN_IF_ERROR(seg.dev->Read(start, {buf, end - start}));
  *rec = {buf + (offset - start), record_bytes};
  return Status::Ok();
}

Status SsdTier::Impl::ReadRecord(const Segment& seg, uint64_t offset, uint32_t record_bytes,
                                 std::vector<uint8_t>* out) {
  AlignedBuffer owned;
  std::span<const uint8_t> rec;
  KVTIER_RETURN_IF_ERROR(ReadRecordView(seg, offset, record_bytes, &owned, &rec));
  out->assign(rec.begin(), rec.end());
  return Status::Ok();
}

Status SsdTier::Impl::AppendLocked(const Key& key, const RecordHeader& h,
                                   std::span<const uint8_t> payload, uint64_t keep_free_bytes,
                                   IndexEntry* e) {
  uint64_t rec = ssd::kRecordHeaderBytes + payload.size();
  uint64_t padded = AlignUp(rec, ssd::kRecordAlignBytes);
  if (!FitsActiveLocked(padded, keep_free_bytes)) KVTIER_RETURN_IF_ERROR(RollLocked());
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
  if (zero_fill_wake_at_ != 0 && buf_file_offset_ + buf_len_ >= zero_fill_wake_at_) {
    zero_fill_wake_at_ = 0;
    seg_cv_.notify_all();  // the segment thread may zero-fill its next chunk (ZeroFillSegment)
  }
  return Status::Ok();
}

void SsdTier::Impl::WriteBufferLocked(bool wake_writer) {
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
    b.commit_writes = !wake_writer;
    wb_queue_.push_back(fill_);
  }
  if (wake_writer) writer_cv_.notify_one();
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
    // of the commit that covers this write, see Execute); relocations go back to their victim.
    ++stats_.io_errors;
    std::vector<Key> keys;
    for (const auto& [k, e] : map_) {
      if (e.segment == l.seg->id && e.offset >= l.offset && e.offset < l.offset + l.len) {
        keys.push_back(k);
      }
    }
    std::erase_if(keys, [&](const Key& k) { return !UndoFailedWriteLocked(k); });
    if (o_.on_write_lost && !keys.empty()) o_.on_write_lost(keys);
    KVTIER_LOG(kWarn) << "ssd buffer write failed (segment " << l.seg->id << " @" << l.offset
                      << ", " << keys.size() << " units dropped): " << l.status.ToString();
  }
}

bool SsdTier::Impl::UndoFailedWriteLocked(const Key& k) {
  auto it = map_.find(k);
  if (it == map_.end()) return false;
  auto from = relocated_from_.find(k);
  if (from != relocated_from_.end() && from->second.seq == it->second.seq) {
    IndexEntry source = from->second;
    relocated_from_.erase(from);
    if (segments_.count(source.segment) && DurableLocked(source)) {
      // The relocation's index put is never written: RocksDB still names the source.
      source.hit_count = it->second.hit_count;
      source.last_access_unix_ms = it->second.last_access_unix_ms;
      Insert(k, source);
      return false;
    }
  }
  RemoveLocked(k);
  return true;
}

void SsdTier::Impl::WriterLoop() {
  std::unique_lock wb(wb_mu_);
  while (true) {
    // A buffer a commit queued for itself is left to it (it is on its way to write it).
    writer_cv_.wait(wb, [&] {
      if (writer_busy_) return false;
      if (wb_queue_.empty()) return wb_stop_;
      return !bufs_[wb_queue_.front()].commit_writes;
    });
    if (wb_queue_.empty()) return;  // stopping, and everything queued is written
    WriteQueuedLocked(wb, UINT64_MAX);
  }
}

void SsdTier::Impl::WriteQueuedLocked(std::unique_lock<std::mutex>& wb, uint64_t last_seq) {
  writer_busy_ = true;
  wb.unlock();
  // The buffers this stream took from the queue, in queue order (so in write_seq order).
  struct Taken {
    size_t buf;
    uint64_t seq;
    size_t chunks_left = 0;   // handed to the device, not reported yet
    bool all_pulled = false;  // every chunk handed to the device
    Status status;            // the first failed chunk's error
  };
  std::deque<Taken> taken;  // references stay valid: only push_back and pop_front
  std::array<DeviceIo, kWriteDepth> ios;
  std::array<Taken*, kWriteDepth> owner{};
  std::vector<size_t> free_ios;
  for (size_t k = kWriteDepth; k > 0; --k) free_ios.push_back(k - 1);
  Taken* cur = nullptr;  // the buffer being cut into chunks
  uint64_t cur_off = 0, chunk_bytes = 0;

  auto next = [&]() -> DeviceIo* {
    if (free_ios.empty()) return nullptr;
    if (cur == nullptr) {
      std::lock_guard l(wb_mu_);
      if (wb_queue_.empty() || bufs_[wb_queue_.front()].write_seq > last_seq) return nullptr;
      size_t i = wb_queue_.front();
      wb_queue_.pop_front();
      taken.push_back({i, bufs_[i].write_seq});
      cur = &taken.back();
      cur_off = 0;
      chunk_bytes = std::max<uint64_t>(AlignUp(bufs_[i].len / kWriteSplit, ssd::kBlockBytes),
                                       kMinWriteChunkBytes);
    }
    // data/seg/file_offset/len were set before the buffer was queued (read after wb_mu_).
    const WriteBuf& b = bufs_[cur->buf];
    size_t k = free_ios.back();
    free_ios.pop_back();
    uint64_t len = std::min(chunk_bytes, b.len - cur_off);
    ios[k] = {b.seg->dev.get(),
              {IoRequest::Op::kWrite,
               b.file_offset + cur_off,
               b.data + cur_off,
               static_cast<size_t>(len),
               {}}};
    owner[k] = cur;
    ++cur->chunks_left;
    cur_off += len;
    if (cur_off >= b.len) {
      cur->all_pulled = true;
      cur = nullptr;
    }
    return &ios[k];
  };
  auto done = [&](DeviceIo* io) {
    size_t k = static_cast<size_t>(io - ios.data());
    Taken* t = owner[k];
    if (!io->io.result.ok() && t->status.ok()) t->status = io->io.result;
    --t->chunks_left;
    free_ios.push_back(k);
    // A buffer is done once all its chunks are; completed_seq_ advances over a prefix.
    bool settled = false;
    {
      std::lock_guard l(wb_mu_);
      while (!taken.empty() && taken.front().all_pulled && taken.front().chunks_left == 0) {
        Taken& f = taken.front();
        WriteBuf& b = bufs_[f.buf];
        if (!f.status.ok())
          failed_writes_.push_back({f.seq, b.seg->id, b.file_offset, b.len, f.status});
        b.status = f.status;
        b.done = true;  // the putting thread may reap (and refill) it from here on
        completed_seq_ = f.seq;
        taken.pop_front();
        settled = true;
      }
    }
    if (settled) wb_cv_.notify_all();
  };
  Status st = env_->Stream(kWriteDepth, next, done);
  // A ring error ends the stream with a buffer perhaps partly handed over: its other chunks
  // fail with that error (its records are dropped, never indexed).
  while (cur != nullptr) {
    DeviceIo* io = next();
    io->io.result = st.ok() ? Status::IOError("buffer write not completed") : st;
    done(io);
  }
  wb.lock();
  writer_busy_ = false;
  wb_cv_.notify_all();
  if (!wb_queue_.empty()) writer_cv_.notify_one();
}

Status SsdTier::Impl::RollLocked() {
  if (next_seg_ == nullptr) return Status::Rejected("no room in the active segment");
  // The buffer being filled belongs to the sealed segment; the next commit waits for it and
  // syncs the sealed segment (it stays in unsynced_segs_), so no commit is needed here.
  WriteBufferLocked();
  active_ = std::move(next_seg_);
  next_seg_.reset();
  segments_[active_->id] = active_;
  buf_file_offset_ = 0;
  buf_len_ = 0;
  ++threshold_cleans_;
  seg_cv_.notify_all();  // prepare the next segment; clean if over the limit
  return Status::Ok();
}

Status SsdTier::Impl::WaitForRoomLocked(std::unique_lock<std::mutex>& lock, uint64_t padded) {
  while (!PutFitsActiveLocked(padded) && next_seg_ == nullptr) {
    if (!prepare_status_.ok()) return prepare_status_;
    ++room_waiters_;  // lifts the background I/O budget until a segment is prepared
    seg_cv_.notify_all();
    room_cv_.wait(lock);
    --room_waiters_;
  }
  return Status::Ok();
}

}  // namespace kvtier::storage
