// kvtier: the operator's command line. `kvtier help` lists the subcommands.
#include <cstdio>
#include <string_view>
#include <vector>

#include "cli/commands.h"

namespace {

struct Command {
  const char* name;
  const char* summary;
  int (*run)(kvtier::cli::Args);
};

// One row per subcommand, in the order `kvtier help` prints them.
constexpr Command kCommands[] = {
    {"layout", "global-KV bytes per token and per unit for a model config", kvtier::cli::RunLayout},
    {"demo", "agent session: save to kvtierd, restart it, resume from SSD vs recompute",
     kvtier::cli::RunDemo},
    {"codec-demo", "layouts of the shipped models and one unit through the FP4 codec",
     kvtier::cli::RunCodecDemo},
    {"bench", "benchmarks vs a peer or physical limit: `bench storage`, `bench engram`",
     kvtier::cli::RunBench},
    {"engram",
     "`engram build`: write Engram tables as row-server files; `engram grant`: get grants "
     "from kvtierd",
     kvtier::cli::RunEngram},
    {"stats", "tier occupancy, hits and misses of a running kvtierd", kvtier::cli::RunStats},
    {"lookup", "longest cached prefix of a key chain in kvtierd", kvtier::cli::RunLookup},
    {"put-file", "store a file in kvtierd as a chain of units (smoke test)",
     kvtier::cli::RunPutFile},
    {"get-file", "read back and verify a file stored by put-file", kvtier::cli::RunGetFile},
    {"policy", "get or switch kvtierd's live eviction/admission policy", kvtier::cli::RunPolicy},
    {"cluster",
     "`cluster status`: members, health, shares, repair; `cluster drain NODE`; `cluster where`: "
     "who holds a unit",
     kvtier::cli::RunCluster},
    {"drain", "flush kvtierd and mark it not ready (--shutdown stops it)", kvtier::cli::RunDrain},
    {"sim", "replay a trace through eviction/admission policies; `sim gen` makes one",
     kvtier::cli::RunSim},
};

void PrintHelp(FILE* out) {
  std::fprintf(out, "usage: kvtier <command> [flags]   (kvtier <command> --help for flags)\n\n");
  for (const Command& c : kCommands) std::fprintf(out, "  %-12s %s\n", c.name, c.summary);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    PrintHelp(stderr);
    return 2;
  }
  std::string_view name = argv[1];
  if (name == "help" || name == "--help" || name == "-h") {
    PrintHelp(stdout);
    return 0;
  }
  std::vector<std::string_view> args(argv + 2, argv + argc);
  for (const Command& c : kCommands) {
    if (name == c.name) return c.run(args);
  }
  std::fprintf(stderr, "kvtier: unknown command '%.*s'\n\n", static_cast<int>(name.size()),
               name.data());
  PrintHelp(stderr);
  return 2;
}
