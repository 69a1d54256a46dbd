// `kvtier sim`: replay a trace through eviction / admission policies and report miss ratios,
// prefix-token hit ratio, SSD writes and money saved; `kvtier sim gen`: write a multi-day
// agent workload in the Mooncake format. See docs/POLICIES.md.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/flags.h"
#include "sim/cluster_sim.h"
#include "sim/generator.h"
#include "sim/report.h"
#include "sim/simulator.h"
#include "sim/trace.h"

namespace kvtier::cli {
namespace {

constexpr size_t kMaxSweepPoints = 256;  // capacities x policies per run

bool ParseParams(const std::string& text, uint64_t seed, policies::PolicyParams* out) {
  out->seed = seed;
  for (const std::string& kv : SplitComma(text)) {
    size_t eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) {
      std::fprintf(stderr, "kvtier sim: parameter '%s' is not key=value\n", kv.c_str());
      return false;
    }
    out->values.emplace_back(kv.substr(0, eq), kv.substr(eq + 1));
  }
  return true;
}

// --param for a list of policies: `POLICY:K=V` reaches only that policy (which must be listed);
// an unscoped `K=V` reaches every listed policy that takes key K and is skipped for the others
// (so `--policy lru,long-tail --param decay=0.8` tunes long-tail and leaves lru alone); it is an
// error only when no listed policy takes K. Fills one PolicyParams per name, in `names` order.
bool ParsePolicyParams(const std::string& text, uint64_t seed,
                       const std::vector<std::string>& names,
                       std::vector<policies::PolicyParams>* out) {
  out->assign(names.size(), policies::PolicyParams{});
  for (auto& p : *out) p.seed = seed;
  std::vector<std::vector<std::string>> keys;
  for (const std::string& name : names) keys.push_back(policies::EvictionPolicyParamKeys(name));
  for (const std::string& item : SplitComma(text)) {
    size_t eq = item.find('=');
    size_t colon = item.find(':');
    std::string scope, kv = item;
    if (colon != std::string::npos && (eq == std::string::npos || colon < eq)) {
      scope = item.substr(0, colon);
      kv = item.substr(colon + 1);
      eq = kv.find('=');
    }
    if (eq == std::string::npos || eq == 0) {
      std::fprintf(stderr, "kvtier sim: parameter '%s' is not [POLICY:]key=value\n", item.c_str());
      return false;
    }
    const std::string key = kv.substr(0, eq);
    bool listed = false, used = false;
    for (size_t i = 0; i < names.size(); ++i) {
      if (!scope.empty() && scope != names[i]) continue;
      listed = true;
      // A scoped key always reaches its policy, whose factory then names an unknown key.
      if (scope.empty() && std::find(keys[i].begin(), keys[i].end(), key) == keys[i].end()) {
        continue;
      }
      (*out)[i].values.emplace_back(key, kv.substr(eq + 1));
      used = true;
    }
    if (!listed) {
      std::fprintf(stderr,
                   "kvtier sim: parameter '%s' names policy '%s', which --policy does "
                   "not list\n",
                   item.c_str(), scope.c_str());
      return false;
    }
    if (!used) {
      std::fprintf(stderr, "kvtier sim: no policy in --policy takes parameter '%s'\n", key.c_str());
      return false;
    }
  }
  return true;
}

bool ParseNumbers(const std::string& text, std::vector<double>* out) {
  for (const std::string& part : SplitComma(text)) {
    char* end = nullptr;
    double v = std::strtod(part.c_str(), &end);
    if (part.empty() || end != part.c_str() + part.size() || !std::isfinite(v) || v < 0) {
      std::fprintf(stderr, "kvtier sim: '%s' is not a non-negative number\n", part.c_str());
      return false;
    }
    out->push_back(v);
  }
  return true;
}

void Progress(double fraction) {
  int width = 40, filled = static_cast<int>(fraction * width);
  std::fprintf(stderr, "\r[%.*s%*s] %3d%%", filled, "########################################",
               width - filled, "", static_cast<int>(fraction * 100));
  if (fraction >= 1.0) std::fprintf(stderr, "\r%*s\r", width + 8, "");
  std::fflush(stderr);
}

// One capacity point: units, and the fraction when given as one.
struct Capacity {
  uint64_t units = 0;
  double fraction = -1;
};

bool Capacities(const std::string& fractions, const std::string& units, const std::string& bytes,
                const sim::UnitTrace& trace, const char* what, std::vector<Capacity>* out) {
  int given = !fractions.empty() + !units.empty() + !bytes.empty();
  if (given > 1) {
    std::fprintf(stderr, "kvtier sim: give %s capacity as one of fraction, units or bytes\n", what);
    return false;
  }
  std::vector<double> v;
  if (!ParseNumbers(!fractions.empty() ? fractions : !units.empty() ? units : bytes, &v)) {
    return false;
  }
  for (double x : v) {
    Capacity c;
    if (!fractions.empty()) {
      if (!(x > 0 && x <= 1)) {
        std::fprintf(stderr, "kvtier sim: %s capacity fraction %g is outside (0, 1]\n", what, x);
        return false;
      }
      c.fraction = x;
      c.units = static_cast<uint64_t>(std::floor(x * static_cast<double>(trace.unique_units)));
    } else if (!units.empty()) {
      c.units = static_cast<uint64_t>(x);
    } else {
      c.units = trace.unit_bytes == 0 ? 0 : static_cast<uint64_t>(x) / trace.unit_bytes;
    }
    out->push_back(c);
  }
  return true;
}

int RunGen(Args args) {
  sim::GeneratorOptions o;
  std::string out_path;
  FlagSet flags("kvtier sim gen",
                "Write a multi-day agent workload (Mooncake JSON Lines); model in "
                "docs/POLICIES.md.");
  flags.String("out", &out_path, "FILE", "output file", true);
  flags.Uint("seed", &o.seed, "RNG seed (same seed, same bytes)");
  flags.Double("days", &o.days, "span of session starts, days", false, 0.001, 365);
  flags.Uint("sessions", &o.sessions, "agent sessions", false, 1, 10000000);
  flags.Uint("system-prompts", &o.system_prompts, "shared system prompts", false, 1, 100000);
  flags.Double("system-prompt-blocks", &o.system_prompt_blocks, "mean system prompt blocks", false,
               1, 1e6);
  flags.Double("prompt-zipf", &o.prompt_zipf, "Zipf exponent of system prompt popularity", false, 0,
               10);
  flags.Double("mean-turns", &o.mean_turns, "mean turns per session (geometric)", false, 1, 1e6);
  flags.Double("first-turn-blocks", &o.first_turn_blocks, "mean new blocks in turn 1", false, 1,
               1e6);
  flags.Double("turn-blocks", &o.turn_blocks, "mean new user blocks per later turn", false, 1, 1e6);
  flags.Double("tool-prob", &o.tool_prob, "probability a turn carries a tool output", false, 0, 1);
  flags.Double("tool-blocks", &o.tool_blocks, "mean tool output blocks", false, 1, 1e6);
  flags.Double("p-minutes", &o.p_minutes, "share of resume gaps of minutes", false, 0, 1);
  flags.Double("p-hours", &o.p_hours, "share of resume gaps of hours (rest: days)", false, 0, 1);
  flags.Double("minutes-median-s", &o.minutes_median_s, "median of minute-scale gaps, s", false,
               0.001, 365.0 * 86400);
  flags.Double("hours-median-s", &o.hours_median_s, "median of hour-scale gaps, s", false, 0.001,
               365.0 * 86400);
  flags.Double("days-median-s", &o.days_median_s, "median of day-scale gaps, s", false, 0.001,
               365.0 * 86400);
  flags.Double("max-gap-hours", &o.max_gap_hours, "truncation of resume gaps, hours", false, 0.001,
               365.0 * 24);
  flags.Double("output-tokens", &o.output_tokens, "mean output tokens", false, 0, 1e6);
  uint64_t block_tokens = o.block_tokens;
  flags.Uint("block-tokens", &block_tokens, "tokens per hash id", false, 2, 1u << 20);
  if (int rc = flags.Parse(args); rc >= 0) return rc;
  o.block_tokens = static_cast<uint32_t>(std::min<uint64_t>(block_tokens, UINT32_MAX));
  auto gen = sim::GenerateAgentTrace(o);
  if (!gen.ok()) {
    std::fprintf(stderr, "kvtier sim gen: %s\n", gen.status().ToString().c_str());
    return 2;
  }
  FILE* f = std::fopen(out_path.c_str(), "wb");
  if (f == nullptr ||
      std::fwrite(gen->jsonl.data(), 1, gen->jsonl.size(), f) != gen->jsonl.size() ||
      std::fclose(f) != 0) {
    std::fprintf(stderr, "kvtier sim gen: cannot write '%s'\n", out_path.c_str());
    return 1;
  }
  std::fprintf(stderr, "wrote %llu requests, %llu distinct blocks to %s\n",
               static_cast<unsigned long long>(gen->requests),
               static_cast<unsigned long long>(gen->blocks), out_path.c_str());
  return 0;
}

}  // namespace

