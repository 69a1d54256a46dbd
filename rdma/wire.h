// The Engram row transport's TCP frame format (docs/format/wire.md, section "Engram row
// transport (TCP)"): pure encode/decode helpers shared by TcpTransport and RowServer.
//
// All integers are little-endian. A request is a 32-byte RequestHeader followed by
// `body_bytes` of body; a response is a 32-byte ResponseHeader, `message_bytes` of UTF-8
// message, then `data_bytes` of data. Decoders never trust their input: every field is
// checked against the named limits below and a malformed frame returns Corruption (or
// InvalidArgument for a well-formed frame that exceeds a limit), never asserts.
//
// Thread safety: all functions are pure.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace kvtier::rdma::wire {

inline constexpr uint32_t kRequestMagic = 0x5452564B;   // bytes "KVRT"
inline constexpr uint32_t kResponseMagic = 0x5352564B;  // bytes "KVRS"
inline constexpr uint16_t kVersion = 1;
inline constexpr size_t kHeaderBytes = 32;
inline constexpr size_t kReadOpBytes = 24;
inline constexpr size_t kGrantTokenBytes = 16;
inline constexpr size_t kOpenFixedBytes = 8 + kGrantTokenBytes;
inline constexpr size_t kOpenReplyBytes = 40;
// Verbs side-channel bodies (the layouts are verbs::QpParams / verbs::RemoteRegion, whose
// codecs live in rdma/verbs_plan.h; only the sizes are fixed here).
// VERBS_CONNECT body: version 2 (40 bytes) adds what each end can do (path MTU, read
// depth, link layer) to version 1 (28 bytes); servers accept both and answer in kind.
inline constexpr size_t kQpParamsV1Bytes = 28;
inline constexpr size_t kQpParamsBytes = 40;
inline constexpr size_t kVerbsRegionRequestBytes = 8;  // u32 region_id, u32 reserved
inline constexpr size_t kRemoteRegionBytes = 24;

// Hard protocol limits (a peer exceeding them is disconnected). Servers and clients may
// configure smaller limits; these are the ceilings a decoder accepts at all.
inline constexpr uint32_t kBatchOpsMax = 4096;
inline constexpr uint32_t kReadBytesMax = 1u << 20;             // one op: 1 MiB
inline constexpr uint64_t kResponseDataBytesMax = 64ull << 20;  // one response: 64 MiB
inline constexpr uint32_t kNameBytesMax = 256;                  // region name, tenant id
inline constexpr uint32_t kMessageBytesMax = 1024;              // error message in a response
inline constexpr uint32_t kRequestBodyBytesMax = kBatchOpsMax * kReadOpBytes;

enum class FrameType : uint16_t {
  kOpen = 1,  // attach a grant to this connection; reply: OpenReply
  kRead = 2,  // a batch of one-sided reads; reply: the bytes of every op, in order
  // Verbs side channel (docs/format/wire.md). Servers without an RDMA device answer both
  // with Unavailable and keep the connection.
  kVerbsConnect = 3,  // body: the client's QpParams; reply data: the server's QpParams
  kVerbsRegion = 4,   // body: a region_id opened on this connection; reply: RemoteRegion
};

using GrantToken = std::array<uint8_t, kGrantTokenBytes>;

struct RequestHeader {
  FrameType type = FrameType::kRead;
  uint64_t request_id = 0;
  uint32_t op_count = 0;    // kRead: ops in the batch; kOpen: 0
  uint32_t body_bytes = 0;  // kRead: op_count * kReadOpBytes
};

struct ReadOpWire {
  uint32_t region_id = 0;  // the server's id, from an OpenReply on this connection
  uint32_t length_bytes = 0;
  uint64_t offset_bytes = 0;  // from the start of the region
};

struct OpenRequest {
  GrantToken token{};
  std::string region_name;
  std::string tenant;
};

struct OpenReply {
  uint32_t region_id = 0;
  uint32_t row_stride_bytes = 0;
  uint64_t size_bytes = 0;
  uint64_t row_begin = 0;
  uint64_t row_count = 0;
  uint32_t row_dim = 0;
};

struct ResponseHeader {
  FrameType type = FrameType::kRead;
  uint64_t request_id = 0;
  StatusCode code = StatusCode::kOk;
  uint16_t message_bytes = 0;
  uint64_t data_bytes = 0;
};

// Header codecs. Decode* return Corruption on a bad magic, version or type, a non-zero
// reserved field, or a length field above the ceilings above.
void EncodeRequestHeader(const RequestHeader& h, uint8_t out[kHeaderBytes]);
Status DecodeRequestHeader(const uint8_t in[kHeaderBytes], RequestHeader* out);
void EncodeResponseHeader(const ResponseHeader& h, uint8_t out[kHeaderBytes]);
Status DecodeResponseHeader(const uint8_t in[kHeaderBytes], ResponseHeader* out);

// Body codecs.
void AppendReadOp(const ReadOpWire& op, std::vector<uint8_t>* out);
// Decodes `body` (exactly op_count * kReadOpBytes) into `out` (cleared first).
Status DecodeReadOps(std::span<const uint8_t> body, uint32_t op_count,
                     std::vector<ReadOpWire>* out);
std::vector<uint8_t> EncodeOpenRequest(const OpenRequest& req);
Status DecodeOpenRequest(std::span<const uint8_t> body, OpenRequest* out);
void EncodeOpenReply(const OpenReply& reply, uint8_t out[kOpenReplyBytes]);
// Corruption on any size but kOpenReplyBytes or a non-zero reserved field.
Status DecodeOpenReply(std::span<const uint8_t> in, OpenReply* out);

// A whole request frame (header + body), as a client sends it.
std::vector<uint8_t> BuildReadRequest(uint64_t request_id, std::span<const ReadOpWire> ops);
std::vector<uint8_t> BuildOpenRequest(uint64_t request_id, const OpenRequest& req);
// kVerbsConnect: `qp_params` is verbs::EncodeQpParams' output (kQpParamsBytes, or
// kQpParamsV1Bytes for a version-1 body).
std::vector<uint8_t> BuildVerbsConnectRequest(uint64_t request_id,
                                              std::span<const uint8_t> qp_params);
// kVerbsRegion for the server's `region_id` (from an OpenReply on the same connection).
std::vector<uint8_t> BuildVerbsRegionRequest(uint64_t request_id, uint32_t region_id);
// Decodes a kVerbsRegion body (exactly kVerbsRegionRequestBytes, reserved bytes zero).
Status DecodeVerbsRegionRequest(std::span<const uint8_t> body, uint32_t* region_id);
// The data_bytes an OK reply of `type` must carry, or 0 for kRead (variable). For
// kVerbsConnect: a version-2 reply (this client sends version 2).
uint64_t FixedReplyDataBytes(FrameType type);

}  // namespace kvtier::rdma::wire
