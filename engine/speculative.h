// Speculative decoding with the DSpark draft (reference §9): draft, verify in one batched
// Forward, accept losslessly, roll rejected positions back out of the caches.
//
// One round on a sequence of n tokens whose next token x_n is known (emitted, not yet run):
//   1. the draft proposes K tokens d_1..d_K after x_n with confidences c_k;
//   2. B in [0, K] of them are chosen (fixed, or by the DraftScheduler, draft_scheduler.h),
//      and their Engram rows are requested at once (Engine::PrefetchEngram), before the
//      verify pass;
//   3. Forward(state, [x_n, d_1..d_B], all_logits): row k is the target's distribution after d_k;
//   4. greedy: accept the longest prefix with d_k == argmax(row k-1), then the target's own
//      argmax of the next row; sampling: accept d_k with probability min(1, p(d_k)/q(d_k))
//      (p: the Sampler's distribution of row k-1; q: the draft's softmax(logits / T)), on
//      rejection draw from normalise(max(0, p - q)) and stop; if all B are accepted draw the
//      bonus from row B. The emitted tokens are distributed exactly as plain sampling's.
//   5. Rollback: the state keeps n + 1 + a tokens (a accepted); rejected positions leave no
//      trace: SWA ring slots they overwrote are restored from a checkpoint taken before the
//      verify, appended global KV entries past the kept tokens are truncated, and the
//      compressor's partial group is rebuilt from the checkpoint and, for kept verify
//      positions, recomputed from the captured attention input (the compressor's projection of
//      one row is row-independent, ops.h), so the state equals plain decoding's bit for bit.
//
// Several sequences (SpeculativeDecoder::RoundBatch): every decoder drafts, the DraftScheduler
// picks B across all of them (candidates by descending survival), and the drafts of all are
// verified in one Engine::ForwardBatch pass (all rows' logits, one capture per sequence); each
// sequence then accepts and rolls back as in its own round.
//
// Undrafted rounds (the scheduler says drafting does not pay, or every fixed draft length is 0)
// cost what plain decoding costs: no draft pass, no checkpoint, no all-rows logits and no
// rollback captures; the pass runs the pending tokens as plain decode rows (the last logits
// only) and records just the draft's target layers' inputs of the new positions (a copy of
// target layers x hidden floats per token), which wait unprojected until the next draft pass
// needs them (one DSpark::Observe over all of them then). A caller with rows of its own (a
// server's prefill chunks) runs the undrafted round inside its own pass: StepCapture, then
// FinishStep. A sequence may switch between drafted and undrafted rounds at any round; its
// tokens and state are plain decoding's either way (greedy).
//
// Thread safety: a SpeculativeDecoder drives one sequence on one thread; the Engine and DSpark
// may be shared only as their own headers allow.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "common/status.h"
#include "engine/draft_scheduler.h"
#include "engine/dspark.h"
#include "engine/model.h"
#include "engine/sampler.h"

namespace kvtier::engine {

// The part of a SequenceState a verify pass may overwrite, saved before it.
struct VerifyCheckpoint {
  int64_t tokens = 0;
  std::vector<SwaRing> swa;  // full copies (W slots per layer: small)
  struct Source {
    std::vector<float> kv_state, score_state;
  };
  std::vector<Source> kv;
};

void SaveCheckpoint(const SequenceState& state, VerifyCheckpoint* cp);

// Truncates `state` (extended by one Forward from cp.tokens, whose attention inputs of every
// KV source with ratio > 1 are in `capture`) to `keep` tokens, keep in [cp.tokens,
// state->tokens.size()]. InvalidArgument when keep is out of range, the verify ran more than
// sliding_window tokens, or the capture lacks a needed row (the state is then unchanged).
Status RollbackTo(const EngineConfig& config, const ModelWeights& weights,
                  const VerifyCheckpoint& cp, const AttnInputCapture& capture, int64_t keep,
                  SequenceState* state);

// The layers a capture needs for rollback and drafting: the draft's targets and every KV
// source with ratio > 1.
std::vector<int> CaptureLayers(const EngineConfig& config, const DSparkConfig& dconfig);

struct SpeculativeOptions {
  // Draft tokens verified per round when fixed (scheduler == false), in [0, block_size].
  int draft_len = 5;
  // true: the DraftScheduler picks B each round from the confidences and measured rates.
  bool scheduler = false;
};

// Monotonic counters of a SpeculativeDecoder.
struct SpeculativeStats {
  uint64_t rounds = 0;             // verify passes
  uint64_t drafts = 0;             // draft passes (the scheduler may skip them)
  uint64_t drafted = 0;            // draft tokens verified (sum of B)
  uint64_t accepted = 0;           // of those, accepted
  uint64_t rejections = 0;         // rounds that rejected a draft token
  uint64_t emitted = 0;            // tokens emitted by rounds (accepted + one per round)
  uint64_t rolled_back = 0;        // verify positions removed from the caches
  std::vector<uint64_t> chosen_b;  // rounds per chosen B (index B)
  uint64_t draft_us = 0, verify_us = 0, rollback_us = 0;  // wall time of the three phases
};

class SpeculativeDecoder {
 public:
  // engine, draft and scheduler are not owned and must outlive the decoder; scheduler may be
  // null when options.scheduler is false. The sampler decides greedy or sampling.
  SpeculativeDecoder(Engine* engine, const DSpark* draft, const ModelWeights* weights,
                     DraftScheduler* scheduler, const SpeculativeOptions& options,
                     Sampler* sampler);

