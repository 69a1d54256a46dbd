// The free-space floor: the segments give way to the files that share their disk (the RocksDB
// index, the RESP name log), which grow with the keys and fail hard when the disk is full
// (docs/format/ssd.md, "Free space for the index").
#include <algorithm>
#include <chrono>

#include "common/logging.h"
#include "storage/ssd/tier_impl.h"

namespace kvtier::storage {

namespace {

// The limit rises only this many checks after it was last lowered: the index's free space
// moves by a memtable or a compaction at a time, and a limit that followed it would have the
// cleaner relocate a segment at every swing.
constexpr uint32_t kRaiseAfterChecks = 30;

}  // namespace

std::chrono::milliseconds SsdTier::Impl::WatchDiskFree(std::unique_lock<std::mutex>& lock) {
  using std::chrono::milliseconds;
  if (o_.disk_free_min_bytes == 0) return milliseconds::max();
  const milliseconds interval(
      std::clamp<uint32_t>(o_.disk_check_ms, 1, SsdOptions::kMaxDiskCheckMs));
  const auto now = std::chrono::steady_clock::now();
  if (now < next_disk_check_) {
    return std::chrono::duration_cast<milliseconds>(next_disk_check_ - now) + milliseconds(1);
  }
  next_disk_check_ = now + interval;
  lock.unlock();
  StatusOr<uint64_t> free = env_->FreeBytes();
  lock.lock();
  if (!free.ok()) {
    uint64_t held = 0;
    if (disk_floor_log_.Allow(NowUs() / 1000, &held)) {
      KVTIER_LOG(kWarn) << "ssd free space not read: " << free.status().ToString()
                        << "; the floor of " << o_.disk_free_min_bytes
                        << " bytes is not kept meanwhile";
    }
    return interval;
  }
  stats_.disk_free_bytes = *free;
  if (*free < o_.disk_free_min_bytes) {
    BelowFloorLocked(*free, "has");
  } else if (free_segments_max_ != SIZE_MAX && segments_.size() <= MaxSegments() &&
             now - floor_lowered_at_ >= kRaiseAfterChecks * interval &&
             *free >= ssd::SaturatingAdd(o_.disk_free_min_bytes, 2 * o_.segment_bytes)) {
    // The earlier shrink has settled, long ago, and the index gave space back: one more
    // segment, with one to spare so that preparing it does not take the disk under the floor
    // again.
    const size_t before = MaxSegments();
    free_segments_max_ = before + 1 >= CapacitySegments() ? SIZE_MAX : before + 1;
    KVTIER_LOG(kInfo) << "ssd disk has " << *free << " bytes free: segment limit raised from "
                      << before << " to " << MaxSegments();
    seg_cv_.notify_all();
  }
  return interval;
}

Status SsdTier::Impl::CheckRoomForSegment(uint64_t* free_bytes) {
  *free_bytes = DeviceEnv::kNoFreeSpaceLimit;
  if (o_.disk_free_min_bytes == 0) return Status::Ok();
  StatusOr<uint64_t> free = env_->FreeBytes();
  if (!free.ok()) return Status::Ok();  // WatchDiskFree reports it
  *free_bytes = *free;
  const uint64_t need = ssd::SaturatingAdd(o_.disk_free_min_bytes, o_.segment_bytes);
  if (*free >= need) return Status::Ok();
  return NoSpaceError("a new segment of " + std::to_string(o_.segment_bytes) +
                      " bytes would leave " +
                      std::to_string(*free > o_.segment_bytes ? *free - o_.segment_bytes : 0) +
                      " bytes free on the disk, below disk_free_min_bytes (" +
                      std::to_string(o_.disk_free_min_bytes) + ")");
}

void SsdTier::Impl::BelowFloorLocked(uint64_t free_bytes, const char* when) {
  const size_t before = MaxSegments();
  if (segments_.size() >= 3) {
    free_segments_max_ = std::min(free_segments_max_, segments_.size() - 1);
  }
  if (MaxSegments() < before) {
    ++stats_.disk_free_shrinks;
    floor_lowered_at_ = std::chrono::steady_clock::now();
    KVTIER_LOG(kWarn) << "ssd disk " << when << " " << free_bytes
                      << " bytes free, below disk_free_min_bytes (" << o_.disk_free_min_bytes
                      << ", room for the index): segment limit lowered from " << before << " to "
                      << MaxSegments();
    return;
  }
  if (segments_.size() > MaxSegments()) return;  // an earlier shrink is still being cleaned
  uint64_t held = 0;
  if (disk_floor_log_.Allow(NowUs() / 1000, &held)) {
    KVTIER_LOG(kWarn) << "ssd disk " << when << " " << free_bytes
                      << " bytes free, below disk_free_min_bytes (" << o_.disk_free_min_bytes
                      << "), and the tier is at its smallest (" << segments_.size()
                      << " segments): puts that need a new segment fail until the disk has room";
  }
}

}  // namespace kvtier::storage
