#include "engine/speculative.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>

#include "engine/ops.h"
#include "engine/scratch.h"
#include "kernels/quant.h"

namespace kvtier::engine {

namespace {

// Logits rows a round reuses on its thread (ForwardBatch overwrites each row), as the plain
// decode loop reuses its own: fresh ones every round were the one difference from it a profile
// could point at (at most about 1 % of an undrafted round at C = 4 on the trained miniature;
// docs/performance/speculative.md). Released when they grew past kScratchKeepBytes, as a
// Scratch is (a real vocabulary's row is half a megabyte).
struct ReusedRows {
  explicit ReusedRows(std::vector<std::vector<float>>& slot) : rows(slot) {}
  ~ReusedRows() {
    size_t bytes = 0;
    for (const std::vector<float>& r : rows) bytes += r.capacity() * sizeof(float);
    if (bytes > kScratchKeepBytes) std::vector<std::vector<float>>().swap(rows);
  }
  ReusedRows(const ReusedRows&) = delete;
  ReusedRows& operator=(const ReusedRows&) = delete;
  std::vector<std::vector<float>>& rows;
};

using kernels::QuantFormat;

// Latest position < keep with position % m == j, or -1.
int64_t LastWithResidue(int64_t keep, int m, int j) {
  const int64_t top = keep - 1;
  if (top < j) return -1;
  return top - ((top - j) % m);
}

// softmax(logits / temperature) in double.
std::vector<double> DraftProbabilities(const std::vector<float>& logits, double temperature) {
  const double mx = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p(logits.size());
  double sum = 0;
  for (size_t v = 0; v < p.size(); ++v) sum += p[v] = std::exp((logits[v] - mx) / temperature);
  for (double& x : p) x /= sum;
  return p;
}

}  // namespace

void SaveCheckpoint(const SequenceState& st, VerifyCheckpoint* cp) {
  cp->tokens = static_cast<int64_t>(st.tokens.size());
  cp->swa = st.swa;
  cp->kv.resize(st.kv.size());
  for (size_t i = 0; i < st.kv.size(); ++i) {
    cp->kv[i].kv_state = st.kv[i].kv_state;
    cp->kv[i].score_state = st.kv[i].score_state;
  }
}

std::vector<int> CaptureLayers(const EngineConfig& c, const DSparkConfig& dc) {
  std::vector<int> layers = dc.target_layer_ids;
  for (int l : c.kv_source_layer_ids) {
    if (c.ratio(l) > 1 && std::find(layers.begin(), layers.end(), l) == layers.end())
      layers.push_back(l);
  }
  return layers;
}

Status RollbackTo(const EngineConfig& c, const ModelWeights& w, const VerifyCheckpoint& cp,
                  const AttnInputCapture& cap, int64_t keep, SequenceState* st) {
  const int64_t n0 = cp.tokens, end = static_cast<int64_t>(st->tokens.size());
  const int D = c.hidden_size, hd = c.head_dim, W = c.sliding_window;
  if (keep < n0 || keep > end) return Status::InvalidArgument("rollback: keep out of range");
  if (end - n0 > W) return Status::InvalidArgument("rollback: verify longer than the window");
  if (cp.swa.size() != st->swa.size() || cp.kv.size() != st->kv.size())
    return Status::InvalidArgument("rollback: checkpoint of another state");
  if (keep == end) return Status::Ok();
  // Check every captured row needed before changing anything.
  std::vector<const float*> rows;  // per (source, slot) recomputed from the capture, else null
  for (const KvSourceCache& k : st->kv) {
    for (int j = 0; j < k.ratio; ++j) {
      const int64_t p = LastWithResidue(keep, k.ratio, j);
      const float* row = nullptr;
      if (k.ratio > 1 && p >= n0) {
        const int s = cap.Slot(k.layer);
        if (s < 0 || static_cast<size_t>(s) >= cap.first_pos.size() || cap.first_pos[s] < 0)
          return Status::InvalidArgument("rollback: the capture lacks a kv source");
        const int64_t f = cap.first_pos[s];
        if (p < f || p >= f + static_cast<int64_t>(cap.normed[s].size()) / D)
          return Status::InvalidArgument("rollback: the capture lacks a kept position");
        row = cap.normed[s].data() + (p - f) * D;
      }
      rows.push_back(row);
    }
  }
  // SWA rings: the slots of positions [keep, end) held positions W earlier before the verify.
  for (size_t l = 0; l < st->swa.size(); ++l) {
    SwaRing& r = st->swa[l];
    const SwaRing& o = cp.swa[l];
    const size_t sb = static_cast<size_t>(r.dim) / 32;
    for (int64_t p = keep; p < end; ++p) {
      const size_t slot = static_cast<size_t>(p % r.window);
      std::memcpy(r.values.data() + slot * r.dim, o.values.data() + slot * r.dim, r.dim * 4);
      std::memcpy(r.data.data() + slot * r.dim, o.data.data() + slot * r.dim, r.dim);
      std::memcpy(r.scales.data() + slot * sb, o.scales.data() + slot * sb, sb);
      r.stamps[slot] = o.stamps[slot];  // the checkpoint's bytes, so its stamp
    }
    r.end = std::min(r.end, keep);
  }
  // Global KV: entries of complete groups of the kept tokens; the partial group rebuilt.
  ThreadPool pool(1);
  size_t ri = 0;
  for (size_t i = 0; i < st->kv.size(); ++i) {
    KvSourceCache& k = st->kv[i];
    const int m = k.ratio;
    const size_t e = static_cast<size_t>(keep / m);
    k.Truncate(static_cast<int64_t>(e));
    k.consumed = keep;
    const std::string p = "layers." + std::to_string(k.layer) + ".attn.compressor.";
    for (int j = 0; j < m; ++j, ++ri) {
      float* kv = k.kv_state.data() + static_cast<size_t>(j) * hd;
      float* sc = k.score_state.data() + static_cast<size_t>(j) * hd;
      if (rows[ri] == nullptr) {
        std::memcpy(kv, cp.kv[i].kv_state.data() + static_cast<size_t>(j) * hd, hd * 4);
        std::memcpy(sc, cp.kv[i].score_state.data() + static_cast<size_t>(j) * hd, hd * 4);
        continue;
      }
      const float* wkv = w.F32(p + "wkv.weight");
      const float* wgate = w.F32(p + "wgate.weight");
      if (wkv == nullptr || wgate == nullptr)
        return Status::Internal("rollback: compressor weights missing");
      MatMulCpu(&pool, rows[ri], 1, D, wkv, hd, kv);
      MatMulCpu(&pool, rows[ri], 1, D, wgate, hd, sc);
    }
  }
  st->tokens.resize(static_cast<size_t>(keep));
  return Status::Ok();
}

SpeculativeDecoder::SpeculativeDecoder(Engine* engine, const DSpark* draft,
                                       const ModelWeights* weights, DraftScheduler* scheduler,
                                       const SpeculativeOptions& options, Sampler* sampler)
    : engine_(engine),
      draft_(draft),
      weights_(weights),
      scheduler_(scheduler),
      options_(options),
      sampler_(sampler) {
  capture_.layers = CaptureLayers(engine->config(), draft->dconfig());
  backlog_.layers = draft->target_layers();
  backlog_.Clear();
  step_capture_.layers = draft->target_layers();
  step_capture_.record_normed = false;  // the draft's context reads stream_mean only
  step_capture_.Clear();
  stats_.chosen_b.assign(draft->dconfig().block_size + 1, 0);
}

Status SpeculativeDecoder::Start(SequenceState* st, std::span<const int32_t> prompt,
                                 int32_t* first) {
  std::vector<float> logits;
  KVTIER_RETURN_IF_ERROR(Prefill(st, prompt, &logits));
  pending_ = sampler_->greedy() ? sampler_->Sample(logits)
                                : sampler_->SampleFrom(sampler_->Probabilities(logits));
  *first = pending_;
  return Status::Ok();
}

Status SpeculativeDecoder::StartWith(SequenceState* st, std::span<const int32_t> prompt,
                                     int32_t next) {
  if (next < 0 || next >= engine_->config().vocab_size)
    return Status::InvalidArgument("speculative: token outside the vocabulary");
  std::vector<float> logits;
  KVTIER_RETURN_IF_ERROR(Prefill(st, prompt, &logits));
  pending_ = next;
  return Status::Ok();
}

Status SpeculativeDecoder::Attach(int32_t next, DraftContext context) {
  if (next < 0 || next >= engine_->config().vocab_size)
    return Status::InvalidArgument("speculative: token outside the vocabulary");
  ctx_ = std::move(context);
  backlog_.Clear();
  pending_ = next;
  round_n_ = -1;
  return Status::Ok();
}

Status SpeculativeDecoder::RoundLogits(int64_t keep, std::vector<float>* logits) const {
  const int64_t V = engine_->config().vocab_size;
  const int64_t rows = static_cast<int64_t>(round_logits_.size()) / V;
  if (round_n_ < 0 || keep < round_n_ + 1 || keep > round_n_ + rows)
    return Status::InvalidArgument("speculative: no round, or keep outside its kept tokens");
  const int64_t row = keep - 1 - round_n_;
  logits->assign(round_logits_.begin() + row * V, round_logits_.begin() + (row + 1) * V);
  return Status::Ok();
}

Status SpeculativeDecoder::TruncateRound(SequenceState* st, int64_t keep,
                                         std::vector<float>* logits) {
  const int64_t V = engine_->config().vocab_size;
  const int64_t end = static_cast<int64_t>(st->tokens.size());
  if (round_n_ < 0 || round_n_ + static_cast<int64_t>(round_logits_.size()) / V != end)
    return Status::InvalidArgument("speculative: TruncateRound on a state the round did not leave");
  KVTIER_RETURN_IF_ERROR(RoundLogits(keep, logits));
  if (keep < end)
    KVTIER_RETURN_IF_ERROR(RollbackTo(engine_->config(), *weights_, cp_, capture_, keep, st));
  pending_ = -1;
  round_n_ = -1;
  return Status::Ok();
}

Status SpeculativeDecoder::Prefill(SequenceState* st, std::span<const int32_t> prompt,
                                   std::vector<float>* logits_out) {
  if (!st->tokens.empty()) return Status::InvalidArgument("speculative: needs an empty state");
  std::vector<float>& logits = *logits_out;
  // Only the last W positions feed the draft: the capture of a long prompt stays W rows.
  capture_.from_pos =
      std::max<int64_t>(0, static_cast<int64_t>(prompt.size()) - engine_->config().sliding_window);
  engine_->set_attn_capture(&capture_);
  Status s = engine_->Forward(st, prompt, false, &logits);
  engine_->set_attn_capture(nullptr);
  KVTIER_RETURN_IF_ERROR(s);
  ctx_.Clear();
  backlog_.Clear();
  round_n_ = -1;
  const int64_t n = static_cast<int64_t>(prompt.size());
  const int64_t from = std::max<int64_t>(0, n - engine_->config().sliding_window);
  KVTIER_RETURN_IF_ERROR(draft_->Observe(capture_, from, n - from, &ctx_));
  capture_.from_pos = 0;
  return Status::Ok();
}

namespace {
using Clock = std::chrono::steady_clock;
uint64_t Micros(Clock::time_point a, Clock::time_point b) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(b - a).count());
}
}  // namespace

