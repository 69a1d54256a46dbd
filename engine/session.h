// Session save and resume through kvtierd (DESIGN §5, reference §4; docs/RESUME.md).
//
// Save: whole unit_tokens-token pages of a sequence's FP4 global KV are PUT through the client
// library as encoded units (engine/state_io.h ExportUnit), each under its chain key
// (common/key_spec.h ChainKeys over the session's tokens with the model fingerprint) and with
// its parent key. Partial pages are never stored as units. The SWA rings plus the last token's
// logits ("hot state") may also be PUT, DRAM only (allow_ssd=false, kind SWA, ttl_ms minutes):
// when the sequence ends at a page boundary under SwaBlobKey(last chain key); when it ends
// r (0 < r < unit_tokens) tokens past its last whole page, with that partial page's global KV
// (state_io.h ExportTail) under HotTailKey(last chain key, the r token ids). A resume within
// the TTL then needs no replay and restores the session bit for bit.
//
// Each hot-state PUT also records its tail length in the page's index (HotStateIndexKey: read,
// the bit set, PUT beside the blob; two savers racing on one page may lose a bit, which costs
// that tail a replay, never a wrong restore).
//
// Resume: LOOKUP the chain of the tokens, GET the hit units (shared memory over the Unix
// socket), ImportUnit each (verifying checksum, fingerprint and key); a unit that is missing
// or fails verification ends the usable hit there. Then the page's hot-state index is read and
// the hot states it lists that could continue the used units (the page-aligned key, and
// HotTailKey of the next j prompt tokens for each listed j) are asked for in one GET; the
// longest one found is imported (exact restore, the tail's tokens count as restored), or the
// SWA rings are rebuilt by bounded replay
// (Engine::ReplayTail: replay_start = hit - min(R, hit), R = replay_tokens >= W); the uncached
// suffix is prefilled with the full forward in chunks. A guard compares the estimated cost of
// that path (measured fetch seconds per unit per tier, measured forward seconds per token)
// with a CED prefill of every token (measured CED seconds per token) and recomputes when that
// is cheaper; each decision is logged with its reason and counted (SessionStats).
//
// Split for a caller whose engine thread must not wait on kvtierd (serving/cache_io.h): the
// engine's side is a SessionCodec (PrepareSave encodes what Save puts, Complete restores the hot
// state or replays; no kvtierd call), the kvtierd side the store's Fetch (LOOKUP, guard, GETs,
// units imported into a fresh state; no Engine pass) and PutSave. Restore(tokens) is
// Complete(tokens, Fetch(tokens)) plus Account; Save is PrepareSave plus PutSave.
//
// Thread safety: a SessionStore is not thread-safe (it drives one Engine, which is not
// re-entrant); use one per engine thread, except that its Fetch, PutSave and Account may run on
// another thread than the engine's, which then uses a SessionCodec of its own (its const methods
// are safe on any thread that may call the Engine). The Client may be shared with other users.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cache_daemon/client.h"
#include "common/key_spec.h"
#include "common/status.h"
#include "common/unit_format.h"
#include "engine/model.h"
#include "engine/weights.h"

