// Engine: the miniature DeepSeek-V4.1-Flash forward pass on the CPU (reference §1-§8).
//
// One Engine holds the weights (shared, immutable) and a thread pool; per-sequence state lives
// in a SequenceState the caller owns. Three ways to run a sequence:
//   Forward     every layer over every new token (full forward; also chunked prefill and
//               decode, since every per-token computation is causal and cached exactly);
//   PrefillCed  CED prefill: the encoder (layers [0, L/2)) over all tokens, the decoder KV
//               source's compressor (global KV) from the encoder output for every token, and the
//               full decoder only over the last min(W, n) tokens (bounded replay);
//   ExtendCed   a new turn appended the CED way (encoder + global KV over every new token, the
//               decoder over the last min(W, n)); PrefillCed is ExtendCed of an empty state;
//   Decode      one token through all layers (Forward with one token).
// ReplayTail rebuilds the SWA rings after global KV was imported as units (state_io.h): the
// last R' = min(R, n) tokens (R = replay_tokens >= W, default W) go through every layer with
// replay_start = n - R', and a query at i sees SWA keys in [max(replay_start, i-W+1), i]; the
// imported global KV is reused. The rings end holding the last min(W, R') positions. R >= n
// replays from position 0 and equals the full forward bit for bit.
//
// Exactness: a token's logits depend only on its inputs, never on batch shape or thread count
// (ops.h). Hence Forward(prompt) + Decode(x) == Forward(prompt + x) bit for bit, and
// PrefillCed == Forward for prompts of at most W tokens. Forward, PrefillCed and ReplayTail run
// their tokens in chunks of options.prefill_chunk_tokens (each phase of PrefillCed chunk by
// chunk), which by the same argument changes no result.
//
// Engram prefetch: a call is a list of steps (a chunk through a range of layers). Before a
// step computes, its Engram rows are requested (or found already requested) and so are the
// rows of the next options.engram_lookahead_chunks steps of the same call (their tokens are
// known); each Engram layer waits for its rows just before it runs, a *stall* when they are
// late. PrefetchEngram / PrefetchEngramReplay request rows of tokens a caller knows before it
// runs them; the following calls use those batches instead of requesting again. A prefetched
// batch is used only for the positions it was requested for and only when its row ids equal
// the ones the step computes from its own tokens (so it can never serve other tokens);
// batches that no step can use any more are discarded. A row that cannot be read is an error
// naming the Engram layer (a failed prefetch is requested once more as the step's own read
// first); rows are never replaced by zeros.
//
// Thread safety: an Engine may be shared by threads only if they do not call it at the same
// time (its pool is not re-entrant). A SequenceState belongs to one caller.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "engine/config.h"
#include "engine/device/profile.h"
#include "engine/engram.h"
#include "engine/matmul.h"
#include "engine/ops.h"
#include "engine/thread_pool.h"
#include "engine/weights.h"

