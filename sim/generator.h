// A generator of multi-day agent workloads in the Mooncake trace format (`kvtier sim gen`).
// No public trace with block hashes spans more than about two hours, so the 72-hour long tail
// of KV reuse comes from this documented, parameterised model (docs/POLICIES.md):
//
//  * `sessions` agent sessions start uniformly over `days` days. Each picks one of
//    `system_prompts` shared system prompts (Zipf(prompt_zipf) popularity; each prompt is
//    1..2*system_prompt_blocks blocks), so sessions share their root blocks.
//  * A session runs Geometric(mean_turns) turns. Turn 1 adds Geometric(first_turn_blocks)
//    user-context blocks; each later turn adds the previous answer plus Geometric(turn_blocks)
//    new user blocks, and with probability tool_prob a tool output of
//    Geometric(tool_blocks) blocks.
//  * The gap before each resumed turn is drawn from a mixture: minutes (p_minutes,
//    log-normal, median minutes_median_s), hours (p_hours, median hours_median_s), days
//    (the rest, median days_median_s), all truncated at max_gap_hours (72 h by default).
//  * Like Mooncake, a request's last block is partial (1..block_tokens-1 tokens) and gets a
//    fresh id; the next turn's copy of it is a new full block, so ids are prefix-chained.
//
// Deterministic: the same options (seed included) give byte-identical output. Own RNG and
// distributions (splitmix64, Box-Muller), not <random>'s implementation-defined ones.
// Limits: at most max_requests requests (InvalidArgument beyond).
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"

namespace kvtier::sim {

struct GeneratorOptions {
  uint64_t seed = 1;
  double days = 3.0;
  uint64_t sessions = 3000;
  uint64_t system_prompts = 8;
  double system_prompt_blocks = 6;
  double prompt_zipf = 1.0;
  double mean_turns = 6;
  double first_turn_blocks = 4;
  double turn_blocks = 2;
  double tool_prob = 0.4;
  double tool_blocks = 4;
  double p_minutes = 0.6;
  double p_hours = 0.3;
  double minutes_median_s = 120;
  double hours_median_s = 2 * 3600;
  double days_median_s = 20 * 3600;
  double max_gap_hours = 72;
  uint32_t block_tokens = 512;
  double output_tokens = 300;
  uint64_t max_requests = 2000000;
};

struct GeneratedTrace {
  std::string jsonl;  // Mooncake JSON Lines, sorted by timestamp
  uint64_t requests = 0;
  uint64_t blocks = 0;  // distinct hash ids
};

// InvalidArgument for out-of-range options (negative probabilities, p_minutes + p_hours > 1,
// zero block size, too many requests).
StatusOr<GeneratedTrace> GenerateAgentTrace(const GeneratorOptions& options);

}  // namespace kvtier::sim
