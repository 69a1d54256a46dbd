// KVTIER_REQUIRE_CUDA=1 turns the CUDA tests' "no device, skipped" into a failure. The GPU check
// (deploy/gpu/check.sh) sets it, so a machine whose device or driver the tests cannot use
// reports a failure instead of a run of skips that reads like a pass. Unset (the default, and
// on every machine without a GPU) the CUDA tests skip as before.
#pragma once

#include <cstdlib>
#include <cstring>

namespace kvtier::testing {

inline bool CudaRequired() {
  const char* env = std::getenv("KVTIER_REQUIRE_CUDA");
  return env != nullptr && std::strcmp(env, "1") == 0;
}

}  // namespace kvtier::testing