Status SpeculativeDecoder::DraftPhase(bool draft, DraftResult* d) {
  const int K = draft_->dconfig().block_size;
  std::vector<double> u;
  if (!sampler_->greedy()) {
    for (int k = 0; k < K; ++k) u.push_back(sampler_->NextUniform());
  }
  if (!draft) return Status::Ok();
  const auto tb = Clock::now();
  KVTIER_RETURN_IF_ERROR(FlushBacklog());
  const auto td = Clock::now();
  stats_.rollback_us += Micros(tb, td);  // the context update, as in Accept
  KVTIER_RETURN_IF_ERROR(draft_->Draft(ctx_, pending_, sampler_->temperature(), u, d));
  const auto te = Clock::now();
  stats_.draft_us += Micros(td, te);
  ++stats_.drafts;
  last_draft_tokens_ = d->tokens;
  last_draft_confidence_ = d->confidence;
  // The cost is recorded by the round (the drafting's whole cost outside the verify pass).
  if (scheduler_ != nullptr) scheduler_->RecordDraft(0, d->confidence);
  return Status::Ok();
}

Status SpeculativeDecoder::Defer(const AttnInputCapture& capture, int64_t from, int64_t count) {
  const int D = engine_->config().hidden_size;
  // The context keeps W + 1 rows; the backlog is cut back to them only when it holds twice
  // as many (FlushBacklog observes the last W + 1), so an undrafted round moves no rows.
  const size_t rows_max = static_cast<size_t>(engine_->config().sliding_window) + 1;
  const int64_t have = backlog_.first_pos.empty() || backlog_.first_pos[0] < 0
                           ? 0
                           : static_cast<int64_t>(backlog_.stream_mean[0].size()) / D;
  if (have > 0 && backlog_.first_pos[0] + have != from) {
    // Not contiguous with the backlog: the context would restart at `from` anyway.
    backlog_.Clear();
  }
  for (size_t i = 0; i < backlog_.layers.size(); ++i) {
    const int s = capture.Slot(backlog_.layers[i]);
    if (s < 0 || capture.first_pos[s] < 0 || from < capture.first_pos[s] ||
        (from - capture.first_pos[s] + count) * D >
            static_cast<int64_t>(capture.stream_mean[s].size()))
      return Status::InvalidArgument("speculative: the capture lacks the accepted positions");
    std::vector<float>& m = backlog_.stream_mean[i];
    if (backlog_.first_pos[i] < 0) backlog_.first_pos[i] = from;
    const float* src = capture.stream_mean[s].data() + (from - capture.first_pos[s]) * D;
    m.insert(m.end(), src, src + count * D);
    const size_t rows = m.size() / static_cast<size_t>(D);
    if (rows > 2 * rows_max) {
      m.erase(m.begin(), m.begin() + static_cast<int64_t>((rows - rows_max) * D));
      backlog_.first_pos[i] += static_cast<int64_t>(rows - rows_max);
    }
  }
  return Status::Ok();
}

