// `kvtier-engine serve`: the OpenAI-compatible server (docs/SERVING.md).
#pragma once

#include <span>
#include <string_view>

namespace kvtier::serving {

// Parses the flags, serves until SIGINT or SIGTERM. Exit codes: 0 clean stop, 1 failure,
// 2 bad usage.
int RunServe(std::span<const std::string_view> args);

}  // namespace kvtier::serving
