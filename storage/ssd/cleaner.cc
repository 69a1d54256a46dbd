#include <algorithm>

#include "common/logging.h"
#include "storage/ssd/tier_impl.h"

namespace kvtier::storage {

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

}  // namespace kvtier::storage