namespace kvtier::engine {

namespace device {
class DeviceBackend;
class DeviceLayers;
}  // namespace device

// Upper bound on tokens in one call whose memory grows with it: Forward with all_logits,
// ForwardBatch, ReplayTail's replay, PrefetchEngram's hint.
inline constexpr size_t kMaxTokensPerCall = 1 << 16;
// Upper bound on tokens in one PrefillCed, ExtendCed or Forward without all_logits (a prompt).
// Past EngineOptions::prompt_piece_tokens they run in pieces of at most that many tokens, with
// the same results bit for bit, so their activations stay those of one piece.
inline constexpr size_t kMaxPromptTokens = size_t{1} << 22;
// Upper bounds on EngineOptions::engram_lookahead_chunks and engram_prefetch_batches_max.
inline constexpr int kMaxEngramLookaheadChunks = 8;
inline constexpr int kMaxEngramPrefetchBatches = 256;

// Where the engine's passes run each layer's arithmetic (engine/device/layers.h).
enum class LayerDevice {
  kCpu,       // on the CPU (the default)
  kCuda,      // on the GPU, the pass's activations kept there; the caches, the compressor, the
              // top-k and Engram on the CPU. Logits within the CUDA math library's expf / log1pf
              // of kCpu's.
  kHostTwin,  // the GPU's kernels run on the CPU: kCpu's bits, slower (tests, machines
              // without a GPU)
};
const char* LayerDeviceName(LayerDevice device);
// The LayerDevice LayerDeviceName gives `name` ("cpu", "cuda", "host-twin"); false for another.
bool ParseLayerDevice(std::string_view name, LayerDevice* device);

struct EngineOptions {
  // Worker threads (including the caller). Results do not depend on it. Default 1.
  int threads = 1;
  // Reindex layers restrict their top-k to the candidate source's block pool (the model's
  // behaviour). false is a test hook: plain top-k over every visible entry. Default true.
  bool use_candidate_pool = true;
  // Engram row source; nullptr (default) serves rows from the weights' own tables.
  // Not owned; must outlive the Engine.
  EngramRowSource* engram_rows = nullptr;
  // Tokens per chunk of Forward / PrefillCed / ReplayTail (results do not depend on it), in
  // [1, kMaxTokensPerCall]. Default 256.
  int prefill_chunk_tokens = 256;
  // Steps (chunks) of a call whose Engram rows are requested before the current one computes,
  // in [0, kMaxEngramLookaheadChunks]. 0: each chunk's rows are requested when it starts.
  // Default 1.
  int engram_lookahead_chunks = 1;
  // Batches per Engram layer requested ahead of their step (lookahead and hints) that the
  // engine holds at once, in [1, kMaxEngramPrefetchBatches]; a prefetch over it is refused
  // (the step then requests its rows itself). Default 16.
  int engram_prefetch_batches_max = 16;
  // Most tokens PrefillCed, ExtendCed and Forward without all_logits run at once; a longer call
  // runs in pieces (results do not depend on it). A CED piece holds its tokens' activations
  // (piece x hc_mult x hidden_size floats). In (sliding_window, kMaxTokensPerCall], or
  // kMaxTokensPerCall whatever the window. Default kMaxTokensPerCall.
  int prompt_piece_tokens = static_cast<int>(kMaxTokensPerCall);
  // Where every pass (Forward, PrefillCed, ExtendCed, ReplayTail, ForwardBatch) runs its layers
  // (see LayerDevice); Create fails (Unavailable) for kCuda without a usable device. A
  // pass while a StepTrace is set runs on the CPU whatever it says; the head of a single-sequence
  // pass runs on the CPU (its residual comes back at the end of the pass's layers).
  LayerDevice layer_device = LayerDevice::kCpu;
  // Test hook: makes the device layers' backend in place of layer_device's own (layer_device
  // must not be kCpu then); null (default): layer_device's.
  std::function<std::unique_ptr<device::DeviceBackend>()> device_backend;
};

// What the engine saw of Engram row reads (monotonic counters). A prefetch is a batch
// requested ahead of its step (lookahead or hint); issued = consumed + discarded + the ones
// still held.
struct EngineStats {
  uint64_t engram_requests = 0;              // Request() calls the engine made (all kinds)
  uint64_t engram_prefetches_issued = 0;     // of those, prefetches
  uint64_t engram_prefetches_consumed = 0;   // prefetched batches that served a step
  uint64_t engram_prefetches_discarded = 0;  // prefetched batches dropped unused
  uint64_t engram_prefetches_rejected = 0;   // prefetches refused (engine bound or the source)
  uint64_t engram_prefetches_failed = 0;     // prefetched reads that failed (asked again)
  uint64_t engram_waits = 0;                 // Wait() calls
  uint64_t engram_stalls = 0;                // waits where the rows were late (batch.stalled)
  uint64_t engram_stall_us = 0;              // wall time of those waits
};

// A process-wide unique number, never 0 (KvEpoch's values and SwaRing's stamps). Thread-safe.
uint64_t NextHistoryNumber();

// The sliding-window ring of one layer: the last W positions' kv_norm(wkv x) with RoPE,
// stored as FP8 e4m3 + ue8m0/32 (data/scales) and their exact dequantised values (W slots:
// a constant per layer, not per cached token). Each slot carries the stamp of its last write
// (0: never written), for a copy of the slots kept elsewhere (the device layers' mirror): equal
// stamps mean equal bytes, so every write of a slot's bytes must take a new stamp (Stamp), and a
// copy of a slot carries its stamp with it.
struct SwaRing {
  int window = 0;
  int dim = 0;
  int64_t valid_from = 0;        // replay start: positions below are never visible
  int64_t end = 0;               // one past the newest position written
  std::vector<float> values;     // window x dim, slot = pos % window
  std::vector<uint8_t> data;     // window x dim
  std::vector<uint8_t> scales;   // window x dim/32
  std::vector<uint64_t> stamps;  // window
  bool Has(int64_t pos) const {
    return pos >= valid_from && pos < end && pos >= end - window && pos >= 0;
  }
  void Stamp(int64_t slot) { stamps[static_cast<size_t>(slot)] = NextHistoryNumber(); }
};

// A process-wide unique number naming one history of a cache's entries, for a copy of them kept
// elsewhere (the device layers' mirror): while a cache keeps its epoch, its entries only grow at
// the end, so a copy of the first s entries made under that epoch stays true. A new epoch on
// construction and on every copy (a copy may grow differently from its original); a move hands
// the epoch over and gives the moved-from object a new one. Thread-safe.
class KvEpoch {
 public:
  KvEpoch() : value_(NextHistoryNumber()) {}
  KvEpoch(const KvEpoch&) : value_(NextHistoryNumber()) {}
  KvEpoch& operator=(const KvEpoch& o) {
    if (this != &o) value_ = NextHistoryNumber();
    return *this;
  }
  KvEpoch(KvEpoch&& o) noexcept : value_(o.value_) { o.value_ = NextHistoryNumber(); }
  KvEpoch& operator=(KvEpoch&& o) noexcept {
    if (this != &o) {
      value_ = o.value_;
      o.value_ = NextHistoryNumber();
    }
    return *this;
  }
  uint64_t value() const { return value_; }
  // A new number (the entries changed otherwise than by growing).
  void Renew() { value_ = NextHistoryNumber(); }

