#include "cluster/peer_clocks.h"

#include <algorithm>
#include <set>
#include <utility>

namespace kvtier::cluster {

PeerClocks::PeerClocks(PeerClockOptions options, MembersFn members, SampleFn sample,
                       const Clock* steady)
    : options_(options),
      members_(std::move(members)),
      sample_(std::move(sample)),
      steady_(steady != nullptr ? *steady : DefaultSteadyClock()) {}

PeerClocks::~PeerClocks() { Stop(); }

void PeerClocks::Start() {
  if (options_.interval_ms == 0 || thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = false;
  }
  thread_ = std::thread([this] { Run(); });
}

void PeerClocks::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void PeerClocks::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    lock.unlock();
    SampleRound();
    lock.lock();
    cv_.wait_for(lock, std::chrono::milliseconds(options_.interval_ms), [&] { return stop_; });
  }
}

void PeerClocks::SampleRound() {
  std::lock_guard<std::mutex> round(round_mu_);
  std::vector<Peer> peers = members_();
  std::sort(peers.begin(), peers.end(),
            [](const Peer& a, const Peer& b) { return a.node_id < b.node_id; });
  if (peers.size() > options_.peers_max) peers.resize(options_.peers_max);
  std::vector<Peer> ask;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::set<std::string> current;
    for (const Peer& p : peers) current.insert(p.node_id);
    std::erase_if(entries_, [&](const auto& e) { return !current.contains(e.first); });
    const uint64_t now_ms = steady_.NowMs();
    for (const Peer& p : peers) {
      const auto it = entries_.find(p.node_id);
      if (it != entries_.end() && it->second.unsupported_ms != 0 &&
          now_ms - it->second.unsupported_ms < kUnsupportedRetryMs)
        continue;
      ask.push_back(p);
    }
  }
  // Asked without the lock: a call waits at most the peer timeout, and Readings must not.
  for (const Peer& p : ask) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
    }
    auto sample = sample_(p.endpoint);
    std::lock_guard<std::mutex> lock(mu_);
    Entry& e = entries_[p.node_id];
    if (sample.ok()) {
      e.answered = true;
      e.offset_us = sample->offset_us;
      e.rtt_us = sample->rtt_us;
      e.answered_ms = steady_.NowMs();
      e.unsupported_ms = 0;
      ++stats_.samples;
    } else if (sample.status().IsInvalidArgument()) {
      e.answered = false;
      e.unsupported_ms = std::max<uint64_t>(steady_.NowMs(), 1);
      ++stats_.unsupported;
    } else {
      ++stats_.failures;
    }
  }
}

std::vector<PeerClockReading> PeerClocks::Readings(size_t max) const {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t now_ms = steady_.NowMs();
  const uint64_t stale_ms = kStaleIntervals * std::max<uint64_t>(options_.interval_ms, 1);
  std::vector<PeerClockReading> out;
  for (const auto& [node_id, e] : entries_) {
    if (out.size() >= max) break;
    if (!e.answered) continue;
    const uint64_t age_ms = now_ms - e.answered_ms;
    if (age_ms > stale_ms) continue;
    out.push_back(PeerClockReading{node_id, e.offset_us, e.rtt_us, age_ms});
  }
  return out;
}

PeerClockStats PeerClocks::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace kvtier::cluster
