// Which sanitizer a test is built with (common/sanitizers.h detects it for gcc and clang
// alike). Tests whose figures measure the allocator or the process's memory read these to skip
// or to widen an allowance, and say why where they do.
#pragma once

#include "common/sanitizers.h"

#if defined(KVTIER_ASAN)
#define KVTIER_TEST_ASAN 1
#endif

#if defined(KVTIER_TSAN)
#define KVTIER_TEST_TSAN 1
#endif

// UBSan (CMake defines KVTIER_SANITIZE_UNDEFINED; neither compiler has a macro for it).
#if defined(KVTIER_SANITIZE_UNDEFINED)
#define KVTIER_TEST_UBSAN 1
#endif

// Tests that take every file descriptor from a server skip under UBSan: its vptr check opens a
// pipe to probe memory, and without one it reports every virtual call as made on an invalid
// object (seen on the fuzz preset: "object has invalid vptr" at a Clock and a shared_ptr's
// control block), a finding that is fatal in the ubsan and asan presets.
#if defined(KVTIER_TEST_UBSAN)
#define KVTIER_SKIP_WITHOUT_DESCRIPTORS_UNDER_UBSAN() \
  GTEST_SKIP() << "UBSan's vptr check needs a descriptor (a pipe) that this test takes away"
#else
#define KVTIER_SKIP_WITHOUT_DESCRIPTORS_UNDER_UBSAN() (void)0
#endif
