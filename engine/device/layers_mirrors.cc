// The device layers' mirrors (DeviceLayers::Attention): copies in device memory of the global KV
// caches and the SWA rings that the sparse attention reads, each kept true by its history (a
// cache's epoch, a ring's stamps) and all within kv_mirror_bytes_max and kKvMirrorsMax, the least
// recently read dropped first.
#include <algorithm>

#include "engine/device/layers.h"

namespace kvtier::engine::device {

void DeviceLayers::DropMirror(std::unordered_map<const void*, Mirror>::iterator it) {
  mirror_bytes_ -= it->second.bytes;
  backend_->Free(it->second.data);
  backend_->Free(it->second.scales);
  mirrors_.erase(it);
}

bool DeviceLayers::DropLeastRecentlyRead() {
  auto victim = mirrors_.end();
  for (auto it = mirrors_.begin(); it != mirrors_.end(); ++it) {
    if (it->second.read < attention_calls_ &&
        (victim == mirrors_.end() || it->second.read < victim->second.read))
      victim = it;
  }
  if (victim == mirrors_.end()) return false;
  DropMirror(victim);
  return true;
}

Status DeviceLayers::FindMirror(const void* id, bool ring, Mirror** out) {
  auto it = mirrors_.find(id);
  if (it != mirrors_.end() && it->second.ring != ring) {  // a dead object's, at the same address
    DropMirror(it);
    it = mirrors_.end();
  }
  if (it == mirrors_.end()) {
    while (mirrors_.size() >= kKvMirrorsMax) {
      if (!DropLeastRecentlyRead()) return Status::Rejected("device layers: too many mirrors");
    }
    it = mirrors_.emplace(id, Mirror{}).first;
    it->second.ring = ring;
  }
  it->second.read = attention_calls_;
  *out = &it->second;
  return Status::Ok();
}

Status DeviceLayers::GrowMirror(Mirror* m, int64_t entries, size_t data_bytes, size_t scale_bytes,
                                int64_t keep) {
  const size_t want = static_cast<size_t>(entries) * (data_bytes + scale_bytes);
  while (mirror_bytes_ - m->bytes + want > kv_mirror_bytes_max_) {
    if (!DropLeastRecentlyRead())
      return Status::Rejected("device layers: the mirrors' memory is spent");
  }
  KVTIER_ASSIGN_OR_RETURN(void* data, backend_->Alloc(static_cast<size_t>(entries) * data_bytes));
  auto scales = backend_->Alloc(static_cast<size_t>(entries) * scale_bytes);
  if (!scales.ok()) {
    backend_->Free(data);
    return scales.status();
  }
  if (keep > 0) {  // a failed copy leaves the mirror as it was
    Status copied = backend_->DeviceCopy(data, m->data, static_cast<size_t>(keep) * data_bytes);
    if (copied.ok())
      copied = backend_->DeviceCopy(*scales, m->scales, static_cast<size_t>(keep) * scale_bytes);
    if (!copied.ok()) {
      backend_->Free(data);
      backend_->Free(*scales);
      return copied;
    }
  }
  backend_->Free(m->data);
  backend_->Free(m->scales);
  m->data = static_cast<uint8_t*>(data);
  m->scales = static_cast<uint8_t*>(*scales);
  mirror_bytes_ = mirror_bytes_ - m->bytes + want;
  m->bytes = want;
  m->capacity = entries;
  return Status::Ok();
}

void DeviceLayers::AddRun(uint8_t* dst, const uint8_t* src, size_t bytes) {
  run_dst_.push_back(dst);
  run_src_.emplace_back(src, bytes);
  run_begin_.push_back(run_begin_.back() + static_cast<int64_t>(bytes));
}

Status DeviceLayers::PrepareMirror(const KvSource& s, Mirror** out) {
  const size_t mdb = config_.head_dim / 2, msb = config_.head_dim / 16;
  Mirror* m = nullptr;
  KVTIER_RETURN_IF_ERROR(FindMirror(s.id, /*ring=*/false, &m));
  // What the mirror still holds of this source: its copy under the source's epoch, or under the
  // parent epoch up to the entries kept of it.
  int64_t keep = 0;
  if (s.epoch != 0 && m->epoch == s.epoch) {
    keep = m->synced;
  } else if (s.parent_epoch != 0 && m->epoch == s.parent_epoch) {
    keep = std::min(m->synced, s.parent_keep);
  }
  keep = std::min(keep, s.entries);
  if (s.entries > m->capacity) {
    const int64_t cap = std::max<int64_t>({s.entries, m->capacity + m->capacity / 2, 64});
    KVTIER_RETURN_IF_ERROR(GrowMirror(m, cap, mdb, msb, keep));
  }
  // Until this call's upload lands the mirror claims only what it keeps (of m->epoch's entries):
  // the new entries are written after them.
  m->synced = keep;
  if (keep < s.entries) {
    const size_t ne = static_cast<size_t>(s.entries - keep);
    AddRun(m->data + keep * mdb, s.data + keep * mdb, ne * mdb);
    AddRun(m->scales + keep * msb, s.scales + keep * msb, ne * msb);
  }
  *out = m;
  return Status::Ok();
}

Status DeviceLayers::PrepareRingMirror(const SwaSource& r, Mirror** out) {
  const size_t sdb = config_.head_dim, ssb = config_.head_dim / 32;
  Mirror* m = nullptr;
  KVTIER_RETURN_IF_ERROR(FindMirror(r.id, /*ring=*/true, &m));
  if (m->capacity != r.slots) {
    KVTIER_RETURN_IF_ERROR(GrowMirror(m, r.slots, sdb, ssb, 0));
    m->stamps.assign(static_cast<size_t>(r.slots), 0);
  }
  // Runs of consecutive written slots whose stamps the mirror lacks; until the upload lands it
  // claims nothing for them.
  for (int64_t j = 0; j < r.slots;) {
    if (r.stamps[j] == 0 || r.stamps[j] == m->stamps[j]) {
      ++j;
      continue;
    }
    int64_t e = j;
    while (e < r.slots && r.stamps[e] != 0 && r.stamps[e] != m->stamps[e]) m->stamps[e++] = 0;
    const size_t ns = static_cast<size_t>(e - j);
    AddRun(m->data + j * sdb, r.data + j * sdb, ns * sdb);
    AddRun(m->scales + j * ssb, r.scales + j * ssb, ns * ssb);
    j = e;
  }
  *out = m;
  return Status::Ok();
}

void DeviceLayers::MirrorsHold(const AttentionKeys& k) {
  for (size_t i = 0; i < k.sources.size(); ++i) {
    mirror_of_[i]->epoch = k.sources[i].epoch;
    mirror_of_[i]->synced = k.sources[i].entries;
  }
  for (size_t i = 0; i < k.rings.size(); ++i) {
    const SwaSource& r = k.rings[i];
    std::copy(r.stamps, r.stamps + r.slots, ring_mirror_of_[i]->stamps.begin());
  }
}

}  // namespace kvtier::engine::device