 private:
  uint64_t value_;
};

// The global KV of one KV source layer: entries in FP4 exactly as a unit stores them
// (main kFp4E4M3x16, index key kFp4Ue8m0x32), plus the compressor's partial group
// (kv_state / score_state, ratio x head_dim fp32). There is no fp32 copy of the entries:
// attention and the indexer dequantise the bytes they read (exact, kernels/quant.h). The byte
// vectors grow by AppendKvBytes, so their capacity stays within kKvGrowthNum/kKvGrowthDen of
// their size (KvCacheBytes).
struct KvSourceCache {
  int layer = 0;
  int ratio = 1;
  int head_dim = 0;
  int index_dim = 0;
  int64_t consumed = 0;   // tokens fed to the compressor
  int64_t n_entries = 0;  // compressed entries held (rows of main_* and index_*)
  std::vector<uint8_t> main_data, main_scales, index_data, index_scales;
  std::vector<float> kv_state, score_state;
  // The entries' history: appending keeps the epoch; Truncate below entries() starts a new one
  // whose parent is the old one, of which the first parent_keep entries are still these (so a
  // copy taken under the parent keeps that many). Code that rewrites entries in place must call
  // epoch.Renew() (and clear parent_epoch).
  KvEpoch epoch;
  uint64_t parent_epoch = 0;  // 0: none
  int64_t parent_keep = 0;
  int64_t entries() const { return n_entries; }
  // Drops every entry from `e` on (e <= entries()).
  void Truncate(int64_t e);
};

// Growth of the global KV byte vectors: capacity at most size * 5/4 (plus the appended rows'
// bytes), instead of std::vector's doubling, so the engine's memory per cached token stays near
// the stored bytes (docs/performance/engine.md, "Attention, indexer and memory per cached token").
inline constexpr size_t kKvGrowthNum = 5, kKvGrowthDen = 4;
// Appends `bytes` zero bytes to *v with that growth; returns the old size.
size_t AppendKvBytes(std::vector<uint8_t>* v, size_t bytes);

// Bytes the engine holds for a sequence. global_kv_bytes grows with the sequence: the capacity
// of the FP4 byte vectors, at most kKvGrowthNum/kKvGrowthDen of stored_bytes (the data and
// scales of the entries held, what units store for them) plus one append. fixed_bytes does not:
// the SWA rings (W slots per layer, FP8 bytes and their fp32 values) and the compressors'
// partial groups.
struct KvMemory {
  size_t global_kv_bytes = 0;
  size_t fixed_bytes = 0;
  size_t stored_bytes = 0;
};

struct SequenceState {
  std::vector<int32_t> tokens;    // every token whose global KV exists (positions 0..n-1)
  std::vector<SwaRing> swa;       // per layer
  std::vector<KvSourceCache> kv;  // per KV source, in kv_source_layer_ids order
};

KvMemory KvCacheBytes(const SequenceState& st);

// Reserves the global KV byte vectors of *st for a sequence of `tokens` tokens (each source's
// tokens / ratio entries), so that importing up to that many appends without reallocating: a
// restore knows its prompt before the first unit arrives. Growing by AppendKvBytes instead
// copied every byte about four times over and faulted in fresh memory at each step
// (docs/performance/serving.md, "A restore's global KV reserved"). A caller that will hold
// far fewer tokens calls ShrinkKvToFit, so that KvCacheBytes' bound holds again.
void ReserveKvTokens(SequenceState* st, int64_t tokens);
// Gives back the global KV byte vectors' capacity beyond their entries.
void ShrinkKvToFit(SequenceState* st);

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

// Additive hook for DSpark (engine/dspark.h) and speculative rollback (engine/speculative.h):
// what entered the attention sublayer of the listed layers. Every Forward / PrefillCed /
// ReplayTail clears the rows and records, per listed layer, the tokens that layer ran in that
// call in position order, from first_pos[i] on (-1 when it ran none; positions below from_pos
// are skipped, which bounds a long prefill's capture); the Engram rows are
// already added. A layer runs the tokens of one contiguous range per call (PrefillCed's
// decoder layers only its last min(W, n) tokens).
struct AttnInputCapture {
  std::vector<int> layers;         // set by the caller
  int64_t from_pos = 0;            // set by the caller: positions below are not recorded
  bool record_normed = true;       // set by the caller: false leaves `normed` empty
  std::vector<int64_t> first_pos;  // per listed layer
  // Per listed layer: the mean of the hc copies of the sublayer's input stream (D per token),
  // and the attention's normalised input xa (D per token; speculative rollback's, the draft
  // reads only stream_mean).
  std::vector<std::vector<float>> stream_mean;
  std::vector<std::vector<float>> normed;
  // Index of `layer` in layers, or -1.
  int Slot(int layer) const;
  void Clear();
  void Record(int layer, int64_t p0, int n, int hc, int dim, const float* x, const float* xa);
};

// The RoPE parameters of `config` (YaRN when its rope_scaling says so and the context exceeds
// the original one) with base `theta`: rope_theta for attention, compress_rope_theta for the
// compressor.
RopeParams RopeParamsFor(const EngineConfig& config, double theta);

class Engine {
 public:
  static StatusOr<std::unique_ptr<Engine>> Create(const EngineConfig& config,
                                                  std::shared_ptr<const ModelWeights> weights,
                                                  const EngineOptions& options);
  ~Engine();

