// AgentText: deterministic agent-like byte-tokenizer text (shell commands, tool output, code,
// user turns, log lines) for the demo's sessions and the resume benchmark, so that both run
// the trained miniature on text of the kind it was trained on rather than random bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvtier::engine {

// n token ids (byte + 3, the byte tokenizer's ids): whole lines picked by a generator seeded
// with `seed`, the last one cut at n. Same (seed, n): same tokens, on every machine.
std::vector<int32_t> AgentText(uint64_t seed, size_t n);

}  // namespace kvtier::engine
