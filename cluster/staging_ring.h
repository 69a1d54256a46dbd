// StagingRing: the memory an owner exports to its peers for one-sided reads of units
// (docs/CLUSTER.md, "Bulk data over the region transport"), and the check a reader makes of
// what it read.
//
// The ring is ring_bytes of memory cut into records, written one after another and wrapping
// to offset 0 when a record does not fit before the end; a new record overwrites whatever
// older records lay there. Nothing is ever freed or leased: a record is valid until the ring
// comes round to it. A record (all integers little-endian, 64-byte aligned):
//
//   u64 generation   unique per Stage() of this ring (never 0)
//   u64 checksum     xxh3-64 of the value
//   u32 value_bytes
//   u32 zero, u64 zero
//   value_bytes      the value
//
// Stage() answers (offset, length, generation, checksum); the reader reads `length` bytes at
// `offset` (with rdma::Transport: RDMA READ or TCP) and calls Verify(), which accepts the
// bytes only when the header names that generation and length and the value's xxh3-64 is the
// checksum. RDMA reads are not synchronized with Stage() (a NIC reads without the owner's
// knowledge; TCP reads copy under WithWriteLock), so a record overwritten before or during
// the read is what Verify() exists to reject: a wholly overwritten record has another generation
// (always detected); a read torn across an overwrite is detected by the checksum (a torn read
// passes only if its bytes hash to the old checksum: about 2^-64 for xxh3-64).
//
// Thread safety: Stage() and counters() may be called concurrently (Stage() is serialized
// internally). Verify() is a pure function.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>

#include "cluster/peer_wire.h"
#include "common/status.h"

namespace kvtier::cluster {

inline constexpr uint32_t kStagingAlignBytes = 64;
inline constexpr uint64_t kStagingRingBytesMin = 64 << 10;
inline constexpr uint64_t kStagingRingBytesMax = 1ull << 36;

struct StagingRingCounters {
  uint64_t records = 0;  // Stage() calls that wrote a record
  uint64_t bytes = 0;    // value bytes staged
  uint64_t wraps = 0;    // times the write position went back to offset 0
  uint64_t too_large = 0;
};

class StagingRing {
 public:
  // ring_bytes: kStagingRingBytesMin..kStagingRingBytesMax, a multiple of 4096
  // (InvalidArgument otherwise). The memory is page-aligned (a verbs registration covers
  // exactly it) and zeroed. Internal when no random first generation can be drawn.
  static StatusOr<std::unique_ptr<StagingRing>> Create(uint64_t ring_bytes);

  // Copies `value` into the next record. Rejected when the record (header + value) is larger
  // than the ring.
  StatusOr<StagedUnit> Stage(std::span<const uint8_t> value);

  // The ring's bytes (what the region server exports) and a handle that keeps them alive.
  std::span<const uint8_t> memory() const { return {memory_.get(), ring_bytes_}; }
  std::shared_ptr<const void> owner() const { return memory_; }
  StagingRingCounters counters() const;

  // The value inside `record` (the bytes read at unit.offset_bytes, unit.length_bytes long)
  // when it is the record `unit` names; Retry("staging slot reused ...") when the header
  // names another generation or length or the value does not hash to unit.checksum;
  // InvalidArgument when record is not unit.length_bytes long.
  static StatusOr<std::span<const uint8_t>> Verify(std::span<const uint8_t> record,
                                                   const StagedUnit& unit);

  // Runs f under the lock Stage() writes under: the TCP region server copies records inside
  // it, so its reads never race a write (rdma::RowServer::RegisterMemory's guard).
  void WithWriteLock(const std::function<void()>& f);

  // Test hook: overwrites the generation of the record at `offset` (as a reuse would).
  void TEST_Clobber(uint64_t offset);

 private:
  StagingRing(std::shared_ptr<uint8_t> memory, uint64_t ring_bytes, uint64_t first_generation);

  const std::shared_ptr<uint8_t> memory_;
  const uint64_t ring_bytes_;
  std::mutex mu_;
  uint64_t next_offset_ = 0;      // guarded by mu_
  uint64_t next_generation_ = 0;  // guarded by mu_
  std::atomic<uint64_t> records_{0}, bytes_{0}, wraps_{0}, too_large_{0};
};

}  // namespace kvtier::cluster