namespace kvtier::engine {

// The tokenizer id hashed into the model fingerprint (engine/tokenizer.h's byte tokenizer).
inline constexpr std::string_view kByteTokenizerId = "kvtier.byte-tokenizer.v1";
// Domain tag of the hot-state (SWA) key derived from a chain key.
inline constexpr std::string_view kSwaKeyDomainTag = "kvtier.swa";
// Domain tag of the key of a hot state that ends mid-page (HotTailKey).
inline constexpr std::string_view kHotTailKeyDomainTag = "kvtier.swa.tail";
// Domain tag of the key of a page's hot-state index (HotStateIndexKey).
inline constexpr std::string_view kHotStateIndexKeyDomainTag = "kvtier.swa.index";
// Upper bound on the tokens of one session this module saves or resumes (sanity limit): what
// one Engine::PrefillCed takes, since a resume that recomputes is one.
inline constexpr size_t kMaxSessionTokens = kMaxPromptTokens;
// Tokens per forward call when prefilling an uncached suffix (bounds activation memory).
inline constexpr size_t kSuffixChunkTokens = 2048;

// Domain tag of EngineModelDigest.
inline constexpr std::string_view kEngineModelDomainTag = "kvtier.engine_model";
// SHA-256 over every tensor in name order: F(name), F(dtype), shape (i64 LE), bytes.
Digest WeightsDigest(const ModelWeights& weights);
// What the engine computes with: SHA256(F(0x01,"kvtier.engine_model"), F(0x03,WeightsDigest),
// F(0x05,config.CanonicalDescription())). The file's tensors alone do not say it: the config
// rounds them at load (expert_format, weight_format) and sets every other number the forward
// pass uses (rope_theta, rms_norm_eps, index_topk, ...).
Digest EngineModelDigest(const EngineConfig& config, const ModelWeights& weights);
// ModelFingerprint(EngineKvLayout(config, unit_tokens) description, EngineModelDigest,
// tokenizer) (docs/format/key-spec.md §2): units and hot states saved under one config are
// never restored under another, even over the same weights file. The Engram rows are bound as
// the weights' tables; a remote row source (EngineOptions::engram_rows) must serve rows exported
// from the same weights file (`kvtier engram build`), which nothing verifies.
StatusOr<Digest> EngineModelFingerprint(const EngineConfig& config, const ModelWeights& weights,
                                        uint32_t unit_tokens);
// SHA256(F(0x01,"kvtier.swa"), F(0x03,last_chain_key)): where the hot state of a sequence
// that ends at the unit named `last_chain_key` is kept. Never collides with a chain key.
Digest SwaBlobKey(const Digest& last_chain_key);
// SHA256(F(0x01,"kvtier.swa.tail"), F(0x03,last_chain_key), F(0x04,tail)): where the hot state
// of a sequence that ends `tail` (1..unit_tokens-1 ids) past the unit `last_chain_key` is kept.
Digest HotTailKey(const Digest& last_chain_key, std::span<const int32_t> tail);
// SHA256(F(0x01,"kvtier.swa.index"), F(0x03,last_chain_key)): the index of the hot states kept
// past the unit `last_chain_key`, so that a resume asks only for keys that were written (a GET
// of a key never written is a miss in kvtierd's counters; asking for every tail length the
// prompt allowed made up to 63 such misses per resume).
Digest HotStateIndexKey(const Digest& last_chain_key);

// One hot state kept past a page: its tail length (0: at the boundary) and its key
// (SwaBlobKey or HotTailKey).
struct HotStateIndexEntry {
  uint32_t tail = 0;
  Digest key{};
  bool operator==(const HotStateIndexEntry&) const = default;
};
// The entries an index keeps: the page-aligned state's (tail 0) while it is listed, and the most
// recent others (branches of one page beyond it are forgotten, oldest first: their resumes
// replay, or restore the page-aligned state when there is one).
inline constexpr size_t kHotStateIndexEntriesMax = 16;
// A page's hot-state index, the most recent entry first, framed as
//   "KVHI" u16 version(1) u16 count  count x (u16 tail, 32-byte key)
// Decode: Corruption for damaged bytes, more than kHotStateIndexEntriesMax entries or a tail
// of unit_tokens or more.
std::vector<uint8_t> EncodeHotStateIndex(std::span<const HotStateIndexEntry> entries);
StatusOr<std::vector<HotStateIndexEntry>> DecodeHotStateIndex(std::span<const uint8_t> bytes,
                                                              uint32_t unit_tokens);

// Where a hot state belongs: the model fingerprint and the key it is kept under (SwaBlobKey or
// HotTailKey, which cover the chain key of the whole prefix and the tail's ids).
struct HotStateIdentity {
  Digest model_fingerprint{};
  Digest key{};
};

// Hot state: the SWA rings blob (ExportSwaRings) plus the last token's logits, and for a state
// that ends mid-page the partial page's tail blob (state_io.h ExportTail), framed as
//   "KVHS" u16 version(3) u16 0  u32 logits_count  model_fingerprint[32]  key[32]
//   logits f32 LE  u64 swa_bytes  swa blob  u64 tail_bytes  tail blob (0 bytes: ends at a
//   page boundary)  u64 xxh3-64 of all before it.
// `tail`: ExportTail of the state, or empty; `identity`: where the blob will be kept.
std::vector<uint8_t> EncodeHotState(const SequenceState& state, std::span<const float> logits,
                                    const HotStateIdentity& identity,
                                    std::span<const uint8_t> tail = {});
// Imports the tail (whose ids must equal `tail_tokens`; a blob without a tail needs it empty)
// and the rings into `state` and returns the logits. Corruption for damaged bytes, a blob
// written for another identity than `expected` (a daemon that answers a GET with another key's
// value: the rings and logits of another prefix would pass every shape check), other tail ids,
// or versions 1 and 2 (not bound to a key: a resume replays instead); the state is unchanged on
// any error.
StatusOr<std::vector<float>> DecodeHotState(std::span<const uint8_t> bytes,
                                            const HotStateIdentity& expected, SequenceState* state,
                                            std::span<const int32_t> tail_tokens = {});

// The default bounded-replay length, in sliding windows (SessionOptions::replay_tokens = 0
// means kDefaultReplayWindows * W). Chosen from the fidelity measurements in docs/RESUME.md:
// 2W is the smallest measured length whose top-1 agreement with the uninterrupted session is
// at least 0.99 at every history on the trained miniature (W alone reached 0.977).
inline constexpr int64_t kDefaultReplayWindows = 2;

// The replay length a resume uses: `replay_tokens`, or kDefaultReplayWindows * W when 0.
// InvalidArgument when it is below the sliding window W (the rings could not be rebuilt) or
// above kMaxTokensPerCall.
StatusOr<int64_t> ResolveReplayTokens(const EngineConfig& config, uint64_t replay_tokens);

enum class GuardMode : uint8_t {
  kAuto = 0,         // fetch or recompute, whichever the estimates say is cheaper
  kAlwaysFetch,      // use every usable hit (tests, benchmarks)
  kAlwaysRecompute,  // ignore the cache (the peer in benchmarks)
};
const char* GuardModeName(GuardMode mode);

struct SessionOptions {
  // Tokens per unit (even, divisible by every compress ratio). Default 64.
  uint32_t unit_tokens = 64;
  // MaybeSave() puts new units once at least this many tokens of whole units are unsaved
  // (a multiple of unit_tokens is sensible). Default 1024.
  uint64_t save_interval_tokens = 1024;
  // Keep the hot state (SWA rings + logits, and the partial page's global KV when the state
  // ends mid-page) in the daemon's DRAM pool at every save. Default true.
  bool keep_hot_state = true;
  // TTL of the hot state in the daemon. Default 10 minutes.
  uint64_t hot_state_ttl_ms = 10 * 60 * 1000;
  // On resume, use a hot state when the daemon still has it. Default true.
  bool use_hot_state = true;
  GuardMode guard = GuardMode::kAuto;
  // Tokens a resume without hot state replays to rebuild the SWA rings (Engine::ReplayTail):
  // the last min(replay_tokens, hit) tokens of the hit. At least the sliding window W, at most
  // kMaxTokensPerCall; 0 (default) = kDefaultReplayWindows * W. More than W lets every layer's
  // ring be rebuilt from queries that saw more context (docs/RESUME.md, "Fidelity").
  uint64_t replay_tokens = 0;
  // The fastest tier a unit is put to (storage::Tier: 1 DRAM, 2 SSD). Default 2: put to SSD
  // they are durable in every durability mode (a DRAM-placed put reaches SSD only on eviction
  // or flush under `none`) and leave DRAM to what is read; the first GET promotes them.
  uint8_t unit_highest_tier = 2;
  // Units per PUT / GET call (the client also splits at the daemon's limit). Default 256.
  uint32_t max_units_per_call = 256;
};

// Running estimates the guard decides with: exponentially weighted (alpha 0.5) means of
// measured seconds. Before a measurement exists, fetch costs use documented priors
// (kPrior*); prefill speed has no prior (the store calibrates it).
class CostModel {
 public:
  static constexpr double kPriorDramFetchSPerUnit = 50e-6;
  static constexpr double kPriorSsdFetchSPerUnit = 500e-6;