  SequenceState NewSequence() const;

  // All layers over `tokens` appended to `state`. logits: every new token's row
  // (all_logits) or only the last one's, each vocab_size floats. InvalidArgument for ids
  // outside the vocabulary, an empty call, more than kMaxTokensPerCall tokens with all_logits
  // or kMaxPromptTokens without, or a state this engine cannot extend (then the state is
  // unchanged). Any other error leaves the state unusable: discard it.
  Status Forward(SequenceState* state, std::span<const int32_t> tokens, bool all_logits,
                 std::vector<float>* logits);
  Status Decode(SequenceState* state, int32_t token, std::vector<float>* logits);
  // Continuous batching: appends tokens[i] to *states[i] for every i in one pass over the
  // layers. The rows of all sequences are packed so that every per-token computation (embed,
  // mHC mixes, norms, MoE and its MatMuls, the head) runs once over all rows, while attention
  // (SWA ring, compressor, top-k) runs per sequence on its own rows. Bit-identical to
  // Forward(states[i], tokens[i], false, ...) for each i alone (ops.h: a row's results do not
  // depend on the rows beside it). last_logits[i]: the last token of tokens[i].
  // InvalidArgument (every state unchanged) for no sequences, a size mismatch, the same state
  // twice, an empty or out-of-vocabulary tokens[i], tokens[i] longer than
  // options.prefill_chunk_tokens, more than kMaxTokensPerCall tokens in all, or a state this
  // engine cannot extend. Any other error leaves every state unusable.
  // For speculative verification (engine/speculative.h): all_logits (optional) gets every
  // row's logits, (*all_logits)[i] = tokens[i].size() x vocab_size (the head then runs over
  // every row); captures (empty, or one per state, each may be null) records sequence i's
  // attention inputs into captures[i] as set_attn_capture does for a Forward of it alone
  // (InvalidArgument for another size).
  Status ForwardBatch(std::span<SequenceState* const> states,
                      std::span<const std::span<const int32_t>> tokens,
                      std::vector<std::vector<float>>* last_logits,
                      std::vector<std::vector<float>>* all_logits = nullptr,
                      std::span<AttnInputCapture* const> captures = {});
  // CED prefill of an empty state; last_logits: the last token's logits. Up to
  // kMaxPromptTokens tokens: past options.prompt_piece_tokens, ExtendCed's pieces (see there).
  Status PrefillCed(SequenceState* state, std::span<const int32_t> tokens,
                    std::vector<float>* last_logits);
  // CED extend: appends a turn to a state (empty or not) the CED way. The encoder and layer d's
  // compressor (global KV) run over every new token, the decoder over the last R = min(W, n)
  // of them. n <= W: the decoder rings continue, so the result equals Forward(state, tokens)
  // bit for bit (and the full forward of the whole text while it is at most W tokens). n > W:
  // the decoder rings restart at the last W tokens, so extending PrefillCed(A) by B equals
  // PrefillCed(A + B) bit for bit. PrefillCed(s, t) is ExtendCed of an empty state. Up to
  // kMaxPromptTokens tokens: past P = options.prompt_piece_tokens it extends by the first 1..P
  // of them, then by P at a time; each later piece holds more than W tokens, so it restarts the
  // rings at its last W and the result is that of one call bit for bit (with
  // W = P = kMaxTokensPerCall, the config's limit, the rings continue across pieces, as the
  // full forward's do). Errors as Forward without all_logits; the decoder must have a single
  // KV source at its first layer (as PrefillCed).
  Status ExtendCed(SequenceState* state, std::span<const int32_t> tokens,
                   std::vector<float>* last_logits);
  // Bounded replay after an import (see file comment); last_logits: the last token's.
  // InvalidArgument (state unchanged) for an empty state, global KV that does not cover every
  // token, replay_tokens < sliding_window, or min(replay_tokens, n) > kMaxTokensPerCall.
  // The two-argument form replays W tokens.
  Status ReplayTail(SequenceState* state, int64_t replay_tokens, std::vector<float>* last_logits);
  Status ReplayTail(SequenceState* state, std::vector<float>* last_logits);

