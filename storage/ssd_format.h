// On-disk formats of the SSD tier: the segment record and the RocksDB index entry. All
// integers little-endian. Byte-level description: docs/format/ssd.md.
//
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "storage/tier_manager.h"

namespace kvtier::storage::ssd {

inline constexpr uint32_t kRecordMagic = 0x5253564B;  // "KVSR" as little-endian bytes
inline constexpr uint16_t kRecordVersion = 1;
inline constexpr size_t kRecordHeaderBytes = 128;
inline constexpr size_t kRecordAlignBytes = 8;
inline constexpr size_t kBlockBytes = 4096;
inline constexpr uint8_t kIndexEntryVersion = 1;
inline constexpr size_t kIndexEntryBytes = 104;

enum class Codec : uint8_t { kNone = 0, kZstd = 1 };

struct RecordHeader {
  Codec codec = Codec::kNone;
  uint8_t kind = 0;
  uint32_t stored_bytes = 0;  // payload bytes on disk
  uint32_t raw_bytes = 0;     // value bytes after decoding
  uint64_t seq = 0;
  uint64_t tenant = 0;
  Key key{};
  uint64_t created_unix_ms = 0;
  uint64_t payload_checksum = 0;  // XXH3-64 of the stored payload
  uint64_t version = 0;           // TierManager put version
  uint64_t expires_unix_ms = 0;   // 0: no expiry
  uint64_t parent_id = 0;
  uint32_t recompute_tokens = 0;
};

// Writes the 128-byte header (with its own XXH32 over bytes 0..123) into out.
void EncodeRecordHeader(const RecordHeader& h, uint8_t* out);
// Parses and validates magic, version, header checksum and lengths. Corruption otherwise.
Status DecodeRecordHeader(std::span<const uint8_t> in, RecordHeader* h);
// Header + payload, unpadded.
inline size_t RecordBytes(const RecordHeader& h) { return kRecordHeaderBytes + h.stored_bytes; }
inline uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

uint64_t PayloadChecksum(std::span<const uint8_t> payload);

struct IndexEntry {
  Codec codec = Codec::kNone;
  uint8_t kind = 0;
  uint32_t segment = 0;
  uint64_t offset = 0;
  uint32_t record_bytes = 0;
  uint32_t raw_bytes = 0;
  uint64_t checksum = 0;  // the record's payload checksum, kept outside the record
  uint64_t tenant = 0;
  uint64_t created_unix_ms = 0;
  uint64_t last_access_unix_ms = 0;
  uint64_t hit_count = 0;
  uint64_t seq = 0;
  uint64_t version = 0;  // TierManager's put version (orders puts across restarts)
  uint64_t expires_unix_ms = 0;
  uint64_t parent_id = 0;
  uint32_t recompute_tokens = 0;
};

std::string EncodeIndexEntry(const IndexEntry& e);
Status DecodeIndexEntry(std::span<const uint8_t> in, IndexEntry* e);

// Segment ids are 32-bit and only grow; the tier stops preparing segments after the last one
// (docs/format/ssd.md, "Segment files").
inline constexpr uint32_t kSegmentIdMax = UINT32_MAX;

// Segment file name for an id: "seg-" and the id in decimal, zero-padded to eight digits (nine
// or ten above 99,999,999), then ".kvs". ParseSegmentName is true exactly for the names
// SegmentName gives (one name per id), and sets *id.
std::string SegmentName(uint32_t id);
bool ParseSegmentName(const std::string& name, uint32_t* id);

}  // namespace kvtier::storage::ssd