Status SpeculativeDecoder::FlushBacklog() {
  if (backlog_.first_pos.empty() || backlog_.first_pos[0] < 0) return Status::Ok();
  const int64_t rows =
      static_cast<int64_t>(backlog_.stream_mean[0].size()) / engine_->config().hidden_size;
  // Observe projects only the rows the context keeps, in one MatMul.
  Status s = draft_->Observe(backlog_, backlog_.first_pos[0], rows, &ctx_);
  backlog_.Clear();
  return s;
}

Status SpeculativeDecoder::Round(SequenceState* st, std::vector<int32_t>* out) {
  if (pending_ < 0) return Status::InvalidArgument("speculative: Start first");
  const int K = draft_->dconfig().block_size;
  const bool draft = options_.scheduler && scheduler_ != nullptr ? scheduler_->ShouldDraft()
                                                                 : options_.draft_len > 0;
  if (!draft) {  // a plain decode step
    std::vector<float> logits;
    AttnInputCapture* cap = StepCapture(*st);
    engine_->set_attn_capture(cap);
    const bool timed = scheduler_ != nullptr && scheduler_->TimeUndrafted(1);
    const auto t0 = Clock::now();
    const double c0 = timed ? scheduler_->Now() : 0;
    Status s = engine_->Forward(st, std::span<const int32_t>(&pending_, 1), false, &logits);
    const double c1 = timed ? scheduler_->Now() : 0;
    const auto t1 = Clock::now();
    engine_->set_attn_capture(nullptr);
    KVTIER_RETURN_IF_ERROR(s);
    stats_.verify_us += Micros(t0, t1);
    if (timed) scheduler_->RecordUndrafted(1, c1 - c0);
    return FinishStep(st, logits, out);
  }
  DraftResult d;
  const double cd = scheduler_ != nullptr ? scheduler_->Now() : 0;
  KVTIER_RETURN_IF_ERROR(DraftPhase(draft, &d));
  int B = 0;
  if (draft) {
    B = std::clamp(options_.draft_len, 0, K);
    if (options_.scheduler && scheduler_ != nullptr)
      B = scheduler_->Choose({d.confidence}, scheduler_->probing())[0];
  }
  std::vector<int32_t> verify = {pending_};
  verify.insert(verify.end(), d.tokens.begin(), d.tokens.begin() + B);
  // Engram rows of the drafted tokens are requested now (a refused hint changes nothing); a
  // round without draft tokens is a plain decode step (nothing to roll back).
  if (B > 0) {
    (void)engine_->PrefetchEngram(*st, verify);
    SaveCheckpoint(*st, &cp_);
  }
  const int64_t n = static_cast<int64_t>(st->tokens.size());
  std::vector<float> logits;
  engine_->set_attn_capture(&capture_);
  const auto t0 = Clock::now();
  const double c0 = scheduler_ != nullptr ? scheduler_->Now() : 0;
  Status s = engine_->Forward(st, verify, true, &logits);
  const double c1 = scheduler_ != nullptr ? scheduler_->Now() : 0;
  const auto t1 = Clock::now();
  stats_.verify_us += Micros(t0, t1);
  engine_->set_attn_capture(nullptr);
  KVTIER_RETURN_IF_ERROR(s);
  KVTIER_RETURN_IF_ERROR(Accept(st, d, B, n, logits.data(), &capture_, out));
  if (scheduler_ != nullptr) {
    scheduler_->Record(B + 1, c1 - c0);
    scheduler_->RecordDraft((c0 - cd) + (scheduler_->Now() - c1), {});
  }
  return Status::Ok();
}

