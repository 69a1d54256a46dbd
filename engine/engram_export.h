// Exports the engine's Engram tables (weights "layers.<l>.engram.table" FP8 e4m3 codes and
// "layers.<l>.engram.table_scale" ue8m0 scales) as row-server table files
// (rdma/engram_table.h), so RowServers can serve them to RemoteEngramRowSource.
//
//   <out_dir>/engram.l<layer>.s<k>.engram   one file per layer and shard (row range)
//   <out_dir>/shards.toml                   the ShardMap of every layer:
//       [[engram.l1.shard]]
//       region = "engram.l1.s0"      # also the file's stem: RegisterTable(region, file)
//       endpoint = "127.0.0.1:7301"
//       row_begin = 0
//       row_end = 49152
//
// A row of the file is the row's row_dim codes followed by its row_dim/32 scales (stride =
// rdma::EngramRowBytes(row_dim), no padding), byte-identical to the weights' rows. Shards
// split each table into `shards` contiguous ranges of near-equal size; shard k is assigned
// endpoints[k % endpoints.size()].
//
// Thread safety: a free function; writes only under out_dir.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/config.h"
#include "engine/weights.h"

namespace kvtier::engine {

// A limit on shards per table (rdma::ShardMap::kShardsMax).
inline constexpr uint32_t kEngramExportShardsMax = 4096;

struct EngramExportOptions {
  std::string out_dir;  // created if missing
  // Row ranges per table, 1..kEngramExportShardsMax (and at most the table's rows). Default 1.
  uint32_t shards = 1;
  // Endpoints written into shards.toml ("host:port"); default one loopback server.
  std::vector<std::string> endpoints = {"127.0.0.1:7301"};
};

struct EngramExportedFile {
  int layer_id = 0;
  std::string region;  // "engram.l<layer>.s<k>"
  std::string path;
  uint64_t row_begin = 0, row_end = 0;
  uint64_t bytes = 0;  // file size
};

struct EngramExportResult {
  std::vector<EngramExportedFile> files;
  std::string shard_map_path;  // <out_dir>/shards.toml
  std::string shard_map_toml;  // its content
};

// InvalidArgument for a config without Engram, missing/mis-shaped table tensors, bad shard
// count or endpoints; IOError when a file cannot be written.
StatusOr<EngramExportResult> ExportEngramTables(const EngineConfig& config,
                                                const ModelWeights& weights,
                                                const EngramExportOptions& options);

}  // namespace kvtier::engine
