// libFuzzer target: the Engram shard map (rdma/shard_map.h) on arbitrary TOML text. A shards.toml
// is written by `kvtier engram build` and then edited by hand (endpoints moved, shards split),
// and both kvtierd's [engram] dir and the engine's remote Engram read it.
//
// Invariants, beyond no crash, no out-of-bounds access (ASan) and no undefined behaviour (UBSan):
//   - an accepted map's shards are sorted, contiguous from row 0 and non-empty, at most
//     kShardsMax of them, each with a port and a region name;
//   - ShardOf finds the shard holding each shard's first and last row, and NotFound at
//     row_count();
//   - ParseEndpoint accepts only what names a host and a non-zero port.
//
//   cmake --preset fuzz && cmake --build --preset fuzz --target kvtier_shard_map_fuzz
//   build/fuzz/tests/fuzz/kvtier_shard_map_fuzz -max_total_time=60
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "rdma/shard_map.h"
#include "tests/fuzz/fuzz_require.h"

namespace {

using kvtier::fuzz::Require;

using kvtier::rdma::ShardMap;

void CheckMap(const ShardMap& m) {
  const auto& shards = m.shards();
  Require(!shards.empty() && shards.size() <= ShardMap::kShardsMax);
  uint64_t next = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    const auto& s = shards[i];
    Require(s.row_begin == next && s.row_end > s.row_begin);
    Require(s.port != 0 && !s.host.empty() && !s.region_name.empty());
    next = s.row_end;
    auto first = m.ShardOf(s.row_begin), last = m.ShardOf(s.row_end - 1);
    Require(first.ok() && *first == i && last.ok() && *last == i);
  }
  Require(m.row_count() == next);
  Require(m.ShardOf(next).status().IsNotFound());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto map = ShardMap::FromToml(text, "engram.l1");
  if (map.ok()) CheckMap(*map);
  std::string host;
  uint16_t port = 0;
  if (ShardMap::ParseEndpoint(text.substr(0, 64), &host, &port).ok()) {
    Require(!host.empty() && port != 0);
  }
  return 0;
}
