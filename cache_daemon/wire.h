// The kvtier native wire protocol: frames, opcodes and body codecs shared by kvtierd and
// the client library. The byte-level specification is docs/format/wire.md; this header is
// its executable form and must stay in step with it.
//
// Every frame is a 16-byte header followed by a body:
//
//   u32 length      bytes after this field (12 + body bytes), little-endian
//   u8  version     kWireVersion
//   u8  opcode      Opcode; a response sets kResponseBit on the request's opcode
//   u16 flags       FrameFlags bits
//   u64 request_id  chosen by the client, echoed in the response (pipelining)
//
// Every response body starts with a status: u8 StatusCode, u16 message length, message
// bytes. Operation-specific fields follow only when the status is OK.
//
// All decoders treat their input as hostile: they never read out of bounds, never allocate
// more than the input could describe, and return InvalidArgument/Corruption instead of
// asserting. Nothing here does I/O.
//
// Thread safety: free functions are pure; a FrameParser is owned by one connection and is
// not thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace kvtier::daemon::wire {

inline constexpr uint8_t kWireVersion = 1;
inline constexpr size_t kHeaderBytes = 16;
// The smallest legal value of the length field (a header with an empty body).
inline constexpr uint32_t kMinLengthField = 12;
inline constexpr uint8_t kResponseBit = 0x80;
// Largest number of keys in one LOOKUP/GET/PUT/PREFETCH/PIN/UNPIN/DELETE (storage::kMaxBatch).
inline constexpr uint32_t kMaxBatchKeys = 4096;
// Longest auth token and longest status message accepted on the wire.
inline constexpr size_t kMaxTokenBytes = 1024;
inline constexpr size_t kMaxMessageBytes = 4096;

using Key = std::array<uint8_t, 32>;

enum class Opcode : uint8_t {
  kHello = 0x01,      // version negotiation + optional token
  kAuth = 0x02,       // token only
  kShmAttach = 0x03,  // Unix socket only: the daemon answers with a memfd (SCM_RIGHTS)
  kLookup = 0x10,
  kPut = 0x11,
  kGet = 0x12,
  kPrefetch = 0x13,
  kPin = 0x14,
  kUnpin = 0x15,
  kDelete = 0x16,
  kStats = 0x20,
  kPolicyGet = 0x21,
  kPolicySet = 0x22,
  kDrain = 0x23,
  kEngramGrant = 0x30,   // grants on the Engram regions this daemon serves
  kEngramReport = 0x31,  // an engine's Engram fetch counters (deltas) for /metrics
};
// True for the opcodes listed above.
bool IsKnownOpcode(uint8_t opcode);
const char* OpcodeName(uint8_t opcode);  // "hello", ..., "unknown"

enum FrameFlags : uint16_t {
  // Bulk values live in the connection's shared-memory region, not in the frame.
  kFlagShm = 1u << 0,
  // LOOKUP, GET and PUT only: the body begins with a u64 turn id (nonzero, chosen by the
  // client) before the opcode's fields. Calls of one connection that carry the same turn id
  // are one request for the daemon's eviction policies (storage::RequestTag). Send it only
  // to a daemon whose HELLO response sets kFeatureTurns.
  kFlagTurn = 1u << 1,
};
// Bytes of the turn id that kFlagTurn puts in front of a body.
inline constexpr size_t kTurnBytes = 8;

// Bits of HelloResponse::features: what the daemon accepts beyond version 1's base.
enum Features : uint32_t {
  kFeatureTurns = 1u << 0,  // kFlagTurn on LOOKUP, GET and PUT
};

// The turn id of a body sent with kFlagTurn, and the opcode's fields after it (*rest).
// InvalidArgument when the opcode takes no turn, the body is shorter than kTurnBytes, or
// the id is 0.
StatusOr<uint64_t> SplitTurn(uint8_t opcode, std::span<const uint8_t> body,
                             std::span<const uint8_t>* rest);

struct FrameHeader {
  uint32_t length = kMinLengthField;
  uint8_t version = kWireVersion;
  uint8_t opcode = 0;
  uint16_t flags = 0;
  uint64_t request_id = 0;
  uint32_t body_bytes() const { return length - kMinLengthField; }
};

// Encodes a header for a body of body_bytes.
std::array<uint8_t, kHeaderBytes> EncodeHeader(uint8_t opcode, uint16_t flags, uint64_t request_id,
                                               uint32_t body_bytes);

// Validates a header. InvalidArgument for a bad version, a length below kMinLengthField or a
// frame larger than max_frame_bytes (header included). Unknown opcodes are NOT an error here:
// the daemon answers them with an error response and keeps the connection.
StatusOr<FrameHeader> DecodeHeader(std::span<const uint8_t, kHeaderBytes> bytes,
                                   uint64_t max_frame_bytes);

