// The peer protocol between kvtierd nodes of one cluster: the native protocol's framing
// (cache_daemon/wire.h: 16-byte header, little-endian bodies, a status prefix on every
// response) with opcodes of its own, spoken only on the peer front ([cluster] peer_listen).
//
// Peers address units by storage key (already bound to a tenant by the node that took the
// client's request), never by chain key: the peer front has no tenant login, so a peer
// cannot act as a tenant, derive a salt, or reach the client fronts' operations.
//
// Authentication (mutual, challenge-response over the cluster credential, a shared secret
// of at least 32 bytes from [cluster] credential_file):
//   client -> HELLO  {client_nonce[32], node_id}
//   server -> status, {server_nonce[32], HMAC(cred, "kvtier.peer.server" | cn | sn)}
//   client -> AUTH   {HMAC(cred, "kvtier.peer.client" | sn | cn)}
//   server -> status
// Nothing else is accepted before AUTH succeeds (PermissionDenied, connection closed).
//
// Bodies (after the header; keys are 32 bytes):
//   LOOKUP         u32 n, n keys               -> status, u32 n, n x u8 tier (255: absent)
//   GET            u32 n, n keys               -> status, u32 n, n x {u8 code, u32 len, bytes}
//                  (a value that does not fit after others is kRetry, no bytes: ask again;
//                  one that would not fit alone is kRejected)
//   PUT            u8 kind, u8 highest_tier, u8 allow_ssd, u32 recompute_tokens, u64 ttl_ms,
//                  text tenant, key, parent key, u32 len, bytes   -> status, and after an OK
//                  status of a repair copy u8 held (1: the peer already held the key and kept
//                  its unit, nothing stored; 2: the copy's unit had expired by the peer's
//                  clock when it arrived, nothing stored; a reply without it, from an older
//                  node: stored)
//   DELETE         u32 n, n keys               -> status, u32 n, n x u8 (1: it existed)
//   DELETE_TENANT  text tenant                 -> status
//   DROP_COPIES    u32 n, n keys               -> status (the peer drops its GET copies of
//                  the keys, never a unit it holds as an owner; docs/CLUSTER.md, "Copies")
//   DROP_OLDER     u32 n, n keys               -> status (the peer deletes what it holds of
//                  the keys, its units and its GET copies: a newer version was written to the
//                  keys' current owners, which it is not. Unlike DELETE it notes no delete,
//                  so repair copies of the keys are not refused; docs/CLUSTER.md, "Versions")
//   GET_STAGED     u32 n, n keys               -> status, u16 region_port, text region,
//                  16-byte grant token, u32 n, n x {u8 code, u64 offset, u32 length,
//                  u64 generation, u64 checksum}
//                  (the owner copies each held unit into its staging region and names the
//                  record; the caller reads it over rdma::Transport: docs/CLUSTER.md, "Bulk
//                  data over the region transport". code 0: staged; NotFound: absent; any
//                  other: not staged, ask with GET)
//   CLOCK          (empty)                     -> status, u64 unix_us (the peer's clock when it
//                  answered, Unix microseconds; cluster/peer_clocks.h. A node older than
//                  CLOCK answers InvalidArgument "unknown peer opcode")
// (text = u16 length + bytes, at most kPeerTextBytesMax.)
//
// Remaining TTLs: a GET or GET_STAGED request with kPeerFlagTtl in its header flags asks for
// each unit's remaining TTL. A node that knows the flag appends a TTL trailer to the reply,
// after the entries: u32 n, n x u64 ttl_left_ms (0: no expiry, or the unit was not found). A
// node older than the flag ignores it and appends nothing (and an older requester never sets
// it, so no reply it reads has a trailer): the requester then does not know the TTLs.
//
// Expiry of a repair copy: a PUT with kPeerFlagExpiresAt in its header flags (a repair copy
// of a unit with a TTL only) ends its body, after the value, with u64 expires_at_unix_ms: the
// moment the sender's unit expires, in Unix milliseconds by the sender's clock. The receiver
// keeps the copy until the earlier of that moment by its own clock and ttl_ms from the copy's
// arrival, so a copy outlives its unit by at most the smaller of its transit and the two
// clocks' offset (docs/CLUSTER.md, "Repair"); one that arrives after the moment is not stored
// (held byte 2). A node older than the flag refuses the body as malformed (InvalidArgument):
// the sender then sends the copy once more without it (PeerClient::Put).
//
// Thread safety: pure functions.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cache_daemon/wire.h"
#include "common/status.h"

