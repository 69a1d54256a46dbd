// The segment thread: prepares the next segment and cleans sealed ones, outside the tier lock
// for every device I/O, paced by background_io_bytes_per_s.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "common/logging.h"
#include "storage/ssd/tier_impl.h"

namespace kvtier::storage {

namespace {

// Records relocated per lock hold while cleaning (bounds the pause a chunk causes; at most a
// quarter of the smallest segment, so a chunk always fits in the active + a fresh segment).
constexpr size_t kCleanChunkBytes = 256 << 10;
// Zero-filling a new segment (ZeroFillSegment) writes it in chunks of this size (at most a
// quarter of a segment).
constexpr uint64_t kZeroFillChunkBytes = 4 << 20;
// After a failed preparation or cleaning pass, the segment thread retries after this long.
constexpr uint32_t kRetryMs = 100;
// Pacing sleeps in slices of at most this long, so a waiting request lifts it promptly.
constexpr uint64_t kPaceSliceUs = 5'000;

}  // namespace

void SsdTier::Impl::SegmentLoop() {
  std::unique_lock lock(mu_);
  while (!seg_stop_.load()) {
    // 1. A prepared segment first: requests wait for nothing else.
    if (next_seg_ == nullptr && segments_.size() <= MaxSegments()) {
      PrepareSegment(lock);
      if (!prepare_status_.ok()) {
        seg_cv_.wait_for(lock, std::chrono::milliseconds(kRetryMs));
      }
      continue;
    }
    // 2. Cleaning: over the segment limit, or one sparse segment per roll. Deferred while
    // the index loads (live bytes are partial: cleaning would delete live data).
    const std::chrono::milliseconds disk_check_in = WatchDiskFree(lock);
    std::shared_ptr<Segment> victim = PickVictimLocked();
    if (victim != nullptr) {
      Status st = CleanSegment(victim, lock);
      if (!st.ok()) {
        uint64_t held = 0;
        if (clean_failure_log_.Allow(NowUs() / 1000, &held)) {
          KVTIER_LOG(kWarn) << "ssd cleaning of segment " << victim->id << ": " << st.ToString()
                            << " (" << held << " more failed cleanings since the last such line)";
        }
        seg_cv_.wait_for(lock, std::chrono::milliseconds(kRetryMs));
      }
      continue;
    }
    if (disk_check_in == std::chrono::milliseconds::max()) {
      seg_cv_.wait(lock);  // no floor (wait_for would overflow the clock)
    } else {
      seg_cv_.wait_for(lock, disk_check_in);
    }
  }
}

void SsdTier::Impl::PrepareSegment(std::unique_lock<std::mutex>& lock) {
  // Only this thread creates segments after Open, and a roll only consumes the prepared one:
  // the next id is the active segment's + 1.
  if (active_->id == ssd::kSegmentIdMax) {
    // Ids do not wrap (recovery orders segments by id): the tier has written its last segment.
    if (prepare_status_.ok()) {
      prepare_status_ = Status::IOError("ssd segment ids exhausted (the last is " +
                                        std::to_string(ssd::kSegmentIdMax) + ")");
      KVTIER_LOG(kError) << prepare_status_.message()
                         << ": no new segment; puts that need one fail (docs/format/ssd.md)";
    }
    room_cv_.notify_all();
    return;
  }
  uint32_t id = active_->id + 1;
  lock.unlock();
  std::shared_ptr<BlockDevice> dev;
  uint64_t free_bytes = 0;
  Status st = CheckRoomForSegment(&free_bytes);
  const bool below_floor = !st.ok();
  auto opened = below_floor ? StatusOr<std::shared_ptr<BlockDevice>>(st)
                            : env_->Open(ssd::SegmentName(id), true);
  if (opened.ok()) {
    dev = std::move(*opened);
    st = dev->Allocate(0, o_.segment_bytes);
    if (st.ok()) st = ZeroFillSegment(dev.get(), &lock);
    if (st.ok()) st = env_->SyncDir();  // the new entry is durable before a commit names it
    if (!st.ok()) {
      dev.reset();
      Status rm = env_->Remove(ssd::SegmentName(id));
      (void)rm;
    }
  } else {
    st = opened.status();
  }
  lock.lock();
  if (!st.ok() && seg_stop_.load()) return;  // closing (a zero-fill stops early): no error
  if (below_floor) {
    // As at ENOSPC below, but the limit rises again once the index gives the space back. At
    // the tier's smallest, waiting puts fail with the floor's error until the disk has room.
    BelowFloorLocked(free_bytes > o_.segment_bytes ? free_bytes - o_.segment_bytes : 0,
                     "would have, after preparing a segment,");
    if (segments_.size() < 3) {
      prepare_status_ = st;
      room_cv_.notify_all();
    }
    seg_cv_.notify_all();
    return;
  }
  if (!st.ok() && IsNoSpace(st) && segments_.size() >= 3) {
    // The disk holds fewer segments than capacity_bytes allows: the tier shrinks to what it
    // held (disk_segments_max_) and the cleaner makes room; waiting puts wait for it. A
    // preparation at that limit (the cleaner's relocation segment) fails the same way and is
    // no error either: what does not fit is evicted.
    const size_t before = MaxSegments();
    disk_segments_max_ = std::min(disk_segments_max_, segments_.size() - 1);
    if (MaxSegments() < before) {
      ++stats_.disk_full_shrinks;
      KVTIER_LOG(kWarn) << "ssd segment " << id << " not prepared: " << st.ToString()
                        << "; the disk holds " << segments_.size()
                        << " segments: segment limit lowered from " << before << " to "
                        << MaxSegments() << " until restart (capacity_bytes is larger than "
                        << "the disk's free space)";
    }
    seg_cv_.notify_all();
    return;
  }
  if (!st.ok()) {
    ++stats_.io_errors;
    if (prepare_status_.ok()) {
      KVTIER_LOG(kWarn) << "ssd segment " << id << " not prepared: " << st.ToString();
    }
    prepare_status_ = st;
    room_cv_.notify_all();  // waiting puts return the error
    return;
  }
  auto seg = std::make_shared<Segment>();
  seg->id = id;
  seg->dev = std::move(dev);
  next_seg_ = std::move(seg);
  prepare_status_ = Status::Ok();
  room_cv_.notify_all();
}

Status SsdTier::Impl::ZeroFillSegment(BlockDevice* dev, std::unique_lock<std::mutex>* lock) {
  // A device of alignment 1 (memory) has no blocks whose first write costs a conversion.
  if (o_.durability != Durability::kSync || !o_.zero_fill_segments || dev->Alignment() <= 1) {
    return Status::Ok();
  }
  const uint64_t chunk = std::max<uint64_t>(
      std::min<uint64_t>(kZeroFillChunkBytes,
                         o_.segment_bytes / 4 / ssd::kBlockBytes * ssd::kBlockBytes),
      ssd::kBlockBytes);
  AlignedBuffer zeros = AllocateAligned(chunk, ssd::kBlockBytes);
  std::memset(zeros.get(), 0, chunk);
  for (uint64_t off = 0; off < o_.segment_bytes; off += chunk) {
    uint64_t n = std::min(chunk, o_.segment_bytes - off);
    if (lock != nullptr) {
      // The next segment's zeros keep pace with the active segment's fill (done by the time it
      // is 3/4 full), so that they do not compete with commits for the device all at once;
      // at full speed while a put waits for a segment.
      lock->lock();
      const uint64_t wake_at = (off * 3 + 3) / 4;  // the active segment's fill for this chunk
      while (!seg_stop_.load() && room_waiters_.load() == 0 &&
             buf_file_offset_ + buf_len_ < wake_at) {
        zero_fill_wake_at_ = wake_at;  // AppendLocked wakes this thread there
        seg_cv_.wait(*lock);
      }
      zero_fill_wake_at_ = 0;
      lock->unlock();
      if (seg_stop_.load()) return Status::Unavailable("closing");
      PaceBackgroundIo(n);
    }
    KVTIER_RETURN_IF_ERROR(dev->Write(off, {zeros.get(), static_cast<size_t>(n)}));
  }
  return dev->Sync(true);
}

std::shared_ptr<Segment> SsdTier::Impl::PickVictimLocked() {
  if (!loaded_) return nullptr;
  std::shared_ptr<Segment> victim;
  for (const auto& [id, seg] : segments_) {
    if (seg == active_) continue;
    if (victim == nullptr || seg->live_bytes < victim->live_bytes) victim = seg;
  }
  if (victim == nullptr) return nullptr;
  if (segments_.size() > MaxSegments()) return victim;
  if (threshold_cleans_ == 0) return nullptr;
  // At most one threshold-driven clean per roll.
  threshold_cleans_ = 0;
  bool sparse = static_cast<double>(victim->live_bytes) <
                o_.clean_live_ratio * static_cast<double>(o_.segment_bytes);
  return sparse ? victim : nullptr;
}

void SsdTier::Impl::PaceBackgroundIo(uint64_t bytes) {
  if (o_.background_io_bytes_per_s == 0) return;  // unlimited
  uint64_t now = NowUs();
  bg_io_next_us_ = std::max(bg_io_next_us_, now) +
                   bytes * 1'000'000 / std::max<uint64_t>(o_.background_io_bytes_per_s, 1);
  while (!seg_stop_.load() && room_waiters_.load() == 0) {
    now = NowUs();
    if (now >= bg_io_next_us_) return;
    std::this_thread::sleep_for(
        std::chrono::microseconds(std::min<uint64_t>(bg_io_next_us_ - now, kPaceSliceUs)));
  }
  bg_io_next_us_ = NowUs();  // a request waits: cleaning runs at full speed, no debt kept
}

Status SsdTier::Impl::CleanSegment(const std::shared_ptr<Segment>& victim,
                                   std::unique_lock<std::mutex>& lock) {
  std::vector<std::pair<Key, IndexEntry>> live;
  for (const auto& [k, e] : map_) {
    if (e.segment == victim->id) live.emplace_back(k, e);
  }
  std::sort(live.begin(), live.end(),
            [](const auto& a, const auto& b) { return a.second.offset < b.second.offset; });
  struct Read {
    std::vector<uint8_t> rec;
    RecordHeader h;
    Status st;
  };
  std::vector<Read> reads;
  // Ends the reserve for the relocations (waiting puts may fit again).
  auto end_reserve = [&] {
    if (clean_reserve_bytes_ == 0) return;
    clean_reserve_bytes_ = 0;
    room_cv_.notify_all();
  };
  for (size_t i = 0; i < live.size();) {
    if (seg_stop_.load()) {
      end_reserve();
      return Status::Ok();  // closing: the victim stays, intact
    }
    // A long clean must not starve puts of the next segment.
    if (next_seg_ == nullptr && segments_.size() <= MaxSegments()) PrepareSegment(lock);
    size_t end = i;
    uint64_t chunk_bytes = 0;
    while (end < live.size() && (end == i || chunk_bytes < kCleanChunkBytes)) {
      chunk_bytes += live[end].second.record_bytes;
      ++end;
    }
    // A record whose write buffer has not been reaped yet may not be on the device: its
    // bytes are copied from the buffer now (a reaped buffer's records are on the device, and
    // a buffer is not reused before it is reaped). Read from the device instead, such a
    // record reads as zeros and would be dropped as corrupt.
    reads.assign(end - i, Read{});
    for (size_t j = i; j < end; ++j) {
      if (const uint8_t* p = BufferedRecord(live[j].second); p != nullptr) {
        reads[j - i].rec.assign(p, p + live[j].second.record_bytes);
      }
    }
    // Read and verify outside the lock; the index may change meanwhile (checked below).
    lock.unlock();
    PaceBackgroundIo(2 * chunk_bytes);  // read here + written again by the relocation
    for (size_t j = i; j < end; ++j) {
      const auto& [k, old] = live[j];
      Read& r = reads[j - i];
      if (r.rec.empty()) r.st = ReadRecord(*victim, old.offset, old.record_bytes, &r.rec);
      if (r.st.ok()) r.st = ssd::DecodeRecordHeader(r.rec, &r.h);
      if (r.st.ok() && (r.h.key != k || r.h.seq != old.seq ||
                        ssd::PayloadChecksum({r.rec.data() + ssd::kRecordHeaderBytes,
                                              r.h.stored_bytes}) != old.checksum)) {
        r.st = Status::Corruption("checksum");
      }
    }
    lock.lock();
    // Room for the chunk: puts may have filled the active segment and taken the prepared one
    // meanwhile. The cleaner then prepares a segment itself rather than drop live units, but
    // only while the files on disk stay within one of their limit (MaxSegments() + 1; a
    // second relocation segment per chunk, or per clean, would let the count grow without
    // bound while puts outrun the cleaner). From then on puts share that segment as the active
    // one but leave room for the rest of the victim (clean_reserve_bytes_); what still does
    // not fit (a failed preparation) is dropped below.
    uint64_t chunk_padded = 0;
    for (size_t j = i; j < end; ++j) {
      chunk_padded += AlignUp(live[j].second.record_bytes, ssd::kRecordAlignBytes);
    }
    for (int attempt = 0; attempt < 2 && !FitsActiveLocked(chunk_padded) && next_seg_ == nullptr &&
                          segments_.size() <= MaxSegments() + 1;
         ++attempt) {
      PrepareSegment(lock);
      if (next_seg_ != nullptr && clean_reserve_bytes_ == 0) {
        for (size_t j = i; j < live.size(); ++j) {
          clean_reserve_bytes_ += AlignUp(live[j].second.record_bytes, ssd::kRecordAlignBytes);
        }
      }
    }
    for (size_t j = i; j < end; ++j) {
      const auto& [k, old] = live[j];
      Read& r = reads[j - i];
      auto it = map_.find(k);
      // Replaced, removed or evicted while unlocked: nothing to relocate.
      if (it == map_.end() || it->second.seq != old.seq || it->second.segment != victim->id) {
        continue;
      }
      if (!r.st.ok()) {
        if (r.st.IsCorruption())
          ++stats_.checksum_failures;
        else
          ++stats_.io_errors;
        RemoveLocked(k);
        cleaner_dropped_.push_back(k);
        continue;
      }
      IndexEntry e;
      const IndexEntry source = it->second;
      Status st = AppendLocked(k, r.h, {r.rec.data() + ssd::kRecordHeaderBytes, r.h.stored_bytes},
                               /*keep_free_bytes=*/0, &e);
      // Until its commit settles: a failed write or sync of the copy puts the entry back here.
      if (st.ok()) relocated_from_[k] = source;
      if (!st.ok()) {
        // No room to relocate: the unit is dropped, as an eviction.
        RemoveLocked(k);
        ++stats_.evictions;
        cleaner_dropped_.push_back(k);
        if (!st.IsRejected()) {
          end_reserve();
          return st;
        }
        continue;
      }
      stats_.relocated_bytes += old.record_bytes;
      auto moved = map_.find(k);
      if (moved != map_.end()) {
        moved->second.hit_count = old.hit_count;
        moved->second.last_access_unix_ms = old.last_access_unix_ms;
        moved->second.created_unix_ms = old.created_unix_ms;
      }
    }
    clean_reserve_bytes_ -= std::min(clean_reserve_bytes_, chunk_padded);
    i = end;
  }
  end_reserve();
  // Relocated entries must be durable, in the index too, before the old segment disappears
  // (outside the lock: the commit pipeline's own path, as the group commit).
  lock.unlock();
  Status st = Commit(kForceCommit, /*sync_index=*/true);
  lock.lock();
  KVTIER_RETURN_IF_ERROR(st);
  if (victim->live_bytes != 0) {
    // A relocation's write or sync failed (in this commit or an earlier one): its units went
    // back to the victim, which stays until a clean succeeds.
    return Status::IOError("segment " + std::to_string(victim->id) +
                           " still holds live records after cleaning (a relocation's write "
                           "failed): it is kept and cleaned again");
  }
  segments_.erase(victim->id);
  ++stats_.segments_cleaned;
  lock.unlock();
  // Readers holding the segment keep their handle (DeviceEnv::Remove keeps it usable).
  st = env_->Remove(ssd::SegmentName(victim->id));
  if (st.ok()) st = env_->SyncDir();  // a cleaned segment never comes back after a crash
  lock.lock();
  if (!st.ok() && !st.IsNotFound()) {
    KVTIER_LOG(kWarn) << "remove segment: " << st.ToString();
  }
  return Status::Ok();
}

}  // namespace kvtier::storage
