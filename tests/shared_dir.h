// Where tests find the shared reference data (../shared: vectors, traces).
// KVTIER_SHARED_DIR overrides the build-time default (the checkout's ../shared), so other
// vector files of the same format can be substituted.
#pragma once

#include <cstdlib>
#include <string>

namespace kvtier::testing {

inline std::string SharedDir() {
  if (const char* env = std::getenv("KVTIER_SHARED_DIR"); env != nullptr && *env != '\0') {
    return env;
  }
#ifdef KVTIER_DEFAULT_SHARED_DIR
  return KVTIER_DEFAULT_SHARED_DIR;
#else
  return "../shared";
#endif
}

// SharedDir() + "/" + relative.
inline std::string SharedPath(const std::string& relative) { return SharedDir() + "/" + relative; }

}  // namespace kvtier::testing