  // Hint: `upcoming` will follow state's tokens (a prompt streaming in, speculated or accepted
  // tokens). Requests their Engram rows now, on the chunk grid a Forward from `state` uses;
  // the next Forward / Decode / PrefillCed over those positions consumes them. InvalidArgument
  // for bad tokens; Rejected when engram_prefetch_batches_max or the row source refused a
  // batch (the batches before it stay requested; the rest is requested when it runs). Never
  // changes results. Ok and nothing done without Engram layers.
  Status PrefetchEngram(const SequenceState& state, std::span<const int32_t> upcoming);
  // Hint: ReplayTail(replay_tokens) will run on a state holding `tokens` (e.g. while its units
  // are being imported). Requests the rows of the replayed tail. Errors as PrefetchEngram, and
  // InvalidArgument for replay_tokens < sliding_window. The one-argument form: W tokens.
  Status PrefetchEngramReplay(std::span<const int32_t> tokens, int64_t replay_tokens);
  Status PrefetchEngramReplay(std::span<const int32_t> tokens);

  // Counters; read between calls (not synchronised with a call in progress).
  const EngineStats& stats() const { return stats_; }
  // How many weight matrices the products read packed in `format` (0 for all formats while the
  // scalar kernel, which packs nothing, is active).
  size_t PackedMatrices(PackedFormat format) const { return packed_.Count(format); }
  // Device bytes held by the device layers' weight copies (0 with LayerDevice::kCpu, or once
  // the device failed).
  size_t DeviceWeightBytes() const;
  // Ok while the passes run on layer_device (or it is kCpu). When a call to the device fails,
  // the pass that made it returns that error (its sequences' states are then unspecified, as
  // after any failed pass), the engine drops the device layers (after a failure nothing the
  // device holds is trusted: engine/device/fail_stop_backend.h) and every later pass runs on
  // the CPU path; this returns that first error from then on.
  const Status& DeviceFailure() const { return device_failure_; }
  // The device layers' profile (engine/device/profile.h): every kernel and copy of the passes
  // while on, counted and timed on the device; TakeDeviceProfile returns the totals since the
  // last take. InvalidArgument when the passes run on the CPU (layer_device cpu, or the device
  // failed).
  Status SetDeviceProfiling(bool on);
  StatusOr<std::vector<device::OpStat>> TakeDeviceProfile();

  const EngineConfig& config() const { return config_; }
  int threads() const { return pool_->threads(); }
  // Parallel sections this engine's pool handed to its workers so far (ThreadPool::dispatches).
  int64_t pool_dispatches() const { return pool_->dispatches(); }
  void set_trace(StepTrace* trace) { trace_ = trace; }
  // Attaches (nullptr: detaches) an attention-input capture; not owned.
  void set_attn_capture(AttnInputCapture* capture) { capture_ = capture; }

