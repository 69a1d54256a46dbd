#include "cluster/peer_health.h"

#include <algorithm>
#include <chrono>

#include "common/clock.h"

namespace kvtier::cluster {
namespace {

uint64_t NowMs() { return DefaultSteadyClock().NowMs(); }

}  // namespace

PeerHealth::PeerHealth(PeerHealthOptions options, Probe probe)
    : options_(options), probe_(std::move(probe)) {}

PeerHealth::~PeerHealth() {
  std::vector<Prober> probers;
  {
    std::lock_guard lock(mu_);
    stop_ = true;
    probers.swap(probers_);
  }
  cv_.notify_all();
  for (Prober& p : probers) p.thread.join();
}

bool PeerHealth::Admit(const std::string& endpoint, uint64_t* suspect_for_ms) {
  if (suspect_count_.load(std::memory_order_acquire) == 0) return true;
  std::lock_guard lock(mu_);
  auto it = suspects_.find(endpoint);
  if (it == suspects_.end()) return true;
  const uint64_t now = NowMs();
  it->second.asked_ms = now;
  if (suspect_for_ms != nullptr) *suspect_for_ms = now - it->second.since_ms;
  failed_fast_.fetch_add(1, std::memory_order_relaxed);
  return false;
}

void PeerHealth::TimedOut(const std::string& endpoint) {
  if (!enabled()) return;
  std::lock_guard lock(mu_);
  if (stop_ || suspects_.contains(endpoint)) return;
  ReapLocked();
  if (suspects_.size() >= options_.endpoints_max) {
    not_suspected_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  const uint64_t now = NowMs();
  const uint64_t generation = next_generation_++;
  suspects_.emplace(endpoint, Suspect{.since_ms = now, .asked_ms = now, .generation = generation});
  suspect_count_.store(suspects_.size(), std::memory_order_release);
  suspicions_.fetch_add(1, std::memory_order_relaxed);
  auto done = std::make_shared<std::atomic<bool>>(false);
  probers_.push_back(Prober{.thread = std::thread([this, endpoint, generation, done] {
                              ProbeLoop(endpoint, generation);
                              done->store(true, std::memory_order_release);
                            }),
                            .done = done});
}

void PeerHealth::Answered(const std::string& endpoint) {
  if (suspect_count_.load(std::memory_order_acquire) == 0) return;
  std::lock_guard lock(mu_);
  if (suspects_.erase(endpoint) == 0) return;
  suspect_count_.store(suspects_.size(), std::memory_order_release);
  recoveries_.fetch_add(1, std::memory_order_relaxed);
  cv_.notify_all();  // its prober ends
}

bool PeerHealth::CurrentLocked(const std::string& endpoint, uint64_t generation) const {
  auto it = suspects_.find(endpoint);
  return it != suspects_.end() && it->second.generation == generation;
}

void PeerHealth::ReapLocked() {
  std::erase_if(probers_, [](Prober& p) {
    if (!p.done->load(std::memory_order_acquire)) return false;
    p.thread.join();  // past its last step: returns at once
    return true;
  });
}

void PeerHealth::ProbeLoop(const std::string& endpoint, uint64_t generation) {
  std::unique_lock lock(mu_);
  for (;;) {
    if (stop_ || !CurrentLocked(endpoint, generation)) return;
    if (NowMs() - suspects_.at(endpoint).asked_ms >= options_.forget_after_ms) {
      suspects_.erase(endpoint);
      suspect_count_.store(suspects_.size(), std::memory_order_release);
      forgotten_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    lock.unlock();
    probes_.fetch_add(1, std::memory_order_relaxed);
    const bool answered = probe_(endpoint);
    lock.lock();
    if (answered) {
      if (stop_ || !CurrentLocked(endpoint, generation)) return;
      suspects_.erase(endpoint);
      suspect_count_.store(suspects_.size(), std::memory_order_release);
      recoveries_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    probes_failed_.fetch_add(1, std::memory_order_relaxed);
    cv_.wait_for(lock, std::chrono::milliseconds(options_.probe_interval_ms),
                 [&] { return stop_ || !CurrentLocked(endpoint, generation); });
  }
}

std::vector<std::pair<std::string, uint64_t>> PeerHealth::Suspects(size_t max_endpoints) const {
  std::vector<std::pair<std::string, uint64_t>> out;
  if (suspect_count_.load(std::memory_order_acquire) == 0) return out;
  const uint64_t now = NowMs();
  {
    std::lock_guard lock(mu_);
    for (const auto& [endpoint, s] : suspects_) out.emplace_back(endpoint, now - s.since_ms);
  }
  std::sort(out.begin(), out.end());
  if (out.size() > max_endpoints) out.resize(max_endpoints);
  return out;
}

PeerHealthStats PeerHealth::stats() const {
  return PeerHealthStats{.suspects = suspect_count_.load(std::memory_order_relaxed),
                         .suspicions = suspicions_.load(std::memory_order_relaxed),
                         .failed_fast = failed_fast_.load(std::memory_order_relaxed),
                         .probes = probes_.load(std::memory_order_relaxed),
                         .probes_failed = probes_failed_.load(std::memory_order_relaxed),
                         .recoveries = recoveries_.load(std::memory_order_relaxed),
                         .forgotten = forgotten_.load(std::memory_order_relaxed),
                         .not_suspected = not_suspected_.load(std::memory_order_relaxed)};
}

}  // namespace kvtier::cluster
