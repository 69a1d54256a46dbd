// libFuzzer target: the SSD tier's on-disk formats (storage/ssd_format.h) on arbitrary bytes: the
// 128-byte record header read back from a segment, the 104-byte index entry read from RocksDB,
// and segment file names listed from the segments directory.
//
// Input: one mode byte, then the bytes. Mode bit 0 set: the header's and the entry's own XXH32
// are recomputed over the input before decoding, so that the fields behind the checksums are
// reached (a random input almost never has a valid one).
//
// Invariants, beyond no crash, no out-of-bounds access (ASan) and no undefined behaviour (UBSan):
//   - a decoded header or entry is canonical: encoding what was decoded gives the input's bytes
//     back (every byte means something; reserved bytes are zero), its codec is known, and a
//     codec-0 header has equal stored and raw lengths;
//   - an index entry's record length covers at least a record header;
//   - a name ParseSegmentName accepts is exactly SegmentName of the id it sets (one name per
//     id), and SegmentName of any id parses back to it.
//
//   cmake --preset fuzz && cmake --build --preset fuzz --target kvtier_ssd_format_fuzz
//   build/fuzz/tests/fuzz/kvtier_ssd_format_fuzz -max_total_time=60
#include <xxhash.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "common/endian.h"
#include "storage/ssd_format.h"
#include "tests/fuzz/fuzz_require.h"

namespace {

using kvtier::fuzz::Require;
namespace ssd = kvtier::storage::ssd;

void CheckHeader(std::vector<uint8_t> in, bool fix_checksum) {
  in.resize(ssd::kRecordHeaderBytes, 0);
  if (fix_checksum) kvtier::le::Put32(in.data() + 124, XXH32(in.data(), 124, 0));
  ssd::RecordHeader h;
  if (!ssd::DecodeRecordHeader(in, &h).ok()) return;
  Require(h.codec == ssd::Codec::kNone || h.codec == ssd::Codec::kZstd);
  Require(h.codec != ssd::Codec::kNone || h.stored_bytes == h.raw_bytes);
  uint8_t out[ssd::kRecordHeaderBytes];
  ssd::EncodeRecordHeader(h, out);
  Require(std::memcmp(out, in.data(), sizeof(out)) == 0);
}

void CheckEntry(std::vector<uint8_t> in, bool fix_checksum) {
  in.resize(ssd::kIndexEntryBytes, 0);
  if (fix_checksum) kvtier::le::Put32(in.data() + 100, XXH32(in.data(), 100, 0));
  ssd::IndexEntry e;
  if (!ssd::DecodeIndexEntry(in, &e).ok()) return;
  Require(e.codec == ssd::Codec::kNone || e.codec == ssd::Codec::kZstd);
  Require(e.record_bytes >= ssd::kRecordHeaderBytes);
  const std::string out = ssd::EncodeIndexEntry(e);
  Require(out.size() == in.size() && std::memcmp(out.data(), in.data(), in.size()) == 0);
}

void CheckName(const std::string& name, uint32_t some_id) {
  uint32_t id = 0;
  if (ssd::ParseSegmentName(name, &id)) Require(ssd::SegmentName(id) == name);
  uint32_t back = 0;
  Require(ssd::ParseSegmentName(ssd::SegmentName(some_id), &back) && back == some_id);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool fix_checksum = (data[0] & 1) != 0;
  const std::vector<uint8_t> in(data + 1, data + size);
  CheckHeader(in, fix_checksum);
  CheckEntry(in, fix_checksum);
  uint32_t some_id = 0;
  std::memcpy(&some_id, in.data(), std::min<size_t>(in.size(), sizeof(some_id)));
  CheckName(std::string(in.begin(), in.begin() + std::min<size_t>(in.size(), 24)), some_id);
  return 0;
}