bool SpeculativeDecoder::DraftsRound(std::span<SpeculativeDecoder* const> decs) {
  if (decs.empty() || decs[0] == nullptr) return false;
  const SpeculativeDecoder* lead = decs[0];
  if (lead->options_.scheduler && lead->scheduler_ != nullptr)
    return lead->scheduler_->ShouldDraft(static_cast<int>(decs.size()));
  for (const SpeculativeDecoder* d : decs) {
    if (d != nullptr && d->options_.draft_len > 0) return true;
  }
  return false;
}

AttnInputCapture* SpeculativeDecoder::StepCapture(const SequenceState& st, int sequences) {
  step_n_ = static_cast<int64_t>(st.tokens.size());
  const int lead = engine_->config().sliding_window + 1;  // the rows a draft's context keeps
  step_captured_ = options_.scheduler && scheduler_ != nullptr
                       ? scheduler_->MayDraftWithin(sequences, lead)
                       : options_.draft_len > 0;
  if (!step_captured_) return nullptr;
  step_capture_.from_pos = step_n_;
  return &step_capture_;
}

Status SpeculativeDecoder::FinishStep(SequenceState* st, std::span<const float> logits,
                                      std::vector<int32_t>* out) {
  if (pending_ < 0 || step_n_ < 0 || static_cast<int64_t>(st->tokens.size()) != step_n_ + 1 ||
      st->tokens.back() != pending_ ||
      static_cast<int64_t>(logits.size()) != engine_->config().vocab_size)
    return Status::InvalidArgument(
        "speculative: FinishStep needs the StepCapture state extended by the pending token");
  const int64_t n = step_n_;
  step_n_ = -1;
  return Accept(st, DraftResult{}, 0, n, logits.data(), step_captured_ ? &step_capture_ : nullptr,
                out);
}

