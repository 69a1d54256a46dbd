#include "cache_daemon/wire.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>

namespace kvtier::daemon::wire {
namespace {

Key K(uint8_t b) {
  Key k{};
  k.fill(b);
  return k;
}

TEST(WireHeader, RoundTripsAndRejectsBadInput) {
  auto h = EncodeHeader(static_cast<uint8_t>(Opcode::kGet), kFlagShm, 0x0102030405060708ull, 5);
  StatusOr<FrameHeader> d = DecodeHeader(h, 1 << 20);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->opcode, static_cast<uint8_t>(Opcode::kGet));
  EXPECT_EQ(d->flags, kFlagShm);
  EXPECT_EQ(d->request_id, 0x0102030405060708ull);
  EXPECT_EQ(d->body_bytes(), 5u);
  // Byte layout is little-endian and fixed (docs/format/wire.md).
  EXPECT_EQ(h[0], 17);
  EXPECT_EQ(h[4], kWireVersion);
  EXPECT_EQ(h[8], 0x08);

  auto bad_version = h;
  bad_version[4] = 9;
  EXPECT_TRUE(DecodeHeader(bad_version, 1 << 20).status().IsInvalidArgument());
  auto short_len = h;
  short_len[0] = 3;
  EXPECT_TRUE(DecodeHeader(short_len, 1 << 20).status().IsInvalidArgument());
  auto big = EncodeHeader(1, 0, 1, 5000);
  EXPECT_TRUE(DecodeHeader(big, 4096).status().IsInvalidArgument());
  EXPECT_TRUE(DecodeHeader(big, 5016).ok());
}

TEST(WireParser, SplitsFramesFedByteByByte) {
  std::vector<uint8_t> stream;
  for (uint64_t id = 1; id <= 3; ++id) {
    std::vector<uint8_t> body(id * 10, static_cast<uint8_t>(id));
    auto f = BuildFrame(static_cast<uint8_t>(Opcode::kLookup), 0, id, body);
    stream.insert(stream.end(), f.begin(), f.end());
  }
  FrameParser p(1 << 20);
  std::vector<Frame> got;
  for (uint8_t b : stream) {
    p.Append(std::span<const uint8_t>(&b, 1));
    Frame f;
    StatusOr<bool> r = p.Next(&f);
    ASSERT_TRUE(r.ok());
    if (*r) got.push_back(std::move(f));
  }
  ASSERT_EQ(got.size(), 3u);
  for (uint64_t id = 1; id <= 3; ++id) {
    EXPECT_EQ(got[id - 1].header.request_id, id);
    EXPECT_EQ(got[id - 1].body, std::vector<uint8_t>(id * 10, static_cast<uint8_t>(id)));
  }
  EXPECT_FALSE(p.mid_frame());
}

// A large frame's buffer is freed once the frame leaves the parser drained: an idle connection
// that once sent a 64 MiB frame used to keep 64-128 MiB that its accounting (buffered_bytes,
// 0 by then) did not see. Small frames keep their buffer for the next one.
TEST(WireParser, ALargeFramesBufferIsFreedWhenDrained) {
  FrameParser p(64u << 20);
  const std::vector<uint8_t> big_body(16u << 20, 0x5a);
  const auto big = BuildFrame(static_cast<uint8_t>(Opcode::kPut), 0, 1, big_body);
  const std::vector<uint8_t> no_keys = {0, 0};
  const auto small = BuildFrame(static_cast<uint8_t>(Opcode::kLookup), 0, 2, no_keys);
  Frame f;
  for (size_t at = 0; at < big.size(); at += 256u << 10) {  // in read-sized chunks
    const size_t n = std::min<size_t>(256u << 10, big.size() - at);
    p.Append(std::span<const uint8_t>(big.data() + at, n));
    if (at + n < big.size()) {
      ASSERT_FALSE(*p.Next(&f));
      EXPECT_GE(p.capacity_bytes(), p.buffered_bytes());
    }
  }
  EXPECT_GE(p.capacity_bytes(), big.size());
  ASSERT_TRUE(*p.Next(&f));
  EXPECT_EQ(f.body, big_body);
  EXPECT_EQ(p.buffered_bytes(), 0u);
  EXPECT_LE(p.capacity_bytes(), FrameParser::kKeepBufferBytes);
  // A large frame followed by part of the next keeps its buffer (the next one is arriving).
  p.Append(big);
  p.Append(std::span<const uint8_t>(small.data(), 5));
  ASSERT_TRUE(*p.Next(&f));
  EXPECT_EQ(p.buffered_bytes(), 5u);
  p.Append(std::span<const uint8_t>(small.data() + 5, small.size() - 5));
  ASSERT_TRUE(*p.Next(&f));
  EXPECT_EQ(f.header.request_id, 2u);
  EXPECT_LE(p.capacity_bytes(), FrameParser::kKeepBufferBytes);
  // Small frames reuse one buffer.
  p.Append(small);
  ASSERT_TRUE(*p.Next(&f));
  const size_t kept = p.capacity_bytes();
  EXPECT_GT(kept, 0u);
  for (int i = 0; i < 100; ++i) {
    p.Append(small);
    ASSERT_TRUE(*p.Next(&f));
    EXPECT_EQ(p.capacity_bytes(), kept);
  }
}

TEST(WireParser, OversizedFramePoisonsTheStream) {
  FrameParser p(1024);
  auto h = EncodeHeader(1, 0, 7, 4096);
  p.Append(h);
  Frame f;
  EXPECT_TRUE(p.Next(&f).status().IsInvalidArgument());
  // Stays failed even if later bytes look fine.
  auto ok = BuildFrame(1, 0, 8, {});
  p.Append(ok);
  EXPECT_FALSE(p.Next(&f).ok());
}

TEST(WireBodies, PutRoundTripInlineAndShm) {
  std::vector<uint8_t> v1(100, 1), v2(3, 2);
  PutRequest req;
  req.kind = 0;
  req.highest_tier = 2;
  req.ttl_ms = 1234;
  req.recompute_tokens = 64;
  req.units.push_back({K(1), K(0), v1, 0, 0});
  req.units.push_back({K(2), K(1), v2, 0, 0});
  std::vector<uint8_t> body = EncodePut(req, false);
  StatusOr<PutRequest> d = DecodePut(body, false);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  ASSERT_EQ(d->units.size(), 2u);
  EXPECT_EQ(d->ttl_ms, 1234u);
  EXPECT_EQ(d->highest_tier, 2);
  EXPECT_EQ(d->units[1].parent, K(1));
  EXPECT_TRUE(std::equal(d->units[0].value.begin(), d->units[0].value.end(), v1.begin()));
  // Every strict prefix of the body is rejected, never read past.
  for (size_t n = 0; n < body.size(); ++n) {
    EXPECT_FALSE(DecodePut(std::span<const uint8_t>(body.data(), n), false).ok()) << n;
  }
  req.units[0].value_offset = 4096;
  req.units[0].value_bytes = 100;
  std::vector<uint8_t> sbody = EncodePut(req, true);
  StatusOr<PutRequest> ds = DecodePut(sbody, true);
  ASSERT_TRUE(ds.ok());
  EXPECT_EQ(ds->units[0].value_offset, 4096u);
  EXPECT_EQ(ds->units[0].value_bytes, 100u);
}

TEST(WireBodies, RejectsOutOfRangeFields) {
  PutRequest req;
  req.highest_tier = 7;
  EXPECT_TRUE(DecodePut(EncodePut(req, false), false).status().IsInvalidArgument());
  // A key count beyond the batch limit is refused before any allocation.
  Writer w;
  w.U16(kMaxBatchKeys + 1);
  EXPECT_FALSE(DecodeKeys(w.Take()).ok());
  DeleteRequest del;
  del.scope = 5;
  EXPECT_FALSE(DecodeDelete(EncodeDelete(del)).ok());
  // Trailing garbage is an error too.
  std::vector<uint8_t> keys = EncodeKeys(std::vector<Key>{K(3)});
  keys.push_back(0);
  EXPECT_FALSE(DecodeKeys(keys).ok());
}

TEST(WireBodies, StatusAndReplies) {
  Writer w;
  EncodeStatus(Status::Rejected("quota"), &w);
  LookupReply lr;
  lr.hit_count = 2;
  lr.tiers = {1, 2};
  lr.first_miss = 2;
  EncodeLookupReply(lr, &w);
  std::vector<uint8_t> b = w.Take();
  Reader r(b);
  Status st;
  ASSERT_TRUE(DecodeStatus(&r, &st).ok());
  EXPECT_TRUE(st.IsRejected());
  EXPECT_EQ(st.message(), "quota");
  StatusOr<LookupReply> d = DecodeLookupReply(&r);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->hit_count, 2u);
  EXPECT_EQ(d->tiers, (std::vector<uint8_t>{1, 2}));
  EXPECT_EQ(d->first_miss, 2);
  // Unknown status code byte.
  std::vector<uint8_t> bad = {200, 0, 0};
  Reader rb(bad);
  EXPECT_TRUE(DecodeStatus(&rb, &st).IsCorruption());
}

