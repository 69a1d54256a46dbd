// The client's shared-memory region (client_impl.h): the first-fit allocator over it, and the
// per-thread buffers GET values are copied out of it into (ValuesBuffer, CopyOutValues).
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <iterator>
#include <mutex>
#include <utility>

#include "cache_daemon/client_impl.h"

namespace kvtier::daemon::client_internal {

void ShmAllocator::Reset(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  free_.clear();
  if (bytes > 0) free_[0] = bytes;
}

std::optional<uint64_t> ShmAllocator::Alloc(uint64_t bytes) {
  bytes = (bytes + kShmAlignBytes - 1) & ~(kShmAlignBytes - 1);
  if (bytes == 0) bytes = kShmAlignBytes;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < bytes) continue;
    uint64_t off = it->first, size = it->second;
    free_.erase(it);
    if (size > bytes) free_[off + bytes] = size - bytes;
    return off;
  }
  return std::nullopt;
}

void ShmAllocator::Free(uint64_t off, uint64_t bytes) {
  bytes = (bytes + kShmAlignBytes - 1) & ~(kShmAlignBytes - 1);
  if (bytes == 0) bytes = kShmAlignBytes;
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, inserted] = free_.emplace(off, bytes);
  (void)inserted;
  auto next = std::next(it);
  if (next != free_.end() && it->first + it->second == next->first) {
    it->second += next->second;
    free_.erase(next);
  }
  if (it != free_.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second == it->first) {
      prev->second += it->second;
      free_.erase(it);
    }
  }
}

namespace {

thread_local ValuesBuffer t_values;

}  // namespace

ValuesBuffer TakeValuesBuffer(uint64_t bytes) {
  if (t_values.bytes >= bytes) return std::exchange(t_values, ValuesBuffer{});
  ValuesBuffer b;
  b.bytes =
      (std::max(bytes, t_values.bytes * 2) + kValuesGrainBytes - 1) & ~(kValuesGrainBytes - 1);
  b.data.reset(static_cast<uint8_t*>(std::aligned_alloc(kValuesGrainBytes, b.bytes)));
  if (b.data == nullptr) return {};
  (void)::madvise(b.data.get(), b.bytes, MADV_HUGEPAGE);  // advisory: ignored where THP is off
  return b;
}

void ReturnValuesBuffer(ValuesBuffer b) {
  if (b.data != nullptr && b.bytes <= kValuesCachedBytesMax && b.bytes > t_values.bytes) {
    t_values = std::move(b);
  }
}

bool ClientImpl::CopyOutValues(const std::vector<wire::GetEntry>& entries, const ShmLease& lease,
                               ValuesBuffer* out) {
  uint64_t end = lease.offset;
  for (const wire::GetEntry& e : entries) {
    if (e.code != StatusCode::kOk ||
        !InsideArea(e.value_offset, e.value_bytes, lease.offset, lease.bytes)) {
      continue;  // GetChunk fails the call on it
    }
    end = std::max(end, e.value_offset + e.value_bytes);
  }
  const uint64_t bytes = end - lease.offset;
  if (bytes == 0 || bytes > kValuesCachedBytesMax || shm_fd_ < 0) return false;
  *out = TakeValuesBuffer(bytes);
  if (out->data == nullptr) return false;
  uint64_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(shm_fd_, out->data.get() + done, bytes - done,
                              static_cast<off_t>(lease.offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ReturnValuesBuffer(std::exchange(*out, ValuesBuffer{}));
      return false;
    }
    done += static_cast<uint64_t>(n);
  }
  return true;
}

}  // namespace kvtier::daemon::client_internal
