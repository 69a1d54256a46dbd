#include "storage/ssd_format.h"

#include <xxhash.h>

#include <bit>
#include <cstdio>
#include <cstring>
#include <string_view>

#include "common/endian.h"

namespace kvtier::storage::ssd {
namespace {

using le::Get16;
using le::Get32;
using le::Get64;
using le::Put16;
using le::Put32;
using le::Put64;
static_assert(std::endian::native == std::endian::little, "kvtier assumes a little-endian host");

bool AllZero(const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (p[i] != 0) return false;
  }
  return true;
}

}  // namespace

void EncodeRecordHeader(const RecordHeader& h, uint8_t* out) {
  std::memset(out, 0, kRecordHeaderBytes);
  Put32(out + 0, kRecordMagic);
  Put16(out + 4, kRecordVersion);
  out[6] = static_cast<uint8_t>(h.codec);
  out[7] = h.kind;
  Put32(out + 8, h.stored_bytes);
  Put32(out + 12, h.raw_bytes);
  Put64(out + 16, h.seq);
  Put64(out + 24, h.tenant);
  std::memcpy(out + 32, h.key.data(), 32);
  Put64(out + 64, h.created_unix_ms);
  Put64(out + 72, h.payload_checksum);
  Put64(out + 80, h.version);
  Put64(out + 88, h.expires_unix_ms);
  Put64(out + 96, h.parent_id);
  Put32(out + 104, h.recompute_tokens);
  // 108..123 reserved (zero)
  Put32(out + 124, XXH32(out, 124, 0));
}

Status DecodeRecordHeader(std::span<const uint8_t> in, RecordHeader* h) {
  if (in.size() < kRecordHeaderBytes) return Status::Corruption("record header truncated");
  const uint8_t* p = in.data();
  if (Get32(p) != kRecordMagic) return Status::Corruption("bad record magic");
  if (Get32(p + 124) != XXH32(p, 124, 0)) return Status::Corruption("record header checksum");
  if (Get16(p + 4) != kRecordVersion) return Status::Corruption("unknown record version");
  if (p[6] > static_cast<uint8_t>(Codec::kZstd)) return Status::Corruption("unknown codec");
  // Version 1 writes zeros there; a later format that uses them bumps the version.
  if (!AllZero(p + 108, 16)) return Status::Corruption("record header reserved bytes set");
  h->codec = static_cast<Codec>(p[6]);
  h->kind = p[7];
  h->stored_bytes = Get32(p + 8);
  h->raw_bytes = Get32(p + 12);
  if (h->codec == Codec::kNone && h->stored_bytes != h->raw_bytes) {
    return Status::Corruption("record length mismatch");
  }
  h->seq = Get64(p + 16);
  h->tenant = Get64(p + 24);
  std::memcpy(h->key.data(), p + 32, 32);
  h->created_unix_ms = Get64(p + 64);
  h->payload_checksum = Get64(p + 72);
  h->version = Get64(p + 80);
  h->expires_unix_ms = Get64(p + 88);
  h->parent_id = Get64(p + 96);
  h->recompute_tokens = Get32(p + 104);
  return Status::Ok();
}

uint64_t PayloadChecksum(std::span<const uint8_t> payload) {
  return XXH3_64bits(payload.data(), payload.size());
}

std::string EncodeIndexEntry(const IndexEntry& e) {
  std::string out(kIndexEntryBytes, '\0');
  auto* p = reinterpret_cast<uint8_t*>(out.data());
  p[0] = kIndexEntryVersion;
  p[1] = static_cast<uint8_t>(e.codec);
  p[2] = e.kind;
  Put32(p + 4, e.segment);
  Put64(p + 8, e.offset);
  Put32(p + 16, e.record_bytes);
  Put32(p + 20, e.raw_bytes);
  Put64(p + 24, e.checksum);
  Put64(p + 32, e.tenant);
  Put64(p + 40, e.created_unix_ms);
  Put64(p + 48, e.last_access_unix_ms);
  Put64(p + 56, e.hit_count);
  Put64(p + 64, e.seq);
  Put64(p + 72, e.version);
  Put64(p + 80, e.expires_unix_ms);
  Put64(p + 88, e.parent_id);
  Put32(p + 96, e.recompute_tokens);
  Put32(p + 100, XXH32(p, 100, 0));
  return out;
}

Status DecodeIndexEntry(std::span<const uint8_t> in, IndexEntry* e) {
  if (in.size() != kIndexEntryBytes) return Status::Corruption("index entry size");
  const uint8_t* p = in.data();
  if (p[0] != kIndexEntryVersion) return Status::Corruption("index entry version");
  if (Get32(p + 100) != XXH32(p, 100, 0)) return Status::Corruption("index entry checksum");
  if (p[1] > static_cast<uint8_t>(Codec::kZstd)) return Status::Corruption("index entry codec");
  if (p[3] != 0) return Status::Corruption("index entry reserved byte set");
  e->codec = static_cast<Codec>(p[1]);
  e->kind = p[2];
  e->segment = Get32(p + 4);
  e->offset = Get64(p + 8);
  e->record_bytes = Get32(p + 16);
  e->raw_bytes = Get32(p + 20);
  if (e->record_bytes < kRecordHeaderBytes) return Status::Corruption("index entry length");
  e->checksum = Get64(p + 24);
  e->tenant = Get64(p + 32);
  e->created_unix_ms = Get64(p + 40);
  e->last_access_unix_ms = Get64(p + 48);
  e->hit_count = Get64(p + 56);
  e->seq = Get64(p + 64);
  e->version = Get64(p + 72);
  e->expires_unix_ms = Get64(p + 80);
  e->parent_id = Get64(p + 88);
  e->recompute_tokens = Get32(p + 96);
  return Status::Ok();
}

std::string SegmentName(uint32_t id) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "seg-%08u.kvs", id);
  return buf;
}

bool ParseSegmentName(const std::string& name, uint32_t* id) {
  // "seg-", 8 to 10 decimal digits, ".kvs", and no other spelling of the id: sscanf's "%8u"
  // also took " 0000042" or "+0000042" (a second file for segment 42) and stopped at eight
  // digits, so the 100,000,000th segment was not found again at start.
  constexpr std::string_view kPrefix = "seg-", kSuffix = ".kvs";
  constexpr size_t kDigitsMin = 8, kDigitsMax = 10;
  if (name.size() < kPrefix.size() + kDigitsMin + kSuffix.size() ||
      name.size() > kPrefix.size() + kDigitsMax + kSuffix.size()) {
    return false;
  }
  if (!name.starts_with(kPrefix) || !name.ends_with(kSuffix)) return false;
  uint64_t v = 0;
  for (size_t i = kPrefix.size(); i < name.size() - kSuffix.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return false;
    v = v * 10 + static_cast<uint64_t>(name[i] - '0');  // at most 10 digits: no overflow
  }
  if (v > kSegmentIdMax || name != SegmentName(static_cast<uint32_t>(v))) return false;
  *id = static_cast<uint32_t>(v);
  return true;
}

}  // namespace kvtier::storage::ssd
