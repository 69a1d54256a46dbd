// TierManager reads: Get, GetBatch and promotion, Lookup, Prefetch, ListUnits, Describe
// (storage/tier_manager_impl.h).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>

#include "common/logging.h"
#include "storage/tier_manager_impl.h"

namespace kvtier::storage::internal {
namespace {

// What a copy of a unit needs besides its bytes and TTL, from the tier that holds it.
void FromMeta(const MemMeta& m, Tier tier, UnitInfo* u) {
  u->tenant = m.tenant;
  u->kind = m.kind;
  std::memcpy(u->parent.data(), &m.parent_id, sizeof(m.parent_id));
  u->recompute_tokens = m.recompute_tokens;
  u->allow_ssd = m.allow_ssd;
  u->tier = tier;
}

void FromMeta(const SsdMeta& m, UnitInfo* u) {
  u->tenant = m.tenant;
  u->kind = m.kind;
  std::memcpy(u->parent.data(), &m.parent_id, sizeof(m.parent_id));
  u->recompute_tokens = m.recompute_tokens;
  u->allow_ssd = true;
  u->tier = Tier::kSsd;
}

}  // namespace

void TierManagerImpl::ListUnits(UnitCursor* cursor, size_t units_max, std::vector<UnitInfo>* out) {
  out->clear();
  if (cursor->done) return;
  units_max = std::clamp<size_t>(units_max, 1, kMaxBatch);
  std::lock_guard lock(mu_);
  DrainLoadedLocked();
  if (cursor->buckets == 0) {
    cursor->buckets = dir_.bucket_count();
  } else if (cursor->buckets != dir_.bucket_count()) {
    cursor->disturbed = true;  // bucket indices moved: finish this pass, the caller rescans
    cursor->buckets = dir_.bucket_count();
  }
  // Whole buckets per page (a bucket holds ~1 key): a page may run a few keys over.
  while (cursor->bucket < dir_.bucket_count() && out->size() < units_max) {
    size_t b = cursor->bucket++;
    for (auto it = dir_.begin(b); it != dir_.end(b); ++it) {
      if (WritingLocked(it->first)) continue;
      UnitInfo u;
      if (DescribeLocked(it->first, it->second, &u)) out->push_back(u);
    }
  }
  cursor->done = cursor->bucket >= dir_.bucket_count();
}

bool TierManagerImpl::Describe(const Key& key, UnitInfo* info) {
  std::lock_guard lock(mu_);
  DrainLoadedLocked();
  auto it = dir_.find(key);
  return it != dir_.end() && DescribeLocked(key, it->second, info);
}

bool TierManagerImpl::DescribeLocked(const Key& key, const DirEntry& entry, UnitInfo* u) const {
  *u = UnitInfo{};
  MemMeta mm;
  SsdMeta sm;
  uint64_t expires_ms = 0;
  if (hbm_ && hbm_->Contains(key, &mm)) {
    FromMeta(mm, Tier::kHbm, u);
    expires_ms = mm.expires_ms;
  } else if (dram_ && dram_->Contains(key, &mm)) {
    FromMeta(mm, Tier::kDram, u);
    expires_ms = mm.expires_ms;
  } else if (ssd_ && ssd_->Contains(key, nullptr, &sm)) {
    FromMeta(sm, u);
    expires_ms = FromUnix(sm.expires_unix_ms);
  } else {
    return false;
  }
  u->key = key;
  u->tenant = entry.tenant;
  u->bytes = entry.bytes;
  return TtlLeftMs(expires_ms, &u->ttl_left_ms);
}

Tier TierManagerImpl::Locate(const Key& key, bool* expired, uint64_t* bytes) const {
  if (expired != nullptr) *expired = false;
  MemMeta m;
  for (Tier t : {Tier::kHbm, Tier::kDram}) {
    const MemoryTier* mem = MemTier(t);
    if (mem == nullptr || !mem->Contains(key, &m)) continue;
    if (expired != nullptr) *expired = Expired(m.expires_ms);
    if (bytes != nullptr) *bytes = m.size_bytes;
    return t;
  }
  // The SSD tier's index is in memory: its entry names the expiry (Unix ms) at no read.
  SsdMeta sm;
  const bool meta = expired != nullptr || bytes != nullptr;
  if (ssd_ && ssd_->Contains(key, nullptr, meta ? &sm : nullptr)) {
    if (expired != nullptr) *expired = ExpiredUnix(sm.expires_unix_ms);
    if (bytes != nullptr) *bytes = sm.raw_bytes;
    return Tier::kSsd;
  }
  return Tier::kNone;
}

Status TierManagerImpl::GetImpl(const Key& key, std::vector<uint8_t>* out, Tier* from,
                                ReadMode mode, const RequestTag& request, uint64_t* ttl_left_ms,
                                UnitInfo* info) {
  const bool peek = mode == ReadMode::kPeek;
  out->clear();
  auto expire = [&]() -> Status {
    {
      std::lock_guard lock(mu_);
      ExpireLocked(key);
    }
    out->clear();
    if (!peek) CountMiss(MissReason::kExpired);
    return Status::NotFound("expired");
  };
  for (Tier t : {Tier::kHbm, Tier::kDram}) {
    MemoryTier* mem = MemTier(t);
    MemMeta m;
    if (mem && mem->Read(key, out, &m, /*count=*/!peek, &request).ok()) {
      uint64_t left_ms = 0;
      if (!TtlLeftMs(m.expires_ms, &left_ms)) return expire();
      if (from != nullptr) *from = t;
      if (ttl_left_ms != nullptr) *ttl_left_ms = left_ms;
      if (info != nullptr) {
        *info = UnitInfo{.key = key, .bytes = out->size(), .ttl_left_ms = left_ms};
        FromMeta(m, t, info);
      }
      return Status::Ok();
    }
  }
  if (ssd_) {
    SsdMeta sm;
    Status st = ssd_->Get(key, out, &sm, &request);
    if (st.ok()) {
      uint64_t left_ms = 0;
      if (ExpiredUnix(sm.expires_unix_ms) || !TtlLeftMs(FromUnix(sm.expires_unix_ms), &left_ms))
        return expire();
      if (from != nullptr) *from = Tier::kSsd;
      if (ttl_left_ms != nullptr) *ttl_left_ms = left_ms;
      if (info != nullptr) {
        *info = UnitInfo{.key = key, .bytes = out->size(), .ttl_left_ms = left_ms};
        FromMeta(sm, info);
      }
      if ((dram_ || hbm_) && !peek) {
        std::unique_lock lock(mu_, std::defer_lock);
        if (mode == ReadMode::kPrefetch) {
          lock.lock();
        } else {
          (void)lock.try_lock();  // never make a reader wait for a writer to promote
        }
        if (lock.owns_lock()) PromoteLocked(request, key, *out, sm);
      }
      return Status::Ok();
    }
    out->clear();
    if (st.IsCorruption()) {
      {
        std::lock_guard lock(mu_);
        DroppedLocked(key, MissReason::kChecksumFailure);
      }
      if (!peek) CountMiss(MissReason::kChecksumFailure);
      ReportChecksumFailure(key, sm);
      return Status::NotFound("checksum failure: unit quarantined");
    }
    if (st.IsIOError()) {
      io_errors_.fetch_add(1);
      if (!peek) CountMiss(MissReason::kIoError);
      return Status::NotFound("io_error: ssd read failed: " + st.message());
    }
  }
  MissReason r = misses_.Reason(key);
  if (!peek) CountMiss(r);
  return Status::NotFound(MissReasonName(r));
}

void TierManagerImpl::GetBatch(std::span<const Key> keys, std::vector<std::vector<uint8_t>>* outs,
                               std::vector<Tier>* froms, std::vector<Status>* results,
                               const RequestTag& given) {
  const RequestTag request = given.id != 0 ? given : BeginRequest();
  const size_t n = keys.size();
  outs->resize(n);
  if (froms != nullptr) froms->assign(n, Tier::kNone);
  if (n > kMaxBatch) {
    results->assign(n, Status::InvalidArgument("batch larger than kMaxBatch"));
    return;
  }
  results->assign(n, Status::Ok());
  GetBatchImpl(
      keys, request, [&](size_t i) { return &(*outs)[i]; },
      [&](size_t i, const Status& st, Tier from, std::span<const uint8_t> value) {
        (*results)[i] = st;
        if (froms != nullptr) (*froms)[i] = from;
        std::vector<uint8_t>& out = (*outs)[i];
        if (value.data() != out.data() || value.size() != out.size()) {
          out.assign(value.begin(), value.end());  // an SSD value (viewed in its read region)
        }
      });
}

void TierManagerImpl::GetBatchVisit(std::span<const Key> keys, const BatchVisitor& visit,
                                    const RequestTag& given, const std::function<void()>& visited) {
  const RequestTag request = given.id != 0 ? given : BeginRequest();
  if (keys.size() > kMaxBatch) {
    for (size_t i = 0; i < keys.size(); ++i) {
      visit(i, Status::InvalidArgument("batch larger than kMaxBatch"), Tier::kNone, {});
    }
    if (visited) visited();
    return;
  }
  std::vector<uint8_t> scratch;  // memory-tier values, one at a time: no allocation per key
  GetBatchImpl(
      keys, request, [&](size_t) { return &scratch; }, visit, visited);
}

void TierManagerImpl::GetBatchImpl(std::span<const Key> keys, const RequestTag& request,
                                   const std::function<std::vector<uint8_t>*(size_t)>& slot,
                                   const BatchVisitor& visit,
                                   const std::function<void()>& visited) {
  const size_t n = keys.size();
  // Every key is a client's reference, hit or miss: counted before the reads, so before the
  // promotions' demotions ask the admission policy (the simulator's order).
  CountReferences(keys, request.now_us);
  // The SSD units are read in one batch first; then every key, in order, takes its path and
  // reports its hit to its tier's policy (memory: Get's path; SSD: ReportHit), and the SSD
  // hits are promoted last, so that the policies see the batch as the simulator replays it.
  std::vector<size_t> ssd_slot(n, SIZE_MAX);
  std::vector<Key> ssd_keys;
  ssd_keys.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (ssd_ && Locate(keys[i], /*expired=*/nullptr) == Tier::kSsd) {  // expiry: on read
      ssd_slot[i] = ssd_keys.size();
      ssd_keys.push_back(keys[i]);
    }
  }
  // The SSD values stay in the batch's read region (verified there) until the promotions
  // below have copied them: no vector per unit.
  SsdTier::Batch read;
  if (!ssd_keys.empty()) ssd_->GetBatch(ssd_keys, &read, &request, /*report_hits=*/false);
  // A value GetImpl read into *slot(i): visited where it lies.
  auto get = [&](size_t i) {
    std::vector<uint8_t>* out = slot(i);
    Tier from = Tier::kNone;
    Status st = GetImpl(keys[i], out, &from, ReadMode::kGet, request);
    visit(i, st, from, st.ok() ? std::span<const uint8_t>(*out) : std::span<const uint8_t>());
  };
  std::vector<size_t> promote;  // keys read from SSD, in order
  promote.reserve(ssd_keys.size());
  for (size_t i = 0; i < n; ++i) {
    if (ssd_slot[i] == SIZE_MAX) {
      get(i);
      continue;
    }
    const size_t j = ssd_slot[i];
    const Key& key = keys[i];
    const Status& st = read.result(j);
    if (st.IsCorruption()) {  // quarantined by the SSD tier, as in Get
      {
        std::lock_guard lock(mu_);
        DroppedLocked(key, MissReason::kChecksumFailure);
      }
      CountMiss(MissReason::kChecksumFailure);
      ReportChecksumFailure(key, read.meta(j));
      visit(i, Status::NotFound("checksum failure: unit quarantined"), Tier::kNone, {});
      continue;
    }
    if (st.IsIOError()) {
      io_errors_.fetch_add(1);
      CountMiss(MissReason::kNeverStored);
      visit(i, Status::NotFound("ssd read failed: " + st.message()), Tier::kNone, {});
      continue;
    }
    if (!st.ok() || ExpiredUnix(read.meta(j).expires_unix_ms)) {
      // Gone since Locate, or expired: Get's path (it re-reads, and accounts the miss).
      get(i);
      continue;
    }
    ssd_->ReportHit(key, &request);
    visit(i, Status::Ok(), Tier::kSsd, read.value(j));
    promote.push_back(i);
  }
  // Every key was visited: the caller may answer now (GetBatchVisit's `visited`). The
  // promotions below re-check each unit under mu_, so a delete or put after this is honoured.
  if (visited) visited();
  // The SSD hits are promoted after every hit of the batch was reported (in key order; the
  // simulator's order): a promotion's demotions then never evict a unit the batch has yet to
  // report. A unit the SSD evicted meanwhile is not promoted (PromoteLocked checks). Each is
  // copied once, from the read region into its memory-tier chunk.
  if (promote.empty() || (!dram_ && !hbm_)) return;
  std::unique_lock lock(mu_, std::try_to_lock);  // never make a reader wait to promote
  if (!lock.owns_lock()) return;
  // Under the prefix layer deepest first, as the simulator inserts a request's units.
  if (o_.eviction_structure == policies::Structure::kPrefix) {
    std::reverse(promote.begin(), promote.end());
  }
  for (size_t i : promote) {
    PromoteLocked(request, keys[i], read.value(ssd_slot[i]), read.meta(ssd_slot[i]));
  }
  if (o_.eviction_structure != policies::Structure::kPrefix) return;
  // As the simulator under the prefix layer: a unit of the batch whose predecessor in it the
  // promotions evicted after all (the request outgrew what the layer gives back) leaves the
  // tier, since a cached unit whose prefix is gone is of no use.
  MemoryTier* mem = dram_ ? dram_.get() : hbm_.get();
  for (size_t k = 1; k < n; ++k) {
    if (WritingLocked(keys[k]) || !mem->Contains(keys[k]) || mem->Contains(keys[k - 1])) continue;
    (void)mem->Remove(keys[k], &request);
    DroppedLocked(keys[k], MissReason::kEvicted);  // unless another tier still holds it
  }
}