Status SpeculativeDecoder::RoundBatch(std::span<SpeculativeDecoder* const> decs,
                                      std::span<SequenceState* const> states,
                                      std::vector<std::vector<int32_t>>* outs) {
  KVTIER_RETURN_IF_ERROR(CheckBatch(decs, states, outs));
  return RoundBatch(decs, states, outs, DraftsRound(decs));
}

Status SpeculativeDecoder::CheckBatch(std::span<SpeculativeDecoder* const> decs,
                                      std::span<SequenceState* const> states,
                                      const std::vector<std::vector<int32_t>>* outs) {
  const size_t R = decs.size();
  if (R == 0 || states.size() != R || outs == nullptr || outs->size() != R)
    return Status::InvalidArgument(
        "speculative: RoundBatch needs one state and output per decoder");
  const SpeculativeDecoder* lead = decs[0];
  for (size_t i = 0; i < R; ++i) {
    const SpeculativeDecoder* d = decs[i];
    if (d == nullptr || states[i] == nullptr)
      return Status::InvalidArgument("speculative: RoundBatch: null decoder or state");
    if (d->pending_ < 0) return Status::InvalidArgument("speculative: Start first");
    if (d->engine_ != lead->engine_ || d->draft_ != lead->draft_ ||
        d->scheduler_ != lead->scheduler_)
      return Status::InvalidArgument("speculative: RoundBatch decoders share no engine");
    for (size_t j = 0; j < i; ++j) {
      if (decs[j] == d || states[j] == states[i])
        return Status::InvalidArgument("speculative: RoundBatch: a decoder or state twice");
    }
  }
  return Status::Ok();
}