  void ObserveCed(int64_t tokens, double seconds);
  void ObserveForward(int64_t tokens, double seconds);
  // tier: 0 hbm, 1 dram, 2 ssd (storage::Tier).
  void ObserveFetch(uint8_t tier, int64_t units, double seconds);

  bool has_ced() const { return ced_s_per_token_ > 0; }
  bool has_forward() const { return forward_s_per_token_ > 0; }
  double ced_s_per_token() const { return ced_s_per_token_; }
  // The forward rate; the CED rate when no forward was measured yet.
  double forward_s_per_token() const;
  double fetch_s_per_unit(uint8_t tier) const;

 private:
  double ced_s_per_token_ = 0, forward_s_per_token_ = 0;
  std::array<double, 3> fetch_s_per_unit_{};  // 0 = not measured
};

// Times the engine's full forward (ced: a CED prefill) of the first 32 of `tokens` on a scratch
// sequence into `cost`: the speed a guard needs before it has measured one. Errors as the pass.
Status CalibrateCost(Engine* engine, std::span<const int32_t> tokens, bool ced, CostModel* cost);

// Per-session save progress; the caller keeps one per live sequence.
struct SaveCursor {
  std::vector<Digest> chain;  // chain keys of the whole units of the tokens seen so far
  int64_t units_saved = 0;    // units [0, units_saved) were put
  // The turn (daemon::Client::NewTurn) the next Save's PUTs belong to, e.g. the
  // ResumeReport::turn of the resume that began it; 0: a new one. Save resets it to 0.
  uint64_t turn = 0;
};

struct ResumeReport {
  int64_t tokens = 0;                      // tokens asked for
  int64_t hit_units = 0;                   // the daemon's longest hit prefix
  int64_t units_used = 0;                  // units fetched, verified and imported
  std::array<int64_t, 3> units_by_tier{};  // of the used units: hbm, dram, ssd
  int64_t corrupt_units = 0;               // hit but missing on GET or failing verification
  bool hot_state_restored = false;         // exact restore (no replay)
  int64_t hot_tail_tokens = 0;             // tokens past the used units restored with the hot state
  // Tokens of the prompt whose state came from the cache: units_used * unit_tokens +
  // hot_tail_tokens (0 when recomputed). Restore() leaves the rest to the caller.
  int64_t restored_tokens = 0;
  int64_t replay_tokens = 0;      // bounded replay length (0 with a hot state or a recompute)
  int64_t suffix_tokens = 0;      // uncached tokens prefilled after the import
  bool recomputed = false;        // the guard (or a miss) chose a CED prefill of every token
  std::string decision;           // the guard's reason, one line
  uint8_t first_miss_reason = 0;  // storage::MissReason from LOOKUP
  uint64_t turn = 0;              // the turn its LOOKUP and GET carried (SaveCursor::turn)
  double estimated_resume_s = 0, estimated_recompute_s = 0;
  double lookup_s = 0, fetch_s = 0, replay_s = 0, suffix_s = 0, recompute_s = 0, total_s = 0;
  double hot_state_fetch_s = 0;  // the hot-state index and candidates' GETs
};

// Counters over the store's lifetime (exported as JSON by StatsJson()).
struct SessionStats {
  uint64_t units_put = 0, unit_bytes_put = 0, units_rejected = 0;
  uint64_t hot_states_put = 0, hot_state_bytes_put = 0;
  uint64_t resumes = 0, guard_fetch = 0, guard_recompute = 0, miss_recompute = 0;
  std::array<uint64_t, 3> units_hit_by_tier{};
  uint64_t corrupt_units = 0, hot_state_restores = 0, replays = 0, replay_tokens = 0;
  uint64_t suffix_tokens = 0, recomputed_tokens = 0;
};

// A hot state kvtierd holds that could continue a fetched prefix: `tail` tokens past its units
// (0: at the page boundary), kept under `key`.
struct HotStateCandidate {
  int64_t tail = 0;
  Digest key{};
  std::vector<uint8_t> bytes;
};

// What SessionStore::Fetch brought from kvtierd for SessionCodec::Complete.
struct FetchedPrefix {
  // Through the fetch: lookup, guard, units used and by tier, times. recomputed: nothing from
  // the cache is used (a miss, the guard, no usable unit) and `state` is empty.
  ResumeReport report;
  SequenceState state;                 // the report.units_used units imported (global KV only)
  std::vector<HotStateCandidate> hot;  // hot states listed for the last used page, tail ascending
};

// What SessionCodec::PrepareSave encoded for SessionStore::PutSave: whole units [first_unit,
// first_unit + units.size()) and, when `hot` is not empty, the hot state past page
// `hot_page` (hot_tail tokens past it, under hot_key).
struct PreparedSave {
  int64_t first_unit = 0;
  std::vector<Digest> keys;  // chain keys of the units
  Digest first_parent{};     // parent of the first (zeros for unit 0)
  std::vector<std::vector<uint8_t>> units;
  uint64_t turn = 0;  // SaveCursor::turn when prepared (0: PutSave starts a new turn)
  std::vector<uint8_t> hot;
  Digest hot_key{}, hot_page{};
  uint32_t hot_tail = 0;
  bool complete = false;   // every whole page of the state is saved with this one
  uint64_t bytes() const;  // encoded bytes held (units + hot state)
};

// The engine's side of save and resume: encodes a state's units and hot state and restores a
// fetched prefix, never calling kvtierd. Immutable after Create; its methods are const.
class SessionCodec {
 public:
  // engine: not owned. options: as SessionStore::Create (replay_tokens 0 resolved here).
  static StatusOr<SessionCodec> Create(Engine* engine, const Digest& fingerprint,
                                       const SessionOptions& options);

