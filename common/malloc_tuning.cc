#include "common/malloc_tuning.h"

#include <malloc.h>

#include <cstdlib>
#include <string_view>

#include "common/sanitizers.h"

namespace kvtier {

bool TuneMallocForServer() {
  if (kSanitizerAllocator) return false;  // not glibc's allocator: it takes no mallopt settings
  if (const char* env = std::getenv("GLIBC_TUNABLES");
      env != nullptr && std::string_view(env).find("glibc.malloc.") != std::string_view::npos) {
    return false;
  }
  // mallopt returns 1 on success. Setting either one turns glibc's adaptation of both off.
  return ::mallopt(M_MMAP_THRESHOLD, static_cast<int>(kMallocMmapThresholdBytes)) == 1 &&
         ::mallopt(M_TRIM_THRESHOLD, static_cast<int>(kMallocTrimThresholdBytes)) == 1;
}

}  // namespace kvtier
