#include "engine/fidelity.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <string>

#include "engine/session.h"
#include "engine/state_io.h"

namespace kvtier::engine {
namespace {

// Tokens per Forward call of the uninterrupted pass (bounds its activation memory).
constexpr int64_t kSegmentTokens = 2048;

double LogSumExp(std::span<const float> x) {
  const double mx = *std::max_element(x.begin(), x.end());
  double s = 0;
  for (float v : x) s += std::exp(static_cast<double>(v) - mx);
  return mx + std::log(s);
}

int64_t Argmax(std::span<const float> x) {
  return std::max_element(x.begin(), x.end()) - x.begin();
}

// Accumulates one path's comparison with (a) over positions (of every sample).
struct Tally {
  int64_t positions = 0, agree = 0;
  double kl_sum = 0, kl_max = 0, nll_bits = 0;

  // Rows `x` (n x V) against (a)'s rows `a` on the true tokens `next` (n ids).
  void Add(const std::vector<float>& a, const std::vector<float>& x, std::span<const int32_t> next,
           int V) {
    for (size_t j = 0; j < next.size(); ++j) {
      std::span<const float> ra(a.data() + j * V, V), rx(x.data() + j * V, V);
      if (Argmax(ra) == Argmax(rx)) ++agree;
      const double kl = KlDivergence(ra, rx);
      kl_sum += kl;
      kl_max = std::max(kl_max, kl);
      nll_bits += (LogSumExp(rx) - rx[next[j]]) / std::log(2.0);
      ++positions;
    }
  }
  FidelityScore Finish(int64_t replay_tokens) const {
    FidelityScore s;
    const double n = static_cast<double>(positions);
    s.replay_tokens = replay_tokens;
    s.top1_agreement = static_cast<double>(agree) / n;
    s.kl_mean = kl_sum / n;
    s.kl_max = kl_max;
    s.bits_per_byte = nll_bits / n;
    return s;
  }
};

}  // namespace

Status CheckFidelityOptions(const EngineConfig& c, size_t tokens, const FidelityOptions& o) {
  if (o.histories.empty() || o.histories.size() > kMaxFidelityHistories)
    return Status::InvalidArgument("fidelity: 1.." + std::to_string(kMaxFidelityHistories) +
                                   " histories");
  if (o.replay_tokens.size() > kMaxFidelityReplayLengths)
    return Status::InvalidArgument("fidelity: at most " +
                                   std::to_string(kMaxFidelityReplayLengths) + " replay lengths");
  if (o.eval_tokens < 1 || o.eval_tokens > kMaxFidelityEvalTokens)
    return Status::InvalidArgument("fidelity: eval_tokens must be in [1, " +
                                   std::to_string(kMaxFidelityEvalTokens) + "]");
  const int64_t P = o.unit_tokens;
  if (P < 2 || P % 2 != 0) return Status::InvalidArgument("fidelity: unit_tokens must be even");
  for (int64_t h : o.histories) {
    if (h < P || h > kMaxFidelityHistoryTokens || h % P != 0)
      return Status::InvalidArgument("fidelity: history " + std::to_string(h) +
                                     " must be a positive multiple of unit_tokens (" +
                                     std::to_string(P) + ") up to " +
                                     std::to_string(kMaxFidelityHistoryTokens));
  }
  for (int64_t r : o.replay_tokens) {
    if (r < c.sliding_window || r > static_cast<int64_t>(kMaxTokensPerCall))
      return Status::InvalidArgument("fidelity: replay length " + std::to_string(r) +
                                     " must be in [W = " + std::to_string(c.sliding_window) + ", " +
                                     std::to_string(kMaxTokensPerCall) + "]");
  }
  if (o.samples < 1 || o.samples > kMaxFidelitySamples)
    return Status::InvalidArgument("fidelity: samples must be in [1, " +
                                   std::to_string(kMaxFidelitySamples) + "]");
  const int64_t need = FidelitySampleTokens(o) * o.samples;
  if (static_cast<int64_t>(tokens) < need)
    return Status::InvalidArgument(
        "fidelity: the text has " + std::to_string(tokens) + " tokens; " +
        std::to_string(o.samples) + " sample(s) of history " +
        std::to_string(FidelitySampleTokens(o) - o.eval_tokens) + " + " +
        std::to_string(o.eval_tokens) + " evaluated tokens need " + std::to_string(need));
  return Status::Ok();
}

int64_t FidelitySampleTokens(const FidelityOptions& o) {
  const int64_t h_max =
      o.histories.empty() ? 0 : *std::max_element(o.histories.begin(), o.histories.end());
  return h_max + o.eval_tokens;
}

double KlDivergence(std::span<const float> p, std::span<const float> q) {
  const double lp = LogSumExp(p), lq = LogSumExp(q);
  double kl = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    const double a = static_cast<double>(p[i]) - lp, b = static_cast<double>(q[i]) - lq;
    kl += std::exp(a) * (a - b);
  }
  return std::max(kl, 0.0);
}

