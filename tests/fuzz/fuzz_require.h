// The libFuzzer targets' invariant check: a broken invariant aborts, which libFuzzer reports as
// a crash and saves the input that broke it.
#pragma once

#include <cstdlib>

namespace kvtier::fuzz {

inline void Require(bool ok) {
  if (!ok) std::abort();
}

}  // namespace kvtier::fuzz
