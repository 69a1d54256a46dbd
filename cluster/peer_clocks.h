// PeerClocks: how far each peer's clock is from this node's (docs/CLUSTER.md, "Clocks").
//
// The cluster compares Unix times across nodes in one place: a repair copy of a unit with a
// TTL carries the moment its unit ends by the sender's clock, and the owner keeps it until
// that moment by its own (peer_wire.h, kPeerFlagExpiresAt). So a copy outlives its unit by at
// most the smaller of its transit and the two clocks' offset, and an owner whose clock runs
// ahead refuses copies of units that have not ended (kvtier_cluster_repair_expired_at_owner_total
// counts those refusals, not the offset). This measures the offset itself, as etcd's peer prober
// reports its peers' clock drift: every interval_ms a thread asks each other member of the view for
// its clock (PeerClient::Clock, CLOCK: the offset within +- half the round trip) and keeps the last
// answer per member.
//
// A member that left the view is forgotten; one whose last answer is older than
// kStaleIntervals intervals (it stopped answering) is not reported. A member older than CLOCK
// (it answers InvalidArgument) is asked again only after kUnsupportedRetryMs, so that its
// count of bad frames rises slowly while a rolling upgrade reaches it. At most peers_max
// members are asked per round (the first in node_id order).
//
// Thread safety: SampleRound, Readings and stats from any thread (rounds do not overlap:
// one at a time); Start/Stop from one thread. Stop waits for the call in flight (at most the
// peer timeout) and asks no further member.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cluster/peer_client.h"
#include "common/clock.h"
#include "common/status.h"

namespace kvtier::cluster {

struct PeerClockOptions {
  uint64_t interval_ms = 10000;  // between rounds; 0: no thread (Start does nothing)
  uint32_t peers_max = 256;      // members asked per round
};

// A member's last answer.
struct PeerClockReading {
  std::string node_id;
  int64_t offset_us = 0;  // its clock minus ours (positive: it runs ahead)
  uint64_t rtt_us = 0;    // the exchange's round trip: offset_us is within +- rtt_us / 2
  uint64_t age_ms = 0;    // since that answer
};

struct PeerClockStats {
  uint64_t samples = 0;      // answers
  uint64_t failures = 0;     // no answer (timeout, refused, suspect peer, malformed reply)
  uint64_t unsupported = 0;  // answered InvalidArgument: a node older than CLOCK
};

class PeerClocks {
 public:
  // Readings older than this many intervals are not reported.
  static constexpr uint64_t kStaleIntervals = 3;
  // A member older than CLOCK is asked again after this long (10 minutes).
  static constexpr uint64_t kUnsupportedRetryMs = 600000;

  struct Peer {
    std::string node_id, endpoint;
  };
  // The members to ask: the view's, this node excluded.
  using MembersFn = std::function<std::vector<Peer>()>;
  using SampleFn = std::function<StatusOr<PeerClient::ClockSample>(const std::string& endpoint)>;

  // steady: for ages and retries (null: the process's steady clock).
  PeerClocks(PeerClockOptions options, MembersFn members, SampleFn sample,
             const Clock* steady = nullptr);
  ~PeerClocks();  // Stop()
  PeerClocks(const PeerClocks&) = delete;
  PeerClocks& operator=(const PeerClocks&) = delete;

  // A round now, then one every interval_ms until Stop.
  void Start();
  void Stop();
  // Asks every member once (the thread's round; tests call it directly).
  void SampleRound();
  // At most max readings, in node_id order, stale ones left out.
  std::vector<PeerClockReading> Readings(size_t max) const;
  PeerClockStats stats() const;

 private:
  struct Entry {
    bool answered = false;
    int64_t offset_us = 0;
    uint64_t rtt_us = 0;
    uint64_t answered_ms = 0;     // steady
    uint64_t unsupported_ms = 0;  // steady, when it answered InvalidArgument (0: never)
  };
  void Run();

  const PeerClockOptions options_;
  const MembersFn members_;
  const SampleFn sample_;
  const Clock& steady_;
  std::mutex round_mu_;  // one round at a time
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Entry> entries_;  // by node_id; guarded by mu_
  PeerClockStats stats_;                  // guarded by mu_
  bool stop_ = false;                     // guarded by mu_
  std::thread thread_;
};

}  // namespace kvtier::cluster
