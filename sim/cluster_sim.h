// Cluster mode of the simulator (`kvtier sim --cluster-hosts N`): is one cache pooled over N
// engine hosts worth more than N private caches of the same total size, and what does the
// pooling cost in traffic between hosts? (docs/CLUSTER.md "Pooled vs per-host caches".)
//
// Model, on a UnitTrace (sim/simulator.h):
//  * Each request is assigned to one of N hosts: round robin (request i -> i mod N) or by
//    session affinity (a hash of the request's first affinity_units units mod N: requests that
//    continue one conversation or agent session, which share that prefix, land on one host).
//  * Per host: N private LRU caches of floor(C / N) units each; a request sees only its host's.
//  * Pooled: one LRU cache of C units that every host reads. A unit's home is the host that
//    stored it (the requester of the read that missed it); a hit on a unit homed elsewhere
//    moves its bytes between hosts (bytes_moved).
//  * A read request hits the longest prefix of its units present in the cache it sees (a
//    prefix cache stops at the first miss); its prompt tokens in that prefix are hit tokens.
//    Then every unit of the request is stored or refreshed (the engine computed the missed
//    ones). A put request only stores, a delete removes its units. Only reads count tokens.
// Both caches see the same assignment, so their hit ratios compare like for like.
//
// Deterministic. Limits: 1..kClusterHostsMax hosts; capacity of at least one unit per host.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "sim/simulator.h"

namespace kvtier::sim {

inline constexpr uint32_t kClusterHostsMax = 1024;
inline constexpr uint32_t kClusterAffinityUnitsMax = 1u << 16;

enum class HostAssignment : uint8_t { kRoundRobin, kSessionAffinity };
const char* HostAssignmentName(HostAssignment a);  // "round-robin", "session-affinity"

struct ClusterSimOptions {
  uint32_t hosts = 4;
  uint64_t capacity_units = 0;  // C, the pooled cache; each private cache has floor(C / N)
  HostAssignment assignment = HostAssignment::kRoundRobin;
  uint32_t affinity_units = 4;  // kSessionAffinity: the session key is the first K units
};

struct ClusterSimResult {
  ClusterSimOptions options;
  uint64_t requests = 0;       // read requests
  uint64_t prompt_tokens = 0;  // of read requests
  uint64_t private_hit_tokens = 0, pooled_hit_tokens = 0;
  uint64_t pooled_remote_hit_tokens = 0;  // pooled hits on units homed at another host
  uint64_t bytes_moved = 0;               // bytes of those units (pooled)
  std::vector<uint64_t> requests_per_host;
  double private_hit_ratio() const { return Ratio(private_hit_tokens); }
  double pooled_hit_ratio() const { return Ratio(pooled_hit_tokens); }
  double Ratio(uint64_t tokens) const {
    return prompt_tokens == 0 ? 0.0
                              : static_cast<double>(tokens) / static_cast<double>(prompt_tokens);
  }
};

// InvalidArgument for hosts outside 1..kClusterHostsMax, capacity_units < hosts, or
// affinity_units outside 1..kClusterAffinityUnitsMax.
StatusOr<ClusterSimResult> SimulateCluster(const UnitTrace& trace, const ClusterSimOptions& o);

// One row per result: hosts, capacity, assignment, both hit ratios, their quotient, the
// pooled remote share, the bytes moved and the busiest host's requests over the mean.
// FormatClusterJson: {"trace", "results": [...]}.
std::string FormatClusterText(const std::vector<ClusterSimResult>& rows);
std::string FormatClusterJson(const std::vector<ClusterSimResult>& rows, const std::string& trace);

}  // namespace kvtier::sim
