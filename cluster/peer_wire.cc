#include "cluster/peer_wire.h"

#include <openssl/crypto.h>
#include <openssl/hmac.h>

#include <algorithm>

namespace kvtier::cluster {

using daemon::wire::Reader;
using daemon::wire::Writer;

bool IsPeerOp(uint8_t opcode) { return opcode >= 0x60 && opcode <= 0x6A; }

PeerProof PeerAuthProof(std::span<const uint8_t> credential, std::string_view label,
                        const PeerNonce& a, const PeerNonce& b) {
  std::vector<uint8_t> msg(label.begin(), label.end());
  msg.insert(msg.end(), a.begin(), a.end());
  msg.insert(msg.end(), b.begin(), b.end());
  PeerProof out{};
  unsigned int len = 0;
  HMAC(EVP_sha256(), credential.data(), static_cast<int>(credential.size()), msg.data(), msg.size(),
       out.data(), &len);
  return out;
}

bool ProofsEqual(const PeerProof& a, const PeerProof& b) {
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

void PutText(std::string_view text, Writer* w) {
  w->U16(static_cast<uint16_t>(text.size()));
  w->Bytes(text);
}

bool GetText(Reader* r, std::string* text) {
  uint16_t n = 0;
  std::span<const uint8_t> bytes;
  if (!r->U16(&n) || n > kPeerTextBytesMax || !r->Bytes(n, &bytes)) return false;
  text->assign(bytes.begin(), bytes.end());
  return true;
}

void PutKeys(std::span<const PeerKey> keys, Writer* w) {
  w->U32(static_cast<uint32_t>(keys.size()));
  for (const PeerKey& k : keys) w->KeyBytes(k);
}

bool GetKeys(Reader* r, std::vector<PeerKey>* keys) {
  uint32_t n = 0;
  if (!r->U32(&n) || n > daemon::wire::kMaxBatchKeys || r->remaining() < n * sizeof(PeerKey)) {
    return false;
  }
  keys->resize(n);
  for (auto& k : *keys) r->KeyBytes(&k);
  return true;
}

std::vector<uint8_t> EncodePeerPut(const PeerPut& p) {
  Writer w;
  w.U8(p.kind);
  w.U8(p.highest_tier);
  w.U8(static_cast<uint8_t>((p.allow_ssd != 0 ? 1 : 0) | (p.repair ? 2 : 0)));
  w.U32(p.recompute_tokens);
  w.U64(p.ttl_ms);
  PutText(p.tenant, &w);
  w.KeyBytes(p.key);
  w.KeyBytes(p.parent);
  w.U32(static_cast<uint32_t>(p.value.size()));
  w.Bytes(p.value);
  if (p.expires_at_unix_ms != 0) w.U64(p.expires_at_unix_ms);
  return w.Take();
}

StatusOr<PeerPut> DecodePeerPut(std::span<const uint8_t> body, uint16_t flags) {
  Reader r(body);
  PeerPut p;
  uint32_t n = 0;
  const bool expiry = (flags & kPeerFlagExpiresAt) != 0;
  if (!r.U8(&p.kind) || !r.U8(&p.highest_tier) || !r.U8(&p.allow_ssd) ||
      !r.U32(&p.recompute_tokens) || !r.U64(&p.ttl_ms) || !GetText(&r, &p.tenant) ||
      !r.KeyBytes(&p.key) || !r.KeyBytes(&p.parent) || !r.U32(&n) || !r.Bytes(n, &p.value) ||
      (expiry && !r.U64(&p.expires_at_unix_ms)) || r.remaining() != 0) {
    return Status::InvalidArgument("malformed peer PUT");
  }
  if (p.kind > 2 || p.highest_tier > 2 || p.allow_ssd > 3) {
    return Status::InvalidArgument("peer PUT: bad kind, tier or flags");
  }
  p.repair = (p.allow_ssd & 2) != 0;
  p.allow_ssd &= 1;
  if (expiry && (!p.repair || p.ttl_ms == 0 || p.expires_at_unix_ms == 0)) {
    return Status::InvalidArgument("peer PUT: an expiry on a copy that is not a repair with a TTL");
  }
  return p;
}

uint64_t PeerPutTtlMs(const PeerPut& put, uint64_t now_unix_ms) {
  if (put.expires_at_unix_ms == 0) return put.ttl_ms;
  if (now_unix_ms >= put.expires_at_unix_ms) return 0;
  return std::min(put.ttl_ms, put.expires_at_unix_ms - now_unix_ms);
}

void EncodeTtlTrailer(std::span<const uint64_t> ttl_left_ms, Writer* w) {
  w->U32(static_cast<uint32_t>(ttl_left_ms.size()));
  for (uint64_t t : ttl_left_ms) w->U64(t);
}

Status DecodeTtlTrailer(Reader* r, size_t keys, bool* present, std::vector<uint64_t>* ttl_left_ms) {
  ttl_left_ms->clear();
  *present = r->remaining() != 0;
  if (!*present) return Status::Ok();
  uint32_t n = 0;
  if (!r->U32(&n) || n != keys || r->remaining() != 8 * uint64_t{n}) {
    return Status::Corruption("peer reply: malformed TTL trailer");
  }
  ttl_left_ms->resize(n);
  for (uint64_t& t : *ttl_left_ms) (void)r->U64(&t);
  return Status::Ok();
}

StatusOr<uint64_t> DecodeClockReply(std::span<const uint8_t> body) {
  Reader r(body);
  uint64_t unix_us = 0;
  if (!r.U64(&unix_us) || r.remaining() != 0) {
    return Status::Corruption("peer CLOCK reply: not one u64");
  }
  return unix_us;
}

void EncodeStagedReply(const StagedReply& reply, Writer* w, bool with_ttl) {
  w->U16(reply.region_port);
  PutText(reply.region_name, w);
  w->Bytes(std::span<const uint8_t>(reply.token));
  w->U32(static_cast<uint32_t>(reply.units.size()));
  for (const StagedUnit& u : reply.units) {
    w->U8(static_cast<uint8_t>(u.code));
    w->U64(u.offset_bytes);
    w->U32(u.length_bytes);
    w->U64(u.generation);
    w->U64(u.checksum);
  }
  if (with_ttl) {
    std::vector<uint64_t> ttls;
    ttls.reserve(reply.units.size());
    for (const StagedUnit& u : reply.units) ttls.push_back(u.ttl_left_ms);
    EncodeTtlTrailer(ttls, w);
  }
}

StatusOr<StagedReply> DecodeStagedReply(std::span<const uint8_t> body, size_t keys,
                                        bool ttl_asked) {
  Reader r(body);
  StagedReply out;
  std::span<const uint8_t> token;
  uint32_t n = 0;
  if (!r.U16(&out.region_port) || !GetText(&r, &out.region_name) ||
      !r.Bytes(out.token.size(), &token) || !r.U32(&n) || n != keys) {
    return Status::Corruption("peer GET_STAGED reply");
  }
  std::copy(token.begin(), token.end(), out.token.begin());
  out.units.resize(n);
  for (StagedUnit& u : out.units) {
    uint8_t code = 0;
    if (!r.U8(&code) || code > static_cast<uint8_t>(StatusCode::kInternal) ||
        !r.U64(&u.offset_bytes) || !r.U32(&u.length_bytes) || !r.U64(&u.generation) ||
        !r.U64(&u.checksum)) {
      return Status::Corruption("peer GET_STAGED reply entry");
    }
    u.code = static_cast<StatusCode>(code);
    if (u.code == StatusCode::kOk && u.length_bytes < kStagedRecordHeaderBytes) {
      return Status::Corruption("peer GET_STAGED: record shorter than its header");
    }
  }
  if (ttl_asked) {
    std::vector<uint64_t> ttls;
    KVTIER_RETURN_IF_ERROR(DecodeTtlTrailer(&r, out.units.size(), &out.ttl_known, &ttls));
    for (size_t i = 0; i < ttls.size(); ++i) out.units[i].ttl_left_ms = ttls[i];
  }
  if (r.remaining() != 0) return Status::Corruption("peer GET_STAGED reply: trailing bytes");
  return out;
}

}  // namespace kvtier::cluster
