#include "common/unit_format.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "common/checksum.h"
#include "common/shipped_models.h"

namespace kvtier {
namespace {

KvLayout MiniLayout() {
  StatusOr<KvLayout> l = ParseKvLayout(FindShippedModel("mini-v4.1")->config_json, {});
  EXPECT_TRUE(l.ok());
  return *l;
}

// A deliberately tiny layout (2 sources, 4-token units: 4*(8+1+16+1)/2 + 4*26 = 156 bytes of
// payload) so that every bit flip and truncation can be tried exhaustively.
KvLayout TinyLayout() {
  StatusOr<KvLayout> l = MakeKvLayout(16, 32, {0, 2, 1}, {1, 2}, 4);
  EXPECT_TRUE(l.ok()) << l.status().ToString();
  return *l;
}

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> out(n);
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

UnitIdentity Identity(uint64_t position) {
  UnitIdentity id;
  id.model_fingerprint.fill(0x42);
  for (size_t i = 0; i < id.key.size(); ++i) id.key[i] = static_cast<uint8_t>(i * 7 + 1);
  id.first_token_position = position;
  return id;
}

TEST(UnitPayloadLayout, RegionsAreContiguousInSpecOrder) {
  const UnitPayloadLayout p = UnitPayloadLayout::For(MiniLayout());
  EXPECT_EQ(p.payload_bytes, 14240u);
  ASSERT_EQ(p.sources.size(), 4u);
  uint64_t off = 0;
  for (const SourceRegions& s : p.sources) {
    for (const PayloadRegion* r : {&s.main_data, &s.main_scales, &s.index_data, &s.index_scales}) {
      EXPECT_EQ(r->offset_bytes, off);
      off += r->size_bytes;
    }
  }
  EXPECT_EQ(off, p.payload_bytes);
  // Source 0 (layer 2, ratio 2): 32 entries; main 32x64 + 32x8, index 32x16 + 32x1.
  EXPECT_EQ(p.sources[0].layer_id, 2u);
  EXPECT_EQ(p.sources[0].entries, 32u);
  EXPECT_EQ(p.sources[0].main_data.size_bytes, 32u * 64);
  EXPECT_EQ(p.sources[0].main_scales.size_bytes, 32u * 8);
  EXPECT_EQ(p.sources[0].index_data.size_bytes, 32u * 16);
  EXPECT_EQ(p.sources[0].index_scales.size_bytes, 32u);
  EXPECT_EQ(p.sources[3].entries, 64u);
  EXPECT_EQ(p.sources[3].main_data.offset_bytes, 3u * 2848);
}

TEST(UnitFormat, RoundTripKeepsEveryField) {
  const UnitPayloadLayout p = UnitPayloadLayout::For(MiniLayout());
  const std::vector<uint8_t> payload = RandomBytes(p.payload_bytes, 1);
  StatusOr<std::vector<uint8_t>> bytes = EncodeUnit(p, Identity(128), payload);
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  ASSERT_EQ(bytes->size(), kUnitHeaderBytes + 14240);
  EXPECT_EQ(std::string(bytes->begin(), bytes->begin() + 4), "KVTU");

  UnitDecodeOptions opts;
  opts.expected_model_fingerprint = Identity(0).model_fingerprint;
  opts.expected_key = Identity(0).key;
  StatusOr<UnitView> v = DecodeUnit(*bytes, p, opts);
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_EQ(v->format_version, kUnitFormatVersion);
  EXPECT_EQ(v->layout_id, p.layout_id);
  EXPECT_EQ(v->token_count, 64u);
  EXPECT_EQ(v->payload_bytes, 14240u);
  EXPECT_EQ(v->identity.first_token_position, 128u);
  EXPECT_EQ(v->identity.key, Identity(0).key);
  EXPECT_EQ(v->identity.model_fingerprint, Identity(0).model_fingerprint);
  EXPECT_EQ(std::vector<uint8_t>(v->payload.begin(), v->payload.end()), payload);
  EXPECT_EQ(v->payload.data(), bytes->data() + kUnitHeaderBytes);  // a view, not a copy
  // The checksum is xxh3-64 of header[0,120) then the payload, as the spec says.
  std::vector<uint8_t> covered(120 + payload.size());
  std::copy_n(bytes->begin(), 120, covered.begin());
  std::copy(payload.begin(), payload.end(), covered.begin() + 120);
  EXPECT_EQ(v->checksum, Xxh3_64(covered));
}

TEST(UnitFormat, EncodeRejectsWrongInputs) {
  const UnitPayloadLayout p = UnitPayloadLayout::For(TinyLayout());
  const std::vector<uint8_t> payload = RandomBytes(p.payload_bytes, 2);
  EXPECT_TRUE(EncodeUnit(p, Identity(0), std::span(payload).first(payload.size() - 1))
                  .status()
                  .IsInvalidArgument());
  EXPECT_TRUE(EncodeUnit(p, Identity(3), payload).status().IsInvalidArgument());  // not aligned
  EXPECT_TRUE(EncodeUnit(p, Identity(kTokenPositionLimit), payload).status().IsInvalidArgument());
}

TEST(UnitFormat, EverySingleBitFlipIsCorruption) {
  const UnitPayloadLayout p = UnitPayloadLayout::For(TinyLayout());
  ASSERT_EQ(p.payload_bytes, 156u);
  const std::vector<uint8_t> payload = RandomBytes(p.payload_bytes, 3);
  std::vector<uint8_t> bytes = *EncodeUnit(p, Identity(8), payload);
  ASSERT_TRUE(DecodeUnit(bytes, p).ok());
  size_t flips = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      bytes[i] ^= static_cast<uint8_t>(1u << bit);
      StatusOr<UnitView> v = DecodeUnit(bytes, p);
      EXPECT_TRUE(v.status().IsCorruption()) << "byte " << i << " bit " << bit;
      bytes[i] ^= static_cast<uint8_t>(1u << bit);
      ++flips;
    }
  }
  EXPECT_EQ(flips, 8 * (kUnitHeaderBytes + 156));
  ASSERT_TRUE(DecodeUnit(bytes, p).ok());  // restored
}