void TierManagerImpl::PromoteLocked(const RequestTag& request, const Key& key,
                                    std::span<const uint8_t> value, const SsdMeta& sm) {
  if (WritingLocked(key)) return;  // a put of the key is in flight: it places the new version
  uint64_t version = 0;
  if (!ssd_->Contains(key, &version) || version != sm.version) return;  // changed meanwhile
  if ((dram_ && dram_->Contains(key)) || (hbm_ && hbm_->Contains(key))) return;
  MemMeta meta;
  meta.tenant = sm.tenant;
  meta.version = sm.version;
  meta.kind = sm.kind;
  meta.expires_ms = FromUnix(sm.expires_unix_ms);
  meta.parent_id = sm.parent_id;
  meta.recompute_tokens = sm.recompute_tokens;
  meta.allow_ssd = true;
  meta.size_bytes = static_cast<uint32_t>(value.size());
  Tier target = dram_ ? Tier::kDram : Tier::kHbm;
  MemoryTier* mem = MemTier(target);
  if (value.size() > mem->max_value_bytes()) return;
  mem->NoteMiss(key, value.size(), &request);
  while (true) {
    Status st = mem->Insert(key, value, meta, !PinnedLocked(key), &request);
    if (st.ok() || !st.IsRejected()) return;
    auto victim = mem->PickVictim(&request);
    if (!victim) return;
    DemoteLocked(&request, target, *victim);
  }
}

