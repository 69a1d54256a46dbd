#include "engine/session.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/checksum.h"
#include "common/logging.h"
#include "engine/state_io.h"

namespace kvtier::engine {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void AppendField(std::vector<uint8_t>* out, KeyField type, std::span<const uint8_t> value) {
  out->push_back(static_cast<uint8_t>(type));
  const uint32_t n = static_cast<uint32_t>(value.size());
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<uint8_t>(n >> (8 * i)));
  out->insert(out->end(), value.begin(), value.end());
}

std::span<const uint8_t> Bytes(std::string_view s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

void PutU16(std::vector<uint8_t>* out, uint16_t v) {
  out->push_back(static_cast<uint8_t>(v));
  out->push_back(static_cast<uint8_t>(v >> 8));
}
void PutU32(std::vector<uint8_t>* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void PutU64(std::vector<uint8_t>* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<uint8_t>(v >> (8 * i)));
}
uint64_t GetLe(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

constexpr uint8_t kHotMagic[4] = {'K', 'V', 'H', 'S'};
constexpr uint8_t kHotIndexMagic[4] = {'K', 'V', 'H', 'I'};
constexpr uint16_t kHotIndexVersion = 1;
constexpr size_t kHotIndexHeaderBytes = 8;  // magic, version, count
constexpr uint16_t kHotVersion = 3;  // 1, 2: not bound to a key (refused: the resume replays)
// magic, version, reserved, logits_count, model fingerprint, key
constexpr size_t kHotHeaderBytes = 12 + 2 * sizeof(Digest);
// Largest vocabulary a hot state may carry (sanity bound for decoding).
constexpr uint32_t kHotLogitsLimit = 1u << 24;

double Ewma(double old_value, double sample) {
  return old_value > 0 ? 0.5 * old_value + 0.5 * sample : sample;
}

}  // namespace

Digest WeightsDigest(const ModelWeights& weights) {
  std::vector<uint8_t> pre;
  AppendField(&pre, KeyField::kDomainTag, Bytes("kvtier.weights"));
  for (const auto& [name, t] : weights.file.tensors) {
    AppendField(&pre, KeyField::kText, Bytes(name));
    AppendField(&pre, KeyField::kText, Bytes(t.dtype));
    std::vector<uint8_t> shape;
    for (int64_t d : t.shape) PutU64(&shape, static_cast<uint64_t>(d));
    AppendField(&pre, KeyField::kText, shape);
    const Digest d = Sha256(t.bytes);
    AppendField(&pre, KeyField::kDigest, d);
  }
  return Sha256(pre);
}

Digest EngineModelDigest(const EngineConfig& config, const ModelWeights& weights) {
  std::vector<uint8_t> pre;
  AppendField(&pre, KeyField::kDomainTag, Bytes(kEngineModelDomainTag));
  AppendField(&pre, KeyField::kDigest, WeightsDigest(weights));
  AppendField(&pre, KeyField::kText, Bytes(config.CanonicalDescription()));
  return Sha256(pre);
}

StatusOr<Digest> EngineModelFingerprint(const EngineConfig& config, const ModelWeights& weights,
                                        uint32_t unit_tokens) {
  KVTIER_ASSIGN_OR_RETURN(KvLayout layout, EngineKvLayout(config, unit_tokens));
  return ModelFingerprint(layout.CanonicalDescription(), EngineModelDigest(config, weights),
                          kByteTokenizerId);
}

Digest SwaBlobKey(const Digest& last_chain_key) {
  std::vector<uint8_t> pre;
  AppendField(&pre, KeyField::kDomainTag, Bytes(kSwaKeyDomainTag));
  AppendField(&pre, KeyField::kDigest, last_chain_key);
  return Sha256(pre);
}

Digest HotTailKey(const Digest& last_chain_key, std::span<const int32_t> tail) {
  std::vector<uint8_t> pre;
  AppendField(&pre, KeyField::kDomainTag, Bytes(kHotTailKeyDomainTag));
  AppendField(&pre, KeyField::kDigest, last_chain_key);
  std::vector<uint8_t> ids;
  for (int32_t t : tail) PutU32(&ids, static_cast<uint32_t>(t));
  AppendField(&pre, KeyField::kTokens, ids);
  return Sha256(pre);
}

Digest HotStateIndexKey(const Digest& last_chain_key) {
  std::vector<uint8_t> pre;
  AppendField(&pre, KeyField::kDomainTag, Bytes(kHotStateIndexKeyDomainTag));
  AppendField(&pre, KeyField::kDigest, last_chain_key);
  return Sha256(pre);
}

std::vector<uint8_t> EncodeHotStateIndex(std::span<const HotStateIndexEntry> entries) {
  std::vector<uint8_t> out(kHotIndexMagic, kHotIndexMagic + 4);
  PutU16(&out, kHotIndexVersion);
  PutU16(&out, static_cast<uint16_t>(entries.size()));
  for (const HotStateIndexEntry& e : entries) {
    PutU16(&out, static_cast<uint16_t>(e.tail));
    out.insert(out.end(), e.key.begin(), e.key.end());
  }
  return out;
}

StatusOr<std::vector<HotStateIndexEntry>> DecodeHotStateIndex(std::span<const uint8_t> b,
                                                              uint32_t unit_tokens) {
  constexpr size_t kEntryBytes = 2 + sizeof(Digest);
  if (b.size() < kHotIndexHeaderBytes || std::memcmp(b.data(), kHotIndexMagic, 4) != 0)
    return Status::Corruption("hot state index: bad magic or too short");
  if (GetLe(b.data() + 4, 2) != kHotIndexVersion)
    return Status::Corruption("hot state index: version");
  const size_t count = GetLe(b.data() + 6, 2);
  if (count > kHotStateIndexEntriesMax || b.size() != kHotIndexHeaderBytes + count * kEntryBytes)
    return Status::Corruption("hot state index: entry count or size");
  std::vector<HotStateIndexEntry> entries(count);
  for (size_t i = 0; i < count; ++i) {
    const uint8_t* p = b.data() + kHotIndexHeaderBytes + i * kEntryBytes;
    entries[i].tail = static_cast<uint32_t>(GetLe(p, 2));
    if (entries[i].tail >= unit_tokens)
      return Status::Corruption("hot state index: tail past a page");
    std::memcpy(entries[i].key.data(), p + 2, sizeof(Digest));
  }
  return entries;
}

std::vector<Digest> SessionChainKeys(const Digest& fingerprint, std::span<const int32_t> tokens,
                                     uint32_t unit_tokens) {
  std::vector<uint32_t> ids(tokens.begin(), tokens.end());
  return ChainKeys(fingerprint, ids, unit_tokens);
}

std::vector<uint8_t> EncodeHotState(const SequenceState& state, std::span<const float> logits,
                                    const HotStateIdentity& identity,
                                    std::span<const uint8_t> tail) {
  std::vector<uint8_t> out(kHotMagic, kHotMagic + 4);
  PutU16(&out, kHotVersion);
  PutU16(&out, 0);
  PutU32(&out, static_cast<uint32_t>(logits.size()));
  out.insert(out.end(), identity.model_fingerprint.begin(), identity.model_fingerprint.end());
  out.insert(out.end(), identity.key.begin(), identity.key.end());
  const size_t at = out.size();
  out.resize(at + logits.size() * 4);
  std::memcpy(out.data() + at, logits.data(), logits.size() * 4);  // little-endian host
  const std::vector<uint8_t> swa = ExportSwaRings(state);
  PutU64(&out, swa.size());
  out.insert(out.end(), swa.begin(), swa.end());
  PutU64(&out, tail.size());
  out.insert(out.end(), tail.begin(), tail.end());
  PutU64(&out, Xxh3_64(out.data(), out.size()));
  return out;
}

StatusOr<std::vector<float>> DecodeHotState(std::span<const uint8_t> b,
                                            const HotStateIdentity& expected, SequenceState* state,
                                            std::span<const int32_t> tail_tokens) {
  if (b.size() < 12 || std::memcmp(b.data(), kHotMagic, 4) != 0)
    return Status::Corruption("hot state: bad magic or too short");
  const uint64_t version = GetLe(b.data() + 4, 2);
  if (version == 1 || version == 2)
    return Status::Corruption("hot state: version " + std::to_string(version) +
                              " is not bound to its key and model");
  if (version != kHotVersion) return Status::Corruption("hot state: version");
  if (b.size() < kHotHeaderBytes + 24) return Status::Corruption("hot state: too short");
  if (GetLe(b.data() + b.size() - 8, 8) != Xxh3_64(b.data(), b.size() - 8))
    return Status::Corruption("hot state: checksum mismatch");
  if (std::memcmp(b.data() + 12, expected.model_fingerprint.data(), sizeof(Digest)) != 0)
    return Status::Corruption("hot state: model fingerprint does not match");
  if (std::memcmp(b.data() + 12 + sizeof(Digest), expected.key.data(), sizeof(Digest)) != 0)
    return Status::Corruption("hot state: stored under another key");
  const uint64_t n = GetLe(b.data() + 8, 4);
  if (n > kHotLogitsLimit) return Status::Corruption("hot state: logits count");
  const uint64_t swa_at = kHotHeaderBytes + n * 4;
  if (swa_at + 16 > b.size()) return Status::Corruption("hot state: truncated");
  const uint64_t swa_len = GetLe(b.data() + swa_at, 8);
  const uint64_t room = b.size() - swa_at - 16;  // bytes between the swa length and checksum
  if (swa_len > room || room - swa_len < 8) return Status::Corruption("hot state: length");
  const uint64_t tail_at = swa_at + 8 + swa_len;
  const uint64_t tail_len = GetLe(b.data() + tail_at, 8);
  if (tail_len != room - swa_len - 8) return Status::Corruption("hot state: tail length");
  const std::span<const uint8_t> tail = b.subspan(tail_at + 8, tail_len);
  if (tail.empty() != tail_tokens.empty())
    return Status::Corruption("hot state: tail does not match the expected tokens");
  std::vector<float> logits(n);
  std::memcpy(logits.data(), b.data() + kHotHeaderBytes, n * 4);
  if (tail.empty()) {
    KVTIER_RETURN_IF_ERROR(ImportSwaRings(b.subspan(swa_at + 8, swa_len), state));
    return logits;
  }
  // The tail first (the rings count its tokens); undone if the rings are refused, so the state
  // is unchanged on any error (ImportTail itself changes nothing when it fails).
  const size_t tokens_before = state->tokens.size();
  std::vector<KvSourceCache> groups_before;
  for (const KvSourceCache& k : state->kv) {
    KvSourceCache g;
    g.n_entries = k.n_entries;
    g.consumed = k.consumed;
    g.kv_state = k.kv_state;
    g.score_state = k.score_state;
    groups_before.push_back(std::move(g));
  }
  KVTIER_RETURN_IF_ERROR(ImportTail(tail, tail_tokens, state));
  Status rings = ImportSwaRings(b.subspan(swa_at + 8, swa_len), state);
  if (!rings.ok()) {
    state->tokens.resize(tokens_before);
    for (size_t i = 0; i < state->kv.size(); ++i) {
      KvSourceCache& k = state->kv[i];
      k.Truncate(groups_before[i].n_entries);
      k.consumed = groups_before[i].consumed;
      k.kv_state = std::move(groups_before[i].kv_state);
      k.score_state = std::move(groups_before[i].score_state);
    }
    return rings;
  }
  return logits;
}

const char* GuardModeName(GuardMode mode) {
  switch (mode) {
    case GuardMode::kAuto:
      return "auto";
    case GuardMode::kAlwaysFetch:
      return "always-fetch";
    case GuardMode::kAlwaysRecompute:
      return "always-recompute";
  }
  return "?";
}

// ---- CostModel ------------------------------------------------------------------------------

void CostModel::ObserveCed(int64_t tokens, double seconds) {
  if (tokens > 0 && seconds > 0) ced_s_per_token_ = Ewma(ced_s_per_token_, seconds / tokens);
}
void CostModel::ObserveForward(int64_t tokens, double seconds) {
  if (tokens > 0 && seconds > 0)
    forward_s_per_token_ = Ewma(forward_s_per_token_, seconds / tokens);
}
void CostModel::ObserveFetch(uint8_t tier, int64_t units, double seconds) {
  if (tier < fetch_s_per_unit_.size() && units > 0 && seconds > 0)
    fetch_s_per_unit_[tier] = Ewma(fetch_s_per_unit_[tier], seconds / units);
}
double CostModel::forward_s_per_token() const {
  return forward_s_per_token_ > 0 ? forward_s_per_token_ : ced_s_per_token_;
}
double CostModel::fetch_s_per_unit(uint8_t tier) const {
  if (tier < fetch_s_per_unit_.size() && fetch_s_per_unit_[tier] > 0)
    return fetch_s_per_unit_[tier];
  return tier == 2 ? kPriorSsdFetchSPerUnit : kPriorDramFetchSPerUnit;
}

// ---- SessionCodec ----------------------------------------------------------------------------

StatusOr<int64_t> ResolveReplayTokens(const EngineConfig& config, uint64_t replay_tokens) {
  const int64_t W = config.sliding_window;
  if (replay_tokens == 0) return kDefaultReplayWindows * W;
  if (replay_tokens < static_cast<uint64_t>(W))
    return Status::InvalidArgument("replay_tokens " + std::to_string(replay_tokens) +
                                   " is below the sliding window " + std::to_string(W) +
                                   ": the SWA rings could not be rebuilt");
  if (replay_tokens > kMaxTokensPerCall)
    return Status::InvalidArgument("replay_tokens " + std::to_string(replay_tokens) +
                                   " is above kMaxTokensPerCall (" +
                                   std::to_string(kMaxTokensPerCall) + ")");
  return static_cast<int64_t>(replay_tokens);
}

uint64_t PreparedSave::bytes() const {
  uint64_t n = hot.size();
  for (const auto& u : units) n += u.size();
  return n;
}

StatusOr<SessionCodec> SessionCodec::Create(Engine* engine, const Digest& fingerprint,
                                            const SessionOptions& options) {
  if (engine == nullptr) return Status::InvalidArgument("session: engine is required");
  if (options.max_units_per_call == 0)
    return Status::InvalidArgument("session: max_units_per_call must be > 0");
  KVTIER_ASSIGN_OR_RETURN(KvLayout layout, EngineKvLayout(engine->config(), options.unit_tokens));
  SessionOptions resolved = options;
  KVTIER_ASSIGN_OR_RETURN(int64_t replay,
                          ResolveReplayTokens(engine->config(), options.replay_tokens));
  resolved.replay_tokens = static_cast<uint64_t>(replay);
  return SessionCodec(engine, fingerprint, resolved, UnitPayloadLayout::For(layout));
}

StatusOr<PreparedSave> SessionCodec::PrepareSave(const SequenceState& state,
                                                 std::span<const float> last_logits,
                                                 SaveCursor* cursor, int64_t units_max) const {
  const uint32_t P = options_.unit_tokens;
  const int64_t n = static_cast<int64_t>(state.tokens.size());
  if (state.tokens.size() > kMaxSessionTokens)
    return Status::InvalidArgument("session: more than kMaxSessionTokens tokens");
  if (units_max <= 0) return Status::InvalidArgument("session: units_max must be > 0");
  const int64_t pages = std::min<int64_t>(n / P, ExportablePages(payload_layout_, state));
  // Extend the chain incrementally (a cursor's chain is a prefix of the state's).
  if (static_cast<int64_t>(cursor->chain.size()) > pages || cursor->units_saved > pages)
    return Status::InvalidArgument("session: cursor is ahead of the state");
  while (static_cast<int64_t>(cursor->chain.size()) < pages) {
    const size_t i = cursor->chain.size();
    const Digest& parent = i == 0 ? kRootParent : cursor->chain[i - 1];
    std::vector<uint32_t> ids(state.tokens.begin() + i * P, state.tokens.begin() + (i + 1) * P);
    cursor->chain.push_back(ChainKey(fingerprint_, parent, ids));
  }
  PreparedSave out;
  out.first_unit = cursor->units_saved;
  out.turn = cursor->turn;
  if (out.first_unit > 0) out.first_parent = cursor->chain[out.first_unit - 1];
  const int64_t end = out.first_unit + std::min(pages - out.first_unit, units_max);
  for (int64_t i = out.first_unit; i < end; ++i) {
    UnitIdentity id;
    id.model_fingerprint = fingerprint_;
    id.key = cursor->chain[i];
    id.first_token_position = static_cast<uint64_t>(i) * P;
    KVTIER_ASSIGN_OR_RETURN(auto unit, ExportUnit(payload_layout_, id, state, i));
    out.units.push_back(std::move(unit));
    out.keys.push_back(cursor->chain[i]);
  }
  cursor->units_saved = end;
  out.complete = end == pages;
  if (!out.complete) return out;  // the turn stays the cursor's for the rest
  cursor->turn = 0;
  // The hot state: at a page boundary the rings and logits; mid-page also the partial page's
  // global KV (a tail of less than a page past the last whole one).
  const int64_t tail = n - pages * P;
  if (options_.keep_hot_state && pages > 0 && tail < static_cast<int64_t>(P) &&
      !last_logits.empty()) {
    std::vector<uint8_t> tail_blob;
    if (tail > 0) {
      auto t = ExportTail(state, pages * P);
      if (!t.ok()) {  // a state whose global KV lags its tokens: no hot state, not an error
        KVTIER_LOG(kWarn) << "session: hot state not kept: " << t.status().ToString();
        return out;
      }
      tail_blob = std::move(t).value();
    }
    out.hot_page = cursor->chain[pages - 1];
    out.hot_tail = static_cast<uint32_t>(tail);
    out.hot_key = tail == 0 ? SwaBlobKey(out.hot_page)
                            : HotTailKey(out.hot_page,
                                         std::span<const int32_t>(state.tokens).subspan(pages * P));
    out.hot =
        EncodeHotState(state, last_logits, HotStateIdentity{fingerprint_, out.hot_key}, tail_blob);
  }
  return out;
}

StatusOr<ResumeReport> SessionCodec::Complete(std::span<const int32_t> tokens,
                                              FetchedPrefix fetched, SequenceState* state,
                                              std::vector<float>* last_logits) const {
  ResumeReport r = std::move(fetched.report);
  if (r.recomputed) {
    *state = engine_->NewSequence();
    last_logits->clear();  // the caller computes every token
    return r;
  }
  const int64_t P = options_.unit_tokens;
  const int64_t R = static_cast<int64_t>(options_.replay_tokens);  // resolved by Create
  const int64_t at = r.units_used * P;
  SequenceState& st = fetched.state;
  if (r.units_used <= 0 || static_cast<int64_t>(tokens.size()) < at ||
      static_cast<int64_t>(st.tokens.size()) != at ||
      !std::equal(st.tokens.begin(), st.tokens.end(), tokens.begin()))
    return Status::InvalidArgument("session: the fetched prefix is not of these tokens");
  // SWA: exact restore from the longest hot state that continues the used units (page-aligned,
  // or with a partial page), else bounded replay of the last min(R, hit).
  const uint64_t vocab = static_cast<uint64_t>(engine_->config().vocab_size);
  for (size_t i = fetched.hot.size(); i-- > 0;) {  // the longest first
    const HotStateCandidate& c = fetched.hot[i];
    if (c.tail < 0 || c.tail >= P || at + c.tail > static_cast<int64_t>(tokens.size())) continue;
    // Checked before the import changes the state: a blob of another vocabulary is skipped.
    if (c.bytes.size() < 12 || GetLe(c.bytes.data() + 8, 4) != vocab) continue;
    auto logits = DecodeHotState(c.bytes, HotStateIdentity{fingerprint_, c.key}, &st,
                                 tokens.subspan(static_cast<size_t>(at), c.tail));
    if (logits.ok()) {
      *last_logits = std::move(*logits);
      r.hot_state_restored = true;
      r.hot_tail_tokens = c.tail;
      break;
    }
    KVTIER_LOG(kWarn) << "session: hot state unusable: " << logits.status().ToString();
  }
  int64_t hit_tokens = at;
  if (r.hot_state_restored) {
    hit_tokens += r.hot_tail_tokens;
  } else {
    const auto t0 = Clock::now();
    KVTIER_RETURN_IF_ERROR(engine_->ReplayTail(&st, R, last_logits));
    r.replay_s = Since(t0);
    r.replay_tokens = std::min<int64_t>(R, hit_tokens);
  }
  r.restored_tokens = hit_tokens;
  r.suffix_tokens = r.tokens - hit_tokens;
  *state = std::move(st);
  return r;
}

// ---- SessionStore ---------------------------------------------------------------------------

namespace {

// A report that uses nothing from the cache: the caller computes every token.
void MarkRecompute(ResumeReport* r) {
  r->restored_tokens = 0;
  r->hot_tail_tokens = 0;
  r->recomputed = true;
  r->units_used = 0;
  r->units_by_tier = {};
  r->replay_tokens = 0;
  r->suffix_tokens = 0;
  r->hot_state_restored = false;
}

}  // namespace

SessionStore::SessionStore(daemon::Client* client, SessionCodec codec)
    : client_(client), codec_(std::move(codec)) {}

StatusOr<std::unique_ptr<SessionStore>> SessionStore::Create(Engine* engine, daemon::Client* client,
                                                             const Digest& fingerprint,
                                                             const SessionOptions& options) {
  if (engine == nullptr || client == nullptr)
    return Status::InvalidArgument("session: engine and client are required");
  KVTIER_ASSIGN_OR_RETURN(SessionCodec codec, SessionCodec::Create(engine, fingerprint, options));
  return std::unique_ptr<SessionStore>(new SessionStore(client, std::move(codec)));
}

Status SessionStore::Prefill(SequenceState* state, std::span<const int32_t> tokens,
                             std::vector<float>* last_logits) {
  if (tokens.size() > kMaxSessionTokens)
    return Status::InvalidArgument("session: more than kMaxSessionTokens tokens");
  const auto t0 = Clock::now();
  KVTIER_RETURN_IF_ERROR(engine()->PrefillCed(state, tokens, last_logits));
  cost_.ObserveCed(static_cast<int64_t>(tokens.size()), Since(t0));
  return Status::Ok();
}

Status SessionStore::Extend(SequenceState* state, std::span<const int32_t> tokens,
                            std::vector<float>* last_logits) {
  const auto t0 = Clock::now();
  for (size_t at = 0; at < tokens.size(); at += kSuffixChunkTokens) {
    const size_t n = std::min(kSuffixChunkTokens, tokens.size() - at);
    KVTIER_RETURN_IF_ERROR(engine()->Forward(state, tokens.subspan(at, n), false, last_logits));
  }
  cost_.ObserveForward(static_cast<int64_t>(tokens.size()), Since(t0));
  return Status::Ok();
}

Status SessionStore::Save(const SequenceState& state, std::span<const float> last_logits,
                          SaveCursor* cursor) {
  // A call's worth of units at a time, so a long state's encoded units are never all held; all
  // of them one turn (one request for the policies).
  if (cursor->turn == 0) cursor->turn = client_->NewTurn();
  while (true) {
    KVTIER_ASSIGN_OR_RETURN(
        PreparedSave save,
        codec_.PrepareSave(state, last_logits, cursor, codec_.options().max_units_per_call));
    int64_t stored = 0;
    Status s = PutSave(save, &stored);
    if (!s.ok()) {
      cursor->units_saved = save.first_unit + stored;
      cursor->turn = 0;
      return s;
    }
    if (save.complete) return Status::Ok();
  }
}

Status SessionStore::PutSave(const PreparedSave& save, int64_t* units_stored) {
  *units_stored = 0;
  const SessionOptions& o = codec_.options();
  const uint32_t P = o.unit_tokens;
  daemon::PutOptions po;
  po.kind = 0;  // policies::ObjectKind::kGlobalKv
  po.allow_ssd = true;
  po.highest_tier = o.unit_highest_tier;
  po.recompute_tokens = P;
  po.turn = save.turn != 0 ? save.turn : client_->NewTurn();  // one request: the turn
  const int64_t n = static_cast<int64_t>(save.units.size());
  for (int64_t first = 0; first < n; first += o.max_units_per_call) {
    const int64_t count = std::min<int64_t>(n - first, o.max_units_per_call);
    std::vector<daemon::PutUnit> units;
    units.reserve(count);
    for (int64_t i = first; i < first + count; ++i) {
      daemon::PutUnit u;
      u.key = save.keys[i];
      u.parent = i == 0 ? save.first_parent : save.keys[i - 1];
      u.value = save.units[i];
      units.push_back(u);
    }
    KVTIER_ASSIGN_OR_RETURN(std::vector<Status> put, client_->Put(units, po));
    for (size_t i = 0; i < put.size(); ++i) {
      if (put[i].ok()) {
        ++stats_.units_put;
        stats_.unit_bytes_put += save.units[first + i].size();
      } else {
        ++stats_.units_rejected;
        KVTIER_LOG(kWarn) << "session: unit " << (save.first_unit + first + static_cast<int64_t>(i))
                          << " not stored: " << put[i].ToString();
      }
    }
    *units_stored = first + count;
  }
  if (save.hot.empty()) return Status::Ok();
  daemon::PutOptions ho;
  ho.kind = 1;  // policies::ObjectKind::kSwa
  ho.allow_ssd = false;
  ho.highest_tier = 1;  // DRAM
  ho.ttl_ms = o.hot_state_ttl_ms;
  ho.turn = po.turn;
  // The page's index gets this state first, then the page-aligned state if one is listed (it
  // continues every prompt that extends the page, where a tail state continues only those that
  // repeat its tail: many branches past a page must not push it out), then the others already
  // listed, most recent first (read first; an index that is missing or unreadable starts empty).
  const daemon::wire::Key index_key = HotStateIndexKey(save.hot_page);
  std::vector<HotStateIndexEntry> entries = {{save.hot_tail, save.hot_key}};
  {
    std::vector<uint8_t> bytes;
    const Status gs = client_->Get(std::span<const daemon::wire::Key>(&index_key, 1), ho.turn,
                                   [&](size_t, const daemon::GetItem& item) {
                                     if (item.status.ok())
                                       bytes.assign(item.value.begin(), item.value.end());
                                   });
    if (gs.ok() && !bytes.empty()) {
      if (auto old = DecodeHotStateIndex(bytes, P); old.ok()) {
        std::stable_partition(old->begin(), old->end(),
                              [](const HotStateIndexEntry& e) { return e.tail == 0; });
        for (const HotStateIndexEntry& e : *old) {
          if (e.key != save.hot_key && entries.size() < kHotStateIndexEntriesMax)
            entries.push_back(e);
        }
      }
    }
  }
  const std::vector<uint8_t> index = EncodeHotStateIndex(entries);
  daemon::PutUnit u[2];  // values are views
  u[0].key = save.hot_key;
  u[0].value = save.hot;
  u[1].key = index_key;
  u[1].value = index;
  KVTIER_ASSIGN_OR_RETURN(std::vector<Status> put,
                          client_->Put(std::span<const daemon::PutUnit>(u, 2), ho));
  if (put.size() == 2 && put[0].ok() && put[1].ok()) {
    ++stats_.hot_states_put;
    stats_.hot_state_bytes_put += save.hot.size();
  } else {
    for (const Status& p : put) {
      if (!p.ok()) {
        KVTIER_LOG(kWarn) << "session: hot state not stored: " << p.ToString();
      }
    }
  }
  return Status::Ok();
}

Status SessionStore::MaybeSave(const SequenceState& state, std::span<const float> last_logits,
                               SaveCursor* cursor) {
  const uint64_t P = options().unit_tokens;
  const uint64_t n = state.tokens.size();
  if (n / P < static_cast<uint64_t>(cursor->units_saved)) return Status::Ok();
  const uint64_t unsaved = (n / P - static_cast<uint64_t>(cursor->units_saved)) * P;
  if (unsaved == 0 || unsaved < options().save_interval_tokens) return Status::Ok();
  return Save(state, last_logits, cursor);
}

Status CalibrateCost(Engine* engine, std::span<const int32_t> tokens, bool ced, CostModel* cost) {
  constexpr size_t kCalibrationTokens = 32;
  SequenceState scratch = engine->NewSequence();
  std::vector<float> logits;
  const size_t n = std::min(kCalibrationTokens, tokens.size());
  const auto t0 = Clock::now();
  if (ced) {
    KVTIER_RETURN_IF_ERROR(engine->PrefillCed(&scratch, tokens.first(n), &logits));
    cost->ObserveCed(static_cast<int64_t>(n), Since(t0));
  } else {
    KVTIER_RETURN_IF_ERROR(engine->Forward(&scratch, tokens.first(n), false, &logits));
    cost->ObserveForward(static_cast<int64_t>(n), Since(t0));
  }
  return Status::Ok();
}

StatusOr<ResumeReport> SessionStore::Resume(std::span<const int32_t> tokens, SequenceState* state,
                                            std::vector<float>* last_logits) {
  return ResumeOrRestore(tokens, state, last_logits, /*prefill=*/true);
}

StatusOr<ResumeReport> SessionStore::Restore(std::span<const int32_t> tokens, SequenceState* state,
                                             std::vector<float>* last_logits) {
  return ResumeOrRestore(tokens, state, last_logits, /*prefill=*/false);
}

StatusOr<FetchedPrefix> SessionStore::Fetch(std::span<const int32_t> tokens,
                                            const std::function<bool()>& abandoned) {
  return FetchImpl(tokens, /*prefill=*/false, /*engine_thread=*/false, abandoned);
}

void SessionStore::Account(const ResumeReport& r) {
  if (r.recomputed) {
    stats_.recomputed_tokens += static_cast<uint64_t>(r.tokens);
    return;
  }
  if (r.hot_state_restored) {
    ++stats_.hot_state_restores;
  } else {
    cost_.ObserveForward(r.replay_tokens, r.replay_s);
    ++stats_.replays;
    stats_.replay_tokens += static_cast<uint64_t>(r.replay_tokens);
  }
}

void SessionStore::FetchHotStates(std::span<const int32_t> tokens, const std::vector<Digest>& chain,
                                  FetchedPrefix* f) {
  const int64_t P = options().unit_tokens;
  const int64_t at = f->report.units_used * P;  // the state's end: the used units
  const int64_t tail_max = std::min<int64_t>(P - 1, static_cast<int64_t>(tokens.size()) - at);
  const Digest& page = chain[f->report.units_used - 1];
  // The page's index: which hot states were kept past it (none: nothing to ask for).
  std::vector<uint8_t> index;
  const daemon::wire::Key ik = HotStateIndexKey(page);
  Status gs = client_->Get(std::span<const daemon::wire::Key>(&ik, 1), f->report.turn,
                           [&](size_t, const daemon::GetItem& item) {
                             if (item.status.ok())
                               index.assign(item.value.begin(), item.value.end());
                           });
  if (!gs.ok()) {
    KVTIER_LOG(kWarn) << "session: hot state index GET failed: " << gs.ToString();
    return;
  }
  if (index.empty()) return;
  auto listed = DecodeHotStateIndex(index, static_cast<uint32_t>(P));
  if (!listed.ok()) {
    KVTIER_LOG(kWarn) << "session: hot state index unusable: " << listed.status().ToString();
    return;
  }
  // Of those, the ones this prompt continues with, in increasing length.
  std::sort(
      listed->begin(), listed->end(),
      [](const HotStateIndexEntry& a, const HotStateIndexEntry& b) { return a.tail < b.tail; });
  std::vector<HotStateCandidate> wanted;
  std::vector<daemon::wire::Key> keys;
  for (const HotStateIndexEntry& e : *listed) {
    const int64_t j = e.tail;
    if (j > tail_max) continue;
    if (e.key != (j == 0 ? SwaBlobKey(page) : HotTailKey(page, tokens.subspan(at, j)))) continue;
    wanted.push_back(HotStateCandidate{j, e.key, {}});
    keys.push_back(e.key);
  }
  if (keys.empty()) return;
  gs = client_->Get(keys, f->report.turn, [&](size_t i, const daemon::GetItem& item) {
    if (item.status.ok() && i < wanted.size())
      wanted[i].bytes.assign(item.value.begin(), item.value.end());
  });
  if (!gs.ok()) {
    KVTIER_LOG(kWarn) << "session: hot state GET failed: " << gs.ToString();
    return;
  }
  for (HotStateCandidate& c : wanted) {
    if (!c.bytes.empty()) f->hot.push_back(std::move(c));
  }
}

StatusOr<FetchedPrefix> SessionStore::FetchImpl(std::span<const int32_t> tokens, bool prefill,
                                                bool engine_thread,
                                                const std::function<bool()>& abandoned) {
  if (tokens.empty() || tokens.size() > kMaxSessionTokens)
    return Status::InvalidArgument("session: resume needs 1..kMaxSessionTokens tokens");
  for (int32_t t : tokens) {
    if (t < 0 || t >= engine()->config().vocab_size)
      return Status::InvalidArgument("session: token id outside the vocabulary");
  }
  const SessionOptions& o = options();
  FetchedPrefix f;
  ResumeReport& r = f.report;
  r.tokens = static_cast<int64_t>(tokens.size());
  ++stats_.resumes;
  const uint32_t P = o.unit_tokens;
  const int64_t R = static_cast<int64_t>(o.replay_tokens);  // resolved by Create
  auto recompute = [&](std::string decision) {
    r.decision = std::move(decision);
    MarkRecompute(&r);
    return std::move(f);
  };

  if (o.guard == GuardMode::kAlwaysRecompute) {
    ++stats_.guard_recompute;
    return recompute("guard mode always-recompute");
  }

  // 1. LOOKUP the chain of whole units.
  const std::vector<Digest> chain = SessionChainKeys(fingerprint(), tokens, P);
  r.turn = client_->NewTurn();  // LOOKUP, GET and the turn's Save: one request for the policies
  auto t0 = Clock::now();
  StatusOr<daemon::LookupResult> lk = chain.empty()
                                          ? StatusOr<daemon::LookupResult>(daemon::LookupResult{})
                                          : client_->Lookup(chain, r.turn);
  r.lookup_s = Since(t0);
  if (!lk.ok()) {
    ++stats_.miss_recompute;
    return recompute("lookup failed (" + lk.status().ToString() + "): recompute");
  }
  r.hit_units = static_cast<int64_t>(std::min(lk->hit_count, chain.size()));
  r.first_miss_reason = lk->first_miss;
  auto gone = [&] { return abandoned && abandoned(); };
  // After the LOOKUP, before a GET: nothing more is fetched, and what was is dropped.
  auto give_up = [&] {
    f.state = SequenceState{};
    return recompute("abandoned by the caller after " + std::to_string(r.units_used) + " units");
  };
  if (gone()) return give_up();
  if (r.hit_units == 0) {
    ++stats_.miss_recompute;
    return recompute("no hit: recompute");
  }

  // 2. The guard, before any fetch: estimated fetch + replay + suffix vs CED of everything
  // (Resume) or a full forward of everything (Restore). Restore computes nothing with CED and
  // calibrates the full forward: a config that CED cannot run (Engine::ExtendCed) restores. Off
  // the engine's thread nothing is calibrated: without the speed it needs the guard fetches.
  bool guard = o.guard == GuardMode::kAuto;
  if (guard && engine_thread) {
    if (prefill && !cost_.has_ced()) {
      KVTIER_RETURN_IF_ERROR(CalibrateCost(engine(), tokens, /*ced=*/true, &cost_));
    } else if (!prefill && !cost_.has_forward()) {
      KVTIER_RETURN_IF_ERROR(CalibrateCost(engine(), tokens, /*ced=*/false, &cost_));
    }
  }
  const bool has_speed = prefill ? cost_.has_ced() : cost_.has_forward();
  guard = guard && has_speed;
  auto estimate = [&](int64_t used_units, const std::vector<uint8_t>& tiers) {
    double s = 0;
    for (int64_t i = 0; i < used_units; ++i)
      s += cost_.fetch_s_per_unit(i < static_cast<int64_t>(tiers.size()) ? tiers[i] : 2);
    const int64_t hit_tokens = used_units * P;
    s += static_cast<double>(std::min<int64_t>(R, hit_tokens) + (r.tokens - hit_tokens)) *
         cost_.forward_s_per_token();
    return s;
  };
  r.estimated_resume_s = estimate(r.hit_units, lk->tiers);
  // Resume recomputes with a CED prefill; a Restore's caller with the full forward.
  r.estimated_recompute_s = static_cast<double>(r.tokens) *
                            (prefill ? cost_.ced_s_per_token() : cost_.forward_s_per_token());
  if (guard && r.estimated_recompute_s < r.estimated_resume_s) {
    std::ostringstream why;
    why << "guard: recompute " << r.estimated_recompute_s << " s < fetch+replay+suffix "
        << r.estimated_resume_s << " s";
    ++stats_.guard_recompute;
    return recompute(why.str());
  }

  // 3. GET the hit units (and the hot state) and import them in order. On the engine's
  // thread, the Engram rows the bounded replay will need are known now (they depend only on
  // tokens): request them first, so they arrive while the units do. A hint only: if the replay
  // does not happen or covers other positions the batches are dropped unused; a refused hint is
  // requested again later.
  if (engine_thread) {
    if (Status hint = engine()->PrefetchEngramReplay(tokens.first(r.hit_units * P), R);
        !hint.ok()) {
      KVTIER_LOG(kDebug) << "session: Engram replay prefetch not issued: " << hint.ToString();
    }
  }
  t0 = Clock::now();
  f.state = engine()->NewSequence();
  // The units, then the uncached suffix, append without moving what is held.
  ReserveKvTokens(&f.state, static_cast<int64_t>(tokens.size()));
  std::vector<daemon::wire::Key> keys(chain.begin(), chain.begin() + r.hit_units);
  bool stopped = false;
  std::array<int64_t, 3> tier_units{};
  UnitDecodeOptions dopts;
  dopts.expected_model_fingerprint = fingerprint();
  for (int64_t first = 0; first < r.hit_units && !stopped; first += o.max_units_per_call) {
    if (gone()) return give_up();
    const int64_t count = std::min<int64_t>(r.hit_units - first, o.max_units_per_call);
    std::vector<daemon::wire::Key> batch(keys.begin() + first, keys.begin() + first + count);
    Status gs = client_->Get(batch, r.turn, [&](size_t j, const daemon::GetItem& item) {
      if (stopped || static_cast<int64_t>(j) >= count) return;
      const int64_t i = first + static_cast<int64_t>(j);
      if (!item.status.ok()) {
        stopped = true;
        KVTIER_LOG(kWarn) << "session: unit " << i << " hit on LOOKUP but GET says "
                          << item.status.ToString();
        return;
      }
      dopts.expected_key = chain[i];
      Status s = ImportUnit(payload_layout(), item.value, dopts,
                            tokens.subspan(static_cast<size_t>(i) * P, P), &f.state);
      if (!s.ok()) {
        stopped = true;
        KVTIER_LOG(kWarn) << "session: unit " << i << " rejected: " << s.ToString();
        return;
      }
      ++r.units_used;
      if (item.tier < 3) ++tier_units[item.tier];
    });
    if (!gs.ok()) {
      KVTIER_LOG(kWarn) << "session: GET failed: " << gs.ToString();
      stopped = true;
    }
  }
  r.fetch_s = Since(t0);
  r.corrupt_units = r.hit_units - r.units_used;
  if (r.units_used < r.hit_units) ShrinkKvToFit(&f.state);  // reserved for more than arrived
  stats_.corrupt_units += static_cast<uint64_t>(r.corrupt_units);
  for (uint8_t t = 0; t < 3; ++t) {
    r.units_by_tier[t] = tier_units[t];
    // Attribute the fetch time to tiers in proportion to their units.
    if (tier_units[t] > 0 && r.units_used > 0) {
      cost_.ObserveFetch(t, tier_units[t],
                         r.fetch_s * static_cast<double>(tier_units[t]) / r.units_used);
    }
  }
  if (r.units_used == 0) {
    ++stats_.miss_recompute;
    f.state = SequenceState{};
    return recompute("no usable unit (" + std::to_string(r.corrupt_units) +
                     " missing or corrupt): recompute");
  }
  if (r.units_used < r.hit_units && guard) {
    // A shorter hit than looked up: re-check the guard with what is already paid.
    const double rest = static_cast<double>(std::min<int64_t>(R, r.units_used * P) +
                                            (r.tokens - r.units_used * P)) *
                        cost_.forward_s_per_token();
    if (r.estimated_recompute_s < rest) {
      ++stats_.guard_recompute;
      f.state = SequenceState{};
      return recompute("short hit after " + std::to_string(r.corrupt_units) +
                       " bad units; guard: recompute is cheaper");
    }
  }
  ++stats_.guard_fetch;
  for (uint8_t t = 0; t < 3; ++t) stats_.units_hit_by_tier[t] += tier_units[t];

  // 4. The hot states that could continue the used units, for Complete to import the longest.
  if (gone()) return give_up();
  if (o.use_hot_state && o.keep_hot_state) {
    t0 = Clock::now();
    FetchHotStates(tokens, chain, &f);
    r.hot_state_fetch_s = Since(t0);
  }

  std::ostringstream why;
  if (guard) {
    why << "guard: fetch+replay+suffix " << r.estimated_resume_s << " s <= recompute "
        << r.estimated_recompute_s << " s";
  } else if (o.guard == GuardMode::kAuto) {
    why << "guard: no forward speed measured yet: fetch";
  } else {
    why << "guard mode " << GuardModeName(o.guard);
  }
  if (r.corrupt_units > 0) why << "; " << r.corrupt_units << " hit units missing or corrupt";
  r.decision = why.str();
  return f;
}

StatusOr<ResumeReport> SessionStore::ResumeOrRestore(std::span<const int32_t> tokens,
                                                     SequenceState* state,
                                                     std::vector<float>* last_logits,
                                                     bool prefill) {
  const auto t_start = Clock::now();
  KVTIER_ASSIGN_OR_RETURN(FetchedPrefix fetched,
                          FetchImpl(tokens, prefill, /*engine_thread=*/true));
  KVTIER_ASSIGN_OR_RETURN(ResumeReport r,
                          codec_.Complete(tokens, std::move(fetched), state, last_logits));
  Account(r);
  if (r.recomputed && prefill) {
    const auto t0 = Clock::now();
    KVTIER_RETURN_IF_ERROR(Prefill(state, tokens, last_logits));
    r.recompute_s = Since(t0);
  }
  // The uncached suffix: prefilled here (Resume) or left to the caller (Restore).
  if (!r.recomputed && r.suffix_tokens > 0 && prefill) {
    const auto t0 = Clock::now();
    KVTIER_RETURN_IF_ERROR(Extend(state, tokens.subspan(r.restored_tokens), last_logits));
    r.suffix_s = Since(t0);
    stats_.suffix_tokens += static_cast<uint64_t>(r.suffix_tokens);
  }
  r.total_s = Since(t_start);
  KVTIER_LOG(kInfo) << "session resume: " << r.tokens << " tokens, "
                    << (r.recomputed ? "recompute" : "fetch") << " (" << r.decision << "), used "
                    << r.units_used << "/" << r.hit_units << " units, "
                    << "replay " << r.replay_tokens << ", suffix " << r.suffix_tokens << ", "
                    << r.total_s << " s";
  return r;
}

std::string SessionStore::StatsJson() const {
  nlohmann::ordered_json j;
  j["units_put"] = stats_.units_put;
  j["unit_bytes_put"] = stats_.unit_bytes_put;
  j["units_rejected"] = stats_.units_rejected;
  j["hot_states_put"] = stats_.hot_states_put;
  j["hot_state_bytes_put"] = stats_.hot_state_bytes_put;
  j["resumes"] = stats_.resumes;
  j["guard_fetch"] = stats_.guard_fetch;
  j["guard_recompute"] = stats_.guard_recompute;
  j["miss_recompute"] = stats_.miss_recompute;
  for (uint8_t t = 0; t < 3; ++t)
    j[std::string("units_hit_") + daemon::wire::TierName(t)] = stats_.units_hit_by_tier[t];
  j["corrupt_units"] = stats_.corrupt_units;
  j["hot_state_restores"] = stats_.hot_state_restores;
  j["replays"] = stats_.replays;
  j["replay_tokens"] = stats_.replay_tokens;
  j["suffix_tokens"] = stats_.suffix_tokens;
  j["recomputed_tokens"] = stats_.recomputed_tokens;
  j["ced_s_per_token"] = cost_.ced_s_per_token();
  j["forward_s_per_token"] = cost_.forward_s_per_token();
  j["fetch_s_per_unit_dram"] = cost_.fetch_s_per_unit(1);
  j["fetch_s_per_unit_ssd"] = cost_.fetch_s_per_unit(2);
  return j.dump();
}

}  // namespace kvtier::engine
