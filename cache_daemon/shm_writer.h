// Writes a native GET's values into the connection's shared-memory file (the memfd behind the
// region) with few system calls: each value is staged in a per-thread buffer and the staged
// values are written with one pwrite per kShmStageBytesMax (a 16K-token resume's 256 units:
// one pwrite), instead of one pwrite per value. The kernel copies through its own mapping of
// the region's pages, so the daemon's mapping of the region is never touched by a GET (in a
// virtual machine with shadow page tables each first touch of a 4 KiB page costs ~10 us;
// docs/performance/resume.md, "Resume fetch: per-unit CPU" and "one write per GET").
//
//   ShmValueWriter w(fd, dst_offset, dst_capacity);
//   std::optional<ShmValueWriter::Slot> s = w.Add(value);  // nullopt: no room left (retry)
//   ...
//   w.Flush();
//   if (!w.Written(s->index)) ...  // the kernel refused the write: answer retry
//
// Values are placed back to back from dst_offset in Add order. A value larger than the stage
// is written directly, without the stage copy. A write the kernel refuses (no memory for the
// region's pages) loses every value of that write: Written is false for each of them, and
// failed_writes() counts the refused writes. The caller has checked that [dst_offset,
// dst_offset + dst_capacity) lies in the region (the file is sealed at the region's size).
//
// Thread safety: an object is used by one thread. The stage is the calling thread's (cached
// per thread up to kShmStageBytesMax, reused by its next GET); a writer holds it from its
// first Add to its Flush or destruction.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

namespace kvtier::daemon::internal {

// The largest stage a thread keeps; values are written at least once per this many bytes.
inline constexpr uint64_t kShmStageBytesMax = 4ull << 20;

// Populates one stage now for the first GET of a thread that has none (kvtierd calls it at
// startup), so that the first GET after a restart copies into pages the kernel has already
// zeroed instead of a fresh huge page (9% of kvtierd's CPU in that GET). Idempotent.
void WarmShmStage();

// pwrite of every byte of v at `offset` of fd (retrying EINTR and short writes). False when
// the kernel refused it.
bool PwriteAll(int fd, std::span<const uint8_t> v, uint64_t offset);

class ShmValueWriter {
 public:
  // How a write reaches the file: PwriteAll, or a test's stand-in.
  using WriteFn = std::function<bool(int fd, std::span<const uint8_t> v, uint64_t offset)>;
  struct Slot {
    size_t index = 0;     // Add order: pass to Written
    uint64_t offset = 0;  // where the value lies in the region
  };

  ShmValueWriter(int fd, uint64_t dst_offset, uint64_t dst_capacity, WriteFn write = PwriteAll);
  ~ShmValueWriter();  // gives the stage back; values not flushed are not written
  ShmValueWriter(const ShmValueWriter&) = delete;
  ShmValueWriter& operator=(const ShmValueWriter&) = delete;

  // Places v after the values added before (copying it into the stage, or writing it now
  // when it is larger than the stage). nullopt when it does not fit in what is left of the
  // destination area: nothing is placed.
  std::optional<Slot> Add(std::span<const uint8_t> v);
  // Writes what is staged. Written() is final for every value added before it.
  void Flush();
  // Whether value `index` (Slot::index) reached the file; false for values not flushed yet.
  bool Written(size_t index) const;
  uint64_t failed_writes() const { return failed_writes_; }

  struct Stage;

 private:
  bool WriteStaged();

  int fd_;
  uint64_t dst_offset_, dst_capacity_;
  WriteFn write_;
  uint64_t cursor_ = 0;  // bytes placed from dst_offset_
  std::unique_ptr<Stage> stage_;
  uint64_t staged_bytes_ = 0;     // bytes in the stage
  uint64_t staged_offset_ = 0;    // region offset of the stage's first byte
  size_t staged_first_ = 0;       // index of the stage's first value; written_.size(): none
  std::vector<uint8_t> written_;  // per value: 1 written, 0 not (yet)
  uint64_t failed_writes_ = 0;
};

}  // namespace kvtier::daemon::internal
