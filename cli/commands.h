// The `kvtier` subcommands. Each takes its arguments (after the subcommand name) and returns
// the process exit code: 0 success, 1 failure, 2 bad usage. Each lives in cmd_<name>.cc.
#pragma once

#include <span>
#include <string_view>

namespace kvtier::cli {

using Args = std::span<const std::string_view>;

int RunLayout(Args args);  // cmd_layout.cc
int RunDemo(Args args);    // cmd_demo.cc

}  // namespace kvtier::cli
