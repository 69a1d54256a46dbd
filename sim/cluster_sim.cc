#include "sim/cluster_sim.h"

#include <algorithm>
#include <cstdio>
#include <list>
#include <nlohmann/json.hpp>
#include <string>
#include <unordered_map>

#include "common/json_text.h"

namespace kvtier::sim {
namespace {

// A unit-count LRU remembering each unit's home host.
class Lru {
 public:
  explicit Lru(uint64_t capacity_units) : capacity_(capacity_units) {}

  // The home of a cached unit, or -1.
  int64_t Home(uint32_t unit) const {
    auto it = map_.find(unit);
    return it == map_.end() ? int64_t{-1} : static_cast<int64_t>(it->second->second);
  }
  // Stores the unit (homed at host) or refreshes it (keeping its home).
  void Touch(uint32_t unit, uint32_t host) {
    if (capacity_ == 0) return;
    auto it = map_.find(unit);
    if (it != map_.end()) {
      order_.splice(order_.begin(), order_, it->second);
      return;
    }
    if (map_.size() >= capacity_) {
      map_.erase(order_.back().first);
      order_.pop_back();
    }
    order_.emplace_front(unit, host);
    map_.emplace(unit, order_.begin());
  }
  void Remove(uint32_t unit) {
    auto it = map_.find(unit);
    if (it == map_.end()) return;
    order_.erase(it->second);
    map_.erase(it);
  }

