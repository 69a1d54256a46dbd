#include "common/malloc_tuning.h"

#include <malloc.h>

#include <cstdlib>
#include <string_view>

#include "common/sanitizers.h"

namespace kvtier {

MallocTuning TuneMallocForServer() {
  MallocTuning t;
  if (kSanitizerAllocator) return t;  // not glibc's allocator: it takes no mallopt settings
  if (const char* env = std::getenv("GLIBC_TUNABLES");
      env != nullptr && std::string_view(env).find("glibc.malloc.") != std::string_view::npos) {
    return t;
  }
  // mallopt returns 1 on success. The mmap threshold is set first: setting either one turns
  // glibc's adaptation of both off.
  if (::mallopt(M_MMAP_THRESHOLD, static_cast<int>(kMallocMmapThresholdBytes)) != 1 ||
      ::mallopt(M_TRIM_THRESHOLD, static_cast<int>(kMallocTrimThresholdBytes)) != 1) {
    return t;
  }
  t.applied = true;
  t.mmap_threshold_bytes = kMallocMmapThresholdBytes;
  t.trim_threshold_bytes = kMallocTrimThresholdBytes;
  return t;
}

}  // namespace kvtier
