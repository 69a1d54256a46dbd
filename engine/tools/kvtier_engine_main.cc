// kvtier-engine: run the miniature DeepSeek-V4.1-Flash engine from the command line.
//
//   kvtier-engine init     --config C --seed S --out M.safetensors
//   kvtier-engine generate --model M --config C --prompt-file F --max-new N
//                          [--temperature T --top-p P --seed S --threads N --full]
//                          [--save-socket S --token T --save-interval N --no-hot-state
//                           --tokens-out F --engram-socket S]
//                          [--speculative --draft D.safetensors --draft-len N]
//   kvtier-engine resume   --model M --config C --socket S (--tokens-file F | --prompt-file F)
//                          [--max-new N --token T --guard auto|fetch|recompute
//                           --no-hot-state --replay-tokens N --json]
//   kvtier-engine bench    --model M --config C [--json --prompt-tokens N --decode-tokens N]
//   kvtier-engine fidelity --model M --config C --prompt-file F [--json --histories LIST
//                          --replay-tokens LIST --eval-tokens N --samples K --bos --threads N]
//
// Exit codes: 0 success, 1 failure, 2 bad usage.
//
// Each subcommand lives in cmd_<name>.cc (engine/tools/commands.h); serve in serving/.
#include <cstdio>
#include <string_view>
#include <vector>

#include "engine/tools/commands.h"
#include "serving/serve_command.h"

namespace kvtier::engine::tool {
namespace {

void PrintHelp(FILE* out) {
  std::fprintf(out,
               "usage: kvtier-engine <command> [flags]   (kvtier-engine <command> --help)\n\n"
               "  init       make deterministic weights for a config (safetensors)\n"
               "  generate   generate text from a prompt file (greedy or top-p sampling);\n"
               "             --save-socket saves the session's units to kvtierd\n"
               "  resume     resume a saved session from kvtierd and continue decoding\n"
               "  bench      prefill and decode tokens/s, prefill-to-decode cost ratio\n"
               "  fidelity   top-1 agreement and KL of exact restore and bounded replay vs\n"
               "             the uninterrupted session, on a text\n"
               "  serve      OpenAI-compatible HTTP server (docs/SERVING.md)\n");
}

}  // namespace
}  // namespace kvtier::engine::tool

int main(int argc, char** argv) {
  using namespace kvtier::engine::tool;
  if (argc < 2) {
    PrintHelp(stderr);
    return 2;
  }
  std::string_view cmd = argv[1];
  std::vector<std::string_view> args(argv + 2, argv + argc);
  if (cmd == "help" || cmd == "--help" || cmd == "-h") {
    PrintHelp(stdout);
    return 0;
  }
  if (cmd == "init") return RunInit(args);
  if (cmd == "generate") return RunGenerate(args);
  if (cmd == "resume") return RunResume(args);
  if (cmd == "bench") return RunBench(args);
  if (cmd == "fidelity") return RunFidelity(args);
  if (cmd == "serve") return kvtier::serving::RunServe(args);
  std::fprintf(stderr, "kvtier-engine: unknown command '%.*s'\n\n", static_cast<int>(cmd.size()),
               cmd.data());
  PrintHelp(stderr);
  return 2;
}