 private:
  using Order = std::list<std::pair<uint32_t, uint32_t>>;  // (unit, home), most recent first
  uint64_t capacity_;
  Order order_;
  std::unordered_map<uint32_t, Order::iterator> map_;
};

uint64_t Mix(uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

const char* HostAssignmentName(HostAssignment a) {
  return a == HostAssignment::kRoundRobin ? "round-robin" : "session-affinity";
}

StatusOr<ClusterSimResult> SimulateCluster(const UnitTrace& trace, const ClusterSimOptions& o) {
  if (o.hosts < 1 || o.hosts > kClusterHostsMax) {
    return Status::InvalidArgument("cluster hosts must be 1.." + std::to_string(kClusterHostsMax) +
                                   ", got " + std::to_string(o.hosts));
  }
  if (o.capacity_units < o.hosts) {
    return Status::InvalidArgument("cluster capacity of " + std::to_string(o.capacity_units) +
                                   " units is less than one unit per host (" +
                                   std::to_string(o.hosts) + " hosts)");
  }
  if (o.affinity_units < 1 || o.affinity_units > kClusterAffinityUnitsMax) {
    return Status::InvalidArgument("affinity units must be 1.." +
                                   std::to_string(kClusterAffinityUnitsMax));
  }
  ClusterSimResult r;
  r.options = o;
  r.requests_per_host.assign(o.hosts, 0);
  std::vector<Lru> local(o.hosts, Lru(o.capacity_units / o.hosts));
  Lru pooled(o.capacity_units);
  uint64_t seq = 0;
  for (const UnitTrace::Request& req : trace.requests) {
    const uint32_t* units = trace.unit.data() + req.first_ref;
    const uint32_t* tokens = trace.tokens.data() + req.first_ref;
    uint32_t host = 0;
    if (o.assignment == HostAssignment::kRoundRobin) {
      host = static_cast<uint32_t>(seq % o.hosts);
    } else {
      uint64_t h = 0;
      for (uint32_t i = 0; i < req.num_refs && i < o.affinity_units; ++i) h = Mix(h ^ units[i]);
      host = static_cast<uint32_t>(h % o.hosts);
    }
    ++seq;
    Lru& mine = local[host];
    if (req.op == TraceOp::kDelete) {
      for (uint32_t i = 0; i < req.num_refs; ++i) {
        for (Lru& l : local) l.Remove(units[i]);
        pooled.Remove(units[i]);
      }
      continue;
    }
    if (req.op != TraceOp::kPut) {
      ++r.requests;
      ++r.requests_per_host[host];
      bool private_prefix = true, pooled_prefix = true;
      for (uint32_t i = 0; i < req.num_refs; ++i) {
        r.prompt_tokens += tokens[i];
        private_prefix = private_prefix && mine.Home(units[i]) >= 0;
        if (private_prefix) r.private_hit_tokens += tokens[i];
        int64_t home = pooled.Home(units[i]);
        pooled_prefix = pooled_prefix && home >= 0;
        if (!pooled_prefix) continue;
        r.pooled_hit_tokens += tokens[i];
        if (home != static_cast<int64_t>(host)) {
          r.pooled_remote_hit_tokens += tokens[i];
          r.bytes_moved += trace.size_bytes[units[i]];
        }
      }
    }
    for (uint32_t i = 0; i < req.num_refs; ++i) {
      mine.Touch(units[i], host);
      pooled.Touch(units[i], host);
    }
  }
  return r;
}

namespace {

// Requests of the busiest host over the mean per host (1: balanced; N: one host takes all).
double Imbalance(const ClusterSimResult& r) {
  uint64_t most = 0;
  for (uint64_t n : r.requests_per_host) most = std::max(most, n);
  return r.requests == 0 ? 0.0
                         : static_cast<double>(most) * static_cast<double>(r.options.hosts) /
                               static_cast<double>(r.requests);
}

double Quotient(const ClusterSimResult& r) {
  return r.private_hit_tokens == 0
             ? 0.0
             : static_cast<double>(r.pooled_hit_tokens) / static_cast<double>(r.private_hit_tokens);
}

}  // namespace

std::string FormatClusterText(const std::vector<ClusterSimResult>& rows) {
  std::string out =
      "hosts  capacity_units  assignment        private_hit  pooled_hit  pooled/private  "
      "pooled_remote_share  bytes_moved  busiest_host\n";
  char line[256];
  for (const ClusterSimResult& r : rows) {
    std::snprintf(line, sizeof(line),
                  "%5u  %14llu  %-16s  %11.4f  %10.4f  %14.2f  %19.4f  %11llu  %12.2f\n",
                  r.options.hosts, static_cast<unsigned long long>(r.options.capacity_units),
                  HostAssignmentName(r.options.assignment), r.private_hit_ratio(),
                  r.pooled_hit_ratio(), Quotient(r),
                  r.pooled_hit_tokens == 0 ? 0.0
                                           : static_cast<double>(r.pooled_remote_hit_tokens) /
                                                 static_cast<double>(r.pooled_hit_tokens),
                  static_cast<unsigned long long>(r.bytes_moved), Imbalance(r));
    out += line;
  }
  return out;
}

std::string FormatClusterJson(const std::vector<ClusterSimResult>& rows, const std::string& trace) {
  nlohmann::ordered_json out;
  out["trace"] = trace;
  auto& results = out["results"] = nlohmann::ordered_json::array();
  for (const ClusterSimResult& r : rows) {
    results.push_back({{"hosts", r.options.hosts},
                       {"capacity_units", r.options.capacity_units},
                       {"assignment", HostAssignmentName(r.options.assignment)},
                       {"affinity_units", r.options.affinity_units},
                       {"requests", r.requests},
                       {"prompt_tokens", r.prompt_tokens},
                       {"private_hit_tokens", r.private_hit_tokens},
                       {"pooled_hit_tokens", r.pooled_hit_tokens},
                       {"private_hit_ratio", r.private_hit_ratio()},
                       {"pooled_hit_ratio", r.pooled_hit_ratio()},
                       {"pooled_over_private", Quotient(r)},
                       {"pooled_remote_hit_tokens", r.pooled_remote_hit_tokens},
                       {"bytes_moved", r.bytes_moved},
                       {"requests_per_host", r.requests_per_host},
                       {"busiest_host_over_mean", Imbalance(r)}});
  }
  return JsonText(out, 2) + "\n";
}

}  // namespace kvtier::sim
