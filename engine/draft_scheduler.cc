#include "engine/draft_scheduler.h"

#include <time.h>

#include <algorithm>
#include <cmath>

namespace kvtier::engine {

namespace {

double Seconds(const timespec& ts) {
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// The cost estimates' update (draft_scheduler.h, DraftScheduler): the first sample sets it, each
// later one moves it an eighth of the way in the log domain, its ratio clamped to [1/2, 2].
void UpdateCost(double* c, double x) {
  if (!(x > 0) || !std::isfinite(x)) return;
  if (*c <= 0) {
    *c = x;
    return;
  }
  *c *= std::pow(std::clamp(x / *c, 0.5, 2.0), 1.0 / 8.0);
}

}  // namespace

double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return Seconds(ts);
}

double ProcessCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return Seconds(ts);
}

CostClock CpuCostClock(const Engine& engine) {
  if (engine.threads() <= 1) return ThreadCpuSeconds;
  return ProcessCpuSeconds;
}

DraftScheduler::DraftScheduler(int max_tokens, CostClock clock)
    : clock_(clock ? std::move(clock) : CostClock(ThreadCpuSeconds)),
      cost_s_(std::max(1, max_tokens) + 1, 0.0),
      samples_(cost_s_.size(), 0),
      probes_(std::max(1, max_tokens) + 1) {}

void DraftScheduler::Record(int tokens, double seconds) {
  if (tokens < 1 || tokens >= static_cast<int>(cost_s_.size())) return;
  UpdateCost(&cost_s_[tokens], seconds);
  if (seconds > 0 && std::isfinite(seconds))
    samples_[tokens] = std::min(samples_[tokens] + 1, kTableMoveSamples);
}

void DraftScheduler::RecordUndrafted(int sequences, double seconds) {
  if (sequences < 1 || sequences >= static_cast<int>(cost_s_.size())) return;
  double& c = cost_s_[sequences];
  const double before = c;
  Record(sequences, seconds);
  // The first samples of a size mostly correct its own first one: they move it alone.
  if (before <= 0 || c == before || samples_[sequences] < kTableMoveSamples) return;
  const double f = c / before;
  for (size_t t = 1; t < cost_s_.size(); ++t) {
    if (static_cast<int>(t) != sequences) cost_s_[t] *= f;  // 0 (never measured) stays 0
  }
}

namespace {

// a_1 .. a_K of one draft: the running products of its confidences clamped to [0, 1].
std::vector<double> RawSurvivals(const std::vector<float>& conf) {
  std::vector<double> a(conf.size());
  double p = 1;
  for (size_t k = 0; k < conf.size(); ++k)
    a[k] = p *= std::clamp(static_cast<double>(conf[k]), 0.0, 1.0);
  return a;
}

int CalibrationBin(double a) {
  const int n = DraftScheduler::kCalibrationBins;
  return std::clamp(static_cast<int>(a * n), 0, n - 1);
}

}  // namespace

double DraftScheduler::Calibrated(double a) const {
  a = std::clamp(a, 0.0, 1.0);
  const int b = CalibrationBin(a);
  return (survived_[b] + kCalibrationPrior * a) / (verified_[b] + kCalibrationPrior);
}

std::vector<double> DraftScheduler::Survivals(const std::vector<float>& conf, bool raw) const {
  std::vector<double> s = RawSurvivals(conf);
  if (raw) return s;
  for (size_t k = 0; k < s.size(); ++k) s[k] = std::min(k > 0 ? s[k - 1] : 1.0, Calibrated(s[k]));
  return s;
}

void DraftScheduler::RecordDraft(double seconds, const std::vector<float>& conf) {
  UpdateCost(&draft_s_, seconds);
  if (mean_survival_.size() < conf.size()) mean_survival_.resize(conf.size(), -1.0);
  const std::vector<double> s = Survivals(conf, false);
  for (size_t k = 0; k < s.size(); ++k) {
    double& m = mean_survival_[k];
    m = m < 0 ? s[k] : m + (s[k] - m) / 8.0;
  }
}