// kFlagTurn: the turn id in front of a LOOKUP/GET/PUT body; bad uses are InvalidArgument.
TEST(WireTurns, SplitTurnTakesTheIdAndRejectsBadUse) {
  Writer w;
  w.U64(0xfedcba9876543210ull);
  std::vector<uint8_t> keys = EncodeKeys(std::vector<Key>{K(3)});
  w.Bytes(keys);
  std::vector<uint8_t> body = w.Take();
  std::span<const uint8_t> rest;
  for (Opcode op : {Opcode::kLookup, Opcode::kGet, Opcode::kPut}) {
    StatusOr<uint64_t> turn = SplitTurn(static_cast<uint8_t>(op), body, &rest);
    ASSERT_TRUE(turn.ok()) << turn.status().ToString();
    EXPECT_EQ(*turn, 0xfedcba9876543210ull);
    EXPECT_TRUE(std::equal(rest.begin(), rest.end(), keys.begin(), keys.end()));
  }
  EXPECT_TRUE(
      SplitTurn(static_cast<uint8_t>(Opcode::kDelete), body, &rest).status().IsInvalidArgument());
  EXPECT_TRUE(
      SplitTurn(static_cast<uint8_t>(Opcode::kPin), body, &rest).status().IsInvalidArgument());
  const std::vector<uint8_t> short_body(7, 1);
  EXPECT_TRUE(SplitTurn(static_cast<uint8_t>(Opcode::kGet), short_body, &rest)
                  .status()
                  .IsInvalidArgument());
  const std::vector<uint8_t> zero(8 + keys.size(), 0);
  EXPECT_TRUE(
      SplitTurn(static_cast<uint8_t>(Opcode::kGet), zero, &rest).status().IsInvalidArgument());
}