LookupResult TierManagerImpl::LookupImpl(std::span<const Key> chain, bool count_references) {
  LookupResult r;
  size_t n = std::min(chain.size(), kMaxBatch);
  for (size_t i = 0; i < n; ++i) {
    // An expired unit is a miss in every tier, SSD included (until session 37 an SSD unit's
    // expiry was checked only when it was read: a Lookup after a restart, with the units on
    // SSD, counted units whose TTL had run out and the Get that followed missed them).
    bool expired = false;
    uint64_t bytes = 0;
    Tier t = Locate(chain[i], &expired, &bytes);
    if (expired) {
      std::lock_guard lock(mu_);
      ExpireLocked(chain[i]);
      t = Tier::kNone;
    }
    if (t == Tier::kNone) {
      r.first_miss = misses_.Reason(chain[i]);
      CountMiss(r.first_miss);
      // The engine recomputes and puts the keys from here on: each is referenced now. (The
      // hits before it are read next, and those reads count them.)
      if (count_references) CountReferences(chain.subspan(i, n - i), clock_->NowUs());
      return r;
    }
    r.tiers.push_back(t);
    ++r.hit_count;
    r.hit_bytes += bytes;
  }
  return r;
}

Status TierManagerImpl::Prefetch(std::span<const Key> keys) {
  if (keys.size() > kMaxBatch) return Status::InvalidArgument("batch larger than kMaxBatch");
  const RequestTag request = BeginRequest();
  std::vector<uint8_t> buf;
  for (const Key& k : keys) {
    if (Locate(k, /*expired=*/nullptr) != Tier::kSsd) continue;  // GetImpl checks expiry
    Status st = GetImpl(k, &buf, nullptr, ReadMode::kPrefetch, request);
    (void)st;  // a miss is skipped
  }
  return Status::Ok();
}

}  // namespace kvtier::storage::internal
