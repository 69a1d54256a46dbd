#include "cluster/staging_ring.h"

#include <openssl/rand.h>

#include <cstdlib>
#include <cstring>

#include "common/checksum.h"

namespace kvtier::cluster {
namespace {

void PutU64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void PutU32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint64_t GetU64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
uint32_t GetU32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

uint64_t RoundUp(uint64_t n) {
  return (n + kStagingAlignBytes - 1) / kStagingAlignBytes * kStagingAlignBytes;
}

}  // namespace

StatusOr<std::unique_ptr<StagingRing>> StagingRing::Create(uint64_t ring_bytes) {
  if (ring_bytes < kStagingRingBytesMin || ring_bytes > kStagingRingBytesMax ||
      ring_bytes % 4096 != 0) {
    return Status::InvalidArgument("staging ring: ring_bytes must be a multiple of 4096 in " +
                                   std::to_string(kStagingRingBytesMin) + ".." +
                                   std::to_string(kStagingRingBytesMax));
  }
  auto* raw = static_cast<uint8_t*>(std::aligned_alloc(4096, ring_bytes));
  if (raw == nullptr) return Status::Rejected("staging ring: out of memory");
  std::memset(raw, 0, ring_bytes);
  std::shared_ptr<uint8_t> memory(raw, [](uint8_t* p) { std::free(p); });
  // A random first generation: a reader that kept (offset, generation) across an owner
  // restart does not meet the same generation again (its grant is gone anyway).
  uint64_t first = 0;
  if (RAND_bytes(reinterpret_cast<uint8_t*>(&first), sizeof(first)) != 1) {
    return Status::Internal("staging ring: no random first generation (RAND_bytes failed)");
  }
  first = (first >> 16) | 1;
  return std::unique_ptr<StagingRing>(new StagingRing(std::move(memory), ring_bytes, first));
}

StagingRing::StagingRing(std::shared_ptr<uint8_t> memory, uint64_t ring_bytes,
                         uint64_t first_generation)
    : memory_(std::move(memory)), ring_bytes_(ring_bytes), next_generation_(first_generation) {}

StatusOr<StagedUnit> StagingRing::Stage(std::span<const uint8_t> value) {
  const uint64_t record_bytes = uint64_t{kStagedRecordHeaderBytes} + value.size();
  if (record_bytes > ring_bytes_ || value.size() > UINT32_MAX - kStagedRecordHeaderBytes) {
    too_large_.fetch_add(1);
    return Status::Rejected("unit larger than cluster.peer_staging_ring_bytes");
  }
  StagedUnit unit;
  unit.length_bytes = static_cast<uint32_t>(record_bytes);
  unit.checksum = Xxh3_64(value);
  std::lock_guard lock(mu_);
  if (ring_bytes_ - next_offset_ < record_bytes) {
    next_offset_ = 0;
    wraps_.fetch_add(1);
  }
  unit.offset_bytes = next_offset_;
  unit.generation = next_generation_++;
  if (next_generation_ == 0) next_generation_ = 1;
  uint8_t* p = memory_.get() + unit.offset_bytes;
  // Generation first, value, then the rest of the header: a reader that sees the new
  // generation is already rejected, whatever the order its read observes the other bytes in.
  PutU64(p, unit.generation);
  std::memcpy(p + kStagedRecordHeaderBytes, value.data(), value.size());
  PutU64(p + 8, unit.checksum);
  PutU32(p + 16, static_cast<uint32_t>(value.size()));
  PutU32(p + 20, 0);
  PutU64(p + 24, 0);
  next_offset_ = std::min(ring_bytes_, unit.offset_bytes + RoundUp(record_bytes));
  records_.fetch_add(1);
  bytes_.fetch_add(value.size());
  return unit;
}

StatusOr<std::span<const uint8_t>> StagingRing::Verify(std::span<const uint8_t> record,
                                                       const StagedUnit& unit) {
  if (record.size() != unit.length_bytes || record.size() < kStagedRecordHeaderBytes) {
    return Status::InvalidArgument("staged record: read length differs from the reply");
  }
  const uint8_t* p = record.data();
  const std::span<const uint8_t> value = record.subspan(kStagedRecordHeaderBytes);
  if (GetU64(p) != unit.generation || GetU64(p + 8) != unit.checksum ||
      GetU32(p + 16) != value.size()) {
    return Status::Retry("staging slot reused before the read (generation or length differs)");
  }
  if (Xxh3_64(value) != unit.checksum) {
    return Status::Retry("staging slot reused during the read (checksum differs)");
  }
  return value;
}

StagingRingCounters StagingRing::counters() const {
  return {records_.load(), bytes_.load(), wraps_.load(), too_large_.load()};
}

void StagingRing::WithWriteLock(const std::function<void()>& f) {
  std::lock_guard lock(mu_);
  f();
}

void StagingRing::TEST_Clobber(uint64_t offset) {
  std::lock_guard lock(mu_);
  if (offset + 8 <= ring_bytes_) PutU64(memory_.get() + offset, GetU64(memory_.get() + offset) + 1);
}

}  // namespace kvtier::cluster