Status SpeculativeDecoder::RoundBatch(std::span<SpeculativeDecoder* const> decs,
                                      std::span<SequenceState* const> states,
                                      std::vector<std::vector<int32_t>>* outs, bool draft) {
  KVTIER_RETURN_IF_ERROR(CheckBatch(decs, states, outs));
  const size_t R = decs.size();
  const SpeculativeDecoder* lead = decs[0];
  Engine* engine = lead->engine_;
  if (!draft) {
    // Undrafted: one plain decode row per sequence, the last logits only.
    std::vector<std::span<const int32_t>> spans;
    std::vector<AttnInputCapture*> caps;
    for (size_t i = 0; i < R; ++i) {
      spans.emplace_back(&decs[i]->pending_, 1);
      caps.push_back(decs[i]->StepCapture(*states[i], static_cast<int>(R)));
    }
    thread_local std::vector<std::vector<float>> undrafted_last_slot;
    ReusedRows reused(undrafted_last_slot);
    std::vector<std::vector<float>>& last = reused.rows;
    DraftScheduler* timer =
        lead->scheduler_ != nullptr && lead->scheduler_->TimeUndrafted(static_cast<int>(R))
            ? lead->scheduler_
            : nullptr;
    const auto t0 = Clock::now();
    const double c0 = timer != nullptr ? timer->Now() : 0;
    KVTIER_RETURN_IF_ERROR(engine->ForwardBatch(states, spans, &last, nullptr, caps));
    const double c1 = timer != nullptr ? timer->Now() : 0;
    const auto t1 = Clock::now();
    if (timer != nullptr) timer->RecordUndrafted(static_cast<int>(R), c1 - c0);
    for (size_t i = 0; i < R; ++i) {
      decs[i]->stats_.verify_us += Micros(t0, t1);
      KVTIER_RETURN_IF_ERROR(decs[i]->FinishStep(states[i], last[i], &(*outs)[i]));
    }
    return Status::Ok();
  }
  DraftScheduler* sched = lead->options_.scheduler ? lead->scheduler_ : nullptr;
  const int K = lead->draft_->dconfig().block_size;
  // A probe (drafting did not pay lately) drafts for one sequence only, in turn.
  const size_t probe = draft && sched != nullptr && sched->probing()
                           ? static_cast<size_t>(lead->stats_.rounds % R)
                           : R;
  DraftScheduler* timer = lead->scheduler_;
  // The drafting's cost outside the verify pass (context updates, draft passes, checkpoints,
  // acceptance, rollbacks) is timed from here and after the verify pass, and recorded as the
  // draft cost of each sequence that drafted.
  const double cd = timer != nullptr ? timer->Now() : 0;
  std::vector<DraftResult> d(R);
  std::vector<int> B(R, 0);
  int drafted = 0;
  for (size_t i = 0; i < R; ++i) {
    // Without the scheduler a decoder whose draft_len is 0 drafts nothing (its B is 0).
    const bool drafts =
        probe == R ? sched != nullptr || decs[i]->options_.draft_len > 0 : i == probe;
    KVTIER_RETURN_IF_ERROR(decs[i]->DraftPhase(drafts, &d[i]));
    if (!d[i].tokens.empty()) B[i] = std::clamp(decs[i]->options_.draft_len, 0, K);
    drafted += d[i].tokens.empty() ? 0 : 1;
  }
  if (draft && sched != nullptr) {
    std::vector<std::vector<float>> conf(R);
    for (size_t i = 0; i < R; ++i) conf[i] = d[i].confidence;
    B = sched->Choose(conf, sched->probing());
  }
  std::vector<std::vector<int32_t>> verify(R);
  std::vector<std::span<const int32_t>> spans;
  std::vector<AttnInputCapture*> caps;
  std::vector<int64_t> n(R);
  int tokens = 0;
  for (size_t i = 0; i < R; ++i) {
    verify[i] = {decs[i]->pending_};
    verify[i].insert(verify[i].end(), d[i].tokens.begin(), d[i].tokens.begin() + B[i]);
    if (B[i] > 0) {
      (void)engine->PrefetchEngram(*states[i], verify[i]);
      SaveCheckpoint(*states[i], &decs[i]->cp_);
    }
    n[i] = static_cast<int64_t>(states[i]->tokens.size());
    spans.emplace_back(verify[i]);
    caps.push_back(&decs[i]->capture_);
    tokens += 1 + B[i];
  }
  thread_local std::vector<std::vector<float>> last_slot, all_slot;
  ReusedRows reused_last(last_slot), reused_all(all_slot);
  std::vector<std::vector<float>>&last = reused_last.rows, &all = reused_all.rows;
  const auto t0 = Clock::now();
  const double c0 = timer != nullptr ? timer->Now() : 0;
  KVTIER_RETURN_IF_ERROR(engine->ForwardBatch(states, spans, &last, &all, caps));
  const double c1 = timer != nullptr ? timer->Now() : 0;
  const auto t1 = Clock::now();
  for (size_t i = 0; i < R; ++i) {
    decs[i]->stats_.verify_us += Micros(t0, t1);
    KVTIER_RETURN_IF_ERROR(decs[i]->Accept(states[i], d[i], B[i], n[i], all[i].data(),
                                           &decs[i]->capture_, &(*outs)[i]));
  }
  if (timer != nullptr) {
    timer->Record(tokens, c1 - c0);
    if (drafted > 0) timer->RecordDraft(((c0 - cd) + (timer->Now() - c1)) / drafted, {});
  }
  return Status::Ok();
}