  // Encodes the whole units of `state` after cursor->units_saved, at most units_max of them (the
  // rest at the next call), and, with the call that reaches the last whole page
  // (PreparedSave::complete), its hot state as Save keeps it. Advances the cursor as if PutSave
  // will store them (chain; units_saved past the encoded units; turn 0 once complete): a caller
  // whose PutSave fails sets units_saved back (PutSave's *units_stored). Reads `state` only; the
  // result owns its bytes, so the state may change once it returns. InvalidArgument for a
  // cursor ahead of the state or units_max <= 0.
  StatusOr<PreparedSave> PrepareSave(const SequenceState& state, std::span<const float> last_logits,
                                     SaveCursor* cursor, int64_t units_max) const;
  // The engine's part of a restore of `tokens` (the same tokens Fetch was given): imports the
  // longest usable hot state of `fetched` (exact), else rebuilds the SWA rings by bounded replay
  // (Engine::ReplayTail). Sets *state (fetched's state, moved) and *last_logits as Restore does
  // and returns the finished report (restored_tokens, replay, suffix, decision). A recomputed
  // fetch gives an empty state and empty logits. Errors only from the engine.
  StatusOr<ResumeReport> Complete(std::span<const int32_t> tokens, FetchedPrefix fetched,
                                  SequenceState* state, std::vector<float>* last_logits) const;

