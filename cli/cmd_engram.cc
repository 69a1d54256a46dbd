// kvtier engram build: writes the engine's Engram tables as row-server table files.
//
//   kvtier engram build --model M.safetensors --config C.json --out DIR [--shards N]
//                       [--endpoints 127.0.0.1:7301,...] [--json]
//
// One file per Engram layer and shard (DIR/engram.l<layer>.s<k>.engram, rdma/engram_table.h)
// and DIR/shards.toml (the ShardMap, rdma/shard_map.h). Serve each file with
// RowServer::RegisterTable("engram.l<layer>.s<k>", path); engines connect with
// engine::RemoteEngramRowSource::ConnectTcp. See engine/engram_export.h.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "cli/commands.h"
#include "cli/flags.h"
#include "engine/config.h"
#include "engine/engram_export.h"
#include "engine/weights.h"

namespace kvtier::cli {
namespace {

int RunBuild(Args args) {
  FlagSet flags("kvtier engram build",
                "Write a model's Engram tables as row-server table files plus shards.toml.");
  std::string model, config, out, endpoints = "127.0.0.1:7301";
  uint64_t shards = 1;
  bool json = false;
  flags.String("model", &model, "FILE", "weights (.safetensors)", true);
  flags.String("config", &config, "FILE", "model config.json", true);
  flags.String("out", &out, "DIR", "output directory (created if missing)", true);
  flags.Uint("shards", &shards, "row-range shards per table (1..4096)");
  flags.String("endpoints", &endpoints, "LIST",
               "row server host:port list for shards.toml (shard k -> entry k mod n)");
  flags.Bool("json", &json, "print the written files as JSON");
  if (int rc = flags.Parse(args); rc >= 0) return rc;
  if (shards == 0 || shards > engine::kEngramExportShardsMax) {
    std::fprintf(stderr, "kvtier engram build: --shards must be in 1..%u\n",
                 engine::kEngramExportShardsMax);
    return 2;
  }
  auto cfg = engine::LoadEngineConfig(config);
  if (!cfg.ok()) {
    std::fprintf(stderr, "kvtier engram build: %s\n", cfg.status().ToString().c_str());
    return 1;
  }
  auto weights = engine::LoadWeights(*cfg, model);
  if (!weights.ok()) {
    std::fprintf(stderr, "kvtier engram build: %s\n", weights.status().ToString().c_str());
    return 1;
  }
  engine::EngramExportOptions o;
  o.out_dir = out;
  o.shards = static_cast<uint32_t>(shards);
  o.endpoints = SplitComma(endpoints);
  auto r = engine::ExportEngramTables(*cfg, *weights, o);
  if (!r.ok()) {
    std::fprintf(stderr, "kvtier engram build: %s\n", r.status().ToString().c_str());
    return 1;
  }
  if (json) {
    nlohmann::ordered_json j;
    j["shard_map"] = r->shard_map_path;
    j["files"] = nlohmann::ordered_json::array();
    for (const auto& f : r->files)
      j["files"].push_back({{"layer_id", f.layer_id},
                            {"region", f.region},
                            {"path", f.path},
                            {"row_begin", f.row_begin},
                            {"row_end", f.row_end},
                            {"bytes", f.bytes}});
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    for (const auto& f : r->files)
      std::printf("%s  rows [%llu, %llu)  %llu bytes  %s\n", f.region.c_str(),
                  static_cast<unsigned long long>(f.row_begin),
                  static_cast<unsigned long long>(f.row_end),
                  static_cast<unsigned long long>(f.bytes), f.path.c_str());
    std::printf("shard map: %s\n", r->shard_map_path.c_str());
  }
  return 0;
}

}  // namespace

int RunEngram(Args args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::printf(
        "usage: kvtier engram build --model M --config C --out DIR [--shards N]\n"
        "  build   write the Engram tables of a weights file as row-server table files\n");
    return args.empty() ? 2 : 0;
  }
  if (args[0] == "build") return RunBuild(args.subspan(1));
  std::fprintf(stderr, "kvtier engram: unknown subcommand '%.*s' (try build)\n",
               static_cast<int>(args[0].size()), args[0].data());
  return 2;
}

}  // namespace kvtier::cli