namespace kvtier::cluster {

using PeerKey = std::array<uint8_t, 32>;
using PeerNonce = std::array<uint8_t, 32>;
using PeerProof = std::array<uint8_t, 32>;

enum class PeerOp : uint8_t {
  kHello = 0x60,
  kAuth = 0x61,
  kLookup = 0x62,
  kGet = 0x63,
  kPut = 0x64,
  kDelete = 0x65,
  kDeleteTenant = 0x66,
  kDropCopies = 0x67,
  kGetStaged = 0x68,
  kDropOlder = 0x69,
  kClock = 0x6A,
};
bool IsPeerOp(uint8_t opcode);

inline constexpr size_t kPeerTextBytesMax = 1024;
inline constexpr uint64_t kPeerPreauthFrameBytesMax = 4096;
inline constexpr size_t kCredentialBytesMin = 32;
inline constexpr size_t kCredentialBytesMax = 4096;
inline constexpr uint8_t kPeerTierAbsent = 255;
// Header flag of a GET / GET_STAGED request: append the TTL trailer (above).
inline constexpr uint16_t kPeerFlagTtl = 1;
// Header flag of a PUT: the body ends with the copy's expiry (above).
inline constexpr uint16_t kPeerFlagExpiresAt = 2;
// The held byte after an OK status of a repair copy.
enum class PeerPutOutcome : uint8_t {
  kStored = 0,   // the copy is stored (also what a reply without the byte means)
  kHeld = 1,     // the peer held a unit of the key and kept it; nothing stored
  kExpired = 2,  // the copy's unit had expired by the peer's clock on arrival; nothing stored
};
// Bytes of a TTL trailer for n keys.
inline constexpr uint64_t PeerTtlTrailerBytes(size_t n) { return 4 + 8 * uint64_t{n}; }
void EncodeTtlTrailer(std::span<const uint64_t> ttl_left_ms, daemon::wire::Writer* w);
// Reads a TTL trailer for `keys` units at r's position, which must end the body. Sets
// *present false (and leaves *ttl_left_ms empty) when nothing is left: an older node.
// Corruption for a trailer that is short, names another count, or is followed by more.
Status DecodeTtlTrailer(daemon::wire::Reader* r, size_t keys, bool* present,
                        std::vector<uint64_t>* ttl_left_ms);

// HMAC-SHA256(credential, label | a | b).
PeerProof PeerAuthProof(std::span<const uint8_t> credential, std::string_view label,
                        const PeerNonce& a, const PeerNonce& b);
inline constexpr std::string_view kServerProofLabel = "kvtier.peer.server";
inline constexpr std::string_view kClientProofLabel = "kvtier.peer.client";
// Constant-time comparison of two proofs.
bool ProofsEqual(const PeerProof& a, const PeerProof& b);

void PutText(std::string_view text, daemon::wire::Writer* w);
bool GetText(daemon::wire::Reader* r, std::string* text);  // false: truncated or too long

void PutKeys(std::span<const PeerKey> keys, daemon::wire::Writer* w);
// At most daemon::wire::kMaxBatchKeys keys.
bool GetKeys(daemon::wire::Reader* r, std::vector<PeerKey>* keys);

struct PeerPut {
  uint8_t kind = 0;
  uint8_t highest_tier = 1;
  uint8_t allow_ssd = 1;
  // A copy made by the repair scan (ClusterRepair), not a client's write: the receiver refuses
  // it for a key or tenant it deleted within RecentDeletes' window, and stores it only if it
  // holds no unit of the key (a newer write got there first: it stays). On the wire: bit 1 of
  // the allow_ssd byte (bit 0 is allow_ssd).
  bool repair = false;
  uint32_t recompute_tokens = 0;
  uint64_t ttl_ms = 0;
  // A repair copy of a unit with a TTL: when the sender's unit expires, in Unix ms by the
  // sender's clock (0: not sent). Sent with kPeerFlagExpiresAt (EncodePeerPut's caller sets
  // the flag: PeerPutFlags).
  uint64_t expires_at_unix_ms = 0;
  std::string tenant;
  PeerKey key{};
  PeerKey parent{};
  std::span<const uint8_t> value;  // points into the decoded body / caller's bytes
};
std::vector<uint8_t> EncodePeerPut(const PeerPut& put);
// The header flags EncodePeerPut's body needs.
inline uint16_t PeerPutFlags(const PeerPut& put) {
  return put.expires_at_unix_ms != 0 ? kPeerFlagExpiresAt : 0;
}
// InvalidArgument for a truncated or over-long body, and for an expiry on anything but a
// repair copy with a TTL. flags: the request header's.
StatusOr<PeerPut> DecodePeerPut(std::span<const uint8_t> body, uint16_t flags = 0);
// The TTL a copy stored at now_unix_ms keeps: put.ttl_ms, or less when put's expiry comes
// first; 0 when the expiry has passed (nothing to store). put.ttl_ms for a put without one.
uint64_t PeerPutTtlMs(const PeerPut& put, uint64_t now_unix_ms);

// The body of a CLOCK reply after its OK status: the peer's Unix time in microseconds.
// Corruption for a body that is short or longer than the u64.
StatusOr<uint64_t> DecodeClockReply(std::span<const uint8_t> body);

// Bytes before a staged value in its record (cluster/staging_ring.h).
inline constexpr uint32_t kStagedRecordHeaderBytes = 32;

// One unit of a GET_STAGED reply: where its record lies in the owner's staging region
// (cluster/staging_ring.h), valid when code is OK.
struct StagedUnit {
  StatusCode code = StatusCode::kOk;
  uint64_t offset_bytes = 0;
  uint32_t length_bytes = 0;  // the whole record: header + value
  uint64_t generation = 0;
  uint64_t checksum = 0;  // xxh3-64 of the value
  // The unit's remaining TTL (0: none). Travels in the TTL trailer, not in the entry.
  uint64_t ttl_left_ms = 0;
};
// A GET_STAGED reply: the staging region (on the owner's host, at region_port) with the
// grant the owner issued to the caller's node, and one StagedUnit per key.
struct StagedReply {
  uint16_t region_port = 0;
  std::string region_name;
  std::array<uint8_t, 16> token{};  // a secret: never logged
  std::vector<StagedUnit> units;
  bool ttl_known = false;  // decoded: the reply had a TTL trailer (units' ttl_left_ms are set)
};
// The body after the OK status; with_ttl appends the TTL trailer (of units' ttl_left_ms).
void EncodeStagedReply(const StagedReply& reply, daemon::wire::Writer* w, bool with_ttl = false);
// Corruption for a truncated or over-long body, a count other than `keys`, a code outside
// StatusCode, or a staged record shorter than its header. ttl_asked: the request set
// kPeerFlagTtl, so a TTL trailer may follow the entries (ttl_known tells whether it did).
StatusOr<StagedReply> DecodeStagedReply(std::span<const uint8_t> body, size_t keys,
                                        bool ttl_asked = false);

}  // namespace kvtier::cluster