  const SessionOptions& options() const { return options_; }
  const Digest& fingerprint() const { return fingerprint_; }
  const UnitPayloadLayout& payload_layout() const { return payload_layout_; }
  Engine* engine() const { return engine_; }

 private:
  SessionCodec(Engine* engine, const Digest& fingerprint, const SessionOptions& options,
               UnitPayloadLayout layout)
      : engine_(engine),
        fingerprint_(fingerprint),
        options_(options),
        payload_layout_(std::move(layout)) {}

  Engine* engine_;
  Digest fingerprint_;
  SessionOptions options_;
  UnitPayloadLayout payload_layout_;
};

class SessionStore {
 public:
  // engine and client are not owned and must outlive the store. `fingerprint` must be
  // EngineModelFingerprint(engine's config, weights, options.unit_tokens).
  static StatusOr<std::unique_ptr<SessionStore>> Create(Engine* engine, daemon::Client* client,
                                                        const Digest& fingerprint,
                                                        const SessionOptions& options);

  // CED prefill of an empty state (Engine::PrefillCed, up to kMaxSessionTokens tokens), timed
  // into the cost model. Errors as PrefillCed.
  Status Prefill(SequenceState* state, std::span<const int32_t> tokens,
                 std::vector<float>* last_logits);
  // Full forward of `tokens` appended to `state` (chunked prefill of a turn), timed.
  Status Extend(SequenceState* state, std::span<const int32_t> tokens,
                std::vector<float>* last_logits);

  // Puts every whole unit of `state` after cursor->units_saved, then (keep_hot_state, at least
  // one whole page) its hot state with `last_logits` (the logits of the last token; empty
  // skips the hot state), with the partial page's global KV when it ends mid-page. IOError when the
  // daemon is unreachable; units the daemon rejects (quota) are counted and not retried.
  Status Save(const SequenceState& state, std::span<const float> last_logits, SaveCursor* cursor);
  // Save() when at least save_interval_tokens of whole units are unsaved (the hot state goes
  // with it); otherwise nothing. Call after every
  // decode step and every appended turn.
  Status MaybeSave(const SequenceState& state, std::span<const float> last_logits,
                   SaveCursor* cursor);

