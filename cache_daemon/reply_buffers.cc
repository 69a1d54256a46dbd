#include "cache_daemon/reply_buffers.h"

#include <algorithm>
#include <utility>

namespace kvtier::daemon::internal {

std::vector<uint8_t> ReplyBuffers::Take() {
  std::vector<uint8_t> out = TakeToOverwrite();
  out.clear();
  return out;
}

std::vector<uint8_t> ReplyBuffers::TakeToOverwrite() {
  std::lock_guard<std::mutex> lock(mu_);
  if (kept_.empty()) return {};
  auto largest = std::max_element(kept_.begin(), kept_.end(), [](const auto& a, const auto& b) {
    return a.capacity() < b.capacity();
  });
  std::vector<uint8_t> out = std::move(*largest);
  *largest = std::move(kept_.back());
  kept_.pop_back();
  kept_bytes_ -= out.capacity();
  return out;
}

void ReplyBuffers::Give(std::vector<uint8_t> buffer) {
  const size_t capacity = buffer.capacity();
  if (capacity < kMinKeptBytes) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (kept_.size() >= kMaxKeptBuffers || kept_bytes_ + capacity > limit_bytes_) return;
  kept_bytes_ += capacity;
  kept_.push_back(std::move(buffer));
}

std::vector<uint8_t> ReplyBuffers::Fit(std::vector<uint8_t> reply) {
  if (reply.capacity() <= 2 * reply.size()) return reply;
  std::vector<uint8_t> exact(reply.begin(), reply.end());
  Give(std::move(reply));
  return exact;
}

uint64_t ReplyBuffers::kept_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return kept_bytes_;
}

size_t ReplyBuffers::kept_buffers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return kept_.size();
}

}  // namespace kvtier::daemon::internal