// `kvtier sim --cluster-hosts N`: private vs pooled caches (sim/cluster_sim.h), one row per
// capacity and assignment. LRU only; flags of the policy sweep are refused.
int RunCluster(const sim::UnitTrace& trace, const std::string& trace_path,
               const std::vector<Capacity>& capacities, uint64_t hosts, const std::string& assign,
               uint64_t affinity_units, bool json) {
  std::vector<sim::HostAssignment> assignments;
  if (assign == "round-robin" || assign == "both") {
    assignments.push_back(sim::HostAssignment::kRoundRobin);
  }
  if (assign == "session-affinity" || assign == "both") {
    assignments.push_back(sim::HostAssignment::kSessionAffinity);
  }
  if (assignments.empty()) {
    std::fprintf(stderr,
                 "kvtier sim: '--cluster-assign' wants round-robin, session-affinity or both, "
                 "got '%s'\n",
                 assign.c_str());
    return 2;
  }
  std::vector<sim::ClusterSimResult> rows;
  for (const Capacity& c : capacities) {
    for (sim::HostAssignment a : assignments) {
      auto r =
          sim::SimulateCluster(trace, {.hosts = static_cast<uint32_t>(hosts),
                                       .capacity_units = c.units,
                                       .assignment = a,
                                       .affinity_units = static_cast<uint32_t>(affinity_units)});
      if (!r.ok()) {
        std::fprintf(stderr, "kvtier sim: %s\n", r.status().ToString().c_str());
        return 2;
      }
      rows.push_back(std::move(*r));
    }
  }
  std::fputs(json ? sim::FormatClusterJson(rows, trace_path).c_str()
                  : sim::FormatClusterText(rows).c_str(),
             stdout);
  return 0;
}