Status SpeculativeDecoder::Accept(SequenceState* st, const DraftResult& d, int B, int64_t n,
                                  const float* logits, const AttnInputCapture* capture,
                                  std::vector<int32_t>* out) {
  const bool greedy = sampler_->greedy();
  const int V = engine_->config().vocab_size;
  auto row = [&](int k) {
    return std::span<const float>(logits + static_cast<int64_t>(k) * V, static_cast<size_t>(V));
  };
  int a = 0;
  int32_t bonus = -1;
  for (; a < B; ++a) {
    const std::span<const float> r = row(a);
    const int32_t dk = d.tokens[a];
    if (greedy) {
      const int32_t t = sampler_->Sample(r);
      if (t != dk) {
        bonus = t;
        break;
      }
      continue;
    }
    std::vector<double> p = sampler_->Probabilities(r);
    const std::vector<double> q = DraftProbabilities(d.logits[a], sampler_->temperature());
    if (sampler_->NextUniform() < std::min(1.0, p[dk] / q[dk])) continue;
    for (int v = 0; v < V; ++v) p[v] = std::max(0.0, p[v] - q[v]);
    bonus = sampler_->SampleFrom(p);
    if (bonus < 0) bonus = sampler_->SampleFrom(sampler_->Probabilities(r));  // p == q exactly
    break;
  }
  if (bonus < 0) {
    const std::span<const float> r = row(B);
    bonus = greedy ? sampler_->Sample(r) : sampler_->SampleFrom(sampler_->Probabilities(r));
  }
  const int64_t keep = n + 1 + a;
  if (scheduler_ != nullptr && B > 0) scheduler_->RecordVerified(d.confidence, B, a);
  const auto tr = Clock::now();
  if (B > 0)
    KVTIER_RETURN_IF_ERROR(RollbackTo(engine_->config(), *weights_, cp_, capture_, keep, st));
  if (capture != nullptr) {
    KVTIER_RETURN_IF_ERROR(Defer(*capture, n, keep - n));
  } else {
    backlog_.Clear();
    ctx_.Clear();
  }
  stats_.rollback_us += Micros(tr, Clock::now());
  out->insert(out->end(), d.tokens.begin(), d.tokens.begin() + a);
  out->push_back(bonus);
  pending_ = bonus;
  round_n_ = n;
  round_logits_.assign(logits, logits + static_cast<int64_t>(a + 1) * V);
  ++stats_.rounds;
  stats_.drafted += B;
  stats_.accepted += a;
  stats_.rejections += a < B ? 1 : 0;
  stats_.emitted += a + 1;
  stats_.rolled_back += B - a;
  ++stats_.chosen_b[B];
  return Status::Ok();
}

}  // namespace kvtier::engine
