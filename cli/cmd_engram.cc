// kvtier engram build: writes the engine's Engram tables as row-server table files.
//
//   kvtier engram build --model M.safetensors --config C.json --out DIR [--shards N]
//                       [--endpoints 127.0.0.1:7301,...] [--json]
//
// One file per Engram layer and shard (DIR/engram.l<layer>.s<k>.engram, rdma/engram_table.h)
// and DIR/shards.toml (the ShardMap, rdma/shard_map.h). Serve them with kvtierd's [engram]
// table (engram.dir = DIR; docs/CONFIG.md) or RowServer::RegisterTable("engram.l<layer>.s<k>",
// path); engines connect with engine::RemoteEngramRowSource::Connect.
//
// kvtier engram grant: asks a kvtierd that serves Engram tables for grants (ENGRAM_GRANT).
//
//   kvtier engram grant [--daemon ADDR] [--token T] [--region R ...] [--ttl-ms N]
//                       [--token-file F] [--print-tokens] [--json]
//
// Prints the row server endpoint, the tenant, and each region with its expiry. The grant
// tokens are secrets: they are written only to --token-file (JSON, mode 0600) and to stdout
// only with --print-tokens.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cache_daemon/client.h"
#include "cli/commands.h"
#include "cli/flags.h"
#include "common/host_port.h"
#include "common/json_text.h"
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
    std::printf("%s\n", JsonText(j, 2).c_str());
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

std::string Hex(const daemon::wire::EngramToken& t) {
  static const char* kDigits = "0123456789abcdef";
  std::string out;
  for (uint8_t b : t) {
    out += kDigits[b >> 4];
    out += kDigits[b & 15];
  }
  return out;
}

// Writes `text` to `path` with mode 0600 (also when the file existed). No symlink following.
bool WriteSecretFile(const std::string& path, const std::string& text) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return false;
  bool ok = ::fchmod(fd, 0600) == 0;
  size_t off = 0;
  while (ok && off < text.size()) {
    ssize_t n = ::write(fd, text.data() + off, text.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      ok = false;
    else
      off += static_cast<size_t>(n);
  }
  return ::close(fd) == 0 && ok;
}

int RunGrant(Args args) {
  // --region may repeat (FlagSet keeps one value per flag): collect every occurrence first.
  std::vector<std::string> regions;
  std::vector<std::string_view> rest;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string_view a = args[i];
    if (a == "--region" && i + 1 < args.size()) {
      for (auto& r : SplitComma(args[++i])) regions.push_back(r);
    } else if (a.starts_with("--region=")) {
      for (auto& r : SplitComma(a.substr(9))) regions.push_back(r);
    } else {
      rest.push_back(a);
    }
  }
  FlagSet flags("kvtier engram grant",
                "Ask a kvtierd serving Engram tables for read grants (tokens are secrets).");
  std::string addr = daemon::DefaultSocketPath(), token, token_file, unused_region;
  uint64_t ttl_ms = 0;
  bool print_tokens = false, json = false;
  flags.String("daemon", &addr, "ADDR",
               "kvtierd native endpoint: a Unix socket path, or host:port for native TCP");
  flags.String("token", &token, "TOKEN", "kvtierd auth token (default: $KVTIER_TOKEN)");
  flags.String("region", &unused_region, "R",
               "region to grant (repeatable or comma-separated; default: every served region)");
  flags.Uint("ttl-ms", &ttl_ms, "grant lifetime in ms (0: the daemon's engram.grant_ttl_ms)");
  flags.String("token-file", &token_file, "F",
               "write endpoint, tenant, shards.toml and the tokens as JSON here (mode 0600)");
  flags.Bool("print-tokens", &print_tokens, "also print the secret tokens to stdout");
  flags.Bool("json", &json, "print JSON instead of text");
  if (int rc = flags.Parse(rest); rc >= 0) return rc;

  daemon::ClientOptions o;
  o.shm_bytes = 0;
  if (addr.find('/') == std::string::npos && addr.find(':') != std::string::npos) {
    StatusOr<HostPort> hp = ParseHostPort(addr);
    if (!hp.ok()) {
      std::fprintf(stderr, "kvtier engram grant: --daemon: %s\n", hp.status().message().c_str());
      return 2;
    }
    o.tcp_host = hp->host;
    o.tcp_port = hp->port;
  } else {
    o.socket_path = addr;
  }
  o.token = token;
  if (o.token.empty()) {
    if (const char* t = std::getenv("KVTIER_TOKEN")) o.token = t;
  }
  auto c = daemon::Client::Connect(o);
  if (!c.ok()) {
    std::fprintf(stderr, "kvtier engram grant: %s\n", c.status().ToString().c_str());
    return 1;
  }
  auto g = (*c)->EngramGrant(regions, ttl_ms);
  if (!g.ok()) {
    std::fprintf(stderr, "kvtier engram grant: %s\n", g.status().ToString().c_str());
    return 1;
  }
  auto to_json = [&](bool with_tokens) {
    nlohmann::ordered_json j;
    j["endpoint"] = g->endpoint;
    j["tenant"] = g->tenant;
    j["ttl_ms"] = g->ttl_ms;
    j["regions"] = nlohmann::ordered_json::array();
    for (const auto& r : g->regions) {
      nlohmann::ordered_json e = {{"name", r.name}, {"expires_unix_ms", r.expires_unix_ms}};
      if (with_tokens) e["token"] = Hex(r.token);
      j["regions"].push_back(e);
    }
    if (with_tokens) j["shards_toml"] = g->shards_toml;
    return j;
  };
  if (!token_file.empty() && !WriteSecretFile(token_file, JsonText(to_json(true), 2) + "\n")) {
    std::fprintf(stderr, "kvtier engram grant: cannot write %s: %s\n", token_file.c_str(),
                 std::strerror(errno));
    return 1;
  }
  if (json) {
    std::printf("%s\n", JsonText(to_json(print_tokens), 2).c_str());
    return 0;
  }
  std::printf("endpoint %s  tenant %s  ttl %llu ms\n", g->endpoint.c_str(), g->tenant.c_str(),
              static_cast<unsigned long long>(g->ttl_ms));
  for (const auto& r : g->regions) {
    std::printf("%s  expires_unix_ms %llu%s%s\n", r.name.c_str(),
                static_cast<unsigned long long>(r.expires_unix_ms), print_tokens ? "  token " : "",
                print_tokens ? Hex(r.token).c_str() : "");
  }
  if (!token_file.empty()) std::printf("tokens written to %s (mode 0600)\n", token_file.c_str());
  return 0;
}

}  // namespace

int RunEngram(Args args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::printf(
        "usage: kvtier engram build --model M --config C --out DIR [--shards N]\n"
        "       kvtier engram grant [--daemon ADDR] [--region R ...] [--ttl-ms N]\n"
        "                           [--token-file F] [--print-tokens] [--json]\n"
        "  build   write the Engram tables of a weights file as row-server table files\n"
        "  grant   ask a kvtierd serving Engram tables ([engram]) for read grants; tokens go\n"
        "          only to --token-file (0600), or stdout with --print-tokens\n");
    return args.empty() ? 2 : 0;
  }
  if (args[0] == "build") return RunBuild(args.subspan(1));
  if (args[0] == "grant") return RunGrant(args.subspan(1));
  std::fprintf(stderr, "kvtier engram: unknown subcommand '%.*s' (try build or grant)\n",
               static_cast<int>(args[0].size()), args[0].data());
  return 2;
}

}  // namespace kvtier::cli