// One decoded frame: the header and its body bytes (owned).
struct Frame {
  FrameHeader header;
  std::vector<uint8_t> body;
};

// Incremental frame splitter over a byte stream. Append bytes as they arrive; Next() yields
// complete frames. A malformed header poisons the parser (every later Next fails), because
// framing is lost and the only safe reaction is to close the connection.
class FrameParser {
 public:
  // A drained buffer whose capacity grew beyond this (a large frame) is freed rather than
  // kept for the next frame, as resp::RespParser does.
  static constexpr size_t kKeepBufferBytes = 4u << 20;

  explicit FrameParser(uint64_t max_frame_bytes) : max_frame_bytes_(max_frame_bytes) {}
  // Changes the limit for headers not yet decoded (a connection lowers it before
  // authentication, so an unauthenticated peer cannot announce a large frame).
  void set_max_frame_bytes(uint64_t max_frame_bytes) { max_frame_bytes_ = max_frame_bytes; }

  void Append(std::span<const uint8_t> bytes);
  // True and fills *out when a whole frame is buffered; false when more bytes are needed.
  // InvalidArgument when the stream is malformed. A frame that leaves the buffer drained
  // frees it when its capacity is over kKeepBufferBytes.
  StatusOr<bool> Next(Frame* out);
  // Bytes buffered that do not yet form a complete frame.
  size_t buffered_bytes() const { return buffer_.size() - consumed_; }
  // Bytes allocated for the buffer: what the connection holds, also while idle (at most
  // kKeepBufferBytes once drained).
  size_t capacity_bytes() const { return buffer_.capacity(); }
  // True while a frame has started but is not complete.
  bool mid_frame() const { return buffered_bytes() > 0; }

 private:
  uint64_t max_frame_bytes_;
  std::vector<uint8_t> buffer_;
  size_t consumed_ = 0;
  Status poisoned_;
};

// ---- little-endian body encoding --------------------------------------------------------

class Writer {
 public:
  Writer() = default;
  // Writes into `buffer` from its start, keeping its capacity (a reused reply buffer).
  explicit Writer(std::vector<uint8_t> buffer) : out_(std::move(buffer)) { out_.clear(); }
  void U8(uint8_t v) { out_.push_back(v); }
  void U16(uint16_t v) { Put(v, 2); }
  void U32(uint32_t v) { Put(v, 4); }
  void U64(uint64_t v) { Put(v, 8); }
  void Bytes(std::span<const uint8_t> b) { out_.insert(out_.end(), b.begin(), b.end()); }
  void Bytes(std::string_view s) { out_.insert(out_.end(), s.begin(), s.end()); }
  void KeyBytes(const Key& k) { out_.insert(out_.end(), k.begin(), k.end()); }
  std::vector<uint8_t>& buffer() { return out_; }
  std::vector<uint8_t> Take() { return std::move(out_); }

 private:
  void Put(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  std::vector<uint8_t> out_;
};

// Bounds-checked reader: every getter returns false (and reads nothing) past the end.
class Reader {
 public:
  explicit Reader(std::span<const uint8_t> in) : in_(in) {}
  bool U8(uint8_t* v) { return Get(v, 1); }
  bool U16(uint16_t* v) { return Get(v, 2); }
  bool U32(uint32_t* v) { return Get(v, 4); }
  bool U64(uint64_t* v) { return Get(v, 8); }
  bool Bytes(size_t n, std::span<const uint8_t>* out) {
    if (remaining() < n) return false;
    *out = in_.subspan(pos_, n);
    pos_ += n;
    return true;
  }
  bool KeyBytes(Key* k) {
    if (remaining() < k->size()) return false;
    std::memcpy(k->data(), in_.data() + pos_, k->size());
    pos_ += k->size();
    return true;
  }
  size_t remaining() const { return in_.size() - pos_; }

