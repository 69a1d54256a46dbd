#include "rdma/engram_table.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

#include "common/endian.h"

namespace kvtier::rdma {
namespace {

constexpr char kMagic[8] = {'K', 'V', 'T', 'E', 'N', 'G', 'R', 'M'};
constexpr uint32_t kVersion = 1;

using le::Get32;
using le::Get64;
using le::Put32;
using le::Put64;

// splitmix64: a fixed, portable generator for synthetic rows.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

std::string ErrnoText(const char* what, const std::string& path) {
  return std::string(what) + " " + path + ": " + std::strerror(errno);
}

}  // namespace

void EncodeEngramTableHeader(const EngramTableHeader& h, uint8_t out[kEngramTableHeaderBytes]) {
  std::memset(out, 0, kEngramTableHeaderBytes);
  std::memcpy(out, kMagic, sizeof(kMagic));
  Put32(out + 8, kVersion);
  Put32(out + 12, h.row_dim);
  Put64(out + 16, h.row_begin);
  Put64(out + 24, h.row_count);
  Put32(out + 32, h.row_stride_bytes);
  Put32(out + 36, h.layer_id);
  Put32(out + 40, kEngramTableHeaderBytes);
}

Status DecodeEngramTableHeader(std::span<const uint8_t> in, EngramTableHeader* out) {
  if (in.size() < kEngramTableHeaderBytes) return Status::Corruption("engram header truncated");
  if (std::memcmp(in.data(), kMagic, sizeof(kMagic)) != 0) {
    return Status::Corruption("not an engram table (bad magic)");
  }
  if (Get32(in.data() + 8) != kVersion) return Status::Corruption("unsupported table version");
  if (Get32(in.data() + 40) != kEngramTableHeaderBytes) {
    return Status::Corruption("unexpected header_bytes");
  }
  // Bytes 44..63 are zero in version 1 (a later version may use them: refusing them now keeps
  // one spelling per header, so such a file is never read as version 1 by mistake).
  for (size_t i = 44; i < kEngramTableHeaderBytes; ++i) {
    if (in[i] != 0) return Status::Corruption("engram header: reserved bytes are not zero");
  }
  EngramTableHeader h;
  h.row_dim = Get32(in.data() + 12);
  h.row_begin = Get64(in.data() + 16);
  h.row_count = Get64(in.data() + 24);
  h.row_stride_bytes = Get32(in.data() + 32);
  h.layer_id = Get32(in.data() + 36);
  if (h.row_dim == 0 || h.row_dim % kEngramScaleBlockElems != 0 || h.row_dim > kEngramRowDimMax) {
    return Status::InvalidArgument("row_dim must be a positive multiple of 32");
  }
  if (h.row_stride_bytes < EngramRowBytes(h.row_dim) ||
      h.row_stride_bytes > 2 * EngramRowBytes(kEngramRowDimMax)) {
    return Status::InvalidArgument("row_stride_bytes out of range for row_dim");
  }
  if (h.row_count == 0 || h.row_count > (uint64_t{1} << 40)) {
    return Status::InvalidArgument("row_count out of range");
  }
  if (h.row_begin > UINT64_MAX - h.row_count) {
    return Status::InvalidArgument("row_begin + row_count overflows a row number");
  }
  *out = h;
  return Status::Ok();
}

void FillSyntheticEngramRow(uint64_t seed, uint64_t row, uint32_t row_dim, uint8_t* out_row) {
  uint64_t state = Mix(seed ^ Mix(row));
  for (uint32_t i = 0; i < row_dim; i += 8) {
    state = Mix(state);
    for (uint32_t j = 0; j < 8 && i + j < row_dim; ++j) {
      uint8_t code = static_cast<uint8_t>(state >> (8 * j));
      if ((code & 0x7f) == 0x7f) code &= 0xfe;  // e4m3fn NaN -> the largest finite code
      out_row[i + j] = code;
    }
  }
  for (uint32_t b = 0; b < row_dim / kEngramScaleBlockElems; ++b) {
    state = Mix(state);
    out_row[row_dim + b] = static_cast<uint8_t>(120 + state % 15);
  }
}

Status GenerateEngramTable(const std::string& path, const EngramTableHeader& header,
                           uint64_t seed) {
  uint8_t hdr[kEngramTableHeaderBytes];
  EncodeEngramTableHeader(header, hdr);
  EngramTableHeader check;
  KVTIER_RETURN_IF_ERROR(DecodeEngramTableHeader(hdr, &check));
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return Status::IOError(ErrnoText("cannot create", path));
  bool ok = std::fwrite(hdr, 1, sizeof(hdr), f) == sizeof(hdr);
  constexpr uint64_t kRowsPerChunk = 4096;
  std::vector<uint8_t> chunk;
  for (uint64_t r = 0; ok && r < header.row_count; r += kRowsPerChunk) {
    const uint64_t n = std::min(kRowsPerChunk, header.row_count - r);
    chunk.assign(n * header.row_stride_bytes, 0);
    for (uint64_t i = 0; i < n; ++i) {
      FillSyntheticEngramRow(seed, header.row_begin + r + i, header.row_dim,
                             chunk.data() + i * header.row_stride_bytes);
    }
    ok = std::fwrite(chunk.data(), 1, chunk.size(), f) == chunk.size();
  }
  if (std::fclose(f) != 0) ok = false;
  if (!ok) return Status::IOError(ErrnoText("cannot write", path));
  return Status::Ok();
}

StatusOr<std::shared_ptr<const MappedTable>> MappedTable::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return Status::NotFound(ErrnoText("no table", path));
    return Status::IOError(ErrnoText("cannot open", path));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return Status::IOError(ErrnoText("cannot stat", path));
  }
  const size_t file_bytes = static_cast<size_t>(st.st_size);
  if (file_bytes < kEngramTableHeaderBytes) {
    ::close(fd);
    return Status::Corruption("table file shorter than its header: " + path);
  }
  void* map = ::mmap(nullptr, file_bytes, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);  // the mapping keeps the file referenced
  if (map == MAP_FAILED) return Status::IOError(ErrnoText("cannot mmap", path));
  std::shared_ptr<MappedTable> table(new MappedTable());
  table->map_ = map;
  table->map_bytes_ = file_bytes;
  const auto* bytes = static_cast<const uint8_t*>(map);
  Status st_header =
      DecodeEngramTableHeader(std::span<const uint8_t>(bytes, file_bytes), &table->header_);
  if (!st_header.ok()) return st_header.WithContext(path);
  const EngramTableHeader& h = table->header_;
  const uint64_t rows_bytes = h.row_count * h.row_stride_bytes;
  if (rows_bytes > file_bytes - kEngramTableHeaderBytes) {
    return Status::Corruption("table file shorter than row_count * row_stride_bytes: " + path);
  }
  table->rows_ = std::span<const uint8_t>(bytes + kEngramTableHeaderBytes, rows_bytes);
  // Row reads are random: tell the kernel not to read ahead.
  (void)::madvise(map, file_bytes, MADV_RANDOM);
  return std::shared_ptr<const MappedTable>(std::move(table));
}

MappedTable::~MappedTable() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

}  // namespace kvtier::rdma