namespace {

// One sample: (a) over `tokens`, then (b) and every (c) per history, added to tallies[h index]
// (index 0: (a) itself, 1: (b), 2 + i: (c) at replay_tokens[i]).
Status MeasureSample(Engine* engine, const Digest& fingerprint, const UnitPayloadLayout& layout,
                     std::span<const int32_t> tokens, const FidelityOptions& o,
                     std::vector<std::vector<Tally>>* tallies, FidelityReport* report) {
  const int V = engine->config().vocab_size;
  const int64_t N = o.eval_tokens, P = o.unit_tokens;
  const std::set<int64_t> hs(o.histories.begin(), o.histories.end());
  const int64_t h_max = *hs.rbegin();
  const std::vector<Digest> chain =
      SessionChainKeys(fingerprint, tokens.first(static_cast<size_t>(h_max)), o.unit_tokens);

  // (a): one pass, cut at every history h (export there) and every h + N - 1 (its last row).
  std::set<int64_t> cuts;
  for (int64_t h : hs) {
    cuts.insert(h);
    cuts.insert(h + N - 1);
  }
  std::map<int64_t, std::vector<float>> rows_a;  // h -> N x V (positions h-1 .. h+N-2)
  std::map<int64_t, std::vector<uint8_t>> hot;   // h -> EncodeHotState at h
  std::vector<std::vector<uint8_t>> units;       // encoded units of pages [0, h_max / P)
  for (int64_t h : hs) rows_a[h].resize(static_cast<size_t>(N * V));
  SequenceState a = engine->NewSequence();
  int64_t pos = 0;
  std::vector<float> seg_logits;
  for (int64_t cut : cuts) {
    while (pos < cut) {
      const int64_t len = std::min(kSegmentTokens, cut - pos);
      KVTIER_RETURN_IF_ERROR(engine->Forward(&a, tokens.subspan(pos, len), true, &seg_logits));
      for (int64_t h : hs) {  // rows of positions in [h-1, h+N-2] within [pos, pos+len)
        const int64_t lo = std::max(pos, h - 1), hi = std::min(pos + len, h + N - 1);
        for (int64_t p = lo; p < hi; ++p) {
          std::copy_n(seg_logits.begin() + (p - pos) * V, V, rows_a[h].begin() + (p - (h - 1)) * V);
        }
      }
      pos += len;
    }
    if (hs.count(cut) == 0) continue;
    for (int64_t page = static_cast<int64_t>(units.size()); page < cut / P; ++page) {
      UnitIdentity id;
      id.model_fingerprint = fingerprint;
      id.key = chain[page];
      id.first_token_position = static_cast<uint64_t>(page * P);
      KVTIER_ASSIGN_OR_RETURN(auto unit, ExportUnit(layout, id, a, page));
      units.push_back(std::move(unit));
    }
    hot[cut] = EncodeHotState(a, std::span<const float>(rows_a[cut].data(), V),
                              HotStateIdentity{fingerprint, SwaBlobKey(chain[cut / P - 1])});
  }
  a = SequenceState{};  // release (a)'s state before the restores

  // A fresh state holding the first h tokens' global KV, imported unit by unit as a resume
  // does (checksum, layout, fingerprint, chain key and position verified).
  auto import = [&](int64_t h, SequenceState* st) -> Status {
    *st = engine->NewSequence();
    UnitDecodeOptions d;
    d.expected_model_fingerprint = fingerprint;
    for (int64_t page = 0; page < h / P; ++page) {
      d.expected_key = chain[page];
      KVTIER_RETURN_IF_ERROR(ImportUnit(layout, units[page], d, tokens.subspan(page * P, P), st));
      ++report->units_imported;
    }
    return Status::Ok();
  };
  // Teacher-forced continuation: `first` (the restore's logits at h-1) then tokens h..h+N-2.
  auto continue_from = [&](int64_t h, SequenceState* st, const std::vector<float>& first,
                           std::vector<float>* rows) -> Status {
    rows->assign(first.begin(), first.end());
    if (N > 1) {
      std::vector<float> rest;
      KVTIER_RETURN_IF_ERROR(engine->Forward(st, tokens.subspan(h, N - 1), true, &rest));
      rows->insert(rows->end(), rest.begin(), rest.end());
    }
    return Status::Ok();
  };

  for (size_t hi = 0; hi < o.histories.size(); ++hi) {
    const int64_t h = o.histories[hi];
    std::vector<Tally>& t = (*tallies)[hi];
    const std::vector<float>& ra = rows_a.at(h);
    const std::span<const int32_t> next = tokens.subspan(h, N);
    t[0].Add(ra, ra, next, V);
    SequenceState st;
    std::vector<float> rows;
    // (b) exact restore.
    KVTIER_RETURN_IF_ERROR(import(h, &st));
    KVTIER_ASSIGN_OR_RETURN(
        std::vector<float> hot_logits,
        DecodeHotState(hot.at(h), HotStateIdentity{fingerprint, SwaBlobKey(chain[h / P - 1])},
                       &st));
    ++report->hot_states_imported;
    KVTIER_RETURN_IF_ERROR(continue_from(h, &st, hot_logits, &rows));
    t[1].Add(ra, rows, next, V);
    // (c) bounded replay at each R.
    for (size_t ri = 0; ri < o.replay_tokens.size(); ++ri) {
      const int64_t r = o.replay_tokens[ri];
      KVTIER_RETURN_IF_ERROR(import(h, &st));
      std::vector<float> replay_logits;
      KVTIER_RETURN_IF_ERROR(engine->ReplayTail(&st, r, &replay_logits));
      report->replayed_tokens += std::min(r, h);
      KVTIER_RETURN_IF_ERROR(continue_from(h, &st, replay_logits, &rows));
      t[2 + ri].Add(ra, rows, next, V);
    }
  }
  return Status::Ok();
}

}  // namespace

