// Large reply buffers kept for the next reply (limits.reply_buffers_kept_bytes_max).
//
// A native GET without shared memory (a remote server's restore over TCP or TLS) builds its
// reply in one buffer: every value copied in after the status, a megabyte or more for a batch
// of units. With glibc's sliding thresholds such a buffer is carved from a heap whose top is
// given back to the kernel once more than twice the largest freed block lies free there, so
// each reply faulted its pages in again: a 64K-token conversation's restore cost kvtierd about
// 30-40 ms of CPU per restore over TCP against a few over the Unix socket (docs/performance/
// serving.md, "kvtierd's reply buffers"). ReplyBuffers keeps the buffers of finished replies
// (their pages stay resident) and hands them to the next replies to build.
//
//   std::vector<uint8_t> buf = buffers.Take();   // empty, with a kept buffer's capacity
//   ... build the reply in buf, write it ...
//   buffers.Give(std::move(buf));                 // kept, or freed
//
// A cluster node also reads its peers' GET replies into kept buffers (TakeToOverwrite).
//
// What it keeps is bounded by its limit (counted by capacity) and is memory outside
// limits.connection_memory_bytes_max: the daemon's resident memory may exceed the DRAM tier
// and the connection buffers by this much. Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

namespace kvtier::daemon::internal {

class ReplyBuffers {
 public:
  // Buffers below this capacity are not kept: malloc reuses small blocks by itself.
  static constexpr size_t kMinKeptBytes = size_t{256} << 10;
  // Buffers kept at most, whatever their sizes (so Take's scan stays short).
  static constexpr size_t kMaxKeptBuffers = 64;

  // limit_bytes 0 keeps nothing.
  explicit ReplyBuffers(uint64_t limit_bytes) : limit_bytes_(limit_bytes) {}
  ReplyBuffers(const ReplyBuffers&) = delete;
  ReplyBuffers& operator=(const ReplyBuffers&) = delete;

  // An empty buffer: the kept one of the largest capacity (no longer kept), or a new one with
  // no capacity when none is kept.
  std::vector<uint8_t> Take();
  // Take's buffer with the size and bytes its last user left in it, for a reader that
  // overwrites it whole: resizing it to a reply's size then zero-fills only what lies beyond
  // that size, where Take's empty buffer would be zero-filled whole (a memset of each reply).
  std::vector<uint8_t> TakeToOverwrite();
  // Keeps `buffer` for a later Take when its capacity is at least kMinKeptBytes and fits
  // within the limit beside those kept; frees it otherwise.
  void Give(std::vector<uint8_t> buffer);
  // A built reply, ready to queue: when its buffer holds more than twice it (a small reply
  // built in a large kept buffer), a copy of exactly its size, the buffer given back;
  // otherwise the reply itself (at most what a vector grown by doubling holds). Connections
  // count a queued reply by its size (limits.connection_memory_bytes_max), so a client that
  // reads nothing must not hold a kept buffer's whole capacity behind a small reply.
  std::vector<uint8_t> Fit(std::vector<uint8_t> reply);

  uint64_t kept_bytes() const;
  size_t kept_buffers() const;

 private:
  const uint64_t limit_bytes_;
  mutable std::mutex mu_;
  std::vector<std::vector<uint8_t>> kept_;  // by mu_
  uint64_t kept_bytes_ = 0;                 // by mu_: the sum of kept_'s capacities
};

}  // namespace kvtier::daemon::internal
