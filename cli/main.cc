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
    {"demo", "the end-to-end scenario on the embedded default", kvtier::cli::RunDemo},
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
