// Fidelity of session restore: how closely a resumed session continues the uninterrupted one
// (docs/RESUME.md, "Fidelity"; `kvtier-engine fidelity`).
//
// For a token sequence and each history length h, teacher-forced over the N = eval_tokens
// tokens after h, the next-token distributions predicting tokens h .. h+N-1 of
//   (a) the uninterrupted session: the full forward over the sequence;
//   (b) exact restore: (a)'s state at h exported as encoded units (state_io.h ExportUnit, chain
//       keys and model fingerprint as SessionStore saves them) plus its hot state
//       (EncodeHotState: SWA rings + the last logits), imported into a fresh state
//       (ImportUnit with full verification, DecodeHotState), then continued;
//   (c) bounded replay at R: the same units imported, the SWA rings rebuilt by
//       Engine::ReplayTail(R) (the resume path without a hot state), then continued;
// are compared with (a): top-1 agreement (argmax equal; ties go to the lowest id) and
// KL(a || x) in nats over the full vocabulary, mean and max over the N positions. Each path's
// bits per byte on the true tokens is reported too (the byte tokenizer: one token per byte).
// (a) is one pass over the sequence, split at every h (chunking never changes a result).
// With samples = K the sequence is cut into K consecutive independent sessions of
// max(h) + N tokens each (positions restart at 0) and the scores are pooled over all K x N
// positions: agreement and KL mean over all positions, KL max over all.
//
// Histories must be positive multiples of unit_tokens (a resume restores whole units; a
// partial page would be prefilled, which is neither (b) nor (c)). Every replay length must be
// >= the sliding window W.
//
// Thread safety: drives one Engine (not re-entrant); no shared state.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"
#include "engine/model.h"
#include "engine/weights.h"

namespace kvtier::engine {

// Limits on one measurement (what a command line may ask for).
inline constexpr size_t kMaxFidelityHistories = 16;
inline constexpr size_t kMaxFidelityReplayLengths = 16;
inline constexpr int64_t kMaxFidelityEvalTokens = 4096;
// Longest history (the state at h is held in memory as units and state).
inline constexpr int64_t kMaxFidelityHistoryTokens = int64_t{1} << 16;
inline constexpr int64_t kMaxFidelitySamples = 256;

struct FidelityOptions {
  std::vector<int64_t> histories;      // each in [unit_tokens, kMaxFidelityHistoryTokens]
  std::vector<int64_t> replay_tokens;  // each in [W, kMaxTokensPerCall]
  int64_t eval_tokens = 64;            // N, in [1, kMaxFidelityEvalTokens]
  uint32_t unit_tokens = 64;           // page size of the exported units (even, >= 2)
  int64_t samples = 1;                 // K sessions, in [1, kMaxFidelitySamples]
};

// Tokens one sample uses: max(histories) + eval_tokens (the sequence needs samples times that).
int64_t FidelitySampleTokens(const FidelityOptions& options);

// One path compared with (a) over the N positions after one history.
struct FidelityScore {
  int64_t replay_tokens = 0;       // R for (c); 0 for (b)
  double top1_agreement = 0;       // fraction of positions whose argmax equals (a)'s
  double kl_mean = 0, kl_max = 0;  // KL(a || this path), nats
  double bits_per_byte = 0;        // this path's mean -log2 p(true token)
};

struct FidelityHistory {
  int64_t history = 0;
  int64_t positions = 0;                   // samples x eval_tokens
  double uninterrupted_bits_per_byte = 0;  // (a) on the same N tokens
  FidelityScore exact;                     // (b)
  std::vector<FidelityScore> replay;       // (c), in options.replay_tokens order
};

struct FidelityReport {
  int64_t tokens = 0;  // length of the sequence
  int sliding_window = 0;
  int64_t eval_tokens = 0;
  uint32_t unit_tokens = 0;
  int64_t samples = 0;
  std::vector<FidelityHistory> histories;  // in options.histories order
  // What the restores did (each history: its units for (b) and for every R):
  int64_t units_imported = 0;       // ImportUnit calls that succeeded
  int64_t hot_states_imported = 0;  // DecodeHotState calls that succeeded
  int64_t replayed_tokens = 0;      // sum of min(R, h) over the ReplayTail calls
};

// InvalidArgument (with a message for a user) for options outside their limits, a history that
// is not a multiple of unit_tokens, a replay length below W, or a sequence of `tokens` tokens
// shorter than samples x (max(history) + eval_tokens) (the message names the length needed).
Status CheckFidelityOptions(const EngineConfig& config, size_t tokens,
                            const FidelityOptions& options);

// Measures (a), (b), (c) on `tokens` (see file comment). CheckFidelityOptions' errors; engine
// errors pass through.
StatusOr<FidelityReport> MeasureFidelity(Engine* engine, const ModelWeights& weights,
                                         std::span<const int32_t> tokens,
                                         const FidelityOptions& options);

// Mean KL(p || q) and the agreement of argmaxes are computed from logits with these helpers
// (exposed for tests): KL of softmax(p) from softmax(q), in nats, >= 0, 0 for equal inputs.
double KlDivergence(std::span<const float> p_logits, std::span<const float> q_logits);

}  // namespace kvtier::engine
