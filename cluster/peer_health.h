// PeerHealth: which peer endpoints stopped answering, so that calls to them fail at once
// instead of each waiting out its deadline.
//
// A peer that is stopped (SIGSTOP, a hung host, a partition that drops packets) stays in
// every view until its etcd lease runs out (lease_ttl_s). Without this, every call to it
// waits peer_timeout_ms meanwhile: each PUT that names it as an owner or a copy keeper, each
// DELETE (they reach every member), each GET whose first owner it is. With this, the first
// call that times out marks the endpoint suspect; until a probe gets an answer, every call to
// it fails at once with Unavailable, which each caller already handles as it handles a
// timeout (the next owner, a tombstone, a missing acknowledgement: docs/CLUSTER.md, "Failure
// model"). This is gRPC's fail-fast in TRANSIENT_FAILURE: the channel reconnects in the
// background and calls do not wait for it.
//
// Probes: one thread per suspect endpoint calls probe(endpoint) at once, then again
// probe_interval_ms after each probe that got no answer (PeerClient's probe opens and
// authenticates a connection, which needs the peer process to run, and keeps it for the next
// call). A probe, or a call already in flight, that got an answer clears the suspicion: a
// peer that was merely slow (its handshake still answered at once) is suspect for one probe;
// a stopped one, until it runs again. A suspect endpoint no call asked for in forget_after_ms (it
// left the views) is forgotten and its thread ends: the next call to it is made, and may time
// out again. At most endpoints_max endpoints are suspect at once; past that a timed-out
// endpoint is not suspected (its calls wait, as without this).
//
// Only a timeout raises suspicion: a refused connection or a reset fails at once anyway, and
// a peer's own error status is an answer.
//
// The cost: until a probe reaches a peer that runs again, its calls still fail, and what a
// failed call leaves (a PUT's copy keeper told by tombstone instead of DROP_COPIES) lasts
// until that peer's next catch-up; a peer continued after a stop holds its reads until then
// (cluster/pause_guard.h: its hold is at least one probe interval). kvtierd's [cluster]
// peer_probe_interval_ms (500 ms by default; 0: off).
//
// Thread safety: every method may be called concurrently. The destructor stops and joins the
// probe threads (a probe in flight runs to its deadline).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvtier::cluster {

struct PeerHealthOptions {
  // After a probe that got no answer, the wait before the next; 0: suspect nothing (every
  // call waits its own deadline).
  uint64_t probe_interval_ms = 500;
  // A suspect endpoint that no call asked for this long is forgotten.
  uint64_t forget_after_ms = 30000;
  uint32_t endpoints_max = 1024;
};

struct PeerHealthStats {
  uint64_t suspects = 0;       // gauge: endpoints suspect now
  uint64_t suspicions = 0;     // counters: endpoints marked suspect after a timeout,
  uint64_t failed_fast = 0;    //   calls failed at once because their endpoint was suspect,
  uint64_t probes = 0;         //   probes made,
  uint64_t probes_failed = 0;  //   of those, unanswered,
  uint64_t recoveries = 0;     //   suspicions cleared by an answer,
  uint64_t forgotten = 0;      //   suspicions dropped because nobody asked,
  uint64_t not_suspected = 0;  //   timeouts not suspected (endpoints_max reached)
};

class PeerHealth {
 public:
  // True when the endpoint answered: connected and authenticated, or any reply before the
  // probe's deadline (a peer that refuses is running). Called on a probe thread.
  using Probe = std::function<bool(const std::string& endpoint)>;

  PeerHealth(PeerHealthOptions options, Probe probe);
  ~PeerHealth();
  PeerHealth(const PeerHealth&) = delete;
  PeerHealth& operator=(const PeerHealth&) = delete;

  // Before a call: false when the endpoint is suspect and the call must fail at once
  // (counted); *suspect_for_ms (may be null) is then how long ago its call timed out.
  bool Admit(const std::string& endpoint, uint64_t* suspect_for_ms = nullptr);
  // After a call: it timed out (no answer by its deadline), or it got an answer.
  void TimedOut(const std::string& endpoint);
  void Answered(const std::string& endpoint);

  bool enabled() const { return options_.probe_interval_ms > 0; }
  PeerHealthStats stats() const;
  // The endpoints suspect now, in endpoint order, with how long ago each call timed out (ms);
  // at most max_endpoints of them.
  std::vector<std::pair<std::string, uint64_t>> Suspects(size_t max_endpoints) const;

 private:
  struct Suspect {
    uint64_t since_ms = 0;    // when the call that raised it timed out
    uint64_t asked_ms = 0;    // the last call that found it suspect
    uint64_t generation = 0;  // its prober's: a prober whose entry is gone or newer ends
  };
  struct Prober {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;  // set as the thread's last step
  };
  void ProbeLoop(const std::string& endpoint, uint64_t generation);
  // True while endpoint's suspicion is still the one of generation; mu_ held.
  bool CurrentLocked(const std::string& endpoint, uint64_t generation) const;
  // Joins the probers that have finished; mu_ held (they no longer take it).
  void ReapLocked();

  const PeerHealthOptions options_;
  const Probe probe_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<std::string, Suspect> suspects_;  // guarded by mu_
  std::vector<Prober> probers_;                        // not yet joined; guarded by mu_
  uint64_t next_generation_ = 1;                       // guarded by mu_
  bool stop_ = false;                                  // guarded by mu_
  std::atomic<uint64_t> suspect_count_{0};             // suspects_.size(), read without mu_
  std::atomic<uint64_t> suspicions_{0}, failed_fast_{0}, probes_{0}, probes_failed_{0},
      recoveries_{0}, forgotten_{0}, not_suspected_{0};
};

}  // namespace kvtier::cluster