  // Prefills `prompt` into an empty state with Forward and draws the first token (emitted).
  Status Start(SequenceState* state, std::span<const int32_t> prompt, int32_t* first);
  // As Start, with the first token given (e.g. the previous turn's last): next is pending.
  Status StartWith(SequenceState* state, std::span<const int32_t> prompt, int32_t next);
  // Starts on a state computed elsewhere (a server's chunked prefill, a resumed session):
  // `next` is the token to run next (emitted, pending) and `context` the draft's rows of the
  // state's last positions (DSpark::Observe over the attention inputs they ran with; empty
  // when unknown: the first round then drafts without a context). InvalidArgument for a
  // token outside the vocabulary.
  Status Attach(int32_t next, DraftContext context);
  // The target's logits after the first `keep` tokens of the state the last round left
  // (keep in [n + 1, state size] for a round of n tokens): the verify row of position
  // keep - 1. InvalidArgument when no round ran since Start/Attach or keep is out of range.
  Status RoundLogits(int64_t keep, std::vector<float>* logits) const;
  // After a round of n tokens: truncates `state` to `keep` tokens, keep in [n + 1, state
  // size], removing accepted positions past it from every cache exactly as a rejection would
  // (for a caller that ends the sequence inside the round's emitted tokens: a stop string, a
  // token limit), and gives the target's logits after the kept tokens (the verify row of
  // position keep - 1). The decoder must be attached or started again before its next round.
  // InvalidArgument (nothing changed) when no round ran since or keep is out of range.
  Status TruncateRound(SequenceState* state, int64_t keep, std::vector<float>* logits);
  // One round (draft, verify, accept, roll back); appends the emitted tokens (>= 1) to out.
  Status Round(SequenceState* state, std::vector<int32_t>* out);
  // Whether the next round of these decoders drafts: the first one's scheduler says so
  // (DraftScheduler::ShouldDraft(decoders.size()), which counts the rounds it says no: ask
  // once per round), or, without the scheduler, some decoder's fixed draft_len is > 0. False for
  // no decoders.
  static bool DraftsRound(std::span<SpeculativeDecoder* const> decoders);
  // The two halves of an undrafted round run inside a caller's own Engine::ForwardBatch: put
  // pending() as this state's tokens (one row), StepCapture(state) as its capture (owned by the
  // decoder, valid until its next round), take that row's last-token logits, then FinishStep
  // with them: it samples the next token as a round with B = 0 does (appended to out, the new
  // pending token) and keeps the draft's rows of the run position. RoundLogits and
  // TruncateRound then work as after a round. FinishStep: InvalidArgument (nothing changed)
  // unless the state is the one StepCapture saw extended by exactly pending(), and logits has
  // vocab_size floats.
  // `sequences`: the round's undrafted rows (the R its DraftsRound asked about). Returns
  // nullptr instead (nothing to capture: pass no capture for this row, FinishStep keeps no
  // rows) when no draft can come within the draft context's sliding_window + 1 rounds
  // (DraftScheduler::MayDraftWithin; fixed draft_len 0: never): capturing the target layers'
  // rows costs about 1 % of a decode step of the trained miniature, and a draft after a gap
  // restarts its context from the rows captured since (fewer rows: lower acceptance only).
  AttnInputCapture* StepCapture(const SequenceState& state, int sequences = 1);
  Status FinishStep(SequenceState* state, std::span<const float> logits, std::vector<int32_t>* out);
  // One round of several sequences, verified in one Engine::ForwardBatch pass: decoders[i]
  // (started) drives states[i] and appends its emitted tokens to (*outs)[i]. Every decoder must
  // share the first one's engine, draft and scheduler; the first one's options.scheduler
  // decides whether the scheduler picks B across all (otherwise each uses its own draft_len).
  // Each sequence's tokens and state are those its own Round would give (greedy: plain
  // greedy's). InvalidArgument (nothing changed) for no decoders, mismatched sizes, a decoder
  // or state twice, or decoders that do not share those; a failed verify leaves every state
  // unusable, as ForwardBatch.
  // Asks DraftsRound itself; an undrafted round runs as one plain ForwardBatch of the pending
  // tokens (StepCapture / FinishStep for each sequence).
  static Status RoundBatch(std::span<SpeculativeDecoder* const> decoders,
                           std::span<SequenceState* const> states,
                           std::vector<std::vector<int32_t>>* outs);
  // The same with the decision made (DraftsRound, asked once for this round).
  static Status RoundBatch(std::span<SpeculativeDecoder* const> decoders,
                           std::span<SequenceState* const> states,
                           std::vector<std::vector<int32_t>>* outs, bool draft);