TEST(UnitFormat, EveryBitFlipOfARealSizeUnitIsCorruption) {
  const UnitPayloadLayout p = UnitPayloadLayout::For(MiniLayout());
  std::vector<uint8_t> bytes = *EncodeUnit(p, Identity(0), RandomBytes(p.payload_bytes, 4));
  for (size_t i = 0; i < bytes.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      bytes[i] ^= static_cast<uint8_t>(1u << bit);
      ASSERT_TRUE(DecodeUnit(bytes, p).status().IsCorruption()) << "byte " << i << " bit " << bit;
      bytes[i] ^= static_cast<uint8_t>(1u << bit);
    }
  }
}

TEST(UnitFormat, EveryTruncationAndExtensionIsCorruption) {
  const UnitPayloadLayout p = UnitPayloadLayout::For(TinyLayout());
  std::vector<uint8_t> bytes = *EncodeUnit(p, Identity(0), RandomBytes(p.payload_bytes, 5));
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_TRUE(DecodeUnit(std::span(bytes).first(n), p).status().IsCorruption()) << n;
  }
  bytes.push_back(0);
  EXPECT_TRUE(DecodeUnit(bytes, p).status().IsCorruption());
  EXPECT_TRUE(DecodeUnit(std::span<const uint8_t>(), p).status().IsCorruption());
}

TEST(UnitFormat, WrongLayoutFingerprintOrKeyIsCorruption) {
  const KvLayout tiny = TinyLayout();
  const UnitPayloadLayout p = UnitPayloadLayout::For(tiny);
  const std::vector<uint8_t> bytes = *EncodeUnit(p, Identity(0), RandomBytes(p.payload_bytes, 6));
  // Same payload size, other layout id (other source layers).
  StatusOr<KvLayout> other = MakeKvLayout(16, 32, {0, 0, 2, 1}, {2, 3}, 4);
  ASSERT_TRUE(other.ok());
  const UnitPayloadLayout q = UnitPayloadLayout::For(*other);
  ASSERT_EQ(q.payload_bytes, p.payload_bytes);
  ASSERT_NE(q.layout_id, p.layout_id);
  EXPECT_TRUE(DecodeUnit(bytes, q).status().IsCorruption());
  // Another unit size.
  EXPECT_TRUE(DecodeUnit(bytes, UnitPayloadLayout::For(MiniLayout())).status().IsCorruption());
  UnitDecodeOptions opts;
  opts.expected_key = Digest{};
  EXPECT_TRUE(DecodeUnit(bytes, p, opts).status().IsCorruption());
  opts = {};
  opts.expected_model_fingerprint = Digest{};
  EXPECT_TRUE(DecodeUnit(bytes, p, opts).status().IsCorruption());
}

TEST(UnitFormat, HeaderFieldsWithAValidChecksumAreStillChecked) {
  // A writer bug (not a bit flip) that produces a self-consistent checksum must still fail.
  const UnitPayloadLayout p = UnitPayloadLayout::For(TinyLayout());
  const std::vector<uint8_t> payload = RandomBytes(p.payload_bytes, 7);
  const std::vector<uint8_t> good = *EncodeUnit(p, Identity(4), payload);
  auto reseal = [&](std::vector<uint8_t> b) {
    const uint64_t sum = UnitChecksum(std::span(b).first(kUnitChecksumOffset), payload);
    for (int i = 0; i < 8; ++i) b[kUnitChecksumOffset + i] = static_cast<uint8_t>(sum >> (8 * i));
    return b;
  };
  ASSERT_TRUE(DecodeUnit(reseal(good), p).ok());
  struct Case {
    size_t offset;
    uint8_t value;
  };
  // version, header length, token count, flags, reserved, unaligned position, layout id,
  // payload length (each XORed with a nonzero value).
  for (Case c : {Case{4, 2}, Case{6, 64}, Case{88, 8}, Case{92, 1}, Case{110, 1}, Case{80, 1},
                 Case{8, 1}, Case{96, 1}}) {
    std::vector<uint8_t> b = good;
    b[c.offset] ^= c.value;
    EXPECT_TRUE(DecodeUnit(reseal(b), p).status().IsCorruption()) << "offset " << c.offset;
  }
}

TEST(UnitFormat, RandomGarbageIsCorruptionNeverACrash) {
  const UnitPayloadLayout p = UnitPayloadLayout::For(TinyLayout());
  std::mt19937 rng(8);
  const std::vector<uint8_t> good = *EncodeUnit(p, Identity(0), RandomBytes(p.payload_bytes, 9));
  for (int i = 0; i < 20000; ++i) {
    const size_t n = rng() % (good.size() + 64);
    std::vector<uint8_t> b = RandomBytes(n, static_cast<uint32_t>(rng()));
    if (i % 2 == 0 && n >= 8) std::copy(good.begin(), good.begin() + 8, b.begin());  // magic ok
    EXPECT_TRUE(DecodeUnit(b, p).status().IsCorruption());
  }
}

}  // namespace
}  // namespace kvtier