 private:
  struct LayerWeights;
  struct Runtime;
  // One step of a call: Engram layers in [l_begin, l_end) over positions [p0, p0 + n).
  struct Step {
    int64_t p0 = 0;
    int n = 0;
    int l_begin = 0, l_end = 0;
  };
  struct EngramPending;  // one requested batch the engine holds (model.cc)
  Engine(const EngineConfig& config, std::shared_ptr<const ModelWeights> weights,
         const EngineOptions& options);
  Status Bind();
  // The coded format of each rounded matrix, by its (new) weight pointer.
  using CodedFormats = std::unordered_map<const float*, PackedFormat>;
  // expert_format mxfp4 and weight_format fp8: copies every matrix they cover into
  // coded_values_, rounds each row's blocks of 32 (kernels::RoundTrip: MXFP4 for the routed
  // experts, FP8 for the dense projections), points LayerWeights at the copies and returns
  // their formats (the one list of which matrix is coded how).
  StatusOr<CodedFormats> RoundCodedWeights();
  // Registers a packed copy of every weight matrix MatMul reads (engine/matmul.h), in its coded
  // format when `coded` has one, and keeps a pointer to each beside its weight
  // (LayerWeights::pk_*, head_pk_).
  void PackMatMulWeights(const CodedFormats& coded);
  // MatMul with W's packed copy `pw` as PackMatMulWeights resolved it (null: MatMul looks it up
  // or packs), so that no call does a lookup.
  void Mm(ThreadPool* pool, const float* x, int rows, int in, const float* w,
          const PackedMatrix* pw, int out, float* y) const;
  // MatMulMany (ops.h) of the parts, each with its `packed` copy as resolved at bind time:
  // products that are independent of each other (e.g. sharing an input) in one parallel
  // section when small.
  void MmMany(ThreadPool* pool, std::span<MatMulPart> parts) const;
  // InvalidArgument for no tokens, more than tokens_max, or an id outside the vocabulary.
  Status CheckTokens(std::span<const int32_t> tokens, size_t tokens_max = kMaxTokensPerCall) const;
  // Runs run(piece) over `tokens` in pieces: the first of 1..P tokens, every later one of
  // P = options_.prompt_piece_tokens (ExtendCed needs each later piece to hold more than W
  // tokens; Forward's results do not depend on the split).
  // (A template: no std::function, so a decode step allocates nothing for it; model.cc.)
  template <typename Run>
  Status InPieces(std::span<const int32_t> tokens, const Run& run) const;
  // Forward / ExtendCed of at most prompt_piece_tokens checked tokens, without ResetTrace.
  Status ForwardPiece(SequenceState* state, std::span<const int32_t> tokens, bool all_logits,
                      std::vector<float>* logits);
  Status ExtendCedPiece(SequenceState* state, std::span<const int32_t> tokens,
                        std::vector<float>* last_logits);
  void Embed(std::span<const int32_t> tokens, float* x, float* pre) const;
  void AppendChunks(int64_t p0, int64_t n, int l_begin, int l_end, std::vector<Step>* plan) const;
  // Runs plan[step] (after requesting its Engram rows and the lookahead's).
  Status RunLayers(SequenceState* st, const std::vector<Step>& plan, size_t step, float* x,
                   float* pre);
  // Engram rows (model.cc, "Engram prefetch"). toks[i] is the token at position toks_p0 + i.
  Status EngramRowIds(int slot, std::span<const int32_t> toks, int64_t toks_p0, int64_t p0, int n,
                      std::vector<int64_t>* rows) const;
  // own: `s` is plan[step] and runs now (claims its batches, discards unusable ones; batches
  // the lookahead requested for later steps of `plan` are kept); otherwise a prefetch.
  Status EnsureEngram(const Step& s, std::span<const int32_t> toks, int64_t toks_p0, bool own,
                      std::vector<EngramPending*>* claimed, const std::vector<Step>* plan = nullptr,
                      size_t step = 0);
  Status BeginEngramStep(const SequenceState& st, const std::vector<Step>& plan, size_t step,
                         std::vector<EngramPending*>* claimed);
  Status PrefetchPlan(const std::vector<Step>& plan, std::span<const int32_t> toks,
                      int64_t toks_p0);
  Status RequestEngram(std::unique_ptr<EngramPending> e, bool own, EngramPending** out);
  void WaitEngram(EngramPending* e);
  void DiscardEngram(EngramPending* e);
  void ReapEngram(int slot);
  Status TakeEngram(int layer, EngramPending* e, int64_t p0, int n, EngramRowBatch* out);
  Status ApplyEngram(int layer, const EngramRowBatch& batch, int n, float* x);
  void MixSublayer(int n, float* x, const float* f_out, const float* post, const float* comb) const;
  void PreMix(int n, const float* x, const float* pre, const float* norm_w, float* xn) const;
  // The attention sublayer (model_attention.cc) over n rows of one sequence from position p0:
  // AttnProject, AttnCore, AttnOutput in turn.
  Status Attention(int layer, SequenceState* st, int64_t p0, int n, const float* xa, Runtime* rt,
                   float* out);
  // Per-row results of AttnProject for n rows (row-major; iq and wts only for layers that select
  // top-k).
  struct AttnRows {
    std::vector<float> qr, q, kv, iq, wts;
    // The compressor's projections of every row (n x head_dim; cgate only at ratio > 1) on a
    // kFull layer, so that a batch reads the compressor's weights once, not once per sequence.
    std::vector<float> ckv, cgate;
    // Each row's RoPE rotation at its position (n x rope pairs: RopeRotation's c and s), for
    // its q heads, its SWA entry, its indexer heads and AttnCore's inverse RoPE of its output.
    std::vector<float> rope_c, rope_s;
    std::vector<uint8_t> kv_data, kv_scales;
  };
  // The per-row part: rows of any sequences; pos[t]: row t's position. AttnProducts (the matrix
  // products of xa and the norms), then AttnRotate (RoPE, the SWA entries' FP8 bytes, the
  // indexer query's FP4 rounding).
  Status AttnProject(int layer, int n, const float* xa, const int64_t* pos, AttnRows* a);
  // a's vectors sized for n rows of `layer` (iq, wts, ckv, cgate empty where the layer has none).
  void ShapeAttnRows(int layer, int n, AttnRows* a) const;
  void AttnProducts(int layer, int n, const float* xa, AttnRows* a);
  Status AttnRotate(int layer, int n, const int64_t* pos, AttnRows* a);
  // AttnProject on the device path: the products on the device layers, from the normed input
  // their AttentionInput left there (DeviceLayers::AttentionProducts, the same bits), then
  // AttnRotate here; q stays on the device (a->q left empty).
  Status DeviceAttnProject(int layer, int n, const int64_t* pos, AttnRows* a);
  // The per-sequence part over n rows of `st` from p0, which are rows [row0, row0 + n) of `a`
  // (given to AttnProject at positions p0 .. p0 + n - 1); writes their attention outputs (n x heads
  // x head_dim) to o. Splits its loops over `pool` (null: runs on the caller, e.g. inside a loop
  // over sequences). Touches only *st, *rt, o and (when set) the trace, so calls on different
  // sequences may run in parallel when no trace is attached. xa: the rows' normed inputs, read
  // only by Compress (so null will do where a carries the compressor's projections).
  Status AttnCore(int layer, SequenceState* st, int64_t p0, int n, const float* xa,
                  const AttnRows& a, int64_t row0, Runtime* rt, ThreadPool* pool, float* o);
  // AttnCore's parts: AttnSelect (the ring's rewind to p0, the compressor, the top-k into rt) and
  // SwaPush (the rows' SWA entries into the ring, after every read of it).
  Status AttnSelect(int layer, SequenceState* st, int64_t p0, int n, const float* xa,
                    const AttnRows& a, int64_t row0, Runtime* rt, ThreadPool* pool);
  void SwaPush(int layer, SequenceState* st, int64_t p0, int n, const AttnRows& a,
               int64_t row0) const;
  // One sequence's rows' attention keys (AttnGather): the selected global entries once each (sel:
  // their indices in src, sorted; the device reads them from its mirror of src), the window's SWA
  // entries once each, oldest first (swa_slot: entry j as its slot in `ring`, which holds it after
  // the pass's push and which the device reads from its mirror, or as ~u for entry u of swa_*,
  // the FP8 bytes of those the push overwrites, uploaded with the pass; swa_of: position - the
  // window's first -> entry, or -1), and per row its list in AttnCore's order (keys[key_off[t] ..
  // key_off[t + 1]): a global entry as its place in sel, SWA entry j as ~j). ring: null when no
  // entry is read from it; ring_end: its end once the pass's entries are pushed.
  struct AttnKeyRows {
    const KvSourceCache* src = nullptr;  // null when sel is empty
    const SwaRing* ring = nullptr;
    int64_t ring_end = 0;
    std::vector<uint8_t> swa_data, swa_scales;
    std::vector<int32_t> sel, swa_slot, swa_of, keys, key_off;
  };
  // TrimScratch of each of r's buffers (a long prefill's are not kept).
  static void TrimKeyRows(AttnKeyRows& r);
  // After AttnSelect, before SwaPush: the keys of n rows of st from p0 (rows [row0, row0 + n) of
  // a).
  Status AttnGather(int layer, const SequenceState& st, int64_t p0, int n, const AttnRows& a,
                    int64_t row0, const Runtime& rt, AttnKeyRows* out) const;
  // AttnCore on the device path: AttnSelect, AttnGather into *keys, SwaPush; the arithmetic is
  // DeviceAttention's. Touches what AttnCore touches, and *keys.
  Status AttnCoreKeys(int layer, SequenceState* st, int64_t p0, int n, const AttnRows& a,
                      int64_t row0, Runtime* rt, ThreadPool* pool, AttnKeyRows* keys);
  // The device layers' attention of `layer` over the pass's rows (a: the pass's AttnRows, for the
  // rotations), whose keys are seqs' lists in row order (one per sequence), after every
  // sequence's SwaPush: the lists merged into one, each sequence's cache and ring named for the
  // device's mirrors of them, the uploaded SWA bytes read in place for one sequence and merged
  // for several.
  Status DeviceAttention(int layer, std::span<AttnKeyRows* const> seqs, const AttnRows& a);
  // The per-row output projection of n rows of attention outputs.
  void AttnOutput(int layer, int n, const float* o, float* out);
  // The compressor over n rows of `st` from p0 (xa: their normed inputs; may be null when ckv
  // and cgate are given). ckv and cgate, when not null, are those rows' projections
  // (AttnRows::ckv, cgate) and Compress does not project xa itself; the results are the same bits
  // either way (MatMul does not depend on the row count).
  Status Compress(int layer, SequenceState* st, int64_t p0, int n, const float* xa,
                  ThreadPool* pool, const float* ckv_rows = nullptr,
                  const float* cgate_rows = nullptr);
  Status SelectTopk(int layer, int64_t p0, int n, const float* iq, const float* wts, Runtime* rt,
                    ThreadPool* pool);
  void Moe(int layer, int n, const float* xn, float* out);
  void Head(int n, const float* x, const float* pre, float* logits);
  // r has this engine's window and head width, and every buffer its size (NewSequence's).
  bool RingOfThisEngine(const SwaRing& r) const;
  Status CheckExtendable(const SequenceState& st) const;
  void ResetTrace();

