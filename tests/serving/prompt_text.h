// Test helper: deterministic printable prompt text for the serving tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace kvtier::testing {

// `n` bytes of words drawn by a fixed LCG from `seed` (same seed, same text).
inline std::string PromptText(size_t n, uint32_t seed) {
  static const char kWords[][8] = {"the ", "cache ", "tier ", "page ",  "unit ",
                                   "hit ", "of ",    "a ",    "token ", "kv "};
  std::string s;
  uint32_t x = seed * 2654435761u + 1;
  while (s.size() < n) {
    x = x * 1664525u + 1013904223u;
    s += kWords[(x >> 16) % 10];
  }
  s.resize(n);
  return s;
}

}  // namespace kvtier::testing
