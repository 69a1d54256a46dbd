// What-if miss-ratio curves from live traffic: the policy simulator (sim/) replayed over the
// recorded trace window (trace_window.h), one curve per eviction policy, with the daemon's
// live policy and DRAM capacity marked. Served as GET /v1/whatif (http_admin.cc) and drawn
// by the dashboard page.
//
// The replay is `kvtier sim` on the same lines: sim::ParseTrace + sim::BuildUnitTrace, DRAM
// tier only (no SSD tier), every policy with default parameters and seed kWhatIfSeed (the
// CLI's default --seed), capacities in units. So the curves equal
//   kvtier sim --trace FILE --policy P1,P2,.. --capacity-units C1,C2,.. --json
// on the trace file whenever the window still holds the whole file.
//
// Bounds: one background thread, niced; it recomputes at most every interval_ms and only
// when lines were appended since the last result; memory while computing is about twice the
// window's bytes plus the simulator's per-reference arrays; CPU per computation is
// policies x capacities (<= kWhatIfCapacitiesMax) replays of the window.
//
// Thread safety: Json() from any thread; Start/destructor from one.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "cache_daemon/trace_window.h"
#include "common/status.h"

namespace kvtier::daemon {

inline constexpr uint64_t kWhatIfSeed = 42;
// Capacity points of a curve: the fractions below of the window's unique units, plus the
// live DRAM capacity, deduplicated.
inline constexpr double kWhatIfFractions[] = {0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0};
inline constexpr size_t kWhatIfCapacitiesMax = std::size(kWhatIfFractions) + 1;

// What the daemon runs now (read on the background thread at each computation).
struct WhatIfLive {
  std::string policy;                // live DRAM eviction policy
  uint64_t dram_capacity_bytes = 0;  // live DRAM capacity
};

struct WhatIfCurve {
  std::string policy;
  std::vector<double> miss_ratio;  // per capacity point; empty when error is set
  std::string error;               // the simulator refused this policy
};

struct WhatIfResult {
  uint64_t records = 0, unique_units = 0, read_refs = 0, unit_bytes = 0;
  std::vector<uint64_t> capacity_units;  // ascending, > 0
  WhatIfLive live;
  uint64_t live_capacity_units = 0;  // live DRAM capacity / unit_bytes (0 when unknown)
  std::vector<WhatIfCurve> curves;   // one per policy, in registry order, then "belady"
};

// The policies a curve is drawn for: every registry eviction policy, then "belady".
std::vector<std::string> WhatIfPolicies();

// Replays `trace_text` (kvtier trace JSON Lines). InvalidArgument when the lines do not
// parse; an empty window gives a result with no capacity points.
StatusOr<WhatIfResult> ComputeWhatIf(std::string_view trace_text, const WhatIfLive& live);

struct WhatIfOptions {
  uint64_t interval_ms = 30000;  // recompute at most this often ([trace] whatif_interval_ms)
};

class WhatIf {
 public:
  // Starts the background thread over `window` (not owned; must outlive this object).
  // `live` is called on that thread before each computation.
  WhatIf(const TraceWindow* window, WhatIfOptions options, std::function<WhatIfLive()> live);
  ~WhatIf();  // stops and joins the thread (an ongoing computation finishes first)

  // The latest result as the /v1/whatif JSON document (docs/DASHBOARD.md): state "pending"
  // before the first computation, "ready" with curves, "error" with the reason.
  std::string Json() const;

 private:
  void Run();

  const TraceWindow* window_;
  const WhatIfOptions options_;
  const std::function<WhatIfLive()> live_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;  // protected by mu_
  std::string json_;   // protected by mu_
  std::thread thread_;
};

}  // namespace kvtier::daemon
