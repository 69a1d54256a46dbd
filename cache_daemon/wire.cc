#include "cache_daemon/wire.h"

#include <algorithm>

namespace kvtier::daemon::wire {
namespace {

constexpr uint8_t kMaxStatusCode = static_cast<uint8_t>(StatusCode::kInternal);

Status Truncated(const char* what) {
  return Status::InvalidArgument(std::string("truncated or malformed ") + what + " body");
}

Status CheckEnd(const Reader& r, const char* what) {
  if (r.remaining() != 0) {
    return Status::InvalidArgument(std::string("trailing bytes after ") + what + " body");
  }
  return Status::Ok();
}

}  // namespace

bool IsKnownOpcode(uint8_t opcode) {
  switch (static_cast<Opcode>(opcode)) {
    case Opcode::kHello:
    case Opcode::kAuth:
    case Opcode::kShmAttach:
    case Opcode::kLookup:
    case Opcode::kPut:
    case Opcode::kGet:
    case Opcode::kPrefetch:
    case Opcode::kPin:
    case Opcode::kUnpin:
    case Opcode::kDelete:
    case Opcode::kStats:
    case Opcode::kPolicyGet:
    case Opcode::kPolicySet:
    case Opcode::kDrain:
    case Opcode::kEngramGrant:
    case Opcode::kEngramReport:
      return true;
  }
  return false;
}

const char* OpcodeName(uint8_t opcode) {
  switch (static_cast<Opcode>(opcode & ~kResponseBit)) {
    case Opcode::kHello:
      return "hello";
    case Opcode::kAuth:
      return "auth";
    case Opcode::kShmAttach:
      return "shm_attach";
    case Opcode::kLookup:
      return "lookup";
    case Opcode::kPut:
      return "put";
    case Opcode::kGet:
      return "get";
    case Opcode::kPrefetch:
      return "prefetch";
    case Opcode::kPin:
      return "pin";
    case Opcode::kUnpin:
      return "unpin";
    case Opcode::kDelete:
      return "delete";
    case Opcode::kStats:
      return "stats";
    case Opcode::kPolicyGet:
      return "policy_get";
    case Opcode::kPolicySet:
      return "policy_set";
    case Opcode::kDrain:
      return "drain";
    case Opcode::kEngramGrant:
      return "engram_grant";
    case Opcode::kEngramReport:
      return "engram_report";
  }
  return "unknown";
}

std::array<uint8_t, kHeaderBytes> EncodeHeader(uint8_t opcode, uint16_t flags, uint64_t request_id,
                                               uint32_t body_bytes) {
  std::array<uint8_t, kHeaderBytes> h{};
  uint32_t length = kMinLengthField + body_bytes;
  for (int i = 0; i < 4; ++i) h[i] = static_cast<uint8_t>(length >> (8 * i));
  h[4] = kWireVersion;
  h[5] = opcode;
  h[6] = static_cast<uint8_t>(flags);
  h[7] = static_cast<uint8_t>(flags >> 8);
  for (int i = 0; i < 8; ++i) h[8 + i] = static_cast<uint8_t>(request_id >> (8 * i));
  return h;
}

StatusOr<FrameHeader> DecodeHeader(std::span<const uint8_t, kHeaderBytes> bytes,
                                   uint64_t max_frame_bytes) {
  Reader r(bytes);
  FrameHeader h;
  (void)r.U32(&h.length);
  (void)r.U8(&h.version);
  (void)r.U8(&h.opcode);
  (void)r.U16(&h.flags);
  (void)r.U64(&h.request_id);
  if (h.version != kWireVersion) {
    return Status::InvalidArgument("unsupported wire version " + std::to_string(h.version));
  }
  if (h.length < kMinLengthField) {
    return Status::InvalidArgument("frame length field " + std::to_string(h.length) +
                                   " below the minimum of 12");
  }
  if (static_cast<uint64_t>(h.length) + 4 > max_frame_bytes) {
    return Status::InvalidArgument("frame of " + std::to_string(uint64_t{h.length} + 4) +
                                   " bytes exceeds max_frame_bytes " +
                                   std::to_string(max_frame_bytes));
  }
  return h;
}

void FrameParser::Append(std::span<const uint8_t> bytes) {
  if (consumed_ > 0 && consumed_ == buffer_.size()) {
    buffer_.clear();
    consumed_ = 0;
  }
  buffer_.insert(buffer_.end(), bytes.begin(), bytes.end());
}

StatusOr<bool> FrameParser::Next(Frame* out) {
  if (!poisoned_.ok()) return poisoned_;
  if (buffered_bytes() < kHeaderBytes) return false;
  std::span<const uint8_t, kHeaderBytes> head(buffer_.data() + consumed_, kHeaderBytes);
  StatusOr<FrameHeader> h = DecodeHeader(head, max_frame_bytes_);
  if (!h.ok()) {
    poisoned_ = h.status();
    return poisoned_;
  }
  size_t total = size_t{h->length} + 4;
  if (buffered_bytes() < total) return false;
  out->header = *h;
  const uint8_t* body = buffer_.data() + consumed_ + kHeaderBytes;
  out->body.assign(body, body + h->body_bytes());
  consumed_ += total;
  if (consumed_ == buffer_.size()) {  // drained: reuse from the start, or free a large buffer
    if (buffer_.capacity() > kKeepBufferBytes) {
      std::vector<uint8_t>().swap(buffer_);
    } else {
      buffer_.clear();
    }
    consumed_ = 0;
    return true;
  }
  // Compact once the consumed prefix dominates, so the buffer stays bounded by one frame.
  if (consumed_ > (1u << 16) && consumed_ * 2 > buffer_.size()) {
    buffer_.erase(buffer_.begin(), buffer_.begin() + static_cast<ptrdiff_t>(consumed_));
    consumed_ = 0;
  }
  return true;
}

void EncodeStatus(const Status& status, Writer* w) {
  w->U8(static_cast<uint8_t>(status.code()));
  std::string_view msg = status.message();
  if (msg.size() > kMaxMessageBytes) msg = msg.substr(0, kMaxMessageBytes);
  w->U16(static_cast<uint16_t>(msg.size()));
  w->Bytes(msg);
}

Status DecodeStatus(Reader* r, Status* decoded) {
  uint8_t code = 0;
  uint16_t len = 0;
  std::span<const uint8_t> msg;
  if (!r->U8(&code) || !r->U16(&len) || !r->Bytes(len, &msg)) {
    return Status::Corruption("truncated response status");
  }
  if (code > kMaxStatusCode) return Status::Corruption("unknown status code in response");
  if (code == 0) {
    *decoded = Status::Ok();
  } else {
    *decoded = Status(static_cast<StatusCode>(code),
                      std::string_view(reinterpret_cast<const char*>(msg.data()), msg.size()));
  }
  return Status::Ok();
}

std::vector<uint8_t> EncodeHello(const HelloRequest& req) {
  Writer w;
  w.U16(req.version_max);
  w.U32(req.unit_tokens);
  w.U16(static_cast<uint16_t>(req.token.size()));
  w.Bytes(req.token);
  return w.Take();
}

StatusOr<HelloRequest> DecodeHello(std::span<const uint8_t> body) {
  Reader r(body);
  HelloRequest req;
  uint16_t len = 0;
  std::span<const uint8_t> tok;
  if (!r.U16(&req.version_max) || !r.U32(&req.unit_tokens) || !r.U16(&len)) {
    return Truncated("hello");
  }
  if (len > kMaxTokenBytes) return Status::InvalidArgument("token too long");
  if (!r.Bytes(len, &tok)) return Truncated("hello");
  KVTIER_RETURN_IF_ERROR(CheckEnd(r, "hello"));
  req.token.assign(tok.begin(), tok.end());
  return req;
}

void EncodeHelloResponse(const HelloResponse& resp, Writer* w) {
  w->U16(resp.version);
  w->U8(resp.authenticated);
  w->U64(resp.max_frame_bytes);
  w->U32(resp.max_inflight);
  w->U32(resp.max_batch_keys);
  w->U16(static_cast<uint16_t>(std::min<size_t>(resp.tenant_name.size(), 256)));
  w->Bytes(std::string_view(resp.tenant_name).substr(0, 256));
  w->U32(resp.features);
}

StatusOr<HelloResponse> DecodeHelloResponse(Reader* r) {
  HelloResponse resp;
  uint16_t len = 0;
  std::span<const uint8_t> name;
  if (!r->U16(&resp.version) || !r->U8(&resp.authenticated) || !r->U64(&resp.max_frame_bytes) ||
      !r->U32(&resp.max_inflight) || !r->U32(&resp.max_batch_keys) || !r->U16(&len) ||
      !r->Bytes(len, &name)) {
    return Status::Corruption("truncated hello response");
  }
  resp.tenant_name.assign(name.begin(), name.end());
  if (r->remaining() >= 4) (void)r->U32(&resp.features);  // absent before features existed
  return resp;
}

StatusOr<uint64_t> SplitTurn(uint8_t opcode, std::span<const uint8_t> body,
                             std::span<const uint8_t>* rest) {
  const auto op = static_cast<Opcode>(opcode);
  if (op != Opcode::kLookup && op != Opcode::kGet && op != Opcode::kPut) {
    return Status::InvalidArgument("turn flag on an opcode other than LOOKUP, GET, PUT");
  }
  Reader r(body);
  uint64_t turn = 0;
  if (!r.U64(&turn)) return Status::InvalidArgument("turn flag on a body shorter than its turn id");
  if (turn == 0) return Status::InvalidArgument("turn id 0");
  *rest = body.subspan(kTurnBytes);
  return turn;
}

std::vector<uint8_t> EncodeAuth(std::string_view token) {
  Writer w;
  w.U16(static_cast<uint16_t>(token.size()));
  w.Bytes(token);
  return w.Take();
}

StatusOr<std::string> DecodeAuth(std::span<const uint8_t> body) {
  Reader r(body);
  uint16_t len = 0;
  std::span<const uint8_t> tok;
  if (!r.U16(&len)) return Truncated("auth");
  if (len > kMaxTokenBytes) return Status::InvalidArgument("token too long");
  if (!r.Bytes(len, &tok)) return Truncated("auth");
  KVTIER_RETURN_IF_ERROR(CheckEnd(r, "auth"));
  return std::string(tok.begin(), tok.end());
}

std::vector<uint8_t> EncodeShmAttach(uint64_t bytes) {
  Writer w;
  w.U64(bytes);
  return w.Take();
}

StatusOr<uint64_t> DecodeShmAttach(std::span<const uint8_t> body) {
  Reader r(body);
  uint64_t bytes = 0;
  if (!r.U64(&bytes)) return Truncated("shm_attach");
  KVTIER_RETURN_IF_ERROR(CheckEnd(r, "shm_attach"));
  return bytes;
}

static void PutKeyList(std::span<const Key> keys, Writer* w) {
  w->U16(static_cast<uint16_t>(keys.size()));
  for (const Key& k : keys) w->KeyBytes(k);
}

bool DecodeKeyList(Reader* r, std::vector<Key>* keys) {
  uint16_t count = 0;
  if (!r->U16(&count)) return false;
  if (count > kMaxBatchKeys || r->remaining() < size_t{count} * 32) return false;
  keys->resize(count);
  for (Key& k : *keys) (void)r->KeyBytes(&k);
  return true;
}

std::vector<uint8_t> EncodeKeys(std::span<const Key> keys) {
  Writer w;
  PutKeyList(keys, &w);
  return w.Take();
}

StatusOr<std::vector<Key>> DecodeKeys(std::span<const uint8_t> body) {
  Reader r(body);
  std::vector<Key> keys;
  if (!DecodeKeyList(&r, &keys)) return Truncated("key list");
  KVTIER_RETURN_IF_ERROR(CheckEnd(r, "key list"));
  return keys;
}

std::vector<uint8_t> EncodePin(uint64_t lease_ms, std::span<const Key> keys) {
  Writer w;
  w.U64(lease_ms);
  PutKeyList(keys, &w);
  return w.Take();
}

StatusOr<PinRequest> DecodePin(std::span<const uint8_t> body) {
  Reader r(body);
  PinRequest req;
  if (!r.U64(&req.lease_ms) || !DecodeKeyList(&r, &req.keys)) return Truncated("pin");
  KVTIER_RETURN_IF_ERROR(CheckEnd(r, "pin"));
  return req;
}

std::vector<uint8_t> EncodeDelete(const DeleteRequest& req) {
  Writer w;
  w.U8(req.scope);
  PutKeyList(req.keys, &w);
  return w.Take();
}

StatusOr<DeleteRequest> DecodeDelete(std::span<const uint8_t> body) {
  Reader r(body);
  DeleteRequest req;
  if (!r.U8(&req.scope) || !DecodeKeyList(&r, &req.keys)) return Truncated("delete");
  KVTIER_RETURN_IF_ERROR(CheckEnd(r, "delete"));
  if (req.scope > 1) return Status::InvalidArgument("unknown delete scope");
  return req;
}

std::vector<uint8_t> EncodePut(const PutRequest& req, bool shm) {
  // Sized once: an inline batch of 32 units of 57,000 bytes regrew a doubling buffer six times,
  // each time into fresh pages (most of the client's CPU in an inline PUT).
  constexpr size_t kFixedBytes = 4 + 4 + 8 + 2;  // kind..reserved, recompute_tokens, ttl, count
  constexpr size_t kShmValueBytes = 8 + 4;       // offset, length
  size_t bytes = kFixedBytes;
  for (const PutUnit& u : req.units) {
    bytes += 2 * sizeof(Key) + (shm ? kShmValueBytes : 4 + u.value.size());
  }
  Writer w;
  w.buffer().reserve(bytes);
  w.U8(req.kind);
  w.U8(req.highest_tier);
  w.U8(req.allow_ssd);
  w.U8(0);
  w.U32(req.recompute_tokens);
  w.U64(req.ttl_ms);
  w.U16(static_cast<uint16_t>(req.units.size()));
  for (const PutUnit& u : req.units) {
    w.KeyBytes(u.key);
    w.KeyBytes(u.parent);
    if (shm) {
      w.U64(u.value_offset);
      w.U32(u.value_bytes);
    } else {
      w.U32(static_cast<uint32_t>(u.value.size()));
      w.Bytes(u.value);
    }
  }
  return w.Take();
}

StatusOr<PutRequest> DecodePut(std::span<const uint8_t> body, bool shm) {
  Reader r(body);
  PutRequest req;
  uint8_t reserved = 0;
  uint16_t count = 0;
  if (!r.U8(&req.kind) || !r.U8(&req.highest_tier) || !r.U8(&req.allow_ssd) || !r.U8(&reserved) ||
      !r.U32(&req.recompute_tokens) || !r.U64(&req.ttl_ms) || !r.U16(&count)) {
    return Truncated("put");
  }
  if (count > kMaxBatchKeys) return Status::InvalidArgument("put batch too large");
  if (req.kind > 2) return Status::InvalidArgument("unknown object kind");
  if (req.highest_tier > 2) return Status::InvalidArgument("unknown tier");
  // Each unit takes at least 68 bytes, so count is bounded by the body before reserving.
  if (r.remaining() < size_t{count} * 68) return Truncated("put");
  req.units.resize(count);
  for (PutUnit& u : req.units) {
    if (!r.KeyBytes(&u.key) || !r.KeyBytes(&u.parent)) return Truncated("put");
    if (shm) {
      if (!r.U64(&u.value_offset) || !r.U32(&u.value_bytes)) return Truncated("put");
    } else {
      if (!r.U32(&u.value_bytes) || !r.Bytes(u.value_bytes, &u.value)) return Truncated("put");
    }
  }
  KVTIER_RETURN_IF_ERROR(CheckEnd(r, "put"));
  return req;
}

std::vector<uint8_t> EncodeGet(const GetRequest& req, bool shm) {
  Writer w;
  if (shm) {
    w.U64(req.dst_offset);
    w.U64(req.dst_capacity);
  }
  PutKeyList(req.keys, &w);
  return w.Take();
}

StatusOr<GetRequest> DecodeGet(std::span<const uint8_t> body, bool shm) {
  Reader r(body);
  GetRequest req;
  if (shm && (!r.U64(&req.dst_offset) || !r.U64(&req.dst_capacity))) return Truncated("get");
  if (!DecodeKeyList(&r, &req.keys)) return Truncated("get");
  KVTIER_RETURN_IF_ERROR(CheckEnd(r, "get"));
  return req;
}

StatusOr<std::vector<GetEntry>> DecodeGetResponse(Reader* r, bool shm) {
  uint16_t count = 0;
  if (!r->U16(&count) || count > kMaxBatchKeys) return Status::Corruption("bad get response");
  std::vector<GetEntry> entries(count);
  for (GetEntry& e : entries) {
    uint8_t code = 0;
    if (!r->U8(&code) || !r->U8(&e.tier) || !r->U32(&e.value_bytes) || code > kMaxStatusCode) {
      return Status::Corruption("bad get response entry");
    }
    e.code = static_cast<StatusCode>(code);
    if (e.code != StatusCode::kOk) continue;
    if (shm) {
      if (!r->U64(&e.value_offset)) return Status::Corruption("bad get response entry");
    } else if (!r->Bytes(e.value_bytes, &e.value)) {
      return Status::Corruption("truncated get response value");
    }
  }
  return entries;
}

void EncodeLookupReply(const LookupReply& reply, Writer* w) {
  w->U16(static_cast<uint16_t>(reply.hit_count));
  for (uint32_t i = 0; i < reply.hit_count; ++i) w->U8(reply.tiers[i]);
  w->U8(reply.first_miss);
}

StatusOr<LookupReply> DecodeLookupReply(Reader* r) {
  LookupReply reply;
  uint16_t hits = 0;
  if (!r->U16(&hits) || hits > kMaxBatchKeys || r->remaining() < size_t{hits} + 1) {
    return Status::Corruption("bad lookup response");
  }
  reply.hit_count = hits;
  reply.tiers.resize(hits);
  for (uint8_t& t : reply.tiers) (void)r->U8(&t);
  (void)r->U8(&reply.first_miss);
  return reply;
}

void EncodeCodes(std::span<const StatusCode> codes, Writer* w) {
  w->U16(static_cast<uint16_t>(codes.size()));
  for (StatusCode c : codes) w->U8(static_cast<uint8_t>(c));
}

StatusOr<std::vector<StatusCode>> DecodeCodes(Reader* r) {
  uint16_t count = 0;
  if (!r->U16(&count) || count > kMaxBatchKeys || r->remaining() < count) {
    return Status::Corruption("bad status list");
  }
  std::vector<StatusCode> codes(count);
  for (StatusCode& c : codes) {
    uint8_t v = 0;
    (void)r->U8(&v);
    if (v > kMaxStatusCode) return Status::Corruption("unknown status code");
    c = static_cast<StatusCode>(v);
  }
  return codes;
}

void EncodeText(std::string_view text, Writer* w) {
  w->U32(static_cast<uint32_t>(text.size()));
  w->Bytes(text);
}

StatusOr<std::string> DecodeText(Reader* r, size_t max_bytes) {
  uint32_t len = 0;
  std::span<const uint8_t> b;
  if (!r->U32(&len) || len > max_bytes || !r->Bytes(len, &b)) {
    return Status::InvalidArgument("truncated or oversized text payload");
  }
  return std::string(b.begin(), b.end());
}

namespace {

void PutShortString(std::string_view s, Writer* w) {
  w->U16(static_cast<uint16_t>(s.size()));
  w->Bytes(s);
}

bool GetShortString(Reader* r, size_t max_bytes, std::string* out) {
  uint16_t len = 0;
  std::span<const uint8_t> b;
  if (!r->U16(&len) || len > max_bytes || !r->Bytes(len, &b)) return false;
  out->assign(b.begin(), b.end());
  return true;
}

// The report's counters in wire order.
std::array<uint64_t*, kEngramReportCounters> ReportFields(EngramReport* r) {
  return {&r->rows_requested, &r->rows_deduplicated, &r->hot_cache_hits, &r->rows_read,
          &r->bytes_read,     &r->late_rows,         &r->stalls,         &r->stall_us,
          &r->retries,        &r->fetches_failed,    &r->reads_in_flight};
}

}  // namespace

std::vector<uint8_t> EncodeEngramGrant(const EngramGrantRequest& req) {
  Writer w;
  w.U64(req.ttl_ms);
  w.U16(static_cast<uint16_t>(req.regions.size()));
  for (const std::string& name : req.regions) PutShortString(name, &w);
  return w.Take();
}

StatusOr<EngramGrantRequest> DecodeEngramGrant(std::span<const uint8_t> body) {
  Reader r(body);
  EngramGrantRequest req;
  uint16_t count = 0;
  if (!r.U64(&req.ttl_ms) || !r.U16(&count)) return Truncated("engram_grant");
  if (count > kEngramRegionsMax) return Status::InvalidArgument("too many regions in one grant");
  // Each name takes at least 3 bytes (u16 length + 1 byte), so count is bounded by the body.
  if (r.remaining() < size_t{count} * 3) return Truncated("engram_grant");
  req.regions.resize(count);
  for (std::string& name : req.regions) {
    if (!GetShortString(&r, kEngramNameBytesMax, &name) || name.empty()) {
      return Status::InvalidArgument("engram_grant: region names are 1..256 bytes");
    }
  }
  KVTIER_RETURN_IF_ERROR(CheckEnd(r, "engram_grant"));
  return req;
}

void EncodeEngramGrantResponse(const EngramGrantResponse& resp, Writer* w) {
  PutShortString(resp.endpoint, w);
  PutShortString(resp.tenant, w);
  w->U64(resp.ttl_ms);
  EncodeText(resp.shards_toml, w);
  w->U16(static_cast<uint16_t>(resp.regions.size()));
  for (const EngramGrantedRegion& g : resp.regions) {
    PutShortString(g.name, w);
    w->Bytes(std::span<const uint8_t>(g.token));
    w->U64(g.expires_unix_ms);
  }
}

StatusOr<EngramGrantResponse> DecodeEngramGrantResponse(Reader* r) {
  EngramGrantResponse resp;
  uint16_t count = 0;
  if (!GetShortString(r, kEngramNameBytesMax, &resp.endpoint) ||
      !GetShortString(r, kEngramNameBytesMax, &resp.tenant) || !r->U64(&resp.ttl_ms)) {
    return Status::Corruption("truncated engram_grant response");
  }
  StatusOr<std::string> toml = DecodeText(r, kEngramShardsTomlBytesMax);
  if (!toml.ok()) return Status::Corruption("bad shards.toml in engram_grant response");
  resp.shards_toml = std::move(toml).value();
  if (!r->U16(&count) || count > kEngramRegionsMax || r->remaining() < size_t{count} * 27) {
    return Status::Corruption("bad engram_grant response region count");
  }
  resp.regions.resize(count);
  for (EngramGrantedRegion& g : resp.regions) {
    std::span<const uint8_t> tok;
    if (!GetShortString(r, kEngramNameBytesMax, &g.name) || !r->Bytes(kEngramTokenBytes, &tok) ||
        !r->U64(&g.expires_unix_ms)) {
      return Status::Corruption("truncated engram_grant response region");
    }
    std::copy(tok.begin(), tok.end(), g.token.begin());
  }
  return resp;
}

int EngramTransportIndex(std::string_view name) {
  for (size_t i = 0; i < kEngramTransports.size(); ++i) {
    if (name == kEngramTransports[i]) return static_cast<int>(i);
  }
  return -1;
}

std::vector<uint8_t> EncodeEngramReport(const EngramReport& report) {
  Writer w;
  w.U8(static_cast<uint8_t>(report.transport.size()));
  w.Bytes(report.transport);
  EngramReport copy = report;
  for (uint64_t* v : ReportFields(&copy)) w.U64(*v);
  return w.Take();
}

StatusOr<EngramReport> DecodeEngramReport(std::span<const uint8_t> body) {
  Reader r(body);
  EngramReport report;
  uint8_t len = 0;
  std::span<const uint8_t> name;
  if (!r.U8(&len) || len > kEngramTransportBytesMax || !r.Bytes(len, &name)) {
    return Truncated("engram_report");
  }
  report.transport.assign(name.begin(), name.end());
  for (uint64_t* v : ReportFields(&report)) {
    if (!r.U64(v)) return Truncated("engram_report");
  }
  KVTIER_RETURN_IF_ERROR(CheckEnd(r, "engram_report"));
  if (EngramTransportIndex(report.transport) < 0) {
    return Status::InvalidArgument("engram_report: transport must be \"tcp\" or \"verbs\"");
  }
  return report;
}

std::vector<uint8_t> BuildFrame(uint8_t opcode, uint16_t flags, uint64_t request_id,
                                std::span<const uint8_t> body) {
  std::vector<uint8_t> out;
  out.reserve(kHeaderBytes + body.size());
  auto h = EncodeHeader(opcode, flags, request_id, static_cast<uint32_t>(body.size()));
  out.insert(out.end(), h.begin(), h.end());
  out.insert(out.end(), body.begin(), body.end());
  return out;
}

const char* TierName(uint8_t tier) {
  switch (tier) {
    case 0:
      return "hbm";
    case 1:
      return "dram";
    case 2:
      return "ssd";
    default:
      return "none";
  }
}

}  // namespace kvtier::daemon::wire
