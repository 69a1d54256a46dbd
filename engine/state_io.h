// Export and import of an engine sequence's state (reference §4, §5; docs/format/unit.md).
//
// Global KV: whole pages of unit_tokens (default 64) tokens, each as one unit payload laid out
// by common/unit_format.h's UnitPayloadLayout (per KV source in layer order: main FP4 data
// rows, main E4M3 scale rows, index-key FP4 data rows, index-key UE8M0 scale rows). The bytes
// are exactly the FP4 codes the model attends over: nothing is re-quantised on export. On the
// miniature a page is 14,240 bytes, 222.5 B/token.
//
// SWA rings: a separate blob, never part of a unit (SWA is not persisted; it lives in a hot
// pool with a TTL and is otherwise rebuilt by bounded replay, Engine::ReplayTail):
//   "KVSW" u16 version(1) u16 layers  u32 window  u32 dim  u64 tokens
//   per layer: i64 valid_from, i64 end, window*dim e4m3 codes, window*dim/32 ue8m0 codes
//   u64 xxh3-64 of everything before it.
//
// Partial page ("tail"): the global KV of the tokens past the last whole page, memory-only like
// the SWA rings (part of the hot state, session.h EncodeHotState; never a unit, never persisted):
//   "KVTL" u16 version(1) u16 sources  u64 first_token  u32 tail_tokens  tail ids (i32 LE each)
//   per source: u32 layer  u32 ratio  u32 entries  u32 group_floats  main FP4 data rows, main
//     E4M3 scale rows, index-key FP4 data rows, index-key UE8M0 scale rows (`entries` rows of
//     each), kv_state f32 LE (group_floats), score_state f32 LE (group_floats)
//   u64 xxh3-64 of everything before it.
// The compressor's partial group (kv_state / score_state) travels with it, so a state cut
// mid-group continues exactly.
//
// Thread safety: pure functions over caller-owned state.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/kv_layout.h"
#include "common/status.h"
#include "common/unit_format.h"
#include "engine/config.h"
#include "engine/model.h"

namespace kvtier::engine {

// The KvLayout of this engine's config (unit_tokens must be even and divisible by every ratio).
StatusOr<KvLayout> EngineKvLayout(const EngineConfig& config,
                                  uint32_t unit_tokens = kDefaultUnitTokens);

// Number of whole pages whose global KV the state holds.
int64_t ExportablePages(const UnitPayloadLayout& layout, const SequenceState& state);

// The payload of page `page` (tokens [page*P, (page+1)*P)). NotFound when the state does not
// hold the whole page.
StatusOr<std::vector<uint8_t>> ExportUnitPayload(const UnitPayloadLayout& layout,
                                                 const SequenceState& state, int64_t page);

// Appends one page to `state`, whose global KV must end exactly at a page boundary with no
// partial compressor group (a fresh state, or one built only by imports). `tokens` are the
// page's token ids. After the last import call Engine::ReplayTail (or ImportSwaRings) before
// decoding. InvalidArgument / Corruption on a size or state mismatch.
Status ImportUnitPayload(const UnitPayloadLayout& layout, std::span<const uint8_t> payload,
                         std::span<const int32_t> tokens, SequenceState* state);

// A whole encoded unit (common/unit_format.h header + the page's payload).
// identity.first_token_position must be page * unit_tokens.
StatusOr<std::vector<uint8_t>> ExportUnit(const UnitPayloadLayout& layout,
                                          const UnitIdentity& identity, const SequenceState& state,
                                          int64_t page);
// Verifies an encoded unit (DecodeUnit with `options`: checksum, layout, fingerprint, key)
// and appends it as ImportUnitPayload does. Corruption for a unit that fails verification or
// whose position is not the state's end.
Status ImportUnit(const UnitPayloadLayout& layout, std::span<const uint8_t> unit,
                  const UnitDecodeOptions& options, std::span<const int32_t> tokens,
                  SequenceState* state);

// Upper bound on a tail blob's tokens (sanity limit for decoding; a tail is less than a page).
inline constexpr uint32_t kTailTokensLimit = 1u << 16;

// The tail of `state` from token `first_token` (a page boundary: a multiple of every compress
// ratio) to its end. InvalidArgument when first_token is not such a boundary, lies past the end,
// or the global KV does not cover every token.
StatusOr<std::vector<uint8_t>> ExportTail(const SequenceState& state, int64_t first_token);
// Appends a tail to `state`, whose global KV must end exactly at the blob's first_token with no
// partial compressor group (built by unit imports); the blob's token ids must equal
// `tail_tokens` (the ids the caller expects at those positions). Corruption for a damaged blob or
// other ids, InvalidArgument for a shape or position that does not match the state; the state is
// unchanged on any error. Import the SWA rings after it (they count the tail's tokens).
Status ImportTail(std::span<const uint8_t> blob, std::span<const int32_t> tail_tokens,
                  SequenceState* state);

// Upper bound on a SWA blob (sanity limit for decoding).
inline constexpr uint64_t kSwaBlobBytesLimit = uint64_t{1} << 30;

std::vector<uint8_t> ExportSwaRings(const SequenceState& state);
// Restores the rings; the blob's token count must equal state->tokens.size(). Corruption for
// a damaged blob, InvalidArgument for a shape that does not match the state.
Status ImportSwaRings(std::span<const uint8_t> blob, SequenceState* state);

}  // namespace kvtier::engine
