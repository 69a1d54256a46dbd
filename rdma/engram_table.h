// Engram table files: the row data a RowServer memory-maps and serves read-only.
//
// A table file holds one shard (a contiguous row range) of one Engram layer's table:
//
//   offset 0   64-byte header (little-endian)
//     0  8  magic "KVTENGRM"
//     8  4  version (1)
//    12  4  row_dim: elements per row, a multiple of 32
//    16  8  row_begin: global row number of the file's first row
//    24  8  row_count
//    32  4  row_stride_bytes: >= EngramRowBytes(row_dim)
//    36  4  layer_id
//    40  4  header_bytes (64): where row 0 starts
//    44 20  zero
//   offset 64  row_count rows of row_stride_bytes each. A row is row_dim FP8 e4m3 codes,
//              then row_dim/32 ue8m0 scales (kernels::QuantFormat::kFp8Ue8m0x32, the
//              layout of kernels/quant.h with data and scales of one row adjacent), then
//              zero padding up to the stride.
//
// Offsets on the wire are relative to the first row (offset 64 in the file), so the row
// r of the table lives at (r - row_begin) * row_stride_bytes of the region.
//
// Thread safety: MappedTable is immutable after Open and safe to share across threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "common/status.h"

namespace kvtier::rdma {

inline constexpr size_t kEngramTableHeaderBytes = 64;
inline constexpr uint32_t kEngramScaleBlockElems = 32;
// A sanity ceiling for one row (the real model's rows are 256 elements, 264 bytes).
inline constexpr uint32_t kEngramRowDimMax = 1 << 14;

struct EngramTableHeader {
  uint32_t row_dim = 0;
  uint64_t row_begin = 0;
  uint64_t row_count = 0;
  uint32_t row_stride_bytes = 0;
  uint32_t layer_id = 0;
};

// Bytes of one unpadded row: row_dim codes + row_dim/32 scales.
constexpr uint32_t EngramRowBytes(uint32_t row_dim) {
  return row_dim + row_dim / kEngramScaleBlockElems;
}

void EncodeEngramTableHeader(const EngramTableHeader& h, uint8_t out[kEngramTableHeaderBytes]);
// Corruption for a bad magic/version/header size or a reserved byte (44..63) that is not zero,
// InvalidArgument for inconsistent fields (rows past the last uint64 row number included).
Status DecodeEngramTableHeader(std::span<const uint8_t> in, EngramTableHeader* out);

// Deterministic content of global row `row` (codes never NaN, scales in [120, 134]):
// what GenerateEngramTable writes; tests use it as the independent oracle.
void FillSyntheticEngramRow(uint64_t seed, uint64_t row, uint32_t row_dim, uint8_t* out_row);

// Writes a table file of synthetic rows (FillSyntheticEngramRow) at `path`, streaming (it
// never holds the table in memory). IOError on write failure.
Status GenerateEngramTable(const std::string& path, const EngramTableHeader& header, uint64_t seed);

// A table file mapped read-only (PROT_READ, MAP_SHARED). Unmapped by the destructor.
class MappedTable {
 public:
  // NotFound when the file is missing; Corruption when it is shorter than its header says.
  static StatusOr<std::shared_ptr<const MappedTable>> Open(const std::string& path);
  ~MappedTable();
  MappedTable(const MappedTable&) = delete;
  MappedTable& operator=(const MappedTable&) = delete;

  const EngramTableHeader& header() const { return header_; }
  // The rows (the region clients read): row_count * row_stride_bytes bytes.
  std::span<const uint8_t> rows() const { return rows_; }

 private:
  MappedTable() = default;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  EngramTableHeader header_;
  std::span<const uint8_t> rows_;
};

}  // namespace kvtier::rdma