// HELLO's features field round-trips and reads as 0 from a daemon that predates it.
TEST(WireTurns, HelloFeaturesOptional) {
  HelloResponse h;
  h.tenant_name = "t";
  h.features = kFeatureTurns;
  Writer w;
  EncodeHelloResponse(h, &w);
  std::vector<uint8_t> b = w.Take();
  Reader r(b);
  StatusOr<HelloResponse> d = DecodeHelloResponse(&r);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->features, kFeatureTurns);
  ASSERT_GE(b.size(), 4u);
  b.erase(b.end() - 4, b.end());  // an older daemon's response (not resize: GCC 12 at -O1 with
                                  // ASan warns of a huge memset on its growing path)
  Reader old(b);
  d = DecodeHelloResponse(&old);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->tenant_name, "t");
  EXPECT_EQ(d->features, 0u);
}

TEST(WireBodies, RandomBytesNeverCrashDecoders) {
  std::mt19937 rng(7);
  int keys_accepted = 0;
  for (int i = 0; i < 20000; ++i) {
    std::vector<uint8_t> b(rng() % 200);
    for (auto& x : b) x = static_cast<uint8_t>(rng());
    (void)DecodePut(b, i % 2 == 0);
    (void)DecodeGet(b, i % 2 == 0);
    (void)DecodeHello(b);
    (void)DecodePin(b);
    Reader r(b);
    (void)DecodeGetResponse(&r, i % 2 == 0);
    // A key list is accepted only when the body is exactly its u16 count plus the keys: no
    // short body, no trailing bytes (docs/format/wire.md).
    auto keys = DecodeKeys(b);
    if (keys.ok()) {
      ++keys_accepted;
      EXPECT_EQ(b.size(), 2 + keys->size() * sizeof(Key)) << "iteration " << i;
    }
  }
  // Random bodies almost never have that exact length; a decoder that accepted them would
  // ignore the framing of its own body.
  EXPECT_LT(keys_accepted, 200);
}

}  // namespace
}  // namespace kvtier::daemon::wire
