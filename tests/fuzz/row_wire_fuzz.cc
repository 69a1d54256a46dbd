// libFuzzer target: the Engram row transport's frame codecs (rdma/wire.h), the verbs
// side-channel bodies (rdma/verbs_plan.h) and the table file header (rdma/engram_table.h) on
// arbitrary bytes. Both ends of that protocol read bytes a peer sent: the row server a
// request, the engine's transport a reply; the row server also reads table files from disk.
//
// The first input byte picks the decoder, the rest is its input. Invariants, beyond no crash,
// no out-of-bounds read (ASan) and no undefined behaviour (UBSan):
//   - whatever decodes is canonical: encoding the decoded value gives back the input bytes
//     (docs/format/wire.md: every reserved field is 0, so a frame has one spelling; a decoder
//     that accepted a reserved byte it did not check would let two peers disagree about it);
//   - a decoded request header is within the protocol's ceilings; a decoded table header's
//     rows fit in a uint64 row number.
//
//   cmake --preset fuzz && cmake --build --preset fuzz --target kvtier_row_wire_fuzz
//   build/fuzz/tests/fuzz/kvtier_row_wire_fuzz -max_total_time=60
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "rdma/engram_table.h"
#include "rdma/verbs_plan.h"
#include "rdma/wire.h"
#include "tests/fuzz/fuzz_require.h"

namespace {

using kvtier::fuzz::Require;

using namespace kvtier::rdma;

bool Same(std::span<const uint8_t> a, const uint8_t* b) {
  return a.empty() || std::memcmp(a.data(), b, a.size()) == 0;
}

void RequestHeader(std::span<const uint8_t> in) {
  if (in.size() < wire::kHeaderBytes) return;
  wire::RequestHeader h;
  if (!wire::DecodeRequestHeader(in.data(), &h).ok()) return;
  Require(h.body_bytes <= wire::kRequestBodyBytesMax);
  Require(h.type != wire::FrameType::kRead ||
          (h.op_count >= 1 && h.op_count <= wire::kBatchOpsMax));
  uint8_t out[wire::kHeaderBytes];
  wire::EncodeRequestHeader(h, out);
  Require(Same(in.first(wire::kHeaderBytes), out));
}

void ResponseHeader(std::span<const uint8_t> in) {
  if (in.size() < wire::kHeaderBytes) return;
  wire::ResponseHeader h;
  if (!wire::DecodeResponseHeader(in.data(), &h).ok()) return;
  Require(h.message_bytes <= wire::kMessageBytesMax);
  Require(h.data_bytes <= wire::kResponseDataBytesMax);
  uint8_t out[wire::kHeaderBytes];
  wire::EncodeResponseHeader(h, out);
  Require(Same(in.first(wire::kHeaderBytes), out));
}

void ReadOps(std::span<const uint8_t> in) {
  const uint32_t n = static_cast<uint32_t>(in.size() / wire::kReadOpBytes);
  std::vector<wire::ReadOpWire> ops;
  if (!wire::DecodeReadOps(in, n, &ops).ok()) return;
  Require(ops.size() == n);
  std::vector<uint8_t> out;
  for (const wire::ReadOpWire& op : ops) wire::AppendReadOp(op, &out);
  Require(out.size() == in.size() && Same(in, out.data()));
}

void OpenRequest(std::span<const uint8_t> in) {
  wire::OpenRequest r;
  if (!wire::DecodeOpenRequest(in, &r).ok()) return;
  Require(!r.region_name.empty() && r.region_name.size() <= wire::kNameBytesMax);
  Require(!r.tenant.empty() && r.tenant.size() <= wire::kNameBytesMax);
  const std::vector<uint8_t> out = wire::EncodeOpenRequest(r);
  Require(out.size() == in.size() && Same(in, out.data()));
}

void OpenReply(std::span<const uint8_t> in) {
  wire::OpenReply r;
  if (!wire::DecodeOpenReply(in, &r).ok()) return;
  uint8_t out[wire::kOpenReplyBytes];
  wire::EncodeOpenReply(r, out);
  Require(in.size() == sizeof out && Same(in, out));
}

void VerbsRegionRequest(std::span<const uint8_t> in) {
  uint32_t region_id = 0;
  if (!wire::DecodeVerbsRegionRequest(in, &region_id).ok()) return;
  const std::vector<uint8_t> frame = wire::BuildVerbsRegionRequest(0, region_id);
  Require(frame.size() == wire::kHeaderBytes + in.size() &&
          Same(in, frame.data() + wire::kHeaderBytes));
}

void QpParams(std::span<const uint8_t> in) {
  verbs::QpParams p;
  if (!verbs::DecodeQpParams(in, &p).ok()) return;
  uint8_t out[verbs::kQpParamsBytes];
  Require(verbs::EncodeQpParams(p, out) == in.size() && Same(in, out));
}

// An Engram table file's header (rdma/engram_table.h): the row server reads it from disk.
void TableHeader(std::span<const uint8_t> in) {
  EngramTableHeader h;
  if (!DecodeEngramTableHeader(in, &h).ok()) return;
  Require(h.row_count >= 1 && h.row_begin + h.row_count > h.row_begin);
  Require(h.row_stride_bytes >= EngramRowBytes(h.row_dim));
  uint8_t out[kEngramTableHeaderBytes];
  EncodeEngramTableHeader(h, out);
  Require(Same(in.first(kEngramTableHeaderBytes), out));
}

void RemoteRegion(std::span<const uint8_t> in) {
  verbs::RemoteRegion r;
  if (!verbs::DecodeRemoteRegion(in, &r).ok()) return;
  Require(r.length_bytes != 0);
  uint8_t out[verbs::kRemoteRegionBytes];
  verbs::EncodeRemoteRegion(r, out);
  Require(in.size() == sizeof out && Same(in, out));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::span<const uint8_t> in(data + 1, size - 1);
  switch (data[0] % 9) {
    case 0:
      RequestHeader(in);
      break;
    case 1:
      ResponseHeader(in);
      break;
    case 2:
      ReadOps(in);
      break;
    case 3:
      OpenRequest(in);
      break;
    case 4:
      OpenReply(in);
      break;
    case 5:
      VerbsRegionRequest(in);
      break;
    case 6:
      QpParams(in);
      break;
    case 7:
      RemoteRegion(in);
      break;
    default:
      TableHeader(in);
      break;
  }
  return 0;
}