void DraftScheduler::RecordVerified(const std::vector<float>& conf, int verified, int accepted) {
  if (accepted < 0 || accepted > verified || verified > static_cast<int>(conf.size())) return;
  const std::vector<double> a = RawSurvivals(conf);
  for (int k = 0; k < verified; ++k) {
    const int b = CalibrationBin(a[k]);
    verified_[b] += 1;
    survived_[b] += k < accepted ? 1 : 0;
    if (verified_[b] > kCalibrationWindow) {
      verified_[b] /= 2;
      survived_[b] /= 2;
    }
  }
}

double DraftScheduler::Sps(int tokens) const {
  if (tokens < 1 || tokens >= static_cast<int>(cost_s_.size()) || cost_s_[tokens] <= 0) return 0;
  return 1.0 / cost_s_[tokens];
}

double DraftScheduler::Rate(int tokens, int drafts) const {
  const double sps = Sps(tokens);
  if (sps <= 0) return 0;
  return 1.0 / (1.0 / sps + drafts * draft_s_);
}

std::vector<int> DraftScheduler::Choose(const std::vector<std::vector<float>>& conf,
                                        bool probe) const {
  const int R = static_cast<int>(conf.size());
  struct Cand {
    double a;
    int req;
  };
  std::vector<Cand> cands;
  int drafts = 0;
  for (int i = 0; i < R; ++i) {
    drafts += conf[i].empty() ? 0 : 1;
    for (double a : Survivals(conf[i], probe)) cands.push_back({a, i});
  }
  // Descending survival; within a request a is non-increasing, so prefixes stay prefixes.
  std::stable_sort(cands.begin(), cands.end(),
                   [](const Cand& x, const Cand& y) { return x.a > y.a; });
  std::vector<int> take(R, 0);
  if (R == 0) return take;
  double tau = R, best = tau * Rate(R, drafts);
  size_t best_b = 0;
  for (size_t b = 0; b < cands.size() && R + static_cast<int>(b) + 1 <= max_tokens(); ++b) {
    tau += cands[b].a;
    const double obj = tau * Rate(R + static_cast<int>(b) + 1, drafts);
    if (obj > best) {
      best = obj;
      best_b = b + 1;
    }
  }
  for (size_t b = 0; b < best_b; ++b) ++take[cands[b].req];
  return take;
}

bool DraftScheduler::ShouldDraft(int requests) {
  const int R = std::max(1, requests);
  probing_ = false;
  if (R >= max_tokens()) {
    ++decisions_.full;
    return false;
  }
  Probes& p = probes_[R];
  if (mean_survival_.empty()) {  // no survival estimate yet: a draft gives one
    ++decisions_.first;
    probing_ = true;
    return true;
  }
  if (Sps(R) <= 0) {
    // A plain step of R sequences was never timed (a batch size new to the table): run one,
    // timed, before weighing drafts against it. Drafting instead would never time it, and
    // every round of R sequences would draft for all of them.
    p.probing = p.plain_probing = false;
    time_next_undrafted_ = true;
    ++decisions_.new_size;
    return false;
  }
  const bool pays = Pays(R);
  if (p.probing && !pays) p.interval = std::min(2 * p.interval, kProbeRoundsMax);
  if (p.plain_probing && pays) p.plain_interval = std::min(2 * p.plain_interval, kProbeRoundsMax);
  p.probing = p.plain_probing = false;
  if (pays) {
    p.interval = kProbeRounds;
    p.skipped = 0;
    if (++p.drafting > p.plain_interval) {  // a plain probe: re-measure the undrafted pass
      p.drafting = 0;
      p.plain_probing = true;
      time_next_undrafted_ = true;
      ++decisions_.plain_probes;
      return false;
    }
    ++decisions_.pays;
    return true;
  }
  p.plain_interval = kProbeRounds;
  p.drafting = 0;
  if (++p.skipped > p.interval) {
    p.skipped = 0;
    p.probing = probing_ = true;
    ++decisions_.probes;
    return true;
  }
  ++decisions_.no;
  return false;
}

bool DraftScheduler::Pays(int R) const {
  double tau = 1, best = 0;
  for (size_t k = 0; k <= mean_survival_.size() && R * (static_cast<int>(k) + 1) <= max_tokens();
       ++k) {
    if (k > 0) tau += std::max(0.0, mean_survival_[k - 1]);
    best = std::max(best, R * tau * Rate(R * (static_cast<int>(k) + 1), R));
  }
  return best > kPaysMargin * R * Sps(R);
}

