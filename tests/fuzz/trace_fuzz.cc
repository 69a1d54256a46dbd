// libFuzzer target: the policy simulator's trace reader (sim/trace.h) on arbitrary text, and
// the simulator on every small trace it accepts. Traces come from third parties (Mooncake's
// published traces under ../shared/traces) or from a kvtierd's trace file: `kvtier sim` must
// refuse what is malformed with a line number and replay whatever it accepts.
//
// The first input byte picks the format (auto, Mooncake, kvtier), the unit mapping, the policy
// and the structure; the rest is the trace text. Invariants, beyond no crash, no out-of-bounds
// access (ASan) and no undefined behaviour (UBSan):
//   - every parsed request's ids lie inside Trace::ids, at most kMaxIdsPerRequest of them;
//   - an accepted trace expands to units whose per-reference and per-unit arrays agree in
//     length and index only what exists;
//   - a replay of at most kRefsMax references through a 3-unit DRAM tier and a 5-unit SSD tier
//     (every registered policy and Belady) accounts for every read reference exactly once (hit in
//     DRAM, hit on SSD, or miss), and no more prefix tokens hit than were asked for.
//
//   cmake --preset fuzz && cmake --build --preset fuzz --target kvtier_trace_fuzz
//   build/fuzz/tests/fuzz/kvtier_trace_fuzz -max_total_time=60 <corpus dir of trace lines>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "policies/policy.h"
#include "sim/simulator.h"
#include "sim/trace.h"
#include "tests/fuzz/fuzz_require.h"

namespace {

using kvtier::fuzz::Require;

using namespace kvtier::sim;

// References above which an accepted trace is only expanded, not replayed (keeps runs fast).
constexpr size_t kRefsMax = 2000;
// Every registered eviction policy, and Belady (the simulator's own).
const std::vector<std::string>& Policies() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n = kvtier::policies::EvictionPolicyNames();
    n.push_back("belady");
    return n;
  }();
  return names;
}

void CheckTrace(const Trace& t) {
  for (const TraceRequest& r : t.requests) {
    Require(r.num_ids <= kMaxIdsPerRequest);
    Require(uint64_t{r.first_id} + r.num_ids <= t.ids.size());
  }
}

void CheckUnits(const UnitTrace& u) {
  const size_t refs = u.unit.size(), units = u.size_bytes.size();
  Require(u.tokens.size() == refs && u.next_ref.size() == refs);
  Require(u.parent.size() == units && u.unit_tokens.size() == units &&
          u.recompute_tokens.size() == units);
  for (const UnitTrace::Request& r : u.requests)
    Require(uint64_t{r.first_ref} + r.num_refs <= refs);
  for (size_t i = 0; i < refs; ++i) {
    Require(u.unit[i] < units);
    Require(u.next_ref[i] == UnitTrace::kNoNext || (u.next_ref[i] > i && u.next_ref[i] < refs));
  }
  for (uint32_t p : u.parent) Require(p <= units);
  Require(u.unique_units <= units);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t pick = data[0];
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  TraceLoadOptions load;
  load.format = static_cast<TraceFormat>(pick % 3);
  load.block_tokens = (pick & 0x04) != 0 ? 16 : 512;
  auto trace = ParseTrace(text, load);
  if (!trace.ok()) {
    Require(!trace.status().message().empty());
    return 0;
  }
  CheckTrace(*trace);
  UnitMapping mapping;
  if (trace->format == TraceFormat::kMooncake && (pick & 0x08) != 0) mapping.unit_tokens = 256;
  auto units = BuildUnitTrace(*trace, mapping);
  if (!units.ok()) return 0;
  CheckUnits(*units);
  if (units->unit.size() > kRefsMax) return 0;
  SimOptions o;
  o.policy = Policies()[(pick >> 4) % Policies().size()];
  o.structure = (pick & 0x80) != 0 ? Structure::kPrefix : Structure::kPlain;
  o.dram_capacity_units = 3;
  o.ssd_capacity_units = 5;
  auto result = Simulate(*units, o);
  if (!result.ok()) {
    // Belady under the prefix layer, or a policy the structure refuses: a clean refusal.
    Require(result.status().IsInvalidArgument());
    return 0;
  }
  Require(result->dram_hits + result->ssd_hits + result->misses == result->read_refs);
  Require(result->read_refs == units->read_refs);
  Require(result->prefix_hit_tokens <= result->input_tokens);
  return 0;
}
