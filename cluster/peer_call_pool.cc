#include "cluster/peer_call_pool.h"

#include <algorithm>

namespace kvtier::cluster {

PeerCallPool::PeerCallPool(PeerCallPoolOptions options) : options_(options) {
  uint32_t n = std::clamp<uint32_t>(options_.threads, 1, 1024);
  limit_ = uint64_t{n} + options_.queue_max;
  threads_.reserve(n);
  for (uint32_t i = 0; i < n; ++i) threads_.emplace_back([this] { Run(); });
}

PeerCallPool::~PeerCallPool() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

bool PeerCallPool::TrySubmit(std::function<void()> task) {
  {
    std::lock_guard lock(mu_);
    if (stop_ || unfinished_ >= limit_) {
      ++refused_;
      return false;
    }
    ++unfinished_;
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
  return true;
}

uint64_t PeerCallPool::refused() const {
  std::lock_guard lock(mu_);
  return refused_;
}

uint64_t PeerCallPool::queued() const {
  std::lock_guard lock(mu_);
  return queue_.size();
}

void PeerCallPool::Run() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and every queued task has run
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
    std::lock_guard lock(mu_);
    --unfinished_;
  }
}

}  // namespace kvtier::cluster
