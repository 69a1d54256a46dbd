// The prefix unit: the global KV of `unit_tokens` consecutive tokens for every KV source layer,
// stored, moved and checksummed as one all-or-nothing object. Byte-level spec:
// docs/format/unit.md.
//
//   header (128 bytes, little-endian)
//     0   magic "KVTU" (4 bytes)          4  format_version u16 (1)   6  header_bytes u16 (128)
//     8   layout_id u64 (KvLayout::LayoutId)
//     16  model_fingerprint (32)         48  key (32, the chain key)
//     80  first_token_position u64       88  token_count u32          92  flags u32 (0)
//     96  payload_bytes u64              104 reserved (16 zero bytes)
//     120 checksum u64 = xxh3-64 over header bytes [0,120) followed by the payload
//   payload (payload_bytes): for each KV source layer in layer order, with
//   entries = unit_tokens / compress_ratio:
//     main data   entries x head_dim/2         (FP4 E2M1, even element in the low nibble)
//     main scales entries x head_dim/16        (E4M3, one per 16 elements)
//     index data  entries x index_head_dim/2   (FP4 E2M1)
//     index scales entries x index_head_dim/32 (UE8M0, one per 32 elements)
//   Each region is the row-major output of kernels::Quantize for `entries` rows.
//
// Decoding validates every field and returns Corruption for anything that is not a unit of
// the expected layout: short or long input, wrong magic / version / header length / layout id /
// token count / payload length / flags / reserved bytes / position, checksum mismatch, or a
// fingerprint / key that differs from the one the caller expected. It never reads out of
// bounds and never asserts on its input.
//
// Thread safety: all functions are pure. A UnitView borrows the decoded bytes: it is valid only
// while they are alive and unchanged.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "common/key_spec.h"
#include "common/kv_layout.h"
#include "common/status.h"

namespace kvtier {

inline constexpr uint8_t kUnitMagic[4] = {'K', 'V', 'T', 'U'};
inline constexpr uint16_t kUnitFormatVersion = 1;
inline constexpr size_t kUnitHeaderBytes = 128;
inline constexpr size_t kUnitChecksumOffset = 120;
// Largest payload a unit may carry (64 MiB; the real model's 64-token unit is 56,960 bytes).
inline constexpr uint64_t kUnitPayloadBytesLimit = uint64_t{64} << 20;
// Token positions must stay below 2^48 (sanity bound; far beyond any context).
inline constexpr uint64_t kTokenPositionLimit = uint64_t{1} << 48;

// A byte range inside the payload.
struct PayloadRegion {
  uint64_t offset_bytes = 0;
  uint64_t size_bytes = 0;
};

struct SourceRegions {
  uint32_t layer_id = 0;
  uint32_t entries = 0;  // rows in each region
  PayloadRegion main_data, main_scales, index_data, index_scales;
};

// Where each region of a unit payload lies, for one KvLayout. Engines fill payloads region by
// region (kernels::Quantize writes data rows and scale rows to the two region pointers).
struct UnitPayloadLayout {
  uint64_t layout_id = 0;
  uint32_t unit_tokens = 0;
  uint32_t head_dim = 0;
  uint32_t index_head_dim = 0;
  uint64_t payload_bytes = 0;
  std::vector<SourceRegions> sources;  // in layer (payload) order

  static UnitPayloadLayout For(const KvLayout& layout);
};

// Identity of a unit: what the header binds the payload to.
struct UnitIdentity {
  Digest model_fingerprint{};
  Digest key{};                       // the unit's chain key (common/key_spec.h)
  uint64_t first_token_position = 0;  // a multiple of unit_tokens, < kTokenPositionLimit
};

// A decoded, verified unit. `payload` points into the decoded bytes.
struct UnitView {
  uint16_t format_version = 0;
  uint64_t layout_id = 0;
  uint32_t token_count = 0;
  uint64_t payload_bytes = 0;
  uint64_t checksum = 0;
  UnitIdentity identity;
  std::span<const uint8_t> payload;
};

// Encodes header + payload. InvalidArgument when payload.size() != layout.payload_bytes or
// the position is not a multiple of unit_tokens or exceeds kTokenPositionLimit.
StatusOr<std::vector<uint8_t>> EncodeUnit(const UnitPayloadLayout& layout,
                                          const UnitIdentity& identity,
                                          std::span<const uint8_t> payload);

struct UnitDecodeOptions {
  // When set, a unit whose header carries a different value is Corruption (a misdirected or
  // stale read). Default: not checked.
  std::optional<Digest> expected_model_fingerprint;
  std::optional<Digest> expected_key;
  // Verify the checksum (default true). Turn off only where the caller has just verified it.
  bool verify_checksum = true;
};

// Decodes and validates `bytes` against the expected layout (see the file comment).
StatusOr<UnitView> DecodeUnit(std::span<const uint8_t> bytes, const UnitPayloadLayout& expected,
                              const UnitDecodeOptions& options = {});

// The checksum stored at kUnitChecksumOffset: xxh3-64 of header[0,120) then the payload.
uint64_t UnitChecksum(std::span<const uint8_t> header_prefix, std::span<const uint8_t> payload);

}  // namespace kvtier