bool DraftScheduler::MayDraftWithin(int requests, int rounds) const {
  const int R = std::max(1, requests);
  if (R >= max_tokens()) return false;                     // ShouldDraft: never (no room)
  if (mean_survival_.empty() || Sps(R) <= 0) return true;  // the first draft, a new size
  if (Pays(R)) return true;
  // It does not pay: the next yes is the probe, at the call where skipped exceeds interval.
  return probes_[R].skipped + rounds > probes_[R].interval;
}

bool DraftScheduler::TimeUndrafted(int sequences) {
  if (time_next_undrafted_) {
    time_next_undrafted_ = false;
    undrafted_passes_ = 1;
    return true;
  }
  const bool early = sequences >= 1 && sequences < static_cast<int>(samples_.size()) &&
                     samples_[sequences] < kTableMoveSamples;
  return undrafted_passes_++ % (early ? kUndraftedTimedEveryEarly : kUndraftedTimedEvery) == 0;
}

namespace {

// The median of `x` (the lower middle one of an even count); x is reordered.
double Median(std::vector<double>* x) {
  auto mid = x->begin() + static_cast<int64_t>((x->size() - 1) / 2);
  std::nth_element(x->begin(), mid, x->end());
  return *mid;
}

}  // namespace

Status MeasureSps(Engine* e, const SequenceState& base, int reps, DraftScheduler* s) {
  if (base.tokens.empty()) return Status::InvalidArgument("speculative: MeasureSps needs a prefix");
  if (reps < 1) return Status::Ok();
  std::vector<float> logits;
  std::vector<std::vector<double>> cost(static_cast<size_t>(s->max_tokens()) + 1);
  for (int r = -1; r < reps; ++r) {  // r = -1: one warm-up pass, not recorded
    for (int t = r < 0 ? s->max_tokens() : 1; t <= s->max_tokens(); ++t) {
      SequenceState st = base;
      const std::vector<int32_t> toks(static_cast<size_t>(t), base.tokens.back());
      const double c0 = s->Now();
      KVTIER_RETURN_IF_ERROR(e->Forward(&st, toks, true, &logits));
      const double c1 = s->Now();
      if (r >= 0) cost[t].push_back(c1 - c0);
    }
  }
  for (int t = 1; t <= s->max_tokens(); ++t) s->Record(t, Median(&cost[t]));
  return Status::Ok();
}

Status MeasureSpsBatch(Engine* e, std::span<const SequenceState> bases, int reps,
                       DraftScheduler* s) {
  const int R = static_cast<int>(bases.size());
  if (R == 0 || s->max_tokens() < R)
    return Status::InvalidArgument("speculative: MeasureSpsBatch needs 1 .. max_tokens bases");
  for (const SequenceState& b : bases) {
    if (b.tokens.empty())
      return Status::InvalidArgument("speculative: MeasureSpsBatch needs prefixes");
  }
  std::vector<std::vector<float>> logits;
  std::vector<std::vector<double>> cost(static_cast<size_t>(s->max_tokens()) + 1);
  for (int r = -1; r < reps; ++r) {  // r = -1: one warm-up pass, not recorded
    for (int t = r < 0 ? s->max_tokens() : 1; t <= s->max_tokens(); ++t) {
      // t < R: a plain step of the first t sequences (the rounds after others finished).
      const int seqs = std::min(t, R);
      std::vector<SequenceState> st(bases.begin(), bases.begin() + seqs);
      std::vector<SequenceState*> ptrs;
      std::vector<std::vector<int32_t>> toks(static_cast<size_t>(seqs));
      std::vector<std::span<const int32_t>> spans;
      for (int i = 0; i < seqs; ++i) {
        toks[i].assign(static_cast<size_t>(t / seqs + (i < t % seqs ? 1 : 0)), st[i].tokens.back());
        ptrs.push_back(&st[i]);
        spans.emplace_back(toks[i]);
      }
      const double c0 = s->Now();
      KVTIER_RETURN_IF_ERROR(e->ForwardBatch(ptrs, spans, &logits));
      const double c1 = s->Now();
      if (r >= 0) cost[t].push_back(c1 - c0);
    }
  }
  for (int t = 1; t <= s->max_tokens() && reps > 0; ++t) s->Record(t, Median(&cost[t]));
  return Status::Ok();
}

}  // namespace kvtier::engine