StatusOr<FidelityReport> MeasureFidelity(Engine* engine, const ModelWeights& weights,
                                         std::span<const int32_t> tokens,
                                         const FidelityOptions& o) {
  const EngineConfig& c = engine->config();
  KVTIER_RETURN_IF_ERROR(CheckFidelityOptions(c, tokens.size(), o));
  KVTIER_ASSIGN_OR_RETURN(KvLayout kv_layout, EngineKvLayout(c, o.unit_tokens));
  const UnitPayloadLayout layout = UnitPayloadLayout::For(kv_layout);
  KVTIER_ASSIGN_OR_RETURN(Digest fingerprint, EngineModelFingerprint(c, weights, o.unit_tokens));
  FidelityReport report;
  report.tokens = static_cast<int64_t>(tokens.size());
  report.sliding_window = c.sliding_window;
  report.eval_tokens = o.eval_tokens;
  report.unit_tokens = o.unit_tokens;
  report.samples = o.samples;
  std::vector<std::vector<Tally>> tallies(o.histories.size(),
                                          std::vector<Tally>(2 + o.replay_tokens.size()));
  const int64_t L = FidelitySampleTokens(o);
  for (int64_t s = 0; s < o.samples; ++s) {
    KVTIER_RETURN_IF_ERROR(
        MeasureSample(engine, fingerprint, layout, tokens.subspan(s * L, L), o, &tallies, &report));
  }
  for (size_t hi = 0; hi < o.histories.size(); ++hi) {
    FidelityHistory fh;
    fh.history = o.histories[hi];
    fh.positions = tallies[hi][0].positions;
    fh.uninterrupted_bits_per_byte = tallies[hi][0].Finish(0).bits_per_byte;
    fh.exact = tallies[hi][1].Finish(0);
    for (size_t ri = 0; ri < o.replay_tokens.size(); ++ri)
      fh.replay.push_back(tallies[hi][2 + ri].Finish(o.replay_tokens[ri]));
    report.histories.push_back(std::move(fh));
  }
  return report;
}

}  // namespace kvtier::engine