  EngineConfig config_;
  std::shared_ptr<const ModelWeights> weights_;
  EngineOptions options_;
  std::unique_ptr<ThreadPool> pool_;
  PackedWeightSet packed_;  // every weight matrix Mm reads, packed at bind time
  std::vector<LayerWeights> layers_;
  // The rounded weights as the model defines them (expert_format mxfp4: the routed experts;
  // weight_format fp8: the dense projections; each row's rounding of the checkpoint's), which
  // LayerWeights points into; empty when both formats are f32. The products read their packed
  // codes; the scalar and CUDA MatMuls read these floats.
  std::vector<float> coded_values_;
  std::vector<double> rope_main_, rope_compress_;
  const float *embed_w_ = nullptr, *norm_w_ = nullptr, *head_w_ = nullptr;  // bound once
  const PackedMatrix* head_pk_ = nullptr;                                   // head_w_'s copy
  AttnRows attn_rows_;  // Attention's buffers, reused call to call
  std::unique_ptr<EngramHashing> engram_hash_;
  std::unique_ptr<LocalEngramRowSource> local_rows_;
  EngramRowSource* rows_ = nullptr;
  // Per Engram slot: the batches requested and not yet consumed or discarded, in request
  // order (the order their Waits are made in).
  std::vector<std::deque<std::unique_ptr<EngramPending>>> engram_queue_;
  // Batches waited and dropped, kept with their buffers for the next requests (at most
  // kEngramFreeMax, each with at most kScratchKeepBytes of buffers), so that a steady decode
  // step requests and takes its rows without allocating.
  static constexpr size_t kEngramFreeMax = 16;
  std::vector<std::unique_ptr<EngramPending>> engram_free_;
  std::unique_ptr<EngramPending> NewEngramPending(int slot, int64_t p0, int n);
  EngineStats stats_;
  StepTrace* trace_ = nullptr;
  AttnInputCapture* capture_ = nullptr;
  // The passes' layers when options_.layer_device is not kCpu (model_device.cc).
  std::unique_ptr<device::DeviceLayers> device_;
  Status device_failure_;  // DeviceFailure()
  Status BindDevice();
  // A device pass's result s; when the device layers failed (their failure()), the engine drops
  // them first and remembers the failure (DeviceFailure).
  Status AfterDevicePass(Status s);
};

}  // namespace kvtier::engine