  const SpeculativeStats& stats() const { return stats_; }
  // The next token (emitted, not yet run by the target).
  int32_t pending() const { return pending_; }
  // The last draft pass's tokens and confidences (K each; empty before the first), for
  // inspection.
  const std::vector<int32_t>& last_draft_tokens() const { return last_draft_tokens_; }
  const std::vector<float>& last_draft_confidence() const { return last_draft_confidence_; }

 private:
  Status Prefill(SequenceState* state, std::span<const int32_t> prompt, std::vector<float>* logits);
  // RoundBatch's argument checks (nothing changed when they fail).
  static Status CheckBatch(std::span<SpeculativeDecoder* const> decoders,
                           std::span<SequenceState* const> states,
                           const std::vector<std::vector<int32_t>>* outs);
  // Round's phases: the draft pass (when `draft`; the sampling uniforms are drawn either way);
  // then, after the verify pass of n + 1 + B tokens gave `logits` ((B + 1) x vocab), the
  // acceptance, the rollback, the draft context's update and the counters.
  Status DraftPhase(bool draft, DraftResult* d);
  // The draft context is brought up to date lazily: the target layers' captured rows of
  // accepted positions wait in backlog_ (at most sliding_window + 1 rows, as many as the
  // context keeps) and DSpark::Observe runs on them only before the next draft pass, so rounds
  // the scheduler runs without drafting pay no draft-side projection (main_x of a row does not
  // depend on other rows: the context ends up the same).
  // Defer keeps the target layers' rows of positions [from, from + count) from `capture`.
  Status Defer(const AttnInputCapture& capture, int64_t from, int64_t count);
  Status FlushBacklog();
  // capture: the pass's capture of the state (capture_ or step_capture_); nullptr: an
  // undrafted step that captured nothing (StepCapture), after which the draft's context
  // restarts from the rows captured later (the backlog and the context are cleared).
  Status Accept(SequenceState* state, const DraftResult& d, int B, int64_t n, const float* logits,
                const AttnInputCapture* capture, std::vector<int32_t>* out);
  Engine* engine_;
  const DSpark* draft_;
  const ModelWeights* weights_;
  DraftScheduler* scheduler_;
  SpeculativeOptions options_;
  Sampler* sampler_;
  AttnInputCapture capture_;
  DraftContext ctx_;
  AttnInputCapture backlog_;  // target layers only; first_pos[i] equal for all
  // Undrafted rounds: the target layers only, from the run position (step_n_).
  AttnInputCapture step_capture_;
  int64_t step_n_ = -1;
  bool step_captured_ = false;  // the last StepCapture returned step_capture_
  VerifyCheckpoint cp_;
  int32_t pending_ = -1;
  // The last round: tokens before it (-1: none since Start/Attach) and the verify rows of
  // its kept positions (a + 1 rows), for TruncateRound.
  int64_t round_n_ = -1;
  std::vector<float> round_logits_;
  SpeculativeStats stats_;
  std::vector<int32_t> last_draft_tokens_;
  std::vector<float> last_draft_confidence_;
};

}  // namespace kvtier::engine
