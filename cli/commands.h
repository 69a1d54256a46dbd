// The `kvtier` subcommands. Each takes its arguments (after the subcommand name) and returns
// the process exit code: 0 success, 1 failure, 2 bad usage. Each lives in cmd_<name>.cc.
#pragma once

#include <span>
#include <string_view>

namespace kvtier::cli {

using Args = std::span<const std::string_view>;

int RunLayout(Args args);     // cmd_layout.cc
int RunDemo(Args args);       // cmd_demo.cc: the agent-resume scenario (make demo)
int RunCodecDemo(Args args);  // cmd_codec_demo.cc: layouts + one unit through the codec
int RunBench(Args args);      // cmd_bench.cc: `bench storage`, dispatches on <what>
int BenchEngram(Args args);   // cmd_bench_engram.cc: `bench engram`
int RunSim(Args args);        // cmd_sim.cc
int RunEngram(Args args);     // cmd_engram.cc: `engram build`, `engram grant`
int RunCluster(Args args);    // cmd_cluster.cc: `cluster status` (reads etcd)
// cmd_client.cc: against a running kvtierd, through the client library.
int RunStats(Args args);
int RunLookup(Args args);
int RunPutFile(Args args);
int RunGetFile(Args args);
int RunPolicy(Args args);
int RunDrain(Args args);

}  // namespace kvtier::cli