  // Rebuilds `*state` (replaced) for `tokens` and sets `*last_logits` to the last token's
  // logits, ready for Decode. Never fails because of the cache: a miss, a corrupt unit or an
  // unreachable daemon degrades to a recompute (IOError from the daemon is reported in the
  // decision and counted). Errors only for invalid tokens or engine failures.
  StatusOr<ResumeReport> Resume(std::span<const int32_t> tokens, SequenceState* state,
                                std::vector<float>* last_logits);
  // Resume without computing anything but the bounded replay: restores the cached part of
  // `tokens` into `*state` (replaced) and sets `*last_logits` to its last token's logits. On
  // return state->tokens is the first report.restored_tokens of `tokens` (0: an empty state and
  // empty logits, for a miss or when the guard found a full forward of every token cheaper,
  // report.recomputed) and the caller runs the rest with the full forward (Engine::Forward /
  // ForwardBatch, e.g. in chunks beside other sequences). The guard compares the resume with a
  // full forward of every token, not a CED prefill, and nothing here runs CED: a config that
  // CED cannot run (Engine::ExtendCed: the decoder's kv source) restores too. Errors as Resume.
  StatusOr<ResumeReport> Restore(std::span<const int32_t> tokens, SequenceState* state,
                                 std::vector<float>* last_logits);

  // Restore's kvtierd part: LOOKUP, the guard, the GETs of the hit units (imported into
  // fetched.state) and of the hot states listed for the last used page. Calls no Engine pass:
  // in GuardMode::kAuto the guard uses the cost model as it stands, and fetches every usable
  // hit until it has a forward speed (CostModel::has_forward; seed it with ObserveForward).
  // Never fails because of the cache (as Restore); InvalidArgument for invalid tokens.
  // `abandoned` (if set) is asked after the LOOKUP and before each GET call (of at most
  // max_units_per_call units): once it says true nothing more is fetched, and the result is an
  // empty recompute (a caller whose client left wants no state; kvtierd is spared its reads).
  StatusOr<FetchedPrefix> Fetch(std::span<const int32_t> tokens,
                                const std::function<bool()>& abandoned = {});
  // Folds a restore finished by SessionCodec::Complete into stats() and the cost model (the
  // replay's forward speed). Restore does it itself.
  void Account(const ResumeReport& report);
  // Save's kvtierd part: PUTs the prepared units, then the hot state with its page's index.
  // *units_stored: units of `save` that are in kvtierd or were refused by it (quota: counted,
  // not retried) when it returns, so that a caller sets its cursor's units_saved to
  // save.first_unit + *units_stored after an error. IOError when kvtierd is unreachable.
  Status PutSave(const PreparedSave& save, int64_t* units_stored);

  const SessionStats& stats() const { return stats_; }
  std::string StatsJson() const;
  CostModel* cost_model() { return &cost_; }
  // options.replay_tokens as given to Create, with 0 resolved to the default.
  const SessionOptions& options() const { return codec_.options(); }
  const UnitPayloadLayout& payload_layout() const { return codec_.payload_layout(); }
  // Encoded unit size (header + payload).
  uint64_t unit_bytes() const { return kUnitHeaderBytes + payload_layout().payload_bytes; }

 private:
  SessionStore(daemon::Client* client, SessionCodec codec);
  // Resume (prefill = true: the rest computed here, CED for a recompute) or Restore (false).
  StatusOr<ResumeReport> ResumeOrRestore(std::span<const int32_t> tokens, SequenceState* state,
                                         std::vector<float>* last_logits, bool prefill);
  // Fetch; `prefill` says what a recompute would be (CED or the full forward) for the guard,
  // and on the engine's thread a guard without the speed it needs measures it on the engine
  // first, and the replay's Engram rows are requested while the units arrive.
  StatusOr<FetchedPrefix> FetchImpl(std::span<const int32_t> tokens, bool prefill,
                                    bool engine_thread,
                                    const std::function<bool()>& abandoned = {});
  const Digest& fingerprint() const { return codec_.fingerprint(); }
  Engine* engine() const { return codec_.engine(); }
  // The hot states listed for the page chain[units_used - 1] that `tokens` could continue with:
  // their index, then the listed ones in one GET, into fetched->hot.
  void FetchHotStates(std::span<const int32_t> tokens, const std::vector<Digest>& chain,
                      FetchedPrefix* fetched);

  daemon::Client* client_;
  SessionCodec codec_;
  CostModel cost_;
  SessionStats stats_;
};

// Chain keys of every whole unit of `tokens` (int32 ids as u32).
std::vector<Digest> SessionChainKeys(const Digest& fingerprint, std::span<const int32_t> tokens,
                                     uint32_t unit_tokens);

}  // namespace kvtier::engine
