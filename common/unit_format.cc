#include "common/unit_format.h"

#include <cstring>
#include <string>

#include "common/checksum.h"

namespace kvtier {
namespace {

// Header field offsets (docs/format/unit.md).
constexpr size_t kOffMagic = 0;
constexpr size_t kOffVersion = 4;
constexpr size_t kOffHeaderBytes = 6;
constexpr size_t kOffLayoutId = 8;
constexpr size_t kOffFingerprint = 16;
constexpr size_t kOffKey = 48;
constexpr size_t kOffPosition = 80;
constexpr size_t kOffTokenCount = 88;
constexpr size_t kOffFlags = 92;
constexpr size_t kOffPayloadBytes = 96;
constexpr size_t kOffReserved = 104;
constexpr size_t kReservedBytes = 16;
static_assert(kOffReserved + kReservedBytes == kUnitChecksumOffset);
static_assert(kUnitChecksumOffset + 8 == kUnitHeaderBytes);

void PutLE(uint8_t* p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint64_t GetLE(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

Status Bad(const std::string& what) { return Status::Corruption("unit: " + what); }

}  // namespace

UnitPayloadLayout UnitPayloadLayout::For(const KvLayout& layout) {
  UnitPayloadLayout out;
  out.layout_id = layout.LayoutId();
  out.unit_tokens = layout.unit_tokens;
  out.head_dim = layout.head_dim;
  out.index_head_dim = layout.index_head_dim;
  uint64_t off = 0;
  auto take = [&off](uint64_t size) {
    PayloadRegion r{off, size};
    off += size;
    return r;
  };
  for (const KvSourceLayout& s : layout.sources) {
    SourceRegions r;
    r.layer_id = s.layer_id;
    r.entries = s.entries_per_unit;
    const uint64_t n = s.entries_per_unit;
    r.main_data = take(n * (layout.head_dim / 2));
    r.main_scales = take(n * (layout.head_dim / 16));
    r.index_data = take(n * (layout.index_head_dim / 2));
    r.index_scales = take(n * (layout.index_head_dim / 32));
    out.sources.push_back(r);
  }
  out.payload_bytes = off;
  return out;
}

uint64_t UnitChecksum(std::span<const uint8_t> header_prefix, std::span<const uint8_t> payload) {
  Checksum64 sum;
  sum.Update(header_prefix);
  sum.Update(payload);
  return sum.Digest();
}

StatusOr<std::vector<uint8_t>> EncodeUnit(const UnitPayloadLayout& layout,
                                          const UnitIdentity& identity,
                                          std::span<const uint8_t> payload) {
  if (payload.size() != layout.payload_bytes || payload.size() > kUnitPayloadBytesLimit) {
    return Status::InvalidArgument("EncodeUnit: payload is " + std::to_string(payload.size()) +
                                   " bytes, layout wants " + std::to_string(layout.payload_bytes));
  }
  if (layout.unit_tokens == 0 || identity.first_token_position % layout.unit_tokens != 0 ||
      identity.first_token_position >= kTokenPositionLimit) {
    return Status::InvalidArgument("EncodeUnit: first_token_position " +
                                   std::to_string(identity.first_token_position) +
                                   " is not a unit boundary below 2^48");
  }
  std::vector<uint8_t> out(kUnitHeaderBytes + payload.size(), 0);
  uint8_t* h = out.data();
  std::memcpy(h + kOffMagic, kUnitMagic, sizeof(kUnitMagic));
  PutLE(h + kOffVersion, kUnitFormatVersion, 2);
  PutLE(h + kOffHeaderBytes, kUnitHeaderBytes, 2);
  PutLE(h + kOffLayoutId, layout.layout_id, 8);
  std::memcpy(h + kOffFingerprint, identity.model_fingerprint.data(), 32);
  std::memcpy(h + kOffKey, identity.key.data(), 32);
  PutLE(h + kOffPosition, identity.first_token_position, 8);
  PutLE(h + kOffTokenCount, layout.unit_tokens, 4);
  PutLE(h + kOffFlags, 0, 4);
  PutLE(h + kOffPayloadBytes, payload.size(), 8);
  if (!payload.empty()) std::memcpy(h + kUnitHeaderBytes, payload.data(), payload.size());
  const uint64_t sum = UnitChecksum(std::span<const uint8_t>(h, kUnitChecksumOffset), payload);
  PutLE(h + kUnitChecksumOffset, sum, 8);
  return out;
}

StatusOr<UnitView> DecodeUnit(std::span<const uint8_t> bytes, const UnitPayloadLayout& expected,
                              const UnitDecodeOptions& options) {
  if (bytes.size() < kUnitHeaderBytes) {
    return Bad("truncated: " + std::to_string(bytes.size()) + " bytes, header needs " +
               std::to_string(kUnitHeaderBytes));
  }
  const uint8_t* h = bytes.data();
  if (std::memcmp(h + kOffMagic, kUnitMagic, sizeof(kUnitMagic)) != 0) return Bad("bad magic");
  UnitView v;
  v.format_version = static_cast<uint16_t>(GetLE(h + kOffVersion, 2));
  if (v.format_version != kUnitFormatVersion) {
    return Bad("unsupported format version " + std::to_string(v.format_version));
  }
  if (GetLE(h + kOffHeaderBytes, 2) != kUnitHeaderBytes) return Bad("bad header length");
  v.payload_bytes = GetLE(h + kOffPayloadBytes, 8);
  if (v.payload_bytes != expected.payload_bytes || v.payload_bytes > kUnitPayloadBytesLimit) {
    return Bad("payload_bytes " + std::to_string(v.payload_bytes) + ", layout wants " +
               std::to_string(expected.payload_bytes));
  }
  // Compare without overflow: payload_bytes is bounded above.
  if (bytes.size() - kUnitHeaderBytes != v.payload_bytes) {
    return Bad("length " + std::to_string(bytes.size()) + " does not match header + payload " +
               std::to_string(kUnitHeaderBytes + v.payload_bytes));
  }
  v.payload = bytes.subspan(kUnitHeaderBytes, v.payload_bytes);
  v.checksum = GetLE(h + kUnitChecksumOffset, 8);
  if (options.verify_checksum &&
      UnitChecksum(bytes.first(kUnitChecksumOffset), v.payload) != v.checksum) {
    return Bad("checksum mismatch (xxh3-64)");
  }
  v.layout_id = GetLE(h + kOffLayoutId, 8);
  if (v.layout_id != expected.layout_id) return Bad("layout id does not match");
  v.token_count = static_cast<uint32_t>(GetLE(h + kOffTokenCount, 4));
  if (v.token_count != expected.unit_tokens) return Bad("token count does not match layout");
  if (GetLE(h + kOffFlags, 4) != 0) return Bad("unknown flags");
  for (size_t i = 0; i < kReservedBytes; ++i) {
    if (h[kOffReserved + i] != 0) return Bad("reserved bytes are not zero");
  }
  v.identity.first_token_position = GetLE(h + kOffPosition, 8);
  if (v.identity.first_token_position >= kTokenPositionLimit || v.token_count == 0 ||
      v.identity.first_token_position % v.token_count != 0) {
    return Bad("first_token_position is not a unit boundary");
  }
  std::memcpy(v.identity.model_fingerprint.data(), h + kOffFingerprint, 32);
  std::memcpy(v.identity.key.data(), h + kOffKey, 32);
  if (options.expected_model_fingerprint &&
      *options.expected_model_fingerprint != v.identity.model_fingerprint) {
    return Bad("model fingerprint does not match");
  }
  if (options.expected_key && *options.expected_key != v.identity.key) {
    return Bad("key does not match");
  }
  return v;
}

}  // namespace kvtier
