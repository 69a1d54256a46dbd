// ShardMap: which row server holds which rows of one Engram table.
//
// A table of N rows is split into contiguous row ranges [row_begin, row_end), each served by
// one row server endpoint as one region (a table file whose header has the same row_begin).
// The ranges must be sorted, non-overlapping and cover [0, N) without gaps.
//
// Configuration (TOML; one array of tables per Engram table):
//
//   [[engram.l1.shard]]
//   region = "engram.l1.s0"        # region name on that server (RowServer::RegisterTable)
//   endpoint = "127.0.0.1:7301"    # host:port ([v6]:port for IPv6)
//   row_begin = 0
//   row_end = 49152                # exclusive
//
// Thread safety: immutable after creation; safe to share.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace kvtier::rdma {

struct ShardSpec {
  uint64_t row_begin = 0;
  uint64_t row_end = 0;  // exclusive
  std::string host;
  uint16_t port = 0;
  std::string region_name;
};

class ShardMap {
 public:
  // A limit on shards per table (a config with more is InvalidArgument).
  static constexpr size_t kShardsMax = 4096;

  // InvalidArgument for empty, unsorted, overlapping or gapped ranges, or a bad endpoint.
  static StatusOr<ShardMap> Create(std::vector<ShardSpec> shards);
  // Parses the `[[<table_path>.shard]]` array of `toml_text` (see above). InvalidArgument on
  // a TOML syntax error or a missing/mistyped key, with the key in the message.
  static StatusOr<ShardMap> FromToml(std::string_view toml_text, std::string_view table_path);
  // "host:port" or "[v6]:port". InvalidArgument otherwise.
  static Status ParseEndpoint(std::string_view text, std::string* host, uint16_t* port);

  // Index of the shard holding `row`; NotFound when row >= row_count().
  StatusOr<size_t> ShardOf(uint64_t row) const;
  const std::vector<ShardSpec>& shards() const { return shards_; }
  uint64_t row_count() const { return shards_.empty() ? 0 : shards_.back().row_end; }

 private:
  std::vector<ShardSpec> shards_;
};

}  // namespace kvtier::rdma
