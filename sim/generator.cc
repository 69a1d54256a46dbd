#include "sim/generator.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <tuple>
#include <vector>

namespace kvtier::sim {
namespace {

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed * 0x2545f4914f6cdd1dull + 1) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }  // [0,1)
  double Normal() {
    double u1 = std::max(Uniform(), 1e-300), u2 = Uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
  }
  // Geometric on {1, 2, ...} with the given mean (>= 1).
  uint64_t Geometric(double mean) {
    if (mean <= 1.0) return 1;
    double p = 1.0 / mean;
    double u = std::max(Uniform(), 1e-300);
    return 1 + static_cast<uint64_t>(std::floor(std::log(u) / std::log(1.0 - p)));
  }
  double LogNormal(double median, double sigma) { return median * std::exp(sigma * Normal()); }

 private:
  uint64_t state_;
};

struct Event {
  uint64_t ts_ms;
  uint64_t session;
  uint64_t turn;
  uint64_t input_tokens;
  uint64_t output_tokens;
  std::vector<uint64_t> ids;
};

// True for finite x in [lo, hi]; false for NaN (every comparison with NaN is false).
bool InRange(double x, double lo, double hi) { return x >= lo && x <= hi; }

Status Validate(const GeneratorOptions& o) {
  auto bad = [](const char* what) { return Status::InvalidArgument(std::string("gen: ") + what); };
  if (o.block_tokens < 2) return bad("block_tokens must be >= 2");
  if (!(o.days > 0) || !InRange(o.days, 0, 365)) return bad("days must be in (0, 365]");
  if (o.sessions == 0 || o.sessions > 10000000) return bad("sessions must be in [1, 10^7]");
  if (o.system_prompts == 0 || o.system_prompts > 100000) return bad("system_prompts range");
  if (!InRange(o.p_minutes, 0, 1) || !InRange(o.p_hours, 0, 1) || o.p_minutes + o.p_hours > 1) {
    return bad("p_minutes and p_hours must be >= 0 and sum to <= 1");
  }
  if (!InRange(o.tool_prob, 0, 1)) return bad("tool_prob must be in [0, 1]");
  if (!InRange(o.prompt_zipf, 0, 10)) return bad("prompt_zipf must be in [0, 10]");
  constexpr double kMaxMean = 1e6;
  if (!InRange(o.mean_turns, 1, kMaxMean) || !InRange(o.first_turn_blocks, 1, kMaxMean) ||
      !InRange(o.turn_blocks, 1, kMaxMean) || !InRange(o.tool_blocks, 1, kMaxMean) ||
      !InRange(o.system_prompt_blocks, 1, kMaxMean)) {
    return bad("means must be in [1, 10^6]");
  }
  if (!InRange(o.output_tokens, 0, kMaxMean)) return bad("output_tokens must be in [0, 10^6]");
  constexpr double kYearS = 365.0 * 86400;
  if (!(o.minutes_median_s > 0) || !InRange(o.minutes_median_s, 0, kYearS) ||
      !(o.hours_median_s > 0) || !InRange(o.hours_median_s, 0, kYearS) || !(o.days_median_s > 0) ||
      !InRange(o.days_median_s, 0, kYearS)) {
    return bad("gap medians must be in (0, 1 year] seconds");
  }
  if (!(o.max_gap_hours > 0) || !InRange(o.max_gap_hours, 0, 365.0 * 24)) {
    return bad("max_gap_hours must be in (0, 8760]");
  }
  return Status::Ok();
}

}  // namespace

StatusOr<GeneratedTrace> GenerateAgentTrace(const GeneratorOptions& o) {
  KVTIER_RETURN_IF_ERROR(Validate(o));
  Rng rng(o.seed);
  uint64_t next_id = 0;
  // Shared system prompts and their Zipf CDF.
  std::vector<std::vector<uint64_t>> prompts(o.system_prompts);
  std::vector<double> cdf(o.system_prompts);
  double total = 0;
  for (uint64_t p = 0; p < o.system_prompts; ++p) {
    uint64_t n = 1 + static_cast<uint64_t>(rng.Uniform() * 2 * o.system_prompt_blocks);
    for (uint64_t k = 0; k < n; ++k) prompts[p].push_back(next_id++);
    total += 1.0 / std::pow(static_cast<double>(p + 1), o.prompt_zipf);
    cdf[p] = total;
  }
  const double span_ms = o.days * 24 * 3600 * 1000;
  const double max_gap_s = o.max_gap_hours * 3600;
  std::vector<Event> events;
  for (uint64_t s = 0; s < o.sessions; ++s) {
    double t_ms = rng.Uniform() * span_ms;
    double u = rng.Uniform() * total;
    size_t p = std::lower_bound(cdf.begin(), cdf.end(), u) - cdf.begin();
    std::vector<uint64_t> history = prompts[std::min(p, prompts.size() - 1)];
    uint64_t turns = rng.Geometric(o.mean_turns);
    for (uint64_t turn = 0; turn < turns && t_ms < span_ms; ++turn) {
      uint64_t add = turn == 0 ? rng.Geometric(o.first_turn_blocks) : rng.Geometric(o.turn_blocks);
      if (turn > 0 && rng.Uniform() < o.tool_prob) add += rng.Geometric(o.tool_blocks);
      for (uint64_t k = 0; k < add; ++k) history.push_back(next_id++);
      Event e;
      e.ts_ms = static_cast<uint64_t>(t_ms);
      e.session = s;
      e.turn = turn;
      e.ids = history;
      e.ids.push_back(next_id++);  // the partial last block: never reused as such
      uint64_t tail = 1 + rng.Next() % (o.block_tokens - 1);
      e.input_tokens = static_cast<uint64_t>(history.size()) * o.block_tokens + tail;
      e.output_tokens = rng.Geometric(o.output_tokens);
      events.push_back(std::move(e));
      if (events.size() > o.max_requests) return Status::InvalidArgument("gen: too many requests");
      history.push_back(next_id++);  // the completed last block + answer, as the next turn sees it
      double r = rng.Uniform();
      double gap_s = r < o.p_minutes               ? rng.LogNormal(o.minutes_median_s, 1.0)
                     : r < o.p_minutes + o.p_hours ? rng.LogNormal(o.hours_median_s, 0.8)
                                                   : rng.LogNormal(o.days_median_s, 0.5);
      t_ms += std::min(gap_s, max_gap_s) * 1000;
    }
  }
  std::sort(events.begin(), events.end(), [](const Event& a, const Event& b) {
    return std::tie(a.ts_ms, a.session, a.turn) < std::tie(b.ts_ms, b.session, b.turn);
  });
  GeneratedTrace out;
  out.requests = events.size();
  out.blocks = next_id;
  char buf[128];
  for (const Event& e : events) {
    std::snprintf(buf, sizeof(buf),
                  "{\"timestamp\":%llu,\"input_length\":%llu,\"output_length\":%llu,\"hash_ids\":[",
                  static_cast<unsigned long long>(e.ts_ms),
                  static_cast<unsigned long long>(e.input_tokens),
                  static_cast<unsigned long long>(e.output_tokens));
    out.jsonl += buf;
    for (size_t i = 0; i < e.ids.size(); ++i) {
      if (i > 0) out.jsonl += ',';
      out.jsonl += std::to_string(e.ids[i]);
    }
    out.jsonl += "]}\n";
  }
  return out;
}

}  // namespace kvtier::sim
