#include "engine/engram_export.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>

#include "rdma/engram_table.h"
#include "rdma/shard_map.h"

namespace kvtier::engine {

namespace {

struct FileCloser {
  void operator()(FILE* f) const {
    if (f != nullptr) std::fclose(f);
  }
};

Status WriteTableFile(const std::string& path, const rdma::EngramTableHeader& h,
                      const uint8_t* codes, const uint8_t* scales) {
  std::unique_ptr<FILE, FileCloser> f(std::fopen(path.c_str(), "wb"));
  if (f == nullptr) return Status::IOError("engram export: cannot create " + path);
  uint8_t header[rdma::kEngramTableHeaderBytes];
  rdma::EncodeEngramTableHeader(h, header);
  if (std::fwrite(header, 1, sizeof(header), f.get()) != sizeof(header))
    return Status::IOError("engram export: write failed: " + path);
  const size_t rd = h.row_dim, sd = h.row_dim / rdma::kEngramScaleBlockElems;
  // Rows are assembled in chunks (bounded memory) and written sequentially.
  constexpr size_t kChunkRows = 8192;
  std::vector<uint8_t> buf(kChunkRows * h.row_stride_bytes, 0);
  for (uint64_t r = 0; r < h.row_count; r += kChunkRows) {
    const size_t m = static_cast<size_t>(std::min<uint64_t>(kChunkRows, h.row_count - r));
    for (size_t i = 0; i < m; ++i) {
      const uint64_t g = h.row_begin + r + i;
      uint8_t* dst = buf.data() + i * h.row_stride_bytes;
      std::memcpy(dst, codes + g * rd, rd);
      std::memcpy(dst + rd, scales + g * sd, sd);
    }
    const size_t bytes = m * h.row_stride_bytes;
    if (std::fwrite(buf.data(), 1, bytes, f.get()) != bytes)
      return Status::IOError("engram export: write failed: " + path);
  }
  if (std::fflush(f.get()) != 0) return Status::IOError("engram export: flush failed: " + path);
  return Status::Ok();
}

}  // namespace

StatusOr<EngramExportResult> ExportEngramTables(const EngineConfig& config,
                                                const ModelWeights& weights,
                                                const EngramExportOptions& options) {
  if (config.engram_layer_ids.empty())
    return Status::InvalidArgument("engram export: the config has no Engram layers");
  const int row_dim = config.engram_head_dim;
  if (row_dim <= 0 || row_dim % 32 != 0 || static_cast<uint32_t>(row_dim) > rdma::kEngramRowDimMax)
    return Status::InvalidArgument("engram export: engram_head_dim must be a multiple of 32");
  if (options.shards == 0 || options.shards > kEngramExportShardsMax)
    return Status::InvalidArgument("engram export: shards must be in 1..4096");
  if (options.endpoints.empty())
    return Status::InvalidArgument("engram export: at least one endpoint is needed");
  for (const std::string& e : options.endpoints) {
    std::string host;
    uint16_t port = 0;
    KVTIER_RETURN_IF_ERROR(rdma::ShardMap::ParseEndpoint(e, &host, &port));
  }
  std::error_code ec;
  std::filesystem::create_directories(options.out_dir, ec);
  if (ec) return Status::IOError("engram export: cannot create " + options.out_dir);

  EngramExportResult result;
  std::string toml = "# Engram table shards written by `kvtier engram build` (rdma/shard_map.h).\n";
  const size_t sd = static_cast<size_t>(row_dim) / 32;
  for (int layer : config.engram_layer_ids) {
    const std::string prefix = "layers." + std::to_string(layer) + ".engram.";
    const Tensor* d = weights.Find(prefix + "table");
    const Tensor* s = weights.Find(prefix + "table_scale");
    if (d == nullptr || s == nullptr || d->shape.size() != 2 || d->shape[0] <= 0 ||
        d->shape[1] != row_dim ||
        d->bytes.size() != static_cast<size_t>(d->shape[0]) * static_cast<size_t>(row_dim) ||
        s->bytes.size() != static_cast<size_t>(d->shape[0]) * sd)
      return Status::InvalidArgument("engram export: missing or mis-shaped table of layer " +
                                     std::to_string(layer));
    const uint64_t rows = static_cast<uint64_t>(d->shape[0]);
    if (options.shards > rows)
      return Status::InvalidArgument("engram export: more shards than table rows");
    for (uint32_t k = 0; k < options.shards; ++k) {
      EngramExportedFile file;
      file.layer_id = layer;
      file.region = "engram.l" + std::to_string(layer) + ".s" + std::to_string(k);
      file.path = options.out_dir + "/" + file.region + ".engram";
      file.row_begin = rows * k / options.shards;
      file.row_end = rows * (k + 1) / options.shards;
      rdma::EngramTableHeader h;
      h.row_dim = static_cast<uint32_t>(row_dim);
      h.row_begin = file.row_begin;
      h.row_count = file.row_end - file.row_begin;
      h.row_stride_bytes = rdma::EngramRowBytes(h.row_dim);
      h.layer_id = static_cast<uint32_t>(layer);
      KVTIER_RETURN_IF_ERROR(WriteTableFile(file.path, h, d->bytes.data(), s->bytes.data()));
      file.bytes = rdma::kEngramTableHeaderBytes + h.row_count * h.row_stride_bytes;
      toml += "\n[[engram.l" + std::to_string(layer) + ".shard]]\n";
      toml += "region = \"" + file.region + "\"\n";
      toml += "endpoint = \"" + options.endpoints[k % options.endpoints.size()] + "\"\n";
      toml += "row_begin = " + std::to_string(file.row_begin) + "\n";
      toml += "row_end = " + std::to_string(file.row_end) + "\n";
      result.files.push_back(std::move(file));
    }
  }
  result.shard_map_path = options.out_dir + "/shards.toml";
  {
    std::unique_ptr<FILE, FileCloser> f(std::fopen(result.shard_map_path.c_str(), "wb"));
    if (f == nullptr || std::fwrite(toml.data(), 1, toml.size(), f.get()) != toml.size() ||
        std::fflush(f.get()) != 0)
      return Status::IOError("engram export: cannot write " + result.shard_map_path);
  }
  // The map must parse back as the engine will read it.
  for (int layer : config.engram_layer_ids) {
    KVTIER_RETURN_IF_ERROR(
        rdma::ShardMap::FromToml(toml, "engram.l" + std::to_string(layer)).status());
  }
  result.shard_map_toml = std::move(toml);
  return result;
}

}  // namespace kvtier::engine