int RunSim(Args args) {
  if (!args.empty() && args[0] == "gen") return RunGen(args.subspan(1));
  std::string trace_path, format = "auto", policy_list = "lru", params_text, fractions, units,
                          bytes, ssd_fraction, ssd_units, ssd_bytes, ssd_policy = "lru",
                          ssd_params_text, admission = "admit-all", admission_params_text,
                          curve_out, structure_list = "plain";
  uint64_t block_tokens = 512, unit_tokens = 0, bytes_per_token = 890, seed = 42;
  uint64_t cluster_hosts = 0, cluster_affinity_units = 4;
  std::string cluster_assign = "both";
  double price_uncached = 0.28, price_cached = -1;
  bool json = false, no_progress = false;
  FlagSet flags("kvtier sim",
                "Replay a Mooncake or kvtier trace through eviction/admission policies "
                "(subcommand: kvtier sim gen).");
  flags.String("trace", &trace_path, "FILE", "trace (.jsonl, or kvtier .jsonl/.zst)", true);
  flags.String("format", &format, "auto|mooncake|kvtier", "trace format");
  flags.Uint("block-tokens", &block_tokens, "tokens per Mooncake hash id", false, 1, 1u << 20);
  flags.Uint("unit-tokens", &unit_tokens, "tokens per storage unit (0: one unit per block)", false,
             0, 1u << 20);
  flags.Uint("bytes-per-token", &bytes_per_token, "global KV bytes per token (unit sizes)", false,
             1, 1u << 24);
  flags.String("policy", &policy_list, "NAME[,NAME]",
               "DRAM eviction policies (lru fifo lfu arc s3fifo sieve gdsf ttl long-tail belady)");
  flags.String("param", &params_text, "[P:]K=V[,...]",
               "DRAM policy parameters: K=V reaches each listed policy taking K, P:K=V only P");
  flags.String("structure", &structure_list, "plain|prefix[,..]",
               "plain: libCacheSim's replay; prefix: partial blocks uncached, leaf-first "
               "eviction (docs/POLICIES.md); both: one row per structure");
  flags.Uint("seed", &seed, "seed for randomised policies");
  flags.String("capacity-fraction", &fractions, "F[,F]",
               "DRAM capacity: fractions of unique units");
  flags.String("capacity-units", &units, "N[,N]", "DRAM capacity in units");
  flags.String("capacity-bytes", &bytes, "B[,B]", "DRAM capacity in bytes");
  flags.String("ssd-capacity-fraction", &ssd_fraction, "F",
               "SSD capacity: fraction of unique units");
  flags.String("ssd-capacity-units", &ssd_units, "N", "SSD capacity in units");
  flags.String("ssd-capacity-bytes", &ssd_bytes, "B", "SSD capacity in bytes");
  flags.String("ssd-policy", &ssd_policy, "NAME", "SSD eviction policy");
  flags.String("ssd-param", &ssd_params_text, "K=V[,K=V]", "parameters for the SSD policy");
  flags.String("admission", &admission, "NAME",
               "SSD admission (admit-all second-hit write-budget)");
  flags.String("admission-param", &admission_params_text, "K=V[,K=V]", "admission parameters");
  flags.Double("price-uncached-per-mtok", &price_uncached, "USD per million uncached input tokens",
               false, 0, 1e6);
  flags.Double("price-cached-per-mtok", &price_cached,
               "USD per million cached tokens (-1: 2% of uncached)", false, -1, 1e6);
  flags.Bool("json", &json, "print JSON");
  flags.String("curve-out", &curve_out, "PREFIX", "write PREFIX.csv and PREFIX.svg");
  flags.Bool("no-progress", &no_progress, "never draw the progress bar");
  flags.Uint("cluster-hosts", &cluster_hosts,
             "cluster mode: N hosts, private caches of C/N vs one pooled cache of C "
             "(LRU; C from the capacity flags; 0: off)",
             false, 0, sim::kClusterHostsMax);
  flags.String("cluster-assign", &cluster_assign, "round-robin|session-affinity|both",
               "cluster mode: how requests are assigned to hosts");
  flags.Uint("cluster-affinity-units", &cluster_affinity_units,
             "cluster mode: session key = the request's first N units", false, 1,
             sim::kClusterAffinityUnitsMax);
  if (int rc = flags.Parse(args); rc >= 0) return rc;
  if (cluster_hosts > 0 &&
      (policy_list != "lru" || !params_text.empty() || structure_list != "plain" ||
       !ssd_fraction.empty() || !ssd_units.empty() || !ssd_bytes.empty() ||
       !ssd_params_text.empty() || admission != "admit-all" || !curve_out.empty())) {
    std::fprintf(stderr,
                 "kvtier sim: '--cluster-hosts' simulates LRU DRAM caches only: drop --policy, "
                 "--param, --structure, --ssd-*, --admission and --curve-out\n");
    return 2;
  }

  sim::TraceLoadOptions load;
  load.block_tokens = static_cast<uint32_t>(std::min<uint64_t>(block_tokens, UINT32_MAX));
  if (format == "mooncake") {
    load.format = sim::TraceFormat::kMooncake;
  } else if (format == "kvtier") {
    load.format = sim::TraceFormat::kKvtier;
  } else if (format != "auto") {
    std::fprintf(stderr, "kvtier sim: unknown --format '%s'\n", format.c_str());
    return 2;
  }
  auto trace = sim::LoadTrace(trace_path, load);
  if (!trace.ok()) {
    std::fprintf(stderr, "kvtier sim: %s\n", trace.status().ToString().c_str());
    return 1;
  }
  if (trace->requests.empty()) {  // a table of zeros would read as a result
    std::fprintf(stderr, "kvtier sim: %s holds no requests\n", trace_path.c_str());
    return 1;
  }
  sim::UnitMapping mapping{.unit_tokens = static_cast<uint32_t>(unit_tokens),
                           .bytes_per_token = bytes_per_token};
  auto units_trace = sim::BuildUnitTrace(*trace, mapping);
  if (!units_trace.ok()) {
    std::fprintf(stderr, "kvtier sim: %s\n", units_trace.status().ToString().c_str());
    return 2;
  }
  std::vector<Capacity> dram, ssd;
  if (fractions.empty() && units.empty() && bytes.empty()) fractions = "0.01,0.05,0.1,0.25";
  if (!Capacities(fractions, units, bytes, *units_trace, "DRAM", &dram) ||
      !Capacities(ssd_fraction, ssd_units, ssd_bytes, *units_trace, "SSD", &ssd)) {
    return 2;
  }
  if (ssd.size() > 1) {
    std::fprintf(stderr, "kvtier sim: give one SSD capacity\n");
    return 2;
  }
  if (cluster_hosts > 0) {
    return RunCluster(*units_trace, trace_path, dram, cluster_hosts, cluster_assign,
                      cluster_affinity_units, json);
  }
  sim::SimOptions base;
  base.ssd_policy = ssd_policy;
  base.ssd_capacity_units = ssd.empty() ? 0 : ssd[0].units;
  base.admission = admission;
  base.price_uncached_per_mtok = price_uncached;
  base.price_cached_per_mtok = price_cached;
  std::vector<std::string> names = SplitComma(policy_list);
  if (names.empty() || names.size() * dram.size() > kMaxSweepPoints) {
    std::fprintf(stderr, "kvtier sim: 1..%zu policy x capacity points\n", kMaxSweepPoints);
    return 2;
  }
  std::vector<sim::Structure> structures;
  for (const std::string& st : SplitComma(structure_list)) {
    if (st == "plain") {
      structures.push_back(sim::Structure::kPlain);
    } else if (st == "prefix") {
      structures.push_back(sim::Structure::kPrefix);
    } else {
      std::fprintf(stderr, "kvtier sim: '--structure' wants plain or prefix, got '%s'\n",
                   st.c_str());
      return 2;
    }
  }
  if (structures.empty() || structures.size() * names.size() * dram.size() > kMaxSweepPoints) {
    std::fprintf(stderr, "kvtier sim: 1..%zu structure x policy x capacity points\n",
                 kMaxSweepPoints);
    return 2;
  }
  std::vector<policies::PolicyParams> policy_params;
  if (!ParsePolicyParams(params_text, seed, names, &policy_params) ||
      !ParseParams(ssd_params_text, seed, &base.ssd_policy_params) ||
      !ParseParams(admission_params_text, seed, &base.admission_params)) {
    return 2;
  }
  const bool show_progress = !no_progress && isatty(STDERR_FILENO) != 0;
  std::vector<sim::ReportRow> rows;
  for (sim::Structure structure : structures) {
    for (size_t n = 0; n < names.size(); ++n) {
      const std::string& name = names[n];
      for (const Capacity& c : dram) {
        sim::SimOptions o = base;
        o.structure = structure;
        o.policy = name;
        o.policy_params = policy_params[n];
        o.dram_capacity_units = c.units;
        if (show_progress) o.progress = Progress;
        auto r = sim::Simulate(*units_trace, o);
        if (!r.ok()) {
          std::fprintf(stderr, "kvtier sim: %s\n", r.status().ToString().c_str());
          return 2;
        }
        rows.push_back({*r, c.fraction});
      }
    }
  }
  if (!curve_out.empty()) {
    if (auto st = sim::WriteCurves(rows, curve_out, trace_path); !st.ok()) {
      std::fprintf(stderr, "kvtier sim: %s\n", st.ToString().c_str());
      return 1;
    }
  }
  std::fputs(json ? sim::FormatJson(rows, trace_path).c_str() : sim::FormatText(rows).c_str(),
             stdout);
  return 0;
}

}  // namespace kvtier::cli
