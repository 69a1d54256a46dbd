#include "rdma/wire.h"

#include <cstring>

#include "common/endian.h"

namespace kvtier::rdma::wire {
namespace {

using le::Get16;
using le::Get32;
using le::Get64;
using le::Put16;
using le::Put32;
using le::Put64;

bool ValidType(uint16_t t) {
  return t >= static_cast<uint16_t>(FrameType::kOpen) &&
         t <= static_cast<uint16_t>(FrameType::kVerbsRegion);
}

}  // namespace

void EncodeRequestHeader(const RequestHeader& h, uint8_t out[kHeaderBytes]) {
  std::memset(out, 0, kHeaderBytes);
  Put32(out + 0, kRequestMagic);
  Put16(out + 4, kVersion);
  Put16(out + 6, static_cast<uint16_t>(h.type));
  Put64(out + 8, h.request_id);
  Put32(out + 16, h.op_count);
  Put32(out + 20, h.body_bytes);
}

Status DecodeRequestHeader(const uint8_t in[kHeaderBytes], RequestHeader* out) {
  if (Get32(in + 0) != kRequestMagic) return Status::Corruption("bad request magic");
  if (Get16(in + 4) != kVersion) return Status::Corruption("unsupported request version");
  const uint16_t type = Get16(in + 6);
  if (!ValidType(type)) return Status::Corruption("unknown request type");
  if (Get64(in + 24) != 0) return Status::Corruption("reserved request bytes not zero");
  RequestHeader h;
  h.type = static_cast<FrameType>(type);
  h.request_id = Get64(in + 8);
  h.op_count = Get32(in + 16);
  h.body_bytes = Get32(in + 20);
  if (h.type == FrameType::kRead) {
    if (h.op_count == 0 || h.op_count > kBatchOpsMax) {
      return Status::Corruption("read op_count out of range");
    }
    if (static_cast<uint64_t>(h.body_bytes) != uint64_t{h.op_count} * kReadOpBytes) {
      return Status::Corruption("read body_bytes != op_count * 24");
    }
  } else if (h.type == FrameType::kOpen) {
    if (h.op_count != 0) return Status::Corruption("open op_count not zero");
    if (h.body_bytes < kOpenFixedBytes || h.body_bytes > kOpenFixedBytes + 2 * kNameBytesMax) {
      return Status::Corruption("open body_bytes out of range");
    }
  } else if (h.type == FrameType::kVerbsConnect) {
    if (h.op_count != 0) return Status::Corruption("verbs op_count not zero");
    if (h.body_bytes != kQpParamsBytes && h.body_bytes != kQpParamsV1Bytes) {
      return Status::Corruption("verbs connect body_bytes is neither 40 (v2) nor 28 (v1)");
    }
  } else {
    if (h.op_count != 0) return Status::Corruption("verbs op_count not zero");
    if (h.body_bytes != kVerbsRegionRequestBytes) {
      return Status::Corruption("verbs body_bytes mismatch");
    }
  }
  *out = h;
  return Status::Ok();
}

void EncodeResponseHeader(const ResponseHeader& h, uint8_t out[kHeaderBytes]) {
  std::memset(out, 0, kHeaderBytes);
  Put32(out + 0, kResponseMagic);
  Put16(out + 4, kVersion);
  Put16(out + 6, static_cast<uint16_t>(h.type));
  Put64(out + 8, h.request_id);
  out[16] = static_cast<uint8_t>(h.code);
  Put16(out + 18, h.message_bytes);
  Put64(out + 24, h.data_bytes);
}

Status DecodeResponseHeader(const uint8_t in[kHeaderBytes], ResponseHeader* out) {
  if (Get32(in + 0) != kResponseMagic) return Status::Corruption("bad response magic");
  if (Get16(in + 4) != kVersion) return Status::Corruption("unsupported response version");
  const uint16_t type = Get16(in + 6);
  if (!ValidType(type)) return Status::Corruption("unknown response type");
  ResponseHeader h;
  h.type = static_cast<FrameType>(type);
  h.request_id = Get64(in + 8);
  if (in[16] > static_cast<uint8_t>(StatusCode::kInternal)) {
    return Status::Corruption("unknown status code");
  }
  if (in[17] != 0 || Get32(in + 20) != 0) {
    return Status::Corruption("reserved response bytes not zero");
  }
  h.code = static_cast<StatusCode>(in[16]);
  h.message_bytes = Get16(in + 18);
  h.data_bytes = Get64(in + 24);
  if (h.message_bytes > kMessageBytesMax) return Status::Corruption("message too long");
  if (h.data_bytes > kResponseDataBytesMax) return Status::Corruption("data_bytes too large");
  if (h.code != StatusCode::kOk && h.data_bytes != 0) {
    return Status::Corruption("error response carries data");
  }
  *out = h;
  return Status::Ok();
}

void AppendReadOp(const ReadOpWire& op, std::vector<uint8_t>* out) {
  uint8_t b[kReadOpBytes] = {};
  Put32(b + 0, op.region_id);
  Put32(b + 4, op.length_bytes);
  Put64(b + 8, op.offset_bytes);
  out->insert(out->end(), b, b + kReadOpBytes);
}

Status DecodeReadOps(std::span<const uint8_t> body, uint32_t op_count,
                     std::vector<ReadOpWire>* out) {
  out->clear();
  if (body.size() != uint64_t{op_count} * kReadOpBytes) {
    return Status::Corruption("read body size mismatch");
  }
  out->reserve(op_count);
  for (uint32_t i = 0; i < op_count; ++i) {
    const uint8_t* p = body.data() + size_t{i} * kReadOpBytes;
    if (Get64(p + 16) != 0) return Status::Corruption("reserved op bytes not zero");
    out->push_back(ReadOpWire{Get32(p + 0), Get32(p + 4), Get64(p + 8)});
  }
  return Status::Ok();
}

std::vector<uint8_t> EncodeOpenRequest(const OpenRequest& req) {
  std::vector<uint8_t> body(kOpenFixedBytes);
  Put16(body.data() + 0, static_cast<uint16_t>(req.region_name.size()));
  Put16(body.data() + 2, static_cast<uint16_t>(req.tenant.size()));
  std::memcpy(body.data() + 8, req.token.data(), kGrantTokenBytes);
  body.insert(body.end(), req.region_name.begin(), req.region_name.end());
  body.insert(body.end(), req.tenant.begin(), req.tenant.end());
  return body;
}

Status DecodeOpenRequest(std::span<const uint8_t> body, OpenRequest* out) {
  if (body.size() < kOpenFixedBytes) return Status::Corruption("open body too short");
  const uint16_t name_len = Get16(body.data());
  const uint16_t tenant_len = Get16(body.data() + 2);
  if (Get32(body.data() + 4) != 0) return Status::Corruption("reserved open bytes not zero");
  if (name_len == 0 || name_len > kNameBytesMax || tenant_len == 0 || tenant_len > kNameBytesMax) {
    return Status::Corruption("open name/tenant length out of range");
  }
  if (body.size() != kOpenFixedBytes + name_len + tenant_len) {
    return Status::Corruption("open body size mismatch");
  }
  OpenRequest r;
  std::memcpy(r.token.data(), body.data() + 8, kGrantTokenBytes);
  const char* names = reinterpret_cast<const char*>(body.data() + kOpenFixedBytes);
  r.region_name.assign(names, name_len);
  r.tenant.assign(names + name_len, tenant_len);
  *out = std::move(r);
  return Status::Ok();
}

void EncodeOpenReply(const OpenReply& reply, uint8_t out[kOpenReplyBytes]) {
  std::memset(out, 0, kOpenReplyBytes);
  Put32(out + 0, reply.region_id);
  Put32(out + 4, reply.row_stride_bytes);
  Put64(out + 8, reply.size_bytes);
  Put64(out + 16, reply.row_begin);
  Put64(out + 24, reply.row_count);
  Put32(out + 32, reply.row_dim);
}

Status DecodeOpenReply(std::span<const uint8_t> in, OpenReply* out) {
  if (in.size() != kOpenReplyBytes) return Status::Corruption("open reply size mismatch");
  OpenReply r;
  r.region_id = Get32(in.data() + 0);
  r.row_stride_bytes = Get32(in.data() + 4);
  r.size_bytes = Get64(in.data() + 8);
  r.row_begin = Get64(in.data() + 16);
  r.row_count = Get64(in.data() + 24);
  r.row_dim = Get32(in.data() + 32);
  if (Get32(in.data() + 36) != 0) return Status::Corruption("reserved open reply bytes not zero");
  *out = r;
  return Status::Ok();
}

std::vector<uint8_t> BuildReadRequest(uint64_t request_id, std::span<const ReadOpWire> ops) {
  std::vector<uint8_t> frame(kHeaderBytes);
  frame.reserve(kHeaderBytes + ops.size() * kReadOpBytes);
  RequestHeader h{FrameType::kRead, request_id, static_cast<uint32_t>(ops.size()),
                  static_cast<uint32_t>(ops.size() * kReadOpBytes)};
  EncodeRequestHeader(h, frame.data());
  for (const ReadOpWire& op : ops) AppendReadOp(op, &frame);
  return frame;
}

std::vector<uint8_t> BuildOpenRequest(uint64_t request_id, const OpenRequest& req) {
  std::vector<uint8_t> body = EncodeOpenRequest(req);
  std::vector<uint8_t> frame(kHeaderBytes);
  RequestHeader h{FrameType::kOpen, request_id, 0, static_cast<uint32_t>(body.size())};
  EncodeRequestHeader(h, frame.data());
  frame.insert(frame.end(), body.begin(), body.end());
  return frame;
}

std::vector<uint8_t> BuildVerbsConnectRequest(uint64_t request_id,
                                              std::span<const uint8_t> qp_params) {
  std::vector<uint8_t> frame(kHeaderBytes);
  RequestHeader h{FrameType::kVerbsConnect, request_id, 0, static_cast<uint32_t>(qp_params.size())};
  EncodeRequestHeader(h, frame.data());
  frame.insert(frame.end(), qp_params.begin(), qp_params.end());
  return frame;
}

std::vector<uint8_t> BuildVerbsRegionRequest(uint64_t request_id, uint32_t region_id) {
  std::vector<uint8_t> frame(kHeaderBytes + kVerbsRegionRequestBytes, 0);
  RequestHeader h{FrameType::kVerbsRegion, request_id, 0,
                  static_cast<uint32_t>(kVerbsRegionRequestBytes)};
  EncodeRequestHeader(h, frame.data());
  Put32(frame.data() + kHeaderBytes, region_id);
  return frame;
}

Status DecodeVerbsRegionRequest(std::span<const uint8_t> body, uint32_t* region_id) {
  if (body.size() != kVerbsRegionRequestBytes) return Status::Corruption("verbs region body size");
  if (Get32(body.data() + 4) != 0) return Status::Corruption("reserved verbs region bytes");
  *region_id = Get32(body.data());
  return Status::Ok();
}

uint64_t FixedReplyDataBytes(FrameType type) {
  switch (type) {
    case FrameType::kOpen:
      return kOpenReplyBytes;
    case FrameType::kVerbsConnect:
      return kQpParamsBytes;
    case FrameType::kVerbsRegion:
      return kRemoteRegionBytes;
    case FrameType::kRead:
      break;
  }
  return 0;
}

}  // namespace kvtier::rdma::wire