 private:
  template <typename T>
  bool Get(T* v, size_t n) {
    if (remaining() < n) return false;
    uint64_t x = 0;
    for (size_t i = 0; i < n; ++i) x |= static_cast<uint64_t>(in_[pos_ + i]) << (8 * i);
    *v = static_cast<T>(x);
    pos_ += n;
    return true;
  }
  std::span<const uint8_t> in_;
  size_t pos_ = 0;
};

// ---- status prefix of every response ----------------------------------------------------

void EncodeStatus(const Status& status, Writer* w);
// Reads the status prefix into *decoded (possibly non-OK). Returns Corruption when the prefix
// itself is truncated or names an unknown code.
Status DecodeStatus(Reader* r, Status* decoded);

// ---- request bodies ---------------------------------------------------------------------

struct HelloRequest {
  uint16_t version_max = kWireVersion;
  // Tokens per unit the client uses (recorded in traces; 0 = unknown).
  uint32_t unit_tokens = 0;
  std::string token;  // empty: no authentication
};
struct HelloResponse {
  uint16_t version = kWireVersion;
  uint8_t authenticated = 0;
  uint64_t max_frame_bytes = 0;
  uint32_t max_inflight = 0;
  uint32_t max_batch_keys = 0;
  std::string tenant_name;
  // Features bits, after the tenant name; a daemon that predates them sends none (0).
  uint32_t features = 0;
};
std::vector<uint8_t> EncodeHello(const HelloRequest& req);
StatusOr<HelloRequest> DecodeHello(std::span<const uint8_t> body);
void EncodeHelloResponse(const HelloResponse& resp, Writer* w);
StatusOr<HelloResponse> DecodeHelloResponse(Reader* r);

// AUTH: u16 token length + token.
std::vector<uint8_t> EncodeAuth(std::string_view token);
StatusOr<std::string> DecodeAuth(std::span<const uint8_t> body);

// SHM_ATTACH: u64 requested bytes. Response: u64 granted bytes (+ the fd as ancillary data).
std::vector<uint8_t> EncodeShmAttach(uint64_t bytes);
StatusOr<uint64_t> DecodeShmAttach(std::span<const uint8_t> body);

// Key lists (LOOKUP, PREFETCH, UNPIN): u16 count + count x 32-byte keys.
std::vector<uint8_t> EncodeKeys(std::span<const Key> keys);
StatusOr<std::vector<Key>> DecodeKeys(std::span<const uint8_t> body);
bool DecodeKeyList(Reader* r, std::vector<Key>* keys);

// PIN: u64 lease_ms + key list.
std::vector<uint8_t> EncodePin(uint64_t lease_ms, std::span<const Key> keys);
struct PinRequest {
  uint64_t lease_ms = 0;
  std::vector<Key> keys;
};
StatusOr<PinRequest> DecodePin(std::span<const uint8_t> body);

// DELETE: u8 scope (0 keys, 1 the whole tenant) + key list (empty for scope 1).
struct DeleteRequest {
  uint8_t scope = 0;
  std::vector<Key> keys;
};
std::vector<uint8_t> EncodeDelete(const DeleteRequest& req);
StatusOr<DeleteRequest> DecodeDelete(std::span<const uint8_t> body);

// PUT.
struct PutUnit {
  Key key{};
  Key parent{};  // all zeros for the first unit of a chain
  // Inline: value points into the frame body. Shm: value_offset/value_bytes in the region.
  std::span<const uint8_t> value;
  uint64_t value_offset = 0;
  uint32_t value_bytes = 0;
};
struct PutRequest {
  uint8_t kind = 0;          // policies::ObjectKind
  uint8_t highest_tier = 1;  // storage::Tier (0 hbm, 1 dram, 2 ssd)
  uint8_t allow_ssd = 1;
  uint32_t recompute_tokens = 0;
  uint64_t ttl_ms = 0;
  std::vector<PutUnit> units;
};
// shm: write (offset, bytes) per unit instead of the bytes.
std::vector<uint8_t> EncodePut(const PutRequest& req, bool shm);
// body must outlive the returned request (inline values point into it).
StatusOr<PutRequest> DecodePut(std::span<const uint8_t> body, bool shm);

// GET: [shm: u64 dst_offset, u64 dst_capacity] + key list.
struct GetRequest {
  uint64_t dst_offset = 0;
  uint64_t dst_capacity = 0;
  std::vector<Key> keys;
};
std::vector<uint8_t> EncodeGet(const GetRequest& req, bool shm);
StatusOr<GetRequest> DecodeGet(std::span<const uint8_t> body, bool shm);

// One entry of a GET response: u8 code, u8 tier, u32 bytes, then u64 offset (shm) or the
// bytes inline.
struct GetEntry {
  StatusCode code = StatusCode::kNotFound;
  uint8_t tier = 255;
  uint32_t value_bytes = 0;
  uint64_t value_offset = 0;       // shm only
  std::span<const uint8_t> value;  // inline only, points into the response body
};
StatusOr<std::vector<GetEntry>> DecodeGetResponse(Reader* r, bool shm);

// "hbm", "dram", "ssd" for a wire tier byte (storage::Tier values); "none" otherwise.
const char* TierName(uint8_t tier);

// LOOKUP response: u16 hit count, one u8 tier per hit, u8 reason for the first miss.
struct LookupReply {
  uint32_t hit_count = 0;
  std::vector<uint8_t> tiers;
  uint8_t first_miss = 0;  // storage::MissReason
};
void EncodeLookupReply(const LookupReply& reply, Writer* w);
StatusOr<LookupReply> DecodeLookupReply(Reader* r);

// Per-unit status list (PUT response): u16 count + count x u8 code.
void EncodeCodes(std::span<const StatusCode> codes, Writer* w);
StatusOr<std::vector<StatusCode>> DecodeCodes(Reader* r);

// Text payloads (STATS, POLICY GET/SET JSON): u32 length + bytes.
void EncodeText(std::string_view text, Writer* w);
StatusOr<std::string> DecodeText(Reader* r, size_t max_bytes);

// ---- Engram (docs/format/wire.md, "ENGRAM_GRANT" and "ENGRAM_REPORT") -------------------

inline constexpr size_t kEngramTokenBytes = 16;  // = rdma::wire::kGrantTokenBytes
using EngramToken = std::array<uint8_t, kEngramTokenBytes>;
// Regions named in one ENGRAM_GRANT request or answered in one response.
inline constexpr uint32_t kEngramRegionsMax = 4096;
// A region name, a tenant name, an endpoint ("host:port").
inline constexpr size_t kEngramNameBytesMax = 256;
// The shards.toml text carried in an ENGRAM_GRANT response.
inline constexpr size_t kEngramShardsTomlBytesMax = 1u << 20;
// A transport name in ENGRAM_REPORT ("tcp", "verbs").
inline constexpr size_t kEngramTransportBytesMax = 16;

// ENGRAM_GRANT request: u64 ttl_ms (0: the daemon's engram.grant_ttl_ms), u16 n, n x (u16 len,
// region name); n = 0 asks for every region the daemon serves.
struct EngramGrantRequest {
  uint64_t ttl_ms = 0;
  std::vector<std::string> regions;
};
std::vector<uint8_t> EncodeEngramGrant(const EngramGrantRequest& req);
StatusOr<EngramGrantRequest> DecodeEngramGrant(std::span<const uint8_t> body);

struct EngramGrantedRegion {
  std::string name;
  EngramToken token{};           // secret: never log it
  uint64_t expires_unix_ms = 0;  // wall-clock expiry (the server enforces it on its own clock)
};
// ENGRAM_GRANT response: u16 len + endpoint, u16 len + tenant, u64 ttl_ms, u32 len +
// shards.toml, u16 n, n x (u16 len + name, 16-byte token, u64 expires_unix_ms).
struct EngramGrantResponse {
  std::string endpoint;     // the row server's "host:port" (engram.advertise)
  std::string tenant;       // the grants' tenant (RegionCredentials::tenant)
  uint64_t ttl_ms = 0;      // the ttl the grants were issued with
  std::string shards_toml;  // the whole shards.toml the daemon serves from
  std::vector<EngramGrantedRegion> regions;
};
void EncodeEngramGrantResponse(const EngramGrantResponse& resp, Writer* w);
StatusOr<EngramGrantResponse> DecodeEngramGrantResponse(Reader* r);

// ENGRAM_REPORT request: u8 len + transport name, then 11 x u64 in this order (the first ten
// are deltas since the previous report, reads_in_flight is the current value). Response: none.
struct EngramReport {
  std::string transport;  // "tcp" or "verbs"
  uint64_t rows_requested = 0;
  uint64_t rows_deduplicated = 0;
  uint64_t hot_cache_hits = 0;
  uint64_t rows_read = 0;
  uint64_t bytes_read = 0;
  uint64_t late_rows = 0;
  uint64_t stalls = 0;
  uint64_t stall_us = 0;
  uint64_t retries = 0;
  uint64_t fetches_failed = 0;
  uint64_t reads_in_flight = 0;  // gauge
};
inline constexpr size_t kEngramReportCounters = 11;
std::vector<uint8_t> EncodeEngramReport(const EngramReport& report);
// InvalidArgument for a malformed body or a transport other than "tcp"/"verbs".
StatusOr<EngramReport> DecodeEngramReport(std::span<const uint8_t> body);
// Index of a known transport name (0 "tcp", 1 "verbs"), or -1.
int EngramTransportIndex(std::string_view name);
inline constexpr std::array<const char*, 2> kEngramTransports = {"tcp", "verbs"};

// Builds a whole frame (header + body).
std::vector<uint8_t> BuildFrame(uint8_t opcode, uint16_t flags, uint64_t request_id,
                                std::span<const uint8_t> body);

// True when [offset, offset + bytes) lies inside [area_offset, area_offset + area_bytes).
// Computed without overflow: offsets and lengths in a frame come from the other side, and a
// sum that wraps would pass a naive end check. Shared-memory ranges on both sides use it.
inline bool InsideArea(uint64_t offset, uint64_t bytes, uint64_t area_offset, uint64_t area_bytes) {
  if (offset < area_offset) return false;
  const uint64_t rel = offset - area_offset;
  return rel <= area_bytes && bytes <= area_bytes - rel;
}

}  // namespace kvtier::daemon::wire
