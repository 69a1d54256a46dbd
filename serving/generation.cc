#include "serving/generation.h"

#include <chrono>
#include <utility>

namespace kvtier::serving {

bool Generation::Next(GenerationEvent* event, int timeout_ms) {
  std::unique_lock l(mu_);
  if (!cv_.wait_for(l, std::chrono::milliseconds(timeout_ms), [&] { return !events_.empty(); }))
    return false;
  *event = std::move(events_.front());
  events_.pop_front();
  return true;
}

void Generation::Push(GenerationEvent event) {
  {
    std::lock_guard l(mu_);
    events_.push_back(std::move(event));
  }
  cv_.notify_all();
}

}  // namespace kvtier::serving
