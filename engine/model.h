// Engine: the miniature DeepSeek-V4.1-Flash forward pass on the CPU (reference §1-§8).
//
// One Engine holds the weights (shared, immutable) and a thread pool; per-sequence state lives
// in a SequenceState the caller owns. Three ways to run a sequence:
//   Forward     every layer over every new token (full forward; also chunked prefill and
//               decode, since every per-token computation is causal and cached exactly);
//   PrefillCed  CED prefill: the encoder (layers [0, L/2)) over all tokens, the decoder KV
//               source's compressor (global KV) from the encoder output for every token, and the
//               full decoder only over the last min(W, n) tokens (bounded replay);
//   Decode      one token through all layers (Forward with one token).
// ReplayTail rebuilds the SWA rings after global KV was imported as units (state_io.h): the
// last min(W, n) tokens go through every layer with replay_start = n - min(W, n), and a query
// at i sees SWA keys in [max(replay_start, i-W+1), i]; the imported global KV is reused.
//
// Exactness: a token's logits depend only on its inputs, never on batch shape or thread count
// (ops.h). Hence Forward(prompt) + Decode(x) == Forward(prompt + x) bit for bit, and
// PrefillCed == Forward for prompts of at most W tokens.
//
// Thread safety: an Engine may be shared by threads only if they do not call it at the same
// time (its pool is not re-entrant). A SequenceState belongs to one caller.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "common/status.h"
#include "engine/config.h"
#include "engine/engram.h"
#include "engine/ops.h"
#include "engine/thread_pool.h"
#include "engine/weights.h"

namespace kvtier::engine {

// Upper bound on tokens in one Forward / PrefillCed call.
inline constexpr size_t kMaxTokensPerCall = 1 << 16;

struct EngineOptions {
  // Worker threads (including the caller). Results do not depend on it. Default 1.
  int threads = 1;
  // Reindex layers restrict their top-k to the candidate source's block pool (the model's
  // behaviour). false is a test hook: plain top-k over every visible entry. Default true.
  bool use_candidate_pool = true;
  // Engram row source; nullptr (default) serves rows from the weights' own tables.
  // Not owned; must outlive the Engine.
  EngramRowSource* engram_rows = nullptr;
};

// The sliding-window ring of one layer: the last W positions' kv_norm(wkv x) with RoPE,
// stored as FP8 e4m3 + ue8m0/32 (data/scales) and their exact dequantised values.
struct SwaRing {
  int window = 0;
  int dim = 0;
  int64_t valid_from = 0;       // replay start: positions below are never visible
  int64_t end = 0;              // one past the newest position written
  std::vector<float> values;    // window x dim, slot = pos % window
  std::vector<uint8_t> data;    // window x dim
  std::vector<uint8_t> scales;  // window x dim/32
  bool Has(int64_t pos) const {
    return pos >= valid_from && pos < end && pos >= end - window && pos >= 0;
  }
};

// The global KV of one KV source layer: entries in FP4 exactly as a unit stores them
// (main kFp4E4M3x16, index key kFp4Ue8m0x32) and their dequantised values, plus the
// compressor's partial group (kv_state / score_state, ratio x head_dim fp32).
struct KvSourceCache {
  int layer = 0;
  int ratio = 1;
  int head_dim = 0;
  int index_dim = 0;
  int64_t consumed = 0;  // tokens fed to the compressor
  std::vector<float> main_values, index_values;
  std::vector<uint8_t> main_data, main_scales, index_data, index_scales;
  std::vector<float> kv_state, score_state;
  int64_t entries() const {
    return head_dim ? static_cast<int64_t>(main_values.size()) / head_dim : 0;
  }
};

struct SequenceState {
  std::vector<int32_t> tokens;    // every token whose global KV exists (positions 0..n-1)
  std::vector<SwaRing> swa;       // per layer
  std::vector<KvSourceCache> kv;  // per KV source, in kv_source_layer_ids order
};

// Per-step observations for tests and tools (filled when a trace is attached).
struct StepTrace {
  // Per batch token at the candidate source: visible entries and positions in the pool.
  std::vector<int64_t> candidate_visible, candidate_pool;
  // Per layer, per batch token: the selected compressed entry indices.
  std::vector<std::vector<std::vector<int32_t>>> topk;
  // Per sublayer (2 per layer), per batch token: the mHC comb matrix (hc x hc).
  std::vector<std::vector<std::vector<float>>> comb;
  // Per layer: how many batch tokens each routed expert received.
  std::vector<std::vector<int64_t>> expert_tokens;
  // Per Engram layer slot: every gate value of the step (token-major, then hc copy).
  std::vector<std::vector<float>> engram_gates;
};

class Engine {
 public:
  static StatusOr<std::unique_ptr<Engine>> Create(const EngineConfig& config,
                                                  std::shared_ptr<const ModelWeights> weights,
                                                  const EngineOptions& options);
  ~Engine();

