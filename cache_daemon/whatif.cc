#include "cache_daemon/whatif.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <nlohmann/json.hpp>

#include "common/clock.h"
#include "policies/policy.h"
#include "sim/simulator.h"
#include "sim/trace.h"

namespace kvtier::daemon {

std::vector<std::string> WhatIfPolicies() {
  std::vector<std::string> names = policies::EvictionPolicyNames();
  names.push_back("belady");
  return names;
}

StatusOr<WhatIfResult> ComputeWhatIf(std::string_view trace_text, const WhatIfLive& live) {
  WhatIfResult out;
  out.live = live;
  if (trace_text.empty()) return out;
  sim::TraceLoadOptions load;
  load.format = sim::TraceFormat::kKvtier;
  KVTIER_ASSIGN_OR_RETURN(sim::Trace trace, sim::ParseTrace(trace_text, load));
  KVTIER_ASSIGN_OR_RETURN(sim::UnitTrace units, sim::BuildUnitTrace(trace));
  out.records = trace.requests.size();
  out.unique_units = units.unique_units;
  out.read_refs = units.read_refs;
  out.unit_bytes = units.unit_bytes;
  // The same floor(fraction * unique) as `kvtier sim --capacity-fraction`.
  for (double f : kWhatIfFractions) {
    out.capacity_units.push_back(
        static_cast<uint64_t>(std::floor(f * static_cast<double>(units.unique_units))));
  }
  if (units.unit_bytes > 0) {
    out.live_capacity_units = live.dram_capacity_bytes / units.unit_bytes;
    out.capacity_units.push_back(out.live_capacity_units);
  }
  std::erase(out.capacity_units, 0);
  std::sort(out.capacity_units.begin(), out.capacity_units.end());
  out.capacity_units.erase(std::unique(out.capacity_units.begin(), out.capacity_units.end()),
                           out.capacity_units.end());
  for (const std::string& name : WhatIfPolicies()) {
    WhatIfCurve curve;
    curve.policy = name;
    for (uint64_t c : out.capacity_units) {
      sim::SimOptions o;
      o.policy = name;
      o.policy_params.seed = kWhatIfSeed;
      o.dram_capacity_units = c;
      StatusOr<sim::SimResult> r = sim::Simulate(units, o);
      if (!r.ok()) {
        curve.miss_ratio.clear();
        curve.error = r.status().ToString();
        break;
      }
      curve.miss_ratio.push_back(r->block_miss_ratio);
    }
    out.curves.push_back(std::move(curve));
  }
  return out;
}

namespace {

nlohmann::json WindowJson(const TraceWindow& w, const TraceWindow::Snapshot& s) {
  return {{"records", s.records},
          {"bytes", s.text.size()},
          {"records_appended", s.appended},
          {"records_dropped", s.dropped},
          {"records_max", w.limits().records_max},
          {"bytes_max", w.limits().bytes_max}};
}

}  // namespace

WhatIf::WhatIf(const TraceWindow* window, WhatIfOptions options, std::function<WhatIfLive()> live)
    : window_(window), options_(options), live_(std::move(live)) {
  json_ = nlohmann::json{{"state", "pending"},
                         {"seq", 0},
                         {"interval_ms", options_.interval_ms},
                         {"reason", "no computation yet (the first runs once traffic is recorded)"}}
              .dump();
  thread_ = std::thread([this] { Run(); });
}

WhatIf::~WhatIf() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

std::string WhatIf::Json() const {
  std::lock_guard<std::mutex> lock(mu_);
  return json_;
}

void WhatIf::Run() {
  // Linux: a thread's nice value is per thread; the simulator yields to request work.
  (void)setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 10);
  uint64_t seen = 0, seq = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (seq > 0 || seen > 0) {
        cv_.wait_for(lock, std::chrono::milliseconds(options_.interval_ms), [&] { return stop_; });
      } else {
        // Before the first result poll briefly, so the page has curves soon after traffic.
        cv_.wait_for(lock,
                     std::chrono::milliseconds(std::min<uint64_t>(options_.interval_ms, 1000)),
                     [&] { return stop_; });
      }
      if (stop_) return;
    }
    if (window_->appended() == seen) continue;
    TraceWindow::Snapshot snap = window_->Take();
    seen = snap.appended;
    const uint64_t start_us = DefaultSteadyClock().NowUs();
    StatusOr<WhatIfResult> r = ComputeWhatIf(snap.text, live_());
    const uint64_t compute_ms = (DefaultSteadyClock().NowUs() - start_us) / 1000;
    nlohmann::json j;
    j["seq"] = ++seq;
    j["interval_ms"] = options_.interval_ms;
    j["compute_ms"] = compute_ms;
    j["window"] = WindowJson(*window_, snap);
    snap.text = std::string();
    if (!r.ok()) {
      j["state"] = "error";
      j["reason"] = r.status().ToString();
    } else {
      j["state"] = "ready";
      j["unique_units"] = r->unique_units;
      j["read_refs"] = r->read_refs;
      j["unit_bytes"] = r->unit_bytes;
      j["live"] = {{"policy", r->live.policy},
                   {"dram_capacity_bytes", r->live.dram_capacity_bytes},
                   {"capacity_units", r->live_capacity_units}};
      j["capacity_units"] = r->capacity_units;
      nlohmann::json curves = nlohmann::json::array();
      for (const WhatIfCurve& c : r->curves) {
        nlohmann::json cj = {{"policy", c.policy}, {"miss_ratio", c.miss_ratio}};
        if (!c.error.empty()) cj["error"] = c.error;
        curves.push_back(std::move(cj));
      }
      j["curves"] = std::move(curves);
    }
    std::string text = j.dump();
    std::lock_guard<std::mutex> lock(mu_);
    json_ = std::move(text);
  }
}

}  // namespace kvtier::daemon
