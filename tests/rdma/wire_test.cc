#include "rdma/wire.h"

#include <gtest/gtest.h>

#include <array>
#include <cstring>

namespace kvtier::rdma::wire {
namespace {

TEST(WireTest, ReadRequestRoundTrip) {
  std::vector<ReadOpWire> ops = {{7, 33, 0}, {9, 264, 1ull << 33}};
  std::vector<uint8_t> frame = BuildReadRequest(42, ops);
  ASSERT_EQ(frame.size(), kHeaderBytes + 2 * kReadOpBytes);
  // Byte-level: magic "KVRT", version 1, type 2, little-endian request id.
  EXPECT_EQ(std::memcmp(frame.data(), "KVRT", 4), 0);
  EXPECT_EQ(frame[4], 1);
  EXPECT_EQ(frame[6], 2);
  EXPECT_EQ(frame[8], 42);
  RequestHeader h;
  ASSERT_TRUE(DecodeRequestHeader(frame.data(), &h).ok());
  EXPECT_EQ(h.type, FrameType::kRead);
  EXPECT_EQ(h.request_id, 42u);
  EXPECT_EQ(h.op_count, 2u);
  std::vector<ReadOpWire> decoded;
  ASSERT_TRUE(DecodeReadOps(std::span(frame).subspan(kHeaderBytes), h.op_count, &decoded).ok());
  ASSERT_EQ(decoded.size(), 2u);
  EXPECT_EQ(decoded[1].region_id, 9u);
  EXPECT_EQ(decoded[1].length_bytes, 264u);
  EXPECT_EQ(decoded[1].offset_bytes, 1ull << 33);
}

TEST(WireTest, OpenRequestRoundTrip) {
  OpenRequest req;
  req.region_name = "engram.l1.s0";
  req.tenant = "tenant-a";
  for (size_t i = 0; i < req.token.size(); ++i) req.token[i] = static_cast<uint8_t>(i * 7);
  std::vector<uint8_t> frame = BuildOpenRequest(5, req);
  RequestHeader h;
  ASSERT_TRUE(DecodeRequestHeader(frame.data(), &h).ok());
  EXPECT_EQ(h.type, FrameType::kOpen);
  OpenRequest back;
  ASSERT_TRUE(DecodeOpenRequest(std::span(frame).subspan(kHeaderBytes), &back).ok());
  EXPECT_EQ(back.region_name, req.region_name);
  EXPECT_EQ(back.tenant, req.tenant);
  EXPECT_EQ(back.token, req.token);
}

TEST(WireTest, MalformedRequestHeadersAreCorruption) {
  std::vector<ReadOpWire> ops = {{1, 8, 0}};
  const std::vector<uint8_t> good = BuildReadRequest(1, ops);
  RequestHeader h;
  auto mutate = [&](size_t at, uint8_t value) {
    std::vector<uint8_t> f = good;
    f[at] = value;
    return DecodeRequestHeader(f.data(), &h);
  };
  EXPECT_TRUE(mutate(0, 'X').IsCorruption());  // magic
  EXPECT_TRUE(mutate(4, 2).IsCorruption());    // version
  EXPECT_TRUE(mutate(6, 9).IsCorruption());    // type
  EXPECT_TRUE(mutate(16, 0).IsCorruption());   // op_count 0
  EXPECT_TRUE(mutate(20, 25).IsCorruption());  // body != 24 * ops
  EXPECT_TRUE(mutate(24, 1).IsCorruption());   // reserved
  std::vector<uint8_t> huge = good;
  huge[17] = 0x20;  // op_count 8193 > kBatchOpsMax
  EXPECT_TRUE(DecodeRequestHeader(huge.data(), &h).IsCorruption());
}

TEST(WireTest, ResponseHeaderLimits) {
  ResponseHeader r;
  r.type = FrameType::kRead;
  r.request_id = 3;
  r.code = StatusCode::kPermissionDenied;
  r.message_bytes = 10;
  uint8_t buf[kHeaderBytes];
  EncodeResponseHeader(r, buf);
  ResponseHeader back;
  ASSERT_TRUE(DecodeResponseHeader(buf, &back).ok());
  EXPECT_EQ(back.code, StatusCode::kPermissionDenied);
  r.data_bytes = 1;  // an error reply never carries data
  EncodeResponseHeader(r, buf);
  EXPECT_TRUE(DecodeResponseHeader(buf, &back).IsCorruption());
  r.code = StatusCode::kOk;
  r.data_bytes = kResponseDataBytesMax + 1;
  EncodeResponseHeader(r, buf);
  EXPECT_TRUE(DecodeResponseHeader(buf, &back).IsCorruption());
  buf[16] = 200;  // unknown status code
  EXPECT_TRUE(DecodeResponseHeader(buf, &back).IsCorruption());
}

// A reply has one spelling: each reserved byte (docs/format/wire.md: 0) set alone makes it
// Corruption, as the request header's do (found by kvtier_row_wire_fuzz: a client accepted
// them).
TEST(WireTest, RepliesWithReservedBytesSetAreCorruption) {
  ResponseHeader r;
  r.type = FrameType::kOpen;
  r.request_id = 9;
  r.data_bytes = kOpenReplyBytes;
  uint8_t good[kHeaderBytes];
  EncodeResponseHeader(r, good);
  ResponseHeader back;
  ASSERT_TRUE(DecodeResponseHeader(good, &back).ok());
  for (size_t at : {17, 20, 21, 22, 23}) {
    uint8_t bad[kHeaderBytes];
    std::memcpy(bad, good, sizeof bad);
    bad[at] = 1;
    EXPECT_TRUE(DecodeResponseHeader(bad, &back).IsCorruption()) << "byte " << at;
  }
  OpenReply o{3, 64, 4096, 0, 64, 16};
  uint8_t ob[kOpenReplyBytes];
  EncodeOpenReply(o, ob);
  OpenReply ob_back;
  ASSERT_TRUE(DecodeOpenReply(ob, &ob_back).ok());
  EXPECT_EQ(ob_back.row_dim, 16u);
  for (size_t at = 36; at < kOpenReplyBytes; ++at) {
    uint8_t bad[kOpenReplyBytes];
    std::memcpy(bad, ob, sizeof bad);
    bad[at] = 0x80;
    EXPECT_TRUE(DecodeOpenReply(bad, &ob_back).IsCorruption()) << "byte " << at;
  }
}

TEST(WireTest, OpenBodyValidation) {
  OpenRequest out;
  std::vector<uint8_t> body(kOpenFixedBytes, 0);
  EXPECT_TRUE(DecodeOpenRequest(body, &out).IsCorruption());  // empty names
  body[0] = 3;
  body[2] = 2;
  EXPECT_TRUE(DecodeOpenRequest(body, &out).IsCorruption());  // names missing
  body.insert(body.end(), {'a', 'b', 'c', 't', 'u'});
  EXPECT_TRUE(DecodeOpenRequest(body, &out).ok());
  EXPECT_EQ(out.region_name, "abc");
  EXPECT_EQ(out.tenant, "tu");
}

TEST(WireTest, VerbsConnectRequestRoundTripAndHostileHeaders) {
  std::array<uint8_t, kQpParamsBytes> params{};
  for (size_t i = 0; i < params.size(); ++i) params[i] = static_cast<uint8_t>(i + 1);
  const std::vector<uint8_t> frame = BuildVerbsConnectRequest(77, params);
  ASSERT_EQ(frame.size(), kHeaderBytes + kQpParamsBytes);
  EXPECT_EQ(frame[6], 3);  // type 3 = VERBS_CONNECT
  RequestHeader h;
  ASSERT_TRUE(DecodeRequestHeader(frame.data(), &h).ok());
  EXPECT_EQ(h.type, FrameType::kVerbsConnect);
  EXPECT_EQ(h.request_id, 77u);
  EXPECT_EQ(h.body_bytes, kQpParamsBytes);
  EXPECT_EQ(std::memcmp(frame.data() + kHeaderBytes, params.data(), params.size()), 0);
  auto mutate = [&](size_t at, uint8_t value) {
    std::vector<uint8_t> f = frame;
    f[at] = value;
    return DecodeRequestHeader(f.data(), &h);
  };
  EXPECT_TRUE(mutate(20, 39).IsCorruption());  // body_bytes neither 40 (v2) nor 28 (v1)
  EXPECT_TRUE(mutate(20, 41).IsCorruption());
  EXPECT_TRUE(mutate(20, 27).IsCorruption());
  EXPECT_TRUE(mutate(20, 0).IsCorruption());
  EXPECT_TRUE(mutate(20, 28).ok());           // a version-1 client's body is still accepted
  EXPECT_TRUE(mutate(23, 1).IsCorruption());  // body_bytes huge
  EXPECT_TRUE(mutate(16, 1).IsCorruption());  // op_count must be 0
  EXPECT_TRUE(mutate(6, 5).IsCorruption());   // type 5 is unknown
  EXPECT_TRUE(mutate(6, 0).IsCorruption());   // type 0 is unknown
}

TEST(WireTest, VerbsRegionRequestRoundTripAndHostileBodies) {
  const std::vector<uint8_t> frame = BuildVerbsRegionRequest(9, 0xabcdef01);
  ASSERT_EQ(frame.size(), kHeaderBytes + kVerbsRegionRequestBytes);
  EXPECT_EQ(frame[6], 4);  // type 4 = VERBS_REGION
  RequestHeader h;
  ASSERT_TRUE(DecodeRequestHeader(frame.data(), &h).ok());
  EXPECT_EQ(h.type, FrameType::kVerbsRegion);
  EXPECT_EQ(h.body_bytes, kVerbsRegionRequestBytes);
  std::span<const uint8_t> body = std::span(frame).subspan(kHeaderBytes);
  uint32_t region_id = 0;
  ASSERT_TRUE(DecodeVerbsRegionRequest(body, &region_id).ok());
  EXPECT_EQ(region_id, 0xabcdef01u);
  std::vector<uint8_t> bad(body.begin(), body.end());
  bad[5] = 1;  // reserved
  EXPECT_TRUE(DecodeVerbsRegionRequest(bad, &region_id).IsCorruption());
  EXPECT_TRUE(DecodeVerbsRegionRequest(body.subspan(0, 4), &region_id).IsCorruption());
  std::vector<uint8_t> longer(body.begin(), body.end());
  longer.push_back(0);
  EXPECT_TRUE(DecodeVerbsRegionRequest(longer, &region_id).IsCorruption());
  std::vector<uint8_t> f = frame;
  f[20] = 16;  // body_bytes != 8
  EXPECT_TRUE(DecodeRequestHeader(f.data(), &h).IsCorruption());
}

TEST(WireTest, VerbsRepliesHaveFixedDataLengths) {
  EXPECT_EQ(FixedReplyDataBytes(FrameType::kOpen), kOpenReplyBytes);
  EXPECT_EQ(FixedReplyDataBytes(FrameType::kVerbsConnect), kQpParamsBytes);
  EXPECT_EQ(FixedReplyDataBytes(FrameType::kVerbsRegion), kRemoteRegionBytes);
  EXPECT_EQ(FixedReplyDataBytes(FrameType::kRead), 0u);
  ResponseHeader r;
  r.type = FrameType::kVerbsConnect;
  r.request_id = 4;
  r.code = StatusCode::kUnavailable;
  r.message_bytes = 29;
  uint8_t buf[kHeaderBytes];
  EncodeResponseHeader(r, buf);
  ResponseHeader back;
  ASSERT_TRUE(DecodeResponseHeader(buf, &back).ok());
  EXPECT_EQ(back.type, FrameType::kVerbsConnect);
  EXPECT_EQ(back.code, StatusCode::kUnavailable);
  buf[6] = 6;  // unknown response type
  EXPECT_TRUE(DecodeResponseHeader(buf, &back).IsCorruption());
}

}  // namespace
}  // namespace kvtier::rdma::wire
