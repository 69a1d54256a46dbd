// The C library's allocator, set up for a server whose requests allocate and free large
// transient buffers (kvtierd's replies over TCP, restored units, long prompts' bodies).
//
// glibc serves an allocation of M_MMAP_THRESHOLD bytes or more with a mapping of its own,
// unmapped when it is freed, and gives the free memory at the top of its heap back to the
// kernel once more than M_TRIM_THRESHOLD is free there. Both start low (128 KiB) and adapt
// only partly, so a server that receives megabytes per request maps, faults in and unmaps
// the same amount again for every request: restoring a 64K-token conversation over kvtierd's
// TCP front took about 2,200 page faults and 42 ms of the server's CPU, where the transfer
// itself takes a few (docs/performance/serving.md, "kvtierd over TCP and TLS").
// TuneMallocForServer keeps freed memory for reuse instead: the cost is that the process's
// resident memory stays near its peak (what the server's own limits bound) rather than
// falling after each burst.
#pragma once

#include <cstddef>

namespace kvtier {

// The largest M_MMAP_THRESHOLD glibc accepts on 64-bit (HEAP_MAX_SIZE / 2).
inline constexpr size_t kMallocMmapThresholdBytes = size_t{32} << 20;
inline constexpr size_t kMallocTrimThresholdBytes = size_t{256} << 20;

// Sets M_MMAP_THRESHOLD and M_TRIM_THRESHOLD to the constants above and returns true, unless
// the environment's GLIBC_TUNABLES sets any glibc.malloc tunable (the operator's choice then
// stands) or malloc is a sanitizer's allocator (common/sanitizers.h): then it changes nothing
// and returns false. Call it once at start, before the threads that allocate.
bool TuneMallocForServer();

}  // namespace kvtier