  SequenceState NewSequence() const;

  // All layers over `tokens` appended to `state`. logits: every new token's row
  // (all_logits) or only the last one's, each vocab_size floats. InvalidArgument for ids
  // outside the vocabulary, an empty or oversize call, or a state this engine cannot extend
  // (then the state is unchanged). Any other error leaves the state unusable: discard it.
  Status Forward(SequenceState* state, std::span<const int32_t> tokens, bool all_logits,
                 std::vector<float>* logits);
  Status Decode(SequenceState* state, int32_t token, std::vector<float>* logits);
  // CED prefill of an empty state; last_logits: the last token's logits.
  Status PrefillCed(SequenceState* state, std::span<const int32_t> tokens,
                    std::vector<float>* last_logits);
  // Bounded replay after an import (see file comment); last_logits: the last token's.
  Status ReplayTail(SequenceState* state, std::vector<float>* last_logits);

  const EngineConfig& config() const { return config_; }
  int threads() const { return pool_->threads(); }
  void set_trace(StepTrace* trace) { trace_ = trace; }

 private:
  struct LayerWeights;
  struct Runtime;
  Engine(const EngineConfig& config, std::shared_ptr<const ModelWeights> weights,
         const EngineOptions& options);
  Status Bind();
  Status CheckTokens(std::span<const int32_t> tokens) const;
  void Embed(std::span<const int32_t> tokens, float* x, float* pre) const;
  Status RunLayers(SequenceState* st, int64_t p0, int n, int l_begin, int l_end, float* x,
                   float* pre);
  Status RequestEngramRows(int layer, const SequenceState& st, int64_t p0, int n,
                           EngramRowBatch* batch);
  Status ApplyEngram(int layer, EngramRowBatch* batch, int n, float* x);
  void MixSublayer(int n, float* x, const float* f_out, const float* post, const float* comb) const;
  void PreMix(int n, const float* x, const float* pre, const float* norm_w, float* xn) const;
  Status Attention(int layer, SequenceState* st, int64_t p0, int n, const float* xa, Runtime* rt,
                   float* out);
  Status Compress(int layer, SequenceState* st, int64_t p0, int n, const float* xa);
  Status SelectTopk(int layer, int64_t p0, int n, const float* qr, const float* xa, Runtime* rt);
  void Moe(int layer, int n, const float* xn, float* out);
  void Head(int n, const float* x, const float* pre, float* logits);
  Status CheckExtendable(const SequenceState& st) const;
  void ResetTrace();

  EngineConfig config_;
  std::shared_ptr<const ModelWeights> weights_;
  EngineOptions options_;
  std::unique_ptr<ThreadPool> pool_;
  std::vector<LayerWeights> layers_;
  std::vector<double> rope_main_, rope_compress_;
  std::unique_ptr<EngramHashing> engram_hash_;
  std::unique_ptr<LocalEngramRowSource> local_rows_;
  EngramRowSource* rows_ = nullptr;
  StepTrace* trace_ = nullptr;
};

}  // namespace kvtier::engine
